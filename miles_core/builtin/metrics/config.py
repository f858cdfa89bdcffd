"""The ``metrics`` config section: which exporters a run feeds (``--metrics prometheus,tensorboard``), and where."""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from miles_core.builtin.dashboard.hosts import check_host, is_loopback_host
from miles_core.config.section import Section

Exporter = Literal["prometheus", "tensorboard"]


class MetricsSection(Section):
    """Metrics exporters: off unless named. Each gets every metric of the run through the typed run hooks."""

    exporters: list[Exporter] = pydantic.Field(
        default_factory=list,
        description="Exporters to feed: prometheus (a scrape endpoint) and/or tensorboard (event files), comma "
        "separated (--metrics prometheus,tensorboard); none by default.",
    )
    prometheus_host: str = pydantic.Field(
        default="127.0.0.1", description="Address the Prometheus endpoint binds to (loopback unless allowed)."
    )
    prometheus_port: int = pydantic.Field(
        default=0,
        ge=0,
        le=65535,
        description="Port of the Prometheus endpoint; 0 picks a free one (RUN_DIR/prometheus.url names it).",
    )
    prometheus_allow_remote: bool = pydantic.Field(
        default=False, description="Allow a non-loopback prometheus_host (0.0.0.0): the endpoint has no authentication."
    )
    tensorboard_dir: str | None = pydantic.Field(
        default=None, min_length=1, description="Directory of the TensorBoard event files; None: RUN_DIR/tensorboard."
    )

    @pydantic.field_validator("exporters", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        if value is None:  # `--metrics ""`: no exporter
            return []
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @pydantic.field_validator("exporters")
    @classmethod
    def _each_once(cls, value: list[str]) -> list[str]:
        twice = sorted({name for name in value if value.count(name) > 1})
        if twice:
            raise ValueError(f"exporter {twice[0]!r} is named twice; name each exporter once")
        return value

    @pydantic.field_validator("prometheus_host")
    @classmethod
    def _bindable_host(cls, host: str) -> str:
        return check_host(host, what="metrics.prometheus_host")  # a blank host would bind every interface

    @pydantic.model_validator(mode="after")
    def _loopback_unless_allowed(self) -> MetricsSection:
        if not self.prometheus_allow_remote and not is_loopback_host(self.prometheus_host):
            raise ValueError(
                f"metrics.prometheus_host = {self.prometheus_host!r} is reachable from other machines and the "
                "endpoint has no authentication: bind 127.0.0.1 (the default), or set "
                "metrics.prometheus_allow_remote = true (--metrics-prometheus-allow-remote true) on purpose"
            )
        return self
