"""The base class of every config section."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

import pydantic

_NUMBERS = (int, float)


class Section(pydantic.BaseModel):
    """A config section: frozen, unknown keys rejected, validated at construction, every field defaulted,
    ``inf`` / ``nan`` refused for every float (no setting of a run is infinite), and a boolean refused for a number
    (YAML's ``true`` is not the seed 1)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False)

    removed_fields: ClassVar[Mapping[str, str]] = {}
    """Fields the section no longer has, each with what to do instead: the YAML key and its ``--SECTION-FIELD``
    flag are refused with that message rather than as unknown."""

    def resolved_notes(self) -> dict[str, str]:
        """What settings of the section resolve to on this machine (an ``auto`` found somewhere), by field name:
        ``miles config show`` prints them beside the config. None by default."""
        return {}

    @pydantic.field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        # pydantic's lax mode reads True as 1 for an int (and 1.0 for a float); a setting given as a YAML boolean
        # where a number belongs is a mistake, not a number. (Flags arrive as text, which pydantic parses.)
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            if _is_number(annotation):
                raise ValueError(f"a boolean ({str(value).lower()}) is not a number; give a number")
        return value


def _is_number(annotation: Any) -> bool:
    """Whether ``annotation`` is ``int`` or ``float``, optionally with ``None`` (and no ``bool`` among them)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return bool(members) and all(_is_number(arg) for arg in members)
    return annotation in _NUMBERS
