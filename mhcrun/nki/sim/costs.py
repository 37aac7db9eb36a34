"""What one kernel call did, as counted by the simulator: each DMA transfer (bytes, partitions) and each engine
instruction (engine, partitions, elements per partition, dtype). ``mhcrun.nki.sim.costmodel`` turns the log into
an estimated time; this module only counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Dma:
    op: str
    nbytes: int  # device bytes moved
    partitions: int  # rows of the on-chip side (1 for HBM -> HBM)

    @property
    def bytes_per_partition(self) -> int:
        return self.nbytes // max(self.partitions, 1)


@dataclass(frozen=True)
class Instr:
    engine: str  # "tensor" | "vector" | "scalar" | "gpsimd"
    op: str
    partitions: int
    free: int  # elements per partition the instruction streams (matmul: moving free size)
    itemsize: int  # bytes of the widest operand element
    contraction: int = 0  # matmul / transpose: K rows


@dataclass
class CostLog:
    dmas: list[Dma] = field(default_factory=list)
    instrs: list[Instr] = field(default_factory=list)

    def dma(self, op: str, nbytes: int, partitions: int) -> None:
        self.dmas.append(Dma(op, int(nbytes), int(partitions)))

    def instr(self, engine: str, op: str, partitions: int, free: int, itemsize: int, contraction: int = 0) -> None:
        self.instrs.append(Instr(engine, op, int(partitions), int(free), int(itemsize), int(contraction)))

    def extend(self, other: CostLog) -> None:
        self.dmas.extend(other.dmas)
        self.instrs.extend(other.instrs)
