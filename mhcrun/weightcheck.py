"""`--check-weights`: scan every stored tensor a run loads for values that must not reach a GEMM.

Float tensors (NaN or Inf), FP8 e4m3 weights (NaN codes), FP8/FP4 scales (NaN, Inf, or so large that the format's
largest value times the scale overflows fp32). FP4 codes are all numbers; integer tables are range-checked at
load. Each byte is read once (`mhcrun.ops.scan`), straight from the mapped shards.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mhcrun.checkpoint import CheckpointPlan, stored_tensors
from mhcrun.errors import NonFiniteError
from mhcrun.ops.scan import first_bad, what_is_bad


@dataclass
class BadTensor:
    name: str
    index: list[int]  # of the first bad element
    what: str

    def line(self) -> str:
        return f"{self.name}: {self.what} at {self.index}"


def unravel(i: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for n in reversed(shape):
        out.append(i % n)
        i //= n
    return out[::-1]


def shown_value(v: torch.Tensor) -> str:
    """One stored element: one-byte formats as their byte (e4m3 0x7f, e8m0 0xff), floats as numbers."""
    if v.element_size() == 1:
        return f"0x{int(v.view(torch.uint8)):02x}"
    return str(float(v.float()))


def check_weights(plan: CheckpointPlan, scan: ctypes.CDLL | None,
                  progress: Callable[[int, int], None] | None = None) -> list[BadTensor]:
    """Every bad tensor with its first bad index, scanned by `scan` (scan.cpp's library, `open_scan`; None: the
    torch reference); progress(done_bytes, total_bytes) after each tensor."""
    total = sum(plan.bytes_by_dtype.values())
    done, bad = 0, []
    for name, role, fmt, t in stored_tensors(plan):
        if role in ("float", "codes", "scale"):
            i = first_bad(t, role, fmt, lib=scan)
            if i >= 0:
                bad.append(BadTensor(name, unravel(i, tuple(t.shape)), f"{what_is_bad(t, role, fmt)} "
                                                                       f"({shown_value(t.reshape(-1)[i])})"))
        done += t.numel() * t.element_size()
        if progress:
            progress(done, total)
    return bad


def raise_if_bad(bad: list[BadTensor], where: str) -> None:
    """One line naming every bad tensor (the first 10, then how many more): a failed run, exit 3."""
    if not bad:
        return
    shown = "; ".join(b.line() for b in bad[:10]) + (f"; and {len(bad) - 10} more" if len(bad) > 10 else "")
    verb = "tensors hold" if len(bad) > 1 else "tensor holds"
    raise NonFiniteError(f"{where}: {len(bad)} {verb} values no GEMM may take: {shown}")
