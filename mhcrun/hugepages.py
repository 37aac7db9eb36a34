"""Weights on transparent huge pages (2 MB): each shard's loaded tensors copied into an anonymous mapping advised
MADV_HUGEPAGE, so that a decode step, which streams every weight once, walks one page table entry per 2 MB instead of
one per 4 KB. A shard's own mapping (`checkpoint.load_checkpoint`) is on the page cache's 4 KB pages. On a 2-core AMX
VM an eager decode step of the mid-size config took 0.9x the time, and a read stream ran 1.2x as fast (BENCHMARKS.md,
issue 20).

A CPU run copies where the kernel offers huge pages to a process that asks (its `transparent_hugepage` mode "always"
or "madvise") and the weights fit in the memory available; otherwise they stay mapped, and `why_not` says why.
MHCRUN_HUGE_PAGES=0 keeps them mapped.
"""

from __future__ import annotations

import mmap
from dataclasses import replace

import torch

from mhcrun.heap import thp_mode
from mhcrun.memory import available_bytes, format_bytes
from mhcrun.ops.qweight import QWeight

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor's first byte: a cache line
FIT = 0.9  # the share of the available memory the weights may take


def why_not(nbytes: int, enabled: bool, mode: str | None = None, available: int | None = -1) -> str | None:
    """Why `nbytes` of weights stay on 4 KB pages, or None where they go on huge pages (`mode` and `available`
    default to the kernel's: `thp_mode`, `memory.available_bytes`)."""
    mode = thp_mode() if mode is None else mode
    available = available_bytes() if available == -1 else available
    if not enabled:
        return "MHCRUN_HUGE_PAGES=0"
    if mode not in ("always", "madvise"):
        return f"transparent huge pages: {mode or 'none'}"
    if available is not None and nbytes > FIT * available:
        return f"{format_bytes(nbytes)} of weights, {format_bytes(available)} available"
    return None


def parts(value: torch.Tensor | QWeight) -> list[torch.Tensor]:
    """The tensors holding a loaded value's bytes: a tensor, or a QWeight's data and scale."""
    return value.parts if isinstance(value, QWeight) else [value]


def span(t: torch.Tensor) -> int:
    """Bytes `t` takes in a mapping: its own, rounded up to ALIGN."""
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN


def place(tensors: dict[str, torch.Tensor | QWeight]) -> None:
    """Copy the tensors, in place in `tensors`, into one anonymous mapping advised MADV_HUGEPAGE, starting on a huge
    page boundary: the same names, shapes, dtypes and values (a QWeight keeps its flags). The copies are views that
    keep the mapping alive; the originals are dropped."""
    nbytes = sum(span(t) for v in tensors.values() for t in parts(v))
    if not nbytes:
        return
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(area, dtype=torch.uint8)  # keeps `area` alive while any view of it lives
    at = -raw.data_ptr() % HUGE_PAGE

    def copy(t: torch.Tensor) -> torch.Tensor:
        nonlocal at
        dst = raw[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        dst.copy_(t)
        at += span(t)
        return dst

    for name, v in tensors.items():
        tensors[name] = (replace(v, data=copy(v.data), scale=None if v.scale is None else copy(v.scale))
                         if isinstance(v, QWeight) else copy(v))
