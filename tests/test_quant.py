"""Hand-derived checks of the plain-torch quantisation reference ops."""

from __future__ import annotations

import math

import pytest
import torch

from mhcrun.ops.quant import (
    FP4_MAX,
    FP8_MAX,
    dequantize_act,
    dequantize_fp4,
    dequantize_fp8,
    e4m3_to_float,
    e8m0_to_float,
    float_to_e8m0,
    fp4_simulate,
    fp8_simulate,
    hadamard,
    pack_fp4,
    pow2_ceil,
    quantize_act_fp8,
    quantize_weight_fp4,
    quantize_weight_fp8,
    round_e2m1,
    scale_to_float,
    unpack_fp4,
)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def e4m3_values(n: int, gen: torch.Generator, amax: float = FP8_MAX) -> torch.Tensor:
    """n random e4m3-representable values with max |v| == amax (amax itself representable)."""
    v = (torch.rand(n, generator=gen) * 2 - 1) * amax
    v = v.to(torch.float8_e4m3fn).float()
    v[0] = amax
    return v


# ---------------------------------------------------------------- pow2_ceil


def test_constants():
    assert FP8_MAX == 448.0 and FP4_MAX == 6.0


@pytest.mark.parametrize("e", [-149, -127, -126, -20, -1, 0, 1, 7, 100, 127])
def test_pow2_ceil_exact_powers(e):
    x = f32([math.ldexp(1.0, e)])
    assert pow2_ceil(x).item() == math.ldexp(1.0, e)


@pytest.mark.parametrize("e", [-126, -10, 0, 3, 60])
def test_pow2_ceil_neighbours(e):
    p = f32([math.ldexp(1.0, e)])
    above = torch.nextafter(p, f32([math.inf]))
    below = torch.nextafter(p, f32([0.0]))
    assert pow2_ceil(above).item() == math.ldexp(1.0, e + 1)
    assert pow2_ceil(below).item() == math.ldexp(1.0, e)


def test_pow2_ceil_misc():
    x = f32([3.0, 0.3, 5.0, 448.0, 1 / 448, 0.75, 1e-30])
    expected = [4.0, 0.5, 8.0, 512.0, 2.0**-8, 1.0, 2.0**-99]
    assert pow2_ceil(x).tolist() == expected


# ---------------------------------------------------------------- round_e2m1


@pytest.mark.parametrize(
    "x, expected",
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)],
)
def test_round_e2m1_ties(x, expected):
    assert round_e2m1(f32([x, -x])).tolist() == [expected, -expected]


def test_round_e2m1_grid_and_neighbours():
    grid = f32(E2M1 + [-v for v in E2M1])
    assert torch.equal(round_e2m1(grid), grid)
    x = f32([0.2, 0.3, 0.74, 1.1, 1.3, 2.4, 2.6, 3.4, 3.6, 4.9, 5.1, 5.9, 6.5, 7.0, 100.0, -100.0])
    expected = [0.0, 0.5, 0.5, 1.0, 1.5, 2.0, 3.0, 3.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0, 6.0, -6.0]
    assert round_e2m1(x).tolist() == expected


def test_round_e2m1_is_nearest():
    x = torch.linspace(-6, 6, 4801)
    grid = f32(E2M1 + [-v for v in E2M1[1:]])
    dist = (x[:, None] - grid[None, :]).abs()
    nearest = dist.min(dim=1).values
    got = round_e2m1(x)
    assert torch.equal((got - x).abs(), nearest)
    assert bool(torch.isin(got, grid).all())


# ---------------------------------------------------------------- fp8_simulate


def test_fp8_simulate_representable_block_unchanged():
    gen = torch.Generator().manual_seed(0)
    for amax, scale in [(FP8_MAX, 1.0), (FP8_MAX, 2.0**-6), (FP8_MAX, 2.0**5)]:
        x = e4m3_values(64, gen) * scale
        out = fp8_simulate(x, 64)
        assert torch.equal(out, x)
        assert out is not x
        del amax


def test_fp8_simulate_pow2_scale_explicit():
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(32, generator=gen) * 2 - 1
    x[3] = 1.0  # amax 1 -> scale pow2_ceil(1/448) = 2**-8
    expected = (x * 256).to(torch.float8_e4m3fn).float() / 256
    assert torch.equal(fp8_simulate(x, 32), expected)
    # without pow2 the scale is amax / 448 exactly
    s = torch.tensor(1.0) / FP8_MAX
    expected_lin = (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(fp8_simulate(x, 32, pow2_scale=False), expected_lin)


def test_fp8_simulate_scale_is_power_of_two():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 128, generator=gen) * 3.7
    out = fp8_simulate(x, 128)
    for row_in, row_out in zip(x, out, strict=True):
        scale = pow2_ceil(row_in.abs().max() / FP8_MAX)
        m, _ = torch.frexp(scale)
        assert m.item() == 0.5
        q = row_out / scale  # exact: a power-of-two scale
        assert torch.equal(q.to(torch.float8_e4m3fn).float(), q)
        assert q.abs().max().item() <= FP8_MAX


def test_fp8_simulate_matches_torch_cast():
    gen = torch.Generator().manual_seed(3)
    x = (torch.rand(3, 256, generator=gen) * 2 - 1) * FP8_MAX
    x[:, 0] = FP8_MAX  # amax 448 -> scale 1
    assert torch.equal(fp8_simulate(x, 256), x.to(torch.float8_e4m3fn).float())


def test_fp8_simulate_partial_last_block():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 40, generator=gen)
    x[:, 5] = 1000.0  # big values in the first block only
    out = fp8_simulate(x, 32)
    assert out.shape == x.shape
    assert torch.equal(out[:, :32], fp8_simulate(x[:, :32], 32))
    assert torch.equal(out[:, 32:], fp8_simulate(x[:, 32:].contiguous(), 32))
    # the tail has its own (small) scale, so it keeps its precision
    assert torch.allclose(out[:, 32:], x[:, 32:], rtol=2**-4, atol=1e-3)


def test_fp8_simulate_dtype_and_zero_floor():
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    out = fp8_simulate(x, 8)
    assert out.dtype == torch.bfloat16 and torch.equal(out, x)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert fp8_simulate(x, 32).dtype == torch.bfloat16


# ---------------------------------------------------------------- fp4_simulate


def test_fp4_simulate_explicit():
    gen = torch.Generator().manual_seed(5)
    x = (torch.rand(2, 32, generator=gen) * 2 - 1) * 6
    x[:, 0] = 6.0  # scale 1
    assert torch.equal(fp4_simulate(x, 32), round_e2m1(x))
    y = (torch.rand(32, generator=gen) * 2 - 1) * 3
    y[1] = -3.0  # amax 3 -> scale 0.5
    assert torch.equal(fp4_simulate(y, 32), round_e2m1(y * 2) / 2)


def test_fp4_simulate_partial_block_and_zeros():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 48, generator=gen)
    out = fp4_simulate(x)
    assert torch.equal(out[:, 32:], fp4_simulate(x[:, 32:].contiguous()))
    z = torch.zeros(1, 32)
    assert torch.equal(fp4_simulate(z), z)


# ---------------------------------------------------------------- e8m0 and scales


def test_e8m0_round_trip_all_bytes():
    b = torch.arange(0, 255, dtype=torch.uint8)
    f = e8m0_to_float(b)
    assert f.tolist() == [math.ldexp(1.0, int(i) - 127) for i in range(255)]
    e = float_to_e8m0(f)
    assert e.dtype == torch.float8_e8m0fnu
    assert torch.equal(e.view(torch.uint8), b)
    assert torch.equal(e8m0_to_float(e), f)
    assert math.isnan(e8m0_to_float(torch.tensor([255], dtype=torch.uint8)).item())


@pytest.mark.parametrize("bad", [3.0, 0.0, -2.0, 0.75, math.inf])
def test_float_to_e8m0_rejects_non_powers(bad):
    with pytest.raises(ValueError):
        float_to_e8m0(f32([1.0, bad]))


def test_scale_to_float():
    s = f32([0.5, 4.0])
    assert scale_to_float(s) is s
    assert torch.equal(scale_to_float(float_to_e8m0(s)), s)
    assert scale_to_float(s.to(torch.bfloat16)).dtype == torch.float32


# ---------------------------------------------------------------- fp4 packing


def test_unpack_all_bytes_low_nibble_first():
    lut = E2M1 + [-v for v in E2M1]
    b = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(1, 256)
    vals = unpack_fp4(b)
    assert vals.shape == (1, 512)
    for byte in range(256):
        lo, hi = vals[0, 2 * byte].item(), vals[0, 2 * byte + 1].item()
        assert lo == lut[byte & 0xF] and hi == lut[byte >> 4]
    # int8 storage reads the same bytes
    assert torch.equal(unpack_fp4(b.view(torch.int8)), vals)


def test_pack_unpack_round_trip_all_codes():
    codes = torch.arange(16)
    lut = f32(E2M1 + [-0.0] + [-v for v in E2M1[1:]])
    values = lut[codes].reshape(2, 8)
    packed = pack_fp4(values)
    assert packed.dtype == torch.int8 and packed.shape == (2, 4)
    # byte j of row r holds codes (2j) low, (2j+1) high
    expected = [[(c0 | (c0 + 1) << 4) for c0 in range(r * 8, r * 8 + 8, 2)] for r in range(2)]
    assert packed.view(torch.uint8).tolist() == expected
    back = unpack_fp4(packed)
    assert torch.equal(back, values)
    assert torch.equal(torch.signbit(back), torch.signbit(values))  # -0.0 is code 8
    every_byte = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(torch.int8).view(4, 64)
    assert torch.equal(pack_fp4(unpack_fp4(every_byte)), every_byte)


def test_pack_fp4_layout_examples():
    assert pack_fp4(f32([[0.5, 6.0]])).view(torch.uint8).item() == 0x71
    assert pack_fp4(f32([[-1.0, 0.0]])).view(torch.uint8).item() == 0x0A
    assert pack_fp4(f32([[0.0, -6.0]])).item() == -16  # 0xF0 as int8


def test_pack_fp4_rejects():
    with pytest.raises(ValueError):
        pack_fp4(f32([[0.7, 1.0]]))
    with pytest.raises(ValueError):
        pack_fp4(f32([[8.0, 1.0]]))
    with pytest.raises(ValueError):
        pack_fp4(f32([[1.0, 1.0, 1.0]]))


# ---------------------------------------------------------------- dequantisation


@pytest.mark.parametrize("e8m0", [True, False])
def test_dequantize_fp8_ragged_against_loop(e8m0):
    gen = torch.Generator().manual_seed(7)
    out_dim, in_dim, block = 5, 7, 3
    w = (torch.randn(out_dim, in_dim, generator=gen) * 50).to(torch.float8_e4m3fn)
    exps = torch.randint(-4, 4, (2, 3), generator=gen)
    scale = torch.ldexp(torch.ones(2, 3), exps)
    stored = float_to_e8m0(scale) if e8m0 else scale
    got = dequantize_fp8(w, stored, block)
    expected = torch.empty(out_dim, in_dim)
    for i in range(out_dim):
        for j in range(in_dim):
            expected[i, j] = w[i, j].float() * scale[i // block, j // block]
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)


def test_dequantize_fp8_rejects_bad_scale_shape():
    w = torch.zeros(5, 7).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError):
        dequantize_fp8(w, torch.ones(2, 2), 3)


def test_dequantize_fp4_against_loop():
    gen = torch.Generator().manual_seed(8)
    packed = torch.randint(-128, 128, (3, 32), generator=gen, dtype=torch.int8)  # [3, 64]
    scale = torch.ldexp(torch.ones(3, 2), torch.randint(-3, 3, (3, 2), generator=gen))
    got = dequantize_fp4(packed, float_to_e8m0(scale), 32)
    vals = unpack_fp4(packed)
    expected = torch.empty(3, 64)
    for i in range(3):
        for j in range(64):
            expected[i, j] = vals[i, j] * scale[i, j // 32]
    assert torch.equal(got, expected)


# ---------------------------------------------------------------- weight quantisation


def test_quantize_weight_fp8_close_and_minimal_scale():
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(70, 45, generator=gen) * 0.02
    w[:32, :32] *= 1000  # tiles of very different magnitude
    q, s = quantize_weight_fp8(w, 32)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (3, 2)
    deq = dequantize_fp8(q, s, 32)
    sf = e8m0_to_float(s)
    se = sf.repeat_interleave(32, 0)[:70].repeat_interleave(32, 1)[:, :45]
    err = (deq - w).abs()
    assert bool((err <= 2.0**-4 * w.abs() + 2.0**-10 * se).all())  # e4m3: 3 mantissa bits
    assert (deq - w).norm() / w.norm() < 0.03
    # the smallest power-of-two scale that fits the tile, and round-to-nearest values
    for bi in range(3):
        for bj in range(2):
            tile = w[bi * 32:(bi + 1) * 32, bj * 32:(bj + 1) * 32]
            amax = tile.abs().max().item()
            assert amax / sf[bi, bj].item() <= FP8_MAX < amax / (sf[bi, bj].item() / 2)
            qt = q[bi * 32:(bi + 1) * 32, bj * 32:(bj + 1) * 32]
            assert torch.equal(qt.float(), (tile / sf[bi, bj]).to(torch.float8_e4m3fn).float())


def test_quantize_weight_fp8_exact_for_representable():
    gen = torch.Generator().manual_seed(10)
    block = 16
    tiles = [[e4m3_values(block * block, gen, amax=FP8_MAX).reshape(block, block) * 2.0**e
              for e in (-12, 3)] for _ in range(2)]
    w = torch.cat([torch.cat(row, dim=1) for row in tiles], dim=0)  # [32, 32]
    q, s = quantize_weight_fp8(w, block)
    assert torch.equal(dequantize_fp8(q, s, block), w)
    assert e8m0_to_float(s).tolist() == [[2.0**-12, 8.0], [2.0**-12, 8.0]]


def test_quantize_weight_fp8_zero_tile():
    w = torch.zeros(4, 40)
    w[0, 35] = 1.5
    q, s = quantize_weight_fp8(w, 32)
    assert torch.equal(dequantize_fp8(q, s, 32), w)
    assert bool(torch.isfinite(e8m0_to_float(s)).all())


def test_quantize_weight_fp4_close_and_matches_simulation():
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(16, 96, generator=gen) * 0.05
    packed, s = quantize_weight_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (16, 48)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (16, 3)
    deq = dequantize_fp4(packed, s)
    se = e8m0_to_float(s).repeat_interleave(32, 1)
    err = (deq - w).abs()
    assert bool((err <= 0.25 * w.abs() + 0.25 * se).all())  # half a grid step
    assert (deq - w).norm() / w.norm() < 0.15
    assert torch.equal(deq, fp4_simulate(w, 32))


def test_quantize_weight_fp4_exact_for_representable():
    gen = torch.Generator().manual_seed(12)
    grid = f32(E2M1 + [-v for v in E2M1[1:]])
    vals = grid[torch.randint(0, len(grid), (4, 64), generator=gen)]
    vals[:, 0] = 6.0
    vals[:, 32] = -4.0  # amax 4 -> scale 1 as well
    scales = torch.ldexp(torch.ones(4, 2), torch.tensor([[-3, 0], [2, -10], [5, 5], [-1, 7]]))
    w = vals * scales.repeat_interleave(32, 1)
    packed, s = quantize_weight_fp4(w)
    assert torch.equal(dequantize_fp4(packed, s), w)
    assert torch.equal(e8m0_to_float(s), scales)
    assert torch.equal(unpack_fp4(packed), vals)


def test_quantize_weight_fp4_rejects_odd():
    with pytest.raises(ValueError):
        quantize_weight_fp4(torch.ones(2, 33))


# ---------------------------------------------------------------- hadamard


@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_hadamard_orthonormal_sylvester(n):
    h = hadamard(torch.eye(n))
    assert torch.allclose(h @ h.T, torch.eye(n), atol=1e-6)
    for i in range(n):
        for j in range(n):
            sign = -1.0 if bin(i & j).count("1") % 2 else 1.0
            assert h[i, j].item() == pytest.approx(sign / math.sqrt(n), abs=1e-7)


def test_hadamard_preserves_dot_products_and_is_involution():
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(5, 128, generator=gen)
    y = torch.randn(5, 128, generator=gen)
    hx, hy = hadamard(x), hadamard(y)
    assert torch.allclose((hx * hy).sum(-1), (x * y).sum(-1), atol=1e-4)
    assert torch.allclose(hadamard(hx), x, atol=1e-5)
    assert hadamard(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_hadamard_butterflies_are_within_rounding_of_the_matrix_product():
    """The butterflies give x times the Sylvester matrix over sqrt(n) (float64's product) within fp32 rounding."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 128, generator=gen, dtype=torch.float64)
    h = torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(128)] for i in range(128)], dtype=torch.float64)
    want = x @ h / math.sqrt(128)
    assert torch.allclose(hadamard(x.float()).double(), want, rtol=0, atol=4e-6)


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError):
        hadamard(torch.ones(3, 12))


def test_e4m3_to_float_is_the_cast_bitwise_for_every_code():
    """The bit-operation decode (CPU eager) equals torch's cast for all 256 codes, NaN codes included, in a
    non-contiguous view too."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    grid = codes.view(16, 16)
    for c in (codes, grid, grid.t(), grid[:, ::3], codes[:0]):
        got, want = e4m3_to_float(c), c.float()
        assert got.shape == want.shape and got.dtype == torch.float32
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(0.0).view(torch.int32), want.nan_to_num(0.0).view(torch.int32))
    sub = codes.view(torch.uint8)[1:8].view(torch.float8_e4m3fn)  # the subnormal codes: 2**-9 .. 7 * 2**-9
    assert torch.equal(e4m3_to_float(sub), torch.arange(1, 8) * 2.0**-9)


def test_dequantize_act_decodes_fp8_codes_as_the_cast():
    x = torch.randn(3, 5, 200) * torch.logspace(-30, 10, 200)
    codes, scale = quantize_act_fp8(x, 64)
    vb = codes.float().nan_to_num(0.0)
    want = (torch.nn.functional.pad(vb, (0, 56)).view(3, 5, 4, 64) * scale.unsqueeze(-1)).view(3, 5, 256)[..., :200]
    assert torch.equal(dequantize_act(codes, scale, 64), want)
    assert torch.equal(dequantize_act(codes, scale, 64), fp8_simulate(x, 64))
