"""qlinear: GEMMs over weights kept quantised, against the reference dequantisers (quant.dequantize_fp8 /
dequantize_fp4) followed by an fp32 F.linear.

Decoders are compared bitwise (torch.equal, NaN positions separately). GEMM results are compared with the
worst-case fp32 summation bound: each of two fp32 dot products of length K lies within K * 2**-24 * sum|x w| of
the exact value (gamma_K), so two summation orders differ by at most 2 * K * 2**-24 * (|x| @ |W|^T); a chunked
GEMM (another N per BLAS call) may pick another kernel or split and sum in another order, so bitwise equality
with one whole GEMM is not guaranteed (it holds on many shapes, see test_chunked_gemv_bitwise_on_aligned_shapes,
which only reports). Results in bf16 may then round to neighbouring bf16 values: one bf16 ulp more.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from mhcrun.ops import qlinear as ql
from mhcrun.ops.qgemv import KERNEL_OFF
from mhcrun.ops.qlinear import (
    act_quant_fp8_codes,
    decode,
    dequantize,
    dequantize_reference,
    gemv_fused,
    qlinear,
    qlinear_grouped,
)
from mhcrun.ops.quant import (
    dequantize_fp4,
    dequantize_fp8,
    float_to_e8m0,
    fp8_simulate,
    quantize_act_fp8,
    scale_to_float,
)
from mhcrun.ops.qweight import QWeight

U32 = 2.0**-24


def qw(data: torch.Tensor, scale: torch.Tensor | None = None, block: int = 0) -> QWeight:
    """A weight as loading makes it: checked once."""
    return QWeight(data, scale, block).checked()


def compiled(fn, w: QWeight, *args, **kwargs):
    """x -> fn(x, w, *args, **kwargs) compiled with the weight's tensors as graph inputs (as the regions take
    them)."""
    c = torch.compile(lambda x, d, s: fn(x, QWeight(d, s, w.block, w.kernel), *args, **kwargs), backend="aot_eager",
                      fullgraph=True)
    return lambda x: c(x, w.data, w.scale)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pow2(shape, lo: int, hi: int, g: torch.Generator) -> torch.Tensor:
    return torch.ldexp(torch.ones(shape), torch.randint(lo, hi, shape, generator=g))


def fp8_weight(out_f: int, in_f: int, block: int, g: torch.Generator, e8m0: bool = True):
    w = (torch.randn(out_f, in_f, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)  # no NaN codes
    s = pow2((-(-out_f // block), -(-in_f // block)), -12, 2, g)
    return w, (float_to_e8m0(s) if e8m0 else s)


def fp4_weight(out_f: int, in_f: int, g: torch.Generator, e8m0: bool = True, block: int = 32):
    p = torch.randint(-128, 128, (out_f, in_f // 2), generator=g, dtype=torch.int8)
    s = pow2((out_f, -(-in_f // block)), -12, 2, g)
    return p, (float_to_e8m0(s) if e8m0 else s)


def weight_of(fmt: str, out_f: int, in_f: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An [out_f x in_f] weight in `fmt` (fp8 with 32-blocks, fp4, or "float": bf16) and its scale."""
    if fmt == "fp8":
        return fp8_weight(out_f, in_f, 32, g)
    if fmt == "fp4":
        return fp4_weight(out_f, in_f, g)
    return torch.randn(out_f, in_f, generator=g).to(torch.bfloat16), None


def weight_96x160(fmt: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    return weight_of(fmt, 96, 160, g)


def reference_weight(data, scale, fmt, block) -> torch.Tensor:
    if fmt == "fp8":
        return dequantize_fp8(data, scale, block).contiguous()
    if fmt == "fp4":
        return dequantize_fp4(data, scale, 32).contiguous()
    return data.float()


def reference_qlinear(x, w_ref, act_quant=False) -> torch.Tensor:
    xq = fp8_simulate(x, 128, pow2_scale=True) if act_quant else x
    return F.linear(xq.float(), w_ref)


def assert_gemm_close(y, ref32, x, w_ref, act_quant=False, rel=None):
    """y (in x.dtype) against the fp32 reference ref32, within the two-orders fp32 bound (+1 ulp of y's dtype);
    rel overrides the relative part (2 * K * 2**-24) of the bound."""
    xq = fp8_simulate(x, 128, pow2_scale=True) if act_quant else x
    k = w_ref.shape[1]
    bound = (2 * k * U32 if rel is None else rel) * F.linear(xq.float().abs(), w_ref.abs())
    if y.dtype != torch.float32:
        bound = bound + ref32.abs() * torch.finfo(y.dtype).eps
    assert y.dtype == x.dtype and y.shape == ref32.shape
    assert torch.equal(torch.isnan(y), torch.isnan(ref32))
    diff = (y.float() - ref32).abs().nan_to_num(0.0)
    assert bool((diff <= bound + 1e-30).all()), f"max excess {(diff - bound).max().item()}"


def assert_same_values(got, ref):
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan], ref[~nan])
    assert torch.equal(torch.signbit(got[~nan]), torch.signbit(ref[~nan]))  # -0.0 too


# ---------------------------------------------------------------- decoders, bitwise

SCALES = [1.0, 2.0**-127, 2.0**127, 2.0**7, 2.0**8, 2.0**1, 2.0**2, 0.3, 2.0**-140, 3.9999998, 4.0,
          math.inf, math.nan]


def stored_scales(value: float, shape: tuple[int, int]) -> list[torch.Tensor]:
    """A scale of `value` as fp32, and as e8m0 too when e8m0 can hold it (a power of two in range)."""
    scale = torch.full(shape, value)
    if value > 0 and math.frexp(value)[0] == 0.5 and 2.0**-127 <= value <= 2.0**127:
        return [scale, float_to_e8m0(scale)]
    return [scale]


@pytest.mark.parametrize("value", SCALES)
def test_decode_fp8_all_codes(value, decoder):
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(torch.float8_e4m3fn).view(2, 128)
    for s in stored_scales(value, (1, 1)):
        assert_same_values(decode(qw(codes, s, 128), cpu=decoder), dequantize_fp8(codes, s, 128))


def test_decode_fp8_nan_codes_and_subnormals(decoder):
    codes = torch.tensor([[0x7F, 0xFF, 0x01, 0x81, 0x07, 0x87, 0x00, 0x80]], dtype=torch.uint8)
    w = codes.view(torch.float8_e4m3fn)
    got = decode(qw(w, torch.ones(1, 1), 8), cpu=decoder)
    assert torch.isnan(got[0, :2]).all()
    assert got[0, 2:].tolist() == [2.0**-9, -(2.0**-9), 7 * 2.0**-9, -7 * 2.0**-9, 0.0, -0.0]
    assert torch.signbit(got[0, 7])


def test_decode_fp8_nan_memory():
    """A weight found free of NaN codes over a whole pass is not looked at again; one holding them always is."""
    g = gen(1)
    w, s = fp8_weight(64, 64, 32, g)
    w.view(torch.uint8)[w.view(torch.uint8) & 0x7F == 0x7F] = 0  # no NaN codes
    clean = qw(w, s, 32)
    assert clean.nan_free is None
    assert_same_values(decode(clean), dequantize_fp8(w, s, 32))
    assert clean.nan_free is True  # remembered
    assert_same_values(decode(clean), dequantize_fp8(w, s, 32))
    bad = w.clone()
    bad.view(torch.uint8)[5, 7] = 0xFF
    nan = qw(bad, s, 32)
    for _ in range(2):
        got = decode(nan)
        assert torch.isnan(got[5, 7]) and int(torch.isnan(got).sum()) == 1 and nan.nan_free is False
        assert_same_values(got, dequantize_fp8(bad, s, 32))
    x = torch.randn(1, 64, generator=g)
    assert torch.isnan(qlinear(x, nan)[0, 5])


@pytest.mark.parametrize("value", SCALES)
def test_decode_fp4_all_codes(value, decoder):
    packed = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(torch.int8).view(8, 32)
    for s in stored_scales(value, (8, 2)):
        assert_same_values(decode(qw(packed, s, 32), cpu=decoder), dequantize_fp4(packed, s, 32))
        assert_same_values(decode(qw(packed.view(torch.uint8), s, 32), cpu=decoder), dequantize_fp4(packed, s, 32))


@pytest.mark.parametrize("shape, block", [((200, 320), 128), ((37, 45), 32), ((1, 128), 128), ((130, 7), 32),
                                          ((129, 64), 32)])
@pytest.mark.parametrize("e8m0", [True, False])
def test_decode_fp8_random_partial_tiles(shape, block, e8m0, decoder):
    w, s = fp8_weight(*shape, block, gen(2), e8m0)
    assert decoder.decodes(qw(w, s, block)) == decoder.on  # the path under test is the one taken
    assert torch.equal(decode(qw(w, s, block), cpu=decoder), dequantize_fp8(w, s, block))


@pytest.mark.parametrize("shape", [(200, 320), (3, 40), (1, 64), (33, 2)])
@pytest.mark.parametrize("e8m0", [True, False])
def test_decode_fp4_random(shape, e8m0, decoder):
    p, s = fp4_weight(*shape, gen(3), e8m0)
    assert decoder.decodes(qw(p, s, 32)) == decoder.on
    assert torch.equal(decode(qw(p, s, 32), cpu=decoder), dequantize_fp4(p, s, 32))


@pytest.mark.parametrize("chunk_bytes", [64 * 4 * 16, 64 * 4 * 48, 64 * 4 * 100])
@pytest.mark.parametrize("spans", [False, True])
def test_decoders_chunk_boundaries(monkeypatch, chunk_bytes, spans, decoder):
    """Chunks of 16 / 48 / 100 rows (at most one 32-row block row unless spans) and a partial last block."""
    monkeypatch.setattr(ql, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(ql, "CHUNK_SPANS_BLOCKS", spans)
    g = gen(4)
    for out_f in (95, 96, 97, 129):
        w, s = fp8_weight(out_f, 64, 32, g)
        assert torch.equal(decode(qw(w, s, 32), cpu=decoder), dequantize_fp8(w, s, 32))
        p, s4 = fp4_weight(out_f, 64, g)
        assert torch.equal(decode(qw(p, s4, 32), cpu=decoder), dequantize_fp4(p, s4, 32))


def test_decode_out_argument_and_empty(decoder):
    w, s = fp8_weight(40, 64, 32, gen(5))
    out = torch.empty(40, 64)
    assert decode(qw(w, s, 32), out=out, cpu=decoder) is out
    assert torch.equal(out, dequantize_fp8(w, s, 32))
    with pytest.raises(ValueError):
        decode(qw(w, s, 32), out=torch.empty(40, 63), cpu=decoder)
    empty = torch.empty(0, 64).to(torch.float8_e4m3fn)
    assert decode(qw(empty, torch.ones(0, 2), 32), cpu=decoder).shape == (0, 64)


def test_decoders_with_flushed_denormals_fall_back():
    w = torch.tensor([[0x01, 0x81, 0x30, 0x7F]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.full((1, 1), 2.0**-127)
    if not torch.set_flush_denormal(True):
        pytest.skip("no flush-denormal mode on this CPU")
    try:
        assert not ql.denormals_ok()
        assert_same_values(decode(qw(w, s, 4)), dequantize_fp8(w, s, 4))
    finally:
        torch.set_flush_denormal(False)
    assert ql.denormals_ok()


# ---------------------------------------------------------------- dequantize (leading dims, graph-safe)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_dequantize_leading_dims(fmt, decoder):
    g = gen(6)
    b, k, out_f, in_f, block = 2, 3, 48, 64, 32
    mats = [fp8_weight(out_f, in_f, block, g) if fmt == "fp8" else fp4_weight(out_f, in_f, g)
            for _ in range(b * k)]
    data = torch.stack([m[0] for m in mats]).view(b, k, *mats[0][0].shape)
    scale = torch.stack([m[1] for m in mats]).view(b, k, *mats[0][1].shape)
    expected = torch.stack([reference_weight(d, s, fmt, block) for d, s in mats]).view(b, k, out_f, in_f)
    assert torch.equal(dequantize(QWeight(data, scale, block), decoder), expected)
    assert torch.equal(dequantize_reference(QWeight(data, scale, block)), expected)
    compiled = torch.compile(lambda d, s: dequantize(QWeight(d, s, block)), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(data, scale), expected)


def test_dequantize_float_and_a_weight_checked_once():
    w = torch.randn(4, 6).to(torch.bfloat16)
    assert torch.equal(dequantize(qw(w)), w.float())
    w8, s8 = fp8_weight(40, 64, 32, gen(7))
    for bad, why in ((QWeight(torch.zeros(4, 6, dtype=torch.int32)), "no weight format"),
                     (QWeight(w8, s8[:1], 32), "scale shape"),
                     (QWeight(w8.view(torch.int8), s8, 32), "fp4 scale shape"),  # int8 bytes are FP4
                     (QWeight(w8, None, 32), "needs a scale"), (QWeight(w8), "positive block"),
                     (QWeight(w, s8), "takes no scale"),
                     (QWeight(w8, s8.to(torch.int16), 32), "scale dtype"), (QWeight(w8[None], s8, 32), "2-D")):
        with pytest.raises(ValueError, match=why):
            bad.checked("layers.0.attn.wq_a.weight")
    assert qw(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 2)).block == 32  # FP4's group by default
    with pytest.raises(ValueError):
        qlinear(torch.randn(1, 63), qw(w8, s8, 32))


# ---------------------------------------------------------------- qlinear against the reference


@pytest.mark.parametrize("shape, block", [((200, 320), 128), ((37, 45), 32), ((1, 128), 128)])
@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("act_quant", [False, True])
def test_qlinear_fp8(gemv_path, shape, block, m, act_quant):
    g = gen(8)
    w, s = fp8_weight(*shape, block, g, e8m0=bool(m % 2))
    w_ref = reference_weight(w, s, "fp8", block)
    x = torch.randn(m, shape[1], generator=g)
    ref = reference_qlinear(x, w_ref, act_quant)
    assert_gemm_close(qlinear(x, qw(w, s, block), act_quant, cpu=gemv_path), ref, x, w_ref, act_quant)


@pytest.mark.parametrize("shape", [(200, 320), (64, 40), (1, 64)])
@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("act_quant", [False, True])
def test_qlinear_fp4(gemv_path, shape, m, act_quant):
    g = gen(9)
    p, s = fp4_weight(*shape, g, e8m0=bool(m % 2))
    w_ref = reference_weight(p, s, "fp4", 32)
    x = torch.randn(m, shape[1], generator=g)
    ref = reference_qlinear(x, w_ref, act_quant)
    assert_gemm_close(qlinear(x, qw(p, s, 32), act_quant, cpu=gemv_path), ref, x, w_ref, act_quant)


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "float"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qlinear_3d_x_and_dtypes(gemv_path, fmt, dtype):
    g = gen(10)
    data, scale = weight_96x160(fmt, g)
    block = 32 if fmt != "float" else 0
    w_ref = reference_weight(data, scale, fmt, block)
    x = torch.randn(2, 3, 160, generator=g).to(dtype)
    for act_quant in (False, True):
        y = qlinear(x, qw(data, scale, block), act_quant, cpu=gemv_path)
        assert y.shape == (2, 3, 96)
        assert_gemm_close(y, reference_qlinear(x, w_ref, act_quant), x, w_ref, act_quant)


@pytest.mark.parametrize("out_f", [127, 128, 129, 191, 193])
def test_qlinear_chunk_boundaries(monkeypatch, out_f):
    """Chunks of 64 rows (CHUNK_BYTES = 64 rows of 160 fp32): out just below / at / above chunk multiples."""
    monkeypatch.setattr(ql, "CHUNK_BYTES", 64 * 160 * 4)
    g = gen(11)
    x = torch.randn(5, 160, generator=g)
    for fmt, (data, scale) in (("fp8", fp8_weight(out_f, 160, 128, g)), ("fp4", fp4_weight(out_f, 160, g)),
                               ("float", (torch.randn(out_f, 160, generator=g).to(torch.bfloat16), None))):
        block = 128 if fmt == "fp8" else 32
        w_ref = reference_weight(data, scale, fmt, block)
        assert_gemm_close(qlinear(x, qw(data, scale, block)), F.linear(x, w_ref), x, w_ref)


def test_qlinear_fp8_x_fold_decisions(monkeypatch):
    """The per-column scales go into x only when exact; every other case scales the weight chunk."""
    monkeypatch.setattr(ql, "CHUNK_BYTES", 32 * 96 * 4)  # 32-row chunks, one per 32-row block row
    g = gen(25)
    w, s = fp8_weight(100, 96, 32, g)
    sf = scale_to_float(s)
    cases = [  # (scale, x, fold expected)
        (s, torch.randn(3, 96, generator=g), True),
        (sf * 0.3, torch.randn(3, 96, generator=g), False),  # not powers of two
        (s, torch.randn(3, 96, generator=g) * 2.0**110, False),  # x * scale * 2**120 would overflow
        (float_to_e8m0(torch.full((4, 3), 2.0**-127)), torch.full((3, 96), 2.0**-125), False),  # subnormal x*f
        (s, torch.randn(40, 96, generator=g), None),  # more rows of x than the chunk: weight scaled
        (torch.full((4, 3), 2.0**9), torch.randn(2, 96, generator=g), False),  # scale * 2**120 overflows
    ]
    for scale, x, fold in cases:
        dec = ql._RowDecoder(qw(w, scale, 32), 32, KERNEL_OFF)
        if fold is not None:
            assert dec.x_fold_ok(x) is fold
        w_ref = reference_weight(w, scale, "fp8", 32)
        assert_gemm_close(qlinear(x, qw(w, scale, 32)), F.linear(x, w_ref), x, w_ref)


def test_qlinear_extreme_scales(gemv_path):
    g = gen(12)
    w = (torch.randn(64, 64, generator=g) * 0.3).clamp(-1.5, 1.5).to(torch.float8_e4m3fn)  # |w| * 2**127 finite
    for e, xe in ((127, -127), (120, -110), (-127, 100), (8, 0)):
        s = torch.full((2, 2), 2.0**e)
        w_ref = reference_weight(w, s, "fp8", 32)
        assert bool(torch.isfinite(w_ref).all())
        x = torch.randn(3, 64, generator=g) * 2.0**xe
        assert_gemm_close(qlinear(x, qw(w, float_to_e8m0(s), 32), cpu=gemv_path), F.linear(x, w_ref), x, w_ref)
    p = torch.randint(-128, 128, (8, 32), generator=g, dtype=torch.int8)
    for e, xe in ((125, -125), (2, 0), (-127, 120)):  # 6 * 2**125 is the largest finite one
        s = torch.full((8, 2), 2.0**e)
        w_ref = reference_weight(p, s, "fp4", 32)
        x = torch.randn(2, 64, generator=g) * 2.0**xe
        assert_gemm_close(qlinear(x, qw(p, s, 32), cpu=gemv_path), F.linear(x, w_ref), x, w_ref)


def test_qlinear_empty():
    w, s = fp8_weight(64, 64, 32, gen(13))
    assert qlinear(torch.randn(0, 64), qw(w, s, 32)).shape == (0, 64)
    assert qlinear(torch.randn(2, 0, 64), qw(w, s, 32), True).shape == (2, 0, 64)


# ---------------------------------------------------------------- fmt "float" against the plain formula


def linear(x: torch.Tensor, w: torch.Tensor, act_quant: bool = False) -> torch.Tensor:
    """The plain linear qlinear's "float" format must reproduce: FP8-rounded x when act_quant, fp32 math when the
    weight's dtype differs from x's (or when act_quant), else F.linear in x's dtype."""
    if act_quant:
        return F.linear(fp8_simulate(x, 128, pow2_scale=True).float(), w.float()).to(x.dtype)
    if w.dtype != x.dtype:
        return F.linear(x.float(), w.float()).to(x.dtype)
    return F.linear(x, w)


@pytest.mark.parametrize("xdt, wdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                      (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("act_quant", [False, True])
def test_float_fmt_identical_to_linear(xdt, wdt, act_quant):
    """Where no conversion of the weight is needed qlinear makes linear()'s own calls, and a converted weight
    that fits one chunk (as here) is one F.linear on the same values: identical."""
    g = gen(14)
    w = torch.randn(200, 320, generator=g).to(wdt)
    x = torch.randn(3, 320, generator=g).to(xdt)
    assert torch.equal(qlinear(x, qw(w, None, 0), act_quant), linear(x, w, act_quant))
    assert torch.equal(qlinear(x, qw(w)), linear(x, w))


@pytest.mark.parametrize("act_quant", [False, True])
def test_float_fmt_converted_weight_matches_linear(act_quant):
    """A bf16 weight under an fp32 x is converted chunk by chunk: same values as linear(), fp32 summation bound."""
    g = gen(15)
    w = torch.randn(300, 256, generator=g).to(torch.bfloat16)
    x = torch.randn(37, 256, generator=g)
    ref = linear(x, w, act_quant)
    assert_gemm_close(qlinear(x, qw(w, None, 0), act_quant), ref, x, w.float(), act_quant)


# ---------------------------------------------------------------- qlinear_grouped


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "float"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qlinear_grouped_against_einsum(gemv_path, fmt, dtype):
    g = gen(16)
    groups, r, d = 4, 48, 96  # 48-row groups straddle the 32-row fp8 blocks
    data, scale = weight_of(fmt, groups * r, d, g)
    w_ref = reference_weight(data, scale, fmt, 32)
    x = torch.randn(2, 3, groups, d, generator=g).to(dtype)
    y = qlinear_grouped(x, qw(data, scale, 32), groups, gemv_path)
    ref = torch.einsum("bsgd,grd->bsgr", x.float(), w_ref.view(groups, r, d))
    bound = 2 * d * U32 * torch.einsum("bsgd,grd->bsgr", x.float().abs(), w_ref.abs().view(groups, r, d))
    if dtype != torch.float32:
        bound = bound + ref.abs() * torch.finfo(dtype).eps
    assert y.shape == (2, 3, groups, r) and y.dtype == dtype
    assert bool(((y.float() - ref).abs() <= bound).all())
    with pytest.raises(ValueError):
        qlinear_grouped(x, qw(data, scale, 32), 5, gemv_path)


# ---------------------------------------------------------------- torch.compile: the whole-tensor path


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("act_quant", [False, True])
def test_qlinear_compiles_without_graph_breaks(fmt, act_quant):
    torch._dynamo.reset()
    g = gen(17)
    data, scale = fp8_weight(96, 160, 32, g) if fmt == "fp8" else fp4_weight(96, 160, g)
    x = torch.randn(2, 160, generator=g)
    w_ref = reference_weight(data, scale, fmt, 32)
    w = qw(data, scale, 32)
    y = compiled(qlinear, w, act_quant)(x)
    assert_gemm_close(y, reference_qlinear(x, w_ref, act_quant), x, w_ref, act_quant)
    xg = torch.randn(1, 2, 4, 160, generator=g)
    yg = compiled(qlinear_grouped, w, 4)(xg)
    for gi in range(4):  # each group against its rows of the reference weight
        rows = w_ref[gi * 24:(gi + 1) * 24]
        assert_gemm_close(yg[0, :, gi], F.linear(xg[0, :, gi], rows), xg[0, :, gi], rows)
        assert_gemm_close(qlinear_grouped(xg, qw(data, scale, 32), 4)[0, :, gi], F.linear(xg[0, :, gi], rows),
                          xg[0, :, gi], rows)


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "float"])
def test_compiled_decode_gemv(gemv_path, fmt):
    """Under torch.compile a few rows of x take the fused CPU kernel as an opaque op (mhcrun::qgemv) or, without
    it, gemv_fused (dequantisation inside the reduction): same values as dequantise-then-matmul within the fp32
    summation bound; more rows take the whole-tensor path."""
    torch._dynamo.reset()
    g = gen(23)
    data, scale = weight_96x160(fmt, g)
    w_ref = reference_weight(data, scale, fmt, 32)
    w = qw(data, scale, 32)
    fns = {act_quant: compiled(qlinear, w, act_quant, cpu=gemv_path) for act_quant in (False, True)}
    for rows in (1, 3, ql.FUSED_MAX_ROWS + 1):
        x = torch.randn(rows, 160, generator=g)
        for act_quant in (False, True):
            ref = reference_qlinear(x, w_ref, act_quant)
            assert_gemm_close(fns[act_quant](x), ref, x, w_ref, act_quant)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_gemv_fused_on_gathered_experts(fmt):
    """The routed experts' form: x [B, 1, 1, in] against gathered weights [B, k, out, in'] -> [B, k, out]."""
    g = gen(25)
    weights = [fp8_weight(64, 96, 32, g) if fmt == "fp8" else fp4_weight(64, 96, g) for _ in range(5)]
    data = torch.stack([w for w, _ in weights])
    scale = torch.stack([s for _, s in weights]).view(torch.uint8)  # as compiled regions pass them
    idx = torch.tensor([[0, 3], [4, 4], [2, 1]])
    x = torch.randn(3, 96, generator=g)
    got = gemv_fused(x.view(3, 1, 1, 96), QWeight(data[idx], scale[idx], 32))
    assert got.shape == (3, 2, 64)
    for b, row in enumerate(idx.tolist()):
        for j, e in enumerate(row):
            w_ref = reference_weight(*weights[e], fmt, 32)
            assert_gemm_close(got[b, j][None], F.linear(x[b:b + 1], w_ref), x[b:b + 1], w_ref)


def test_uint8_scales_are_e8m0_bytes():
    g = gen(24)
    w, s = fp8_weight(64, 96, 32, g)
    p, s4 = fp4_weight(64, 96, g)
    x = torch.randn(2, 96, generator=g)
    assert torch.equal(dequantize(QWeight(w, s.view(torch.uint8), 32)), dequantize_fp8(w, s, 32))
    assert torch.equal(dequantize(QWeight(p, s4.view(torch.uint8), 32)), dequantize_fp4(p, s4, 32))
    assert torch.equal(qlinear(x, qw(w, s.view(torch.uint8), 32)), qlinear(x, qw(w, s, 32)))
    assert torch.equal(qlinear(x, qw(p, s4.view(torch.uint8), 32), True), qlinear(x, qw(p, s4, 32), True))


# ---------------------------------------------------------------- activation codes for the CUDA path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 256), (37, 512), (3, 200)])
def test_act_quant_codes_reproduce_fp8_simulate(dtype, shape):
    g = gen(18)
    x = (torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[1])).to(dtype)
    x[0, :128] = 0.0  # an all-zero block (amax floor)
    codes, sx = act_quant_fp8_codes(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    assert sx.dtype == torch.float32 and sx.shape == (shape[0], -(-shape[1] // 128))
    m, e = torch.frexp(sx)
    assert bool((m == 0.5).all())  # powers of two
    deq = (codes.float().view(shape[0], -1) * sx.repeat_interleave(128, dim=1)[:, : shape[1]])
    sim = fp8_simulate(x, 128, pow2_scale=True)
    assert torch.equal(deq, fp8_simulate(x.float(), 128, pow2_scale=True))
    assert torch.equal(deq.to(dtype), sim)
    c2, s2 = quantize_act_fp8(x.unsqueeze(0), 128)  # leading dims
    assert torch.equal(c2[0].view(torch.uint8), codes.view(torch.uint8)) and torch.equal(s2[0], sx)


def test_scaled_mm_not_tried_on_cpu(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("_scaled_mm path taken on CPU")

    monkeypatch.setattr(ql, "_scaled_mm_call", boom)
    w, s = fp8_weight(128, 256, 128, gen(19))
    qlinear(torch.randn(2, 256), qw(w, s, 128), True, ql.ScaledMM())


# ---------------------------------------------------------------- CUDA (skipped without a GPU)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("m", [1, 5, 37, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_scaled_mm_fp8(monkeypatch, m, dtype):
    g = gen(20)
    w, s = fp8_weight(384, 512, 128, g)
    w_ref = reference_weight(w, s, "fp8", 128).cuda()
    x = torch.randn(m, 512, generator=g).to(dtype).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = ql._scaled_mm_fp8(x, qw(w.cuda(), s.cuda(), 128), ql.ScaledMM())
    assert y is not None, "the _scaled_mm path was not taken"
    ref = reference_qlinear(x, w_ref, True)
    # Hopper's FP8 MMA keeps fewer accumulator bits inside each 128-wide K block than fp32 does: a looser bound
    assert_gemm_close(y, ref, x, w_ref, True, rel=2.0**-9)
    assert_gemm_close(qlinear(x, qw(w.cuda(), s.cuda(), 128), True, ql.ScaledMM()), ref, x, w_ref, True,
                      rel=2.0**-9)


@cuda
@pytest.mark.parametrize("fmt", ["fp8", "fp4", "float"])
def test_cuda_dequantise_paths(fmt):
    g = gen(21)
    if fmt == "fp8":
        data, scale = fp8_weight(100, 96, 32, g)  # block 32: not the _scaled_mm recipe
    elif fmt == "fp4":
        data, scale = fp4_weight(100, 96, g)
    else:
        data, scale = torch.randn(100, 96, generator=g).to(torch.bfloat16), None
    w_ref = reference_weight(data, scale, fmt, 32).cuda()
    data = data.cuda()
    scale = scale.cuda() if scale is not None else None
    x = torch.randn(3, 96, generator=g).cuda()
    for act_quant in (False, True):
        y = qlinear(x, qw(data, scale, 32), act_quant)
        assert_gemm_close(y, reference_qlinear(x, w_ref, act_quant), x, w_ref, act_quant)
    if fmt != "float":
        assert torch.equal(dequantize(QWeight(data, scale, 32)), w_ref)


# ---------------------------------------------------------------- observation (no assertion on summation order)


def test_chunked_gemv_bitwise_on_aligned_shapes():
    """Reports (does not require) whether the chunked GEMV equals one whole fp32 GEMV bitwise here."""
    g = gen(22)
    w, s = fp8_weight(512, 1024, 128, g)
    w_ref = reference_weight(w, s, "fp8", 128)
    x = torch.randn(1, 1024, generator=g)
    y = qlinear(x, qw(w, s, 128))
    ref = F.linear(x, w_ref)
    assert_gemm_close(y, ref, x, w_ref)
    print(f"chunked GEMV bitwise equal to the whole GEMV: {torch.equal(y, ref)}")
