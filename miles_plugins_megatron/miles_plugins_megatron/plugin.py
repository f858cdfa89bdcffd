"""The Miles plugin module of miles-plugins-megatron, registered through the entry-point group ``miles.plugins``.

Provides the training backend ``megatron``, the ``megatron`` config section, the Megatron ``HfWeightIterator`` and
the ``megatron`` implementation of the Llama, Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3 model families, and the ``miles``
implementation of DeepSeek-V4 (``--dsv4-impl miles``, on megatron-core's parallel layers). Every
``miles`` command imports this module, so it imports nothing heavy at the top (megatron-core takes ~10 s to import).
"""

from __future__ import annotations

from typing import Any

from miles_core import DSV4_FAMILY, ConfigError, Implementation, MilesError, hookimpl, model_implementation

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
DSV4_MILES = "miles"
"""The implementation of DeepSeek-V4 that the megatron trainer trains (tensor and expert parallel)."""


@hookimpl
def config_sections() -> dict[str, type]:
    from miles_plugins_megatron.config import MegatronSection  # deferred: pydantic

    return {"megatron": MegatronSection}


@hookimpl
def validate_config(config: Any, registries: Any) -> None:
    if config.train.backend != "megatron":
        return
    check_algorithm(config, registries)
    for family, impl in config.model.implementations.items():
        if family in FAMILIES and impl != "megatron":
            raise ConfigError(
                f"model.implementations.{family} = {impl!r}: the megatron trainer trains megatron-core GPTModel "
                f"ranks (--model-impl {family}=megatron); {impl!r} is for --trainer torch"
            )
    check_deepseek_v4_settings(config)


def check_algorithm(config: Any, registries: Any) -> None:
    """What the Megatron ranks train: an estimator with a critic (ppo) on GPTModel families, its ``critic_model``
    of the policy's architecture."""
    name = config.train.advantage_estimator
    entry = registries.advantage_estimators.get(name)
    if entry is not None and getattr(entry.load(), "needs_critic", False):
        check_critic(config, name)


def check_critic(config: Any, estimator: str) -> None:
    """The Megatron critic is the policy's GPTModel with a value head: refused for DeepSeek-V4 (not a GPTModel) and
    for a ``critic_model`` whose architecture differs from the policy's."""
    from miles_plugins_megatron.critic import architecture_difference

    if _is_deepseek_v4(config.model.path):
        raise ConfigError(
            f"train.advantage_estimator (--train-advantage-estimator) = {estimator!r} trains a critic, which the "
            f"megatron trainer builds as a GPTModel with a value head; {DSV4_FAMILY} is not one: use --trainer torch"
        )
    critic_model = (config.train.advantage_estimator_settings or {}).get("critic_model")
    if critic_model is None or config.model.path is None:
        return
    from types import SimpleNamespace

    from miles_core import read_model_config

    try:
        policy, critic = (SimpleNamespace(**read_model_config(path)) for path in (config.model.path, critic_model))
    except MilesError:
        return  # the checkpoint checks report a bad directory
    difference = architecture_difference(policy, critic)
    if difference is not None:
        raise ConfigError(
            f"train.advantage_estimator_settings.critic_model = {critic_model!r}: its {difference}; the megatron "
            "critic is built from the policy's architecture: give a checkpoint of it, or --trainer torch"
        )


def check_deepseek_v4_settings(config: Any) -> None:
    """Under the megatron trainer, DeepSeek-V4 trains with its ``miles`` implementation, routing as its routers
    choose: any other choice is refused with what would work."""
    impl = config.model.implementations.get(DSV4_FAMILY)
    if impl is not None and impl != DSV4_MILES:
        raise ConfigError(
            f"model.implementations.{DSV4_FAMILY} = {impl!r} (--dsv4-impl {impl}): the megatron trainer trains "
            f"DeepSeek-V4 with --dsv4-impl {DSV4_MILES} (tensor and expert parallel); {impl!r} is for --trainer torch"
        )
    if impl is None and not _is_deepseek_v4(config.model.path):
        return
    if config.train.routing_replay:
        raise ConfigError(
            f"{DSV4_FAMILY}/{DSV4_MILES} under the megatron trainer: train.routing_replay is on (its hash and top-k "
            "routers record no replay: turn it off)"
        )


def _is_deepseek_v4(model_path: str | None) -> bool:
    from miles_core import checkpoint_family

    if model_path is None:
        return False
    try:
        return checkpoint_family(model_path) == DSV4_FAMILY
    except MilesError:
        return False  # the model's own check reports a bad directory


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
    ] + [
        model_implementation(
            DSV4_FAMILY,
            DSV4_MILES,
            "miles_plugins_megatron.deepseek_v4:MilesDeepseekV4CausalLM",
            "megatron-core parallel layers, the transformers names (torch trainer; megatron trainer with TP and EP)",
        )
    ]
