"""NKI data types for the simulator: names, storage, rounding into a dtype, and torch / numpy mapping.

Every dtype is named by a plain string, as in the real ``nki.language`` (``nl.bfloat16 == "bfloat16"``).
Floating-point values live in float32 numpy arrays whose values are already rounded to the tensor's dtype
(bf16 round-to-nearest-even, fp16 via numpy, fp8 via torch's float8 casts, tf32 by mantissa rounding);
integer dtypes live in numpy arrays of that integer type.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import target as tg
from .errors import NkiSimError

bool_ = "bool"
int8 = "int8"
int16 = "int16"
int32 = "int32"
uint8 = "uint8"
uint16 = "uint16"
uint32 = "uint32"
float16 = "float16"
float32 = "float32"
bfloat16 = "bfloat16"
tfloat32 = "tfloat32"
float8_e4m3 = "float8_e4m3"
float8_e4m3fn = "float8_e4m3fn"
float8_e5m2 = "float8_e5m2"


@dataclass(frozen=True)
class DTypeInfo:
    name: str
    storage: type  # numpy scalar type of the backing array
    itemsize: int  # bytes on the device
    is_float: bool
    torch_dtype: torch.dtype


INFO: dict[str, DTypeInfo] = {
    bool_: DTypeInfo(bool_, np.uint8, 1, False, torch.bool),
    int8: DTypeInfo(int8, np.int8, 1, False, torch.int8),
    int16: DTypeInfo(int16, np.int16, 2, False, torch.int16),
    int32: DTypeInfo(int32, np.int32, 4, False, torch.int32),
    uint8: DTypeInfo(uint8, np.uint8, 1, False, torch.uint8),
    uint16: DTypeInfo(uint16, np.uint16, 2, False, torch.uint16),
    uint32: DTypeInfo(uint32, np.uint32, 4, False, torch.uint32),
    float16: DTypeInfo(float16, np.float32, 2, True, torch.float16),
    float32: DTypeInfo(float32, np.float32, 4, True, torch.float32),
    bfloat16: DTypeInfo(bfloat16, np.float32, 2, True, torch.bfloat16),
    tfloat32: DTypeInfo(tfloat32, np.float32, 4, True, torch.float32),
    float8_e4m3: DTypeInfo(float8_e4m3, np.float32, 1, True, torch.float8_e4m3fn),
    float8_e4m3fn: DTypeInfo(float8_e4m3fn, np.float32, 1, True, torch.float8_e4m3fn),
    float8_e5m2: DTypeInfo(float8_e5m2, np.float32, 1, True, torch.float8_e5m2),
}

# torch dtype -> NKI dtype name (float8_e4m3fn maps to the name kernels use, float8_e4m3).
_FROM_TORCH: dict[torch.dtype, str] = {
    torch.bool: bool_,
    torch.int8: int8,
    torch.int16: int16,
    torch.int32: int32,
    torch.uint8: uint8,
    torch.uint16: uint16,
    torch.uint32: uint32,
    torch.float16: float16,
    torch.float32: float32,
    torch.bfloat16: bfloat16,
    torch.float8_e4m3fn: float8_e4m3,
    torch.float8_e5m2: float8_e5m2,
}

_FROM_NUMPY: dict[np.dtype, str] = {
    np.dtype(np.bool_): bool_,
    np.dtype(np.int8): int8,
    np.dtype(np.int16): int16,
    np.dtype(np.int32): int32,
    np.dtype(np.uint8): uint8,
    np.dtype(np.uint16): uint16,
    np.dtype(np.uint32): uint32,
    np.dtype(np.float16): float16,
    np.dtype(np.float32): float32,
}

_INT_RANGE = {
    bool_: (0, 1),
    int8: (-(2**7), 2**7 - 1),
    int16: (-(2**15), 2**15 - 1),
    int32: (-(2**31), 2**31 - 1),
    uint8: (0, 2**8 - 1),
    uint16: (0, 2**16 - 1),
    uint32: (0, 2**32 - 1),
}


def round_fp8_e4m3_target(values) -> np.ndarray:
    """fp32 values rounded into the target's float8_e4m3 (trn2: IEEE-style e4m3, largest finite 240; below 240
    its values are those of OCP e4m3fn, so the rounding is e4m3fn's). A value that rounds beyond 240 is refused:
    the documents do not say whether the hardware saturates or overflows to inf."""
    x = np.asarray(values, dtype=np.float32)
    r = _round_torch(x, torch.float8_e4m3fn)
    over = np.isfinite(x) & (np.abs(r) > tg.FP8_E4M3_MAX)
    if over.any():
        v = float(x[over].reshape(-1)[0])
        raise NkiSimError(
            f"float8_e4m3 overflow: {v:g} rounds beyond {tg.FP8_E4M3_MAX:g}, the largest float8_e4m3 value on "
            f"{tg.TARGET} (OCP e4m3fn's 448 exists only from NeuronCore-v4); scale the values first"
        )
    return r


def normalize(dtype, what: str = "dtype") -> str:
    """An NKI dtype name for ``dtype`` (an nl dtype string, a torch dtype or a numpy dtype)."""
    if dtype == float8_e4m3fn:
        raise NkiSimError(f"{what}: float8_e4m3fn exists only from NeuronCore-v4 (trn3); the target is {tg.TARGET}, "
                          "whose fp8 is float8_e4m3 (largest 240)")
    if isinstance(dtype, str) and dtype in INFO:
        return dtype
    if isinstance(dtype, torch.dtype):
        if dtype in _FROM_TORCH:
            return _FROM_TORCH[dtype]
    else:
        try:
            nd = np.dtype(dtype)
        except TypeError:
            nd = None
        if nd is not None and nd in _FROM_NUMPY:
            return _FROM_NUMPY[nd]
    raise NkiSimError(f"{what}: unsupported NKI dtype {dtype!r} (supported: {', '.join(sorted(INFO))})")


def info(dtype: str) -> DTypeInfo:
    return INFO[dtype]


def is_float(dtype: str) -> bool:
    return INFO[dtype].is_float


def storage_type(dtype: str) -> type:
    return INFO[dtype].storage


def _round_mantissa(x: np.ndarray, drop_bits: int) -> np.ndarray:
    """Round float32 values to ``23 - drop_bits`` mantissa bits, nearest-even, keeping NaN a NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    lsb = (u >> np.uint32(drop_bits)) & np.uint32(1)
    bias = np.uint32((1 << (drop_bits - 1)) - 1) + lsb
    mask = np.uint32((0xFFFFFFFF >> drop_bits) << drop_bits)
    r = ((u + bias) & mask).view(np.float32)
    nan = np.isnan(x)
    if nan.any():
        r = np.where(nan, np.float32(np.nan), r)
    return r


def _round_torch(x: np.ndarray, tdtype: torch.dtype) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return t.to(tdtype).to(torch.float32).numpy()


def round_to(values, dtype: str, src_dtype: str | None = None) -> np.ndarray:
    """``values`` (engine results, float32 or integer) converted into the storage of ``dtype``.

    Floats round to nearest-even into the dtype; integer dtypes round to nearest and saturate.
    ``src_dtype`` equal to ``dtype`` skips the rounding (the values are already representable).
    """
    values = np.asarray(values)
    if dtype == float32 or (src_dtype == dtype and INFO[dtype].is_float):
        return values.astype(np.float32, copy=False)
    if dtype == bfloat16:
        return _round_mantissa(values, 16)
    if dtype == tfloat32:
        return _round_mantissa(values, 13)
    if dtype == float16:
        with np.errstate(over="ignore"):
            return values.astype(np.float32, copy=False).astype(np.float16).astype(np.float32)
    if dtype == float8_e4m3:
        return round_fp8_e4m3_target(values)
    if dtype == float8_e5m2:
        return _round_torch(values, torch.float8_e5m2)
    st = INFO[dtype].storage
    if src_dtype == dtype:
        return values.astype(st, copy=False)
    lo, hi = _INT_RANGE[dtype]
    if dtype == bool_:
        return (values != 0).astype(st)
    if np.issubdtype(values.dtype, np.integer):
        return np.clip(values, lo, hi).astype(st)
    with np.errstate(invalid="ignore"):
        return np.clip(np.rint(values.astype(np.float64)), lo, hi).astype(st)


def from_torch(t: torch.Tensor, what: str) -> tuple[np.ndarray, str]:
    """A torch tensor as (numpy storage, NKI dtype name)."""
    if t.dtype not in _FROM_TORCH:
        raise NkiSimError(
            f"{what}: torch dtype {t.dtype} has no NKI counterpart "
            f"(supported: {', '.join(str(d) for d in _FROM_TORCH)}); convert it before calling the kernel"
        )
    name = _FROM_TORCH[t.dtype]
    src = t.detach().cpu()
    if INFO[name].is_float:
        arr = src.to(torch.float32).numpy().copy()
    elif name == bool_:
        arr = src.to(torch.uint8).numpy().copy()
    else:
        arr = src.numpy().copy()
    return arr, name


def from_numpy(a: np.ndarray, what: str) -> tuple[np.ndarray, str]:
    """A numpy array as (numpy storage, NKI dtype name)."""
    if a.dtype not in _FROM_NUMPY:
        raise NkiSimError(
            f"{what}: numpy dtype {a.dtype} has no NKI counterpart (supported: "
            f"{', '.join(str(d) for d in _FROM_NUMPY)}); pass a torch tensor for bf16/fp8 data"
        )
    name = _FROM_NUMPY[a.dtype]
    arr = np.array(a, dtype=INFO[name].storage, copy=True)
    return arr, name


def to_torch(arr: np.ndarray, dtype: str) -> torch.Tensor:
    """Storage values of ``dtype`` as a torch tensor of the matching torch dtype."""
    t = torch.from_numpy(np.ascontiguousarray(arr).copy())
    return t.to(INFO[dtype].torch_dtype)


def promote(a: str, b: str) -> str:
    """The result dtype of a binary nl.* op on tiles of dtypes ``a`` and ``b`` (wider float wins)."""
    if a == b:
        return a
    fa, fb = INFO[a].is_float, INFO[b].is_float
    if fa != fb:
        return a if fa else b
    if INFO[b].itemsize > INFO[a].itemsize:
        return b
    return a
