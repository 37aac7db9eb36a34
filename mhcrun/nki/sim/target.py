"""The device mhcrun's kernels are written for, and what the simulator knows about it: one place for every
figure the simulator's rules rest on.

mhcrun targets the Neuron SDK 2.33 (TorchNeuron: the native ``neuron`` device, ``torch-neuronx`` 2.13.3 for
PyTorch 2.13) on Trainium2 (NeuronCore-v3), and writes its kernels against the NKI 0.3 API (SDK 2.29, NKI's
first GA release): the oldest API of the GA line, which the later SDKs keep, so the same source compiles from
SDK 2.29 on. The simulator refuses API that NKI 0.3 lacks (``NkiTensor.broadcast`` / ``.size`` arrived in 0.5)
and provides what 0.3 has (``NkiTensor.ap`` access patterns).

Sources (aws-neuron/aws-neuron-sdk):
- ``release-notes/components/nki.rst``: NKI 0.3.0 = SDK 2.29.0, 0.4.0 = 2.30.0, 0.5.0 = 2.31.0, 0.6.0 = 2.32.0;
  0.3.0's breaking changes (no ``dst_rmw_op`` on ``dma_copy``, no keyword-only ``*`` in kernel signatures, no
  ``is`` / ``is not``, binary ops do not broadcast).
- ``nki/guides/architecture/trainium2_arch.rst``: SBUF 24 MiB = 128 partitions x 192 KiB, PSUM 2 MiB =
  128 partitions x 16 KiB in 8 banks of 2 KiB; a matmul writes one bank; 8 accumulation groups; partition
  start offsets; fp8 ``float8_e4m3`` on NeuronCore-v3 has 240 as its largest value (``float8_e4m3fn``, largest
  448, arrives with NeuronCore-v4).
- release notes of torch-neuronx 2.33.0 (TorchNeuron public beta; ``init_process_group(backend="neuron")``).
"""

from __future__ import annotations

NEURON_SDK = "2.33"
NKI_API = (0, 3)  # the NKI version whose API the kernels use
NKI_API_NAME = "NKI 0.3 (Neuron SDK 2.29)"
TARGET = "trn2"  # Trainium2, NeuronCore-v3

# API introduced after NKI 0.3: name -> the version that brought it.
API_SINCE = {
    "NkiTensor.broadcast": (0, 5),
    "NkiTensor.size": (0, 5),
}
# API that NKI 0.3 removed: name -> (the version that removed it, what replaces it).
API_REMOVED = {
    "nisa.dma_copy(dst_rmw_op=...)": ((0, 3), "nisa.dma_compute"),
}

# NeuronCore-v3 memory.
PMAX = 128  # partitions
SBUF_PARTITION_BYTES = 192 * 1024
PSUM_BANKS = 8
PSUM_BANK_BYTES = 2 * 1024
PSUM_PARTITION_BYTES = PSUM_BANKS * PSUM_BANK_BYTES
PSUM_BANK_FP32 = PSUM_BANK_BYTES // 4  # 512: nl.tile_size.psum_fmax
MAX_ACCUMULATION_GROUPS = 8
# Partition starts an engine instruction may use, by the number of partitions it touches (trainium2_arch.rst).
PARTITION_STARTS = ((32, (0, 32, 64, 96)), (64, (0, 64)), (PMAX, (0,)))

# fp8 on NeuronCore-v3: float8_e4m3 is the IEEE-style e4m3 (exponent 15 reserved), largest finite value 240.
FP8_E4M3_MAX = 240.0


def version_name(v: tuple[int, int]) -> str:
    return f"NKI {v[0]}.{v[1]}"


def allowed_partition_starts(partitions: int) -> tuple[int, ...]:
    """The partition offsets at which an engine operand of ``partitions`` partitions may start."""
    for limit, starts in PARTITION_STARTS:
        if partitions <= limit:
            return starts
    return (0,)
