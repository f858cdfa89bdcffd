"""SGLang's own benchmark client against a real local-engine server and a real SGLang server on the same checkpoint:
every request succeeds, on the native route (``--backend sglang``: ``/generate`` with ``stream: true``) and the
OpenAI ones (``sglang-oai``: ``/v1/completions``, ``sglang-oai-chat``: ``/v1/chat/completions``, both streamed). It
needs an SGLang environment (``make sglang``, or ``$MILES_SGLANG_PYTHON``); the real server also a CPU it serves on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_core.testkit.sglang_bench import (
    SGLANG_PYTHON_ENV,
    bench_client_unavailable_reason,
    run_bench_serving,
    sglang_python,
)
from miles_core.testkit.tiny_models import save_tiny_llama
from miles_core.testkit.tokenizers import ROLE_TAG_CHAT_TEMPLATE, save_char_tokenizer
from tests.engines.test_local_engine_hostile import EngineProcess
from tests.sglang.real_sglang import real_sglang_server, unavailable_reason

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def python() -> Path:
    path, named = sglang_python()
    if not path.exists():
        if named:  # asked for by name: a wrong path is a mistake to report, not a reason to skip
            pytest.fail(f"${SGLANG_PYTHON_ENV} names {path}, which does not exist")
        pytest.skip(
            f"no SGLang environment at {path}: run `make sglang`, or set ${SGLANG_PYTHON_ENV} to the python "
            "of an environment where sglang is installed"
        )
    reason = bench_client_unavailable_reason(path)
    if reason is not None:  # the client cannot run here, against any server
        pytest.skip(reason)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a HF tokenizer directory (bench_serving loads the tokenizer to make its prompts)."""
    path = save_tiny_llama(tmp_path_factory.mktemp("bench") / "model", max_position_embeddings=1024)
    save_char_tokenizer(path, "abcdefghijklmnopqrstuvwxyz0123456789 <>", chat_template=ROLE_TAG_CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def local_engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    process = EngineProcess(model_dir, tmp_path_factory.mktemp("bench-engine"), admin_key="bench-admin")
    yield process.url
    process.stop()


@pytest.fixture(scope="module")
def real_sglang(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A stock SGLang server as the plugin launches it, with SGLang's tokenizer on (the text backends need it)."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    loop = asyncio.new_event_loop()
    tokenizer_on = {"sglang.server_args": {"skip_tokenizer_init": False}}
    server = real_sglang_server(tmp_path_factory.mktemp("bench-sglang"), model_dir, token="bench-admin", **tokenizer_on)
    info = loop.run_until_complete(server.__aenter__())
    try:
        yield info.url
    finally:
        loop.run_until_complete(server.__aexit__(None, None, None))
        loop.close()


@pytest.mark.parametrize("server", ["local_engine", "real_sglang"])
@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat"])
def test_bench_serving_completes_every_request(
    python: Path, model_dir: Path, tmp_path: Path, backend: str, server: str, request: pytest.FixtureRequest
) -> None:
    record = run_bench_serving(
        python,
        base_url=request.getfixturevalue(server),
        backend=backend,
        tokenizer=model_dir,
        num_prompts=12,
        input_len=24,
        output_len=8,
        workdir=tmp_path,
    )
    assert record["completed"] == 12
    assert record["total_output_tokens"] == 12 * 8  # ignore_eos: every request generates what it asked for
    assert record["mean_itl_ms"] > 0  # text arrived in several chunks: streamed, not sent at the end
