"""``MegatronCausalLM``: the ``megatron`` implementation of the Llama, Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3
families in one process.

A megatron-core ``GPTModel`` behind the core's :class:`~miles_core.models.causal_lm.CausalLM` interface: it loads an
HF checkpoint directory and exports the same HF names as ``FAMILY/transformers``. It needs megatron-core's parallel
state; when torch.distributed is not initialised it creates a one-rank gloo world for it.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from miles_core import LOOPBACK, CausalLM, MilesError, reserve_rendezvous, tcp_init_method_address, tcp_store
from miles_plugins_megatron.checkpoint import check_checkpoint, load_hf_config, read_hf_state
from miles_plugins_megatron.conversion import hf_to_megatron
from miles_plugins_megatron.cpu_compat import causal_mask, seed_model_parallel_rng
from miles_plugins_megatron.weight_iterator import MegatronHfWeightIterator


class MegatronCausalLM(CausalLM):
    def __init__(self, model: torch.nn.Module, hf_config: object) -> None:
        super().__init__()
        # megatron-core computes RoPE on the current CUDA device whenever one exists, so the model lives there; the
        # interface stays on the caller's device (inputs, logits and exported weights), the CPU for the torch trainer.
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.model = model.to(self.device) if self.device else model
        self.hf_config = hf_config

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32) -> MegatronCausalLM:
        from miles_plugins_megatron.model import build_gpt_model  # megatron-core's GPTModel

        hf_config = load_hf_config(path)
        check_checkpoint(path, hf_config)
        ensure_single_rank_parallel_state()
        model = build_gpt_model(hf_config, dtype=dtype)
        missing, unexpected = model.load_state_dict(hf_to_megatron(read_hf_state(path), hf_config), strict=False)
        missing = [name for name in missing if not name.endswith("_extra_state")]
        if missing or unexpected:
            raise MilesError(f"{path}: Megatron weights missing {missing[:5]}, unexpected {unexpected[:5]}")
        return cls(model.eval(), hf_config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        device = self.device or input_ids.device
        length = input_ids.shape[1]
        positions = torch.arange(length, device=device).expand(input_ids.shape[0], -1)
        logits = self.model(
            input_ids=input_ids.to(device), position_ids=positions, attention_mask=causal_mask(length).to(device)
        )
        return logits.to(input_ids.device)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF names, as transformers' ``state_dict()`` has them (a tied ``lm_head.weight`` is the embedding)."""
        named = MegatronHfWeightIterator(self.model, self.hf_config, bucket_bytes=1 << 30).named_tensors()
        state = {name: tensor.cpu() for name, tensor in named}  # no copy when the model is on the CPU
        if self.hf_config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state


def ensure_single_rank_parallel_state() -> None:
    """A one-rank gloo world and megatron-core's parallel state, unless they exist already."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        # a world of one process: its store listens on loopback, where nothing outside this process joins
        init_method, listener = reserve_rendezvous(LOOPBACK)
        host, port = tcp_init_method_address(init_method)
        timeout = datetime.timedelta(minutes=10)
        store = tcp_store(host, port, world_size=1, is_master=True, timeout=timeout, listener=listener)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    seed_model_parallel_rng(0)
