"""Plain-torch reference ops for the V4 quantisation formats.

- FP8 e4m3 with power-of-two (ue8m0) block scales: linear weights ([B x B] tiles) and the activation
  simulation (blocks along the last dim).
- FP4 e2m1 with a power-of-two scale per 32 values along the input dim: routed experts and the indexer
  activation simulation. Two e2m1 codes per byte, low nibble first; bit 3 of a code is the sign.
- The normalised Walsh-Hadamard transform (Sylvester order).

Everything here is exact where the format allows it (no log2, no float exponent arithmetic).
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = 448.0
FP4_MAX = 6.0
FORMAT_MAX = {"fp8": FP8_MAX, "fp4": FP4_MAX}  # a weight format's largest magnitude before its scale
# block sizes of the formats (the one place they are defined)
FP4_BLOCK = 32  # FP4 e2m1 weights (routed experts): one e8m0 scale per 32 inputs
ACT_FP8_BLOCK = 128  # the FP8 activation rounding before a GEMM over FP8/FP4 weights, along K
KV_FP8_BLOCK = 64  # the FP8 simulation (and cache) of kv's non-rope channels: a scale per 64 values
INDEX_FP4_BLOCK = 32  # the FP4 simulation (and cache) of the indexer's queries and keys: a scale per 32 values

_FP8_AMAX_FLOOR = 1e-4  # activation simulation: the reference's floor on a block's amax
_E8M0_MIN = 2.0**-127
_E8M0_MAX = 2.0**127
# magnitudes of the e2m1 codes 0..7; codes 8..15 are their negatives
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def pow2_ceil(x: Tensor) -> Tensor:
    """Smallest power of two >= x, elementwise, for positive fp32 x (exact, via frexp)."""
    x = x.float()
    m, e = torch.frexp(x)  # x = m * 2**e, m in [0.5, 1)
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(x), e)


def _blocked(x: Tensor, block: int) -> tuple[Tensor, int]:
    """[..., n] fp32 -> [..., ceil(n/block), block], zero-padded (zeros never change an amax)."""
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    n = x.shape[-1]
    pad = (-n) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], (n + pad) // block, block), n


def _unblocked(x: Tensor, n: int) -> Tensor:
    """Inverse of `_blocked`: [..., nb, block] -> [..., n]."""
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])[..., :n]


def fp8_simulate(x: Tensor, block: int, pow2_scale: bool = True) -> Tensor:
    """Quantise to FP8 e4m3 and back in blocks of `block` along the last dim (last block may be partial).

    Per block: scale = max(amax, 1e-4) / 448 (rounded up to a power of two when `pow2_scale`),
    q = e4m3(clamp(x / scale, +-448)); returns q * scale in x.dtype (a new tensor).
    """
    if x.shape[-1] == 0:
        return x.clone()
    q, scale, n = _fp8_block_quant(x, block, pow2_scale)
    return _unblocked(q.float() * scale, n).to(x.dtype)


def _fp8_block_quant(x: Tensor, block: int, pow2_scale: bool) -> tuple[Tensor, Tensor, int]:
    """fp8_simulate's rounding: (e4m3 codes [..., nb, block], fp32 scales [..., nb, 1], n)."""
    xb, n = _blocked(x.float(), block)  # [..., nb, block]
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=_FP8_AMAX_FLOOR)  # [..., nb, 1]
    scale = amax / FP8_MAX
    if pow2_scale:
        scale = pow2_ceil(scale)
    q = (xb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale, n


def quantize_act_fp8(x: Tensor, block: int, pow2_scale: bool = True) -> tuple[Tensor, Tensor]:
    """The FP8 codes and scales behind fp8_simulate: (float8_e4m3fn [..., n], fp32 [..., ceil(n/block)]).

    codes.float() times the scale of each block of `block` values along the last dim equals
    fp8_simulate(x, block, pow2_scale) computed in fp32, bitwise (the same ops).
    """
    if x.shape[-1] == 0:
        return x.to(torch.float8_e4m3fn), torch.empty(*x.shape[:-1], 0, dtype=torch.float32, device=x.device)
    q, scale, n = _fp8_block_quant(x, block, pow2_scale)
    return _unblocked(q, n).contiguous(), scale[..., 0]


def round_e2m1(x: Tensor) -> Tensor:
    """Round fp32 values to the nearest e2m1 value (+-{0, .5, 1, 1.5, 2, 3, 4, 6}), saturating at 6.

    Ties go to the value whose mantissa bit is 0 (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4).
    Within each binade the grid is uniform and the mantissa bit is the parity of the grid index, so
    torch.round (half to even) on the binade's step gives exactly this rule.
    """
    x = x.float()
    a = x.abs()
    r = torch.where(
        a < 2.0,
        torch.round(a * 2.0) * 0.5,  # step 0.5 on [0, 2)
        torch.where(a < 4.0, torch.round(a), torch.round(a * 0.5) * 2.0),  # step 1 on [2, 4), 2 on [4, 6]
    )
    r = r.clamp(max=FP4_MAX)
    return torch.copysign(r, x)


def fp4_simulate(x: Tensor, block: int = INDEX_FP4_BLOCK) -> Tensor:
    """Quantise to FP4 e2m1 and back in blocks of `block` along the last dim (last block may be partial).

    Per block: scale = pow2_ceil(max(amax, 6 * 2**-126) / 6), q = round_e2m1(clamp(x / scale, +-6));
    returns q * scale in x.dtype.
    """
    if x.shape[-1] == 0:
        return x.clone()
    q, scale, n = _fp4_block_quant(x, block)
    return _unblocked(q * scale, n).to(x.dtype)


def _fp4_block_quant(x: Tensor, block: int) -> tuple[Tensor, Tensor, int]:
    """fp4_simulate's rounding: (e2m1 grid values [..., nb, block] fp32, fp32 scales [..., nb, 1], n)."""
    xb, n = _blocked(x.float(), block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_MAX * 2.0**-126)
    scale = pow2_ceil(amax / FP4_MAX)
    return round_e2m1((xb / scale).clamp(-FP4_MAX, FP4_MAX)), scale, n


def quantize_act_fp4(x: Tensor, block: int = INDEX_FP4_BLOCK) -> tuple[Tensor, Tensor]:
    """The FP4 codes and scales behind fp4_simulate: (packed uint8 [..., n/2], fp32 [..., ceil(n/block)]).

    dequantize_act(codes, scales) equals fp4_simulate(x, block) computed in fp32, bitwise (the same ops).
    """
    q, scale, n = _fp4_block_quant(x, block)
    return pack_fp4(_unblocked(q, n), check=False).view(torch.uint8), scale[..., 0]


def dequantize_act(values: Tensor, scale: Tensor, block: int) -> Tensor:
    """Codes [..., n] (float8_e4m3fn, or e2m1 values already decoded) times their block scales
    [..., ceil(n/block)] -> fp32 [..., n]: the product fp8_simulate / fp4_simulate compute."""
    vb, n = _blocked(e4m3_to_float(values) if values.dtype == torch.float8_e4m3fn else values.float(), block)
    return _unblocked(vb * scale.unsqueeze(-1), n)


# e4m3 codes by integer bit operations: the code as int8, sign-extended to int32, << 20 and & E4M3_BITS is the fp32
# whose value is the e4m3 value * 2**-E4M3_UNSCALE_LOG2, normals and subnormals alike (e4m3 subnormals land on fp32
# subnormals); NaN codes (0x7F / 0xFF) give +-480 * 2**-120 and need writing as NaN.
E4M3_BITS = 0x87F00000 - (1 << 32)  # sign bit + the 7 exponent/mantissa bits after << 20, as int32
E4M3_UNSCALE_LOG2 = 120
_SUBNORMAL = 2.0**-1060  # a float64 subnormal


def denormals_ok() -> bool:
    """Whether subnormals survive arithmetic on this thread: torch.set_flush_denormal(True) sets the CPU's
    flush-to-zero flags, which Python's own float arithmetic obeys too (no tensor made, nothing synchronised)."""
    return _SUBNORMAL * 0.5 != 0.0


def e4m3_unscaled_(dst: Tensor, codes: Tensor) -> Tensor:
    """dst fp32 <- each e4m3 code's value * 2**-120 (codes int8 or float8_e4m3fn, dst's shape; NaN codes not
    marked: see above), in place; returns dst."""
    t = dst.view(torch.int32)
    t.copy_(codes.view(torch.int8))  # sign-extends
    t.bitwise_left_shift_(20)
    t.bitwise_and_(E4M3_BITS)
    return dst


def has_e4m3_nan(codes: Tensor) -> bool:
    """Whether e4m3 codes (int8 or float8_e4m3fn) hold a NaN (0x7F or 0xFF): two max reductions, no temporaries."""
    codes = codes.view(torch.int8)
    return bool(codes.max() == 127) or bool(codes.view(torch.uint8).max() == 255)


def e4m3_to_float(codes: Tensor) -> Tensor:
    """float8_e4m3fn -> fp32, equal to codes.float(). On the CPU outside graphs by integer bit operations
    (`e4m3_unscaled_`, then * 2**120: exact), ~3x faster than torch's cast there (a KV cache read decodes every
    window entry each step); graphs compile the cast into their own loop."""
    if torch.compiler.is_compiling() or codes.device.type != "cpu" or not denormals_ok() or not codes.numel():
        return codes.float()
    codes = codes.contiguous()
    out = e4m3_unscaled_(torch.empty(codes.shape, dtype=torch.float32), codes).mul_(2.0**E4M3_UNSCALE_LOG2)
    if has_e4m3_nan(codes):
        out.masked_fill_(codes.view(torch.int8).bitwise_and(0x7F) == 0x7F, float("nan"))
    return out


def hadamard(x: Tensor) -> Tensor:
    """Normalised Walsh-Hadamard transform along the last dim n (a power of two) in Sylvester's order (H = [[H', H'],
    [H', -H']], so y[j] = sum_i (-1)**popcount(i & j) x[i] / sqrt(n)), computed in fp32 by butterflies: for h = 1, 2,
    ..., n / 2 each pair (i, i + h) of a block of 2h becomes (a + b, a - b), then the product by n**-0.5. Each output
    is one fixed tree of sums, which the CPU kernel computes in the same order (`CpuKernel.hadamard`, bitwise);
    DeepSeek's reference (fast_hadamard_transform) is a butterfly transform too."""
    n = x.shape[-1]
    if n <= 0 or n & (n - 1):
        raise ValueError(f"hadamard: last dim {n} is not a power of two")
    y, h = x.float(), 1
    while h < n:
        pairs = y.unflatten(-1, (n // (2 * h), 2, h))  # [..., blocks, 2, h]: a = [..., 0, :], b = [..., 1, :]
        a, b = pairs.unbind(-2)
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * n**-0.5).to(x.dtype)


def e8m0_to_float(t: Tensor) -> Tensor:
    """float8_e8m0fnu (or its uint8 bytes) -> fp32 2**(byte - 127); byte 255 is NaN."""
    if t.dtype == torch.float8_e8m0fnu:
        t = t.view(torch.uint8)
    elif t.dtype != torch.uint8:
        raise ValueError(f"e8m0_to_float: expected float8_e8m0fnu or uint8, got {t.dtype}")
    b = t.to(torch.int32)
    # fp32 bit pattern: exponent field = byte for 1..254; byte 0 is the subnormal 2**-127
    bits = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23)
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def float_to_e8m0(t: Tensor) -> Tensor:
    """fp32 powers of two in [2**-127, 2**127] -> float8_e8m0fnu; ValueError for anything else."""
    t = t.float()
    m, e = torch.frexp(t)
    ok = (m == 0.5) & (t >= _E8M0_MIN) & (t <= _E8M0_MAX)
    if not bool(ok.all()):
        bad = t[~ok].flatten()[0].item()
        raise ValueError(f"float_to_e8m0: {bad!r} is not a power of two in [2**-127, 2**127]")
    return (e.to(torch.int32) - 1 + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def scale_to_float(scale: Tensor) -> Tensor:
    """A stored scale as fp32: e8m0 (float8_e8m0fnu, or its raw bytes as uint8) decoded, fp32 as is, anything
    else float()."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return e8m0_to_float(scale)
    if scale.dtype == torch.float32:
        return scale
    return scale.float()


def scale_tiles(values: Tensor, scale: Tensor, block_r: int, block_c: int) -> Tensor:
    """values [..., R, C] fp32 * scale [..., ceil(R/br), ceil(C/bc)] fp32 broadcast over tiles -> [..., R, C]
    fp32: the reference dequantisation (static shapes only: graph-safe)."""
    *lead, r, c = values.shape
    sr, sc = -(-r // block_r), -(-c // block_c)
    if tuple(scale.shape[-2:]) != (sr, sc):
        raise ValueError(f"scale shape {list(scale.shape)}, expected [..., {sr}, {sc}] for a [{r}, {c}] weight")
    pr, pc = sr * block_r - r, sc * block_c - c
    if pr or pc:
        values = torch.nn.functional.pad(values, (0, pc, 0, pr))
    tiles = values.reshape(*lead, sr, block_r, sc, block_c) * scale[..., :, None, :, None]
    return tiles.reshape(*lead, sr * block_r, sc * block_c)[..., :r, :c]


def dequantize_fp8(w: Tensor, scale: Tensor, block: int) -> Tensor:
    """w float8_e4m3fn [out, in], scale [ceil(out/block), ceil(in/block)] (e8m0 or fp32) -> fp32 [out, in]."""
    if w.dim() != 2:
        raise ValueError(f"dequantize_fp8: expected a 2-D weight, got shape {list(w.shape)}")
    return scale_tiles(w.float(), scale_to_float(scale), block, block)


_E2M1_LUT = torch.tensor(list(_E2M1_GRID) + [-v for v in _E2M1_GRID], dtype=torch.float32)  # code -> value


def unpack_fp4(packed: Tensor) -> Tensor:
    """int8/uint8 [..., in/2] (low nibble = element 2j, high nibble = 2j+1) -> fp32 [..., in]."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"unpack_fp4: expected int8 or uint8, got {packed.dtype}")
    p = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1)  # [..., in/2, 2]
    codes = codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return _E2M1_LUT.to(packed.device)[codes]


def dequantize_fp4(packed: Tensor, scale: Tensor, block: int = FP4_BLOCK) -> Tensor:
    """packed int8 [out, in/2], scale [out, in/block] (e8m0 or fp32) -> fp32 [out, in]."""
    if packed.dim() != 2:
        raise ValueError(f"dequantize_fp4: expected a 2-D weight, got shape {list(packed.shape)}")
    return scale_tiles(unpack_fp4(packed), scale_to_float(scale), 1, block)


def pack_fp4(values: Tensor, check: bool = True) -> Tensor:
    """fp32 [..., in] already on the e2m1 grid -> int8 [..., in/2], low nibble first (-0.0 -> code 8).
    `check`: raise when a value is off the grid (a data-dependent test: off inside compiled graphs, where the
    values come from round_e2m1)."""
    if values.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim {values.shape[-1]} is odd")
    v = values.float()
    a = v.abs()
    # grid index of the magnitude: 2a on [0, 2), a + 2 on [2, 4), a/2 + 4 on [4, 6]
    idx = torch.where(a < 2.0, a * 2.0, torch.where(a < 4.0, a + 2.0, a * 0.5 + 4.0))
    idx = idx.clamp(0, 7).to(torch.int64)
    lut = _E2M1_LUT.to(v.device)
    if check and not bool((lut[idx] == a).all()):
        raise ValueError("pack_fp4: values are not all on the e2m1 grid")
    codes = idx | (torch.signbit(v).to(torch.int64) << 3)
    codes = codes.reshape(*codes.shape[:-1], -1, 2)
    byte = codes[..., 0] | (codes[..., 1] << 4)
    return byte.to(torch.uint8).view(torch.int8)


def _pow2_scale(amax: Tensor, qmax: float) -> Tensor:
    """pow2_ceil(amax / qmax) with a floor so all-zero blocks get a valid (tiny) e8m0 scale."""
    tiny = torch.finfo(torch.float32).tiny
    return pow2_ceil(amax.clamp(min=tiny) / qmax).clamp(min=_E8M0_MIN)


def _check_finite(w: Tensor, what: str) -> None:
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{what}: weight holds inf or nan")


def quantize_weight_fp8(w: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """w [out, in] -> (float8_e4m3fn [out, in], float8_e8m0fnu scale [ceil(out/block), ceil(in/block)]).

    Each [block x block] tile gets the smallest power-of-two scale with amax / scale <= 448, and the
    values are rounded to nearest e4m3, so dequantize_fp8 gives the closest such representation.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_weight_fp8: expected a 2-D weight, got shape {list(w.shape)}")
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    wf = w.float()
    _check_finite(wf, "quantize_weight_fp8")
    r, c = wf.shape
    sr, sc = -(-r // block), -(-c // block)
    padded = torch.nn.functional.pad(wf, (0, sc * block - c, 0, sr * block - r))
    tiles = padded.reshape(sr, block, sc, block)
    amax = tiles.abs().amax(dim=(1, 3))  # [sr, sc]
    scale = _pow2_scale(amax, FP8_MAX)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(sr * block, sc * block)[:r, :c].contiguous()
    return q, float_to_e8m0(scale)


def quantize_weight_fp4(w: Tensor, block: int = FP4_BLOCK) -> tuple[Tensor, Tensor]:
    """w [out, in] -> (int8 packed [out, in/2], float8_e8m0fnu scale [out, ceil(in/block)]).

    Per row and `block` values along in: scale = pow2_ceil(amax / 6), values round_e2m1(w / scale).
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_weight_fp4: expected a 2-D weight, got shape {list(w.shape)}")
    if w.shape[1] % 2:
        raise ValueError(f"quantize_weight_fp4: inner size {w.shape[1]} is odd")
    wf = w.float()
    _check_finite(wf, "quantize_weight_fp4")
    wb, n = _blocked(wf, block)  # [out, nb, block]
    scale = _pow2_scale(wb.abs().amax(dim=-1), FP4_MAX)  # [out, nb]
    q = round_e2m1((wb / scale[..., None]).clamp(-FP4_MAX, FP4_MAX))
    return pack_fp4(_unblocked(q, n)), float_to_e8m0(scale)
