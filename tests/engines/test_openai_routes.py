"""The local engine's OpenAI-compatible routes and SGLang's native streaming, against a real server on 127.0.0.1,
driven by the real ``openai`` client: answers equal the native ``/generate``'s, streams arrive as chunks, and
hostile or unsupported requests get OpenAI-shaped 4xx errors while the engine keeps serving."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import transformers

from miles_core.builtin.local_engine.engine import LocalEngine, TokenUpdate
from miles_core.builtin.local_engine.sampling import GenerationRequest, GenerationResult, SamplingParams
from miles_core.builtin.local_engine.serving import held_back
from miles_core.default.tokenizer import DigitTokenizer
from miles_core.testkit.tiny_models import save_tiny_llama
from miles_core.testkit.tokenizers import save_char_tokenizer
from tests.engines.test_local_engine_hostile import EngineProcess, wait_for

pytestmark = pytest.mark.slow

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 <>:\n.,!?"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)
GREEDY = {"temperature": 0, "max_tokens": 12}
STREAMED = {"temperature": 0, "max_tokens": 48, "extra_body": {"ignore_eos": True}}  # long enough for many chunks
CONTEXT = 4096  # long enough that an abandoned stream is cut visibly short


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a character tokenizer that has a chat template."""
    path = save_tiny_llama(tmp_path_factory.mktemp("chat") / "model", max_position_embeddings=CONTEXT)
    tokenizer = save_char_tokenizer(path, ALPHABET)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    process = EngineProcess(model_dir, tmp_path_factory.mktemp("openai"), admin_key="openai-admin")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(engine: EngineProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{engine.url}/v1", api_key="not-needed", max_retries=0, timeout=120) as c:
        yield c


def native(engine: EngineProcess, body: dict) -> dict:
    response = httpx.post(f"{engine.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def greedy_native(engine: EngineProcess, ids: list[int], max_new_tokens: int = 12, **extra: object) -> dict:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    return native(engine, {"input_ids": ids, "sampling_params": params, **extra})


def encode(model_dir: Path, text: str) -> list[int]:
    return transformers.AutoTokenizer.from_pretrained(model_dir).encode(text)


def chat_ids(model_dir: Path, messages: list[dict]) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


# -- answers --------------------------------------------------------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI, model_dir: Path) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [str(model_dir)]


def test_a_greedy_completion_equals_native_generate(engine, client, model_dir) -> None:
    ids = encode(model_dir, "hello world")
    expected = greedy_native(engine, ids)
    for prompt in ("hello world", ids):
        out = client.completions.create(model="any", prompt=prompt, **GREEDY)
        assert out.choices[0].text == expected["text"]
        assert out.usage.prompt_tokens == len(ids)
        assert out.usage.completion_tokens == len(expected["output_ids"])
        assert out.choices[0].finish_reason == (
            "length" if expected["meta_info"]["finish_reason"]["type"] == "length" else "stop"
        )


def test_several_prompts_are_several_choices(engine, client, model_dir) -> None:
    prompts = [encode(model_dir, "abc"), encode(model_dir, "xyz")]
    out = client.completions.create(model="m", prompt=prompts, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [greedy_native(engine, p)["text"] for p in prompts]


def test_a_greedy_chat_equals_native_generate_on_the_templated_prompt(engine, client, model_dir) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    expected = greedy_native(engine, chat_ids(model_dir, messages))
    out = client.chat.completions.create(model="m", messages=messages, **GREEDY)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected["text"]
    assert out.usage.prompt_tokens == len(chat_ids(model_dir, messages))
    assert out.object == "chat.completion"


def test_a_streamed_completion_arrives_in_chunks_and_equals_the_whole(client) -> None:
    whole = client.completions.create(model="m", prompt="stream me", **STREAMED)
    chunks = list(
        client.completions.create(
            model="m", prompt="stream me", stream=True, stream_options={"include_usage": True}, **STREAMED
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text
    assert len([t for t in texts if t]) > 1  # token by token, not everything at the end
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_streamed_chat_arrives_in_chunks_and_equals_the_whole(client) -> None:
    messages = [{"role": "user", "content": "tell me"}]
    whole = client.chat.completions.create(model="m", messages=messages, **STREAMED)
    chunks = list(client.chat.completions.create(model="m", messages=messages, stream=True, **STREAMED))
    assert chunks[0].choices[0].delta.role == "assistant"
    contents = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(contents) == whole.choices[0].message.content
    assert len([t for t in contents if t]) > 1
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_completion_logprobs_are_the_native_ones(engine, client, model_dir) -> None:
    ids = encode(model_dir, "logprobs")
    expected = greedy_native(engine, ids, return_logprob=True, top_logprobs_num=3)
    out = client.completions.create(model="m", prompt=ids, logprobs=3, **GREEDY).choices[0].logprobs
    native_lps = [lp for lp, _, _ in expected["meta_info"]["output_token_logprobs"]]
    assert out.token_logprobs == pytest.approx(native_lps, abs=1e-6)  # same engine, same batch shape: same floats
    assert all(
        len(top) <= 3 and max(top.values()) == pytest.approx(lp)
        for top, lp in zip(out.top_logprobs, out.token_logprobs, strict=True)
    )  # greedy: the chosen is the top
    assert out.text_offset[0] == 0 and out.text_offset == sorted(out.text_offset)
    assert [len(p) for p in expected["meta_info"]["output_top_logprobs"]] == [3] * len(native_lps)


def test_chat_logprobs_and_top_logprobs(client) -> None:
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2, **GREEDY
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy: the chosen token is the top
        assert item.bytes == list(item.token.encode())
    streamed = list(
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2, stream=True, **GREEDY
        )
    )
    tokens = [i.logprob for c in streamed if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert tokens == pytest.approx([i.logprob for i in content], abs=1e-6)


def test_stop_strings_cut_the_text_and_end_the_generation(engine, client, model_dir) -> None:
    ids = encode(model_dir, "stop here")
    full = greedy_native(engine, ids, max_new_tokens=24)
    text = full["text"]
    stop = next((text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2] not in text[: i + 1]), None)
    assert stop is not None, f"the greedy output {text!r} has no two characters that first appear late"
    cut = text[: text.index(stop)]
    out = client.completions.create(model="m", prompt=ids, temperature=0, max_tokens=24, stop=[stop, "never!"])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < len(full["output_ids"])  # the engine stopped, not just the text
    streamed = client.completions.create(model="m", prompt=ids, temperature=0, max_tokens=24, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut  # never a piece of the stop string
    stopped = native(
        engine, {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 24, "stop": stop}}
    )
    assert stopped["text"] == cut and stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_a_seed_makes_sampling_reproducible(client) -> None:
    runs = [
        client.completions.create(
            model="m", prompt="seeded", temperature=1.0, max_tokens=16, seed=seed, extra_body={"ignore_eos": True}
        )
        for seed in (5, 5, 6)
    ]
    texts = [r.choices[0].text for r in runs]
    assert texts[0] == texts[1] and texts[0] != texts[2]
    assert all(r.usage.completion_tokens == 16 for r in runs)


def test_an_authorization_header_does_not_break_the_data_plane(engine) -> None:
    for header in ("Bearer whatever", "Basic abc", "garbage"):
        response = httpx.post(
            f"{engine.url}/v1/completions",
            headers={"Authorization": header},
            json={"model": "m", "prompt": "a", "max_tokens": 1},
        )
        assert response.status_code == 200, response.text


# -- refusals -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param", "match"),
    [
        ({"n": 2}, "n", "n=2"),
        ({"n": 10**9}, "n", "one choice per prompt"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate", "unknown field 'frobnicate'"),
        ({"echo": True}, "echo", "echo=true is not supported"),
        ({"best_of": 3}, "best_of", "best_of=3"),
        ({"presence_penalty": 0.5}, "presence_penalty", "presence_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias", "logit_bias"),
        ({"temperature": 3.0}, "temperature", "less than or equal to 2"),
        ({"max_tokens": 10**9}, None, "context length"),
        ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
        ({"logprobs": 50}, "logprobs", "less than or equal to 20"),
        ({"stop": ["x"] * 20}, "stop", "at most 16"),
        ({"prompt": []}, "prompt", "1 to 16384 prompts"),
        ({"prompt": [1, "a"]}, "prompt", "prompt must be"),
        ({"prompt": [[1], [100000]]}, None, "token ids are integers from 0 to 63"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream=true"),
        ({"prompt": ["a", "b"], "stream": True}, "prompt", "stream=true takes one prompt"),
        ({"seed": -3}, "seed", "greater than or equal to 0"),
    ],
)
def test_bad_completion_requests_are_openai_400s(client, kwargs: dict, param: str | None, match: str) -> None:
    request = {"model": "m", "prompt": "a", "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        result = client.completions.create(**request)
        list(result) if request.get("stream") else None
    error = caught.value.body
    assert match in error["message"], error
    assert error["param"] == param and error["type"] == "invalid_request_error", error


@pytest.mark.parametrize(
    ("kwargs", "param", "match"),
    [
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs=true"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role", "Input should be"),
        ({"messages": []}, "messages", "at least 1 item"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "unknown field 'tools'"),
        ({"response_format": {"type": "json_object"}}, "response_format.type", "Input should be 'text'"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", "differ"),
        ({"n": 3}, "n", "n=3"),
    ],
)
def test_bad_chat_requests_are_openai_400s(client, kwargs: dict, param: str, match: str) -> None:
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**request)
    assert match in caught.value.body["message"] and caught.value.body["param"] == param, caught.value.body


@pytest.mark.parametrize(
    ("content", "status", "match"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b'{"model": "m", "prompt": "a", "prompt": "b"}', 400, "twice"),
        (b'{"model": "m", "prompt": "a", "temperature": NaN}', 400, "NaN"),
        (b'{"model": "m", "prompt": "a", "max_tokens": "5"}', 400, "max_tokens"),
        (b'{"model": "m", "prompt": "a", "stream": "yes"}', 400, "stream"),
        (b'{"model": 5, "prompt": "a"}', 400, "model"),
        (b'{"prompt": "a"}', 400, "model: Field required"),
        (b'{"model": "m", "prompt": {"a": 1}}', 400, "prompt"),
        (b'{"model": "m", "prompt": "a", "max_tokens": true}', 400, "max_tokens"),
        (b'{"model": "m", "prompt": "' + b"[" * 100 + b'"}', 200, ""),  # brackets in a string are text
    ],
)
def test_hostile_bodies_are_openai_errors_and_the_engine_stays_up(
    engine, content: bytes, status: int, match: str
) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = httpx.post(f"{engine.url}{path}", content=content, timeout=60)
        if status == 200 and path.endswith("chat/completions"):
            continue  # a completion body is not a chat body
        assert response.status_code == status, response.text
        if status != 200:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and match in error["message"], error
    assert httpx.get(f"{engine.url}/health_generate", timeout=60).status_code == 200


def test_browser_requests_are_refused_in_openai_shape(engine) -> None:
    body = {"model": "m", "prompt": "a", "max_tokens": 1}
    rebound = httpx.post(f"{engine.url}/v1/completions", json=body, headers={"Host": f"evil.example:{engine.port}"})
    assert rebound.status_code == 421 and "is not a name" in rebound.json()["error"]["message"]
    posted = httpx.post(f"{engine.url}/v1/chat/completions", json=body, headers={"Origin": "http://evil.example"})
    assert posted.status_code == 403 and "web pages" in posted.json()["error"]["message"]


def test_a_huge_body_is_413_in_openai_shape(engine) -> None:
    response = httpx.post(f"{engine.url}/v1/completions", content=b" " * (33 << 20), timeout=120)
    assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"


def test_chat_without_a_chat_template_is_a_clear_400(model_dir: Path, tmp_path: Path) -> None:
    """The embedded default's digit tokenizer has no chat template: chat says so, completions still work."""
    path = save_tiny_llama(tmp_path / "default-tokenizer")
    DigitTokenizer().save_pretrained(path)
    process = EngineProcess(path, tmp_path, admin_key="k")
    try:
        with openai.OpenAI(base_url=f"{process.url}/v1", api_key="x", max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "12"}])
            assert caught.value.body["code"] == "no_chat_template"
            assert "without a chat template" in caught.value.body["message"]
            assert str(path) in caught.value.body["message"]
            out = client.completions.create(model="m", prompt="73915:", max_tokens=4, temperature=0)
            assert set(out.choices[0].text) <= set(":0123456789")
    finally:
        process.stop()


def test_a_stream_whose_client_leaves_is_cancelled(engine) -> None:
    body = {"model": "m", "prompt": "long", "max_tokens": CONTEXT - 10, "stream": True, "ignore_eos": True}
    before = httpx.get(f"{engine.url}/server_info", timeout=10).json()["internal_states"][0]["generated_tokens"]
    with httpx.stream("POST", f"{engine.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # generation has begun

    def state() -> dict:
        return httpx.get(f"{engine.url}/server_info", timeout=10).json()["internal_states"][0]

    wait_for(lambda: state()["in_flight"] == 0, "the abandoned stream to be cancelled")
    assert state()["generated_tokens"] - before < CONTEXT - 10  # cut short, not run to its end


# -- SGLang's native /generate ----------------------------------------------------------------------------------


def sse_events(engine: EngineProcess, body: dict) -> list[str]:
    with httpx.stream("POST", f"{engine.url}/generate", json=body, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def test_native_streaming_is_sglangs_cumulative_sse(engine) -> None:
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    whole = native(engine, {"input_ids": [5, 6, 7], "sampling_params": params, "return_logprob": True})
    events = sse_events(
        engine, {"input_ids": [5, 6, 7], "sampling_params": params, "stream": True, "return_logprob": True}
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 1
    for before, after in itertools.pairwise(chunks):  # cumulative: each extends the one before
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert chunks[-1]["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]


def test_native_logprob_options(engine, model_dir) -> None:
    out = native(
        engine,
        {
            "input_ids": [5, 6],
            "sampling_params": {"temperature": 0, "max_new_tokens": 4},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
    )
    meta = out["meta_info"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert [text for _, _, text in meta["output_token_logprobs"]] == [
        tokenizer.decode([t], skip_special_tokens=True) for t in out["output_ids"]
    ]
    assert [top[0][1] for top in meta["output_top_logprobs"]] == out["output_ids"]


def test_bench_servings_native_payload_is_accepted(engine) -> None:
    """What ``sglang.bench_serving --backend sglang`` sends (its defaults), field for field."""
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True},
        "stream": False,
        "lora_path": None,
        "return_logprob": False,
        "return_routed_experts": False,
        "logprob_start_len": -1,
    }
    assert len(native(engine, body)["output_ids"]) == 3


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"frobnicate": 1}, "unknown field 'frobnicate'"),
        ({"lora_path": "adapter"}, "lora_path 'adapter' names no loaded adapter"),
        ({"image_data": "http://x/y.png"}, "image_data"),
        ({"return_hidden_states": True}, "return_hidden_states"),
        ({"logprob_start_len": 0}, "logprob_start_len"),
        ({"custom_logit_processor": "x"}, "custom_logit_processor"),
        ({"session_params": {"id": "s"}}, "session_params"),
        ({"bootstrap_host": "10.0.0.1"}, "bootstrap_host"),
        ({"stream_interval": 4}, "unknown field 'stream_interval'"),
        ({"top_logprobs_num": 21}, "top_logprobs_num"),
        ({"return_text_in_logprobs": "yes"}, "return_text_in_logprobs"),
        ({"log_metrics": "no"}, "log_metrics"),
        ({"input_ids": [[5], [6]], "stream": True}, "stream=true takes one prompt"),
        ({"return_routed_experts": 0}, "return_routed_experts"),
    ],
)
def test_native_fields_are_handled_or_refused_by_name(engine, extra: dict, match: str) -> None:
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, **extra}
    response = httpx.post(f"{engine.url}/generate", json=body, timeout=60)
    assert response.status_code == 400 and match in response.json()["error"], response.text


def test_engine_stream_updates_add_up_to_the_result_and_closing_it_cancels(model_dir: Path, tmp_path: Path) -> None:
    engine = LocalEngine(model_dir, staging_dir=tmp_path)
    params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)

    async def scenario() -> None:
        engine.start()
        items = [item async for item in engine.stream(GenerationRequest([5, 6], params, top_logprobs_num=1))]
        *updates, result = items
        assert isinstance(result, GenerationResult) and all(isinstance(u, TokenUpdate) for u in updates)
        assert [t for u in updates for t in u.output_ids] == result.output_ids and len(result.output_ids) == 32
        assert [lp for u in updates for lp in u.logprobs] == result.logprobs
        assert [top for u in updates for top in u.top_logprobs] == result.top_logprobs
        (whole,) = await engine.generate([GenerationRequest([5, 6], params)])
        assert whole.output_ids == result.output_ids  # streaming changes nothing but when tokens arrive
        stream = engine.stream(GenerationRequest([5, 6], params.model_copy(update={"max_new_tokens": 4000})))
        first = await anext(stream)
        assert isinstance(first, TokenUpdate)
        before = engine.generated_tokens
        await stream.aclose()  # the consumer leaves: the request ends at the next step
        await asyncio.to_thread(engine._wait_idle)  # the batch has ended (and counted its tokens)
        assert engine.generated_tokens - before < 4000 - len(first.output_ids)

    asyncio.run(scenario())


def test_native_streaming_never_shows_a_piece_of_a_stop_string(engine, model_dir) -> None:
    ids = encode(model_dir, "native stop")
    full = greedy_native(engine, ids, max_new_tokens=24)["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]  # cut where it first appears, which may be earlier
    assert len(stop) == 2, full
    params = {"temperature": 0, "max_new_tokens": 24, "stop": stop}
    chunks = [
        json.loads(e) for e in sse_events(engine, {"input_ids": ids, "sampling_params": params, "stream": True})[:-1]
    ]
    texts = [c["text"] for c in chunks]
    assert texts[-1] == full[: full.index(stop)]
    assert all(stop[0] not in t[full.index(stop) :] for t in texts)  # nothing of the stop string, even for a moment
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # the text only grows


@pytest.mark.parametrize(
    ("text", "stops", "sendable"),
    [
        ("hello wor", ["world"], "hello "),  # "wor" may become "world"
        ("hello world!", ["world"], "hello "),
        ("abc", [], "abc"),
        ("abc\ufffd", [], "abc"),  # an incomplete character waits for its next byte
        ("xyz", ["zq", "yzz"], "x"),  # the longest tail that may start any stop string
        ("ab", ["abc", "b"], "a"),  # "b" is there: the text ends before it, whatever "abc" would have done
    ],
)
def test_held_back(text: str, stops: list[str], sendable: str) -> None:
    assert text[: held_back(text, stops)] == sendable
