"""The session server against a real local engine serving the embedded default model, both started through the
``LocalWorkerProvider`` from their specs, driven by the real ``openai`` client: a three-turn conversation with a
tool message is token-in-token-out (the trajectory's ids are exactly the engine's generated ids plus the appended
message tokens, loss mask 1 exactly on the generated ones), and hostile requests get 4xx answers in OpenAI's error
shape while the server keeps serving."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from miles_core.builtin.chat_formats import DigitChatFormat
from miles_core.default.tokenizer import DigitTokenizer
from miles_core.rollout.sessions import ChatMessage, ToolCall
from miles_core.rollout.sessions.server import SessionLimits, session_server_spec
from miles_core.run_setup import default_model
from miles_core.workers.local_provider import LocalWorkerProvider
from miles_core.workers.process import free_ports
from miles_core.workers.specs import CommandWorkerSpec

DIGIT_FORMAT = "miles_core.builtin.chat_formats:DigitChatFormat"
"""The embedded default's chat format, as a session server is given it (the driver resolves ``default`` to it)."""

pytestmark = pytest.mark.slow

TOKEN = "session-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BOS, EOS, COLON = 2, 1, 3
USER, ASSISTANT, TOOL = ([BOS, role, COLON] for role in (5, 6, 7))  # <bos>, the role's digit, ':'
MAX_TOKENS = 6
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
LIMITS = SessionLimits(max_sessions=6, max_request_bytes=64 << 10, max_session_tokens=400, idle_timeout_s=600)
SHORT_LIVED = SessionLimits(max_sessions=4, max_request_bytes=64 << 10, max_session_tokens=400, idle_timeout_s=2.0)
CALCULATOR = {
    "type": "function",
    "function": {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {}}}},
}
STARTUP_TIMEOUT_S = 300.0


def digits(text: str) -> list[int]:
    return DigitTokenizer().encode(text, add_bos=False)


PAD, ZERO, COLON_ID = 0, 4, 3  # the ids of <pad>, "0" and ":"
SUCCESSOR = {COLON_ID: ZERO, ZERO: PAD}  # every other token: ":"
TOOL_CALLER_TOKENS = 7  # "0" <pad> ":" "0" <pad> ":" "0"


def save_tool_caller(path: Path) -> Path:
    """The embedded default's architecture and tokenizer with weights set to a bigram table, so that its greedy
    turn after ``<bos>2:`` is ``0 <pad> : 0 <pad> : 0``: content ``0`` and the tool call ``:0:0`` (tool 0 with the
    argument ``0``), with two ``<pad>`` tokens that decoding drops, so encoding the conversation again would lose
    them. Attention and MLP outputs are zero, so a position's hidden state is its token's embedding (one-hot), and
    the output layer maps each token to its :data:`SUCCESSOR`."""
    tokenizer = DigitTokenizer()
    tokenizer.save_pretrained(path)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(config.vocab_size, config.hidden_size))
        model.model.norm.weight.fill_(1.0)
        head = torch.zeros(config.vocab_size, config.hidden_size)
        for token in range(config.vocab_size):
            head[SUCCESSOR.get(token, COLON_ID), token] = 1.0  # logit 8 (the RMS-normed one-hot) against 0
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    return path


class Servers:
    """Two engines (the embedded default model, untrained, and :func:`save_tool_caller`'s) and three session
    servers (one in front of each engine, one with a short idle timeout in front of a port where nothing listens),
    started through one ``LocalWorkerProvider`` on a private event loop."""

    def __init__(self, run_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.provider = LocalWorkerProvider(token=TOKEN, run_dir=run_dir)
        self.model = default_model(run_dir, seed=0)
        self.engine = self._start(self._engine_spec("engine-0", self.model))
        self.tool_engine = self._start(self._engine_spec("engine-1", save_tool_caller(run_dir / "tool_caller")))
        self.url = self._start(self._spec("sessions-0", self.engine, LIMITS))
        self.dead_port = free_ports(1)[0]  # no engine: nothing listens there (a test makes it a black hole a while)
        self.short_url = self._start(self._spec("sessions-1", f"http://127.0.0.1:{self.dead_port}", SHORT_LIVED))
        self.tool_url = self._start(self._spec("sessions-2", self.tool_engine, LIMITS))

    @staticmethod
    def _engine_spec(name: str, model: Path) -> CommandWorkerSpec:
        argv = [sys.executable, "-m", "miles_core.builtin.local_engine.server", "--model-path", str(model)]
        argv += ["--host", "{host}", "--port", "{port}", "--admin-api-key", "{token}", "--cpu-threads", "1"]
        return CommandWorkerSpec(
            name=name, argv=argv, ports=["port"], health_url="http://{host}:{port}/health_generate"
        )

    def _spec(self, name: str, engine_url: str, limits: SessionLimits) -> CommandWorkerSpec:
        return session_server_spec(
            startup_timeout_s=STARTUP_TIMEOUT_S,
            name=name,
            engine_url=engine_url,
            model_path=str(self.model),
            chat_format=DIGIT_FORMAT,
            limits=limits,
        )

    def _start(self, spec: CommandWorkerSpec) -> str:
        info = self.loop.run_until_complete(self.provider.start(spec))
        assert info.url is not None
        return info.url

    def stop(self) -> None:
        try:
            self.loop.run_until_complete(self.provider.shutdown())
        finally:
            self.loop.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    started = Servers(tmp_path_factory.mktemp("sessions"))
    yield started
    started.stop()


def create(url: str, messages: list[dict], **body: object) -> dict:
    response = httpx.post(f"{url}/sessions", json={"messages": messages, **body}, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def trajectory(url: str, sid: str) -> dict:
    response = httpx.get(f"{url}/sessions/{sid}/trajectory", headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def engine_greedy(engine: str, input_ids: list[int], max_tokens: int) -> dict:
    """The engine's own answer for ``input_ids``, asked directly (greedy, so it is the answer the session got)."""
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens}}
    body["return_logprob"] = True
    response = httpx.post(f"{engine}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def assert_openai_error(response: httpx.Response, status: int, *, code: str | None = None, says: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert says in error["message"], error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def closed(generated: list[int]) -> list[int]:
    """The tokens the default format puts after a generated turn: ``<eos>`` unless the turn ended with it."""
    return [] if generated and generated[-1] == EOS else [EOS]


@pytest.mark.parametrize("model", ["default", "tool_caller"])
def test_three_turns_with_a_tool_are_token_in_token_out(servers: Servers, model: str) -> None:
    """The untrained default model writes plain content; the tool caller calls tool 0 every turn, so its answers
    carry ``tool_calls`` that the openai client resends and tool results answer by ``tool_call_id``."""
    url, engine = (servers.url, servers.engine) if model == "default" else (servers.tool_url, servers.tool_engine)
    max_tokens = MAX_TOKENS if model == "default" else TOOL_CALLER_TOKENS
    prompt = [{"role": "user", "content": "73915:"}]
    session = create(url, prompt, sampling={**GREEDY, "max_tokens": max_tokens}, metadata={"sample_index": 3})
    assert session["base_url"] == f"{url}/sessions/{session['session_id']}/v1"
    fmt = DigitChatFormat()
    with openai.OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0, timeout=120) as client:
        assert [card.id for card in client.models.list()] == ["policy"]
        messages: list = list(prompt)
        answers = []
        for new in ([], [{"role": "tool", "content": "42"}], [{"role": "user", "content": "5:"}]):
            if answers:  # the agent resends the answer as it got it, then the tool result or the user's message
                message = answers[-1].choices[0].message
                messages.append(message)
                if message.tool_calls and new[0]["role"] == "tool":
                    new = [{**new[0], "tool_call_id": message.tool_calls[0].id}]
            messages += new
            answers.append(client.chat.completions.create(model="default", messages=messages, tools=[CALCULATOR]))
    got = trajectory(url, session["session_id"])
    assert got["metadata"] == {"sample_index": 3}
    if model == "tool_caller":
        for answer in answers:
            assert answer.choices[0].finish_reason == "tool_calls"
            call = answer.choices[0].message.tool_calls[0]
            assert (call.function.name, call.function.arguments) == ("calculator", '{"expression": "0"}')
    turns = got["turns"]
    assert len(turns) == 3 and len(got["finish_reasons"]) == 3
    generated = [got["response_ids"][t["start"] : t["end"]] for t in turns]

    # each turn is what the engine itself generates from the TITO ids (asked directly, greedy)
    context = [*USER, *digits("73915:"), EOS, *ASSISTANT]
    assert got["prompt_ids"] == context
    appended = [[*TOOL, *digits("42"), EOS, *ASSISTANT], [*USER, *digits("5:"), EOS, *ASSISTANT]]
    for index, ids in enumerate(generated):
        direct = engine_greedy(engine, context, max_tokens)
        assert ids == direct["output_ids"], f"turn {index}"
        lps = [lp for lp, _, _ in direct["meta_info"]["output_token_logprobs"]]
        start = turns[index]["start"]
        session_lps = got["logprobs"][start : turns[index]["end"]]
        # the same ids through the same model: equal up to float32 rounding of a batch computed differently
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(session_lps, lps, strict=True))
        content, calls = fmt.parse_tool_calls(ids, tools=[CALCULATOR])
        message = answers[index].choices[0].message
        assert (message.content or "") == content
        assert [ToolCall(c.function.name, c.function.arguments) for c in message.tool_calls or []] == calls
        context = [*context, *ids]
        if index < 2:
            context += closed(ids) + appended[index]
    assert got["prompt_ids"] + got["response_ids"] == context  # exactly generated + appended tokens

    # loss mask 1 exactly on the generated tokens, logprobs 0.0 on the others
    generated_positions = {p for t in turns for p in range(t["start"], t["end"])}
    assert got["loss_mask"] == [int(p in generated_positions) for p in range(len(got["response_ids"]))]
    assert all(lp == 0.0 for lp, m in zip(got["logprobs"], got["loss_mask"], strict=True) if m == 0)
    assert sum(got["loss_mask"]) == sum(len(ids) for ids in generated) > 0
    if model == "tool_caller":  # the drift that TITO avoids: rendering the messages again loses the <pad> tokens
        assert all(ids.count(PAD) == 2 for ids in generated)
        rendered = fmt.render_messages(
            conversation(messages, answers[-1]), tools=[CALCULATOR], add_generation_prompt=False
        )
        assert PAD not in rendered and rendered != got["prompt_ids"] + got["response_ids"] + [EOS]


def conversation(messages: list, last: openai.types.chat.ChatCompletion) -> list[ChatMessage]:
    """The agent's messages and the last answer as the formats see them (what a text round trip would render)."""
    converted = []
    for message in [*messages, last.choices[0].message]:
        message = message if isinstance(message, dict) else message.model_dump(exclude_none=True)
        calls = [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        converted.append(ChatMessage(message["role"], message.get("content") or "", tool_calls=tuple(calls)))
    return converted


def chat(url: str, sid: str, body: object, **kwargs: object) -> httpx.Response:
    return httpx.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body, timeout=120, **kwargs)


def test_hostile_requests_answer_4xx_in_openai_shape_and_the_server_keeps_serving(servers: Servers) -> None:
    url = servers.url
    sid = create(url, [{"role": "user", "content": "1:"}], sampling=GREEDY)["session_id"]
    good = {"model": "m", "messages": [{"role": "user", "content": "1:"}]}
    assert_openai_error(chat(url, sid, {"model": "m"}), 400, says="messages")
    assert assert_openai_error(chat(url, sid, {**good, "temprature": 1}), 400, code="unknown_field")["param"] == (
        "temprature"
    )
    no_stream = {**good, "stream_options": {"include_usage": True}}
    assert_openai_error(chat(url, sid, no_stream), 400, says="stream_options is only allowed with stream=true")
    assert_openai_error(chat(url, sid, {**good, "n": 2}), 400, says="n")
    bad_json = httpx.post(f"{url}/sessions/{sid}/v1/chat/completions", content=b'{"model": NaN}', timeout=60)
    assert_openai_error(bad_json, 400, says="not valid JSON")
    letters = {"model": "m", "messages": [{"role": "user", "content": "1:"}, {"role": "user", "content": "hi"}]}
    assert_openai_error(chat(url, sid, letters), 400, code="chat_format", says="can only write")
    assert_openai_error(chat(url, "no-such-session", good), 404, code="unknown_session")
    huge = {"model": "m", "messages": [{"role": "user", "content": "1" * (LIMITS.max_request_bytes + 1)}]}
    assert_openai_error(chat(url, sid, huge), 413, says="exceeds the limit")
    overflow = {"model": "m", "messages": [{"role": "user", "content": "1:"}, {"role": "user", "content": "9" * 500}]}
    assert_openai_error(chat(url, sid, overflow), 400, code="context_length_exceeded")
    assert_openai_error(chat(url, sid, {**good, "max_tokens": 10_000}), 400, code="context_length_exceeded")
    # 53 tokens and 20 more fit the server's --max-session-tokens (400), not the model's context (64): the server
    # refuses it, rather than letting the engine fail the turn
    near = {"model": "m", "messages": [good["messages"][0], {"role": "user", "content": "1" * 40}], "max_tokens": 20}
    assert_openai_error(chat(url, sid, near), 400, code="context_length_exceeded", says="at most 64 a session")

    # a history that does not extend the session's: which message, which field
    first = chat(url, sid, good)
    assert first.status_code == 200, first.text
    answer = first.json()["choices"][0]["message"]
    changed = [{"role": "user", "content": "2:"}, answer, {"role": "user", "content": "3"}]
    error = assert_openai_error(chat(url, sid, {"model": "m", "messages": changed}), 400, code="history_mismatch")
    assert error["param"] == "messages.0.content" and "messages[0] (user)" in error["message"]
    forged = {**answer, "content": (answer["content"] or "") + "9"}
    resent = [good["messages"][0], forged, {"role": "user", "content": "3"}]
    error = assert_openai_error(chat(url, sid, {"model": "m", "messages": resent}), 400, code="history_mismatch")
    assert error["param"] == "messages.1.content"
    assert_openai_error(
        chat(url, sid, {"model": "m", "messages": [good["messages"][0], answer]}),
        400,
        says="add at least one new message",
    )

    # unknown routes and methods, in the same shape
    assert_openai_error(httpx.get(f"{url}/sessions/{sid}/v1/chat/completions", timeout=60), 405, says="use POST")
    assert_openai_error(httpx.get(f"{url}/v2/whatever", timeout=60), 404, says="no route '/v2/whatever'")

    # the bearer, the browser rules
    no_token = httpx.post(f"{url}/sessions", json={}, timeout=60)
    assert_openai_error(no_token, 401, says="Bearer")
    wrong = httpx.get(f"{url}/sessions/{sid}/trajectory", headers={"Authorization": "Bearer nope"}, timeout=60)
    assert_openai_error(wrong, 401)
    assert_openai_error(chat(url, sid, good, headers={"Origin": "http://evil.example"}), 403)
    assert_openai_error(chat(url, sid, good, headers={"Host": "evil.example"}), 421)
    bad_create = httpx.post(f"{url}/sessions", json={"sampling": {"temperature": -1}}, headers=AUTH, timeout=60)
    assert assert_openai_error(bad_create, 400)["param"] == "sampling.temperature"

    # too many sessions: a 429 at the limit, room again once some end
    made = []
    while True:
        response = httpx.post(f"{url}/sessions", json={}, headers=AUTH, timeout=60)
        if response.status_code != 200:
            break
        made.append(response.json()["session_id"])
    assert_openai_error(response, 429, code="too_many_sessions")
    assert made, "the server had no room for a session before this test: an earlier test left too many"
    for made_sid in made:
        assert httpx.delete(f"{url}/sessions/{made_sid}", headers=AUTH, timeout=60).status_code == 200
    assert_openai_error(httpx.get(f"{url}/sessions/{made[0]}/trajectory", headers=AUTH, timeout=60), 404)

    # and it still serves: the session goes on, and the openai client sees the errors as its own types
    follow = chat(url, sid, {"model": "m", "messages": [good["messages"][0], answer, {"role": "user", "content": "3"}]})
    assert follow.status_code == 200, follow.text
    assert len(trajectory(url, sid)["turns"]) == 2
    client = openai.OpenAI(base_url=f"{url}/sessions/nope/v1", api_key="x", max_retries=0, timeout=60)
    with client, pytest.raises(openai.NotFoundError, match="no session"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}])
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200
    assert httpx.delete(f"{url}/sessions/{sid}", headers=AUTH, timeout=60).status_code == 200


def test_one_turn_at_a_time_and_a_hung_engine_keeps_nobody_else_waiting(servers: Servers) -> None:
    """An engine that takes the request and never answers (a listening socket that accepts and stays silent): the
    session refuses a second turn meanwhile (409), other requests are served, and when the engine's connection
    drops the turn is a 502 that leaves the session as it was."""
    url = servers.short_url
    hole = socket.create_server(("127.0.0.1", servers.dead_port))
    try:
        sid = create(url, [{"role": "user", "content": "1:"}])["session_id"]
        body = {"model": "m", "messages": [{"role": "user", "content": "1:"}]}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(chat, url, sid, body)
            hole.settimeout(120)
            connection, _ = hole.accept()  # the turn's /generate has reached the "engine": the session is busy
            try:
                assert_openai_error(chat(url, sid, body), 409, says="one turn at a time")
                other = create(url, [])["session_id"]
                assert trajectory(url, other)["response_ids"] == []
                assert httpx.get(f"{url}/health", timeout=60).status_code == 200
            finally:
                connection.close()  # the engine goes away mid-request
            assert_openai_error(first.result(timeout=120), 502, says="the session is unchanged")
        assert trajectory(url, sid)["turns"] == []
    finally:
        hole.close()


def test_a_failed_generation_leaves_the_session_unchanged_and_idle_sessions_expire(servers: Servers) -> None:
    url = servers.short_url  # its engine URL is a port where nothing listens
    sid = create(url, [{"role": "user", "content": "1:"}])["session_id"]
    body = {"model": "m", "messages": [{"role": "user", "content": "1:"}]}
    assert_openai_error(chat(url, sid, body), 502, says="the session is unchanged")
    assert trajectory(url, sid)["turns"] == [] and trajectory(url, sid)["response_ids"] == []
    time.sleep(3 * SHORT_LIVED.idle_timeout_s)  # idle for longer than its timeout
    error = assert_openai_error(chat(url, sid, body), 404, code="session_expired", says="expired after 2 s")
    assert "POST /sessions" in error["message"]
    assert_openai_error(httpx.get(f"{url}/sessions/{sid}/trajectory", headers=AUTH, timeout=60), 404, says="expired")


def test_the_command_line_refuses_an_unknown_format_and_a_missing_token(servers: Servers) -> None:
    base = [sys.executable, "-m", "miles_core.rollout.sessions.server", "--engine-url", servers.engine]
    base += ["--model-path", str(servers.model), "--port", "0"]
    unknown = subprocess.run(
        [*base, "--chat-format", "llama9:Format", "--token", "t"], capture_output=True, text=True, timeout=120
    )
    assert unknown.returncode == 2 and "no module named 'llama9'" in unknown.stderr
    env = {k: v for k, v in os.environ.items() if k != "MILES_RUN_TOKEN"}
    tokenless = subprocess.run(
        [*base, "--chat-format", DIGIT_FORMAT], capture_output=True, text=True, timeout=120, env=env
    )
    assert tokenless.returncode == 2 and "needs the run's token" in tokenless.stderr


def test_a_fork_branches_the_conversation_and_ending_the_session_answers_every_branch(servers: Servers) -> None:
    """A fork starts from the session's exact ids and continues on its own (its turns sampled with a seed of its
    own); ending the first session ends its forks and answers all their trajectories, the forks' in order."""
    prompt = [{"role": "user", "content": "73915:"}]
    session = create(servers.url, prompt, sampling={"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 11})
    sid, base = session["session_id"], session["base_url"]
    first = httpx.post(f"{base}/chat/completions", json={"model": "p", "messages": prompt}, timeout=120).json()
    history = [*prompt, first["choices"][0]["message"], {"role": "user", "content": "5:"}]
    forks = [httpx.post(f"{base}/fork", timeout=60).json() for _ in range(2)]
    for url in [base] + [fork["base_url"] for fork in forks]:
        answer = httpx.post(f"{url}/chat/completions", json={"model": "p", "messages": history}, timeout=120)
        assert answer.status_code == 200, answer.text
    assert_openai_error(httpx.post(f"{servers.url}/sessions/nope/v1/fork", timeout=60), 404, code="unknown_session")
    ended = httpx.delete(f"{servers.url}/sessions/{sid}", headers=AUTH, timeout=60).json()
    trajectories = [ended["trajectory"], *ended["branches"]]
    assert [t["session_id"] for t in trajectories] == [sid] + [fork["session_id"] for fork in forks]
    shared = trajectories[0]["turns"][0]["end"]  # the first turn (and the prompt) is the same in every branch
    assert len({(tuple(t["prompt_ids"]), tuple(t["response_ids"][:shared])) for t in trajectories}) == 1
    assert all(len(t["turns"]) == 2 for t in trajectories)
    second_turns = {tuple(t["response_ids"][t["turns"][1]["start"] : t["turns"][1]["end"]]) for t in trajectories}
    assert len(second_turns) > 1  # seeds of their own: the untrained model's sampled turns differ
    for fork in forks:  # ended with the first session
        assert httpx.post(f"{fork['base_url']}/fork", timeout=60).status_code == 404
