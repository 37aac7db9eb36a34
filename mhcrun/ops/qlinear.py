"""Linear layers over weights that stay quantised in memory: the GEMM dequantises block by block as it goes.

A weight is a `QWeight` (`mhcrun.ops.qweight`: data, scale, block; its format, fp8 / fp4 / float, follows from
the data's dtype), checked once when loaded. `qlinear` and `qlinear_grouped` both go through one dispatch,
`matmul`, which picks the path below from the weight, the number of rows of x and where it runs.

The values are exactly those of `quant.dequantize_fp8` / `quant.dequantize_fp4` (fp8 / e2m1 values times the
block scale: one rounding, the same as the reference's), and the GEMM accumulates in fp32.

CPU eager path: with at most `qgemv.MAX_ROWS` rows of x (decode), the fused kernel of `mhcrun.ops.qgemv` (C++,
AVX-512 or AVX2, opened once per run and passed in as `cpu`, a `qgemv.CpuKernel`) reads each weight byte once and
decodes it in registers; with more rows (a prefill chunk) and the kernel in avx512bf16, an FP8/FP4 weight whose
x qualifies (as the FP8 activation rounding leaves it) is multiplied by bf16 panels (`CpuKernel.qgemm`: each 32
output rows decoded once, BF16 dot products, fp32 sums); where neither applies (prefill otherwise, the kernel
off: no compiler, neither instruction set, MHCRUN_CPU_KERNEL=0 or no run opened it; scales that could overflow),
the torch chunk decoders are the path (and
the reference the kernel is tested against): the output rows are taken in chunks of about `CHUNK_BYTES` of fp32;
each chunk is decoded with integer bit tricks (much faster than torch's fp8 -> fp32 cast) into a small buffer that
stays in cache and multiplied right away (`F.linear` on the chunk), so no fp32 copy of the weight is ever made.
For fp8 with few rows of x, a chunk inside one block row leaves its values unscaled and x takes the per-column
scales instead (exact for power-of-two scales, see `_RowDecoder.x_fold_ok`). Under `torch.compile`
(`torch.compiler.is_compiling()`) on CPU, a decode GEMV takes the kernel as an opaque custom op (`mhcrun::qgemv`;
routed experts `mhcrun::qgemv_expert_set`, reading them in place through their addresses, a `qgemv.ExpertSet`)
where it applies, the kernel fixed into the graph as plain arguments; else (at most FUSED_MAX_ROWS rows of x) it
is written as a reduction with the dequantisation inside it (`gemv_fused`), which inductor turns into one loop
that reads each weight byte once; anything else dequantises the whole weight with plain tensor ops (`dequantize`)
and multiplies once. No Python loops or data-dependent control flow in graphs. On CUDA the whole-tensor path is
used, except fp8 with activation quantisation when the run asks for it (MHCRUN_SCALED_MM=1: `scaled_mm`), which
takes cuBLASLt's FP8 GEMM with DeepSeek's block scales (`_scaled_mm_fp8`).

Decoders (`decode`, and the chunk kernels under it):
- e4m3: the byte as int8 -> int32 (sign-extends), << 20, & 0x87F00000 is the fp32 whose value is the e4m3
  value times 2**-120, for normals and subnormals alike (e4m3 subnormals land on fp32 subnormals). The 2**120
  is folded into the block scale (scale * 2**120; for e8m0 scales straight from the bytes); when that would
  overflow (scales above 2**7) the chunk is first multiplied by 2**120 (exact) and then by the scale. NaN codes
  (0x7F / 0xFF) would decode to +-480 * scale, so chunks are checked (two int8 max reductions) and NaNs written
  where they occur; a weight found NaN-free over a whole pass is remembered (`QWeight.nan_free`) and not checked
  again.
- e2m1: each byte -> an int32 holding two bf16 bit patterns (low half = low nibble): with t the byte
  (0..255), mag = t * (2**5 + 2**17) and sign = (t & 0x88) * (2**11 + 2**23) put every field one bit below
  its place without overlaps or overflow; ((mag | sign) & 0x40E040E0) << 1 is then the bf16 pair whose values
  are the e2m1 values times 2**-126. Converted to fp32 (exact) and multiplied by scale * 2**126 (folded as
  for fp8, unfolded above 2**1).
Subnormal fp32 intermediates need the CPU's denormal support on (the default; `torch.set_flush_denormal(True)`
would zero them): `denormals_ok` checks this and falls back to the reference dequantisation when it is off.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mhcrun.ops.qgemv import KERNEL_OFF, CpuKernel, ExpertSet, expert_set_shape, qgemv_shape
from mhcrun.ops.quant import ACT_FP8_BLOCK as ACT_BLOCK
from mhcrun.ops.quant import (
    E4M3_BITS,
    E4M3_UNSCALE_LOG2,
    denormals_ok,
    e4m3_unscaled_,
    fp8_simulate,
    has_e4m3_nan,
    quantize_act_fp8,
    scale_tiles,
    scale_to_float,
    unpack_fp4,
)
from mhcrun.ops.qweight import QWeight

# fp32 bytes of one dequantised chunk of rows. Each chunk costs ~10 torch ops, whose dispatch overhead dominates
# small chunks: on a 2-core EPYC VM (1 MiB L2 a core, 32 MiB L3) 2-4 MiB beat 1 MiB by 1.3-1.5x for GEMVs
# (benchmarks/bench_qgemm.py --chunks); the chunk and its temporaries stay in L3.
CHUNK_BYTES = 4 << 20
CHUNK_SPANS_BLOCKS = False  # fp8: chunks of at most one block row (so x can take the scales) unless tiny

_E2M1_MAG = (1 << 5) + (1 << 17)  # t * this: low nibble's magnitude bits at 5..7, high nibble's at 21..23
_E2M1_SGN = (1 << 11) + (1 << 23)  # (t & 0x88) * this: sign bits 3 / 7 at 14 / 30
_E2M1_KEEP = 0x40E040E0  # the fields above; << 1 then makes two bf16 patterns
_E2M1_UNSCALE_LOG2 = 126  # those bf16 values == e2m1 value * 2**-126


# ---------------------------------------------------------------- whole-tensor dequantisation (graph-safe)


def dequantize_reference(w: QWeight) -> Tensor:
    """The weight as fp32 [..., out, in] in plain tensor math (static shapes: graph-safe)."""
    if w.fmt == "float":
        return w.data.float()
    br, bc = w.grid
    values = w.data.float() if w.fmt == "fp8" else unpack_fp4(w.data)
    return scale_tiles(values, scale_to_float(w.scale), br, bc)


def dequantize(w: QWeight, cpu: CpuKernel = KERNEL_OFF) -> Tensor:
    """The weight as fp32 [..., out, in], bitwise equal to quant.dequantize_fp8 / dequantize_fp4 (per matrix).

    Takes leading batch dims (data [..., out, in'] with scale [..., sr, sc], e.g. gathered experts
    [B, k, out, in/2]). Under torch.compile, or off the CPU, it is plain tensor math with static shapes (no
    .item(), no data-dependent branches); in CPU eager mode it runs the fast decoders matrix by matrix (`decode`,
    the kernel's C++ pass where `cpu` takes the weight).
    """
    if w.fmt == "float" or torch.compiler.is_compiling() or w.data.device.type != "cpu" or not denormals_ok():
        return dequantize_reference(w)
    data, scale = w.data, w.scale
    out = torch.empty(*data.shape[:-2], w.out_features, w.in_features, dtype=torch.float32)
    flat_d = data.reshape(-1, *data.shape[-2:])
    flat_s = scale.reshape(-1, *scale.shape[-2:])
    flat_o = out.view(-1, *out.shape[-2:])
    for i in range(flat_d.shape[0]):
        decode(QWeight(flat_d[i], flat_s[i], w.block, nan_free=w.nan_free), out=flat_o[i], cpu=cpu)
    return out


# decode GEMVs inside compiled graphs: at most this many rows of x take the fused reduction (below)
FUSED_MAX_ROWS = 8


def fused_fits(w: QWeight, rows: int) -> bool:
    """Whether `gemv_fused` applies: a CPU graph, few rows of x, whole tiles (fp8) / whole groups (fp4)."""
    if not torch.compiler.is_compiling() or w.data.device.type != "cpu" or rows > FUSED_MAX_ROWS:
        return False
    n, k, block = w.out_features, w.in_features, w.block
    if w.fmt == "fp8":
        return n % block == 0 and k % block == 0
    if w.fmt == "fp4":
        return k % block == 0 and block % 2 == 0
    return True


def gemv_fused(x: Tensor, w: QWeight) -> Tensor:
    """y [..., out] = sum_k x [..., 1, in] * W [..., out, in] in fp32, the dequantisation written into the
    reduction so that a compiler (inductor) emits one loop reading each weight byte once.

    For compiled decode (few rows of x): inductor turns a whole-tensor dequantise + matmul into a full fp32
    copy of the weight per call, several times slower than this. x broadcasts against data's leading dims
    (x [M, 1, in] with data [out, in'] -> [M, out]; x [B, 1, 1, in] with gathered data [B, k, out, in'] ->
    [B, k, out]). Same values as dequantise-then-matmul; the fp32 summation order is the compiler's.
    """
    data, fmt, block = w.data, w.fmt, w.block
    if fmt == "float":
        return (data.float() * x).sum(-1)
    n, k = w.out_features, w.in_features
    s = scale_to_float(w.scale)
    if fmt == "fp8":  # e4m3 byte -> fp32 holding value * 2**-120 (module docstring), rescaled exactly
        bits = (data.view(torch.int8).to(torch.int32) << 20) & E4M3_BITS
        v = bits.view(torch.float32) * 2.0**E4M3_UNSCALE_LOG2
        v = v.unflatten(-1, (k // block, block)).unflatten(-3, (n // block, block))  # [..., n/b, b, k/b, b]
        v = (v * s[..., :, None, :, None]).flatten(-4, -3).flatten(-2, -1)
        return (v * x).sum(-1)
    g = block  # e2m1: low and high nibbles -> fp32 holding value * 2**-126, rescaled exactly
    t = data.view(torch.int8).to(torch.int32)
    lo, hi = t & 15, (t >> 4) & 15
    vlo = (((lo & 7) << 22) | ((lo & 8) << 28)).view(torch.float32) * 2.0**126  # [..., n, k/2]
    vhi = (((hi & 7) << 22) | ((hi & 8) << 28)).view(torch.float32) * 2.0**126
    xp = x.unflatten(-1, (k // 2, 2))
    xe = xp[..., 0].unflatten(-1, (k // g, g // 2))  # [..., 1, groups, g/2]: the even inputs
    xo = xp[..., 1].unflatten(-1, (k // g, g // 2))
    prod = vlo.unflatten(-1, (k // g, g // 2)) * xe + vhi.unflatten(-1, (k // g, g // 2)) * xo
    return (prod * s[..., None]).flatten(-2, -1).sum(-1)


# ---------------------------------------------------------------- fast CPU decoders (chunk kernels)


def _folded_scales(scale: Tensor, unscale_log2: int) -> tuple[Tensor, float | None]:
    """_fold(scale as fp32, 2**unscale_log2), for e8m0 scales straight from the bytes when no byte overflows:
    2**(b - 127) * 2**k is the fp32 with exponent field b - 127 + k + 127 (b = 0, 2**-127, included)."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        b = scale.view(torch.uint8)
        if b.numel() and int(b.max()) + unscale_log2 <= 254:
            bits = b.to(torch.int32)
            bits.add_(unscale_log2).bitwise_left_shift_(23)
            return bits.view(torch.float32), None
    return _fold(scale_to_float(scale), 2.0**unscale_log2)


def _fold(s: Tensor, unscale: float) -> tuple[Tensor, float | None]:
    """(factor, pre): chunk values v * unscale * s == (v * pre) * factor, with one rounding either way.

    s * unscale is exact unless it overflows; then the chunk is multiplied by `unscale` first (exact: it gives
    the format's plain values) and by s after. Non-finite scales stay as they are (inf and NaN propagate the same).
    """
    f = s * unscale
    if bool((torch.isinf(f) & torch.isfinite(s)).any()):
        return s, unscale
    return f, None


def _scale_groups_(v: Tensor, f: Tensor, bc: int) -> None:
    """v [r, C] *= f [r, sc], each scale over a group of bc columns of its row (the last group may be partial)."""
    r, c = v.shape
    full = c // bc
    if full:
        head = v if full * bc == c else v[:, : full * bc]
        head.view(r, full, bc).mul_(f[:, :full, None])
    if full * bc < c:
        v[:, full * bc:].mul_(f[:, full:full + 1])


def _scale_tiles_(v: Tensor, fcol: Tensor, r0: int, br: int) -> None:
    """Rows [r0, r0 + r) of a weight, decoded into v [r, C], times fcol [sr, C] (tile scales spread per column)."""
    r, c = v.shape
    if r0 % br == 0 and r % br == 0:
        nb = r // br
        v.view(nb, br, c).mul_(fcol[r0 // br: r0 // br + nb, None, :])
        return
    a = 0
    while a < r:  # a chunk that starts or ends inside a row block: one segment per block row
        j = (r0 + a) // br
        b = min(r, (j + 1) * br - r0)
        v[a:b].mul_(fcol[j])
        a = b


def _fp8_chunk(codes: Tensor, fcol: Tensor, pre: float | None, r0: int, block: int, dst: Tensor,
               check_nan: bool = True, scaled: bool = True) -> bool:
    """codes int8 [r, C] (rows r0.. of an e4m3 weight) -> dst fp32 [r, C] (contiguous), dequantised.

    fcol: [ceil(out/block), C] fp32, the (folded) tile scales spread per column; scaled=False leaves the values
    at e4m3 value * 2**-120 (the caller scales x instead). Returns whether NaN codes were found (and written as
    NaN); with check_nan=False the caller knows there are none.
    """
    e4m3_unscaled_(dst, codes)
    if scaled:
        if pre is not None:
            dst.mul_(pre)
        _scale_tiles_(dst, fcol, r0, block)
    if check_nan and has_e4m3_nan(codes):
        dst.masked_fill_(codes.bitwise_and(0x7F) == 0x7F, math.nan)
        return True
    return False


def _fp4_chunk(packed: Tensor, f: Tensor, pre: float | None, group: int, dst: Tensor, t: Tensor,
               u: Tensor) -> None:
    """packed int8/uint8 [r, C/2] -> dst fp32 [r, C]; f [r, ceil(C/group)] its rows' (folded) scales;
    t, u: int32 [r, C/2] scratch."""
    t.copy_(packed.view(torch.uint8))  # 0..255
    torch.mul(t, _E2M1_MAG, out=u)
    t.bitwise_and_(0x88)
    t.mul_(_E2M1_SGN)
    t.bitwise_or_(u)
    t.bitwise_and_(_E2M1_KEEP)
    t.bitwise_left_shift_(1)
    dst.copy_(t.view(torch.bfloat16))  # [r, C/2] int32 == [r, C] bf16, low half first
    if pre is not None:
        dst.mul_(pre)
    _scale_groups_(dst, f, group)


def _chunk_rows(n_out: int, n_in: int, row_block: int) -> int:
    """Rows per chunk: about CHUNK_BYTES of fp32; a multiple of row_block, or a divisor of it when smaller."""
    rows = max(1, CHUNK_BYTES // (4 * max(n_in, 1)))
    if row_block > 1 and rows > row_block and 16 * row_block * n_in >= CHUNK_BYTES and not CHUNK_SPANS_BLOCKS:
        rows = row_block  # one block row, unless that is under a quarter of CHUNK_BYTES
    if row_block > 1:
        if rows >= row_block:
            rows -= rows % row_block
        else:
            while row_block % rows:
                rows -= 1
    return max(1, min(rows, n_out))


class _RowDecoder:
    """Decodes row ranges of one 2-D weight into fp32 (CPU eager only): `rows(r0, r1, dst)`; `done()` after a
    pass over all rows."""

    def __init__(self, w: QWeight, max_rows: int, cpu: CpuKernel):
        self.w, self.data, self.fmt, self.cpu = w, w.data, w.fmt, cpu
        self.n_in, self.group, self.max_rows = w.in_features, w.block, max_rows
        self.native = self.fmt != "float" and cpu.decodes(w)  # one C++ pass a chunk (CpuKernel.decode_rows)
        self.seen_nan = self.mixed = False
        if self.fmt != "float" and not self.native:
            self.prepare_torch()

    def prepare_torch(self) -> None:
        """The torch chunk decoders' folded scales and scratch (only where the C++ pass does not decode)."""
        self.native = False
        data, scale, block = self.w.data, self.w.scale, self.w.block
        self.f, self.pre = _folded_scales(scale, E4M3_UNSCALE_LOG2 if self.fmt == "fp8" else _E2M1_UNSCALE_LOG2)
        if self.fmt == "fp8":
            self.codes = data.view(torch.int8)
            self.fcol = self.f.repeat_interleave(block, dim=1)[:, : self.n_in].contiguous()
            fa = self.f.abs()
            pow2 = scale.dtype in (torch.float8_e8m0fnu, torch.uint8) or bool((torch.frexp(fa)[0] == 0.5).all())
            self.x_fold_range = (float(fa.min()), float(fa.max())) if pow2 and self.pre is None else None
        else:
            half = data.shape[1]
            self.t = torch.empty(self.max_rows, half, dtype=torch.int32)
            self.u = torch.empty(self.max_rows, half, dtype=torch.int32)

    def x_fold_ok(self, x2: Tensor) -> bool:
        """Whether y = (x * f_col) @ v^T, with v the unscaled fp8 values, is the same product as x @ (v * f)^T:
        power-of-two (folded) scales and every x * f finite and 0 or normal, so that x * f is exact and each
        product x * f * v is the same real number, rounded once either way."""
        if self.fmt != "fp8" or self.native or self.x_fold_range is None:  # the C++ pass scales at no cost
            return False
        fmin, fmax = self.x_fold_range
        ax = x2.abs()
        xmax = float(ax.max())
        if not math.isfinite(xmax) or xmax * fmax >= 2.0**127:
            return False
        nz = ax[ax > 0]
        return nz.numel() == 0 or float(nz.min()) * fmin >= 2.0**-126

    def rows(self, r0: int, r1: int, dst: Tensor, scaled: bool = True) -> Tensor:
        r = r1 - r0
        if self.fmt == "float":
            dst.copy_(self.data[r0:r1])
        elif self.native and scaled and self.cpu.decode_rows(self.w, r0, r1, dst):
            pass
        elif self.native:  # unscaled values asked for, or a thread flushes subnormals: torch from here on
            self.prepare_torch()
            self.mixed = True  # this pass did not look at every row for NaN codes
            return self.rows(r0, r1, dst, scaled)
        elif self.fmt == "fp8":
            found = _fp8_chunk(self.codes[r0:r1], self.fcol, self.pre, r0, self.group, dst,
                               check_nan=not self.w.nan_free, scaled=scaled)
            self.seen_nan |= found
        else:
            _fp4_chunk(self.data[r0:r1], self.f[r0:r1], self.pre, self.group, dst, self.t[:r], self.u[:r])
        return dst

    def done(self) -> None:
        """After a pass over every row: an fp8 weight found free of NaN codes is not looked at again."""
        if self.fmt == "fp8" and self.w.nan_free is None and not self.native and not self.mixed:
            self.w.nan_free = not self.seen_nan


def decode(w: QWeight, out: Tensor | None = None, cpu: CpuKernel = KERNEL_OFF) -> Tensor:
    """Fast exact CPU dequantisation of a 2-D fp8 / fp4 weight -> fp32 [out, in], bitwise equal to
    quant.dequantize_fp8 / dequantize_fp4 (NaN codes give NaN): the kernel's C++ pass where `cpu` takes the weight,
    else the torch chunk decoders. `out`: an optional contiguous fp32 destination."""
    n_out, n_in = w.out_features, w.in_features
    if out is None:
        out = torch.empty(n_out, n_in, dtype=torch.float32)
    elif out.shape != (n_out, n_in) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 [{n_out}, {n_in}] tensor")
    if out.numel() == 0:
        return out
    if w.data.device.type != "cpu" or not denormals_ok():
        out.copy_(dequantize_reference(w))
        return out
    rows = _chunk_rows(n_out, n_in, w.grid[0])
    dec = _RowDecoder(w, rows, cpu)
    for r0 in range(0, n_out, rows):
        r1 = min(n_out, r0 + rows)
        dec.rows(r0, r1, out[r0:r1])
    dec.done()
    return out


# ---------------------------------------------------------------- GEMMs


def _gemm_rows(x2: Tensor, dec: _RowDecoder, r0: int, r1: int, rows: int, buf: Tensor, y: Tensor) -> None:
    """y [M, r1 - r0] = x2 [M, in] (fp32) @ W[r0:r1]^T, decoding `rows` weight rows at a time into buf.

    fp8 with M <= rows: a chunk inside one block row has one scale per column, which is folded into x
    (x * f, M x in values) instead of the chunk (rows x in values) when that is exact (_RowDecoder.x_fold_ok).
    """
    fold = x2.shape[0] <= rows and dec.x_fold_ok(x2)
    xs, xs_row = None, -1
    for a in range(r0, r1, rows):
        b = min(r1, a + rows)
        j = a // dec.group if fold else -1
        if fold and (b - 1) // dec.group == j:
            if xs_row != j:
                xs, xs_row = x2 * dec.fcol[j], j
            w = dec.rows(a, b, buf[: b - a], scaled=False)
            y[:, a - r0: b - r0] = F.linear(xs, w)
        else:
            w = dec.rows(a, b, buf[: b - a])
            y[:, a - r0: b - r0] = F.linear(x2, w)


@torch.library.custom_op("mhcrun::qgemv", mutates_args=())
def qgemv_op(x3: Tensor, data: Tensor, scale: Tensor | None, block: int, groups: int, library: str,
             isa: int) -> Tensor:
    """_cpu_gemm as one opaque op for compiled graphs: x3 [M, G, in] fp32 -> [M, G, r] fp32 (contiguous), the
    weight (data, scale, block) one the kernel takes (`QWeight.kernel`), the kernel (library, isa) the run's
    `CpuKernel`: both fixed into the graph while tracing."""
    return _cpu_gemm(x3, QWeight(data, scale, block, kernel=True), groups, CpuKernel(library, isa)).contiguous()


qgemv_op.register_fake(qgemv_shape)


def experts_in_place(x: Tensor, s: ExpertSet, idx: Tensor, cpu: CpuKernel) -> Tensor:
    """Routed experts read in place: x [B, k or 1, in] fp32, idx [B, k] -> y [B, k, out] fp32 with y[b, j] = x[b, j or
    0] through expert idx[b, j] of the set `s`, by the kernel `cpu` in one call (`CpuKernel.experts_at`: each
    expert's rows together, all of them in one parallel region). ValueError where x or idx do not fit the set."""
    y = cpu.experts_at(s, idx, x)
    if y is None:
        raise RuntimeError("mhcrun::qgemv_expert_set: the CPU kernel declined (it is off, or this thread flushes "
                           "subnormals: torch.set_flush_denormal(True))")
    return y


@torch.library.custom_op("mhcrun::qgemv_expert_set", mutates_args=())
def qgemv_expert_set(x: Tensor, ptrs: Tensor, idx: Tensor, fmt: int, kind: int, block: int, out_features: int,
                     in_features: int, library: str, isa: int) -> Tensor:
    """`experts_in_place` as an opaque op of compiled graphs, the set by its fields, the kernel by its library and
    instruction set."""
    s = ExpertSet(ptrs, fmt, kind, block, out_features, in_features)
    return experts_in_place(x, s, idx, CpuKernel(library, isa))


qgemv_expert_set.register_fake(expert_set_shape)


def qlinear_gathered(x: Tensor, w: QWeight | ExpertSet, idx: Tensor, act_quant: bool = False,
                     cpu: CpuKernel = KERNEL_OFF) -> Tensor:
    """Each token through its k routed experts' weights, on fixed shapes: x [T, k or 1, in], idx [T, k] ->
    y [T, k, out] in x.dtype (fp32 math), w the experts' weights stacked [E, out, in'] (their scales [E, ...]) or
    an `ExpertSet` read in place by `cpu` (which must be on). act_quant as `qlinear`'s."""
    if act_quant:
        x = round_activation(x, cpu)
    xf = x.float()
    if isinstance(w, ExpertSet):  # eager calls it directly: a custom op's first call imports torch._dynamo (~1 s)
        op = torch.ops.mhcrun.qgemv_expert_set_native if cpu.ops else torch.ops.mhcrun.qgemv_expert_set
        y = (op(xf, w.ptrs, idx, w.fmt, w.kind, w.block, w.out_features, w.in_features, cpu.library, cpu.isa)
             if torch.compiler.is_compiling() else experts_in_place(xf, w, idx, cpu))
        return y.to(x.dtype)
    ew = QWeight(w.data[idx], None if w.scale is None else w.scale[idx], w.block)  # [T, k, out, in']
    if ew.fmt != "float" and fused_fits(ew, 1):  # the dequantisation fused into the reduction
        return gemv_fused(xf.unsqueeze(-2), ew).to(x.dtype)
    return torch.einsum("tkd,tkfd->tkf", xf.expand(-1, idx.size(1), -1), dequantize(ew, cpu)).to(x.dtype)


def _cpu_gemm(x3: Tensor, w: QWeight, groups: int, cpu: CpuKernel) -> Tensor:
    """CPU eager: x3 [M, G, in] fp32, the weight's rows in G groups -> y [M, G, r] fp32: the fused kernel where it
    applies, else chunk by chunk."""
    m, n_in = x3.shape[0], x3.shape[2]
    r = w.out_features // groups
    def panels() -> Tensor | None:  # a prefill chunk: bf16 panels by AMX tiles or BF16 dot products, where x qualifies
        y = cpu.qgemm(x3[:, 0], w) if groups == 1 else None
        return None if y is None else y.unsqueeze(1)

    first = cpu.gemm_first(m)  # AMX: its panels beat the GEMV from a few rows on
    fast = panels() if first else None
    if fast is None:
        fast = cpu.qgemv(x3, w, groups)  # decode sizes: the fused kernel, when it takes the weight
    if fast is None and not first:
        fast = panels()
    if fast is not None:
        return fast
    if not denormals_ok():
        return torch.einsum("mgd,grd->mgr", x3, dequantize_reference(w).view(groups, r, n_in))
    y = torch.empty(groups, m, r, dtype=torch.float32)
    if r and m:
        # the C++ pass scales as it decodes: its chunks may span fp8 block rows (wider GEMMs run faster)
        rows = _chunk_rows(r, n_in, 1 if w.fmt == "float" or cpu.decodes(w) else w.grid[0])
        dec = _RowDecoder(w, rows, cpu)
        buf = torch.empty(rows, n_in, dtype=torch.float32)
        for g in range(groups):
            _gemm_rows(x3[:, g], dec, g * r, (g + 1) * r, rows, buf, y[g])
        dec.done()
    return y.transpose(0, 1)


def matmul(xf: Tensor, w: QWeight, cpu: CpuKernel, groups: int = 1) -> Tensor:
    """The one GEMM dispatch: xf [..., G, in] fp32, the weight's rows in G groups of r -> [..., G, r] fp32.

    In a graph on CPU: the fused kernel `cpu` as an opaque op (`mhcrun::qgemv`) where it takes the weight and x
    has few rows, else (G = 1, few rows) the dequantisation fused into the reduction (`gemv_fused`), else the
    whole weight dequantised and multiplied once. Off the CPU, and for fp32 weights: dequantise (a no-op for
    fp32) and multiply. CPU eager: `_cpu_gemm` (the kernel, else the chunk decoders).
    """
    n_in, r = w.in_features, w.out_features // groups
    rows = xf.numel() // (groups * n_in)
    compiling = torch.compiler.is_compiling()
    fp32 = w.fmt == "float" and w.data.dtype == torch.float32
    if compiling and cpu.takes(w, rows):  # the C++ kernel of the op where the run loaded it (CpuKernel.ops)
        op = torch.ops.mhcrun.qgemv_native if cpu.ops else torch.ops.mhcrun.qgemv
        y = op(xf.reshape(rows, groups, n_in), w.data, w.scale, w.block, groups, cpu.library, cpu.isa)
        return y.reshape(*xf.shape[:-1], r)
    if groups == 1 and not fp32 and fused_fits(w, rows):
        return gemv_fused(xf.reshape(rows, 1, n_in), w).reshape(*xf.shape[:-1], r)
    if fp32 or compiling or w.data.device.type != "cpu":
        weight = dequantize_reference(w)
        if groups == 1:
            return F.linear(xf.squeeze(-2), weight).unsqueeze(-2)
        return torch.einsum("...gd,grd->...gr", xf, weight.view(groups, r, n_in))
    return _cpu_gemm(xf.reshape(-1, groups, n_in), w, groups, cpu).reshape(*xf.shape[:-1], r)


def qlinear(x: Tensor, w: QWeight, act_quant: bool = False, scaled_mm: ScaledMM | None = None,
            cpu: CpuKernel = KERNEL_OFF) -> Tensor:
    """y [..., out] = x [..., in] @ W^T in x.dtype (W: module docstring, `QWeight`), CPU decode GEMVs through the
    fused kernel `cpu` where it takes the weight (the run's; off by default), CUDA FP8 GEMMs through `scaled_mm`
    where given.

    act_quant: x is first rounded to FP8 in blocks of 128 along `in` with power-of-two scales
    (`fp8_simulate(x, 128, pow2_scale=True)`), as DeepSeek's act_quant before an FP8/FP4 GEMM.
    The product is computed in fp32 and cast to x.dtype, except for a "float" weight of x's dtype without
    act_quant, which is a plain F.linear in that dtype; a "float" weight of another dtype than x and fp32 is
    converted chunk by chunk, which can change the fp32 summation order.
    """
    if x.is_cpu and not torch.compiler.is_compiling():  # an eager decode step: one call, where it applies
        y = cpu.linear(x, w, ACT_BLOCK if act_quant else 0)
        if y is not None:
            return y
    if x.shape[-1] != w.in_features:
        raise ValueError(f"qlinear: x has {x.shape[-1]} features, the weight takes {w.in_features}")
    if w.fmt == "float" and not act_quant and w.data.dtype == x.dtype:
        return F.linear(x, w.data)
    if x.numel() == 0:
        return x.new_zeros(*x.shape[:-1], w.out_features)
    if act_quant:
        if w.fmt == "fp8" and x.is_cuda and scaled_mm and scaled_mm.working and not torch.compiler.is_compiling():
            y = _scaled_mm_fp8(x, w, scaled_mm)
            if y is not None:
                return y
        x = round_activation(x, cpu)
    return matmul(x.float().unsqueeze(-2), w, cpu).squeeze(-2).to(x.dtype)


def round_activation(x: Tensor, cpu: CpuKernel) -> Tensor:
    """The activation as linear(..., act_quant=True) rounds it (result in x.dtype); a CPU x takes the kernel's
    C++ version of the same rounding where the run has it (bitwise equal, one call instead of ~25 torch ops)."""
    if not torch.compiler.is_compiling():
        fast = cpu.act_quant_fp8(x, ACT_BLOCK)
        if fast is not None:
            return fast
    return fp8_simulate(x, ACT_BLOCK, pow2_scale=True)


def qlinear_grouped(x: Tensor, w: QWeight, groups: int, cpu: CpuKernel = KERNEL_OFF) -> Tensor:
    """DeepSeek's grouped low-rank output (wo_a): x [..., G, d_in], the weight's rows in G groups of r.

    y[..., g, :] = x[..., g, :] @ W[g*r:(g+1)*r, :]^T (as torch.einsum("bsgd,grd->bsgr", x, W.view(G, r, -1))),
    no activation quantisation, result in x.dtype: in x's dtype for a float weight of that dtype, else in fp32,
    through the fused kernel `cpu` where it takes the weight, else the weight dequantised group by group, chunk
    by chunk.
    """
    n_out, n_in = w.out_features, w.in_features
    if groups <= 0 or n_out % groups:
        raise ValueError(f"qlinear_grouped: {n_out} rows do not split into {groups} groups")
    if x.dim() < 2 or x.shape[-2] != groups or x.shape[-1] != n_in:
        raise ValueError(f"qlinear_grouped: x shape {list(x.shape)}, expected [..., {groups}, {n_in}]")
    if w.fmt == "float" and w.data.dtype == x.dtype:
        return torch.einsum("...gd,grd->...gr", x, w.data.view(groups, -1, n_in))
    if x.numel() == 0:
        return x.new_zeros(*x.shape[:-1], n_out // groups)
    return matmul(x.float(), w, cpu, groups).to(x.dtype)


# ---------------------------------------------------------------- CUDA: FP8 x FP8 with DeepSeek block scales

@dataclass
class ScaledMM:
    """A run's use of cuBLASLt's FP8 GEMM (`_scaled_mm_fp8`; `qlinear`'s `scaled_mm`), off for the rest of the
    run once it fails. Off unless MHCRUN_SCALED_MM=1: cuBLASLt's FP8 GEMM accumulates in another order and
    precision than the fp32 reference, and on an H200 the mid-size config's greedy tokens parted from the
    dequantised run's after 10 tokens with it (identical without it). A speed option for those who accept that,
    not the default."""

    working: bool = True


def _scaled_mm_fits(x: Tensor, w: QWeight) -> bool:
    n_out, n_in = w.data.shape
    return (w.block == 128 and n_in % 128 == 0 and n_out % 128 == 0 and x.dtype in (torch.float32, torch.bfloat16)
            and w.data.is_cuda and w.scale.is_cuda and x.numel() > 0)


def act_quant_fp8_codes(x2: Tensor) -> tuple[Tensor, Tensor]:
    """x2 [M, K] -> (codes float8_e4m3fn [M, K], scales fp32 [M, ceil(K/128)]) of DeepSeek's act_quant.

    codes.float() * scale (each scale over its 128 columns) == fp8_simulate(x2, 128, pow2_scale=True) bitwise
    (in fp32; for fp32 and bf16 x2 the cast back to x2.dtype is exact too).
    """
    return quantize_act_fp8(x2, ACT_BLOCK, pow2_scale=True)


def _scaled_mm_operands(x2: Tensor, data: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The operands of the 1x128 x 128x128 recipe, laid out as cuBLASLt wants them (see _scaled_mm_fp8)."""
    m = x2.shape[0]
    codes, sx = act_quant_fp8_codes(x2)
    pad_m = -m % 4  # the activation scales are M-major: keep their column stride 16-byte aligned
    if pad_m:
        codes = F.pad(codes.view(torch.uint8), (0, 0, 0, pad_m)).view(torch.float8_e4m3fn)
        sx = F.pad(sx, (0, 0, 0, pad_m), value=1.0)
    sa = sx.t().contiguous().t()  # [Mp, K/128], strides (1, Mp)
    sw = scale_to_float(scale)  # [N/128, K/128] fp32
    kb = sw.shape[1]
    sw = F.pad(sw, (0, -kb % 4)).contiguous()  # K blocks padded to a multiple of 4
    sb = sw.t()  # [round_up(K/128, 4), N/128], strides (1, round_up(K/128, 4))
    return codes, sa, data.t(), sb


def _scaled_mm_call(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, out_dtype: torch.dtype) -> Tensor:
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        st = F.ScalingType
        return F.scaled_mm(a, b, sa, st.BlockWise1x128, sb, st.BlockWise128x128, output_dtype=out_dtype)
    return torch._scaled_mm(a, b, sa, sb, out_dtype=out_dtype)  # older torch: recipes inferred from the shapes


def _scaled_mm_fp8(x: Tensor, w: QWeight, state: ScaledMM) -> Tensor | None:
    """qlinear(x, w, act_quant=True) for an fp8 weight of block 128 on CUDA through cuBLASLt's FP8 GEMM with DeepSeek's
    block scales (torch._scaled_mm / F.scaled_mm, ScalingType.BlockWise1x128 for the activation and
    BlockWise128x128 for the weight; SM90 with cuBLASLt >= 12.9). None when it does not apply or fails (then a
    one-time warning, and the caller dequantises instead).

    The activation's FP8 codes and power-of-two scales are exactly those of fp8_simulate(x, 128), and the weight
    is used as stored, so this is the same product as the dequantise path, summed in another order (fp32
    accumulation in the tensor cores). Layouts: activation codes [M, K] row-major with scales [M, K/128]
    M-major (M padded to a multiple of 4); weight [N, K] row-major passed as its transpose [K, N]; weight scales
    [N/128, K/128] padded along K/128 to a multiple of 4 and passed transposed. Output in x.dtype (fp32 or
    bf16: cuBLASLt rounds its fp32 accumulator once, as the reference's .to(x.dtype) does).

    Checked on one H200 (torch 2.11.0+cu130, via F.scaled_mm; tests/test_qlinear.py's CUDA tests and
    benchmarks/bench_qgemm.py --cuda): |y - reference| <= 4e-5 * (|xq| @ |W|^T) on M = 1, 37, 4096; an
    unpadded M (not a multiple of 4) was refused by cuBLASLt. Not checked on other GPUs or torch versions.
    """
    if not state.working or not _scaled_mm_fits(x, w):
        return None
    try:
        x2 = x.reshape(-1, x.shape[-1])
        a, sa, b, sb = _scaled_mm_operands(x2, w.data, w.scale)
        y = _scaled_mm_call(a, sa, b, sb, x.dtype)[: x2.shape[0]]
        return y.reshape(*x.shape[:-1], w.out_features).to(x.dtype)
    except Exception as e:  # any failure falls back to the dequantising path
        state.working = False
        warnings.warn(f"qlinear: torch._scaled_mm FP8 block-scaled GEMM unavailable ({type(e).__name__}: {e}); "
                      "dequantising instead", RuntimeWarning, stacklevel=3)
        return None
