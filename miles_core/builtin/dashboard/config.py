"""The ``dashboard`` config section (``--dashboard``, ``--dashboard-host``, ``--dashboard-port``, ...)."""

from __future__ import annotations

import pydantic

from miles_core.builtin.dashboard.hosts import check_host
from miles_core.config.section import Section


class DashboardSection(Section):
    """The run's dashboard: what it records (always, by default) and whether the run serves it live."""

    record: bool = pydantic.Field(
        default=True, description="Record topology, phases, metrics and samples in RUN_DIR/dashboard.sqlite."
    )
    serve: bool = pydantic.Field(default=False, description="Serve the live dashboard during the run (--dashboard).")
    host: str = pydantic.Field(default="127.0.0.1", description="Address the dashboard binds to.")
    port: int = pydantic.Field(default=0, ge=0, le=65535, description="Port of the dashboard; 0 picks a free one.")
    warn_interval_s: float = pydantic.Field(
        default=60.0, gt=0, description="A failing dashboard warns at most once per this many seconds per kind."
    )

    @pydantic.field_validator("host")
    @classmethod
    def _bindable_host(cls, host: str) -> str:
        return check_host(host)  # a blank host would bind every interface
