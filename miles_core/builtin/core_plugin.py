"""The core's built-in plugin: its config sections and flags, cross-section validation, and its registries."""

from __future__ import annotations

from typing import Any

from miles_core.config.flags import ConfigFlag
from miles_core.errors import ConfigError, PluginLoadError, RegistryError
from miles_core.hookspecs import hookimpl
from miles_core.registry import Implementation, Registries, model_implementation
from miles_core.weight_transfer import WeightTransferProtocol

DSV4_FAMILY = "deepseek_v4"
TRANSFORMERS_FAMILIES = ("llama", "qwen2", "qwen3")


@hookimpl
def config_sections() -> dict[str, type]:
    # Deferred: pydantic costs ~0.3 s to import, and `miles plugins` never builds the config.
    from miles_core.config.sections import ModelSection, RolloutSection, RunSection, WeightTransferSection

    return {
        "run": RunSection,
        "model": ModelSection,
        "rollout": RolloutSection,
        "weight_transfer": WeightTransferSection,
    }


@hookimpl
def config_flags() -> list[ConfigFlag]:
    return [
        ConfigFlag(flag="--seed", path="run.seed", help="seed of the run", metavar="N"),
        ConfigFlag(flag="--model", path="model.path", help="HF checkpoint directory", metavar="PATH"),
        ConfigFlag(
            flag="--update-weight-transfer-mode",
            path="weight_transfer.mode",
            help="weight-transfer protocol (`miles plugins` lists them)",
            metavar="NAME",
        ),
        ConfigFlag(
            flag="--model-impl",
            path="model.implementations",
            help="implementation of a model family, repeatable (`miles plugins` lists them)",
            metavar="FAMILY=NAME",
            mapping=True,
        ),
        ConfigFlag(
            flag="--dsv4-impl",
            path=f"model.implementations.{DSV4_FAMILY}",
            help=f"implementation of the {DSV4_FAMILY} family (shorthand for --model-impl {DSV4_FAMILY}=NAME)",
            metavar="NAME",
        ),
    ]


@hookimpl
def validate_config(config: Any, registries: Registries) -> None:
    mode = config.weight_transfer.mode
    if mode is not None:
        check_weight_transfer_protocol(registries, mode)
    for family, impl in config.model.implementations.items():
        check_model_implementation(registries, family, impl)


def check_model_implementation(registries: Registries, family: str, impl: str) -> Implementation:
    """The registry entry for ``FAMILY/IMPL``, or a :class:`ConfigError` that lists what is installed."""
    registry = registries["model_implementations"]
    name = f"{family}/{impl}"
    if name in registry:
        return registry[name]
    same_family = [entry.split("/", 1)[1] for entry in registry if entry.startswith(f"{family}/")]
    flag = f"--dsv4-impl {impl}" if family == DSV4_FAMILY else f"--model-impl {family}={impl}"
    raise ConfigError(
        f"model.implementations.{family} = {impl!r} ({flag}): no such implementation of model family {family!r}; "
        f"installed for {family}: {', '.join(same_family) or '(none)'}; "
        f"all installed implementations: {', '.join(registry) or '(none)'}"
    )


def check_weight_transfer_protocol(registries: Registries, name: str) -> type:
    """Load the protocol class called ``name``; a :class:`ConfigError` names the flag and lists what exists."""
    field = f"weight_transfer.mode (--update-weight-transfer-mode) = {name!r}"
    try:
        protocol = registries["weight_transfer_protocols"].get_or_raise(name).load()
    except (RegistryError, PluginLoadError) as exc:
        raise ConfigError(f"{field}: {exc}") from exc
    if not (isinstance(protocol, type) and issubclass(protocol, WeightTransferProtocol)):
        raise ConfigError(f"{field}: {protocol!r} is not a subclass of WeightTransferProtocol")
    return protocol


@hookimpl
def provide_model_implementations() -> list[Implementation]:
    return [
        model_implementation(
            family,
            "transformers",
            "miles_core.models.transformers_impl:TransformersCausalLM",
            f"Hugging Face transformers' {family} model",
        )
        for family in TRANSFORMERS_FAMILIES
    ]


@hookimpl
def provide_worker_providers() -> list[Implementation]:
    return [
        Implementation("local", "miles_core.workers.local_provider:LocalWorkerProvider", "child processes"),
        Implementation("ray", "miles_core.workers.ray_provider:RayWorkerProvider", "Ray placement groups"),
    ]
