"""``TrainingBackend``: what a training backend provides, as one type.

An entry of the ``training_backends`` registry (``provide_training_backends``; chosen with ``--trainer NAME``) names
a class satisfying :class:`TrainingBackend`; the loop builds the run's trainer with its ``for_run`` and uses nothing
but the members below.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from miles_core.config.build import MilesConfig
    from miles_core.training.batch import TrainBatch
    from miles_core.training.weight_iterator import HfWeightIterator
    from miles_core.weight_transfer.holders import WeightHolders

MEMBERS = (
    "for_run",
    "train_step",
    "weight_iterator",
    "save_checkpoint",
    "load_checkpoint",
    "close",
    "implementation",
    "rank_names",
)
"""Every member the loop uses, for the error that names the missing ones."""


@runtime_checkable
class TrainingBackend(Protocol):
    """The trainer of a run: trains on rollout batches and hands its weights out as HF-named buckets."""

    implementation: str
    """The model implementation it trains, ``FAMILY/IMPL`` (``llama/transformers``), shown by the run and the
    dashboard."""

    @classmethod
    def for_run(
        cls,
        config: MilesConfig,
        *,
        model_path: Path,
        initial_model_path: Path,
        run_dir: Path,
        token: str,
        registries: Any,
    ) -> TrainingBackend:
        """The trainer of a ``miles train`` run from ``model_path`` (a resumed run's checkpoint); ``initial_model_path``
        is the KL reference; ``token`` authenticates workers it starts in ``run_dir``."""
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step over the batch (called in a worker thread); its metrics."""
        ...

    def weight_iterator(self, bucket_bytes: int) -> HfWeightIterator:
        """The current weights as buckets of HF-named tensors of at most ``bucket_bytes``."""
        ...

    def save_checkpoint(self, directory: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
        """An HF checkpoint directory (weights, config, the model's tokenizer files) plus the training state."""
        ...

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote; returns the saved state."""
        ...

    def rank_names(self) -> list[str]:
        """The names of its ranks, in rank order (``["driver"]`` for a trainer in the driver process)."""
        ...

    def close(self) -> None:
        """Release everything it started (rank workers, files)."""
        ...


def missing_members(trainer: Any) -> list[str]:
    """The members of :class:`TrainingBackend` that ``trainer`` lacks."""
    return [name for name in MEMBERS if not hasattr(trainer, name)]


def weight_holders(trainer: Any) -> WeightHolders | None:
    """The trainer's :class:`~miles_core.weight_transfer.holders.WeightHolders` (its optional ``weight_holders()``
    member: the processes that hold its weights and can send them), or ``None`` for a trainer without it, whose
    weights the driver reads through :meth:`TrainingBackend.weight_iterator`."""
    offer = getattr(trainer, "weight_holders", None)
    return offer() if callable(offer) else None
