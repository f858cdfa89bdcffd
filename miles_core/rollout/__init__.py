"""Rollout: prompts, generation through engines, rewards, and conversion to training data."""
