"""The Miles plugin module of miles-plugins-megatron, registered through the entry-point group ``miles.plugins``.

Provides the training backend ``megatron``, the ``megatron`` config section, the Megatron ``HfWeightIterator`` and
the ``megatron`` implementation of the Llama, Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3 model families. Every
``miles`` command imports this module, so it imports nothing heavy at the top (megatron-core takes ~10 s to import).
"""

from __future__ import annotations

from typing import Any

from miles_core.errors import ConfigError
from miles_core.hookspecs import hookimpl
from miles_core.registry import Implementation, model_implementation

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")


@hookimpl
def config_sections() -> dict[str, type]:
    from miles_plugins_megatron.config import MegatronSection  # deferred: pydantic

    return {"megatron": MegatronSection}


@hookimpl
def validate_config(config: Any) -> None:
    if config.train.backend != "megatron":
        return
    for family, impl in config.model.implementations.items():
        if family in FAMILIES and impl != "megatron":
            raise ConfigError(
                f"model.implementations.{family} = {impl!r}: the megatron trainer trains megatron-core GPTModel "
                f"ranks (--model-impl {family}=megatron); {impl!r} is for --trainer torch"
            )


@hookimpl
def provide_training_backends() -> list[Implementation]:
    return [
        Implementation(
            "megatron",
            "miles_plugins_megatron.trainer:MegatronTrainer",
            "megatron-core GPTModel, tensor, data and expert parallel ranks as workers",
        )
    ]


@hookimpl
def provide_model_implementations() -> list[Implementation]:
    return [
        model_implementation(
            family,
            "megatron",
            "miles_plugins_megatron.causal_lm:MegatronCausalLM",
            f"megatron-core GPTModel ({family} layout)",
        )
        for family in FAMILIES
    ]
