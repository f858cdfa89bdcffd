"""The RPC wire models: records round-trip in the shape the protocol documents, the models are frozen and strict,
a misfit is named field by field, and a client refuses an answer that is not a call record, from a real HTTP server
that answers what the test tells it (a stand-in for a wrong program on a worker's port, not a worker)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from typing import Any

import pydantic
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from miles_core.workers.errors import RemoteError, RpcProtocolError
from miles_core.workers.process import listening_socket
from miles_core.workers.rpc.client import RpcClient
from miles_core.workers.rpc.server import RpcServer
from miles_core.workers.rpc.wire import (
    MAX_WAIT_S,
    POLL_PATH,
    SUBMIT_PATH,
    CallFailure,
    CallRecord,
    ErrorBody,
    PollRequest,
    SubmitRequest,
    WireError,
    validate,
    validate_json,
)

TOKEN = "wire-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- the models ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "wire"),
    [
        (CallRecord(call_id="c1", state="running"), {"call_id": "c1", "state": "running"}),
        (CallRecord(call_id="c2", state="done", result={"a": [1, 2.5, None]}), None),
        (CallRecord(call_id="c3", state="done"), {"call_id": "c3", "state": "done", "result": None}),
        (
            CallRecord(call_id="c4", state="failed", error=CallFailure(type="ValueError", message="m", traceback="t")),
            {"call_id": "c4", "state": "failed", "error": {"type": "ValueError", "message": "m", "traceback": "t"}},
        ),
    ],
)
def test_a_record_round_trips_with_only_the_fields_of_its_state(record: CallRecord, wire: dict | None) -> None:
    encoded = record.to_json()
    assert validate_json(CallRecord, encoded) == record
    expected = wire or {"call_id": record.call_id, "state": "done", "result": record.result}
    assert json.loads(encoded) == expected


def test_a_non_finite_result_travels_as_itself_not_as_null() -> None:
    encoded = CallRecord(call_id="n", state="done", result=[math.nan, math.inf]).to_json()
    assert encoded == b'{"call_id":"n","state":"done","result":[NaN,Infinity]}'
    result = validate_json(CallRecord, encoded).result
    assert math.isnan(result[0]) and result[1] == math.inf


def test_the_models_are_frozen_and_a_submit_has_the_documented_defaults() -> None:
    submit = validate(SubmitRequest, {"call_id": "s", "method": "ping"})
    assert (submit.args, submit.kwargs, submit.wait_s) == ([], {}, 0.0)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        submit.method = "other"  # type: ignore[misc]
    assert validate(SubmitRequest, {"call_id": "s", "method": "m", "wait_s": 10**9}).wait_s == MAX_WAIT_S
    assert validate(PollRequest, {"call_id": "p", "wait_s": 2}).wait_s == 2.0


@pytest.mark.parametrize(
    ("model", "data", "messages"),
    [
        (
            SubmitRequest,
            {"call_id": "", "method": "m", "wait_s": -1},
            [
                "call_id must be a string of 1 to 128 characters, got '' (String should have at least 1 character)",
                "wait_s must be a number of seconds >= 0 (at most 60 are used), got -1",
            ],
        ),
        (SubmitRequest, {"call_id": "a", "method": "m", "wait_s": math.inf}, ["got inf (Input should be a finite"]),
        (SubmitRequest, {"call_id": "a"}, ["method must be the name of a method (a non-empty string), got None"]),
        (SubmitRequest, {"call_id": "a", "method": "m", "ARGS": []}, ["unknown submit fields ['ARGS']; a submit has"]),
        (PollRequest, {"call_id": "a", "colour": "red"}, ["unknown poll fields ['colour']; a poll has"]),
        (CallRecord, {"call_id": "a", "state": "finished"}, ["state must be 'running', 'done' or 'failed'"]),
        (CallRecord, {"call_id": "a", "state": "failed"}, ["a failed call record needs an error {type"]),
        (CallRecord, {"call_id": "a", "state": "running", "result": 3}, ["a running call record has no result"]),
        (CallRecord, {"call_id": "a", "state": "done", "error": None, "result": 1, "x": 0}, ["fields ['x']"]),
        (
            CallRecord,
            {"call_id": "a", "state": "failed", "error": {"type": "E", "message": 5, "traceback": ""}},
            ["error must be an object {type, message, traceback} (failed records only), got 5 (error.message: Input"],
        ),
        (CallRecord, [1], ["call record: Input should be a valid dictionary"]),
        (ErrorBody, {"error": None}, ["error must be a message (a string), got None"]),
    ],
)
def test_a_misfit_names_every_field_its_value_and_what_is_allowed(model: type, data: Any, messages: list) -> None:
    with pytest.raises(WireError) as caught:
        validate(model, data)
    for message in messages:
        assert message in str(caught.value)


def test_strict_fields_take_no_coerced_values() -> None:
    for wait_s in (True, "1", None):
        with pytest.raises(WireError, match="wait_s must be"):
            validate(SubmitRequest, {"call_id": "a", "method": "m", "wait_s": wait_s})
    with pytest.raises(WireError, match="args must be a JSON list"):
        validate(SubmitRequest, {"call_id": "a", "method": "m", "args": ("tuple",)})


def test_a_lone_surrogate_in_an_error_message_is_escaped_so_the_body_encodes() -> None:
    assert json.loads(ErrorBody.of("bad \ud800 name").to_json()) == {"error": "bad \\ud800 name"}


# -- a real worker: what the models change on the wire ------------------------------------------------------------


def test_a_worker_s_records_refusals_and_failures_are_the_documented_models() -> None:
    def fail() -> None:
        raise ValueError("cannot read \ud800")  # a lone surrogate: not UTF-8, as hostile input repeated back

    async def scenario() -> None:
        server = RpcServer(token=TOKEN, name="wire-0")
        server.register("nan", lambda: math.nan, group="query")
        server.register("fail", fail, group="query")
        await server.start()
        client = RpcClient(server.url, token=TOKEN, worker="wire-0", timeout_s=20)
        try:
            assert math.isnan(await client.call("nan"))
            with pytest.raises(RemoteError) as caught:
                await client.call("fail")
            assert caught.value.error_type == "ValueError" and caught.value.remote_message == "cannot read \\ud800"
            with pytest.raises(ValueError, match=r"not a valid submit: method must be the name of a method"):
                await client.call("")
            http = client._client()
            hostile = json.dumps({"call_id": "h", "method": "nan", "kwargs": {"\ud800": 1}})  # ASCII-escaped
            refused = await http.post(f"{server.url}{SUBMIT_PATH}", content=hostile)
            assert refused.status_code == 400
            assert "unexpected keyword argument '\\ud800'" in validate_json(ErrorBody, refused.content).error
            polled = await http.get(f"{server.url}{POLL_PATH}", params={"call_id": "x", "colour": "red"})
            assert polled.status_code == 400
            assert validate_json(ErrorBody, polled.content).error.startswith("unknown poll fields ['colour']")
        finally:
            await client.aclose()
            await server.stop()

    run(scenario())


# -- a client facing a server that is not a worker -----------------------------------------------------------------


class AnsweringServer:
    """A real HTTP server on 127.0.0.1 whose submit route answers ``answer(call_id)`` with status 200."""

    def __init__(self, answer: Callable[[str], bytes]) -> None:
        self.answer = answer
        self.submits = 0
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self.url = ""

    async def _submit(self, request: Request) -> Response:
        self.submits += 1
        call_id = json.loads(await request.body())["call_id"]
        return Response(self.answer(call_id), media_type="application/json")

    async def __aenter__(self) -> AnsweringServer:
        sock = listening_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = Starlette(routes=[Route(SUBMIT_PATH, self._submit, methods=["POST"])])
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None and self._task is not None
        self._server.should_exit = True
        await self._task


def _json_answer(shape: Callable[[str], Any]) -> Callable[[str], bytes]:
    return lambda call_id: json.dumps(shape(call_id)).encode()


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (_json_answer(lambda cid: {"call_id": cid, "state": "finished"}), "state must be 'running', 'done' or"),
        (_json_answer(lambda cid: {"call_id": cid, "state": "failed"}), "a failed call record needs an error"),
        (
            _json_answer(lambda cid: {"call_id": cid, "state": "failed", "error": {"type": "E", "message": "m"}}),
            "error.traceback: Field required",
        ),
        (_json_answer(lambda cid: {"call_id": cid, "state": "done", "result": 1, "v": 2}), "call record fields ['v']"),
        (_json_answer(lambda cid: {"state": "done", "result": 1}), "call_id must be a string of 1 to 128 characters"),
        (_json_answer(lambda cid: {"ok": True}), "unknown call record fields ['ok']"),
        (lambda cid: b"<html>hello</html>", "call record: Invalid JSON"),
        (_json_answer(lambda cid: {"call_id": "someone-else", "state": "done"}), "the record of call 'someone-else'"),
    ],
)
def test_a_malformed_record_is_refused_naming_the_field(answer: Callable[[str], bytes], message: str) -> None:
    async def scenario() -> None:
        async with AnsweringServer(answer) as server:
            client = RpcClient(server.url, token=TOKEN, worker="not-a-worker", timeout_s=10)
            try:
                with pytest.raises(RpcProtocolError) as caught:
                    await client.call("ping", call_id="c-1")
            finally:
                await client.aclose()
            assert message in str(caught.value)
            assert "not-a-worker.ping (call c-1" in str(caught.value) and server.url in str(caught.value)
            assert caught.value.may_have_run is True
            assert server.submits == 1  # refused at once: a malformed answer is not resent

    run(scenario())
