"""On-chip memory of one kernel call on the declared target (``target``): live SBUF bytes per partition, PSUM
per partition by bank, open matmul accumulation groups, and the peaks the call reached.

A tile is live from its allocation until the simulator's last reference to it goes (CPython frees it at once: a
tile reassigned in a loop body is freed when the next iteration's replaces it). That is a lower bound of what
the NKI compiler allocates (it may keep more tiles for pipelining), so a kernel refused here is over capacity on
the device too.

PSUM: a tile of at most one bank (2 KiB per partition) is packed into the first bank with room; a larger tile
takes whole consecutive free banks. A matmul (or Tensor-engine transpose) output must lie in one bank. An
accumulation group opens with the first Tensor-engine write into a bank of a tile and closes when another engine
reads that bank of the tile or the tile is freed; at most 8 are open at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import target as tg
from .errors import NkiSimError


@dataclass
class MemoryPeaks:
    """The peaks one kernel call reached (bytes per partition)."""

    sbuf_bytes: int = 0
    psum_bytes: int = 0
    psum_bank_bytes: list[int] = field(default_factory=lambda: [0] * tg.PSUM_BANKS)
    open_groups: int = 0


class MemoryTracker:
    """Live on-chip memory of one kernel call."""

    def __init__(self):
        self.sbuf_live = 0
        self.psum_used = [0] * tg.PSUM_BANKS
        self.groups: dict[tuple[int, int], str] = {}  # (storage id, bank) -> tile name
        self.peaks = MemoryPeaks()

    # ---- SBUF

    def alloc_sbuf(self, op: str, nbytes: int, what: str) -> None:
        if self.sbuf_live + nbytes > tg.SBUF_PARTITION_BYTES:
            raise NkiSimError(
                f"{op}: SBUF over capacity: {what} needs {nbytes} bytes per partition with {self.sbuf_live} already "
                f"live; an SBUF partition holds {tg.SBUF_PARTITION_BYTES} on {tg.TARGET} (free tiles by letting them "
                "go out of scope, or tile the free axis smaller)"
            )
        self.sbuf_live += nbytes
        self.peaks.sbuf_bytes = max(self.peaks.sbuf_bytes, self.sbuf_live)

    def free_sbuf(self, nbytes: int) -> None:
        self.sbuf_live -= nbytes

    # ---- PSUM

    def alloc_psum(self, op: str, nbytes: int, what: str) -> tuple[int, int]:
        """(first bank, number of banks) of a new PSUM tile of ``nbytes`` per partition."""
        bank = tg.PSUM_BANK_BYTES
        if nbytes <= bank:
            for b in range(tg.PSUM_BANKS):
                if self.psum_used[b] + nbytes <= bank:
                    self.psum_used[b] += nbytes
                    self._psum_peak()
                    return b, 1
        else:
            n = -(-nbytes // bank)
            for b in range(tg.PSUM_BANKS - n + 1):
                if all(self.psum_used[i] == 0 for i in range(b, b + n)):
                    for i in range(b, b + n):
                        self.psum_used[i] = min(bank, nbytes - (i - b) * bank)
                    self._psum_peak()
                    return b, n
        raise NkiSimError(
            f"{op}: PSUM over capacity: {what} needs {nbytes} bytes per partition; in use by bank: "
            f"{self.psum_used} of {tg.PSUM_BANKS} x {bank} on {tg.TARGET} (a tile of at most one bank goes into one "
            "bank with room, a larger one into free consecutive banks)"
        )

    def free_psum(self, storage_id: int, first: int, nbanks: int, nbytes: int) -> None:
        if nbanks == 1:
            self.psum_used[first] -= nbytes
        else:
            for i in range(first, first + nbanks):
                self.psum_used[i] = 0
        for b in range(first, first + nbanks):
            self.groups.pop((storage_id, b), None)

    def _psum_peak(self) -> None:
        p = self.peaks
        p.psum_bytes = max(p.psum_bytes, sum(self.psum_used))
        p.psum_bank_bytes = [max(a, b) for a, b in zip(p.psum_bank_bytes, self.psum_used, strict=True)]

    # ---- accumulation groups

    def open_group(self, op: str, storage_id: int, bank: int, name: str) -> None:
        key = (storage_id, bank)
        if key in self.groups:
            return
        if len(self.groups) >= tg.MAX_ACCUMULATION_GROUPS:
            open_ = ", ".join(f"'{n}' bank {b}" for (_, b), n in self.groups.items())
            raise NkiSimError(
                f"{op}: a {tg.MAX_ACCUMULATION_GROUPS + 1}th open matmul accumulation group (PSUM tile '{name}' bank "
                f"{bank}); at most {tg.MAX_ACCUMULATION_GROUPS} are open at once on {tg.TARGET} (open: {open_}); "
                "read (evict) a finished accumulation before starting another"
            )
        self.groups[key] = name
        self.peaks.open_groups = max(self.peaks.open_groups, len(self.groups))

    def close_groups(self, storage_id: int, banks: range) -> None:
        for b in banks:
            self.groups.pop((storage_id, b), None)
