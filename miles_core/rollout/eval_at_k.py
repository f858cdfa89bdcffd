"""Eval at k (``--rollout-eval-samples K``): each held-out prompt sampled K times besides its greedy answer.

``eval/pass@K`` is the fraction of prompts of which at least one of the K samples passes: its reward is at least
``--rollout-eval-pass-threshold``, or above 0 when none is set. With exactly K samples per prompt this is also the
unbiased pass@K estimate of Chen et al. (2021) with n = k. ``eval/mean@K`` is the mean reward of all the samples.
The samples' seeds are a function of the run's seed, the prompt's index and the sample's index alone, so every eval
of a run (and a resumed run's) draws with the same seeds: evals differ by the weights, not by the dice.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence


def eval_seed(run_seed: int, prompt: int, k: int) -> int:
    """The seed of sample ``k`` of eval prompt ``prompt``: a seeded draw, apart from the training samples' seeds."""
    return random.Random(f"{run_seed}/eval/{prompt}/{k}").getrandbits(48)


def passes(reward: float, threshold: float | None) -> bool:
    """Whether a sample of ``reward`` passes: at least ``threshold``, or above 0 when it is ``None``."""
    return reward > 0.0 if threshold is None else reward >= threshold


def at_k_stats(rewards: Sequence[Sequence[float]], *, k: int, threshold: float | None) -> dict[str, float]:
    """``eval/pass@K`` and ``eval/mean@K`` of ``rewards``: the rewards of each prompt's samples (``k`` of them; more
    when an agent branched)."""
    if not rewards or not all(rewards):
        raise ValueError("at_k_stats needs the rewards of at least one sample of each of at least one prompt")
    solved = [any(passes(reward, threshold) for reward in per_prompt) for per_prompt in rewards]
    return {
        f"eval/pass@{k}": sum(solved) / len(solved),
        f"eval/mean@{k}": statistics.fmean(reward for per_prompt in rewards for reward in per_prompt),
    }
