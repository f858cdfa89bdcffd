"""The config sections that the core contributes (through its built-in plugin)."""

from __future__ import annotations

from typing import Annotated

import pydantic

from miles_core.config.section import Section

FamilyName = Annotated[str, pydantic.StringConstraints(pattern=r"^[a-z0-9_]+$")]


class RunSection(Section):
    """Where a run writes and how it is seeded."""

    seed: int = pydantic.Field(default=1234, ge=0, description="Seed of every random generator of the run.")
    output_dir: str = pydantic.Field(default="runs/latest", min_length=1, description="Directory of the run.")
    num_steps: int = pydantic.Field(default=40, gt=0, description="RL steps to run.")


class ModelSection(Section):
    """The policy model and the implementation chosen for each model family."""

    path: str | None = pydantic.Field(
        default=None, description="HF checkpoint directory; None runs the embedded tiny default model."
    )
    implementations: dict[FamilyName, str] = pydantic.Field(
        default_factory=dict,
        description="Model family -> implementation name (see `miles plugins`); set with --model-impl FAMILY=NAME.",
    )


class RolloutSection(Section):
    """How prompts are sampled and answered."""

    batch_size: int = pydantic.Field(default=16, gt=0, description="Prompts per step.")
    group_size: int = pydantic.Field(default=8, ge=2, description="Samples per prompt (GRPO group).")
    max_new_tokens: int = pydantic.Field(default=8, gt=0, description="Maximum response length in tokens.")
    temperature: float = pydantic.Field(default=1.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = pydantic.Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = pydantic.Field(default=-1, ge=-1, description="Top-k sampling; -1 disables it.")


class WeightTransferSection(Section):
    """How new weights reach the engines."""

    mode: str | None = pydantic.Field(
        default=None,
        description="Weight-transfer protocol (see `miles plugins`); unset means the run's default.",
    )
    bucket_size_mb: int = pydantic.Field(default=512, gt=0, description="Bytes per transfer bucket, in MiB.")
    verify_checksum: bool = pydantic.Field(default=False, description="Check that engines hold the exact weights.")
