"""The base class of every config section."""

from __future__ import annotations

import pydantic


class Section(pydantic.BaseModel):
    """A config section: frozen, unknown keys rejected, validated at construction, every field defaulted."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", validate_default=True)
