"""The settings of a weight-transfer protocol (``--weight-transfer-settings '{...}'``) as a declared pydantic model.

Each protocol names its model in the class attribute ``settings_model`` (a :class:`ProtocolSettings` subclass: every
field with a default, a description and its constraints). The kernel validates settings in one place,
:func:`validate_settings`: once for the run's protocol when the config is built (:func:`validate_run_settings`, so that
a bad setting stops ``miles`` with a configuration error before anything starts), and again in the protocol's
constructor, which keeps the validated model as ``self.settings``. A refusal is a :class:`ConfigError` naming the
protocol, each setting refused, the value given and what is allowed (for an unknown setting: the protocol's settings,
and the closest one).
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import pydantic
from pydantic.fields import FieldInfo

from miles_core.errors import ConfigError
from miles_core.targets import describe_callable

SETTINGS_FIELD = "weight_transfer.settings"
"""The config field of a run's protocol settings (the flag ``--weight-transfer-settings``), as errors name it."""
MAX_LISTED_PROBLEMS = 20
"""Refused settings named one by one; the rest are counted (a mapping of thousands of keys stays readable)."""
MAX_SHOWN_CHARS = 200
"""A value longer than this is cut in messages."""

# pydantic's errors whose meaning "expected <the field's allowed values>" already says; others add their message
_SAID_BY_ALLOWED = frozenset(
    {
        "bool_type",
        "dict_type",
        "finite_number",
        "float_type",
        "greater_than",
        "greater_than_equal",
        "int_type",
        "less_than",
        "less_than_equal",
        "literal_error",
        "missing",
        "string_too_long",
        "string_too_short",
        "string_type",
    }
)


class ProtocolSettings(pydantic.BaseModel):
    """The base of a weight-transfer protocol's settings model, which the protocol names in its class attribute
    ``settings_model``; this base itself is the model of a protocol that takes no settings.

    Frozen; an unknown setting is refused; types are strict (a boolean is not a number, the string ``"2"`` is not a
    whole number, ``"false"`` is not a boolean; a whole number is a number); ``inf`` and ``nan`` are refused. Give
    every field a default, a ``description`` (the errors quote it) and its constraints (``ge``, ``gt``, a ``Literal``
    of the allowed names)::

        class MySettings(ProtocolSettings):
            directory: str | None = pydantic.Field(default=None, description="Where versions are written.")
            keep_versions: int = pydantic.Field(default=2, ge=1, description="Versions kept on disk.")
    """

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    example: ClassVar[str] = ""
    """Settings as a user gives them (``'{"keep_versions": 3}'``), which the error for an unknown setting shows."""

    def settings_of_protocols(self) -> dict[str, Mapping[str, Any]]:
        """Settings held here for other protocols, by protocol name (``auto`` keeps those of each protocol it may
        choose): when the config is built, each is validated against that protocol's model too. None by default."""
        return {}


def validate_settings(
    protocol: type,
    settings: Any,
    *,
    field: str = SETTINGS_FIELD,
    flag: str = "--weight-transfer-settings",
    kind: str = "protocol",
) -> ProtocolSettings:
    """``settings`` validated against the ``settings_model`` of ``protocol`` (a ``WeightTransferProtocol`` subclass,
    or any class naming a ``settings_model``: an advantage estimator, a policy loss; ``kind`` names what it is).

    Anything it refuses is a :class:`ConfigError` that starts with ``field`` (the config field the settings come
    from) and its ``flag``, the settings given and the protocol, then names every refused setting (up to
    :data:`MAX_LISTED_PROBLEMS`) with the value given and what is allowed."""
    name = getattr(protocol, "name", protocol.__name__)
    model = getattr(protocol, "settings_model", None)
    header = f"{field} ({flag}) {_shown_json(settings)} do not fit the {kind} {name!r} ({describe_callable(protocol)})"
    if not (isinstance(model, type) and issubclass(model, ProtocolSettings)):
        raise ConfigError(f"{header}: its settings_model is {model!r}, not a subclass of miles_core.ProtocolSettings")
    if not isinstance(settings, Mapping):
        raise ConfigError(
            f"{header}: expected a mapping of setting names to values; {_its_settings(name, model, flag)}"
        )
    try:
        return model.model_validate(dict(settings))
    except pydantic.ValidationError as exc:
        raise ConfigError(f"{header}: {_problems(name, model, exc, flag)}") from None


def validate_run_settings(
    protocol: type, settings: Any, *, protocol_named: Callable[[str], type], field: str = SETTINGS_FIELD
) -> ProtocolSettings:
    """The run's settings (:func:`validate_settings`), with the settings they hold for other protocols
    (:meth:`ProtocolSettings.settings_of_protocols`) validated against the model of each, loaded by
    ``protocol_named`` (which raises a :class:`ConfigError` for a name no plugin provides)."""
    validated = validate_settings(protocol, settings, field=field)
    for name, nested in validated.settings_of_protocols().items():
        validate_settings(protocol_named(name), nested, field=f"{field}.{name}")
    return validated


def _problems(name: str, model: type[ProtocolSettings], exc: pydantic.ValidationError, flag: str) -> str:
    """The refused settings: the unknown ones in one phrase, then each other one (its first error); on one line
    after the header when there is one phrase, else one per line."""
    by_setting: dict[Any, Any] = {}
    for error in exc.errors():
        by_setting.setdefault(error["loc"][0] if error["loc"] else None, error)
    unknown = [key for key, error in by_setting.items() if error["type"] == "extra_forbidden"]
    phrases = [_unknown(name, model, unknown, flag)] if unknown else []
    phrases += [_problem(name, model, key, error) for key, error in by_setting.items() if key not in unknown]
    if len(phrases) == 1:
        return phrases[0]
    listed = phrases[:MAX_LISTED_PROBLEMS]
    if len(phrases) > MAX_LISTED_PROBLEMS:
        listed.append(f"... and {len(phrases) - MAX_LISTED_PROBLEMS} more refused settings (fix these first)")
    return "\n".join([f"{len(phrases)} problems:", *(f"  {phrase}" for phrase in listed)])


def _unknown(name: str, model: type[ProtocolSettings], keys: list[Any], flag: str) -> str:
    """``NAME has no setting 'x' (did you mean 'y'?); NAME's settings: ...``, the keys past the first few counted."""
    shown = []
    for key in keys[:MAX_LISTED_PROBLEMS]:
        close = difflib.get_close_matches(str(key), list(model.model_fields), n=1)
        shown.append(repr(_shorten(str(key))) + (f" (did you mean {close[0]!r}?)" if close else ""))
    if len(keys) > MAX_LISTED_PROBLEMS:
        shown.append(f"and {len(keys) - MAX_LISTED_PROBLEMS} more")
    setting = "setting" if len(keys) == 1 else "settings"
    return f"{name} has no {setting} {', '.join(shown)}; {_its_settings(name, model, flag)}"


def _problem(name: str, model: type[ProtocolSettings], key: Any, error: Any) -> str:
    if key is None:  # a check of the whole model
        return f"{name} settings: {error['msg']}"
    field = model.model_fields[key]
    if len(error["loc"]) > 1 and _is_model(field.annotation):  # inside a nested model: pydantic says where
        path = ".".join(str(part) for part in error["loc"])
        return f"{name} setting {path} = {_shown(error['input'])}: {error['msg']}"
    given = "is missing" if error["type"] == "missing" else f"= {_shown(error['input'])}"
    phrase = f"{name} setting {key} {given}: expected {allowed_values(field)}"
    if isinstance(error["input"], bool) and _expects_number(field.annotation):
        phrase += " (a boolean is not a number)"
    phrase += f"; {key}: {field.description}" if field.description else ""
    # a check's own reason goes last, where a message cut in the middle (the CLI's) keeps it
    return phrase + (f" ({error['msg']})" if error["type"] not in _SAID_BY_ALLOWED else "")


def _its_settings(name: str, model: type[ProtocolSettings], flag: str) -> str:
    fields = list(model.model_fields)
    if fields:
        example = f" (e.g. {flag} '{model.example}')" if model.example else ""
        return f"{name}'s settings: {', '.join(fields)}{example}"
    return f"{name} takes no settings" + (" (its class names no settings_model)" if model is ProtocolSettings else "")


def allowed_values(field: FieldInfo) -> str:
    """What a settings field allows, in words: ``a whole number of at least 1``, ``true, false or null``,
    ``'auto', 'gloo' or 'nccl'``."""
    bounds = _bounds(field)
    phrases: list[str] = []
    for member in _members(field.annotation):
        if member is type(None):
            phrases.append("null")
        elif member is bool:
            phrases += ["true", "false"]
        elif member is int:
            phrases.append(f"a whole number{bounds}")
        elif member is float:
            phrases.append(f"a number{bounds}")
        elif member is str:
            longest = _max_length(field)
            phrases.append(
                ("a non-empty string" if _min_length(field) else "a string")
                + (f" of at most {longest} characters" if longest is not None else "")
            )
        elif typing.get_origin(member) is typing.Literal:
            phrases += [repr(value) for value in typing.get_args(member)]
        elif member is dict or typing.get_origin(member) in (dict, Mapping):
            phrases.append("a mapping (a JSON object)")
        else:
            phrases.append(getattr(member, "__name__", str(member)))
    return phrases[0] if len(phrases) == 1 else f"{', '.join(phrases[:-1])} or {phrases[-1]}"


def _members(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [member for arg in typing.get_args(annotation) for member in _members(arg)]
    return [annotation]


def _bounds(field: FieldInfo) -> str:
    words = {"ge": "of at least", "gt": "above", "le": "of at most", "lt": "below"}
    found = [
        f"{word} {getattr(meta, bound)}"
        for meta in field.metadata
        for bound, word in words.items()
        if getattr(meta, bound, None) is not None
    ]
    return f" {' and '.join(found)}" if found else ""


def _min_length(field: FieldInfo) -> int:
    return max([getattr(meta, "min_length", 0) or 0 for meta in field.metadata], default=0)


def _max_length(field: FieldInfo) -> int | None:
    found = [meta.max_length for meta in field.metadata if getattr(meta, "max_length", None) is not None]
    return min(found) if found else None


def _expects_number(annotation: Any) -> bool:
    return any(member in (int, float) for member in _members(annotation))


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel)


def _shown(value: Any) -> str:
    return _shorten(repr(value))


def _shown_json(value: Any) -> str:
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):  # a value json cannot write (a circular one): its repr
        text = repr(value)
    return _shorten(text)


def _shorten(text: str) -> str:
    return text if len(text) <= MAX_SHOWN_CHARS else f"{text[: MAX_SHOWN_CHARS - 3]}..."
