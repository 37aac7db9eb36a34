"""A weight as the GEMMs take it (`mhcrun.ops.qlinear`): its stored values, its scale and its block, one object.

The format follows from the dtype of `data` (the release's formats, see `weights.stored_format`):
- "fp8":   float8_e4m3fn [out, in]; scale [ceil(out/block), ceil(in/block)], one per block x block tile (128
           released, 32 in the tiny test model).
- "fp4":   int8/uint8 [out, in/2], two e2m1 codes a byte, low nibble first; scale [out, ceil(in/block)], one per
           `block` inputs of a row (FP4_BLOCK).
- "float": any float dtype [out, in]; no scale, no block.
Scales: float8_e8m0fnu, its raw bytes as uint8 (inductor cannot take e8m0 graph inputs on CPU), or fp32.

`checked()` validates all of this once, when the weight is loaded, and decides there whether the fused CPU kernel
(`mhcrun.ops.qgemv`) can take it: a format it covers, contiguous, and every scale finite and small enough that
no dequantised value overflows (scanned by scan.cpp when `checked` is given its library, `scan.open_scan`). The
GEMMs dispatch on the object and never check it again. `share` cuts a rank's rows or columns (`--tp`), its scale
with it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple

import torch
from torch import Tensor

from mhcrun.ops.quant import FP4_BLOCK
from mhcrun.ops.scan import first_bad
from mhcrun.parallel import Shard

FORMATS = ("fp8", "fp4", "float")
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8, torch.float32)


def format_of(dtype: torch.dtype) -> str:
    """The weight format stored as `dtype`."""
    if dtype == torch.float8_e4m3fn:
        return "fp8"
    if dtype in (torch.int8, torch.uint8):
        return "fp4"
    if dtype.is_floating_point:
        return "float"
    raise ValueError(f"no weight format is stored as {dtype}")


class Operands(NamedTuple):
    """A weight as the fused CPU kernel's entry points take it (`QWeight.operands`)."""

    fmt: int  # its format's index in FORMATS
    data: int  # the address of its bytes
    scale: int | None  # the address of its scales (contiguous), None for a float weight
    fp32_scale: int  # 1: fp32 scales, 0: e8m0 bytes (or none)
    out_features: int
    in_features: int
    held: Tensor | None  # the contiguous scales whose address `scale` is (a copy where the scale is not contiguous)


@dataclass(eq=False)
class QWeight:
    """A 2-D weight in its stored format (module docstring); `[..., out, in']` stacks of them where a GEMM takes
    gathered experts. Make it with `checked()`; the plain constructor is for graphs rebuilding a checked one."""

    data: Tensor
    scale: Tensor | None = None
    block: int = 0
    kernel: bool = False  # the fused CPU kernel takes it (decided by checked(), once)
    nan_free: bool | None = None  # fp8: no NaN codes, learnt by the torch decoders' first full pass (None: unknown)

    @property
    def fmt(self) -> str:
        return format_of(self.data.dtype)

    @property
    def out_features(self) -> int:
        return self.data.shape[-2]

    @property
    def in_features(self) -> int:
        return self.data.shape[-1] * (2 if self.fmt == "fp4" else 1)

    @cached_property
    def operands(self) -> Operands:
        """What the fused CPU kernel's calls read, worked out once (eager calls only: a graph never asks): the bytes
        stay where they are while this weight holds them, and a scale that is not contiguous is copied once, here."""
        scale = self.scale
        if scale is not None:
            scale = (scale if scale.dtype == torch.float32 else scale.view(torch.uint8)).contiguous()
        return Operands(FORMATS.index(self.fmt), self.data.data_ptr(), None if scale is None else scale.data_ptr(),
                        int(scale is not None and scale.dtype == torch.float32), self.out_features, self.in_features,
                        scale)

    @property
    def parts(self) -> list[Tensor]:
        """The tensors holding its bytes: data, then the scale where it has one."""
        return [self.data] + ([] if self.scale is None else [self.scale])

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, columns) of weight values that share one scale."""
        return (self.block, self.block) if self.fmt == "fp8" else (1, self.block)

    def checked(self, what: str = "weight", scan: ctypes.CDLL | None = None) -> QWeight:
        """This weight, validated (ValueError naming `what` otherwise), with `kernel` decided; its scales scanned
        by `scan` (scan.cpp's library), or by the torch reference without one."""
        fmt, data, scale = self.fmt, self.data, self.scale
        if data.dim() != 2:
            raise ValueError(f"{what}: expected a 2-D weight, got shape {list(data.shape)}")
        if fmt == "float":
            if scale is not None:
                raise ValueError(f"{what}: a float weight takes no scale")
            return replace(self, block=0, kernel=data.dtype == torch.bfloat16 and kernel_layout(data))
        block = self.block or (FP4_BLOCK if fmt == "fp4" else 0)
        if block <= 0:
            raise ValueError(f"{what}: {fmt} needs a positive block, got {self.block}")
        if scale is None:
            raise ValueError(f"{what}: {fmt} weight needs a scale")
        if scale.dtype not in _SCALE_DTYPES:
            raise ValueError(f"{what}: scale dtype {scale.dtype}, expected one of e8m0, uint8 (e8m0 bytes), fp32")
        w = replace(self, block=block)
        br, bc = w.grid
        want = (-(-w.out_features // br), -(-w.in_features // bc))
        if tuple(scale.shape) != want:
            raise ValueError(f"{what}: {fmt} scale shape {list(scale.shape)}, expected {list(want)} for a weight "
                             f"[{w.out_features}, {w.in_features}] (block {block})")
        w.kernel = kernel_layout(data) and (fmt == "fp8" or block % 2 == 0) and scales_in_range(scale, fmt, scan)
        return w

    def share(self, split: int | None, tp: Shard) -> QWeight:
        """This rank's rows (split 0) or columns (split 1), the scale's with them (blocks a split must not cut:
        `checkpoint` refuses such a plan). Check the result again."""
        if split is None or tp.world == 1:
            return self
        scale = None if self.scale is None else tp.take(self.scale, split)
        return QWeight(tp.take(self.data, split), scale, self.block)

    def to(self, device: torch.device | str) -> QWeight:
        """On `device` (the fused kernel is the CPU's)."""
        device = torch.device(device)
        if self.data.device == device:
            return self
        scale = None if self.scale is None else self.scale.to(device)
        return replace(self, data=self.data.to(device), scale=scale, kernel=self.kernel and device.type == "cpu")

    def graph_scale(self) -> Tensor | None:
        """The scale as a graph input: e8m0 as its raw bytes (inductor cannot take float8_e8m0fnu inputs on CPU)."""
        s = self.scale
        return s.view(torch.uint8) if s is not None and s.dtype == torch.float8_e8m0fnu else s


def kernel_layout(data: Tensor) -> bool:
    return data.device.type == "cpu" and data.is_contiguous()


def scales_in_range(scale: Tensor, fmt: str, scan: ctypes.CDLL | None = None) -> bool:
    """Every scale finite and small enough that the format's largest value times it stays finite (the fused
    kernel sums a tile before scaling it, so it could not reproduce an overflow or a non-finite scale): the
    rule `--check-weights` applies to scales (`mhcrun.ops.scan`)."""
    if scale.dtype == torch.uint8:  # e8m0 as its raw bytes
        scale = scale.view(torch.float8_e8m0fnu)
    return first_bad(scale, "scale", fmt, lib=scan) < 0
