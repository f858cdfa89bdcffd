"""The base class of every config section."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import pydantic


class Section(pydantic.BaseModel):
    """A config section: frozen, unknown keys rejected, validated at construction, every field defaulted, and
    ``inf`` / ``nan`` refused for every float (no setting of a run is infinite)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False)

    removed_fields: ClassVar[Mapping[str, str]] = {}
    """Fields the section no longer has, each with what to do instead: the YAML key and its ``--SECTION-FIELD``
    flag are refused with that message rather than as unknown."""
