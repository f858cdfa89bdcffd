"""Composition, dispatch and the scoring pool: weighted parts, sources, timeouts, errors and failure limits."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from miles_core.config.build import build_config
from miles_core.errors import ConfigError, MilesError
from miles_core.plugin_manager import MilesPluginManager
from miles_core.rollout.prompts import Prompt
from miles_core.rollout.reward_specs import parse_reward_spec
from miles_core.rollout.rewards import (
    CompositeReward,
    RewardPart,
    RewardPlan,
    RewardScorer,
    single_reward,
)
from miles_core.rollout.samples import Sample
from miles_core.run_setup import load_reward


@pytest.fixture(scope="module")
def manager() -> MilesPluginManager:
    return MilesPluginManager.load(environ={"MILES_DISABLE_PLUGIN_AUTOLOAD": "1"})


def config(manager: MilesPluginManager, **overrides):
    return build_config(manager, overrides=overrides)


def samples_of(*pairs: tuple[str, object], metadata: dict | None = None) -> list[Sample]:
    return [
        Sample(index=i, prompt=Prompt("q", label=label, metadata=dict(metadata or {})), prompt_ids=[1], response=text)
        for i, (text, label) in enumerate(pairs)
    ]


def score(scorer: RewardScorer, samples: list[Sample]) -> list[Sample]:
    asyncio.run(scorer.score(samples, ["sample {index}"] * len(samples)))
    return samples


def scorer_of(plan: RewardPlan, *, timeout_s: float = 5.0, workers: int = 2, limit: int = 16, log=None) -> RewardScorer:
    return RewardScorer(
        plan, timeout_s=timeout_s, workers=workers, max_consecutive_failures=limit, log=log or (lambda line: None)
    )


# -- the spec ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("math", [("math", 1.0)]),
        ("math:1.0,format:0.1", [("math", 1.0), ("format", 0.1)]),
        (" math : 2 , format ", [("math", 2.0), ("format", 1.0)]),
        ("my_rewards:score", [("my_rewards:score", 1.0)]),
        ("my_rewards:score:0.5,format:-1e-1", [("my_rewards:score", 0.5), ("format", -0.1)]),
        ("pkg.mod:Class.fn:.5", [("pkg.mod:Class.fn", 0.5)]),
        ("remote:1.0,format:0.1", [("remote", 1.0), ("format", 0.1)]),
    ],
)
def test_a_spec_is_weighted_parts(text: str, parts: list) -> None:
    assert parse_reward_spec(text, field="--reward") == parts


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("math:abc!", "--reward = 'math:abc!': the weight 'abc!' of 'math' is not a number; write NAME:WEIGHT"),
        ("math:1.0x", "the weight '1.0x' of 'math' is not a number"),
        ("math:", "the weight '' of 'math' is not a number"),
        ("math,,format", "a part names no reward"),
        (":1.0", "a part names no reward"),
        ("math:1e999", "the weight of 'math' is not finite"),
        ("math:1,math:2", "'math' appears twice"),
    ],
)
def test_a_malformed_spec_is_one_line(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_reward_spec(text, field="--reward")
    assert message in str(error.value) and "\n" not in str(error.value)


# -- composition and dispatch ------------------------------------------------------------------------------------


def test_composed_parts_sum_with_their_weights_and_are_logged_each(manager) -> None:
    plan = load_reward(config(manager, **{"rollout.reward": "math:1.0,format:0.1"}), manager.registries)
    samples = samples_of(("so \\boxed{\\frac{1}{2}}", "0.5"), ("\\boxed{3}", "0.5"), ("0.5", "0.5"))
    scorer = scorer_of(plan)
    score(scorer, samples)
    assert [s.reward for s in samples] == pytest.approx([1.1, 0.1, 1.0])
    assert samples[0].reward_parts == {"math": 1.0, "format": 1.0} and samples[2].reward_parts["format"] == 0.0
    scorer.close()


def test_dispatch_by_source_with_the_default_for_the_others(manager) -> None:
    run_config = config(
        manager,
        **{
            "rollout.reward_dispatch_key": "data_source",
            "rollout.reward_by_source": {"gsm8k": "gsm8k", "math": "math:1.0,format:0.1"},
            "rollout.reward": "exact",
        },
    )
    plan = load_reward(run_config, manager.registries)
    gsm = samples_of(("#### 72", "72"), metadata={"data_source": "gsm8k"})
    math_ = samples_of(("\\boxed{72}", "72"), metadata={"data_source": "math"})
    other = samples_of(("72", "72"), metadata={"data_source": "trivia"})
    scorer = scorer_of(plan)
    score(scorer, gsm + math_ + other)
    assert [s.reward for s in gsm + math_ + other] == pytest.approx([1.0, 1.1, 1.0])
    assert [set(s.reward_parts) for s in gsm + math_ + other] == [{"gsm8k"}, {"math", "format"}, {"exact"}]
    scorer.close()


def test_an_unknown_source_without_a_default_names_it_and_the_known_ones(manager) -> None:
    run_config = config(
        manager, **{"rollout.reward_dispatch_key": "data_source", "rollout.reward_by_source": {"gsm8k": "gsm8k"}}
    )
    scorer = scorer_of(load_reward(run_config, manager.registries))
    with pytest.raises(MilesError) as error:
        score(scorer, samples_of(("1", "1"), metadata={"data_source": "trivia"}))
    assert str(error.value) == (
        "a sample's metadata 'data_source' is 'trivia', which --rollout-reward-by-source does not map (known: "
        "gsm8k); add it, or give --reward for the others"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rollout.reward": "maths"}, "rollout.reward (--reward) = 'maths': unknown reward function 'maths'"),
        ({"rollout.reward": "maths"}, "(closest: math"),
        ({"rollout.reward": "math:1.0,fromat:0.1"}, "(closest: format"),
        ({"rollout.reward": "math:1.0x"}, "the weight '1.0x' of 'math' is not a number"),
        (
            {"rollout.reward_dispatch_key": "src", "rollout.reward_by_source": {"a": "gsm8"}},
            "rollout.reward_by_source.a = 'gsm8': unknown reward function 'gsm8'",
        ),
        ({"rollout.reward_dispatch_key": "src"}, "give both or neither"),
        ({"rollout.reward": "remote"}, "the reward part 'remote' is the reward server, but rollout.reward_url"),
        (
            {"rollout.reward": "math", "rollout.reward_url": "http://127.0.0.1:9"},
            "rollout.reward_url (--reward-url) is set but no reward names 'remote'",
        ),
        ({"rollout.reward_url": "ftp://x"}, "an http:// or https:// base URL"),
        ({"rollout.reward_timeout_s": 0}, "reward_timeout_s"),
        ({"rollout.reward_workers": 10**6}, "reward_workers"),
    ],
)
def test_bad_reward_config_is_one_line_when_the_config_is_built(manager, overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        config(manager, **overrides)
    assert message in str(error.value), str(error.value)
    assert "\n" not in str(error.value).strip() or len(str(error.value).splitlines()) <= 2


def test_an_unreachable_reward_url_is_a_clear_error_at_start(manager) -> None:
    run_config = config(manager, **{"rollout.reward_url": "http://127.0.0.1:9", "rollout.reward_url_timeout_s": 2})
    with pytest.raises(MilesError) as error:
        load_reward(run_config, manager.registries)
    assert str(error.value).startswith("the reward server --reward-url http://127.0.0.1:9 cannot be reached (")
    assert "start it, or correct the URL" in str(error.value) and "\n" not in str(error.value)


# -- the pool: timeouts, errors, failure limits --------------------------------------------------------------------


def test_a_reward_that_hangs_on_one_input_scores_0_within_the_timeout_and_the_step_goes_on() -> None:
    release = threading.Event()

    def hangs_on_b(*, prompt, response, label, metadata):
        if response == "b":
            release.wait()  # forever, for the scorer
        return 1.0

    lines: list[str] = []
    scorer = scorer_of(single_reward(hangs_on_b, "hangs"), timeout_s=0.5, workers=2, log=lines.append)
    samples = samples_of(*[(text, None) for text in "aababaaa"])
    started = time.monotonic()
    score(scorer, samples)
    elapsed = time.monotonic() - started
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert [s.reward_timeouts for s in samples] == [0, 0, 1, 0, 1, 0, 0, 0]
    assert elapsed < 0.5 * 2 + 5  # two timeouts in the same worker's chunk, one after the other, plus slack
    assert len(lines) == 1 and "reward hangs timed out: ran past --rollout-reward-timeout-s 0.5" in lines[0]
    assert "on sample 2 (prompt 'q', response 'b')" in lines[0]
    again = samples_of(("a", None), ("a", None))
    score(scorer, again)  # the stuck workers were replaced: the next batch is scored
    assert [s.reward for s in again] == [1.0, 1.0]
    release.set()
    scorer.close()


def test_raising_and_non_finite_rewards_score_0_and_are_counted() -> None:
    def flaky(*, prompt, response, label, metadata):
        if response == "raise":
            raise KeyError("score")
        return float("nan") if response == "nan" else 2.0

    lines: list[str] = []
    scorer = scorer_of(single_reward(flaky, "flaky"), log=lines.append)
    samples = score(scorer, samples_of(("raise", None), ("ok", None), ("nan", None), ("raise", None)))
    assert [s.reward for s in samples] == [0.0, 2.0, 0.0, 0.0]
    assert sum(s.reward_errors for s in samples) == 3
    assert len(lines) == 1 and lines[0].startswith("miles: reward flaky raised KeyError: 'score' on sample 0")


def test_consecutive_failures_stop_the_run_naming_the_reward_and_its_last_error() -> None:
    def broken(*, prompt, response, label, metadata):
        raise RuntimeError(f"no verifier for {response}")

    scorer = scorer_of(single_reward(broken, "broken"), workers=1, limit=3)
    score(scorer, samples_of(("a", None), ("b", None)))  # 2 in a row: still going
    with pytest.raises(MilesError) as error:
        score(scorer, samples_of(("c", None)))
    assert str(error.value).startswith(
        "reward broken failed 3 times in a row (--rollout-reward-max-consecutive-failures); the last: reward broken "
        "raised RuntimeError: no verifier for c on sample 0"
    )


def test_a_success_resets_the_count_of_failures_in_a_row() -> None:
    def odd(*, prompt, response, label, metadata):
        if response == "x":
            raise ValueError("bad")
        return 1.0

    scorer = scorer_of(single_reward(odd, "odd"), workers=1, limit=2)
    samples = score(scorer, samples_of(("x", None), ("ok", None), ("x", None), ("ok", None), ("x", None)))
    assert [s.reward for s in samples] == [0.0, 1.0, 0.0, 1.0, 0.0]


def test_a_failed_part_scores_0_while_the_others_count() -> None:
    def boom(**_):
        raise RuntimeError("x")

    plan = RewardPlan(
        CompositeReward("boom:1,one:0.5", (RewardPart("boom", 1.0, fn=boom), RewardPart("one", 0.5, fn=lambda **_: 1)))
    )
    samples = score(scorer_of(plan), samples_of(("a", None)))
    assert samples[0].reward == 0.5 and samples[0].reward_parts == {"boom": 0.0, "one": 1.0}
