"""Continuous batching in the local engine: requests join and leave the running batch between decode steps.

Every test runs a real :class:`LocalEngine` in this process on a tiny checkpoint and checks its answers against the
same request served alone (or the model's own forward), by order of events and by the tokens, never by timing.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
import transformers

from miles_core.builtin.local_engine.batch_generation import FixedRow, generate_batch
from miles_core.builtin.local_engine.engine import LocalEngine
from miles_core.builtin.local_engine.running_batch import RunningBatch, result_of
from miles_core.builtin.local_engine.sampling import GenerationRequest, GenerationResult, Sampler, SamplingParams
from miles_core.testkit.tiny_models import perturbed_state, save_tiny_llama
from tests.numerics import served_logprob_tolerance

SEEDED = SamplingParams(max_new_tokens=24, temperature=1.0, sampling_seed=11, ignore_eos=True)
GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def engine(model_dir: Path, tmp_path: Path) -> LocalEngine:
    staging = tmp_path / "staging"
    staging.mkdir(mode=0o700)
    return LocalEngine(model_dir, staging_dir=staging, max_batch_size=8)


class Tokens:
    """An ``on_token`` callback that counts (on the decode thread) and lets the event loop wait for a count."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self._reached = threading.Condition()

    def __call__(self, token: int, logprob: float, top: object) -> None:
        with self._reached:
            self.ids.append(token)
            self._reached.notify_all()

    async def at_least(self, count: int) -> None:
        def wait() -> None:
            with self._reached:
                assert self._reached.wait_for(lambda: len(self.ids) >= count, timeout=120), (count, self.ids)

        await asyncio.to_thread(wait)


def start(engine: LocalEngine, prompt: list[int], params: SamplingParams, tokens: Tokens | None = None):
    request = GenerationRequest(prompt, params, on_token=tokens)
    return asyncio.ensure_future(engine.generate([request]))


def tolerance(model: torch.nn.Module, prompt: list[int], result: GenerationResult) -> float:
    """Two float32 computations of the same logprob that sum in another order (another batch shape, padding, a
    prefill instead of cached steps): see :func:`tests.numerics.served_logprob_tolerance`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + result.output_ids])).logits
    return served_logprob_tolerance(
        torch.float32, num_layers=model.config.num_hidden_layers, largest_logit=logits.abs().max().item()
    )


def assert_same(model: torch.nn.Module, prompt: list[int], alone: GenerationResult, other: GenerationResult) -> None:
    assert other.output_ids == alone.output_ids
    bound = tolerance(model, prompt, alone)
    assert max(abs(a - b) for a, b in zip(alone.logprobs, other.logprobs, strict=True)) <= bound


def test_a_short_request_finishes_while_a_long_one_runs(engine: LocalEngine) -> None:
    async def scenario() -> None:
        engine.start()
        progress = Tokens()
        long = start(engine, [3, 4], LONG, progress)
        await progress.at_least(2)  # it runs
        (short,) = await engine.generate([GenerationRequest([5], SamplingParams(max_new_tokens=3, ignore_eos=True))])
        assert len(short.output_ids) == 3
        assert not long.done() and len(progress.ids) < LONG.max_new_tokens  # it did not wait for the long one
        (whole,) = await long
        assert len(whole.output_ids) == LONG.max_new_tokens and whole.output_ids == progress.ids

    asyncio.run(scenario())


def test_a_request_that_joins_mid_flight_gets_the_tokens_it_gets_alone(engine: LocalEngine) -> None:
    prompt = [7, 8, 9]

    async def scenario() -> None:
        engine.start()
        alone = [(await engine.generate([GenerationRequest(prompt, p)]))[0] for p in (SEEDED, GREEDY)]
        progress = [Tokens(), Tokens()]
        others = [start(engine, [3, 4, 5, 6, 10, 11], LONG, progress[0]), start(engine, [12], LONG, progress[1])]
        await progress[0].at_least(5)
        joined = await engine.generate([GenerationRequest(prompt, SEEDED), GenerationRequest(prompt, GREEDY)])
        assert not any(task.done() for task in others)  # it joined a running batch and left it before them
        for task in others:
            task.cancel()
        return alone, joined

    alone, joined = asyncio.run(scenario())
    for single, batched in zip(alone, joined, strict=True):
        assert_same(engine.model, prompt, single, batched)


@pytest.mark.parametrize("params", [SEEDED, GREEDY], ids=["sampled", "greedy"])
def test_a_retracted_request_keeps_its_tokens_and_continues_after_resume(engine: LocalEngine, params) -> None:
    prompt = [6, 7]
    params = params.model_copy(update={"max_new_tokens": 60})

    async def scenario() -> tuple[GenerationResult, GenerationResult, int]:
        engine.start()
        (alone,) = await engine.generate([GenerationRequest(prompt, params)])
        progress = Tokens()
        task = start(engine, prompt, params, progress)
        await progress.at_least(3)
        await engine.pause("retract")
        cut = len(progress.ids)
        assert engine.queued == 1 and not task.done() and cut < 60  # out of the batch, back in the queue
        await asyncio.sleep(0.05)  # (no assertion on time: it only gives a broken engine the chance to step it)
        assert len(progress.ids) == cut
        engine.resume()
        return alone, await task, cut

    alone, (resumed,), cut = asyncio.run(scenario())
    assert resumed.output_ids[:cut] == alone.output_ids[:cut]
    assert_same(engine.model, prompt, alone, resumed)  # prefilled again, it went on as if never cut, seed and all


def test_abort_ends_running_and_queued_requests_keeping_their_tokens(engine: LocalEngine) -> None:
    async def scenario() -> None:
        engine.start()
        progress = Tokens()
        running = start(engine, [3], LONG, progress)
        await progress.at_least(3)
        await engine.pause("in_place")
        queued = start(engine, [4], LONG)
        await asyncio.sleep(0)
        assert engine.queued == 1
        await engine.pause("abort")
        (cut,) = await running
        (never,) = await queued
        engine.resume()
        assert cut.finish_reason == {"type": "abort", "message": "aborted by pause_generation"}
        assert cut.output_ids == progress.ids and 3 <= len(cut.output_ids) < LONG.max_new_tokens
        assert len(cut.logprobs) == len(cut.output_ids)
        assert never.output_ids == [] and never.finish_reason["type"] == "abort"
        (after,) = await engine.generate([GenerationRequest([3], SamplingParams(max_new_tokens=2, ignore_eos=True))])
        assert len(after.output_ids) == 2  # resumed, it serves

    asyncio.run(scenario())


def test_an_update_over_in_place_requests_recomputes_their_cache_under_the_new_weights(
    engine: LocalEngine, tmp_path: Path
) -> None:
    """Held ``in_place``, a request keeps its tokens across a weight update; its cache is computed again under the
    new weights, so every token after the update has the new model's logprob given all tokens before it."""
    prompt = [5, 9]
    params = GREEDY.model_copy(update={"max_new_tokens": 40})
    new = transformers.AutoModelForCausalLM.from_pretrained(engine.model_path).eval()
    new.load_state_dict(perturbed_state(new, seed=4))
    new.save_pretrained(tmp_path / "v2")

    async def scenario() -> tuple[GenerationResult, GenerationResult, int]:
        engine.start()
        (before,) = await engine.generate([GenerationRequest(prompt, params)])
        progress = Tokens()
        task = start(engine, prompt, params, progress)
        await progress.at_least(3)
        await engine.pause("in_place")
        cut = len(progress.ids)
        assert engine.queued == 0 and not task.done()  # held in the batch
        await asyncio.to_thread(engine.update_from_disk, str(tmp_path / "v2"), "2")  # paused: it goes ahead
        engine.resume()
        return before, await task, cut

    before, (served,), cut = asyncio.run(scenario())
    assert served.output_ids[:cut] == before.output_ids[:cut] and len(served.output_ids) == 40
    with torch.no_grad():
        logits = new(torch.tensor([prompt + served.output_ids])).logits[0]
    expected = torch.log_softmax(logits, dim=-1)
    bound = served_logprob_tolerance(torch.float32, num_layers=2, largest_logit=logits.abs().max().item())
    for i in range(cut, 40):
        token = served.output_ids[i]
        assert abs(served.logprobs[i] - expected[len(prompt) - 1 + i, token].item()) <= bound, i
        assert token == int(expected[len(prompt) - 1 + i].argmax())


def test_an_update_waits_for_running_requests_and_holds_back_new_ones(engine: LocalEngine, tmp_path: Path) -> None:
    """Not paused, an update waits for a step boundary with nothing being stepped: the running request ends under
    the old weights (same tokens as before the update), and a request sent meanwhile runs under the new ones."""
    prompt = [5, 9]
    params = GREEDY.model_copy(update={"max_new_tokens": 60})
    new = transformers.AutoModelForCausalLM.from_pretrained(engine.model_path).eval()
    new.load_state_dict(perturbed_state(new, seed=8))
    new.save_pretrained(tmp_path / "v3")

    async def scenario() -> None:
        engine.start()
        (old,) = await engine.generate([GenerationRequest(prompt, params)])
        progress = Tokens()
        running = start(engine, prompt, params, progress)
        await progress.at_least(2)
        update = asyncio.ensure_future(asyncio.to_thread(engine.update_from_disk, str(tmp_path / "v3"), "3"))
        while not engine._updates_waiting and not update.done():  # the update waits (or, on a slow machine, ran)
            await asyncio.sleep(0.001)
        later = start(engine, prompt, params)
        (first,) = await running
        await update
        (second,) = await later
        assert first.output_ids == old.output_ids  # all of it under the old weights
        assert second.output_ids != old.output_ids  # all of it under the new ones
        assert engine.weight_version == "3"

    asyncio.run(scenario())


def test_a_failing_step_fails_only_its_request(engine: LocalEngine) -> None:
    """A request whose streaming callback raises from its third token on fails the step it is in: the others are
    prefilled again and run alone, with the tokens they get alone; only that request fails."""

    def breaks(token: int, logprob: float, top: object) -> None:
        breaks.calls += 1
        if breaks.calls >= 3:
            raise RuntimeError("the consumer broke")

    breaks.calls = 0
    prompts = [[3, 4], [5], [6, 7, 8]]

    async def scenario() -> None:
        engine.start()
        alone = [(await engine.generate([GenerationRequest(p, SEEDED)]))[0] for p in prompts]
        await engine.pause("in_place")  # so that all of them join one batch
        good = [start(engine, p, SEEDED) for p in prompts]
        bad = asyncio.ensure_future(engine.generate([GenerationRequest([9], SEEDED, on_token=breaks)]))
        await asyncio.sleep(0)
        engine.resume()
        with pytest.raises(RuntimeError, match="the consumer broke"):
            await bad
        for prompt, single, task in zip(prompts, alone, good, strict=True):
            (batched,) = await task
            assert_same(engine.model, prompt, single, batched)

    asyncio.run(scenario())


def test_rows_leaving_the_batch_take_the_padding_columns_with_them(engine: LocalEngine) -> None:
    """The step API itself: a long prompt's row leaves, the columns that only it used are trimmed, and the row left
    goes on with the tokens it gets alone."""
    short = GenerationRequest([9, 10], GREEDY)
    (alone,) = generate_batch(engine.model, [short])
    batch = RunningBatch(engine.model)
    rows = [FixedRow(r, Sampler(r, set(), 0)) for r in (GenerationRequest(list(range(3, 23)), LONG), short)]
    batch.prefill(rows)
    batch.step()
    assert batch.mask.shape == (2, 21) and batch.cache.layers[0].keys.shape[2] == 21
    assert batch.remove([rows[0]]) == [rows[0]] and batch.remove([rows[0]]) == []
    assert batch.mask.shape == (1, 3) and batch.cache.layers[0].keys.shape[2] == 3  # the short row's prompt + 1
    while not batch.finished():
        batch.step()
    assert_same(engine.model, short.input_ids, alone, result_of(rows[1].sampler))
    assert len(batch) == 0 and batch.cache is None


def test_max_batch_size_caps_the_running_batch(model_dir: Path, tmp_path: Path) -> None:
    """With two rows at most, a third request waits in the queue until a running one leaves, then joins."""
    engine = LocalEngine(model_dir, staging_dir=tmp_path, max_batch_size=2)

    async def scenario() -> None:
        engine.start()
        progress = [Tokens(), Tokens(), Tokens()]
        tasks = [start(engine, [3 + i], LONG, tokens) for i, tokens in enumerate(progress)]
        await progress[0].at_least(2)
        await progress[1].at_least(2)
        assert engine.queued == 1 and progress[2].ids == [] and len(engine._batch) == 2
        tasks[0].cancel()
        await progress[2].at_least(1)  # it took the free row
        assert not tasks[1].done()
        for task in tasks[1:]:
            task.cancel()

    asyncio.run(scenario())
