"""The rollout's data path without a model: partial continuation across weight updates, filters, over-sampling and
the fully_async stream's staleness bound, against a scripted engine whose every answer is known in advance.

The scripted engine "generates" token ``(sum(prompt ids) + position) % 50`` at each position, with logprob
``-(version + 1) / 10``, and cuts requests as a weight update would (``abort`` with the tokens so far) when told to.
``miles train`` runs the same paths against real engines (``tests/test_train_fully_async.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from miles_core.builtin.algorithms import Grpo
from miles_core.config import build_config
from miles_core.engines.generate_types import GenerateOutput, SamplingParams
from miles_core.plugin_manager import MilesPluginManager
from miles_core.rollout.executor import RolloutExecutor
from miles_core.rollout.filters import load_filters, no_truncated, nonzero_reward_std
from miles_core.rollout.prompts import Prompt
from miles_core.rollout.rewards import single_reward
from miles_core.rollout.samples import Group
from miles_core.rollout.stream import RolloutStream, StreamState

VOCAB = 50
EOS = 49


class ScriptedEngine:
    """An engine client whose tokens depend on the request alone; ``cut_after`` cuts every request that gets that
    many tokens further (as ``pause_generation(abort)`` does), ``version`` is the weight version it serves."""

    name = "scripted"
    is_router = False

    def __init__(self) -> None:
        self.version: int | None = None
        self.cut_after: int | None = None
        self.requests: list[tuple[list[int], SamplingParams]] = []

    async def generate_outputs(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerateOutput]:
        await asyncio.sleep(0)
        outputs = []
        for ids, p in zip(prompts, params, strict=True):
            self.requests.append((list(ids), p))
            outputs.append(self._answer(ids, p))
        return outputs

    def _answer(self, ids: list[int], params: SamplingParams) -> GenerateOutput:
        start = sum(ids)
        count = params.max_new_tokens
        reason = "length"
        if self.cut_after is not None and self.cut_after < count:
            count, reason = self.cut_after, "abort"
        tokens = [(start + i) % VOCAB for i in range(count)]
        logprob = -((self.version or 0) + 1) / 10
        meta = {"weight_version": "default" if self.version is None else str(self.version)}
        return GenerateOutput(tokens, [logprob] * count, reason, self.version, None, meta)


class FakeController:
    router_client = None
    lora_name = None  # no LoRA adapter published: generation runs on the base weights

    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine = engine
        self.version = 0

    def engine_clients(self) -> list[ScriptedEngine]:
        return [self.engine]

    async def wait_for_engines(self, timeout_s: float) -> None:
        raise AssertionError("no wave of the scripted engine fails")


class DigitTokenizer:
    """Text ``"a3:"`` as one id per character (its code point mod 40)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 40 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


def make_executor(engine: ScriptedEngine, reward=None, **overrides) -> RolloutExecutor:
    manager = MilesPluginManager.load()
    settings = {"rollout.batch_size": 4, "rollout.group_size": 2, "rollout.max_new_tokens": 8, **overrides}
    config = build_config(manager, overrides=settings)
    prompts = [Prompt(text=f"p{i}:", label=str(i), metadata={}) for i in range(12)]
    return RolloutExecutor(
        run=config.run,
        rollout=config.rollout,
        train=config.train,
        engine=config.engine,
        tokenizer=DigitTokenizer(),
        train_prompts=prompts,
        eval_prompts=prompts[:2],
        reward=single_reward(reward or (lambda *, prompt, response, label, metadata: float(len(response) % 3)), "test"),
        controller=FakeController(engine),
        advantages=Grpo(),
        filters=load_filters(list(config.rollout.filters), manager.registries.rollout_filters),
    )


def expected_tokens(prompt_ids: list[int], count: int) -> list[int]:
    return [(sum(prompt_ids) + i) % VOCAB for i in range(count)]


async def cut_once(engine: ScriptedEngine, executor: RolloutExecutor, *, after: int) -> Group:
    """A group whose requests a weight update cuts after ``after`` tokens: v0 before, v1 after."""
    engine.version, engine.cut_after = 0, after
    original = engine.generate_outputs

    async def first_call_cut(prompts, params):
        outputs = await original(prompts, params)
        engine.version, engine.cut_after = 1, None  # the update landed: the rest runs under v1
        return outputs

    engine.generate_outputs = first_call_cut
    try:
        return await executor.group(0, 0)
    finally:
        engine.generate_outputs = original


def test_a_cut_request_continues_under_the_new_weights_with_its_boundary_recorded() -> None:
    engine = ScriptedEngine()
    executor = make_executor(engine, **{"rollout.partial": True, "rollout.mask_off_policy": True})
    group = asyncio.run(cut_once(engine, executor, after=3))
    for sample in group.samples:
        assert sample.segments == [(0, 3), (1, 5)]
        first = expected_tokens(sample.prompt_ids, 3)
        rest = expected_tokens(sample.prompt_ids + first, 5)
        assert sample.response_ids == first + rest  # the continuation was asked with the tokens so far
        assert sample.logprobs == [-0.1] * 3 + [-0.2] * 5  # the old tokens keep the logprobs they were sampled with
        assert sample.finish_reason == "length"
        assert sample.off_policy_mask() == (0.0,) * 3 + (1.0,) * 5
    continued = [p for ids, p in engine.requests[2:]]
    assert [p.max_new_tokens for p in continued] == [5, 5]
    assert len({p.sampling_seed for _, p in engine.requests}) == 4  # a continuation has a seed of its own
    rollout = executor.rollout_of(0, [group])
    assert [s.loss_mask for s in rollout.batch.samples] == [(0.0,) * 3 + (1.0,) * 5] * 2


def test_without_partial_a_cut_request_is_generated_again_from_the_start() -> None:
    engine = ScriptedEngine()
    executor = make_executor(engine)
    group = asyncio.run(cut_once(engine, executor, after=3))
    for sample in group.samples:
        assert sample.segments == [(1, 8)]
        assert sample.response_ids == expected_tokens(sample.prompt_ids, 8)
        assert sample.logprobs == [-0.2] * 8
    assert [ids for ids, _ in engine.requests[2:]] == [ids for ids, _ in engine.requests[:2]]  # the prompt alone
    assert all(s.loss_mask is None for s in executor.rollout_of(0, [group]).batch.samples)


def test_every_sample_ends_exactly_once_through_many_cuts() -> None:
    engine = ScriptedEngine()
    executor = make_executor(engine, **{"rollout.partial": True})
    engine.cut_after = 1  # every request is cut after one token: eight waves, a new version each time
    calls = 0
    original = engine.generate_outputs

    async def new_version_each_wave(prompts, params):
        nonlocal calls
        calls += 1
        engine.version = calls
        return await original(prompts, params)

    engine.generate_outputs = new_version_each_wave
    group = asyncio.run(executor.group(1, 2))
    for sample in group.samples:
        assert sample.segments == [(v, 1) for v in range(1, 9)]
        assert len(sample.response_ids) == len(sample.logprobs) == 8
    assert calls == 8
    assert group.versions(initial=0) == list(range(1, 9))


def test_reward_std_filter_never_lets_a_zero_variance_group_in_and_over_sampling_keeps_the_batch_full() -> None:
    # The scripted engine answers a group's samples alike; the reward differs within the groups of odd labels only
    # (it alternates per call there), so the groups of even labels have zero variance and must be refused.
    calls = iter(range(10_000))
    executor = make_executor(
        ScriptedEngine(),
        reward=lambda *, prompt, response, label, metadata: float(next(calls) % 2) if int(label) % 2 else 1.0,
        **{"rollout.filters": "nonzero_reward_std", "rollout.over_sampling": 2},
    )
    rollout = asyncio.run(executor.get(0))
    assert len(rollout.samples) == 4 * 2  # a full batch
    for k in range(0, len(rollout.samples), 2):
        assert rollout.samples[k].reward != rollout.samples[k + 1].reward  # no zero-variance group
        assert int(rollout.samples[k].prompt.label) % 2 == 1
    assert rollout.stats["rollout/filtered_groups"] > 0


def test_filters_that_refuse_everything_stop_the_run_with_a_hint() -> None:
    engine = ScriptedEngine()
    executor = make_executor(engine, **{"rollout.filters": "nonzero_reward_std"})  # equal rewards: all refused
    executor.scorer.plan = single_reward(lambda *, prompt, response, label, metadata: 1.0, "one")
    with pytest.raises(Exception, match=r"refused .* groups of rollout 0 .* --rollout-over-sampling"):
        asyncio.run(executor.get(0))


def test_core_filters() -> None:
    executor = make_executor(ScriptedEngine())
    samples = asyncio.run(executor.group(0, 0)).samples
    group = Group(0, 0, 0, [dataclasses.replace(s, reward=r) for s, r in zip(samples, (1.0, 1.0), strict=True)])
    assert not nonzero_reward_std(group)
    group.samples[1].reward = 0.5
    assert nonzero_reward_std(group)
    assert not no_truncated(group)  # the scripted engine always runs to max_new_tokens
    group.samples = [dataclasses.replace(s, finish_reason="stop") for s in group.samples]
    assert no_truncated(group)


async def stream_batches(executor: RolloutExecutor, steps: int, **state) -> tuple[list, RolloutStream]:
    """``steps`` batches from a stream, the engine's version following the trainer's, as in a run."""
    controller = executor.controller
    stream = RolloutStream(executor, controller, executor.rollout, state=StreamState(**state))
    stream.start()
    rollouts = []
    try:
        for rollout_id in range(steps):
            rollouts.append(await stream.take(rollout_id))
            controller.version = controller.engine.version = rollout_id + 1  # the weight update
    finally:
        await stream.stop()
    return rollouts, stream


def test_the_stream_bounds_staleness_and_drops_what_is_older() -> None:
    engine = ScriptedEngine()
    executor = make_executor(engine, **{"rollout.max_staleness": 0, "rollout.over_sampling": 2})
    rollouts, stream = asyncio.run(stream_batches(executor, 4))
    for rollout_id, rollout in enumerate(rollouts):
        assert rollout.stats["rollout/staleness_max"] == 0.0
        assert all((s.weight_version or 0) == rollout_id for s in rollout.samples)  # made with the trainer's weights
        assert len(rollout.samples) == 8
    dropped = sum(r.stats["rollout/dropped_stale_groups"] for r in rollouts)
    assert dropped > 0  # groups made ahead of an update were too old
    used = [g for r in rollouts for g in r.groups]
    assert len(used) == len(set(used)) == 16
    assert all(stream.state.settled(g) for g in used)


def test_the_stream_settles_each_group_once_and_a_resumed_stream_skips_them() -> None:
    executor = make_executor(ScriptedEngine(), **{"rollout.max_staleness": 5})
    first, stream = asyncio.run(stream_batches(executor, 3))
    taken = [g for r in first for g in r.groups]
    assert len(taken) == len(set(taken)) == 3 * 4
    state = stream.state
    assert all(state.settled(g) for g in taken)
    buffered_or_running = [g for g in range(max(taken) + 9) if not state.settled(g)]
    assert buffered_or_running  # generated ahead of the trainer when the stream stopped
    resumed_executor = make_executor(ScriptedEngine(), **{"rollout.max_staleness": 5})
    again, _ = asyncio.run(stream_batches(resumed_executor, 2, low=state.low, above=set(state.above)))
    resumed = [g for r in again for g in r.groups]
    assert len(resumed) == len(set(resumed)) == 2 * 4
    assert not set(resumed) & set(taken)  # nothing counted twice
    assert set(buffered_or_running[:4]) <= set(resumed)  # what was in flight is generated again, first


def test_stream_state_round_trips_through_a_checkpoint(tmp_path) -> None:
    state = StreamState()
    for index in (0, 1, 3, 7):
        state.settle(index)
    assert (state.low, state.above) == (2, {3, 7})
    state.save(tmp_path)
    assert StreamState.load(tmp_path, default_low=0) == state
    assert StreamState.load(tmp_path / "missing", default_low=12) == StreamState(low=12)
    (tmp_path / "rollout_stream.json").write_text("{")
    with pytest.raises(Exception, match="is not a rollout stream state"):
        StreamState.load(tmp_path, default_low=0)


def test_a_checkpoints_snapshot_does_not_change_as_the_stream_settles_more() -> None:
    """The loop writes a checkpoint in a thread while the producer settles filtered groups: it saves a copy."""
    state = StreamState()
    for index in (0, 5):
        state.settle(index)
    snapshot = state.copy()
    for index in (1, 2, 3, 4, 9):
        state.settle(index)
    assert (snapshot.low, snapshot.above) == (1, {5})
    assert (state.low, state.above) == (6, {9})


def test_an_answer_held_across_an_update_is_split_by_its_weight_versions_spans() -> None:
    """SGLang (and the local engine) report where each version's tokens are when a request waited out an update
    (``retract``): the sample takes those spans as its segments."""
    engine = ScriptedEngine()
    original = engine._answer

    def with_spans(ids, params):
        output = original(ids, params)
        spans = [{"version": "default", "start": 0, "end": 3}, {"version": "1", "start": 3, "end": 8}]
        return dataclasses.replace(output, weight_version=1, meta={**output.meta, "weight_versions": spans})

    engine._answer = with_spans
    executor = make_executor(engine)
    group = asyncio.run(executor.group(0, 0))
    assert [s.segments for s in group.samples] == [[(None, 3), (1, 5)]] * 2
    assert group.versions(initial=0) == [0, 1]


def test_weight_versions_spans_that_do_not_cover_the_tokens_are_an_engine_error() -> None:
    engine = ScriptedEngine()
    original = engine._answer
    spans = [{"version": "1", "start": 0, "end": 3}]  # 8 tokens came back
    engine._answer = lambda ids, params: dataclasses.replace(
        original(ids, params), meta={"weight_versions": spans, "weight_version": "1"}
    )
    executor = make_executor(engine)
    waits = []

    async def engines_back(timeout_s: float) -> None:
        waits.append(timeout_s)

    executor.controller.wait_for_engines = engines_back  # a malformed answer fails its wave, which is sent again
    with pytest.raises(Exception, match=r"could not be generated: .*weight_versions .* do not cover its 8 tokens"):
        asyncio.run(executor.group(0, 0))
    assert len(waits) == 4  # five waves in all
