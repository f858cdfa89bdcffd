"""Test kit: workers and helpers that tests of Miles and of its plugins share."""
