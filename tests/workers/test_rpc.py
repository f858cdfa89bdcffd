"""The submit-poll RPC: results, remote errors, exactly-once under connection faults, expiry, limits, bad input."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from miles_core.testkit.echo_worker import ECHO_GROUPS, EchoWorker
from miles_core.testkit.fault_proxy import FaultProxy
from miles_core.workers.errors import CallLostError, RemoteError, RpcDeadlineError, RpcRequestError
from miles_core.workers.handle import WorkerHandle
from miles_core.workers.rpc.client import RpcClient
from miles_core.workers.rpc.server import RpcServer
from miles_core.workers.rpc.wire import CANCELLED

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Served:
    """An EchoWorker served in this event loop."""

    def __init__(self, **server_kwargs) -> None:
        self.worker = EchoWorker()
        self.server = RpcServer(self.worker, token=TOKEN, name="echo-0", groups=ECHO_GROUPS, **server_kwargs)

    async def __aenter__(self) -> Served:
        await self.server.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.server.stop()

    def client(self, url: str | None = None, **kwargs) -> RpcClient:
        return RpcClient(url or self.server.url, token=TOKEN, worker="echo-0", **kwargs)

    def handle(self, url: str | None = None, **kwargs) -> WorkerHandle:
        return WorkerHandle(self.client(url, **kwargs), EchoWorker)


def run(coro):
    return asyncio.run(coro)


def test_typed_handle_calls_and_checks_signatures() -> None:
    async def scenario() -> None:
        async with Served() as served:
            handle = served.handle()
            assert await handle.record("a", 21) == 42
            assert await handle.record(key="b", value=1) == 2
            with pytest.raises(TypeError, match="missing a required argument: 'value'"):
                await handle.record("c")
            with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
                await handle.record("c", 1, colour="red")
            with pytest.raises(AttributeError, match="EchoWorker has no RPC method 'reset'"):
                handle.reset  # noqa: B018
            assert served.worker.executions == {"a": 1, "b": 1}
            await handle.client.aclose()

    run(scenario())


def test_remote_exception_comes_back_with_type_message_and_traceback() -> None:
    async def scenario() -> None:
        async with Served() as served:
            handle = served.handle()
            with pytest.raises(RemoteError) as caught:
                await handle.fail("disk on fire")
            error = caught.value
            assert (error.error_type, error.remote_message, error.worker, error.method) == (
                "ValueError",
                "disk on fire",
                "echo-0",
                "fail",
            )
            assert "in fail\n    raise ValueError(message)" in error.remote_traceback
            assert await handle.ping() == "pong"  # the server keeps serving
            await handle.client.aclose()

    run(scenario())


@pytest.mark.parametrize("plan", [["before"] * 3, ["after"] * 3, ["mid"] * 3, ["before", "after", "mid"] * 4])
def test_exactly_once_through_connection_faults(plan: list[str]) -> None:
    async def scenario() -> None:
        async with Served() as served, FaultProxy(served.server.port, plan) as proxy:
            client = served.client(proxy.url, timeout_s=30)
            results = [await client.call("record", f"key-{i}", i) for i in range(6)]
            assert results == [2 * i for i in range(6)]
            assert served.worker.executions == {f"key-{i}": 1 for i in range(6)}
            assert sum(proxy.done[fault] for fault in set(plan)) == len(plan)  # every planned fault happened
            assert client.resends >= len(plan)
            await client.aclose()

    run(scenario())


def test_concurrent_calls_through_faults_each_run_once() -> None:
    async def scenario() -> None:
        async with Served() as served, FaultProxy(served.server.port, ["before", "after", "mid"] * 5) as proxy:
            client = served.client(proxy.url, timeout_s=30)
            results = await asyncio.gather(*(client.call("record", f"k{i}", i) for i in range(20)))
            assert results == [2 * i for i in range(20)]
            assert served.worker.executions == {f"k{i}": 1 for i in range(20)}
            await client.aclose()

    run(scenario())


def test_long_poll_waits_without_spinning() -> None:
    async def scenario() -> None:
        async with Served() as served:
            client = served.client(long_poll_s=5)
            assert 0.9 < await client.call("sleep", 1.0) < 2.0
            assert client.resends == 0
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
                submitted = await http.post(
                    f"{served.server.url}/rpc/submit", json={"call_id": "slow", "method": "sleep", "args": [0.5]}
                )
                assert submitted.json() == {"call_id": "slow", "state": "running"}  # answered at once
                start = time.monotonic()
                polled = await http.get(f"{served.server.url}/rpc/poll", params={"call_id": "slow", "wait_s": 5})
                assert polled.json()["state"] == "done"
                assert 0.3 < time.monotonic() - start < 2.0  # held open until the result, not until wait_s
            await client.aclose()

    run(scenario())


def test_results_expire_and_unknown_ids_are_404() -> None:
    async def scenario() -> None:
        async with Served(result_ttl_s=0.3) as served:
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
                url = served.server.url
                done = await http.post(f"{url}/rpc/submit", json={"call_id": "c1", "method": "ping", "wait_s": 2})
                assert done.json() == {"call_id": "c1", "state": "done", "result": "pong"}
                assert (await http.get(f"{url}/rpc/poll", params={"call_id": "c1"})).status_code == 200
                await asyncio.sleep(0.8)
                expired = await http.get(f"{url}/rpc/poll", params={"call_id": "c1"})
                assert expired.status_code == 410 and "expired" in expired.json()["error"]
                again = await http.post(f"{url}/rpc/submit", json={"call_id": "c1", "method": "ping"})
                assert again.status_code == 410 and "use a new id" in again.json()["error"]
                unknown = await http.get(f"{url}/rpc/poll", params={"call_id": "never-submitted"})
                assert unknown.status_code == 404 and "unknown call id" in unknown.json()["error"]
            assert served.server.store.expired == 1 and len(served.server.store) == 0

    run(scenario())


def test_call_lost_when_the_worker_restarts_mid_call() -> None:
    async def scenario() -> None:
        first = RpcServer(EchoWorker(), token=TOKEN, name="echo-0", groups=ECHO_GROUPS)
        await first.start()
        client = RpcClient(first.url, token=TOKEN, worker="echo-0", long_poll_s=0.1)
        call = asyncio.create_task(client.call("sleep", 2.0, timeout_s=10))
        await asyncio.sleep(0.3)
        await first.stop()
        second = RpcServer(EchoWorker(), token=TOKEN, name="echo-0", groups=ECHO_GROUPS, port=first.port)
        await second.start()
        with pytest.raises(CallLostError, match=r"echo-0\.sleep .* is no longer known to the worker"):
            await call
        await client.aclose()
        await second.stop()

    run(scenario())


def test_store_memory_stays_bounded_under_load() -> None:
    async def scenario() -> None:
        async with Served(max_calls=50, max_result_bytes=200_000) as served:
            client = served.client()
            await asyncio.gather(*(client.call("blob", 10_000) for _ in range(200)))
            store = served.server.store
            assert len(store) <= 50 and store.result_bytes <= 200_000
            assert store.evicted >= 150
            await client.aclose()

    run(scenario())


def test_concurrency_groups_hold_their_limits_under_50_callers() -> None:
    async def scenario() -> None:
        async with Served() as served:
            client = served.client(timeout_s=60)
            await asyncio.gather(*(client.call("hold_control", 0.01) for _ in range(50)))
            await asyncio.gather(*(client.call("hold_limited", 0.05) for _ in range(50)))
            await asyncio.gather(*(client.call("hold_query", 0.2) for _ in range(50)))
            peaks = await client.call("concurrency_peaks")
            assert peaks["control"] == 1
            assert peaks["limited"] == 4
            assert peaks["query"] > 4  # unlimited really runs in parallel
            await client.aclose()

    run(scenario())


@pytest.mark.parametrize(
    ("request_kwargs", "status", "message"),
    [
        ({"content": b"{not json"}, 400, "not valid JSON"),
        ({"json": [1, 2]}, 400, "must be a JSON object"),
        ({"json": {"call_id": "", "method": "ping"}}, 400, "call_id must be a string"),
        ({"json": {"call_id": "x1", "method": "format_disk"}}, 404, "has no method 'format_disk'"),
        ({"json": {"call_id": "x2", "method": "record", "args": ["k", "many"]}}, 400, "bad argument value='many'"),
        ({"json": {"call_id": "x3", "method": "record", "args": ["k"]}}, 400, "missing a required argument"),
        ({"json": {"call_id": "x4", "method": "record", "args": "k"}}, 400, "args must be a JSON list"),
        ({"content": b'{"call_id": "x5", "method": "blob", "args": [' + b"1" * 3000 + b"]}"}, 413, "exceeds the limit"),
    ],
)
def test_bad_requests_get_a_clear_4xx_and_the_server_keeps_serving(request_kwargs, status, message) -> None:
    async def scenario() -> None:
        async with Served(max_body_bytes=2048) as served:
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
                response = await http.post(f"{served.server.url}/rpc/submit", **request_kwargs)
                assert response.status_code == status
                assert message in response.json()["error"]
            client = served.client()
            assert await client.call("ping") == "pong"
            await client.aclose()

    run(scenario())


def test_token_is_required_on_every_route() -> None:
    async def scenario() -> None:
        async with Served() as served:
            url = served.server.url
            async with httpx.AsyncClient() as http:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
                    for response in (
                        await http.post(f"{url}/rpc/submit", json={"call_id": "t", "method": "ping"}, headers=headers),
                        await http.get(f"{url}/rpc/poll", params={"call_id": "t"}, headers=headers),
                        await http.get(f"{url}/rpc/health", headers=headers),
                    ):
                        assert response.status_code == 401, response.text
            assert served.worker.executions == {}
            bad_client = RpcClient(url, token="wrong", worker="echo-0")
            with pytest.raises(RpcRequestError, match="HTTP 401: missing or wrong run token"):
                await bad_client.call("ping")
            await bad_client.aclose()

    run(scenario())


def test_duplicate_call_id_with_different_arguments_is_409() -> None:
    async def scenario() -> None:
        async with Served() as served:
            client = served.client()
            assert await client.call("record", "k", 1, call_id="same") == 2
            assert await client.call("record", "k", 1, call_id="same") == 2  # identical: the stored result
            with pytest.raises(RpcRequestError, match="HTTP 409: call id 'same' was already submitted"):
                await client.call("record", "k", 2, call_id="same")
            assert served.worker.executions == {"k": 1}
            await client.aclose()

    run(scenario())


def test_unreachable_worker_fails_within_the_deadline() -> None:
    async def scenario() -> None:
        async with Served() as served:
            port = served.server.port
        client = RpcClient(f"http://127.0.0.1:{port}", token=TOKEN, worker="echo-0")
        start = time.monotonic()
        expected = r"echo-0\.ping .* did not finish before its deadline; the worker never accepted it, so it did not"
        with pytest.raises(RpcDeadlineError, match=expected + " run; last error") as caught:
            await client.call("ping", timeout_s=1.0)
        assert caught.value.may_have_run is False
        assert time.monotonic() - start < 3.0
        await client.aclose()

    run(scenario())


def test_non_json_result_is_a_remote_error() -> None:
    async def scenario() -> None:
        server = RpcServer(token=TOKEN, name="odd")
        server.register("odd", lambda: object(), group="query")
        await server.start()
        client = RpcClient(server.url, token=TOKEN, worker="odd")
        with pytest.raises(RemoteError, match="PydanticSerializationError"):
            await client.call("odd")
        await client.aclose()
        await server.stop()

    run(scenario())


def test_health_route() -> None:
    async def scenario() -> None:
        async with Served() as served:
            client = served.client()
            health = await client.health()
            assert health["ok"] is True and health["name"] == "echo-0"
            await client.aclose()

    run(scenario())


def test_submit_body_is_plain_json() -> None:
    """Nothing is unpickled: a pickle payload is just invalid JSON."""
    import pickle

    async def scenario() -> None:
        async with Served() as served, httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            response = await http.post(f"{served.server.url}/rpc/submit", content=pickle.dumps({"x": 1}))
            assert response.status_code == 400
            assert json.loads(response.text)["error"].startswith("request body is not valid JSON")

    run(scenario())


# -- cancellation: a call nobody waits for holds no concurrency slot ---------------------------------------------


def test_a_call_past_its_caller_s_deadline_is_cancelled_and_frees_its_single_slot_group() -> None:
    async def scenario() -> None:
        async with Served() as served:
            client = served.client(long_poll_s=0.2)
            with pytest.raises(RpcDeadlineError) as caught:
                await client.call("sleep", 1e308, timeout_s=0.5, call_id="forever")  # holds the control group
            # before cancellation, this control call waited behind the sleep until its own deadline
            assert await client.call("set_version", 3, timeout_s=5) == 3
            assert "the worker accepted it and cancels it at the same deadline unless it finished" in str(caught.value)
            record = await client.cancel("forever")
            assert (record.state, record.error.type) == ("failed", CANCELLED)
            assert "call 'forever' (sleep) was cancelled: its caller's deadline (" in record.error.message
            await client.aclose()

    run(scenario())


def test_the_cancel_route_cancels_a_running_call_and_answers_its_record() -> None:
    async def scenario() -> None:
        async with Served() as served, httpx.AsyncClient(base_url=served.server.url, headers=AUTH) as http:
            body = {"call_id": "held", "method": "sleep", "args": [1e308]}  # no deadline_s: only a cancel ends it
            assert (await http.post("/rpc/submit", json=body)).json() == {"call_id": "held", "state": "running"}
            poll = asyncio.create_task(http.get("/rpc/poll", params={"call_id": "held", "wait_s": 30}, timeout=60))
            await asyncio.sleep(0.1)
            cancelled = await http.post("/rpc/cancel", json={"call_id": "held"})
            assert cancelled.status_code == 200 and cancelled.json()["error"]["type"] == CANCELLED
            assert "was cancelled: a cancel request came" in cancelled.json()["error"]["message"]
            assert (await poll).json() == cancelled.json()  # the held-open poll is answered at once
            client = served.client()
            assert await client.call("set_version", 4, timeout_s=5) == 4  # the control group is free
            assert (await http.post("/rpc/cancel", json={"call_id": "held"})).json() == cancelled.json()  # again
            await client.call("set_version", 5, call_id="finished", timeout_s=5)
            done = await http.post("/rpc/cancel", json={"call_id": "finished"})  # a finished call keeps its record
            assert done.json() == {"call_id": "finished", "state": "done", "result": 5}
            unknown = await http.post("/rpc/cancel", json={"call_id": "nope"})
            assert unknown.status_code == 404 and "unknown call id 'nope'" in unknown.json()["error"]
            for bad, message in [
                ({"call_id": ""}, "call_id must be a string of 1 to 128 characters"),
                ({"call_id": "held", "force": True}, "unknown cancel fields ['force']"),
                ([1], "request body must be a JSON object, got list"),
            ]:
                refused = await http.post("/rpc/cancel", json=bad)
                assert refused.status_code == 400 and message in refused.json()["error"], refused.text
            no_token = await http.post("/rpc/cancel", json={"call_id": "held"}, headers={"Authorization": "x"})
            assert no_token.status_code == 401
            await client.aclose()

    run(scenario())


@pytest.mark.parametrize("deadline_s", [0, -1, "5", True, [5]])
def test_a_bad_deadline_is_a_400_and_nothing_runs(deadline_s) -> None:
    async def scenario() -> None:
        async with Served() as served, httpx.AsyncClient(base_url=served.server.url, headers=AUTH) as http:
            body = json.dumps({"call_id": "d", "method": "ping", "deadline_s": deadline_s}).encode()
            response = await http.post("/rpc/submit", content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == 400
            assert "deadline_s must be the caller's deadline: a number of seconds > 0" in response.text
            assert len(served.server.store) == 0

    run(scenario())


def test_a_cancelled_synchronous_call_is_answered_at_once_and_keeps_its_slot_until_its_thread_returns() -> None:
    async def scenario() -> None:
        served = Served()
        served.server = RpcServer(served.worker, token=TOKEN, name="echo-0", groups={**ECHO_GROUPS, "limited": 1})
        async with served:
            client = served.client(long_poll_s=0.1)
            with pytest.raises(RpcDeadlineError):
                await client.call("hold_limited", 1.5, timeout_s=0.3, call_id="sync")
            record = await client.cancel("sync")
            assert record.error is not None and record.error.type == CANCELLED  # before its thread returned
            # the thread cannot be stopped: the next call of the group waits for it, and the limit of 1 holds
            assert await client.call("hold_limited", 0.0, timeout_s=10) == 1
            assert served.worker.peaks["limited"] == 1
            await client.aclose()

    run(scenario())
