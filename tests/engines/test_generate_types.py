"""The engine's ``/generate`` as types: :class:`SamplingParams` sent, :class:`GenerateOutput` read back, against a
real local engine process (good answers), a tiny real HTTP server on 127.0.0.1 that answers in malformed shapes
(each an ``EngineError`` naming the engine), and a short ``miles train`` that generates through them."""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import json
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import transformers

import miles_core
from miles_core.engines.client import EngineClient
from miles_core.engines.generate_types import GenerateOutput, SamplingParams
from miles_core.errors import EngineError
from miles_core.testkit.tiny_models import save_tiny_llama
from miles_core.workers.local_provider import LocalWorkerProvider
from tests.conftest import run_miles
from tests.engines.test_local_engine import ADMIN, engine_spec, reference_logprobs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    provider = LocalWorkerProvider(token=ADMIN, run_dir=tmp_path_factory.mktemp("engine-run"))
    info = asyncio.run(provider.start(engine_spec("engine-0", model_dir)))
    yield info
    asyncio.run(provider.shutdown())


def run(coro):
    return asyncio.run(coro)


# -- the request side -----------------------------------------------------------------------------------------


def test_sampling_params_to_sglang_and_its_checks() -> None:
    params = SamplingParams(max_new_tokens=4, temperature=0, top_p=0.9, top_k=5)
    assert params.to_sglang() == {"max_new_tokens": 4, "temperature": 0.0, "top_p": 0.9, "top_k": 5}
    seeded = dataclasses.replace(params, sampling_seed=7)
    assert seeded.to_sglang()["sampling_seed"] == 7 and "sampling_seed" not in params.to_sglang()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 1.0  # type: ignore[misc]
    for bad, field in (
        ({"max_new_tokens": -1}, "max_new_tokens = -1"),
        ({"max_new_tokens": True}, "max_new_tokens = True"),
        ({"max_new_tokens": 4, "temperature": float("nan")}, "temperature = nan"),
        ({"max_new_tokens": 4, "temperature": -0.5}, "temperature = -0.5"),
        ({"max_new_tokens": 4, "top_p": 0.0}, "top_p = 0.0"),
        ({"max_new_tokens": 4, "top_p": 1.5}, "top_p = 1.5"),
        ({"max_new_tokens": 4, "top_k": -2}, "top_k = -2"),
        ({"max_new_tokens": 4, "sampling_seed": -1}, "sampling_seed = -1"),
    ):
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            SamplingParams(**bad)


def test_the_flat_api_exports_the_types() -> None:
    assert miles_core.GenerateOutput is GenerateOutput and miles_core.SamplingParams is SamplingParams
    assert miles_core.EngineError is EngineError
    assert {"GenerateOutput", "SamplingParams", "EngineError"} <= set(miles_core.__all__)


# -- good answers from a real local engine ----------------------------------------------------------------------


def test_greedy_with_logprobs_is_the_raw_answer_typed(engine, model_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=6, temperature=0)

    async def scenario() -> tuple[dict, GenerateOutput, list[GenerateOutput]]:
        async with EngineClient(engine.url, name="engine-0") as client:
            raw = await client.generate([5, 6, 7], params.to_sglang(), return_logprob=True)
            typed = await client.generate_outputs([5, 6, 7], params)
            batch = await client.generate_outputs(
                [[5, 6, 7], [9]], [params, dataclasses.replace(params, max_new_tokens=2)], return_logprob=False
            )
        return raw, typed, batch

    raw, typed, batch = run(scenario())
    assert isinstance(typed, GenerateOutput) and 0 < len(typed.output_ids) <= 6
    assert typed.output_ids == raw["output_ids"]  # greedy: the same answer twice
    assert typed.finish_reason == raw["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    assert typed.weight_version is None  # the engine's initial "default": nothing published yet
    assert typed.text == raw["text"] and typed.meta["completion_tokens"] == len(typed.output_ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    expected = reference_logprobs(model, [5, 6, 7], typed.output_ids)
    # float32 on both sides, the engine batched with a KV cache: rounding differences far below 1e-4
    assert max(abs(a - b) for a, b in zip(typed.logprobs, expected, strict=True)) < 1e-4
    assert batch[0].output_ids == typed.output_ids and len(batch[1].output_ids) <= 2
    assert [b.logprobs for b in batch] == [[], []]  # not asked for


def test_published_versions_are_ints_and_a_foreign_version_is_an_error(engine) -> None:
    params = SamplingParams(max_new_tokens=1, temperature=0)

    async def scenario() -> None:
        async with EngineClient(engine.url, admin_key=ADMIN, name="engine-0") as client:
            try:
                await client.update_weight_version("3")
                assert (await client.generate_outputs([4], params)).weight_version == 3
                await client.update_weight_version("v2-foreign")
                with pytest.raises(EngineError, match=r"engine engine-0 \(http.*'v2-foreign'"):
                    await client.generate_outputs([4], params)
            finally:
                await client.update_weight_version("default")  # the module's other tests expect no version
            assert (await client.generate_outputs([4], params)).weight_version is None

    run(scenario())


def test_an_aborted_request_reads_as_abort(engine) -> None:
    async def scenario() -> GenerateOutput:
        async with EngineClient(engine.url, admin_key=ADMIN, name="engine-0") as client:
            # a prompt whose greedy answer runs to the length limit, so that the request is still running when
            # the engine is paused (this small model may pick its eos early for some prompts)
            params = None
            for first in range(3, 40):
                probe = SamplingParams(max_new_tokens=200, temperature=0)
                if (await client.generate_outputs([first], probe, return_logprob=False)).finish_reason == "length":
                    prompt, params = [first], probe
                    break
            assert params is not None, "no prompt's greedy answer reached 200 tokens"
            running = asyncio.create_task(client.generate_outputs(prompt, params))
            while not (await client.server_info())["internal_states"][0]["in_flight"]:
                await asyncio.sleep(0.01)  # until the engine holds it (running or queued: both are aborted)
            await client.pause_generation("abort")
            try:
                return await running
            finally:
                await client.continue_generation()

    aborted = run(scenario())
    assert aborted.finish_reason == "abort" and aborted.aborted
    assert len(aborted.output_ids) < 200 and len(aborted.logprobs) == len(aborted.output_ids)


# -- malformed answers from a tiny real HTTP server -------------------------------------------------------------


class _Answers(http.server.BaseHTTPRequestHandler):
    """Answers every POST with the body its server holds (``server.answer``, raw bytes)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        answer = self.server.answer  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: object) -> None:
        pass  # quiet tests


@pytest.fixture
def bad_engine() -> Iterator[http.server.HTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


GOOD_META = {"finish_reason": {"type": "length", "length": 2}, "weight_version": "3"}
LOGPROBS = [[-0.5, 4, None], [-1.5, 5, None]]


def answer(**changes: object) -> dict:
    body = {"text": "ab", "output_ids": [4, 5], "meta_info": {**GOOD_META, "output_token_logprobs": LOGPROBS}}
    for key, value in changes.items():
        target = body["meta_info"] if key in ("finish_reason", "weight_version", "output_token_logprobs") else body
        if value is ...:
            del target[key]  # type: ignore[attr-defined]
        else:
            target[key] = value  # type: ignore[index]
    return body


MALFORMED = [
    ([1, 2], "expected a JSON object, got \\[1, 2\\]"),
    ("oops", "expected a JSON object, got 'oops'"),
    (answer(output_ids=...), "output_ids = None, expected a list of token ids"),
    (answer(output_ids=["a"]), "output_ids = \\['a'\\]"),
    (answer(output_ids=[4, True]), "output_ids = \\[4, True\\]"),
    (answer(meta_info=...), "meta_info = None, expected an object"),
    (answer(meta_info=[]), "meta_info = \\[\\], expected an object"),
    (answer(text=7), "text = 7, expected a string"),
    (answer(finish_reason=...), "meta_info.finish_reason = None"),
    (answer(finish_reason="stop"), "meta_info.finish_reason = 'stop', expected an object with a string 'type'"),
    (answer(finish_reason={"type": 3}), "meta_info.finish_reason = \\{'type': 3\\}"),
    (answer(output_token_logprobs=...), "output_token_logprobs = None, expected a list of 2 .*return_logprob"),
    (answer(output_token_logprobs=LOGPROBS[:1]), "expected a list of 2 \\[logprob, token_id, text\\] entries"),
    (answer(output_token_logprobs=[LOGPROBS[0], [-1.5, 9, None]]), "output_token_logprobs\\[1\\] = .* id 5"),
    (answer(output_token_logprobs=[LOGPROBS[0], ["x", 5, None]]), "output_token_logprobs\\[1\\]"),
    (answer(output_token_logprobs=[LOGPROBS[0], -1.5]), "output_token_logprobs\\[1\\] = -1.5"),
    (answer(weight_version=...), "reported weight_version missing"),
    (answer(weight_version=3), "reported weight_version 3: expected 'default'"),
    (answer(weight_version="-1"), "reported weight_version '-1'"),
    (answer(weight_version="٣"), "reported weight_version '٣'"),  # a digit, but not an ASCII one
]


@pytest.mark.parametrize(("body", "message"), MALFORMED)
def test_a_malformed_answer_is_an_engine_error_naming_the_engine(bad_engine, body: object, message: str) -> None:
    bad_engine.answer = json.dumps(body).encode()
    url = f"http://127.0.0.1:{bad_engine.server_address[1]}"

    async def scenario() -> None:
        async with EngineClient(url, name="odd-engine") as client:
            await client.generate_outputs([4], SamplingParams(max_new_tokens=2))

    with pytest.raises(EngineError, match=f"engine odd-engine \\({url}\\) .*{message}"):
        run(scenario())


def test_an_aborted_answer_may_lack_logprobs_and_version_but_not_its_shape(bad_engine) -> None:
    url = f"http://127.0.0.1:{bad_engine.server_address[1]}"

    async def call() -> GenerateOutput:
        async with EngineClient(url, name="odd-engine") as client:
            return await client.generate_outputs([4], SamplingParams(max_new_tokens=2))

    abort = {"type": "abort", "message": "aborted while queued"}
    bare = {"text": "", "output_ids": [], "meta_info": {"finish_reason": abort}}
    bad_engine.answer = json.dumps(bare).encode()
    output = run(call())
    assert (output.aborted, output.output_ids, output.logprobs, output.weight_version) == (True, [], [], None)
    bad_engine.answer = json.dumps(answer(finish_reason=abort, output_token_logprobs=LOGPROBS[:1])).encode()
    with pytest.raises(EngineError, match=r"odd-engine .*expected a list of 2"):  # what it has is still checked
        run(call())


def test_non_finite_logprobs_and_wrong_batch_shapes_are_engine_errors(bad_engine) -> None:
    url = f"http://127.0.0.1:{bad_engine.server_address[1]}"
    params = SamplingParams(max_new_tokens=2)

    async def call(prompts: list) -> object:
        async with EngineClient(url, name="odd-engine") as client:
            return await client.generate_outputs(prompts, params)

    bad_engine.answer = json.dumps(answer(output_token_logprobs=[[float("nan"), 4, None], LOGPROBS[1]])).encode()
    with pytest.raises(EngineError, match=r"odd-engine .*output_token_logprobs\[0\] = \[nan, 4, None\]"):
        run(call([4]))
    bad_engine.answer = json.dumps(answer()).encode()  # one answer where a list of two is due
    with pytest.raises(EngineError, match=r"odd-engine .*expected a list of 2 answers for 2 prompts, got dict"):
        run(call([[4], [5]]))
    bad_engine.answer = json.dumps([answer()]).encode()
    with pytest.raises(EngineError, match=r"expected a list of 2 answers for 2 prompts, got list of 1"):
        run(call([[4], [5]]))
    bad_engine.answer = b"<html>not json</html>"
    with pytest.raises(EngineError, match=r"odd-engine .*output_ids = None"):
        run(call([4]))
    bad_engine.answer = json.dumps([answer(), answer()]).encode()  # and the good shape reads
    assert [o.weight_version for o in run(call([[4], [5]]))] == [3, 3]


def test_prompts_and_params_that_do_not_pair_are_refused_before_sending(bad_engine) -> None:
    url = f"http://127.0.0.1:{bad_engine.server_address[1]}"
    params = SamplingParams(max_new_tokens=2)

    async def call(prompts: list, sampling: object) -> object:
        async with EngineClient(url, name="odd-engine") as client:
            return await client.generate_outputs(prompts, sampling)

    for prompts, sampling, message in (
        ([[4], [5]], [params] * 3, "2 prompt\\(s\\) and 3 SamplingParams"),
        ([4], [params], "1 prompt\\(s\\) and 1 SamplingParams"),  # a list of params is for a batch
        ([], params, "0 prompt\\(s\\)"),
    ):
        with pytest.raises(ValueError, match=message):
            run(call(prompts, sampling))


# -- the rollout through the typed path -------------------------------------------------------------------------


def test_a_short_train_run_generates_through_the_types(tmp_path: Path) -> None:
    quick = ["--no-progress", "--rollout-batch-size", "4", "--rollout-group-size", "4", "--run-eval-every", "0"]
    result = run_miles("train", "--output-dir", str(tmp_path), *quick, "--num-steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[0]["eval/samples"] == 64  # the greedy evals too
    with sqlite3.connect(tmp_path / "dashboard.sqlite") as db:
        rows = db.execute("SELECT step, data FROM samples ORDER BY step, sample_index").fetchall()
    versions = {(step, json.loads(data)["weight_version"]) for step, data in rows}
    finish = {json.loads(data)["finish_reason"] for _, data in rows}
    assert len(rows) == 2 * 16 and finish <= {"stop", "length"}
    # step 1 trains on answers of the initial weights (SGLang's "default": None); step 2 on those of version 1
    assert versions == {(1, None), (2, 1)}
