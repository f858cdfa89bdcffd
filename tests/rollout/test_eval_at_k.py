"""Eval at k (``--rollout-eval-samples K``): the metric math, and the executor's eval against a scripted engine whose
answers depend on each request's seed, so every sample's reward is known in advance."""

from __future__ import annotations

import asyncio
import math

import pytest

from miles_core.engines.generate_types import GenerateOutput, SamplingParams
from miles_core.rollout.eval_at_k import at_k_stats, eval_seed, passes
from tests.rollout.test_stream import ScriptedEngine, make_executor
from tests.test_config_hostile import refused

# -- the metric math ---------------------------------------------------------------------------------------------


def test_pass_at_k_counts_prompts_with_any_passing_sample() -> None:
    rewards = [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.2, 0.0], [-1.0, 0.0, 0.0]]
    stats = at_k_stats(rewards, k=3, threshold=None)  # passes: above 0
    assert stats == {"eval/pass@3": 2 / 4, "eval/mean@3": pytest.approx((1.0 + 0.7 - 1.0) / 12, rel=1e-15)}
    assert at_k_stats(rewards, k=3, threshold=0.5)["eval/pass@3"] == 2 / 4  # 1.0 and 0.5 (at least the threshold)
    assert at_k_stats(rewards, k=3, threshold=1.0)["eval/pass@3"] == 1 / 4
    assert at_k_stats(rewards, k=3, threshold=-1.0)["eval/pass@3"] == 1.0  # every reward is at least -1


@pytest.mark.parametrize(
    ("reward", "threshold", "passed"),
    [(0.0, None, False), (1e-9, None, True), (-0.5, None, False), (0.5, 0.5, True), (0.49, 0.5, False)],
)
def test_a_sample_passes_above_zero_or_at_the_threshold(reward: float, threshold: float | None, passed: bool) -> None:
    assert passes(reward, threshold) is passed


@pytest.mark.parametrize("rewards", [[], [[1.0], []]])
def test_no_rewards_is_an_error_not_a_zero(rewards: list[list[float]]) -> None:
    with pytest.raises(ValueError, match="at least one sample of each"):
        at_k_stats(rewards, k=2, threshold=None)


def test_eval_seeds_depend_on_the_run_seed_prompt_and_sample_alone() -> None:
    seeds = {eval_seed(7, prompt, k) for prompt in range(50) for k in range(8)}
    assert len(seeds) == 400 and all(0 <= seed < 2**48 for seed in seeds)
    assert eval_seed(7, 3, 2) == eval_seed(7, 3, 2) != eval_seed(8, 3, 2)


# -- the executor ------------------------------------------------------------------------------------------------


class SeededEngine(ScriptedEngine):
    """Answers one token, ``seed % 50`` (greedy requests: ``sum(prompt) % 50``)."""

    def _answer(self, ids: list[int], params: SamplingParams) -> GenerateOutput:
        token = (sum(ids) if params.temperature == 0 else params.sampling_seed) % 50
        return GenerateOutput([token], [-0.1], "length", None, None, {"weight_version": "default"})


def reward_of(*, prompt, response, label, metadata) -> float:
    """1.0 when the token (the tokenizer's decode: its id as text) is even, else 0.0."""
    return float(int(response) % 2 == 0)


def evaluate(k: int, **overrides) -> tuple[SeededEngine, dict[str, float]]:
    engine = SeededEngine()
    settings = {"rollout.eval_samples": k, "rollout.temperature": 0.7, "run.seed": 11, **overrides}
    executor = make_executor(engine, reward=reward_of, **settings)
    return engine, asyncio.run(executor.evaluate(3)).stats


def test_k_1_is_the_greedy_eval_alone() -> None:
    engine, stats = evaluate(1)
    greedy_only = {"eval/reward_mean", "eval/reward_std", "eval/response_length", "eval/samples"}
    greedy_only |= {"eval/reward/test", "eval/reward_errors", "eval/reward_timeouts"}  # the reward's own parts
    assert set(stats) == greedy_only
    assert [params.temperature for _, params in engine.requests] == [0.0, 0.0]  # the two eval prompts, greedy
    assert [params.sampling_seed for _, params in engine.requests] == [0, 1]


def test_k_samples_per_prompt_at_the_rollout_temperature_with_seeded_draws() -> None:
    engine, stats = evaluate(3)
    greedy, sampled = engine.requests[:2], engine.requests[2:]
    assert [p.temperature for _, p in greedy] == [0.0, 0.0] and [p.temperature for _, p in sampled] == [0.7] * 6
    assert [p.sampling_seed for _, p in sampled] == [eval_seed(11, i, j) for i in range(2) for j in range(3)]
    assert [ids for ids, _ in sampled] == [greedy[0][0]] * 3 + [greedy[1][0]] * 3
    rewards = [[float(eval_seed(11, i, j) % 50 % 2 == 0) for j in range(3)] for i in range(2)]
    assert stats["eval/pass@3"] == sum(any(r) for r in rewards) / 2
    assert stats["eval/mean@3"] == pytest.approx(sum(map(sum, rewards)) / 6, rel=1e-15)
    assert stats["eval/samples"] == 2.0  # the greedy metrics are the greedy answers' alone
    assert evaluate(3)[1] == stats  # the same seeds every time


def test_the_threshold_decides_what_passes() -> None:
    _, stats = evaluate(4, **{"rollout.eval_pass_threshold": 2.0})  # no reward reaches 2
    assert stats["eval/pass@4"] == 0.0 and not math.isnan(stats["eval/mean@4"])


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--rollout-eval-samples", "0"], "rollout.eval_samples = '0': Input should be greater than or equal to 1"),
        (["--rollout-eval-samples", "1025"], "rollout.eval_samples = '1025': Input should be less than or equal to"),
        (["--rollout-eval-samples", "two"], "rollout.eval_samples = 'two': Input should be a valid integer"),
        (["--rollout-eval-pass-threshold", "nan"], "rollout.eval_pass_threshold = 'nan': Input should be a finite"),
        (["--rollout-eval-pass-threshold", "high"], "rollout.eval_pass_threshold = 'high': Input should be a valid"),
    ],
)
def test_bad_eval_settings_are_refused_by_name(args: list[str], expected: str) -> None:
    assert expected in refused(*args)
