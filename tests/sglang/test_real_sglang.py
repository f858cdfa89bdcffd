"""A real SGLang server, launched through this plugin, on a small model: one generate, one weight update.

SGLang serves only on GPUs, and installing it is about 11 GB pinned to its own torch: this test runs where a CUDA
device and ``sglang`` both exist (``pytest -m gpu``) and is skipped with that reason everywhere else. Everything
else the plugin does is tested on CPU in ``test_sglang_plugin.py`` against servers speaking the same API."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest
import torch
from miles_plugins_sglang.launch import sglang_engine_spec

from miles_core.config.build import build_config
from miles_core.engines.client import EngineClient
from miles_core.plugin_manager import MilesPluginManager
from miles_core.testkit.tiny_models import save_tiny_llama
from miles_core.workers.local_provider import LocalWorkerProvider

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (SGLang serves only on GPUs)"),
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None, reason="needs sglang installed (pip install sglang; about 11 GB)"
    ),
]
SERVER_ARGS = {"dtype": "bfloat16", "skip_tokenizer_init": True, "disable_cuda_graph": True,
               "mem_fraction_static": 0.3, "attention_backend": "triton"}  # fmt: skip
PROMPT = [2, 17, 33, 9, 41]
MODEL = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "torch_dtype": "bfloat16"}  # fmt: skip


def reference_logprobs(model_dir: Path, output_ids: list[int]) -> torch.Tensor:
    """Logprobs of ``output_ids`` after ``PROMPT`` under the checkpoint, from transformers in float32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + output_ids])).logits[0]
    logprobs = torch.log_softmax(logits, dim=-1)
    return torch.tensor([logprobs[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(output_ids)])


def served_logprobs(response: dict) -> tuple[list[int], torch.Tensor]:
    pairs = response["meta_info"]["output_token_logprobs"]
    return response["output_ids"], torch.tensor([logprob for logprob, _token, _text in pairs])


def test_a_real_sglang_server_generates_and_takes_a_weight_update(tmp_path: Path) -> None:
    initial = save_tiny_llama(tmp_path / "initial", seed=0, **MODEL)
    updated = save_tiny_llama(tmp_path / "updated", seed=1, **MODEL)
    config = build_config(MilesPluginManager.load(), overrides={
        "engine.backend": "sglang", "weight_transfer.mode": "disk", "sglang.server_args": SERVER_ARGS,
        "engine.startup_timeout_s": 600})  # fmt: skip
    provider = LocalWorkerProvider(token="sglang-admin", run_dir=tmp_path / "run")
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}

    async def scenario() -> None:
        info = await provider.start(sglang_engine_spec(config, cell_id="engine-0", model_path=str(initial)))
        try:
            async with EngineClient(info.url, admin_key="sglang-admin", name="engine-0") as client:
                await client.flush_cache()
                before = served_logprobs(await client.generate(PROMPT, greedy))
                await client.update_weights_from_disk(str(updated), weight_version="1")
                assert await client.weight_version() == "1"
                after = served_logprobs(await client.generate(PROMPT, greedy))
        finally:
            await provider.shutdown()
        for model_dir, (output_ids, logprobs) in ((initial, before), (updated, after)):
            assert len(output_ids) == 6
            assert torch.allclose(logprobs, reference_logprobs(model_dir, output_ids), atol=0.1)
        stale = reference_logprobs(initial, after[0])
        assert (stale - after[1]).abs().max() > 0.1  # the update changed what is served

    asyncio.run(scenario())
