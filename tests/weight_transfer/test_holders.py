"""The holders' seam: a holder task that fails comes back to the driver as the protocol's error naming the holder,
and holders that meet in collectives while they iterate still see the whole share go by."""

from __future__ import annotations

import pytest
import torch

from miles_core.weight_transfer.holders import (
    HolderTaskError,
    raise_holder_errors,
    round_robin_share,
    run_holder_task_safely,
)

SEEN: list[str] = []
TENSORS = [(f"layer{index}.weight", torch.full((2,), float(index))) for index in range(6)]


def fails_after_two(share, *, holder: int, holders: int) -> dict:
    for count, (name, _) in enumerate(share):
        if count == 1:
            raise RuntimeError(f"engine gone while sending {name}")
    return {}


def fails_before_reading(share, *, holder: int, holders: int) -> dict:
    raise RuntimeError("no group with the engines")


def takes_all(share, *, holder: int, holders: int) -> dict:
    return {"names": [name for name, _ in share]}


def watched(tensors):
    """The tensors as a rank's iterator hands them out, each recorded as it goes by (a gather every rank joins)."""
    for name, tensor in tensors:
        SEEN.append(name)
        yield name, tensor


@pytest.fixture(autouse=True)
def _clear() -> None:
    SEEN.clear()


def test_a_task_that_fails_mid_share_reports_it_after_the_whole_share_went_by() -> None:
    share = round_robin_share(watched(TENSORS), holder=0, holders=2)
    result = run_holder_task_safely(f"{__name__}:fails_after_two", share, holder=0, holders=2)
    assert result == {"holder_error": "RuntimeError: engine gone while sending layer2.weight"}
    assert [name for name, _ in TENSORS] == SEEN  # the peers' gathers of the rest were joined


def test_a_task_that_reads_no_share_fails_without_touching_it() -> None:
    share = round_robin_share(watched(TENSORS), holder=1, holders=2)
    result = run_holder_task_safely(f"{__name__}:fails_before_reading", share, holder=1, holders=2)
    assert result == {"holder_error": "RuntimeError: no group with the engines"}
    assert SEEN == []  # no holder iterated: no gather may start on this one alone


def test_a_task_that_succeeds_returns_its_result() -> None:
    share = round_robin_share(watched(TENSORS), holder=1, holders=2)
    result = run_holder_task_safely(f"{__name__}:takes_all", share, holder=1, holders=2)
    assert result == {"names": ["layer1.weight", "layer3.weight", "layer5.weight"]}


def test_the_driver_raises_one_error_naming_every_holder_that_failed() -> None:
    results = [{"bytes": 1}, {"holder_error": "RuntimeError: a"}, {"holder_error": "OSError: b"}]
    with pytest.raises(HolderTaskError) as caught:
        raise_holder_errors("m:send", results, ["rank0", "rank1", "rank2"])
    assert str(caught.value) == "holder task m:send failed in 2 holder(s): rank1: RuntimeError: a; rank2: OSError: b"
    assert raise_holder_errors("m:send", results[:1], ["rank0"]) == results[:1]


def test_a_bad_task_name_is_a_holder_error_too() -> None:
    result = run_holder_task_safely("no_such_module:task", iter(()), holder=0, holders=1)
    assert result["holder_error"].startswith("MilesError: holder task 'no_such_module:task' cannot be loaded")
