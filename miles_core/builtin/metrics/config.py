"""The ``metrics`` config section: which exporters a run feeds (``--metrics prometheus,tensorboard,wandb,mlflow``),
and where."""

from __future__ import annotations

import re
from typing import Any, Literal
from urllib.parse import urlsplit

import pydantic

from miles_core.builtin.dashboard.hosts import check_host, is_loopback_host
from miles_core.config.section import Section

Exporter = Literal["prometheus", "tensorboard", "wandb", "mlflow"]

MAX_LABELS = 64
MAX_WANDB_TAG = 64
"""W&B refuses a tag longer than 64 characters; a label reaches W&B as the tag ``KEY=VALUE`` (``KEY`` if empty)."""
MLFLOW_SCHEMES = ("sqlite", "file", "http", "https")
NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MetricsSection(Section):
    """Metrics exporters: off unless named. Each gets every metric of the run through the typed run hooks."""

    exporters: list[Exporter] = pydantic.Field(
        default_factory=list,
        description="Exporters to feed: prometheus (a scrape endpoint), tensorboard (event files), wandb and "
        "mlflow (experiment trackers), comma separated (--metrics prometheus,tensorboard); none by default.",
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
    run_name: str | None = pydantic.Field(
        default=None,
        min_length=1,
        max_length=128,
        description="The run's name in W&B and MLflow; None: the name of the run directory (run.output_dir).",
    )
    labels: dict[str, str] = pydantic.Field(
        default_factory=dict,
        description="Labels of the run, e.g. {team: rl, baseline: ''}: MLflow tags, and W&B tags KEY=VALUE (KEY "
        "when the value is empty); at most 64, each tag at most 64 characters.",
    )
    wandb_project: str = pydantic.Field(
        default="miles", min_length=1, max_length=128, description="The W&B project the run is logged to."
    )
    wandb_entity: str | None = pydantic.Field(
        default=None, min_length=1, max_length=128, description="The W&B entity (user or team); None: W&B's default."
    )
    wandb_mode: Literal["online", "offline"] | None = pydantic.Field(
        default=None,
        description="online (synced as it runs) or offline (files only, `wandb sync` later; no network needed); "
        "None: the WANDB_MODE environment variable, else online.",
    )
    wandb_dir: str | None = pydantic.Field(
        default=None, min_length=1, description="Directory W&B writes its wandb/ folder in; None: RUN_DIR."
    )
    mlflow_tracking_uri: str | None = pydantic.Field(
        default=None,
        min_length=1,
        max_length=2048,
        description="The MLflow tracking store: a server (http://HOST:PORT) or a local database (sqlite:///PATH); "
        "None: sqlite:///RUN_DIR/mlflow.db.",
    )
    mlflow_experiment: str = pydantic.Field(
        default="miles", min_length=1, max_length=256, description="The MLflow experiment (created if missing)."
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

    @pydantic.field_validator("labels")
    @classmethod
    def _taggable(cls, labels: dict[str, str]) -> dict[str, str]:
        if len(labels) > MAX_LABELS:
            raise ValueError(f"{len(labels)} labels; at most {MAX_LABELS}")
        for key, value in labels.items():
            if not NAME.fullmatch(key):
                raise ValueError(f"label {key[:80]!r}: a key is letters, digits, '_', '.' and '-'")
            if len(tag := wandb_tag(key, value)) > MAX_WANDB_TAG:
                raise ValueError(f"label {tag[:80]!r}: KEY=VALUE is at most {MAX_WANDB_TAG} characters (W&B's limit)")
        return labels

    @pydantic.field_validator("wandb_project", "wandb_entity")
    @classmethod
    def _wandb_name(cls, value: str | None) -> str | None:
        if value is not None and not NAME.fullmatch(value):
            raise ValueError("a W&B project or entity is letters, digits, '_', '.' and '-'")
        return value

    @pydantic.field_validator("mlflow_tracking_uri")
    @classmethod
    def _known_scheme(cls, uri: str | None) -> str | None:
        if uri is not None and urlsplit(uri).scheme not in MLFLOW_SCHEMES:
            raise ValueError(f"a tracking URI starts with one of {', '.join(s + ':' for s in MLFLOW_SCHEMES)}")
        if uri is not None and urlsplit(uri).scheme in ("http", "https") and not urlsplit(uri).hostname:
            raise ValueError("an http(s) tracking URI names a host: http://HOST:PORT")
        return uri

    @pydantic.model_validator(mode="after")
    def _loopback_unless_allowed(self) -> MetricsSection:
        if not self.prometheus_allow_remote and not is_loopback_host(self.prometheus_host):
            raise ValueError(
                f"metrics.prometheus_host = {self.prometheus_host!r} is reachable from other machines and the "
                "endpoint has no authentication: bind 127.0.0.1 (the default), or set "
                "metrics.prometheus_allow_remote = true (--metrics-prometheus-allow-remote true) on purpose"
            )
        return self


def wandb_tag(key: str, value: str) -> str:
    """The W&B tag of the label ``key: value``."""
    return f"{key}={value}" if value else key
