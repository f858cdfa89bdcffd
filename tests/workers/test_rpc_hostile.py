"""The worker RPC under hostile input: a submit is checked whole before anything runs, argument types are checked
strictly, the bearer check is the shared one, and the client's resend rule tells "never arrived" from "may have run".

Every test talks to a real :class:`RpcServer` on 127.0.0.1 over HTTP.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import socket
from typing import Any, Optional

import httpx
import pydantic
import pytest

from miles_core.testkit.fault_proxy import FaultProxy
from miles_core.workers.errors import CallLostError, RpcDeadlineError, RpcRequestError, WorkerDiedError
from miles_core.workers.handle import WorkerHandle
from miles_core.workers.rpc.arguments import ArgumentError
from miles_core.workers.rpc.client import RpcClient
from miles_core.workers.rpc.server import RpcServer, rpc_method

TOKEN = "hostile-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Settings(pydantic.BaseModel):
    lr: float
    steps: int


class TypedWorker:
    """Methods with one kind of type hint each; every execution is counted by method."""

    def __init__(self) -> None:
        self.executions: collections.Counter[str] = collections.Counter()

    def _ran(self, name: str) -> None:
        self.executions[name] += 1

    @rpc_method("control")
    def record(self, key: str, value: int) -> int:
        self._ran("record")
        return 2 * value

    @rpc_method("control")
    def scale(self, factor: float) -> float:
        self._ran("scale")
        return factor * 2

    @rpc_method("control")
    def toggle(self, on: bool) -> bool:
        self._ran("toggle")
        return not on

    @rpc_method("control")
    def total(self, values: list[int]) -> int:
        self._ran("total")
        return sum(values)

    @rpc_method("control")
    def weigh(self, weights: dict[str, float]) -> float:
        self._ran("weigh")
        return sum(weights.values())

    @rpc_method("control")
    def maybe(self, n: Optional[int] = None) -> int:  # noqa: UP045 (the Optional spelling is the case under test)
        self._ran("maybe")
        return -1 if n is None else n

    @rpc_method("control")
    def configure(self, settings: Settings) -> str:
        self._ran("configure")
        return f"{type(settings).__name__} lr={settings.lr} steps={settings.steps}"

    @rpc_method("control")
    def pair(self, point: tuple[int, int]) -> list[int]:
        self._ran("pair")
        return list(point)

    @rpc_method("control")
    def many(self, *numbers: int, **labels: str) -> list:
        self._ran("many")
        return [list(numbers), labels]

    @rpc_method("query")
    def ping(self) -> str:
        return "pong"

    @rpc_method("query")
    async def nap(self, seconds: float) -> float:
        self._ran("nap")
        await asyncio.sleep(seconds)
        return seconds


class Served:
    """A TypedWorker served in this event loop, with an HTTP client that sends the run's token."""

    def __init__(self, **server_kwargs: Any) -> None:
        self.worker = TypedWorker()
        self.server = RpcServer(self.worker, token=TOKEN, name="typed-0", **server_kwargs)
        self.http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> Served:
        await self.server.start()
        self.http = httpx.AsyncClient(base_url=self.server.url, headers=AUTH, timeout=30)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self.http is not None
        await self.http.aclose()
        await self.server.stop()

    async def submit(self, body: dict | bytes, **kwargs: Any) -> httpx.Response:
        assert self.http is not None
        return await self.http.post("/rpc/submit", content=_encoded(body), **kwargs)

    async def assert_untouched_and_healthy(self) -> None:
        """Nothing ran, nothing is stored, and the server still answers a good call."""
        assert self.worker.executions == {}
        assert len(self.server.store) == 0
        good = await self.submit({"call_id": "afterwards", "method": "record", "args": ["k", 4], "wait_s": 5})
        assert good.json() == {"call_id": "afterwards", "state": "done", "result": 8}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def _encoded(body: Any) -> bytes:
    """JSON with non-ASCII escaped (httpx's own encoder cannot send a lone surrogate, which is a case here)."""
    return body if isinstance(body, bytes) else json.dumps(body).encode()


# -- a submit is checked whole before anything runs ---------------------------------------------------------------


@pytest.mark.parametrize("wait_s", [-1, "soon", "1", True, None, [], {}, -0.5])
def test_invalid_wait_s_is_refused_before_the_call_starts(wait_s: Any) -> None:
    async def scenario() -> None:
        async with Served() as served:
            response = await served.submit({"call_id": "w1", "method": "record", "args": ["k", 1], "wait_s": wait_s})
            assert response.status_code == 400, response.text
            assert f"wait_s must be a number of seconds >= 0 (at most 60 are used), got {wait_s!r}" in response.text
            polled = await served.http.get("/rpc/poll", params={"call_id": "w1"})
            assert polled.status_code == 404  # the call was never stored, so the id is still free
            await served.assert_untouched_and_healthy()

    run(scenario())


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"call_id": "j1", "method": "record", "args": ["k", 1], "wait_s": NaN}', "NaN is not a JSON number"),
        (b'{"call_id": "j2", "method": "scale", "args": [Infinity]}', "Infinity is not a JSON number"),
        (b'{"call_id": "j3", "method": "scale", "args": [-Infinity]}', "-Infinity is not a JSON number"),
        (b'{"call_id": "j4", "method": "scale", "args": [1e400]}', "too large for a float"),
        (b'{"call_id": "j5", "method": "record", "args": ["k", ' + b"7" * 5000 + b"]}", "integer of 5000 digits"),
        (b'{"call_id": "j6", "method": "total", "args": [' + b"[" * 5000 + b"]" * 5000 + b"]}", "nested deeper"),
        (b'{"call_id": "j7", "method": "weigh", "kwargs": ' + b'{"a":' * 100 + b"1" + b"}" * 100 + b"}", "nested"),
        (b'{"call_id": "j8", "method": "record", "args": ["k", 1], "wait_s": 1e999}', "too large for a float"),
        (b'{"call_id": "j9", "method": "record"', "not valid JSON"),
        (b"\xff\xfe\x00{", "not valid JSON"),
    ],
)
def test_hostile_json_is_a_400_and_nothing_runs(raw: bytes, message: str) -> None:
    async def scenario() -> None:
        async with Served() as served:
            response = await served.submit(raw)
            assert response.status_code == 400, response.text
            assert message in response.json()["error"]
            await served.assert_untouched_and_healthy()

    run(scenario())


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"call_id": "f1", "method": "ping", "priority": 9}, "unknown submit fields ['priority']; a submit has"),
        ({"call_id": "f2", "method": 5}, "method must be the name of a method (a non-empty string), got 5"),
        ({"call_id": "f3", "method": ["ping"]}, "method must be the name of a method"),
        ({"call_id": "f4"}, "method must be the name of a method (a non-empty string), got None"),
        ({"call_id": 17, "method": "ping"}, "call_id must be a string of 1 to 128 characters, got 17"),
        ({"call_id": "x" * 129, "method": "ping"}, "call_id must be a string of 1 to 128 characters"),
        ({"method": "ping"}, "call_id must be a string of 1 to 128 characters, got None"),
        ({"call_id": "f5", "method": "record", "kwargs": ["k", 1]}, "kwargs must be a JSON object"),
        ({"call_id": "f6", "method": "record", "args": {"key": "k"}}, "args must be a JSON list"),
        ({"call_id": "f7", "method": "record", "args": ["k", 1], "kwargs": {"key": "k"}}, "multiple values"),
        ({"call_id": "f8", "method": "record", "kwargs": {"key": "k", "value": 1, "": 2}}, "unexpected keyword"),
    ],
)
def test_malformed_submit_fields_are_a_400_naming_the_field(body: dict, message: str) -> None:
    async def scenario() -> None:
        async with Served() as served:
            response = await served.submit(body)
            assert response.status_code == 400, response.text
            assert message in response.json()["error"]
            await served.assert_untouched_and_healthy()

    run(scenario())


@pytest.mark.parametrize(
    "params",
    [
        {"call_id": "p1", "wait_s": "nan"},
        {"call_id": "p1", "wait_s": "inf"},
        {"call_id": "p1", "wait_s": "-1"},
        {"call_id": "p1", "wait_s": "1_0"},
        {"call_id": "p1", "wait_s": " 1"},
        {"call_id": "p1", "wait_s": ""},
        {"call_id": "p1", "wait_s": "1e999"},
        {"call_id": "p1", "colour": "red"},
        [("call_id", "p1"), ("call_id", "p2")],
        {"wait_s": "1"},
        {"call_id": "x" * 129},
    ],
)
def test_malformed_polls_are_a_400(params: Any) -> None:
    async def scenario() -> None:
        async with Served() as served:
            done = await served.submit({"call_id": "p1", "method": "ping", "wait_s": 5})
            assert done.json()["state"] == "done"
            response = await served.http.get("/rpc/poll", params=params)
            assert response.status_code == 400, response.text
            assert "poll" in response.text or "call_id" in response.text or "wait_s" in response.text
            good = await served.http.get("/rpc/poll", params={"call_id": "p1", "wait_s": "0.5"})
            assert good.json() == {"call_id": "p1", "state": "done", "result": "pong"}

    run(scenario())


def test_a_large_wait_is_capped_not_refused() -> None:
    async def scenario() -> None:
        async with Served() as served:
            response = await served.submit({"call_id": "big", "method": "ping", "wait_s": 10**9})
            assert response.json() == {"call_id": "big", "state": "done", "result": "pong"}
            polled = await served.http.get("/rpc/poll", params={"call_id": "big", "wait_s": "1e9"})
            assert polled.status_code == 200

    run(scenario())


# -- argument types are checked strictly ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "args", "kwargs", "expected"),
    [
        ("record", ["k", True], {}, "bad argument value=True for record(key: str, value: int) -> int: expected int"),
        ("record", ["k", 1.5], {}, "bad argument value=1.5 for record"),
        ("record", ["k", "5"], {}, "bad argument value='5' for record"),
        ("record", [5, 1], {}, "bad argument key=5 for record(key: str, value: int) -> int: expected str"),
        ("scale", [True], {}, "bad argument factor=True for scale(factor: float) -> float: expected float"),
        ("scale", ["inf"], {}, "bad argument factor='inf' for scale"),
        ("scale", ["NaN"], {}, "bad argument factor='NaN' for scale"),
        ("toggle", [1], {}, "bad argument on=1 for toggle(on: bool) -> bool: expected bool"),
        ("toggle", ["true"], {}, "bad argument on='true' for toggle"),
        ("total", [[1, True, 3]], {}, "expected list[int]; values[1]: Input should be a valid integer (got True)"),
        ("total", [[1, "2"]], {}, "values[1]: Input should be a valid integer (got '2')"),
        ("total", [{"0": 1}], {}, "expected list[int]; values: Input should be a valid array"),
        ("weigh", [{"a": 1.0, "b": True}], {}, "expected dict[str, float]; weights.b: Input should be a valid number"),
        ("weigh", [{"a": "1.0"}], {}, "weights.a: Input should be a valid number (got '1.0')"),
        ("maybe", [], {"n": True}, "bad argument n=True for maybe(n: Optional[int] = None) -> int: expected Optional"),
        ("maybe", [], {"n": "3"}, "bad argument n='3' for maybe"),
        ("configure", [{"lr": True, "steps": 3}], {}, "expected Settings; settings.lr: Input should be a valid number"),
        ("configure", [{"lr": 0.1, "steps": 2.5}], {}, "settings.steps: Input should be a valid integer (got 2.5)"),
        ("configure", [{"lr": "0.1", "steps": 3}], {}, "settings.lr"),
        ("configure", [{"lr": 0.1}], {}, "settings.steps: Field required"),
        ("pair", [[1, True]], {}, "expected tuple[int, int]; point[1]: Input should be a valid integer"),
        ("pair", [[1, 2, 3]], {}, "point: Tuple should have at most 2 items"),
        ("many", [1, True], {}, "bad argument numbers=(1, True) for many"),
        ("many", [1], {"tag": 3}, "bad argument labels={'tag': 3} for many"),
    ],
)
def test_argument_types_are_checked_strictly_before_anything_runs(method, args, kwargs, expected) -> None:
    async def scenario() -> None:
        async with Served() as served:
            response = await served.submit({"call_id": "t1", "method": method, "args": args, "kwargs": kwargs})
            assert response.status_code == 400, response.text
            assert expected in response.json()["error"]
            await served.assert_untouched_and_healthy()

    run(scenario())


def test_well_typed_arguments_arrive_as_their_declared_types() -> None:
    """JSON's own encodings still count: an array for a tuple, an object for a model, an integer for a float."""

    async def scenario() -> None:
        async with Served() as served:
            client = RpcClient(served.server.url, token=TOKEN, worker="typed-0")
            assert await client.call("scale", 3) == 6.0
            assert await client.call("total", [1, 2, 3]) == 6
            assert await client.call("weigh", {"a": 1, "b": 0.5}) == 1.5
            assert await client.call("maybe") == -1 and await client.call("maybe", n=None) == -1
            assert await client.call("maybe", 7) == 7
            assert await client.call("configure", {"lr": 1, "steps": 3}) == "Settings lr=1.0 steps=3"
            assert await client.call("pair", [4, 5]) == [4, 5]
            assert await client.call("many", 1, 2, tag="x") == [[1, 2], {"tag": "x"}]
            assert await client.call("toggle", False) is True
            await client.aclose()

    run(scenario())


def test_a_refused_value_is_shown_cut_short() -> None:
    async def scenario() -> None:
        async with Served() as served:
            response = await served.submit({"call_id": "long", "method": "record", "args": ["k", "9" * 100_000]})
            assert response.status_code == 400
            error = response.json()["error"]
            assert "(100002 characters)" in error and len(error) < 1000
            await served.assert_untouched_and_healthy()

    run(scenario())


def test_the_client_refuses_non_json_arguments_before_sending() -> None:
    async def scenario() -> None:
        async with Served() as served:
            client = RpcClient(served.server.url, token=TOKEN, worker="typed-0")
            with pytest.raises(ValueError, match=r"typed-0\.scale .*: the arguments must be JSON .*Out of range float"):
                await client.call("scale", float("nan"))
            with pytest.raises(ValueError, match=r"the arguments must be JSON .*Unable to serialize unknown type"):
                await client.call("configure", object())
            assert served.worker.executions == {} and len(served.server.store) == 0
            await client.aclose()

    run(scenario())


def test_models_and_dataclasses_travel_as_objects_and_arrive_rebuilt_from_the_hints() -> None:
    async def scenario() -> None:
        async with Served() as served:
            client = RpcClient(served.server.url, token=TOKEN, worker="typed-0")
            assert await client.call("configure", Settings(lr=0.1, steps=1)) == "Settings lr=0.1 steps=1"
            assert await client.call("pair", (3, 4)) == [3, 4]  # a tuple as its array
            with pytest.raises(RpcRequestError, match=r"steps"):  # the object is still checked field by field
                await client.call("configure", {"lr": 0.1, "steps": "one"})
            await client.aclose()

    run(scenario())


@pytest.mark.parametrize(
    ("method", "args", "kwargs", "expected"),
    [
        ("record", ("k", True), {}, "bad argument value=True for TypedWorker.record(key: str, value: int) -> int"),
        ("scale", (float("inf"),), {}, "bad argument factor=inf for TypedWorker.scale"),
        ("total", ([1, "2"],), {}, "values[1]: Input should be a valid integer (got '2')"),
        ("configure", ({"lr": 0.1},), {}, "settings.steps: Field required"),
        ("maybe", (), {"n": 1.0}, "bad argument n=1.0"),
        ("record", ("k",), {}, "missing a required argument: 'value'"),
    ],
)
def test_a_handle_runs_the_same_strict_check_before_sending(method, args, kwargs, expected) -> None:
    async def scenario() -> None:
        async with Served() as served:
            handle = WorkerHandle(RpcClient(served.server.url, token=TOKEN, worker="typed-0"), TypedWorker)
            with pytest.raises(ArgumentError, match=re.escape(expected)):
                await getattr(handle, method)(*args, **kwargs)
            assert await handle.pair((1, 2)) == [1, 2]  # a tuple is sent as the JSON array it is
            assert served.worker.executions == {"pair": 1} and len(served.server.store) == 1  # nothing else sent
            await handle.client.aclose()

    run(scenario())


# -- the one bearer check ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("header", [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER {TOKEN}", f"Bearer   {TOKEN}"])
def test_bearer_scheme_is_case_insensitive_and_spaces_are_tolerated(header: str) -> None:
    async def scenario() -> None:
        async with Served() as served, httpx.AsyncClient(base_url=served.server.url) as http:
            headers = {"Authorization": header}
            body = {"call_id": "b1", "method": "ping", "wait_s": 5}
            submitted = await http.post("/rpc/submit", json=body, headers=headers)
            assert submitted.json()["result"] == "pong", submitted.text
            assert (await http.get("/rpc/poll", params={"call_id": "b1"}, headers=headers)).status_code == 200
            assert (await http.get("/rpc/health", headers=headers)).status_code == 200

    run(scenario())


@pytest.mark.parametrize(
    "header",
    [
        TOKEN,
        "Bearer",
        f"Basic {TOKEN}",
        "Bearer wrong",
        f"Bearer{TOKEN}",
        f"{TOKEN} Bearer",
        f"Bearer {TOKEN}x",
        f"Bearer {TOKEN[:-1]}",
        f"Token {TOKEN}",
        "",
    ],
)
def test_anything_but_a_bearer_token_is_refused_on_every_route(header: str) -> None:
    async def scenario() -> None:
        async with Served() as served, httpx.AsyncClient(base_url=served.server.url) as http:
            headers = {"Authorization": header}
            body = {"call_id": "b2", "method": "record", "args": ["k", 1]}
            for response in (
                await http.post("/rpc/submit", json=body, headers=headers),
                await http.get("/rpc/poll", params={"call_id": "b2"}, headers=headers),
                await http.get("/rpc/health", headers=headers),
            ):
                assert response.status_code == 401, response.text
                assert "missing or wrong run token: send 'Authorization: Bearer" in response.json()["error"]
            await served.assert_untouched_and_healthy()

    run(scenario())


async def _raw_health_status(port: int, authorization: bytes) -> int:
    """The status of a health request sent byte for byte (httpx refuses header values with outer whitespace)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /rpc/health HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization:" + authorization)
    writer.write(b"\r\nConnection: close\r\n\r\n")
    await writer.drain()
    status_line = await reader.readline()
    writer.close()
    await writer.wait_closed()
    return int(status_line.split()[1])


def test_whitespace_around_the_authorization_value_is_tolerated_and_a_bare_scheme_is_refused() -> None:
    async def scenario() -> None:
        async with Served() as served:
            port, token = served.server.port, TOKEN.encode()
            assert await _raw_health_status(port, b"   Bearer " + token + b"   ") == 200
            assert await _raw_health_status(port, b"\tbearer  " + token + b"\t") == 200
            for refused in (b" Bearer ", b" Bearer \t", b" " + token + b" ", b"", b" Bearer\t" + token):
                assert await _raw_health_status(port, refused) == 401, refused

    run(scenario())


# -- fuzz: many random malformed submits and polls -----------------------------------------------------------------

_JUNK = [None, True, False, 0, -1, 2**63, 1.5, "", "x", "\ud800", "\x00", [], {}, [[[]]], {"a": {"b": []}}, "9" * 300]


def _junk(rng: random.Random) -> Any:
    return rng.choice(_JUNK)


def _bad_submit(rng: random.Random, index: int) -> tuple[bytes | dict, dict[str, str]]:
    """One submit that is certainly refused (each kind breaks one rule), and its headers."""
    good = {"call_id": f"fuzz-{index}", "method": "record", "args": ["k", index], "kwargs": {}, "wait_s": 0}
    body: dict[str, Any] = dict(good)
    kind = rng.randrange(12)
    if kind == 0:
        body["wait_s"] = rng.choice([-1, "1", True, None, [], {}, -1e-9, "nan"])
    elif kind == 1:
        body["call_id"] = rng.choice([None, 7, "", "y" * 129, [], {}, True])
    elif kind == 2:
        body["method"] = rng.choice([None, 3, "", "record ", "_execute", "__init__", "RECORD", [], "\ud800"])
    elif kind == 3:
        body["args"] = rng.choice([["k", True], ["k", "1"], ["k", 1.5], [1, 1], ["k"], ["k", 1, 2], [None, None]])
    elif kind == 4:
        body["args"], body["kwargs"] = [], rng.choice([{"key": "k"}, {"key": "k", "value": True}, {"colour": 1}])
    elif kind == 5:
        body[rng.choice(["extra", "callid", "Method", "timeout"])] = _junk(rng)
    elif kind == 6:
        body.pop(rng.choice(["call_id", "method"]))
    elif kind == 7:
        body[rng.choice(["args", "kwargs"])] = rng.choice(["k", 5, True, None]) if rng.random() < 0.5 else {"k": 1}
    elif kind == 8:  # broken bytes: truncated JSON, NaN, huge numbers, deep nesting, random bytes
        raw = json.dumps(good).encode()
        return rng.choice(
            [
                raw[: rng.randrange(1, len(raw) - 1)],
                raw.replace(b'"wait_s": 0', b'"wait_s": NaN'),
                raw.replace(b'"k", ' + str(index).encode(), b'"k", ' + b"8" * rng.randrange(65, 6000)),
                raw.replace(b'"kwargs": {}', b'"kwargs": ' + b"[" * 3000 + b"]" * 3000),
                raw.replace(b'"wait_s": 0', b'"wait_s": 1e' + str(rng.randrange(309, 999)).encode()),
                bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))),
            ]
        ), AUTH
    elif kind == 9:  # a good body with a bad token
        return good, {"Authorization": rng.choice(["", TOKEN, f"Basic {TOKEN}", "Bearer nope", f"Bearer{TOKEN}"])}
    elif kind == 10:
        body["method"] = rng.choice(["scale", "total", "weigh", "configure", "toggle"])
        body["args"] = [rng.choice(["1", [True], {"a": "b"}, {"lr": True, "steps": 1}, [1.5]])]  # wrong for each
    else:
        body = rng.choice([[good], "submit", 5, None, [], True])  # type: ignore[assignment]
        return json.dumps(body).encode(), AUTH
    return body, AUTH


def _bad_poll(rng: random.Random) -> tuple[Any, dict[str, str]]:
    kind = rng.randrange(5)
    if kind == 0:
        wait_s = rng.choice(["nan", "inf", "-0.1", "x", "", "1,5", "0x10", "1e999", "+1", "1e"])
        return {"call_id": "fuzz-known", "wait_s": wait_s}, AUTH
    if kind == 1:
        return {"call_id": rng.choice(["", "z" * 129])}, AUTH
    if kind == 2:
        return [("call_id", "fuzz-known"), (rng.choice(["call_id", "other"]), "1")], AUTH
    if kind == 3:
        return {"call_id": f"never-{rng.randrange(10**6)}"}, AUTH  # unknown: 404
    return {"call_id": "fuzz-known"}, {"Authorization": rng.choice(["", "Bearer", f"Bearer {TOKEN}!"])}


@pytest.mark.parametrize("seed", [17, 2026])
def test_fuzzed_malformed_submits_and_polls_are_all_4xx_and_nothing_runs(seed: int) -> None:
    rng = random.Random(seed)

    async def scenario() -> None:
        async with Served(max_body_bytes=64 << 10) as served:
            known = await served.submit({"call_id": "fuzz-known", "method": "ping", "wait_s": 5})
            assert known.json()["state"] == "done"
            statuses: collections.Counter[int] = collections.Counter()
            for index in range(400):
                if rng.random() < 0.7:
                    body, headers = _bad_submit(rng, index)
                    response = await served.http.post("/rpc/submit", content=_encoded(body), headers=headers)
                else:
                    params, headers = _bad_poll(rng)
                    response = await served.http.get("/rpc/poll", params=params, headers=headers)
                assert 400 <= response.status_code < 500, (index, response.status_code, response.text)
                assert isinstance(response.json()["error"], str) and response.json()["error"]
                statuses[response.status_code] += 1
            assert served.worker.executions == {}
            assert len(served.server.store) == 1  # the one good call only
            assert {400, 401, 404} <= set(statuses), statuses
            health = await served.http.get("/rpc/health")
            assert health.json()["ok"] is True and health.json()["calls"] == 1
            good = await served.submit({"call_id": "after-fuzz", "method": "record", "args": ["k", 2], "wait_s": 5})
            assert good.json() == {"call_id": "after-fuzz", "state": "done", "result": 4}

    run(scenario())


# -- the client's resend rule: "never arrived" vs "may have run" --------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_refused_connection_is_sent_again_and_the_call_runs_once_when_the_worker_comes_up() -> None:
    async def scenario() -> None:
        port = _free_port()
        client = RpcClient(f"http://127.0.0.1:{port}", token=TOKEN, worker="typed-0")
        call = asyncio.create_task(client.call("record", "k", 5, timeout_s=30))
        while client.resends < 3 and not call.done():  # the worker is not up yet: connection refused, sent again
            await asyncio.sleep(0.01)
        async with Served(port=port) as served:
            assert await call == 10
            assert served.worker.executions == {"record": 1}
        await client.aclose()

    run(scenario())


def test_a_call_that_never_arrived_says_so_at_its_deadline() -> None:
    async def scenario() -> None:
        client = RpcClient(f"http://127.0.0.1:{_free_port()}", token=TOKEN, worker="typed-0")
        with pytest.raises(RpcDeadlineError, match="the worker never accepted it, so it did not run") as caught:
            await client.call("record", "k", 1, timeout_s=0.5)
        assert caught.value.may_have_run is False
        await client.aclose()

    run(scenario())


def test_an_overloaded_worker_s_503_is_sent_again_and_the_call_runs_once() -> None:
    async def scenario() -> None:
        async with Served(max_calls=1) as served:
            client = RpcClient(served.server.url, token=TOKEN, worker="typed-0")
            napping = asyncio.create_task(client.call("nap", 0.5))  # holds the only slot while it runs
            while served.worker.executions["nap"] == 0:
                await asyncio.sleep(0.01)
            assert await client.call("record", "k", 2, timeout_s=30) == 4  # 503 until the nap ends, then once
            assert client.resends >= 1 and served.worker.executions == {"nap": 1, "record": 1}
            assert await napping == 0.5
            blocker = asyncio.create_task(client.call("nap", 5.0))
            while served.worker.executions["nap"] == 1:
                await asyncio.sleep(0.01)
            with pytest.raises(RpcDeadlineError, match="the worker never accepted it, so it did not run") as caught:
                await client.call("record", "k", 3, timeout_s=0.5)  # only 503s: refused before it was accepted
            assert caught.value.may_have_run is False and "HTTP 503" in str(caught.value)
            assert served.worker.executions == {"nap": 2, "record": 1}
            blocker.cancel()
            await client.aclose()

    run(scenario())


def test_stopping_answers_a_held_open_request_at_once_instead_of_after_its_wait() -> None:
    async def scenario() -> None:
        worker = TypedWorker()
        server = RpcServer(worker, token=TOKEN, name="typed-0")
        await server.start()
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as http:
            body = {"call_id": "held", "method": "nap", "args": [300], "wait_s": 60}
            submit = asyncio.create_task(http.post("/rpc/submit", json=body))
            while worker.executions["nap"] == 0 and not submit.done():  # the call runs: the submit is held open
                await asyncio.sleep(0.01)
            # before the fix, stop() waited for the held request's full 60 s wait (uvicorn drains requests)
            await asyncio.wait_for(server.stop(), timeout=45)
            assert (await submit).json() == {"call_id": "held", "state": "running"}  # its outcome is unknown

    run(scenario())


def test_an_accepted_call_that_outlives_its_deadline_says_it_is_cancelled_unless_it_finished() -> None:
    async def scenario() -> None:
        async with Served() as served:
            client = RpcClient(served.server.url, token=TOKEN, worker="typed-0", long_poll_s=0.2)
            expected = (
                "the worker accepted it and cancels it at the same deadline unless it finished first: poll call id "
                "'slow' to learn its outcome"
            )
            with pytest.raises(RpcDeadlineError, match=expected) as caught:
                await client.call("nap", 3.0, timeout_s=0.6, call_id="slow")
            assert caught.value.may_have_run is True and served.worker.executions == {"nap": 1}
            polled = await served.http.get("/rpc/poll", params={"call_id": "slow", "wait_s": 5})
            assert polled.json()["error"]["type"] == "CallCancelled"  # at the worker's copy of the deadline
            await client.aclose()

    run(scenario())


def test_a_submit_dropped_after_it_was_sent_is_resubmitted_with_the_same_id_and_runs_once() -> None:
    async def scenario() -> None:
        async with Served() as served, FaultProxy(served.server.port, ["after", "after", "mid"]) as proxy:
            client = RpcClient(proxy.url, token=TOKEN, worker="typed-0", timeout_s=30)
            assert await client.call("record", "k", 3, call_id="same-id") == 6
            assert proxy.done["after"] == 2 and proxy.done["mid"] == 1
            assert served.worker.executions == {"record": 1}
            assert served.server.store.get("same-id") is not None and len(served.server.store) == 1
            await client.aclose()

    run(scenario())


def test_a_call_whose_answers_keep_being_dropped_may_have_run_at_its_deadline() -> None:
    async def scenario() -> None:
        async with Served() as served, FaultProxy(served.server.port, ["after"] * 1000) as proxy:
            client = RpcClient(proxy.url, token=TOKEN, worker="typed-0", long_poll_s=0.1)
            with pytest.raises(RpcDeadlineError) as caught:
                await client.call("record", "k", 1, timeout_s=1.0, call_id="dropped")
            assert caught.value.may_have_run is True
            assert "it may have run: submit call id 'dropped' again to learn its outcome" in str(caught.value)
            assert served.worker.executions == {"record": 1} and proxy.done["after"] >= 2
            await client.aclose()

    run(scenario())


def test_a_call_that_may_have_run_and_whose_result_expired_is_lost_not_refused() -> None:
    """The submit ran but its answer was dropped; the resubmit arrives after the result expired: the outcome is
    unknown (CallLostError), not "your request was refused"."""

    async def scenario() -> None:
        plan = ["after"] + ["before"] * 4  # the answer is dropped, then the resubmits are held back past the expiry
        async with Served(result_ttl_s=0.05) as served, FaultProxy(served.server.port, plan) as proxy:
            client = RpcClient(proxy.url, token=TOKEN, worker="typed-0", timeout_s=30)
            with pytest.raises(CallLostError, match=r"typed-0\.record .* the call's outcome is unknown"):
                await client.call("record", "k", 1, call_id="lost-id")
            assert proxy.done["before"] == 4
            assert served.worker.executions == {"record": 1}
            # a new call reusing that id was never submitted by this client: that is a refusal (410), not a loss
            fresh = RpcClient(served.server.url, token=TOKEN, worker="typed-0")
            with pytest.raises(RpcRequestError, match="HTTP 410: call id 'lost-id' was already executed") as caught:
                await fresh.call("record", "k", 1, call_id="lost-id")
            assert caught.value.status == 410 and served.worker.executions == {"record": 1}
            await client.aclose()
            await fresh.aclose()

    run(scenario())


def test_a_dead_worker_reports_whether_the_call_may_have_run() -> None:
    async def dead() -> bool:
        return False

    async def scenario() -> None:
        refused = RpcClient(f"http://127.0.0.1:{_free_port()}", token=TOKEN, worker="typed-0", liveness=dead)
        with pytest.raises(WorkerDiedError, match="the worker never accepted it, so it did not run") as caught:
            await refused.call("ping", timeout_s=10)
        assert caught.value.may_have_run is False
        await refused.aclose()
        async with Served() as served, FaultProxy(served.server.port, ["after"]) as proxy:
            dropped = RpcClient(proxy.url, token=TOKEN, worker="typed-0", liveness=dead)
            with pytest.raises(WorkerDiedError, match="it may have run") as caught:
                await dropped.call("record", "k", 1, timeout_s=10)
            assert caught.value.may_have_run is True
            await dropped.aclose()

    run(scenario())
