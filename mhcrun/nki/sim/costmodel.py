"""An estimate of what a kernel call costs on one Trainium2 NeuronCore-v3, from the simulator's count of its DMA
transfers and engine instructions (``costs.CostLog``). An estimate, not a measurement: nothing here has been
compared with a device.

Model: each engine (and the DMA queues) works through its own instructions; engines overlap perfectly, so a
call takes as long as its busiest engine (``overlapped_us``); ``serial_us`` is the sum, the other bound. A kernel
launch adds ``LAUNCH_US``.

- DMA: bytes at ``HBM_BYTES_PER_S`` scaled by an efficiency of ``min(1, bytes per partition / DMA_FULL_BPP)``,
  plus ``DMA_FIXED_S`` per transfer.
- Tensor engine: one moving column per cycle at ``PE_HZ`` for bf16 (fp32 takes 4: 20 of 79 dense TFLOPS; fp8 1/2),
  plus ``INSTR_FIXED_CYCLES``.
- Vector engine: ``VE_ELEMS_PER_CYCLE`` elements per cycle across the 128 partitions (so ``/ 128`` per
  partition: a tile on 1 partition takes as long per element as one on 128), ``VE_HZ``.
- Scalar engine: 1 element per partition per cycle at ``ACT_HZ``; GpSimd the same at ``POOL_HZ``.

Every constant names its source; ``SENSITIVITY`` lists the ones no document gives, with the range the
benchmark shows the estimate over.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .costs import CostLog

PARTITIONS = 128  # lanes of the Vector engine's data path


@dataclass(frozen=True)
class Figures:
    # trainium2_arch.rst: "4 HBM stacks with a total device memory capacity of 96GiB and bandwidth of 3TB/s", 8
    # NeuronCore-v3 per device: one core's share. (shared/spec/nki.md gives 2.9 TB/s.)
    hbm_bytes_per_s: float = 3.0e12 / 8
    # nki-dma-bandwidth-guide (via shared/spec/nki.md): DMAs want >= 2 KiB per partition (4 KiB saturates). No
    # document gives the curve below; linear is an assumption (see SENSITIVITY).
    dma_full_bpp: int = 2048
    # trainium2_arch.rst: "Each DGE-based DMA instruction takes about 600 ns to execute on NeuronCore-v3".
    dma_fixed_s: float = 600e-9
    # trainium2_arch.rst, Compute Engine Specifications (frequency, data-path width).
    pe_hz: float = 2.4e9
    ve_hz: float = 0.96e9
    ve_elems_per_cycle_16: int = 512  # BF16/FP16
    ve_elems_per_cycle_32: int = 256  # other types
    act_hz: float = 1.2e9
    pool_hz: float = 1.2e9  # GpSimd: frequency documented, data-path width not (taken as 1 / partition / cycle)
    # No document gives a fixed per-instruction cost; 64 cycles is an assumption (see SENSITIVITY).
    instr_fixed_cycles: int = 64
    # nki-library's DeepSeek-V4 decode kernels measure ~32 us per kernel launch boundary (shared/spec/nki.md).
    launch_s: float = 32e-6


FIGURES = Figures()

# Constants no document gives, and the values the benchmark shows the estimate at.
SENSITIVITY = {
    "dma_full_bpp": (512, 2048, 4096),
    "instr_fixed_cycles": (0, 64, 256),
    "dma_fixed_s": (0.0, 600e-9, 2e-6),
}


@dataclass(frozen=True)
class Estimate:
    dma_us: float
    engine_us: dict[str, float]
    overlapped_us: float  # busiest engine or DMA (perfect overlap)
    serial_us: float  # everything one after the other
    dmas: int
    dma_bytes: int
    small_dmas: int  # transfers below dma_full_bpp bytes per partition
    instructions: dict[str, int]


def _engine_cycles(engine: str, partitions: int, free: int, itemsize: int, f: Figures) -> float:
    if engine == "tensor":
        per_col = 4.0 if itemsize >= 4 else 0.5 if itemsize == 1 else 1.0
        return free * per_col
    if engine == "vector":
        width = f.ve_elems_per_cycle_16 if itemsize <= 2 else f.ve_elems_per_cycle_32
        return free / (width / PARTITIONS)
    return float(free)  # scalar, gpsimd: one element per partition per cycle


def estimate(log: CostLog, f: Figures = FIGURES) -> Estimate:
    """Estimated time of the instructions and transfers in ``log`` (no launch boundary included)."""
    dma_s = 0.0
    small = 0
    nbytes = 0
    for d in log.dmas:
        eff = min(1.0, d.bytes_per_partition / f.dma_full_bpp)
        small += d.bytes_per_partition < f.dma_full_bpp
        nbytes += d.nbytes
        dma_s += d.nbytes / (f.hbm_bytes_per_s * max(eff, 1e-6)) + f.dma_fixed_s
    hz = {"tensor": f.pe_hz, "vector": f.ve_hz, "scalar": f.act_hz, "gpsimd": f.pool_hz}
    eng = dict.fromkeys(hz, 0.0)
    count = dict.fromkeys(hz, 0)
    for i in log.instrs:
        cycles = _engine_cycles(i.engine, i.partitions, i.free, i.itemsize, f) + f.instr_fixed_cycles
        eng[i.engine] += cycles / hz[i.engine]
        count[i.engine] += 1
    us = {k: v * 1e6 for k, v in eng.items()}
    dma_us = dma_s * 1e6
    return Estimate(dma_us, us, max([dma_us, *us.values()]), dma_us + sum(us.values()), len(log.dmas), nbytes,
                    small, count)


def with_figures(**changes) -> Figures:
    """FIGURES with some constants replaced (the sensitivity runs)."""
    return replace(FIGURES, **changes)


def floor_us(nbytes: int, f: Figures = FIGURES) -> float:
    """Bytes at one core's HBM bandwidth: the floor no kernel goes under."""
    return nbytes / f.hbm_bytes_per_s * 1e6
