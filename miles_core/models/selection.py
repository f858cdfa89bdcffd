"""Choosing the model implementation of a run: the one given for the checkpoint's family, or the default.

A run trains one checkpoint, so an implementation given for another family (``--model-impl qwen3=NAME`` on a
``qwen3_moe`` checkpoint) would be ignored: that is an error naming the checkpoint's family and the families given.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from miles_core.errors import ConfigError
from miles_core.registry import ANY_FAMILY, Implementation, Registries, find_model_implementation

DSV4_FAMILY = "deepseek_v4"
"""The model family of DeepSeek-V4 checkpoints (their ``model_type``), which ``--dsv4-impl`` chooses for."""


def implementation_flag(family: str, impl: str) -> str:
    """The command-line flag that chooses ``impl`` for ``family``."""
    return f"--dsv4-impl {impl}" if family == DSV4_FAMILY else f"--model-impl {family}={impl}"


def check_model_implementation(registries: Registries, family: str, impl: str) -> Implementation:
    """The registry entry for ``FAMILY/IMPL`` (or ``*/IMPL``, which serves every family), or a
    :class:`ConfigError` that lists what is installed."""
    registry = registries.model_implementations
    entry = find_model_implementation(registry, family, impl)
    if entry is not None:
        return entry
    same_family = sorted({name.split("/", 1)[1] for name in registry if name.split("/", 1)[0] in (family, ANY_FAMILY)})
    raise ConfigError(
        f"model.implementations.{family} = {impl!r} ({implementation_flag(family, impl)}): no such implementation "
        f"of model family {family!r}; installed for {family}: {', '.join(same_family) or '(none)'}; "
        f"all installed implementations: {', '.join(registry) or '(none)'}"
    )


def check_families_given(implementations: Mapping[str, str], *, family: str, checkpoint: str) -> None:
    """Refuse implementations given for a family other than the checkpoint's (they would be ignored).
    ``checkpoint`` describes the model for the message: ``"the checkpoint '/path'"``."""
    others = sorted(set(implementations) - {family})
    if not others:
        return
    given = ", ".join(implementation_flag(other, implementations[other]) for other in others)
    raise ConfigError(
        f"model.implementations is set for {', '.join(map(repr, others))} ({given}), but {checkpoint} is of model "
        f"family {family!r}, so it would be ignored; choose the implementation of this model with "
        f"{implementation_flag(family, 'NAME')}, or drop the setting"
    )


def model_implementation_for(
    implementations: Mapping[str, str], registries: Registries, *, family: str, checkpoint: str | Path, default: str
) -> tuple[str, Implementation]:
    """The implementation name and registry entry that train the checkpoint directory ``checkpoint`` (of
    ``family``): the one given for its family, else ``default``."""
    check_families_given(implementations, family=family, checkpoint=f"the checkpoint {str(checkpoint)!r}")
    name = implementations.get(family, default)
    return name, check_model_implementation(registries, family, name)
