"""mhcrun/nki/kernels.py on the NKI simulator against the torch reference ops (mhcrun/ops).

Tolerances (fp32 engine math everywhere; the kernels only reorder or fuse fp32 roundings):
- hc_mixes against the reference on fn = hi + lo (the GEMM itself): 5e-6 absolute on pre / post / comb
  (values of order 1; measured <= 2.4e-6, the largest at n*d = 16384 where the two fp32 dot products of
  16384 terms sum in different orders; <= 1e-6 at d <= 256).
- the same against the reference on the unsplit fp32 fn: 2e-5 absolute (the bf16 hi/lo split keeps 16
  mantissa bits of fn, |fn - hi - lo| <= 2^-17 |fn|; measured <= 5.4e-6).
- hc_collapse / hc_attn_out / hc_expand: fp32 outputs within 1e-6 relative (measured: bit-exact),
  bf16 outputs within 1 bf16 ulp of the reference (measured: bit-exact).
- hc_head, rmsnorm: fp32 within 1e-5 relative; bf16 within 1 bf16 ulp (a fp32 value that differs in its
  last bits can round to the neighbouring bf16) plus 1e-5 absolute for hc_head (where the collapse cancels
  to ~0, the ~1e-6 relative error of the pre weights is larger than a bf16 ulp of the result).
- swiglu (fp32 output): 1e-5 relative.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch

sim = pytest.importorskip("mhcrun.nki.sim", reason="mhcrun's NKI simulator (mhcrun/nki/sim) is not present")

from mhcrun.ops import hc as ref  # noqa: E402
from mhcrun.ops.moe import swiglu as ref_swiglu  # noqa: E402
from mhcrun.ops.norm import rms_norm as ref_rms_norm  # noqa: E402

KERNELS_PY = Path(__file__).resolve().parents[1] / "mhcrun" / "nki" / "kernels.py"
N = 4
MIX = (2 + N) * N
TOKENS = (1, 127, 128, 129, 300)
# (T, d): every T with the tiny model's d=128 and with d=256; d=4096 (V4-Flash) on two T values.
SHAPES = [*itertools.product(TOKENS, (128, 256)), (1, 4096), (129, 4096)]
DTYPES = (torch.float32, torch.bfloat16)
SHAPE_IDS = [f"T{t}-d{d}" for t, d in SHAPES]


@pytest.fixture(scope="module")
def K():
    return sim.load_kernel_module(KERNELS_PY)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _split(fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi = fn.to(torch.bfloat16)
    return hi, (fn - hi.float()).to(torch.bfloat16)


def _streams(t: int, d: int, dtype, g) -> torch.Tensor:
    """X [1, T, n, d] as the model holds it."""
    return torch.randn(1, t, N, d, generator=g).to(dtype)


def _mix_params(t: int, d: int, rows: int, g, scale_n: int):
    fn = torch.randn(rows, N * d, generator=g) * (N * d) ** -0.5
    scale = torch.rand(scale_n, generator=g) + 0.5
    base = torch.randn(rows, generator=g) * 0.5
    return fn, scale, base


def assert_bf16_ulps(out: torch.Tensor, want: torch.Tensor, ulps: int = 1, atol: float = 0.0) -> None:
    """|out - want| <= ulps * (bf16 spacing at |want|) + atol, elementwise (atol covers cancellation near 0)."""
    assert out.dtype == torch.bfloat16 and out.shape == want.shape
    o, w = out.float(), want.float()
    exp = torch.floor(torch.log2(w.abs().clamp_min(2.0**-126)))
    spacing = torch.exp2(exp - 7)
    bad = (o - w).abs() > ulps * spacing + atol
    assert not bad.any(), f"{int(bad.sum())} elements beyond {ulps} bf16 ulp, max |diff| {(o - w).abs().max()}"


def assert_close_dtype(out: torch.Tensor, want: torch.Tensor, rtol: float, atol: float = 1e-6) -> None:
    if want.dtype == torch.bfloat16:
        assert_bf16_ulps(out, want, atol=atol)
    else:
        torch.testing.assert_close(out, want, rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------------------ the source itself


def test_kernel_source_imports_only_nki():
    src = KERNELS_PY.read_text()
    assert src.splitlines()[:3] == ["import nki", "import nki.language as nl", "import nki.isa as nisa"]
    imported, names = set(), set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
        elif isinstance(node, ast.Name):
            names.add(node.id)
    assert imported == {"nki", "nki.language", "nki.isa"}
    assert not names & {"torch", "mhcrun", "numpy", "np", "importlib", "__import__", "exec", "eval"}


def test_mixes_supported_truth_table(K):
    ok = K.mixes_supported
    assert ok(4, 20, 1e-6, 1e-6) and ok(4, 20, 1e-6, 1e-20)
    assert not ok(8, 20, 1e-6, 1e-6)
    assert not ok(4, 10, 1e-6, 1e-6)
    assert not ok(4, 20, 1e-5, 1e-6)
    assert not ok(4, 20, 1e-6, 1e-5)
    assert not ok(4, 20, 1e-6, 0.0)


# ------------------------------------------------------------------------------------------ mHC kernels


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "d"), SHAPES, ids=SHAPE_IDS)
def test_hc_mixes(K, t, d, dtype):
    g = _gen(t * 7 + d)
    x = _streams(t, d, dtype, g)
    fn, scale, base = _mix_params(t, d, MIX, g, 3)
    hi, lo = _split(fn)
    pre, post, comb = K.hc_mixes_v4(x.reshape(t, N * d), hi, lo, scale, base)
    assert (pre.shape, post.shape, comb.shape) == ((t, N), (t, N), (t, N * N))
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    got = (pre, post, comb.view(t, N, N))
    # the kernel's GEMM is exact up to fp32 rounding: compare with the reference on fn = hi + lo ...
    exact = [r[0] for r in ref.hc_mixes(x, hi.float() + lo.float(), scale, base, N, 20, 1e-6, 1e-6)]
    for a, b in zip(got, exact, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-6)
    # ... and the hi/lo split stays within 2e-5 of the fp32 fn.
    want = [r[0] for r in ref.hc_mixes(x, fn, scale, base, N, 20, 1e-6, 1e-6)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    # Sinkhorn ends on a column step: every column sums to 1 (up to hc_eps).
    torch.testing.assert_close(got[2].sum(dim=-2), torch.ones(t, N), rtol=0, atol=1e-5)
    assert (pre > 0).all() and (pre < 1 + 2e-6).all() and (post > 0).all() and (post < 2).all()


def test_hc_mixes_norm_eps_variants(K):
    """V4.1's 1e-20 matters for tiny activations: each variant matches the reference with its own epsilon."""
    g = _gen(11)
    t, d = 129, 128
    x = _streams(t, d, torch.float32, g) * 1e-4  # mean(x^2) ~ 1e-8, so an epsilon of 1e-6 dominates it
    fn, scale, base = _mix_params(t, d, MIX, g, 3)
    hi, lo = _split(fn)
    fn_eff = hi.float() + lo.float()
    for kernel, eps in ((K.hc_mixes_v4, 1e-6), (K.hc_mixes_v41, 1e-20)):
        pre, post, comb = kernel(x.reshape(t, N * d), hi, lo, scale, base)
        want = [r[0] for r in ref.hc_mixes(x, fn_eff, scale, base, N, 20, 1e-6, eps)]
        for a, b in zip((pre, post, comb.view(t, N, N)), want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
    v4 = K.hc_mixes_v4(x.reshape(t, N * d), hi, lo, scale, base)[0]
    v41 = K.hc_mixes_v41(x.reshape(t, N * d), hi, lo, scale, base)[0]
    assert (v4 - v41).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "d"), SHAPES, ids=SHAPE_IDS)
def test_hc_expand(K, t, d, dtype):
    e = torch.randn(1, t, d, generator=_gen(t + d)).to(dtype)
    out = K.hc_expand(e[0])
    assert out.dtype == dtype and out.shape == (t, N * d)
    assert torch.equal(out.view(1, t, N, d), ref.hc_expand(e, N))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "d"), SHAPES, ids=SHAPE_IDS)
def test_hc_collapse(K, t, d, dtype):
    g = _gen(t * 3 + d)
    x = _streams(t, d, dtype, g)
    pre = torch.rand(1, t, N, generator=g) + 0.1
    out = K.hc_collapse(x.reshape(t, N * d), pre[0])
    assert out.dtype == dtype and out.shape == (t, d)
    assert_close_dtype(out.view(1, t, d), ref.hc_collapse(x, pre), rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "d"), SHAPES, ids=SHAPE_IDS)
def test_hc_attn_out(K, t, d, dtype):
    g = _gen(t * 5 + d)
    y = torch.randn(1, t, d, generator=g).to(dtype)
    residual = _streams(t, d, dtype, g)
    post = 2 * torch.rand(1, t, N, generator=g)
    comb = ref.sinkhorn(torch.randn(1, t, N, N, generator=g), 20, 1e-6)
    out = K.hc_attn_out(y[0], residual.reshape(t, N * d), post[0], comb.reshape(t, N * N))
    assert out.dtype == dtype and out.shape == (t, N * d)
    assert_close_dtype(out.view(1, t, N, d), ref.hc_post(y, residual, post, comb), rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "d"), SHAPES, ids=SHAPE_IDS)
def test_hc_head(K, t, d, dtype):
    g = _gen(t * 13 + d)
    x = _streams(t, d, dtype, g)
    fn, scale, base = _mix_params(t, d, N, g, 1)
    hi, lo = _split(fn)
    out = K.hc_head_v4(x.reshape(t, N * d), hi, lo, scale, base)
    assert out.dtype == dtype and out.shape == (t, d)
    want = ref.hc_head(x, hi.float() + lo.float(), scale, base, 1e-6, 1e-6)
    assert_close_dtype(out.view(1, t, d), want, rtol=1e-5, atol=1e-5)
    # the head kernel is mixes (no Sinkhorn) + collapse: same pre weights as the reference's
    pre = torch.sigmoid(ref.hc_norm_mixes(x, hi.float() + lo.float(), 1e-6) * scale + base) + 1e-6
    assert_close_dtype(out.view(1, t, d), ref.hc_collapse(x, pre), rtol=1e-5, atol=1e-5)


def test_hc_head_v41(K):
    g = _gen(17)
    t, d = 128, 256
    x = _streams(t, d, torch.float32, g)
    fn, scale, base = _mix_params(t, d, N, g, 1)
    hi, lo = _split(fn)
    out = K.hc_head_v41(x.reshape(t, N * d), hi, lo, scale, base)
    want = ref.hc_head(x, hi.float() + lo.float(), scale, base, 1e-6, 1e-20)
    torch.testing.assert_close(out.view(1, t, d), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ RMSNorm, SwiGLU


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "d"), [*SHAPES, (129, 200)], ids=[*SHAPE_IDS, "T129-d200"])
def test_rmsnorm(K, t, d, dtype):
    g = _gen(t * 19 + d)
    x = (torch.randn(t, d, generator=g) * 3).to(dtype)
    w = torch.randn(d, generator=g)
    for eps in (1e-6, 1e-20):
        out = K.rmsnorm(x, w, eps)
        assert out.dtype == dtype and out.shape == (t, d)
        assert_close_dtype(out, ref_rms_norm(x, w, eps), rtol=1e-5)


@pytest.mark.parametrize("limit", [10.0, 0.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "f"), [(1, 128), (129, 200), (300, 2048)], ids=["T1-f128", "T129-f200", "T300-f2048"])
def test_swiglu(K, t, f, dtype, limit):
    g = _gen(t * 23 + f)
    gate = (torch.randn(t, f, generator=g) * 8).to(dtype)
    up = (torch.randn(t, f, generator=g) * 8).to(dtype)
    out = K.swiglu(gate, up, limit)
    assert out.dtype == torch.float32 and out.shape == (t, f)
    torch.testing.assert_close(out, ref_swiglu(gate, up, limit), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ device-like numerics
#
# The same kernels with every Scalar-engine activation off by up to mhcrun.nki.sim.numerics.ACT_REL_ERR (2^-9),
# compared at AWS's simulator-versus-hardware rtol 1e-2 plus an absolute part of DEVICE_RANGE_TOL times the
# output's largest magnitude: an output that is a sum (a collapse, a normalised Sinkhorn entry) carries the
# activations' relative error of its largest terms, which near a cancellation is far more than 1e-2 of its own
# value (AWS's atol 1e-5 is for outputs of order 1). Kernels without approximated activations (expand, collapse,
# post) are unchanged by the mode.

DEVICE_RANGE_TOL = 3e-3


def assert_device_close(out: torch.Tensor, want: torch.Tensor) -> None:
    o, w = out.double(), want.double()
    atol = DEVICE_RANGE_TOL * w.abs().max().item()
    if want.dtype == torch.bfloat16:  # plus the bf16 rounding of the stored result
        atol += 2.0**-8 * w.abs().max().item()
    torch.testing.assert_close(o, w, rtol=1e-2, atol=atol)

DEVICE_SHAPES = [(1, 128), (129, 256), (1, 4096), (129, 4096)]
DEVICE_IDS = [f"T{t}-d{d}" for t, d in DEVICE_SHAPES]


@pytest.fixture(scope="module")
def KD():
    return sim.load_kernel_module(KERNELS_PY, numerics="device")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "d"), DEVICE_SHAPES, ids=DEVICE_IDS)
def test_device_numerics_mixes_and_head(K, KD, t, d, dtype):
    g = _gen(t * 29 + d)
    x = _streams(t, d, dtype, g)
    fn, scale, base = _mix_params(t, d, MIX, g, 3)
    hi, lo = _split(fn)
    got = KD.hc_mixes_v4(x.reshape(t, N * d), hi, lo, scale, base)
    exact = K.hc_mixes_v4(x.reshape(t, N * d), hi, lo, scale, base)
    want = [r[0].reshape(g_.shape) for r, g_ in zip(ref.hc_mixes(x, fn, scale, base, N, 20, 1e-6, 1e-6), got,
                                                    strict=True)]
    for a, b, e in zip(got, want, exact, strict=True):
        assert_device_close(a, b)
        assert (a - e).abs().max() > 1e-6  # the mode changed the result
    off = ref.hc_mixes(x, fn, scale, base + 0.05, N, 20, 1e-6, 1e-6)[0][0]  # a small bug: the tolerance sees it
    with pytest.raises(AssertionError):
        assert_device_close(got[0], off)
    hfn, hscale, hbase = _mix_params(t, d, N, g, 1)
    hhi, hlo = _split(hfn)
    out = KD.hc_head_v4(x.reshape(t, N * d), hhi, hlo, hscale, hbase)
    assert_device_close(out, ref.hc_head(x, hfn, hscale, hbase, 1e-6, 1e-6).view(t, d))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "d"), DEVICE_SHAPES, ids=DEVICE_IDS)
def test_device_numerics_rmsnorm_swiglu(KD, t, d, dtype):
    g = _gen(t * 31 + d)
    x = (torch.randn(t, d, generator=g) * 3).to(dtype)
    w = torch.randn(d, generator=g)
    assert_device_close(KD.rmsnorm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6))
    gate, up = (torch.randn(t, d, generator=g) * 8).to(dtype), (torch.randn(t, d, generator=g) * 8).to(dtype)
    assert_device_close(KD.swiglu(gate, up, 10.0), ref_swiglu(gate, up, 10.0))


@pytest.mark.parametrize(("t", "d"), DEVICE_SHAPES, ids=DEVICE_IDS)
def test_device_numerics_leave_the_linear_steps_alone(K, KD, t, d):
    g = _gen(t * 37 + d)
    x = _streams(t, d, torch.bfloat16, g)
    pre = torch.rand(t, N, generator=g) + 0.1
    assert torch.equal(KD.hc_collapse(x.reshape(t, N * d), pre), K.hc_collapse(x.reshape(t, N * d), pre))
    y = torch.randn(t, d, generator=g).to(torch.bfloat16)
    post, comb = 2 * torch.rand(t, N, generator=g), torch.rand(t, N * N, generator=g)
    assert torch.equal(KD.hc_attn_out(y, x.reshape(t, N * d), post, comb),
                       K.hc_attn_out(y, x.reshape(t, N * d), post, comb))


# ------------------------------------------------------------------------------------------ fused pre / post
#
# hc_pre = mixes + collapse + the sublayer's RMSNorm in one kernel, hc_post = the post step, each in the layout
# its T asks for: hidden on the partitions for T <= DECODE_MAX_T (decode rows), tokens on the partitions above.
# post / comb within 5e-6 as hc_mixes (the hidden layout sums the GEMM in another order); y in fp32 within 1e-5
# relative, in bf16 within 2 ulps: it is rounded twice (the collapse to bf16, then the norm), and a pre weight
# ~1e-6 off can flip the first rounding by one ulp.

PRE_SHAPES = [(1, 128), (4, 128), (16, 256), (32, 128), (1, 4096), (4, 4096), (16, 4096), (33, 128), (129, 256),
              (300, 128), (129, 4096)]  # fmt: skip
PRE_IDS = [f"T{t}-d{d}" for t, d in PRE_SHAPES]


def _pre_case(t, d, dtype, seed):
    g = _gen(seed)
    x = _streams(t, d, dtype, g)
    fn, scale, base = _mix_params(t, d, MIX, g, 3)
    hi, lo = _split(fn)
    w = torch.randn(d, generator=g)
    pre, post, comb = (r[0] for r in ref.hc_mixes(x, hi.float() + lo.float(), scale, base, N, 20, 1e-6, 1e-6))
    y = ref_rms_norm(ref.hc_collapse(x, pre[None]), w, 1e-6)[0]
    return (x.reshape(t, N * d), hi, lo, scale, base, w), (y, post, comb.reshape(t, N * N))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "d"), PRE_SHAPES, ids=PRE_IDS)
def test_hc_pre(K, t, d, dtype):
    args, (y, post, comb) = _pre_case(t, d, dtype, t * 41 + d)
    kernels = [K.hc_pre_v4] + ([K.hc_pre_tokens_v4] if t <= K.DECODE_MAX_T else [])  # both layouts at decode T
    for kernel in kernels:
        gy, gpost, gcomb = kernel(*args)
        assert gy.dtype == dtype and gy.shape == (t, d)
        torch.testing.assert_close(gpost, post, rtol=0, atol=5e-6)
        torch.testing.assert_close(gcomb, comb, rtol=0, atol=5e-6)
        if dtype == torch.bfloat16:
            assert_bf16_ulps(gy, y, ulps=2, atol=1e-5)
        else:
            torch.testing.assert_close(gy, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("t", "d"), [(1, 4096), (16, 256), (129, 256)], ids=["T1-d4096", "T16-d256", "T129-d256"])
def test_hc_pre_device_numerics(K, KD, t, d):
    args, (y, post, comb) = _pre_case(t, d, torch.bfloat16, t * 43 + d)
    gy, gpost, gcomb = KD.hc_pre_v4(*args)
    assert_device_close(gpost, post)
    assert_device_close(gcomb, comb)
    assert_device_close(gy, y)
    assert not torch.equal(gcomb, K.hc_pre_v4(*args)[2])


def test_hc_pre_v41_epsilon(K):
    args, _ = _pre_case(4, 128, torch.float32, 5)
    x = args[0] * 1e-4
    a = (x, *args[1:])
    want = [r[0] for r in ref.hc_mixes(x.view(1, 4, N, 128), args[1].float() + args[2].float(), args[3], args[4], N,
                                       20, 1e-6, 1e-20)]
    torch.testing.assert_close(K.hc_pre_v41(*a)[1], want[1], rtol=0, atol=5e-6)
    assert (K.hc_pre_v41(*a)[1] - K.hc_pre_v4(*a)[1]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "d"), [(1, 128), (4, 4096), (32, 256), (33, 128), (129, 256)],
                         ids=["T1-d128", "T4-d4096", "T32-d256", "T33-d128", "T129-d256"])
def test_hc_post_layouts(K, KD, t, d, dtype):
    g = _gen(t * 47 + d)
    y = torch.randn(1, t, d, generator=g).to(dtype)
    residual = _streams(t, d, dtype, g)
    post = 2 * torch.rand(1, t, N, generator=g)
    comb = ref.sinkhorn(torch.randn(1, t, N, N, generator=g), 20, 1e-6)
    args = (y[0], residual.reshape(t, N * d), post[0], comb.reshape(t, N * N))
    want = ref.hc_post(y, residual, post, comb).view(t, N * d)
    out = K.hc_post(*args)
    assert out.dtype == dtype and out.shape == (t, N * d)
    assert_close_dtype(out, want, rtol=1e-6)
    assert torch.equal(KD.hc_post(*args), out)  # no activation: the device mode leaves it as is


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "d"), [(1, 128), (4, 4096), (32, 256)], ids=["T1-d128", "T4-d4096", "T32-d256"])
def test_hc_post_pre_equals_post_then_pre(K, KD, t, d, dtype):
    """One launch for a site's post and the next site's pre: the same values as the two kernels one after the
    other (bit for bit, in both numerics), the streams kept in SBUF between them."""
    g = _gen(t * 53 + d)
    y = torch.randn(t, d, generator=g).to(dtype)
    residual = _streams(t, d, dtype, g).reshape(t, N * d)
    post = 2 * torch.rand(t, N, generator=g)
    comb = ref.sinkhorn(torch.randn(1, t, N, N, generator=g), 20, 1e-6).reshape(t, N * N)
    (_, hi, lo, scale, base, w), _ = _pre_case(t, d, dtype, t + d)
    for kern in (K, KD):
        got = kern.hc_post_pre_v4(y, residual, post, comb, hi, lo, scale, base, w)
        x_new = kern.hc_post(y, residual, post, comb)
        want = (x_new, *kern.hc_pre_v4(x_new, hi, lo, scale, base, w))
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    with pytest.raises(AssertionError, match="at most DECODE_MAX_T rows"):  # the kernel's own assert
        big = 33
        K.hc_post_pre_v4(torch.zeros(big, d, dtype=dtype), torch.zeros(big, N * d, dtype=dtype),
                         torch.zeros(big, N), torch.zeros(big, N * N), hi, lo, scale, base, w)
