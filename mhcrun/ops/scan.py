"""Finding values that must not reach a GEMM, in stored tensors: NaN/Inf floats, e4m3 NaN codes, and scales that
are NaN, infinite or so large that the format's largest value times the scale overflows fp32.

`first_bad` runs `scan.cpp` (built on first use by `mhcrun.ops.native`; each byte read once, on torch's
threads) and falls back to `first_bad_reference`, plain torch over slices, where no compiler is available
(`MHCRUN_CPU_KERNEL=0` also picks it). Both return the flat index of the first bad element, or -1.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import torch
from torch import Tensor

from mhcrun.ops import native
from mhcrun.ops.quant import FORMAT_MAX

SOURCE = Path(__file__).with_name("scan.cpp")
FLOAT_MAX = torch.finfo(torch.float32).max
_EXP_MASK = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}
_SLICE = 1 << 24  # elements per slice of the torch reference

_lib: ctypes.CDLL | None = None
_tried = False


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried or os.environ.get("MHCRUN_CPU_KERNEL", "1") == "0":
        return _lib if _tried else None
    _tried = True
    try:
        lib = ctypes.CDLL(str(native.build(SOURCE)))
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None
    for name, extra in (("mhc_scan_f32", []), ("mhc_scan_f16", [ctypes.c_uint16]), ("mhc_scan_e4m3", []),
                        ("mhc_scan_e8m0", [ctypes.c_uint8])):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, *extra, ctypes.c_int]
    _lib = lib
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


def first_bad(t: Tensor, role: str, fmt: str | None = None) -> int:
    """As `first_bad_reference`, through scan.cpp for a contiguous CPU tensor when it is built."""
    lib = _load()
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
