"""The CPU decode GEMV over weights kept quantised: `qgemv.cpp`, built on first use and called through ctypes.

Decoding quantised weights with torch ops takes several passes over every chunk (`qlinear`'s chunk
decoders), which leaves a decode step bound by arithmetic instead of memory. This kernel reads each weight
byte once, decodes it in registers (AVX-512, or AVX2) and multiplies it into up to four rows of x at a time, on
torch's OpenMP threads. It covers FP8 e4m3 with tile scales, packed FP4 e2m1 with group scales and bf16
weights, for a few rows of x (decode); `qlinear` keeps its torch path as the reference and for everything
else (prefill, other CPUs, a weight whose scales could overflow: `QWeight.kernel`, decided at load).

Build: `mhcrun.ops.native` (`$CXX` with OpenMP, cached in `$MHCRUN_KERNEL_CACHE`). It runs AVX-512 where the
CPU has it, else AVX2 (`MHCRUN_CPU_KERNEL=avx2` picks AVX2 on an AVX-512 CPU, to compare or test both). Without
a compiler, on a CPU with neither, or with `MHCRUN_CPU_KERNEL=0`, `available()` is False and `qgemv` returns
None; `status()` says why.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import torch
from torch import Tensor

from mhcrun.ops import native
from mhcrun.ops.qweight import QWeight
from mhcrun.settings import Env

SOURCE = Path(__file__).with_name("qgemv.cpp")
MAX_ROWS = 16  # rows of x (tokens x batch) up to which the kernel beats dequantise-then-matmul
_FORMATS = {"fp8": 0, "fp4": 1, "float": 2}  # float: bf16 only (QWeight.kernel)

_lib: ctypes.CDLL | None = None
_why: str | None = None  # set once the library is known to be unavailable


_ISAS = {"avx512": 2, "avx2": 1}
_isa = 0  # the best instruction set this CPU gives the kernel (qgemv.cpp's mhc_qgemv_isa), once loaded


def enabled() -> bool:
    return os.environ.get("MHCRUN_CPU_KERNEL", "1") != "0"


def _chosen_isa() -> int:
    """MHCRUN_CPU_KERNEL=avx2 (or avx512) caps the instruction set; anything else but 0 takes the best."""
    want = _ISAS.get(os.environ.get("MHCRUN_CPU_KERNEL", ""), 2)
    return min(want, _isa)


def build(cache: Path | None = None) -> Path:
    """Compile qgemv.cpp (once per source, compiler and flags) and return the shared library's path."""
    env = Env.read()
    return native.build(SOURCE, cache or env.kernel_cache, env.cxx)


def _load() -> ctypes.CDLL | None:
    global _lib, _why
    if _lib is not None or _why is not None:
        return _lib
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _why = f"not built ({e})"
        return None
    lib.mhc_qgemv.restype = ctypes.c_int
    lib.mhc_qgemv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_int, ctypes.c_int]
    lib.mhc_decode_rows.restype = ctypes.c_int
    lib.mhc_decode_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p] + \
        [ctypes.c_int64] * 5 + [ctypes.c_int, ctypes.c_int]
    lib.mhc_act_quant_fp8.restype = ctypes.c_int
    lib.mhc_act_quant_fp8.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3
    global _isa
    _isa = lib.mhc_qgemv_isa()
    if not _isa:
        _why = "this CPU lacks AVX2/AVX-512 with F16C and FMA"
        return None
    _lib = lib
    return lib


def available() -> bool:
    return enabled() and _load() is not None


def status() -> str:
    """One line: whether decode GEMVs on quantised CPU weights take the kernel, and if not why."""
    if not enabled():
        return "off (MHCRUN_CPU_KERNEL=0)"
    if _load() is None:
        return f"off: {_why}"
    return {2: "avx512", 1: "avx2"}[_chosen_isa()]


def takes(w: QWeight, rows: int) -> bool:
    """Whether `qgemv` takes this weight for `rows` rows of x: the weight's own answer (`QWeight.kernel`, decided
    when it was loaded), the library already loaded (`available()` called before) and switched on. Safe while
    torch.compile traces, where the answer is fixed into the graph."""
    return w.kernel and rows <= MAX_ROWS and _lib is not None and enabled()


def qgemv(x3: Tensor, w: QWeight, groups: int) -> Tensor | None:
    """y [M, G, N/G] fp32 = x3 [M, G, K] (fp32) times the rows of the 2-D weight in G groups, or None when the
    kernel does not take it (`takes`) or this thread flushes subnormals (then the caller takes the torch path).
    A row holding an e4m3 NaN code comes out NaN, as dequantise-then-multiply gives it."""
    m = x3.shape[0]
    if not w.kernel or m > MAX_ROWS or not enabled():
        return None
    lib = _load()
    if lib is None:
        return None
    scale, kind = _scale_arg(w)
    s_ptr = None if scale is None else scale.data_ptr()
    x = x3.float().contiguous()
    n, k = w.out_features, w.in_features
    y = torch.empty(m, n, dtype=torch.float32)
    rc = lib.mhc_qgemv(_FORMATS[w.fmt], w.data.data_ptr(), s_ptr, kind, x.data_ptr(), y.data_ptr(), m, n, k,
                       w.block, groups, _chosen_isa(), torch.get_num_threads())
    return None if rc else y.view(m, groups, n // groups)


def _scale_arg(w: QWeight) -> tuple[Tensor | None, int]:
    """The weight's scales as the C++ side reads them: (contiguous fp32, 1) or (contiguous e8m0 bytes, 0); (None, 0)
    for a bf16 weight. The caller keeps the tensor alive through the call."""
    if w.scale is None:
        return None, 0
    if w.scale.dtype == torch.float32:
        return w.scale.contiguous(), 1
    return w.scale.view(torch.uint8).contiguous(), 0


def decodes(w: QWeight) -> bool:
    """Whether `decode_rows` takes this weight (an fp8 / fp4 one the kernel takes, the library loaded)."""
    return w.kernel and w.fmt != "float" and enabled() and _load() is not None


def decode_rows(w: QWeight, r0: int, r1: int, out: Tensor) -> bool:
    """Rows [r0, r1) of a 2-D fp8 / fp4 weight the kernel takes, dequantised into out (contiguous fp32
    [r1 - r0, in]) in one pass, bitwise as the reference dequantisers; False when it does not apply (then the
    caller decodes with torch)."""
    if not w.kernel or w.fmt == "float" or not enabled():
        return False
    lib = _load()
    if lib is None:
        return False
    scale, kind = _scale_arg(w)
    return lib.mhc_decode_rows(_FORMATS[w.fmt], w.data.data_ptr(), scale.data_ptr(), kind, out.data_ptr(), r0, r1,
                               w.out_features, w.in_features, w.block, _decode_isa(), torch.get_num_threads()) == 0


def _decode_isa() -> int:
    """decode_rows' instruction set: AVX-512 where the kernel runs it, else plain C++ (0)."""
    return 2 if _chosen_isa() == 2 else 0


def act_quant_fp8(x: Tensor, block: int) -> Tensor | None:
    """fp8_simulate(x, block, pow2_scale=True) (DeepSeek's act_quant before an FP8/FP4 GEMM), bitwise, for a
    few rows of a CPU fp32/bf16 x; None when it does not apply (then the caller takes the torch path)."""
    k = x.shape[-1]
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu" or not k or not enabled():
        return None
    rows = x.numel() // k
    lib = _load()
    if lib is None or rows > MAX_ROWS:
        return None
    y = x.to(torch.float32, copy=True).contiguous()
    if lib.mhc_act_quant_fp8(y.data_ptr(), rows, k, block):
        return None
    return y.to(x.dtype)
