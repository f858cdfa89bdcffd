"""OPO's optimal baseline (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline"): the baseline of a group is
its rewards' mean weighted by response length, ``b = sum(l_i * r_i) / sum(l_i)``, which minimises the gradient's
variance when each token's score is of the same size; the advantage is ``r_i - b``, the same for every token of a
sample. ``scale`` multiplies it (a setting, to show how an estimator declares and checks its own)."""

from __future__ import annotations

from collections.abc import Sequence

import pydantic

from miles_core import AdvantageEstimator, AlgorithmSettings, ScoredSample


class OpoSettings(AlgorithmSettings):
    scale: float = pydantic.Field(default=1.0, gt=0, le=100, description="Multiplies every advantage.")

    example = '{"scale": 2.0}'


class Opo(AdvantageEstimator):
    """``scale * (r_i - sum(l_j r_j) / sum(l_j))`` within each group (a group of one sample gets 0)."""

    name = "opo"
    settings_model = OpoSettings

    def advantages(self, groups: Sequence[Sequence[ScoredSample]]) -> list[float]:
        found = []
        for group in groups:
            lengths = sum(sample.response_length for sample in group)
            weighted = sum(sample.response_length * sample.reward for sample in group)
            baseline = weighted / lengths if lengths else sum(s.reward for s in group) / len(group)
            found += [self.settings.scale * (sample.reward - baseline) for sample in group]
        return found
