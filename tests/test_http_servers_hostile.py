"""Every HTTP server of Miles attacked from the outside, over raw sockets on 127.0.0.1: half-sent and trickled
bodies, huge heads, duplicate JSON keys, repeated query parameters, oversized batches, error messages that would
echo hostile input. Each is answered with a 4xx (or a closed connection when no request was made) and the server
keeps answering everyone else.

The worker RPC server runs in this process (its deadlines shortened through the shared toolkit's constants, which
the protocol reads at each request); the local engine runs as a child process with the real deadlines; the
dashboard runs in a thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles_core import http as toolkit
from miles_core.builtin.dashboard.server import DashboardServer
from miles_core.builtin.dashboard.store import DashboardStore
from miles_core.builtin.local_engine.serving import MAX_PROMPTS_PER_REQUEST
from miles_core.http import MAX_HEAD_BYTES, MAX_MESSAGE_CHARS, HttpError, parse_json, safe_message
from miles_core.workers.rpc.server import RpcServer, rpc_method
from tests.engines.test_local_engine_hostile import ADMIN, EngineProcess, assert_still_serving

TOKEN = "hostile-http-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SOCKET_TIMEOUT_S = 60  # a bound on waiting for an answer (a hang fails the test), not a timing assertion


class Worker:
    """A worker whose every execution is counted."""

    def __init__(self) -> None:
        self.executions = 0

    @rpc_method("query")
    def ping(self) -> str:
        self.executions += 1
        return "pong"

    @rpc_method("query")
    async def nap(self, seconds: float) -> float:
        self.executions += 1
        await asyncio.sleep(seconds)
        return seconds


class ErrorLog(logging.Handler):
    """uvicorn's error log (it does not propagate to the root logger, so caplog cannot see it)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def short_deadlines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deadlines of about a second, so that a stalled client is cut off quickly (the mechanism is the same)."""
    monkeypatch.setattr(toolkit, "HEAD_TIMEOUT_S", 1.0)
    monkeypatch.setattr(toolkit, "BODY_GRACE_S", 1.0)
    monkeypatch.setattr(toolkit, "MIN_BODY_BYTES_PER_S", 100)


def run_rpc(scenario: Any) -> Any:
    """Run ``scenario(server, worker, client)`` against a real RPC server on 127.0.0.1."""

    async def main() -> Any:
        worker = Worker()
        server = RpcServer(worker, token=TOKEN, name="hostile-0")
        await server.start()
        try:
            async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=SOCKET_TIMEOUT_S) as client:
                return await scenario(server, worker, client)
        finally:
            await server.stop()

    return asyncio.run(main())


async def exchange(port: int, data: bytes, *, read_until_close: bool = True) -> bytes:
    """Send ``data`` on a new connection and return everything the server answers until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read() if read_until_close else reader.read(65536), SOCKET_TIMEOUT_S)
    finally:
        writer.close()


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer[9:12])


def json_of(answer: bytes) -> dict:
    return json.loads(answer.partition(b"\r\n\r\n")[2])


def submit_head(port: int, length: int) -> bytes:
    return (
        f"POST /rpc/submit HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


# -- the shared toolkit ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [b'{"a": 1, "a": 2}', b'{"x": [{"k": 1, "k": 1}]}', b'{"call_id": "x", "method": "ping", "call_id": "y"}'],
)
def test_a_key_given_twice_in_one_object_is_a_400(raw: bytes) -> None:
    with pytest.raises(HttpError, match="twice in one object") as caught:
        parse_json(raw)
    assert caught.value.status == 400


def test_equal_keys_in_different_objects_are_fine() -> None:
    assert parse_json(b'[{"a": 1}, {"a": 2}]') == [{"a": 1}, {"a": 2}]


def test_an_error_message_is_cut_short_and_its_control_characters_escaped() -> None:
    message = safe_message("bad \x1b[31mred\x1b[0m \x00\r" + "x" * 100_000)
    assert len(message) < MAX_MESSAGE_CHARS + 100 and message.endswith(" characters)") and "(cut: " in message
    assert not any(ord(c) < 32 and c not in "\n\t" for c in message), message[:60]
    assert message.startswith("bad \\x1b[31mred\\x1b[0m \\x00\\r")
    assert str(HttpError(400, "\x07" * 5000)).startswith("\\x07")


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"host": "evil.example:8000"}, 421),
        ({}, 421),
        ({"host": "127.0.0.1:8001"}, 421),
        ({"host": "127.0.0.1:8000", "origin": "http://evil.example"}, 403),
        ({"host": "127.0.0.1:8000", "origin": "http://127.0.0.1:9999"}, 403),
        ({"host": "127.0.0.1:8000", "origin": "file://"}, 403),
        ({"host": "127.0.0.1:8000"}, None),
        ({"host": "[::1]:8000", "origin": "http://localhost:8000"}, None),
    ],
)
def test_the_browser_check_refuses_foreign_hosts_and_origins(headers: dict, status: int | None) -> None:
    names = toolkit.allowed_host_names("127.0.0.1")
    if status is None:
        toolkit.check_browser_request(headers, names=names, port=8000)
        return
    with pytest.raises(HttpError) as caught:
        toolkit.check_browser_request(headers, names=names, port=8000)
    assert caught.value.status == status


# -- the worker RPC server ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sent", [b"", b'{"call_id": "stalled", "me'], ids=["no body", "half a body"])
def test_an_rpc_body_that_stops_arriving_is_a_408_and_nothing_runs(short_deadlines: None, sent: bytes) -> None:
    async def scenario(server: RpcServer, worker: Worker, client: httpx.AsyncClient) -> None:
        errors = ErrorLog()
        logging.getLogger("uvicorn.error").addHandler(errors)
        try:
            answer = await exchange(server.port, submit_head(server.port, 200) + sent)
        finally:
            logging.getLogger("uvicorn.error").removeHandler(errors)
        assert status_of(answer) == 408 and "did not arrive in time" in json_of(answer)["error"]
        assert worker.executions == 0 and len(server.store) == 0
        assert errors.records == [], [r.getMessage() for r in errors.records]  # no "Exception in ASGI application"
        assert (await client.get("/rpc/health")).status_code == 200

    run_rpc(scenario)


def test_an_rpc_body_trickled_slower_than_the_minimum_pace_is_a_408(short_deadlines: None) -> None:
    async def scenario(server: RpcServer, worker: Worker, client: httpx.AsyncClient) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(submit_head(server.port, 10_000))
        give_up = time.monotonic() + SOCKET_TIMEOUT_S
        answer = b""
        try:
            while not answer and time.monotonic() < give_up:  # one byte every 0.1 s: 10 bytes/s, under 100
                writer.write(b" ")
                await writer.drain()
                try:
                    answer = await asyncio.wait_for(reader.read(65536), 0.1)
                except TimeoutError:
                    continue
        except ConnectionResetError:
            pytest.fail("the connection was reset without an answer")
        finally:
            writer.close()
        assert status_of(answer) == 408, answer[:200]
        assert worker.executions == 0 and len(server.store) == 0

    run_rpc(scenario)


def test_hundreds_of_stalled_rpc_clients_keep_nobody_waiting_and_are_all_cut_off(short_deadlines: None) -> None:
    async def scenario(server: RpcServer, worker: Worker, client: httpx.AsyncClient) -> None:
        stalled = []
        for index in range(300):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(submit_head(server.port, 100) if index % 2 else b"POST /rpc/sub")
            stalled.append((reader, writer))
        try:
            good = await client.post("/rpc/submit", json={"call_id": "good", "method": "ping", "wait_s": 10})
            assert good.json() == {"call_id": "good", "state": "done", "result": "pong"}
            closed = await asyncio.wait_for(asyncio.gather(*(r.read() for r, _ in stalled)), SOCKET_TIMEOUT_S)
        finally:
            for _, writer in stalled:
                writer.close()
        assert {status_of(a) for a in closed[1::2]} == {408}
        assert set(closed[::2]) == {b""}  # no request was made: closed without an answer
        assert worker.executions == 1

    run_rpc(scenario)


def test_a_slow_call_and_a_pipelined_request_behind_it_are_not_cut_off(short_deadlines: None) -> None:
    """The deadlines count only while the server waits for the client, never while a handler works."""

    async def scenario(server: RpcServer, worker: Worker, client: httpx.AsyncClient) -> None:
        body = json.dumps({"call_id": "slow", "method": "nap", "args": [3], "wait_s": 10}).encode()
        health = f"GET /rpc/health HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            writer.write(submit_head(server.port, len(body)) + body + health)
            answers = b""
            while answers.count(b"HTTP/1.1 200") < 2:
                chunk = await asyncio.wait_for(reader.read(65536), SOCKET_TIMEOUT_S)
                assert chunk, f"closed after {answers!r}"
                answers += chunk
        finally:
            writer.close()
        assert b'"state":"done","result":3' in answers and b'"ok":true' in answers

    run_rpc(scenario)


@pytest.mark.parametrize(
    "extra",
    [b"X-Big: " + b"a" * (4 * MAX_HEAD_BYTES) + b"\r\n", b"".join(b"X-%d: 1\r\n" % i for i in range(20_000))],
    ids=["one huge header", "twenty thousand headers"],
)
def test_an_rpc_request_head_over_the_limit_is_a_431(extra: bytes) -> None:
    async def scenario(server: RpcServer, worker: Worker, client: httpx.AsyncClient) -> None:
        head = f"GET /rpc/health HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n".encode()
        answer = await exchange(server.port, head + extra + b"\r\n")  # a reset (the answer lost) fails the test
        assert status_of(answer) == 431 and str(MAX_HEAD_BYTES) in json_of(answer)["error"]
        assert (await client.get("/rpc/health")).status_code == 200

    run_rpc(scenario)


def test_an_rpc_head_that_never_ends_is_answered_431_and_closed_not_buffered() -> None:
    """A header line streamed forever: the server answers 431 once the head passes :data:`MAX_HEAD_BYTES`, and
    closes the connection however much more comes (without the limit, uvicorn buffered 200 MiB of one header)."""

    async def scenario(server: RpcServer, worker: Worker, client: httpx.AsyncClient) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        answer = asyncio.ensure_future(reader.read())  # everything until the server closes
        sent, limit = 0, 256 * MAX_HEAD_BYTES  # 16 MiB, far more than the kernel's buffers hold
        try:
            writer.write(b"GET /rpc/health HTTP/1.1\r\nX-Endless: ")
            while not answer.done() and sent < limit:
                writer.write(b"a" * 65536)
                try:
                    await asyncio.wait_for(writer.drain(), SOCKET_TIMEOUT_S)
                except ConnectionError:
                    break  # closed by the server
                sent += 65536
            answer_bytes = await asyncio.wait_for(answer, SOCKET_TIMEOUT_S)
        finally:
            writer.close()
        assert status_of(answer_bytes) == 431 and sent < limit, (sent, answer_bytes[:100])
        assert (await client.get("/rpc/health")).status_code == 200

    run_rpc(scenario)


def test_an_rpc_submit_with_a_duplicate_key_is_a_400_and_nothing_runs() -> None:
    async def scenario(server: RpcServer, worker: Worker, client: httpx.AsyncClient) -> None:
        raw = b'{"call_id": "a", "method": "ping", "call_id": "b", "wait_s": 5}'
        response = await client.post("/rpc/submit", content=raw)
        assert response.status_code == 400 and "'call_id' twice" in response.json()["error"]
        assert worker.executions == 0 and len(server.store) == 0

    run_rpc(scenario)


def test_an_rpc_error_never_echoes_a_huge_or_control_character_input() -> None:
    async def scenario(server: RpcServer, worker: Worker, client: httpx.AsyncClient) -> None:
        fields = {f"\x1b[2J{i:06d}" + "k" * 200: 1 for i in range(20_000)}  # 4 MiB of unknown field names
        response = await client.post("/rpc/submit", json={"call_id": "a", "method": "ping", **fields})
        error = response.json()["error"]
        assert response.status_code == 400 and error.startswith("unknown submit fields")
        assert len(response.content) < MAX_MESSAGE_CHARS + 200 and "\x1b" not in error
        response = await client.get("/rpc/poll", params={"call_id": "\x1b]0;owned\x07" + "z" * 100})
        assert response.status_code == 404 and "\x1b" not in response.json()["error"]
        assert worker.executions == 0

    run_rpc(scenario)


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (
            b"POST /rpc/submit HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
        ),
        (b"GET /rpc/health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\x00\r\n\r\n", 400),
        (b"GET /rpc/health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xc3\xa9t\xc3\xa9\r\n\r\n", 401),
        (
            b"GET /rpc/poll?call_id=%ff%fe HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + TOKEN.encode()
            + b"\r\n\r\n",
            404,
        ),
    ],
    ids=["both content-length and chunked", "NUL in a header", "non-ASCII token", "non-UTF-8 query"],
)
def test_malformed_rpc_requests_are_a_4xx_and_the_server_keeps_serving(request_bytes: bytes, status: int) -> None:
    async def scenario(server: RpcServer, worker: Worker, client: httpx.AsyncClient) -> None:
        answer = await exchange(server.port, request_bytes, read_until_close=False)
        assert status_of(answer) == status, answer[:300]
        assert worker.executions == 0
        assert (await client.get("/rpc/health")).status_code == 200

    run_rpc(scenario)


# -- the local engine (a child process, with the real deadlines) ----------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    from miles_core.testkit.tiny_models import save_tiny_llama

    model = save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", max_position_embeddings=512)
    process = EngineProcess(model, tmp_path_factory.mktemp("engine"), admin_key=ADMIN)
    process.model_dir = model
    yield process
    process.stop()


@pytest.mark.slow
def test_an_engine_body_that_stops_arriving_is_a_408_and_others_are_served(engine: EngineProcess) -> None:
    async def scenario() -> bytes:
        head = (
            f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:{engine.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: 1000\r\n\r\n"
        ).encode()
        stalled = asyncio.ensure_future(exchange(engine.port, head + b'{"input_ids": [1, 2'))
        await asyncio.sleep(0.5)  # let the stalled request reach the server first (order only, not timing)
        await asyncio.to_thread(assert_still_serving, engine)
        return await stalled

    answer = asyncio.run(scenario())
    assert status_of(answer) == 408, answer[:300]
    assert_still_serving(engine)


@pytest.mark.slow
def test_an_engine_request_head_over_the_limit_is_a_431(engine: EngineProcess) -> None:
    head = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{engine.port}\r\nX-Big: ".encode()
    answer = asyncio.run(exchange(engine.port, head + b"a" * (2 * MAX_HEAD_BYTES) + b"\r\n\r\n"))
    assert status_of(answer) == 431
    assert_still_serving(engine)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "query"),
    [("/generate", "text=a&text=b"), ("/get_model_info", "x=1&x=2"), ("/flush_cache", "a=%ff&a=%fe")],
)
def test_an_engine_query_parameter_given_twice_is_a_400(engine: EngineProcess, path: str, query: str) -> None:
    response = httpx.get(f"{engine.url}{path}?{query}", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert response.status_code == 400, response.text
    assert "is given more than once" in response.json()["error"]
    assert_still_serving(engine)


@pytest.mark.slow
def test_an_engine_body_with_a_duplicate_key_is_a_400(engine: EngineProcess) -> None:
    raw = b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "max_new_tokens": 100000}}'
    response = httpx.post(f"{engine.url}/generate", content=raw, timeout=60)
    assert response.status_code == 400 and "'max_new_tokens' twice" in response.json()["error"]


@pytest.mark.slow
@pytest.mark.parametrize("field", ["input_ids", "text"])
def test_an_engine_batch_over_the_prompt_limit_is_a_400_before_any_prompt_is_read(
    engine: EngineProcess, field: str
) -> None:
    """32 MiB of one-token prompts would be millions of Python lists and sampling-parameter checks."""
    prompt = "[1]" if field == "input_ids" else '"a"'
    count = MAX_PROMPTS_PER_REQUEST + 1
    raw = f'{{"{field}": [{",".join([prompt] * count)}], "sampling_params": {{"max_new_tokens": 1}}}}'
    response = httpx.post(f"{engine.url}/generate", content=raw.encode(), timeout=60)
    assert response.status_code == 400, response.text[:300]
    assert f"holds {count} prompts" in response.json()["error"]
    assert response.json()["error"].endswith(f"at most {MAX_PROMPTS_PER_REQUEST}: split the batch")
    assert_still_serving(engine)


@pytest.mark.slow
def test_an_engine_error_never_echoes_a_huge_or_control_character_input(engine: EngineProcess) -> None:
    path = "/nonexistent/\x1b[2J" + "p" * 200_000
    response = httpx.post(
        f"{engine.url}/update_weights_from_disk",
        json={"model_path": path},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=60,
    )
    assert 400 <= response.status_code < 500, response.text[:300]
    assert len(response.json()["error"]) < MAX_MESSAGE_CHARS + 100 and "\x1b" not in response.json()["error"]
    assert_still_serving(engine)


# -- the dashboard --------------------------------------------------------------------------------------------


@pytest.fixture
def dashboard(tmp_path: Path) -> Iterator[DashboardServer]:
    DashboardStore(tmp_path).close()
    server = DashboardServer(tmp_path).start()
    yield server
    server.stop()


def test_a_dashboard_request_head_over_the_limit_is_a_431(dashboard: DashboardServer) -> None:
    head = f"GET /api/run HTTP/1.1\r\nHost: 127.0.0.1:{dashboard.port}\r\nX-Big: ".encode()
    with socket.create_connection(("127.0.0.1", dashboard.port), timeout=SOCKET_TIMEOUT_S) as connection:
        connection.sendall(head + b"a" * (2 * MAX_HEAD_BYTES) + b"\r\n\r\n")
        answer = connection.recv(65536)
    assert status_of(answer) == 431
    assert httpx.get(dashboard.url + "api/run", timeout=SOCKET_TIMEOUT_S).status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize(
    "host",
    ["evil.example:{port}", "127.0.0.1.nip.io:{port}", "127.0.0.1:{other}", "127.0.0.1", "", "127.0.0.1:{port}x"],
)
def test_the_engine_refuses_a_host_that_is_not_its_own(engine: EngineProcess, host: str) -> None:
    """DNS rebinding: a page whose domain now resolves to 127.0.0.1 sends its own name as Host."""
    host = host.format(port=engine.port, other=engine.port + 1)
    before = engine_generated(engine)
    request = f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: text/plain\r\nConnection: close\r\n"
    request += "Content-Length: 17\r\n\r\n"
    answer = asyncio.run(exchange(engine.port, request.encode() + b'{"input_ids":[1]}'))
    assert status_of(answer) == 421, answer[:300]
    assert "is not a name this server answers" in json_of(answer)["error"]
    assert engine_generated(engine) == before


@pytest.mark.slow
@pytest.mark.parametrize("origin", ["http://evil.example", "null", "https://127.0.0.1:{port}", "http://localhost:1"])
def test_the_engine_refuses_a_request_from_a_web_page(engine: EngineProcess, origin: str) -> None:
    """A page of another site may post a "simple" (text/plain) request without a preflight; its browser says so."""
    before = engine_generated(engine)
    headers = {"Content-Type": "text/plain", "Origin": origin.format(port=engine.port)}
    response = httpx.post(f"{engine.url}/generate", content=b'{"input_ids": [1, 2]}', headers=headers, timeout=60)
    assert response.status_code == 403 and "requests from web pages are refused" in response.json()["error"]
    assert engine_generated(engine) == before


@pytest.mark.slow
@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST:{port}"])
def test_the_engine_answers_its_own_names_and_its_own_origin(engine: EngineProcess, host: str) -> None:
    host = host.format(port=engine.port)
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    headers = {"Host": host, "Origin": f"http://{host}"}
    response = httpx.post(f"{engine.url}/generate", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text


def engine_generated(engine: EngineProcess) -> int:
    return httpx.get(f"{engine.url}/server_info", timeout=60).json()["internal_states"][0]["generate_requests"]


@pytest.mark.parametrize(
    ("method", "path", "status", "message"),
    [
        ("PUT", "/rpc/submit", 405, "PUT is not a method of '/rpc/submit': use POST"),
        ("OPTIONS", "/rpc/health", 405, "OPTIONS is not a method of '/rpc/health': use GET, HEAD"),
        ("DELETE", "/rpc/poll", 405, "DELETE is not a method of '/rpc/poll'"),
        ("GET", "/rpc/%ff%00%1b[2J", 404, "no route '/rpc/"),
    ],
)
def test_an_unknown_rpc_route_or_method_is_a_json_4xx(method: str, path: str, status: int, message: str) -> None:
    async def scenario(server: RpcServer, worker: Worker, client: httpx.AsyncClient) -> None:
        response = await client.request(method, path)
        assert response.status_code == status and response.json()["error"].startswith(message), response.text
        assert "\x1b" not in response.json()["error"] and worker.executions == 0

    run_rpc(scenario)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "path", "status", "message"),
    [
        ("PUT", "/generate", 405, "PUT is not a method of '/generate': use GET, HEAD, POST"),
        ("OPTIONS", "/update_weights_from_disk", 405, "OPTIONS is not a method of"),
        ("GET", "/no_such_route", 404, "no route '/no_such_route'"),
    ],
)
def test_an_unknown_engine_route_or_method_is_a_json_4xx(
    engine: EngineProcess, method: str, path: str, status: int, message: str
) -> None:
    response = httpx.request(method, f"{engine.url}{path}", timeout=60)
    assert response.status_code == status and response.json()["error"].startswith(message), response.text


@pytest.mark.slow
def test_a_flood_of_generations_during_a_weight_update_is_served_and_the_update_lands(engine: EngineProcess) -> None:
    """Every request of the flood is answered (generated, or aborted by the update), none fails, and the engine
    holds the loaded weights (the same checkpoint: the checksum is unchanged) under the new version."""
    auth = {"Authorization": f"Bearer {ADMIN}"}

    async def scenario() -> tuple[httpx.Response, list[httpx.Response], str, str]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=engine.url, timeout=SOCKET_TIMEOUT_S * 2, limits=limits) as client:
            before = (await client.post("/weights_checksum", json={}, headers=auth)).json()["checksum"]
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
            flood = [asyncio.ensure_future(client.post("/generate", json=body)) for _ in range(100)]
            update = await client.post(
                "/update_weights_from_disk",
                headers=auth,
                json={"model_path": str(engine.model_dir), "weight_version": "flooded", "abort_all_requests": True},
            )
            answers = await asyncio.gather(*flood)
            after = (await client.post("/weights_checksum", json={}, headers=auth)).json()
            return update, answers, before, after

    update, answers, before, after = asyncio.run(scenario())
    assert update.status_code == 200 and update.json()["weight_version"] == "flooded", update.text
    assert {a.status_code for a in answers} == {200}, {a.status_code: a.text[:200] for a in answers}
    assert {a.json()["meta_info"]["finish_reason"]["type"] for a in answers} <= {"length", "abort"}
    assert after == {"checksum": before, "weight_version": "flooded"}
    assert_still_serving(engine)
