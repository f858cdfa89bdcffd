"""Assembling the config model from plugin sections and building a config from its sources.

Sources, lowest to highest priority: section defaults, ``--config FILE.yaml``, command-line flags. The result is a
frozen pydantic model validated at construction, then checked across sections by the ``validate_config`` hook.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import pydantic

from miles_core.config.section import Section
from miles_core.config.sections import (
    EngineSection,
    ModelSection,
    RolloutSection,
    RunSection,
    TrainSection,
    WeightTransferSection,
)
from miles_core.config.yaml_input import read_config_file
from miles_core.errors import ConfigError
from miles_core.registry import call_each_plugin

SectionT = TypeVar("SectionT", bound=Section)


class MilesConfig(pydantic.BaseModel):
    """The root of a run's config: the core's sections as typed fields, and the sections other plugins contribute
    (added by :func:`config_model`), read through :meth:`section`."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    run: RunSection = pydantic.Field(default_factory=RunSection)
    model: ModelSection = pydantic.Field(default_factory=ModelSection)
    rollout: RolloutSection = pydantic.Field(default_factory=RolloutSection)
    train: TrainSection = pydantic.Field(default_factory=TrainSection)
    engine: EngineSection = pydantic.Field(default_factory=EngineSection)
    weight_transfer: WeightTransferSection = pydantic.Field(default_factory=WeightTransferSection)

    def section(self, name: str, kind: type[SectionT]) -> SectionT:
        """The plugin section ``name``, checked to be a ``kind``: the one typed way a plugin reads its own section
        (``config.section("sglang", SglangSection)``). A section no loaded plugin contributes is a
        :class:`ConfigError` naming it."""
        value = getattr(self, name, None) if name in type(self).model_fields else None
        if value is None:
            contributed = ", ".join(type(self).model_fields)
            raise ConfigError(f"config has no section {name!r} (its sections: {contributed}): is its plugin loaded?")
        if not isinstance(value, kind):
            raise ConfigError(f"config section {name!r} is a {type(value).__name__}, not a {kind.__name__}")
        return value


def config_model(manager: Any) -> type[MilesConfig]:
    """The config model for the loaded plugins: one field per contributed section."""
    sections: dict[str, tuple[type, str]] = {}
    for plugin_name, contributed in call_each_plugin(manager.pm, "config_sections"):
        for section_name, model in (contributed or {}).items():
            if section_name in sections:
                raise ConfigError(
                    f"config section {section_name!r} is contributed twice, by plugin "
                    f"{sections[section_name][1]!r} and by plugin {plugin_name!r}"
                )
            if not (isinstance(model, type) and issubclass(model, Section)):
                raise ConfigError(
                    f"plugin {plugin_name!r} contributed section {section_name!r} as {model!r}; "
                    "expected a subclass of miles_core.config.Section"
                )
            sections[section_name] = (model, plugin_name)
    fields: dict[str, Any] = {
        name: (model, pydantic.Field(default_factory=model)) for name, (model, _) in sections.items()
    }
    return pydantic.create_model("MilesConfig", __base__=MilesConfig, **fields)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a mapping of sections; every problem is a :class:`ConfigError` naming the
    file (and the line and column of a parse error)."""
    data = read_config_file(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping of sections (like 'rollout: {{batch_size: 8}}'), "
            f"not a {type(data).__name__}"
        )
    return data


def set_path(data: dict[str, Any], path: str, value: Any) -> None:
    """Set a dotted ``path`` in nested dicts, creating intermediate dicts."""
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {path!r}: {part!r} holds {child!r}, not a mapping")
        node = child
    node[leaf] = value


def build_config(
    manager: Any, *, config_file: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> MilesConfig:
    """Build and validate the config from defaults, an optional YAML file and dotted-path ``overrides``."""
    model = config_model(manager)
    data = load_config_file(config_file) if config_file is not None else {}
    for path, value in (overrides or {}).items():
        set_path(data, path, value)
    try:
        config = model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(format_validation_error(exc, model)) from exc
    manager.hook.validate_config(config=config, registries=manager.registries)
    return config


MAX_LISTED_PROBLEMS = 20
"""Problems listed one per line; the rest are counted (a file with thousands of unknown keys stays readable)."""
MAX_SHOWN_CHARS = 200
"""A key or value longer than this is cut in error messages."""
MAX_LISTED_KEYS = 20
"""The most allowed keys an unknown-key error lists (then a count)."""


def format_validation_error(exc: pydantic.ValidationError, model: type[pydantic.BaseModel]) -> str:
    """One line per problem (the first :data:`MAX_LISTED_PROBLEMS`, then a count): the field, the value given, and
    what is allowed."""
    count = exc.error_count()
    lines = [f"invalid config ({count} problem{'s' if count > 1 else ''}):"]
    for error in exc.errors()[:MAX_LISTED_PROBLEMS]:
        path = _shorten(".".join(str(part) for part in error["loc"]))
        if error["type"] == "extra_forbidden":
            lines.append(f"  {path}: {_unknown_key_hint(model, error['loc'])}")
        else:
            shown = _shorten(repr(error["input"]))
            lines.append(f"  {path} = {shown}: {error['msg']}{_allowed_values_hint(model, error['loc'])}")
    if count > MAX_LISTED_PROBLEMS:
        lines.append(f"  ... and {count - MAX_LISTED_PROBLEMS} more problems (fix these first)")
    return "\n".join(lines)


def _shorten(text: str) -> str:
    return text if len(text) <= MAX_SHOWN_CHARS else f"{text[: MAX_SHOWN_CHARS - 3]}..."


def _model_at(model: type[pydantic.BaseModel], loc: tuple[Any, ...]) -> type[pydantic.BaseModel] | None:
    """The pydantic model that holds the field at ``loc`` (the parent of the last element)."""
    current: Any = model
    for part in loc[:-1]:
        field = current.model_fields.get(part) if isinstance(current, type) else None
        if field is None or not _is_model(field.annotation):
            return None
        current = field.annotation
    return current


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel)


def _unknown_key_hint(model: type[pydantic.BaseModel], loc: tuple[Any, ...]) -> str:
    parent = _model_at(model, loc)
    if parent is None:
        return "unknown key; not allowed here"
    removed = getattr(parent, "removed_fields", {}).get(loc[-1])
    if removed is not None:
        return f"removed: {removed}"
    allowed = list(parent.model_fields)
    where = "sections" if len(loc) == 1 else f"keys of {'.'.join(str(p) for p in loc[:-1])!r}"
    listed = ", ".join(allowed[:MAX_LISTED_KEYS]) or "(none)"
    if len(allowed) > MAX_LISTED_KEYS:  # a long section: the closest name below says more than all of them
        listed += f", and {len(allowed) - MAX_LISTED_KEYS} more (`miles config show` lists them)"
    hint = f"unknown key; allowed {where}: {listed}"
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    return hint + (f"; did you mean {close[0]!r}?" if close else "")


def _allowed_values_hint(model: type[pydantic.BaseModel], loc: tuple[Any, ...]) -> str:
    parent = _model_at(model, loc)
    field = parent.model_fields.get(loc[-1]) if parent is not None else None
    if field is None:
        return ""
    bounds = [
        f"{name} {getattr(meta, name)}"
        for meta in field.metadata
        for name in ("ge", "gt", "le", "lt")
        if getattr(meta, name, None) is not None
    ]
    allowed = f" (allowed: {', '.join(bounds)})" if bounds else ""
    return f"{allowed}; {field.description}" if field.description else allowed
