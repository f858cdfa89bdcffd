"""The trainer's registered memory is moved onto transparent huge pages, in place."""

from __future__ import annotations

import platform
import re

import pytest
import torch
from miles_plugins_rdt.huge_pages import HUGE_PAGE, collapse_into_huge_pages, huge_page_span


def _kernel_at_least(major: int, minor: int) -> bool:
    found = re.match(r"(\d+)\.(\d+)", platform.release())
    return bool(found) and (int(found[1]), int(found[2])) >= (major, minor)


def _huge_kib_in(address: int, nbytes: int) -> int:
    """AnonHugePages of the mappings of this process that overlap ``[address, address + nbytes)``."""
    total, overlaps = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                start, end = int(span[1], 16), int(span[2], 16)
                overlaps = start < address + nbytes and address < end
            elif overlaps and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


def test_the_span_is_the_whole_huge_pages_inside_the_range() -> None:
    assert huge_page_span(HUGE_PAGE + 1, 3 * HUGE_PAGE) == (2 * HUGE_PAGE, 2 * HUGE_PAGE)
    assert huge_page_span(0, 5 * HUGE_PAGE) == (0, 5 * HUGE_PAGE)
    assert huge_page_span(HUGE_PAGE + 1, HUGE_PAGE) == (2 * HUGE_PAGE, 0)  # no whole huge page inside


def test_a_small_tensor_is_left_alone() -> None:
    assert collapse_into_huge_pages(torch.ones(1024)) == 0


@pytest.mark.skipif(
    platform.system() != "Linux" or not _kernel_at_least(6, 1), reason="MADV_COLLAPSE needs Linux 6.1 or later"
)
def test_a_large_tensor_moves_onto_huge_pages_keeping_its_contents_and_address() -> None:
    tensor = torch.arange(8 << 20, dtype=torch.float32)  # 32 MiB
    address, before = tensor.data_ptr(), tensor.clone()
    collapsed = collapse_into_huge_pages(tensor)
    start, length = huge_page_span(address, tensor.numel() * tensor.element_size())
    assert collapsed == length >= 30 << 20
    assert _huge_kib_in(start, length) * 1024 >= length
    assert tensor.data_ptr() == address and torch.equal(tensor, before)
