"""Agents as plugins: loading and checking ``--rollout-agent``, the training mask of an agent's sample, the weight
versions of a trajectory's tokens, and the session server's batching of turns."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from types import SimpleNamespace

import pytest

from miles_core.builtin.algorithms import Grpo
from miles_core.config.sections import EngineSection, RolloutSection, RunSection, TrainSection
from miles_core.default.tokenizer import DigitTokenizer
from miles_core.engines.generate_types import GenerateOutput, SamplingParams
from miles_core.errors import ConfigError, MilesError
from miles_core.plugin_manager import MilesPluginManager
from miles_core.rollout.agents import (
    Agent,
    agent_for_task,
    close_session_clients,
    is_session_failure,
    load_agent,
    session_anthropic_client,
    session_chat_format,
    session_client,
)
from miles_core.rollout.executor import RolloutExecutor, _turn_segments
from miles_core.rollout.prompts import Prompt
from miles_core.rollout.rewards import single_reward
from miles_core.rollout.samples import Group, Sample
from miles_core.rollout.sessions.batching import TurnBatcher
from miles_core.rollout.sessions.session import Trajectory, Turn


@pytest.fixture(scope="module")
def agents():
    return MilesPluginManager.load().registries.agents


async def good_agent(*, base_url, prompt, metadata):
    return 1.0


def plain_function(*, base_url, prompt, metadata):
    return 1.0


async def wrong_arguments(*, url, prompt):
    return 1.0


def test_the_core_registers_its_agents_and_a_task_names_its_own(agents) -> None:
    assert {"single_turn", "tool_lookup", "tool_lookup_responses", "tool_lookup_anthropic"} <= set(agents)
    assert agent_for_task("tool_lookup", None, agents).name.startswith("tool_lookup (")
    assert agent_for_task("echo_last", None, agents) is None  # batched single-turn generation
    assert agent_for_task("echo_last", "single_turn", agents).name.startswith("single_turn (")
    assert load_agent("tests.rollout.test_agents:good_agent", agents).run is good_agent


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nope", "neither a registered agent"),
        ("tests.rollout.test_agents:plain_function", "not an async function"),
        ("tests.rollout.test_agents:wrong_arguments", "cannot be called as agent"),
        ("tests.rollout.test_agents:missing", "missing"),
    ],
)
def test_a_bad_agent_is_refused_before_the_run_starts(agents, target: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_agent(target, agents)


def test_a_model_needs_a_chat_format() -> None:
    config = SimpleNamespace(rollout=SimpleNamespace(chat_format=None), model=SimpleNamespace(path=None))
    assert session_chat_format(config) == "default"
    config.model.path = "/some/model"
    with pytest.raises(ConfigError, match="--rollout-chat-format"):
        session_chat_format(config)
    config.rollout.chat_format = "qwen3"
    assert session_chat_format(config) == "qwen3"


def test_session_clients_share_an_http_client_per_sdk_and_an_unreachable_session_is_a_session_failure() -> None:
    """Both SDKs' clients of the sessions of one event loop share an HTTP client per SDK (a new one costs ~45 ms of
    CPU); a request that cannot reach its session server is a failure to replay the sample on, in either SDK."""
    with socket.socket() as probe:  # a port nothing listens on once the probe is closed
        probe.bind(("127.0.0.1", 0))
        base_url = f"http://127.0.0.1:{probe.getsockname()[1]}/sessions/s/v1"

    async def main() -> tuple[list, list[BaseException], list]:
        openai_clients = [session_client(base_url) for _ in range(2)]
        anthropic_clients = [session_anthropic_client(base_url) for _ in range(2)]
        assert str(anthropic_clients[0].base_url).rstrip("/") == base_url.removesuffix("/v1")
        failures = []
        for ask in (
            lambda: openai_clients[0].with_options(max_retries=0).chat.completions.create(model="p", messages=[]),
            lambda: (
                anthropic_clients[0].with_options(max_retries=0).messages.create(model="p", max_tokens=1, messages=[])
            ),
        ):
            try:
                await ask()
            except Exception as exc:
                failures.append(exc)
        https = [client._client for client in (*openai_clients, *anthropic_clients)]
        await close_session_clients()
        return https, failures, [http.is_closed for http in https]

    https, failures, closed = asyncio.run(main())
    assert https[0] is https[1] and https[2] is https[3] and https[0] is not https[2]
    assert closed == [True] * 4  # the run's end closes them all
    assert [type(exc).__name__ for exc in failures] == ["APIConnectionError"] * 2
    assert all(is_session_failure(exc) for exc in failures) and not is_session_failure(ValueError("agent defect"))


def trajectory() -> Trajectory:
    """Two turns (versions 3 and 4) with four appended tool tokens between them."""
    return Trajectory(
        session_id="s",
        prompt_ids=[2, 4, 3],
        response_ids=[5, 6, 1, 2, 6, 3, 7, 2, 5, 1],
        loss_mask=[1, 1, 1, 0, 0, 0, 0, 1, 1, 1],
        logprobs=[-1.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0.0, -1.0, -1.0, -1.0],
        turns=[Turn(0, 3, "stop", 3), Turn(7, 10, "stop", 4)],
        metadata={},
    )


def test_a_trajectorys_appended_tokens_count_under_the_version_the_policy_had_seen() -> None:
    assert _turn_segments(trajectory()) == [(3, 3), (3, 4), (4, 3)]


@pytest.mark.parametrize("mask_off_policy", [False, True])
def test_an_agents_sample_trains_only_on_the_policys_tokens(mask_off_policy: bool) -> None:
    traj = trajectory()
    sample = Sample(index=0, prompt=Prompt("1", "1", {}), prompt_ids=traj.prompt_ids, response_ids=traj.response_ids)
    sample.loss_mask, sample.segments = traj.loss_mask, _turn_segments(traj)
    mask = sample.train_mask(mask_off_policy=mask_off_policy)
    if mask_off_policy:  # the first turn (version 3) is older than the last (4): off
        assert mask == (0, 0, 0, 0, 0, 0, 0, 1, 1, 1)
    else:
        assert mask == tuple(float(m) for m in traj.loss_mask)
    plain = Sample(index=0, prompt=Prompt("1", "1", {}), prompt_ids=[2], response_ids=[5, 6])
    assert plain.train_mask(mask_off_policy=False) is None


class CountingClient:
    """An engine client that records the batches it is sent and answers each prompt with its own length."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        self.batches: list[int] = []
        self.delay_s, self.fail = delay_s, fail
        self.in_flight = self.most_in_flight = 0

    async def generate_outputs(self, input_ids, params):
        self.batches.append(len(input_ids))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        if self.fail:
            raise OSError("engine gone")
        return [GenerateOutput([len(ids)], [0.0], "stop", None, None, {}) for ids in input_ids]


def test_turns_that_arrive_together_go_to_the_engine_as_one_batch_and_each_gets_its_own_answer() -> None:
    async def main() -> tuple[list[int], list[int]]:
        client = CountingClient()
        batcher = TurnBatcher(client, window_s=0.01)
        outputs = await asyncio.gather(
            *(batcher.generate([0] * n, SamplingParams(max_new_tokens=1)) for n in range(1, 21))
        )
        return client.batches, [output.output_ids[0] for output in outputs]

    batches, answers = asyncio.run(main())
    assert batches == [20] and answers == list(range(1, 21))


def test_a_full_batch_leaves_at_once_a_later_one_does_not_wait_and_a_failure_reaches_each_turn() -> None:
    async def main() -> tuple[CountingClient, list]:
        slow = CountingClient(delay_s=30.0)
        batcher = TurnBatcher(slow, window_s=0.001, max_batch=4)
        first = [asyncio.ensure_future(batcher.generate([0], SamplingParams(max_new_tokens=1))) for _ in range(4)]
        second = [asyncio.ensure_future(batcher.generate([0], SamplingParams(max_new_tokens=1))) for _ in range(2)]
        while slow.in_flight < 2:  # the first batch left when full; the second leaves after its window
            await asyncio.sleep(0.005)
        await batcher.aclose()  # stopping cancels both
        failing = TurnBatcher(CountingClient(fail=True), window_s=0.001)
        results = await asyncio.gather(
            *(failing.generate([0], SamplingParams(max_new_tokens=1)) for _ in range(3)), return_exceptions=True
        )
        assert all(turn.done() for turn in first + second)
        return slow, results

    slow, results = asyncio.run(main())
    assert slow.batches == [4, 2] and slow.most_in_flight == 2  # the second did not wait for the first
    assert [type(result) for result in results] == [OSError] * 3


def executor_for_branches() -> RolloutExecutor:
    return RolloutExecutor(
        run=RunSection(),
        rollout=RolloutSection(mask_off_policy=False),
        train=TrainSection(),
        engine=EngineSection(),
        tokenizer=DigitTokenizer(),
        train_prompts=[],
        eval_prompts=[],
        reward=single_reward(lambda **_: 0.0, "zero"),
        controller=None,
        advantages=Grpo({"normalize_std": False}),
        agent=Agent("brancher", good_agent),
        sessions=SimpleNamespace(),
    )


def test_an_agents_branches_become_samples_of_its_group_with_a_reward_each() -> None:
    executor = executor_for_branches()
    empty = dataclasses.replace(trajectory(), turns=[], response_ids=[], loss_mask=[], logprobs=[])
    sample = Sample(index=5, prompt=Prompt("1", "1", {}), prompt_ids=[2], group=0)
    samples = asyncio.run(
        executor._branch_samples(sample, [trajectory(), empty, trajectory()], [1.0, 0.5, 0.0], "sample {index}")
    )
    assert [s.reward for s in samples] == [1.0, 0.0] and {s.index for s in samples} == {5}  # no turn: no sample
    assert samples[0] is sample and samples[1].response_ids == trajectory().response_ids
    with pytest.raises(MilesError, match=r"returned 2 rewards for sample 5 .* 3 sessions"):
        asyncio.run(executor._branch_samples(sample, [trajectory()] * 3, [1.0, 0.5], "sample {index}"))
    with pytest.raises(MilesError, match="without asking the policy anything"):
        asyncio.run(executor._branch_samples(sample, [empty], 1.0, "sample {index}"))
    # GRPO advantages within each group, whatever its size: a group of 2 (one branch) and one of 3
    group = Group(0, 0, 0, [*samples, Sample(index=6, prompt=sample.prompt, prompt_ids=[2], reward=0.5)])
    other = Group(1, 0, 1, [Sample(index=0, prompt=sample.prompt, prompt_ids=[2], reward=r) for r in (2.0, 4.0)])
    for s in [*group.samples, *other.samples]:
        s.response_ids = s.response_ids or [5]
        s.logprobs = s.logprobs or [0.0]
    batch = executor.rollout_of(0, [group, other]).batch
    assert [s.advantage for s in batch.samples] == [0.5, -0.5, 0.0, -1.0, 1.0]
