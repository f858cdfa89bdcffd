"""Hostile input against a real local-engine server on 127.0.0.1: every route, every field, refused with a 4xx that
says what is wrong, nothing deleted or written on a refused request, and the engine still serving afterwards."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import os
import random
import re
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save, save_file

from miles_core.builtin.local_engine.engine import LocalEngine, _Pending
from miles_core.builtin.local_engine.sampling import GenerationRequest, SamplingParams
from miles_core.engines.staging import STAGING_DIR_ENV
from miles_core.testkit.tiny_models import save_tiny_llama
from miles_core.weight_transfer.staging_layout import StagingLayout
from miles_core.workers.process import free_ports
from miles_core.workers.rpc.wire import TOKEN_ENV

ADMIN = "hostile-admin-key"
VOCAB = 64  # the tiny Llama's vocabulary
CONTEXT = 4096  # its max_position_embeddings here: long enough that a cancelled request is cut visibly short
START_TIMEOUT_S = 180
pytestmark = pytest.mark.slow


class EngineProcess:
    """``python -m miles_core.builtin.local_engine.server`` as a child process (stopped by pid), its stderr in a
    file."""

    def __init__(self, model_dir: Path, workdir: Path, *, admin_key: str | None, extra: list[str] = ()) -> None:
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"engine-{self.port}.log"
        self.staging_dir = workdir / "staging"
        self.staging_dir.mkdir(mode=0o700, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        env[STAGING_DIR_ENV] = str(self.staging_dir)
        argv = [
            sys.executable,
            "-m",
            "miles_core.builtin.local_engine.server",
            "--model-path",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *extra,
        ]
        if admin_key is not None:
            argv += ["--admin-api-key", admin_key]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"engine exited with {self.process.returncode}: {self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"engine not healthy after {START_TIMEOUT_S} s: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    process = EngineProcess(model_dir, tmp_path_factory.mktemp("hostile"), admin_key=ADMIN)
    yield process
    process.stop()


AUTH = {"Authorization": f"Bearer {ADMIN}"}


def post(
    engine: EngineProcess,
    path: str,
    body: object = None,
    *,
    content: bytes | None = None,
    auth: bool = True,
    timeout: float = 60,
) -> httpx.Response:
    headers = AUTH if auth else {}
    if content is None:
        content = json.dumps(body).encode()
    return httpx.post(f"{engine.url}{path}", content=content, headers=headers, timeout=timeout)


def refused(response: httpx.Response, status: int = 400, match: str = "") -> str:
    """Assert a refusal with ``status`` whose message matches ``match``; returns the message."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    message = response.json()["error"]
    assert re.search(match, message), message
    return message


def checksum(engine: EngineProcess) -> str:
    return post(engine, "/weights_checksum", {}).json()["checksum"]


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_still_serving(engine: EngineProcess) -> None:
    assert httpx.get(f"{engine.url}/health", timeout=10).status_code == 200
    out = post(engine, "/generate", {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert out.status_code == 200 and len(out.json()["output_ids"]) == 2, out.text


def engine_state(engine: EngineProcess) -> dict:
    return httpx.get(f"{engine.url}/server_info", timeout=10).json()["internal_states"][0]


async def wait_until(client: httpx.AsyncClient, predicate, what: str, timeout_s: float = 60) -> None:
    """Poll the engine's state until ``predicate`` holds (a bound on waiting, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not predicate((await client.get("/server_info")).json()["internal_states"][0]):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.05)


def wait_for(predicate, what: str, timeout_s: float = 120) -> None:
    """Poll ``predicate`` until true (a bound on waiting, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


# -- the admin key ------------------------------------------------------------------------------------------------


def test_without_an_admin_key_the_control_routes_need_a_generated_key(model_dir: Path, tmp_path: Path) -> None:
    """Started as the local engine's reference page shows it (no key): control routes are never open; the key is in a
    0600 file."""
    process = EngineProcess(model_dir, tmp_path, admin_key=None)
    try:
        found = re.search(r"control routes need the key in (\S+) \(mode 0600\)", process.log())
        assert found, process.log()
        key_file = Path(found.group(1))
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = key_file.read_text().strip()
        assert len(key) >= 32
        for path in ("/pause_generation", "/update_weight_version", "/flush_cache", "/weights_checksum"):
            refused(httpx.post(f"{process.url}{path}", json={"new_version": "x"}), 401, "admin key")
        ok = httpx.post(f"{process.url}/flush_cache", headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200, ok.text
    finally:
        process.stop()
    assert not key_file.exists(), "a generated key file is removed when the engine stops"


@pytest.mark.parametrize(
    ("header", "status"),
    [
        (f"Bearer {ADMIN}", 200),
        (f"bearer {ADMIN}", 200),
        (f"BEARER  {ADMIN}", 200),
        (ADMIN, 401),  # the key without a scheme
        (f"Basic {ADMIN}", 401),
        ("Bearer", 401),
        (f"Bearer {ADMIN}x", 401),
        (f"Bearer {ADMIN[:-1]}", 401),
        ("Bearer \u00e9t\u00e9", 401),
    ],
)
def test_the_bearer_check_is_the_toolkit_one(engine: EngineProcess, header: str, status: int) -> None:
    response = httpx.post(f"{engine.url}/flush_cache", headers={"Authorization": header.encode("utf-8")})
    assert response.status_code == status, (header, response.text)


# -- weight-update paths ------------------------------------------------------------------------------------------


def tiny_update(model_dir: Path, *, bad_shape: bool = False) -> dict[str, torch.Tensor]:
    """One weight of the tiny model, changed (or with a shape that does not fit)."""
    return {"model.norm.weight": torch.full((3,) if bad_shape else (64,), 0.5)}


def test_safetensors_path_outside_the_staging_dir_is_refused_and_not_deleted(engine, model_dir, tmp_path) -> None:
    before = checksum(engine)
    outside = tmp_path / "precious.safetensors"
    save_file(tiny_update(model_dir), str(outside))
    link = engine.staging_dir / "link-out.safetensors"
    link.symlink_to(outside)
    escape = f"{engine.staging_dir}/../{tmp_path.name}/precious.safetensors"
    for path, match in [
        (str(outside), "not in this engine's weight-staging directory"),
        (str(link), "not in this engine's weight-staging directory"),
        (escape, "not in"),
        (str(engine.staging_dir), "not in"),
        (str(engine.staging_dir / "missing"), "No such file"),
        ("", "must be the path"),
        ("/dev/null", "not in"),
    ]:
        body = {"serialized_named_tensors": [path], "load_format": "safetensors_path", "weight_version": "evil"}
        refused(post(engine, "/update_weights_from_tensor", body), 400, match)
    assert outside.is_file() and link.is_symlink(), "a refused request deleted nothing"
    assert checksum(engine) == before
    link.unlink()


def test_safetensors_path_in_the_staging_dir_is_removed_only_once_loaded(engine, model_dir) -> None:
    before = checksum(engine)
    staged = engine.staging_dir / "update.safetensors"
    save_file(tiny_update(model_dir, bad_shape=True), str(staged))
    body = {"serialized_named_tensors": [str(staged)], "load_format": "safetensors_path"}
    refused(post(engine, "/update_weights_from_tensor", body), 400, r"model\.norm\.weight: shape \(3,\)")
    assert staged.is_file(), "a refused update leaves its file to the sender"
    assert checksum(engine) == before
    save_file(tiny_update(model_dir), str(staged))
    ok = post(engine, "/update_weights_from_tensor", {**body, "weight_version": before[:8]})
    assert ok.status_code == 200, ok.text
    assert not staged.exists() and checksum(engine) != before


def staging_file(directory: Path, tensors: dict[str, torch.Tensor], name: str) -> tuple[Path, dict]:
    """A staging file holding ``tensors`` (as the tensor protocol writes one) and its request body."""
    layout = StagingLayout.of(tensors.items())
    buffer = bytearray(layout.size)
    for entry, tensor in zip(layout.tensors, tensors.values(), strict=True):
        buffer[entry.offset : entry.offset + entry.nbytes] = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    path = directory / name
    path.write_bytes(bytes(buffer))
    return path, {"staging_path": str(path), "buffer_size": layout.size, "layout": layout.to_wire()}


@pytest.mark.parametrize("swap", [False, True])
def test_staging_files_outside_the_staging_dir_are_never_mapped(engine, model_dir, tmp_path, swap) -> None:
    """Neither copied from nor aliased: a later update would otherwise write into whatever file it named."""
    before = checksum(engine)
    outside, body = staging_file(tmp_path, tiny_update(model_dir), "not-staging")
    digest = file_digest(outside)
    link = engine.staging_dir / f"miles-staging-link-{swap}"
    link.symlink_to(outside)
    try:
        for target in (str(outside), str(link)):
            request = body | {"staging_path": target, "swap": swap}
            refused(post(engine, "/update_weights_from_staging", request), 400, "not in this engine's weight-staging")
        # An update after the refusals copies into the served weights: had they been aliased, it would write there.
        refresh = {"model.norm.weight": torch.full((64,), 0.8 if swap else 0.75)}
        body = {"serialized_named_tensors": [base64.b64encode(save(refresh)).decode()]}
        assert post(engine, "/update_weights_from_tensor", body).status_code == 200
        assert file_digest(outside) == digest and link.is_symlink()
        assert checksum(engine) != before  # the refresh was loaded (into the engine's own memory)
    finally:
        link.unlink()


def test_staging_inside_the_staging_dir_still_works(engine, model_dir) -> None:
    tensors = {"model.norm.weight": torch.full((64,), 0.25)}
    path, body = staging_file(engine.staging_dir, tensors, "miles-staging-ok")
    before = checksum(engine)
    for swap in (False, True):
        response = post(engine, "/update_weights_from_staging", body | {"swap": swap, "weight_version": f"s{swap}"})
        assert response.status_code == 200, response.text
        assert response.headers["X-Weight-Version"] == f"s{swap}"
    assert checksum(engine) != before
    path.unlink()
    assert_still_serving(engine)


def _staging_body(**change: object) -> dict:
    layout = StagingLayout.of([("model.norm.weight", torch.zeros(64))]).to_wire()
    return {"staging_path": "/dev/shm/x", "buffer_size": 256, "layout": layout} | change


def _layout_with(**change: object) -> dict:
    layout = _staging_body()["layout"]
    return _staging_body(layout=layout | change)


def _entry_with(**change: object) -> dict:
    layout = _staging_body()["layout"]
    return _staging_body(layout=layout | {"tensors": [layout["tensors"][0] | change]})


MALFORMED_STAGING = [
    (b"not json", "not valid JSON"),
    (b'["a list"]', "object"),
    (b'{"staging_path": "x", "buffer_size": NaN, "layout": {}}', "NaN"),
    (b"[" * 200 + b"]" * 200, "nested deeper"),
    ({}, "missing field 'layout'"),
    (_staging_body(layout=json.dumps(_staging_body()["layout"])), "field 'layout' must be dict"),  # JSON in JSON
    (_staging_body(extra=1), "unknown field 'extra'"),
    (_staging_body(serialized_named_tensors=["x"]), "unknown field 'serialized_named_tensors'"),
    ({k: v for k, v in _staging_body().items() if k != "staging_path"}, "missing field 'staging_path'"),
    (_staging_body(staging_path=3), "field 'staging_path' must be str"),
    (_staging_body(buffer_size="256"), "field 'buffer_size' must be int"),
    (_staging_body(buffer_size=0), "field 'buffer_size' must be an integer from 1"),
    (_staging_body(swap="yes"), "field 'swap' must be bool"),
    (_staging_body(weight_version="\n"), "weight_version"),
    (_layout_with(tensors="w"), r"layout\.tensors must be a list"),
    (_layout_with(tensors=[["model.norm.weight", "float32", [64], 0]]), r"layout\.tensors\[0\] must be an object"),
    (_layout_with(size=-1), r"layout\.size must be from 0"),
    (_layout_with(alignment=3), r"layout\.alignment must be a power of two"),
    (_layout_with(extra=1), r"layout: unknown extra"),
    (_entry_with(shape=[-2]), r"layout\.tensors\[0\]\.shape\[0\] must be from 0"),
    (_entry_with(offset=-8), r"layout\.tensors\[0\]\.offset must be from 0"),
    (_entry_with(dtype="complex_nonsense"), r"layout\.tensors\[0\] \('model\.norm\.weight'\): unknown dtype"),
    (_entry_with(nbytes=8), r"nbytes 8 does not match shape \(64,\)"),
    (_layout_with(size=100), r"lie beyond the layout's size 100"),
]


@pytest.mark.parametrize(("body", "match"), MALFORMED_STAGING)
def test_malformed_staging_requests_are_400(engine, body: dict | bytes, match: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    refused(post(engine, "/update_weights_from_staging", content=content), 400, match)


def test_staging_formats_of_update_weights_from_tensor_are_gone(engine) -> None:
    for load_format in ("shm_staging", "shm_swap"):
        body = {"serialized_named_tensors": ["{}"], "load_format": load_format}
        refused(post(engine, "/update_weights_from_tensor", body), 400, "go to /update_weights_from_staging")


def _layout_of(name: str, dtype: str, shape: list[int], offset: int, *, size: int) -> dict:
    nbytes = 4 * math.prod(shape)
    entry = {"name": name, "dtype": dtype, "shape": shape, "offset": offset, "nbytes": nbytes}
    return {"alignment": 1, "size": max(size, offset + nbytes), "tensors": [entry]}


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (("model.norm.weight", "float32", [32], 2), "not a multiple of 4"),  # misaligned for float32
        (("model.norm.weight", "float32", [1 << 40], 0), r"layout\.size \d+ is beyond buffer_size"),
        (("model.norm.weight", "float32", [3], 0), r"shape \(3,\)"),
        (("not.a.weight", "float32", [64], 0), "not a weight"),
    ],
)
def test_staging_layouts_that_do_not_fit_are_400_and_load_nothing(engine, model_dir, entry, match) -> None:
    before = checksum(engine)
    path, body = staging_file(engine.staging_dir, tiny_update(model_dir), f"miles-staging-layout-{entry[2][0]}")
    body["layout"] = _layout_of(*entry, size=body["buffer_size"])
    for swap in (False, True):
        refused(post(engine, "/update_weights_from_staging", body | {"swap": swap}), 400, match)
    assert checksum(engine) == before
    path.unlink()


def test_a_staging_size_beyond_the_file_is_refused_and_the_file_not_grown(engine, model_dir) -> None:
    path, body = staging_file(engine.staging_dir, tiny_update(model_dir), "miles-staging-short")
    size = path.stat().st_size
    grown = body | {"buffer_size": size * 1000, "swap": True}
    refused(post(engine, "/update_weights_from_staging", grown), 400, "smaller than buffer_size")
    assert path.stat().st_size == size
    path.unlink()


# -- /generate: admission before batching -------------------------------------------------------------------------


@pytest.mark.parametrize("bad_ids", [[4, VOCAB], [-1, 4], [4, 10**30], [[4, 5], [VOCAB + 7]], [[4], [-3]]])
def test_a_bad_token_id_gets_its_own_400_and_the_batch_is_served(engine, bad_ids) -> None:
    """Good requests waiting in the same batch window (held by a pause) are all served; the bad one is refused."""

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=engine.url, timeout=120) as client:
            assert (await client.post("/pause_generation", json={"mode": "in_place"}, headers=AUTH)).status_code == 200
            bad = None
            try:
                good = [
                    asyncio.create_task(
                        client.post(
                            "/generate",
                            json={
                                "input_ids": [3 + i, 4],
                                "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
                            },
                        )
                    )
                    for i in range(4)
                ]
                await wait_until(client, lambda state: state["in_flight"] == 4, "the good requests to be queued")
                bad = asyncio.create_task(client.post("/generate", json={"input_ids": bad_ids}))
                await asyncio.wait({bad}, timeout=60)
                assert bad.done(), "the bad request was queued with the good ones instead of refused"
                refused(bad.result(), 400, "token ids are integers from 0 to 63")
            finally:
                assert (await client.post("/continue_generation", headers=AUTH)).status_code == 200
                if bad is not None and not bad.done():  # (it failed) do not leave it behind
                    bad.cancel()
            for response in await asyncio.gather(*good):
                assert response.status_code == 200 and len(response.json()["output_ids"]) == 3, response.text

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (
            {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 10**9, "ignore_eos": True}},
            r"exceeds the context length \(4096\): ask for at most 4094",
        ),
        ({"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 1e9, "ignore_eos": True}}, "valid integer"),
        ({"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 4095}}, "at most 4094"),
        ({"input_ids": [4] * (CONTEXT + 1)}, "more than the context length"),
        ({"input_ids": [[4], [4] * (CONTEXT + 1)]}, "more than the context length"),
    ],
)
def test_generation_is_bounded_by_the_context_length(engine, body, match) -> None:
    refused(post(engine, "/generate", body), 400, match)


def test_an_unset_max_new_tokens_shrinks_to_what_fits(engine) -> None:
    out = post(engine, "/generate", {"input_ids": [4] * (CONTEXT - 3), "sampling_params": {"ignore_eos": True}})
    assert out.status_code == 200 and out.json()["meta_info"]["completion_tokens"] == 3, out.text


def test_a_client_that_goes_away_cancels_its_generation(engine) -> None:
    """Running: it leaves its batch long before its max_new_tokens (the engine is not held until an abort)."""
    before = engine_state(engine)["generated_tokens"]
    body = json.dumps({"input_ids": [4, 5], "sampling_params": {"max_new_tokens": CONTEXT - 2, "ignore_eos": True}})
    with socket.create_connection(("127.0.0.1", engine.port), timeout=30) as sock:
        sock.sendall(
            f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:{engine.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        wait_for(lambda: engine_state(engine)["in_flight"] == 1, "the request to run")
    assert_still_serving(engine)  # 2 tokens, batched after the abandoned request's batch ended
    assert engine_state(engine)["generated_tokens"] - before - 2 < CONTEXT - 2, "it ran to the end"


def test_a_queued_request_whose_client_went_away_is_never_run(engine) -> None:
    before = engine_state(engine)["generated_tokens"]
    assert post(engine, "/pause_generation", {"mode": "in_place"}).status_code == 200
    try:
        body = json.dumps({"input_ids": [4], "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}})
        with socket.create_connection(("127.0.0.1", engine.port), timeout=30) as sock:
            head = f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:{engine.port}\r\nContent-Length: {len(body)}\r\n\r\n"
            sock.sendall(f"{head}{body}".encode())
            wait_for(lambda: engine_state(engine)["in_flight"] == 1, "the request to be queued")
        wait_for(lambda: engine_state(engine)["in_flight"] == 0, "the abandoned request to be dropped", 30)
    finally:
        assert post(engine, "/continue_generation", {}).status_code == 200
    assert_still_serving(engine)  # 2 tokens
    assert engine_state(engine)["generated_tokens"] - before == 2, "the abandoned request was run"


# -- bodies -------------------------------------------------------------------------------------------------------


def send_chunked(engine: EngineProcess, path: str, total: int, *, auth: bool) -> int:
    """POST ``total`` bytes of body in chunks without a Content-Length; returns the answer's status."""
    chunk = b" " * (1 << 16)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{engine.port}\r\nTransfer-Encoding: chunked\r\n"
    head += "Content-Type: application/json\r\n"
    head += f"Authorization: Bearer {ADMIN}\r\n" if auth else ""
    with socket.create_connection(("127.0.0.1", engine.port), timeout=60) as sock:
        sock.sendall((head + "\r\n").encode())
        sent = 0
        try:
            while sent < total:
                part = chunk[: min(len(chunk), total - sent)]
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
                sent += len(part)
            sock.sendall(b"0\r\n\r\n")
        except OSError:  # the server answered and closed early: read what it said
            pass
        answer = b""
        while b"\r\n" not in answer:
            data = sock.recv(4096)
            if not data:
                break
            answer += data
    return int(answer.split(b" ")[1])


@pytest.mark.parametrize(
    ("path", "total", "status"),
    [
        ("/generate", (32 << 20) + 1, 413),  # a chunked body over /generate's limit is cut off, not read whole
        ("/generate", 2 << 20, 400),  # 2 MiB of spaces: within the limit, then not JSON
        ("/flush_cache", (1 << 20) + 1, 413),  # control routes: 1 MiB
        ("/update_weight_version", (1 << 20) + 1, 413),
    ],
)
def test_the_body_stream_is_limited_per_route(engine, path: str, total: int, status: int) -> None:
    assert send_chunked(engine, path, total, auth=True) == status
    assert_still_serving(engine)


def test_a_declared_length_over_the_limit_is_413_before_reading(engine) -> None:
    with socket.create_connection(("127.0.0.1", engine.port), timeout=30) as sock:
        head = b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Length: 1073741824\r\n\r\n" % engine.port
        sock.sendall(head + b"{")
        assert b" 413 " in sock.recv(4096)


# -- versions ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version", ["\u00e9t\u00e9", "v1\r\nX-Injected: 1", "v1\n", "", " v1", "v1 ", "v" * 129, "\u2603", "a\tb", 7.5, [1]]
)
def test_a_bad_weight_version_is_400_and_never_bricks_the_engine(engine, model_dir, version) -> None:
    current = httpx.get(f"{engine.url}/model_info", timeout=10).json()["weight_version"]
    refused(post(engine, "/update_weight_version", {"new_version": version}), 400, "new_version")
    before = checksum(engine)
    update = {
        "serialized_named_tensors": [base64.b64encode(save(tiny_update(model_dir))).decode()],
        "weight_version": version,
    }
    refused(post(engine, "/update_weights_from_tensor", update), 400, "weight_version")
    assert checksum(engine) == before, "a refused version loaded the weights"
    health = httpx.get(f"{engine.url}/health", timeout=10)
    assert health.status_code == 200 and health.headers["X-Weight-Version"] == current
    assert_still_serving(engine)


def test_a_good_weight_version_is_served_in_every_answer(engine) -> None:
    assert post(engine, "/update_weight_version", {"new_version": "step 12/b"}).status_code == 200
    assert httpx.get(f"{engine.url}/health", timeout=10).headers["X-Weight-Version"] == "step 12/b"
    assert post(engine, "/update_weight_version", {"new_version": "default"}).status_code == 200


# -- every field ----------------------------------------------------------------------------------------------------

GENERATE_400 = [
    ({"input_ids": [4], "rid": ["a", "b"]}, "rid must be a string"),
    ({"input_ids": [[4], [5]], "rid": ["a"]}, "rid must be a list of 2 strings"),
    ({"input_ids": [[4], [5]], "rid": "a"}, "rid must be a list of 2 strings"),
    ({"input_ids": [[4], [5]], "rid": ["a", 3]}, "rid must be a list of 2 strings"),
    ({"input_ids": [4], "rid": 12}, "rid must be a string"),
    ({"input_ids": [4], "rid": "r" * 300}, "at most 256"),
    ({"input_ids": 5}, "input_ids must be a non-empty list"),
    ({"input_ids": [4, True]}, "input_ids must be a non-empty list"),
    ({"input_ids": [4, 5.0]}, "input_ids must be a non-empty list"),
    ({"input_ids": [[4], []]}, "input_ids must be a non-empty list"),
    ({"input_ids": [4], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [4], "stream": "no"}, "stream"),
    ({"input_ids": [4], "sampling_params": "greedy"}, "sampling_params must be an object"),
    ({"input_ids": [4], "sampling_params": [{}, {}]}, "2 sampling_params for 1 prompts"),
    ({"input_ids": [4], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": [4], "sampling_params": {"temperature": 1e9}}, "temperature"),
    ({"input_ids": [4], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [4], "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"input_ids": [4], "sampling_params": {"top_k": -2}}, "top_k"),
    ({"input_ids": [4], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [4], "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
    ({"input_ids": [4], "sampling_params": {"sampling_seed": -1}}, "sampling_seed"),
    ({"input_ids": [4], "sampling_params": {"sampling_seed": 2**64}}, "sampling_seed"),
    ({"input_ids": [4], "sampling_params": {"stop_token_ids": [VOCAB]}}, "stop_token_ids holds 64"),
    ({"input_ids": [4], "sampling_params": {"stop_token_ids": "1"}}, "stop_token_ids"),
    ({"input_ids": [4], "sampling_params": {"ignore_eos": "true"}}, "ignore_eos"),
    ({"input_ids": [4], "sampling_params": {"n": 2}}, "n"),
]


@pytest.mark.parametrize(("body", "match"), GENERATE_400)
def test_every_generate_field_is_checked(engine, body, match) -> None:
    refused(post(engine, "/generate", body), 400, match)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
        (b'{"input_ids": ' + b"[" * 70 + b"4" + b"]" * 70 + b"}", "nested deeper"),
        (b'{"input_ids": [NaN]}', "NaN"),
        (b'{"input_ids": [' + b"9" * 5000 + b"]}", "digits"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[4, 5]", "must be a JSON object"),
    ],
)
def test_hostile_json_is_400(engine, content: bytes, match: str) -> None:
    for path in ("/generate", "/update_weights_from_tensor", "/pause_generation"):
        refused(post(engine, path, content=content), 400, match)


def test_a_number_that_overflows_to_infinity_is_400(engine) -> None:
    body = b'{"input_ids": [4], "sampling_params": {"temperature": 1e999}}'  # Python's json reads inf
    refused(post(engine, "/generate", content=body), 400, "1e999, too large for a float")  # miles_core.http


def test_a_tiny_temperature_is_greedy_with_finite_logprobs(engine) -> None:
    def sample(temperature: float) -> dict:
        body = {
            "input_ids": [4, 5, 6],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": temperature, "ignore_eos": True},
        }
        response = post(engine, "/generate", body)
        assert response.status_code == 200, response.text
        return response.json()

    greedy = sample(0)
    for temperature in (1e-45, 1e-40, 1e-30, 1e-10, 1e-7):  # the smallest overflow float32 (logits / t = inf)
        out = sample(temperature)
        logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert all(isinstance(lp, float) and lp == lp and lp <= 0 for lp in logprobs), logprobs  # never NaN
        assert out["output_ids"] == greedy["output_ids"]


CONTROL_400 = [
    ("/pause_generation", {"mode": "later"}, "mode must be one of"),
    ("/pause_generation", {"mode": 3}, "field 'mode' must be str"),
    ("/update_weight_version", {"new_version": "v", "abort_all_requests": "yes"}, "abort_all_requests"),
    ("/update_weight_version", {}, "missing field 'new_version'"),
    ("/update_weights_from_disk", {"model_path": 7}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent"}, "not a directory holding"),
    ("/update_weights_from_disk", {"model_path": "/", "abort_all_requests": 1}, "abort_all_requests"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": "x"}, "must be list"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": [1]}, "must be a string"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["a", "b"]}, "one rank"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["!!"]}, "not base64"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": [""], "load_format": "pickle"}, "load_format"),
    (
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1, "world_size": 2},
        "master_port",
    ),
    (
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 70000, "rank_offset": 1, "world_size": 2},
        "master_port",
    ),
    (
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 0, "world_size": 2},
        "rank_offset",
    ),
    (
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 1},
        "world_size",
    ),
    (
        "/init_weights_update_group",
        {"master_address": ["x"], "master_port": 29500, "rank_offset": 1, "world_size": 2},
        "master_address",
    ),
    (
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2, "group_name": 5},
        "group_name",
    ),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[-1]]}, "shapes"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": [], "shapes": [[1]]}, "same length"),
    ("/update_weights_from_distributed", {"names": [1], "dtypes": ["float32"], "shapes": [[1]]}, "strings"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": "1"}, "shapes"),
    (
        "/update_weights_from_distributed",
        {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]},
        "between begin_weight_update",
    ),  # as SGLang: outside a weight-update session, before the group is looked up
    ("/end_weight_update", {}, "no weight-update session is open"),
    ("/destroy_weights_update_group", {"group_name": "nope"}, "no weight update group"),
    ("/destroy_weights_update_group", {"group_name": ""}, "must not be empty"),
]


@pytest.mark.parametrize(("path", "body", "match"), CONTROL_400)
def test_every_control_field_is_checked(engine, path: str, body: dict, match: str) -> None:
    before = checksum(engine)
    refused(post(engine, path, body), 400, match)
    assert checksum(engine) == before
    assert not engine_state(engine)["paused"]


# -- fuzz -----------------------------------------------------------------------------------------------------------

ROUTES = {
    "/generate": {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2}, "rid": "r", "return_logprob": True},
    "/update_weights_from_tensor": {
        "serialized_named_tensors": ["e30="],
        "load_format": "safetensors",
        "weight_version": "fuzz",
    },
    "/update_weights_from_staging": {
        "staging_path": "/etc/passwd",
        "buffer_size": 256,
        "layout": StagingLayout.of([("model.norm.weight", torch.zeros(64))]).to_wire(),
        "swap": True,
        "weight_version": "fuzz",
    },
    "/update_weights_from_disk": {"model_path": "/nonexistent", "weight_version": "fuzz"},
    "/init_weights_update_group": {
        "master_address": "127.0.0.1",
        "master_port": 0,
        "rank_offset": 1,
        "world_size": 1,
        "group_name": "g",
        "backend": "mpi",
    },  # 3 bad: 2 mutated
    "/update_weights_from_distributed": {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"},
    "/destroy_weights_update_group": {"group_name": "never-made"},
    "/pause_generation": {"mode": "never"},
    "/update_weight_version": {"new_version": "\n"},
    "/flush_cache": {},
    "/continue_generation": {},
    "/weights_checksum": {},
    "/health": {},
    "/model_info": {},
    "/server_info": {},
    "/v1/completions": {
        "model": "m",
        "prompt": [4, 5],
        "max_tokens": 2,
        "logprobs": 1,
        "stop_token_ids": [3],
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    "/v1/chat/completions": {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 1,
    },
}
"""A body per route that is refused or harmless; the fuzz breaks it further (a mutation may repair one, e.g. a
valid version or pause: the test undoes it)."""


def random_value(rng: random.Random, depth: int = 0) -> object:
    kinds = ["int", "float", "str", "bool", "null", "list", "dict", "huge", "neg"] if depth < 3 else ["int", "str"]
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(-(10**6), 10**6)
    if kind == "huge":
        return rng.choice([2**63, 2**64 + 1, 10**40, -(10**30)])
    if kind == "neg":
        return rng.choice([-1, -0.5, -1e308])
    if kind == "float":
        return rng.choice([0.0, 1e-320, 1e308, 3.5, -2.25])
    if kind == "str":
        return rng.choice(["", "x", "\u00e9\u2603", "a\r\nb", "\x00", "9" * 300, "/etc/passwd", "../../x"])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {
        rng.choice(["path", "size", "tensors", "mode", "x", ""]): random_value(rng, depth + 1)
        for _ in range(rng.randint(0, 3))
    }


def malformed_bodies(rng: random.Random, template: dict) -> Iterator[bytes]:
    """Broken syntax, broken structure, and the route's own fields given random values (or dropped)."""
    text = json.dumps(template).encode()
    yield text[: rng.randint(1, max(1, len(text) - 1))]  # truncated
    yield bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    yield b"[" * rng.randint(65, 500)
    yield rng.choice([b"NaN", b"Infinity", b"-Infinity", b'{"a": NaN}', b"1e999999", b"[]", b'"s"', b"null"])
    for _ in range(6):
        body = dict(template)
        for key in rng.sample(sorted(body), k=min(len(body), rng.randint(1, 2))):
            if rng.random() < 0.2:
                del body[key]
            else:
                body[key] = random_value(rng)
        body[rng.choice(["sampling_params", "extra", "load_format"])] = random_value(rng)
        yield json.dumps(body).encode()


def test_fuzz_every_route_answers_4xx_and_the_engine_stays_healthy(engine) -> None:
    rng = random.Random(17)
    before = checksum(engine)
    version = httpx.get(f"{engine.url}/model_info", timeout=10).json()["weight_version"]
    statuses: dict[str, set[int]] = {}
    with httpx.Client(base_url=engine.url, headers=AUTH, timeout=60) as client:
        for _ in range(3):
            for path, template in ROUTES.items():
                for content in malformed_bodies(rng, template):
                    response = client.post(path, content=content)
                    assert response.status_code < 500, (path, content[:200], response.text[:300])
                    statuses.setdefault(path, set()).add(response.status_code)
                    if response.status_code == 200 and path == "/pause_generation":  # a body that paused it
                        client.post("/continue_generation")
                    if response.status_code == 200 and path == "/update_weight_version":
                        client.post(path, json={"new_version": version})
    for path, seen in statuses.items():
        assert any(400 <= s < 500 for s in seen), (path, seen)
    assert checksum(engine) == before
    assert httpx.get(f"{engine.url}/model_info", timeout=10).json()["weight_version"] == version
    assert not engine_state(engine)["paused"]
    assert "Traceback" not in engine.log(), engine.log()[-3000:]
    assert_still_serving(engine)


def test_a_fault_inside_a_batch_fails_only_its_request(model_dir: Path, tmp_path: Path) -> None:
    """Admission keeps bad requests out; should one get in anyway (here: put in the queue directly, past
    admission), the batch is retried request by request and only that request fails."""
    staging = tmp_path / "staging"
    staging.mkdir(mode=0o700)
    engine = LocalEngine(model_dir, staging_dir=staging)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)

    async def scenario() -> None:
        engine.start()
        await engine.pause("in_place")  # hold the queue so that all of them form one batch
        good = [asyncio.create_task(engine.generate([GenerationRequest([3 + i], params)])) for i in range(3)]
        await asyncio.sleep(0)
        bad = _Pending(GenerationRequest([VOCAB + 100], params), asyncio.get_running_loop().create_future())
        with engine._state:  # past admission, as a bug there would let it in
            engine._waiting.append(bad)
        engine.resume()
        results = await asyncio.gather(*good)
        assert all(len(result[0].output_ids) == 3 for result in results)
        with pytest.raises(IndexError):
            await bad.future

    asyncio.run(scenario())
