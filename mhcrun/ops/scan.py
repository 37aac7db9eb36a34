"""Finding values that must not reach a GEMM, in stored tensors: NaN/Inf floats, e4m3 NaN codes, and scales that
are NaN, infinite or so large that the format's largest value times the scale overflows fp32.

`first_bad` runs `scan.cpp` (each byte read once, on torch's threads) when given its library, which
`open_scan(env)` builds (`mhcrun.ops.native`) and loads once per run; without it (no compiler, or
`MHCRUN_CPU_KERNEL=0` in the run's `Env`) it takes `first_bad_reference`, plain torch over slices. Both return the
flat index of the first bad element, or -1.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
from pathlib import Path

import torch
from torch import Tensor

from mhcrun.ops import native
from mhcrun.ops.quant import FORMAT_MAX
from mhcrun.settings import Env

SOURCE = Path(__file__).with_name("scan.cpp")
FLOAT_MAX = torch.finfo(torch.float32).max
_EXP_MASK = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}
_SLICE = 1 << 24  # elements per slice of the torch reference


def open_scan(env: Env) -> ctypes.CDLL | None:
    """scan.cpp built with the run's compiler into its kernel cache and loaded, or None where it does not build or
    MHCRUN_CPU_KERNEL=0 (then `first_bad` takes the torch reference)."""
    if env.cpu_kernel == "0":
        return None
    try:
        return load_scan(native.build(SOURCE, env.kernel_cache, env.cxx))
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None


@functools.cache
def load_scan(path: Path) -> ctypes.CDLL:
    """The scan library at `path`, its entry points typed (loaded once per process)."""
    lib = ctypes.CDLL(str(path))
    for name, extra in (("mhc_scan_f32", []), ("mhc_scan_f16", [ctypes.c_uint16]), ("mhc_scan_e4m3", []),
                        ("mhc_scan_e8m0", [ctypes.c_uint8])):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, *extra, ctypes.c_int]
    return lib


def e8m0_top(fmt: str) -> int:
    """The largest e8m0 byte whose scale 2**(b - 127) times the format's largest value stays finite in fp32."""
    return max(b for b in range(255) if FORMAT_MAX[fmt] * 2.0 ** (b - 127) <= FLOAT_MAX)


def what_is_bad(t: Tensor, role: str, fmt: str | None = None) -> str:
    """The name of the check a tensor gets: role "float" (a float tensor), "codes" (e4m3 codes) or "scale"."""
    if role == "scale":
        return f"a NaN/Inf scale, or one whose product with {FORMAT_MAX[fmt]:g} overflows fp32"
    return "an e4m3 NaN code" if role == "codes" else "NaN/Inf"


def first_bad_reference(t: Tensor, role: str, fmt: str | None = None) -> int:
    """Plain torch: role "float" (any float dtype), "codes" (float8_e4m3fn), "scale" (e8m0 or fp32; `fmt` the
    weight's format, fp8 or fp4)."""
    flat = t.reshape(-1)
    for i0 in range(0, flat.numel(), _SLICE):
        part = flat[i0:i0 + _SLICE]
        if role == "codes":
            bad = part.view(torch.uint8).bitwise_and(0x7F) == 0x7F
        elif role == "scale" and part.dtype == torch.float8_e8m0fnu:
            bad = part.view(torch.uint8) > e8m0_top(fmt)
        elif role == "scale":
            bad = ~(part.float().abs() <= FLOAT_MAX / FORMAT_MAX[fmt])  # NaN too
        else:
            bad = ~torch.isfinite(part)
        hit = bad.nonzero()
        if hit.numel():
            return i0 + int(hit[0, 0])
    return -1


def first_bad(t: Tensor, role: str, fmt: str | None = None, *, lib: ctypes.CDLL | None) -> int:
    """As `first_bad_reference`, through scan.cpp (`lib`, from `open_scan`) for a contiguous CPU tensor; with no
    library, the reference."""
    n, threads = t.numel(), torch.get_num_threads()
    if lib is None or t.device.type != "cpu" or not t.is_contiguous() or n == 0:
        return first_bad_reference(t, role, fmt)
    ptr = t.data_ptr()
    if role == "codes":
        return lib.mhc_scan_e4m3(ptr, n, threads)
    if role == "scale" and t.dtype == torch.float8_e8m0fnu:
        return lib.mhc_scan_e8m0(ptr, n, e8m0_top(fmt), threads)
    if role == "float" and t.dtype == torch.float32:
        return lib.mhc_scan_f32(ptr, n, threads)
    if role == "float" and t.dtype in _EXP_MASK:
        return lib.mhc_scan_f16(ptr, n, _EXP_MASK[t.dtype], threads)
    return first_bad_reference(t, role, fmt)
