"""Where a weight transfer's sending side runs: in the processes that hold the trainer's weights.

A trainer offers its weights as :class:`WeightHolders`: one or more processes (the Megatron trainer's ranks; for
the torch trainer, the driver itself) of which each holds a disjoint share of the HF-named tensors, their union the
whole model. A protocol that sends from the holders (:class:`~miles_core.weight_transfer.protocol.SendsFromHolders`)
names a *holder task*, a function ``"module:function"`` that each holder runs on its own share::

    def task(share: Iterable[tuple[str, torch.Tensor]], *, holder: int, holders: int, **kwargs) -> dict

and the driver only coordinates: it passes the tasks their arguments, combines what they return (small: names,
sizes, digests) and tells the engines what to load. No weight passes through the driver, so its memory does not grow
with the model. A task must consume its whole share (holders that gather shards meet in collectives while it
iterates) and returns JSON-able values (Megatron ranks return them over the worker RPC).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles_core.errors import MilesError

if TYPE_CHECKING:
    import torch

NamedTensorShare = Iterable[tuple[str, "torch.Tensor"]]
"""One holder's share of the HF-named tensors."""


@runtime_checkable
class WeightHolders(Protocol):
    """The processes holding a trainer's weights, each a disjoint share of its HF tensors."""

    def describe(self) -> list[str]:
        """One line per holder (its worker name, or ``driver``)."""
        ...

    def run_task(self, task: str, **kwargs: Any) -> list[dict[str, Any]]:
        """Run the holder task ``task`` on every holder with its share and ``kwargs``; their results, by holder."""
        ...


def resolve_task(task: str) -> Callable[..., dict[str, Any]]:
    """The function a ``"module:function"`` holder task names (a :class:`MilesError` for a bad name)."""
    module_name, _, function_name = task.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise MilesError(f"holder task {task!r} cannot be loaded: {exc}") from None
    if not callable(function):
        raise MilesError(f"holder task {task!r} is not a function")
    return function


def run_holder_task(task: str, share: NamedTensorShare, *, holder: int, holders: int, **kwargs: Any) -> dict:
    """Run ``task`` on this process's ``share`` (what each holder does when the driver asks)."""
    result = resolve_task(task)(share, holder=holder, holders=holders, **kwargs)
    if not isinstance(result, dict):
        raise MilesError(f"holder task {task!r} returned {type(result).__name__}, expected a dict")
    return result


class HolderTaskError(MilesError):
    """A holder task that failed in one or more holders (the protocol's failure: the holders live on)."""


def run_holder_task_safely(
    task: str, share: NamedTensorShare, *, holder: int, holders: int, **kwargs: Any
) -> dict[str, Any]:
    """:func:`run_holder_task` for holders that must go on together (ranks that meet in collectives while they
    iterate): a failure comes back as ``{"holder_error": message}`` instead of raising, after the rest of the
    share was iterated if the task had started on it (so that the other holders' collectives complete).
    :func:`raise_holder_errors` turns it into the driver's error."""
    started = False

    def watched() -> NamedTensorShare:
        nonlocal started
        started = True
        yield from share

    iterator = watched()
    try:
        return run_holder_task(task, iterator, holder=holder, holders=holders, **kwargs)
    except Exception as exc:  # reported to the driver, which raises it
        if started:
            for _ in iterator:
                pass
        return {"holder_error": f"{type(exc).__name__}: {exc}"}


def raise_holder_errors(task: str, results: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """``results`` when no holder failed, else a :class:`HolderTaskError` naming each holder that did."""
    failed = [f"{names[index]}: {r['holder_error']}" for index, r in enumerate(results) if "holder_error" in r]
    if failed:
        raise HolderTaskError(f"holder task {task} failed in {len(failed)} holder(s): {'; '.join(failed)}")
    return results


def round_robin_share(tensors: NamedTensorShare, *, holder: int, holders: int) -> NamedTensorShare:
    """Holder ``holder``'s share of tensors that every holder sees in the same order: every ``holders``-th one.
    The whole iterable is consumed (each holder keeps iterating through the others' tensors)."""
    for index, item in enumerate(tensors):
        if index % holders == holder:
            yield item


def merged_digests(results: list[dict[str, Any]]) -> dict[str, str | None]:
    """The ``digests`` (name -> digest, ``None`` where none was asked) of every holder's result, in one mapping; a name
    two holders reported is a :class:`MilesError` (their shares must be disjoint)."""
    merged: dict[str, str | None] = {}
    for holder, result in enumerate(results):
        for name, digest in result["digests"].items():
            if name in merged:
                raise MilesError(f"weight holder {holder} sent {name!r}, which another holder sent too")
            merged[name] = digest
    return merged


class InProcessHolders:
    """The degenerate case: one holder, this process (the torch trainer, whose model lives in the driver)."""

    def __init__(self, named_tensors: Callable[[], NamedTensorShare]) -> None:
        self.named_tensors = named_tensors

    def describe(self) -> list[str]:
        return ["driver (in process)"]

    def run_task(self, task: str, **kwargs: Any) -> list[dict[str, Any]]:
        return [run_holder_task(task, self.named_tensors(), holder=0, holders=1, **kwargs)]
