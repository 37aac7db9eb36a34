"""Hand-derived checks of the plain-torch reference ops (mHC, norm, RoPE, attention, indexer, compressor,
MoE, linear). Expected values come from explicit Python loops over the spec's formulas
(/work/shared/spec/deepseek-v4.md) or from numbers worked out by hand, never from the op itself."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mhcrun.ops.attention import (
    closed_mask,
    query_bytes,
    query_slices,
    sparse_attn,
    window_mask,
)
from mhcrun.ops.compress import add_to_open_group, compress_chunk, overlap_transform, stays_open
from mhcrun.ops.hc import (
    hc_collapse,
    hc_expand,
    hc_head,
    hc_mixes,
    hc_norm_mixes,
    hc_post,
    hc_split_sinkhorn,
    sinkhorn,
)
from mhcrun.ops.index import entry_step, index_scores, rank_keys, select_topk, select_topk_sliced
from mhcrun.ops.moe import gate_scores, route, swiglu
from mhcrun.ops.norm import rms_norm
from mhcrun.ops.qlinear import qlinear
from mhcrun.ops.qweight import QWeight
from mhcrun.ops.rope import apply_rope, apply_rope_tail, precompute_freqs_cis

N = 4  # hc_mult
MIX = (2 + N) * N
HC_EPS = 1e-6


def linear(x: torch.Tensor, w: torch.Tensor, act_quant: bool = False) -> torch.Tensor:
    """A float weight through qlinear, as a loaded Linear holds it."""
    return qlinear(x, QWeight(w).checked(), act_quant)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype)


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def silu(v: float) -> float:
    return v * sigmoid(v)


def close(actual: torch.Tensor, expected, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------------------------
# mHC
# ---------------------------------------------------------------------------------------------------------------

def loop_sinkhorn(c: list[list[float]], iters: int, eps: float) -> list[list[float]]:
    """The spec's recipe on one n x n matrix (rows = first index), in float64 Python."""
    n = len(c)
    out = []
    for row in c:  # softmax over the last axis, + eps
        m = max(row)
        e = [math.exp(v - m) for v in row]
        s = sum(e)
        out.append([v / s + eps for v in e])

    def col_step(a):
        sums = [sum(a[i][j] for i in range(n)) for j in range(n)]
        return [[a[i][j] / (sums[j] + eps) for j in range(n)] for i in range(n)]

    def row_step(a):
        return [[a[i][j] / (sum(a[i]) + eps) for j in range(n)] for i in range(n)]

    out = col_step(out)
    for _ in range(iters - 1):
        out = col_step(row_step(out))
    return out


def loop_sinkhorn_batched(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    flat = c.double().reshape(-1, c.shape[-2], c.shape[-1])
    res = [loop_sinkhorn(m.tolist(), iters, eps) for m in flat]
    return torch.tensor(res, dtype=torch.float64).reshape(c.shape)


def row_col_err(c: torch.Tensor) -> tuple[float, float]:
    return (c.double().sum(-1) - 1).abs().max().item(), (c.double().sum(-2) - 1).abs().max().item()


@pytest.mark.parametrize("shape", [(N, N), (2, 3, N, N), (3, 5, N, N)])
def test_sinkhorn_random_is_doubly_stochastic_and_matches_loop(shape):
    c = randn(*shape, seed=1)
    out = sinkhorn(c, 20, HC_EPS)
    assert out.shape == c.shape and out.dtype == torch.float32
    rows, cols = row_col_err(out)
    assert rows < 1e-5 and cols < 1e-5
    assert (out >= 0).all()
    close(out, loop_sinkhorn_batched(c, 20, HC_EPS), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scale", [10.0, 100.0, 1000.0])
def test_sinkhorn_extreme_logits(scale):
    # large random logits over batch and seq dims: finite, columns exact (the last step), and the same as the loop
    c = randn(2, 3, N, N, seed=2, scale=scale)
    out = sinkhorn(c, 20, HC_EPS)
    assert torch.isfinite(out).all()
    assert ((out >= 0) & (out <= 1 + 1e-6)).all()
    _, cols = row_col_err(out)
    assert cols < 1e-5
    close(out, loop_sinkhorn_batched(c, 20, HC_EPS), atol=1e-5, rtol=1e-4)
    # large logits on a permutation (over batch and seq dims): every row and column holds one large and three
    # equal small entries, so the result is doubly stochastic and keeps the permutation
    perm = torch.tensor([2, 0, 3, 1])
    p = (F.one_hot(perm, N).float() * scale).expand(2, 3, N, N)
    out = sinkhorn(p, 20, HC_EPS)
    rows, cols = row_col_err(out)
    assert rows < 1e-5 and cols < 1e-5
    assert (out.argmax(-1) == perm).all()
    # all rows peaked on the same column: balanced to uniform
    same = torch.zeros(N, N)
    same[:, 0] = scale
    out = sinkhorn(same, 20, HC_EPS)
    rows, cols = row_col_err(out)
    assert rows < 1e-5 and cols < 1e-5
    close(out, torch.full((N, N), 0.25), atol=1e-5)


def test_sinkhorn_ends_on_a_column_step():
    # few iterations on a far-from-balanced input: the columns are normalised last, the rows are not
    c = randn(5, N, N, seed=4, scale=3.0)
    for iters in (1, 2, 3):
        out = sinkhorn(c, iters, HC_EPS)
        rows, cols = row_col_err(out)
        assert cols < 1e-5
        assert rows > 100 * cols
        close(out, loop_sinkhorn_batched(c, iters, HC_EPS), atol=1e-6)
    # one iteration = softmax(+eps) then one column step, nothing else
    out = sinkhorn(c, 1, 0.0)
    sm = [[math.exp(v) / sum(math.exp(w) for w in row) for v in row] for row in c[0].tolist()]
    cols = [sum(sm[i][j] for i in range(N)) for j in range(N)]
    close(out[0], [[sm[i][j] / cols[j] for j in range(N)] for i in range(N)], atol=1e-6)


def loop_split(mix: list[float], scale: list[float], base: list[float], iters: int, eps: float):
    pre = [sigmoid(mix[m] * scale[0] + base[m]) + eps for m in range(N)]
    post = [2.0 * sigmoid(mix[N + m] * scale[1] + base[N + m]) for m in range(N)]
    c = [[mix[2 * N + i * N + j] * scale[2] + base[2 * N + i * N + j] for j in range(N)] for i in range(N)]
    return pre, post, loop_sinkhorn(c, iters, eps)


def test_hc_split_sinkhorn_layout_and_scale_pairing():
    b, s = 2, 3
    mixes = randn(b, s, MIX, seed=5)
    scale = torch.tensor([0.5, 2.0, -1.5])  # distinct, so any mis-pairing shows
    base = randn(MIX, seed=6)
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, N, 20, HC_EPS)
    assert pre.shape == (b, s, N) and post.shape == (b, s, N) and comb.shape == (b, s, N, N)
    for i in range(b):
        for j in range(s):
            e_pre, e_post, e_comb = loop_split(mixes[i, j].tolist(), scale.tolist(), base.tolist(), 20, HC_EPS)
            close(pre[i, j], e_pre, atol=1e-6)
            close(post[i, j], e_post, atol=1e-6)
            close(comb[i, j], e_comb, atol=1e-6)
    # pre in (eps, 1 + eps), post in (0, 2)
    assert (pre > HC_EPS).all() and (pre < 1 + 2 * HC_EPS).all()
    assert (post > 0).all() and (post < 2).all()


def test_hc_split_sinkhorn_hand_values():
    # mixes all zero: pre = sigmoid(base) + eps, post = 2 sigmoid(base), comb from base only
    mixes = torch.zeros(1, 1, MIX)
    base = torch.zeros(MIX)
    base[0], base[N + 1] = math.log(3.0), -math.log(3.0)  # sigmoid(ln 3) = 3/4, sigmoid(-ln 3) = 1/4
    pre, post, comb = hc_split_sinkhorn(mixes, torch.ones(3), base, N, 20, HC_EPS)
    close(pre[0, 0], [0.75 + HC_EPS, 0.5 + HC_EPS, 0.5 + HC_EPS, 0.5 + HC_EPS], atol=1e-7)
    close(post[0, 0], [1.0, 0.5, 1.0, 1.0], atol=1e-7)
    close(comb[0, 0], torch.full((N, N), 0.25), atol=1e-6)  # uniform logits stay uniform


def loop_norm_mixes(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    b, s, n, d = x.shape
    out = torch.zeros(b, s, fn.shape[0], dtype=torch.float64)
    for i in range(b):
        for j in range(s):
            row = [float(x[i, j, m, k]) for m in range(n) for k in range(d)]  # stream-major flatten
            r = 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + eps)
            for o in range(fn.shape[0]):
                out[i, j, o] = sum(row[k] * float(fn[o, k]) for k in range(len(row))) * r
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_norm_mixes_vs_loop(dtype):
    d = 8
    x = randn(2, 3, N, d, seed=7, scale=3.0, dtype=dtype)
    fn = randn(MIX, N * d, seed=8, scale=0.2)
    out = hc_norm_mixes(x, fn, 1e-6)
    assert out.dtype == torch.float32 and out.shape == (2, 3, MIX)
    close(out, loop_norm_mixes(x.float(), fn, 1e-6), atol=1e-5, rtol=1e-5)


def test_hc_norm_mixes_eps_matters_for_tiny_rows():
    # rms eps 1e-20 (V4.1) vs 1e-6: a row of 1e-4's has mean square 1e-8, so eps = 1e-6 changes r a lot
    x = torch.full((1, 1, N, 2), 1e-4)
    fn = torch.ones(MIX, N * 2)
    small = hc_norm_mixes(x, fn, 1e-20)
    big = hc_norm_mixes(x, fn, 1e-6)
    close(small, torch.full((1, 1, MIX), 8 * 1e-4 / 1e-4), rtol=1e-5)  # (sum x) * rsqrt(1e-8) = 8e-4 * 1e4
    close(big, torch.full((1, 1, MIX), 8e-4 / math.sqrt(1e-8 + 1e-6)), rtol=1e-5)


def test_hc_mixes_composes_norm_and_split():
    d = 4
    x = randn(1, 2, N, d, seed=9)
    fn = randn(MIX, N * d, seed=10, scale=0.3)
    scale = torch.tensor([1.5, 0.7, 2.0])
    base = randn(MIX, seed=11, scale=0.5)
    pre, post, comb = hc_mixes(x, fn, scale, base, N, 20, HC_EPS, 1e-6)
    raw = loop_norm_mixes(x, fn, 1e-6)
    for j in range(2):
        e_pre, e_post, e_comb = loop_split(raw[0, j].tolist(), scale.tolist(), base.tolist(), 20, HC_EPS)
        close(pre[0, j], e_pre, atol=1e-5)
        close(post[0, j], e_post, atol=1e-5)
        close(comb[0, j], e_comb, atol=1e-5)


def test_hc_expand():
    e = randn(2, 3, 5, seed=12, dtype=torch.bfloat16)
    x = hc_expand(e, N)
    assert x.shape == (2, 3, N, 5) and x.dtype == torch.bfloat16
    for m in range(N):
        assert torch.equal(x[:, :, m], e)
    x[:, :, 0] += 1  # independent copies, not views of one another
    assert torch.equal(x[:, :, 1], e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_collapse_vs_loop(dtype):
    b, s, d = 2, 3, 5
    x = randn(b, s, N, d, seed=13, dtype=dtype)
    pre = torch.rand(b, s, N, generator=gen(14)) + 0.1
    out = hc_collapse(x, pre)
    assert out.shape == (b, s, d) and out.dtype == dtype
    exp = torch.zeros(b, s, d, dtype=torch.float64)
    for i in range(b):
        for j in range(s):
            for k in range(d):
                exp[i, j, k] = sum(float(pre[i, j, m]) * float(x[i, j, m, k]) for m in range(N))
    if dtype == torch.float32:
        close(out, exp, atol=1e-6)
    else:  # fp32 math, one rounding to bf16 at the end
        assert torch.equal(out, exp.float().to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_vs_loop_nonsymmetric_comb(dtype):
    b, s, d = 2, 2, 3
    y = randn(b, s, d, seed=15, dtype=dtype)
    res = randn(b, s, N, d, seed=16, dtype=dtype)
    post = torch.rand(b, s, N, generator=gen(17)) * 2
    comb = torch.rand(b, s, N, N, generator=gen(18))
    comb[..., 0, 3] = 5.0  # strongly non-symmetric: input stream 0 feeds output stream 3
    assert not torch.allclose(comb, comb.transpose(-1, -2))
    out = hc_post(y, res, post, comb)
    assert out.shape == (b, s, N, d) and out.dtype == dtype
    exp = torch.zeros(b, s, N, d, dtype=torch.float64)
    for i in range(b):
        for j in range(s):
            for o in range(N):
                for k in range(d):
                    v = float(post[i, j, o]) * float(y[i, j, k])
                    v += sum(float(comb[i, j, inp, o]) * float(res[i, j, inp, k]) for inp in range(N))
                    exp[i, j, o, k] = v
    if dtype == torch.float32:
        close(out, exp, atol=1e-5)
    else:
        assert torch.equal(out, exp.float().to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,s,d", [(1, 1, 1), (2, 7, 33), (1, 64, 2048)])
def test_hc_collapse_and_post_are_bitwise_the_reference_broadcast_form(dtype, b, s, d):
    """The loops over streams round exactly as DeepSeek's broadcast-and-sum form (torch.sum adds in stream order),
    also with infinities and NaN in the residual."""
    x = randn(b, s, N, d, seed=19, dtype=dtype)
    x[0, 0, 1, 0], x[-1, -1, 2, -1], x[0, -1, 3, d // 2] = float("inf"), float("nan"), float("-inf")
    y = randn(b, s, d, seed=20, dtype=dtype)
    pre, post = torch.rand(b, s, N, generator=gen(21)) + 0.1, torch.rand(b, s, N, generator=gen(22)) * 2
    comb = torch.rand(b, s, N, N, generator=gen(23))
    want = (pre.unsqueeze(-1) * x.float()).sum(dim=2).to(dtype)
    assert torch.equal(hc_collapse(x, pre).isnan(), want.isnan())
    assert torch.equal(hc_collapse(x, pre).nan_to_num(), want.nan_to_num())
    want = (post.unsqueeze(-1) * y.unsqueeze(-2) + (comb.unsqueeze(-1) * x.unsqueeze(-2)).sum(dim=2)).type_as(y)
    got = hc_post(y, x, post, comb)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def test_hc_post_comb_first_index_is_input_hand_case():
    # one-hot comb: comb[0, 3] = 1 only -> output stream 3 gets input stream 0; post zero
    d = 2
    res = torch.arange(N * d, dtype=torch.float32).view(1, 1, N, d)  # stream m holds [2m, 2m + 1]
    comb = torch.zeros(1, 1, N, N)
    comb[0, 0, 0, 3] = 1.0
    out = hc_post(torch.zeros(1, 1, d), res, torch.zeros(1, 1, N), comb)
    exp = torch.zeros(1, 1, N, d)
    exp[0, 0, 3] = torch.tensor([0.0, 1.0])
    assert torch.equal(out, exp)
    comb = torch.zeros(1, 1, N, N)
    comb[0, 0, 2, 1] = 1.0
    out = hc_post(torch.ones(1, 1, d), res, torch.tensor([[[0.0, 2.0, 0.0, 0.0]]]), comb)
    exp = torch.zeros(1, 1, N, d)
    exp[0, 0, 1] = torch.tensor([4.0 + 2.0, 5.0 + 2.0])
    assert torch.equal(out, exp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_head_vs_formula(dtype):
    b, s, d = 2, 3, 4
    x = randn(b, s, N, d, seed=19, dtype=dtype, scale=2.0)
    fn = randn(N, N * d, seed=20, scale=0.3)
    scale = torch.tensor([0.8])
    base = randn(N, seed=21)
    eps = 0.25  # large, so that a missing `+ eps` shows
    out = hc_head(x, fn, scale, base, eps, 1e-6)
    assert out.shape == (b, s, d) and out.dtype == dtype
    raw = loop_norm_mixes(x.float(), fn, 1e-6)
    exp = torch.zeros(b, s, d, dtype=torch.float64)
    for i in range(b):
        for j in range(s):
            pre = [sigmoid(float(raw[i, j, m]) * 0.8 + float(base[m])) + eps for m in range(N)]
            for k in range(d):
                exp[i, j, k] = sum(pre[m] * float(x[i, j, m, k]) for m in range(N))
    if dtype == torch.float32:
        close(out, exp, atol=1e-5)
    else:
        close(out, exp, atol=1e-2, rtol=1e-2)


def test_hc_mixes_math_is_fp32_for_bf16_streams():
    d = 8
    x = randn(1, 2, N, d, seed=22, dtype=torch.bfloat16)
    fn = randn(MIX, N * d, seed=23, scale=0.3)
    pre, post, comb = hc_mixes(x, fn, torch.ones(3), torch.zeros(MIX), N, 20, HC_EPS, 1e-6)
    for t in (pre, post, comb):
        assert t.dtype == torch.float32
    pre32, post32, comb32 = hc_mixes(x.float(), fn, torch.ones(3), torch.zeros(MIX), N, 20, HC_EPS, 1e-6)
    assert torch.equal(pre, pre32) and torch.equal(post, post32) and torch.equal(comb, comb32)


# ---------------------------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_vs_formula(dtype):
    x = randn(2, 3, 6, seed=24, scale=4.0, dtype=dtype)
    w = randn(6, seed=25)
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    exp = torch.zeros(2, 3, 6, dtype=torch.float64)
    for i in range(2):
        for j in range(3):
            row = [float(v) for v in x[i, j]]
            r = 1.0 / math.sqrt(sum(v * v for v in row) / 6 + 1e-6)
            for k in range(6):
                exp[i, j, k] = float(w[k]) * row[k] * r
    if dtype == torch.float32:
        close(out, exp, atol=1e-5)
    else:  # fp32 math then one bf16 rounding: within half a bf16 ulp of the exact value (plus fp32 noise)
        assert ((out.double() - exp).abs() <= exp.abs() * 2 ** -8 * 1.01).all()


def test_rms_norm_hand_case():
    x = torch.tensor([[3.0, 4.0]])  # mean square 12.5
    out = rms_norm(x, torch.tensor([1.0, 2.0]), 0.0)
    r = 1 / math.sqrt(12.5)
    close(out, [[3 * r, 8 * r]], atol=1e-7)
    # eps enters inside the sqrt
    out = rms_norm(torch.tensor([[1.0, 1.0]]), torch.ones(2), 3.0)
    close(out, [[0.5, 0.5]], atol=1e-7)


def test_rms_norm_bf16_weight_fp32_math():
    x = torch.tensor([[1e-3, 3e-3, -2e-3, 5e-3]], dtype=torch.bfloat16)
    w = torch.tensor([1.0, 0.5, 2.0, 1.0], dtype=torch.float32)
    out = rms_norm(x, w, 1e-12)
    assert out.dtype == torch.bfloat16
    xf = [float(v) for v in x[0]]
    r = 1 / math.sqrt(sum(v * v for v in xf) / 4 + 1e-12)
    exp = torch.tensor([[float(w[k]) * xf[k] * r for k in range(4)]])
    assert torch.equal(out, exp.float().to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------------------------

def loop_rope(x: list[float], angles: list[float], inverse: bool = False) -> list[float]:
    out = []
    for i, a in enumerate(angles):
        a = -a if inverse else a
        x0, x1 = x[2 * i], x[2 * i + 1]
        out += [x0 * math.cos(a) - x1 * math.sin(a), x0 * math.sin(a) + x1 * math.cos(a)]
    return out


def test_apply_rope_rotates_consecutive_pairs():
    angles = [0.3, -1.2, 2.5]
    freqs = torch.polar(torch.ones(3), torch.tensor(angles))
    x = torch.tensor([1.0, 2.0, -0.5, 0.25, 3.0, -4.0])
    close(apply_rope(x, freqs), loop_rope(x.tolist(), angles), atol=1e-6)
    close(apply_rope(x, freqs, inverse=True), loop_rope(x.tolist(), angles, inverse=True), atol=1e-6)
    # hand case: a quarter turn maps (1, 0) -> (0, 1) and (0, 1) -> (-1, 0)
    q = torch.polar(torch.ones(2), torch.tensor([math.pi / 2, math.pi / 2]))
    close(apply_rope(torch.tensor([1.0, 0.0, 0.0, 1.0]), q), [0.0, 1.0, -1.0, 0.0], atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_batched_broadcast_and_inverse(dtype):
    b, s, h, rd = 2, 5, 3, 8
    freqs = precompute_freqs_cis(rd, s, 0, 10000.0, 1.0, 32, 1)  # [s, rd/2]
    x = randn(b, s, h, rd, seed=26, dtype=dtype)
    out = apply_rope(x, freqs.unsqueeze(0).unsqueeze(2))  # [1, s, 1, rd/2], as model.py broadcasts
    assert out.dtype == dtype and out.shape == x.shape
    ang = torch.angle(freqs).double()
    for i in range(b):
        for t in range(s):
            for hh in range(h):
                exp = loop_rope([float(v) for v in x[i, t, hh]], ang[t].tolist())
                if dtype == torch.float32:
                    close(out[i, t, hh], exp, atol=1e-5)
                else:
                    close(out[i, t, hh], exp, atol=2e-2, rtol=1e-2)
    back = apply_rope(out.float(), freqs.unsqueeze(0).unsqueeze(2), inverse=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    close(back, x.float(), atol=tol, rtol=tol)
    # position 0 is the identity
    assert torch.equal(out[:, 0], x[:, 0])


def test_apply_rope_tail_leaves_the_first_channels():
    s, h, hd, rd = 4, 2, 12, 4
    freqs = precompute_freqs_cis(rd, s, 0, 10000.0, 1.0, 32, 1)
    x = randn(1, s, h, hd, seed=27)
    out = apply_rope_tail(x, freqs.real.unsqueeze(0).unsqueeze(2), freqs.imag.unsqueeze(0).unsqueeze(2), rd)
    assert torch.equal(out[..., : hd - rd], x[..., : hd - rd])
    ang = torch.angle(freqs).double()
    for t in range(s):
        for hh in range(h):
            close(out[0, t, hh, hd - rd:], loop_rope(x[0, t, hh, hd - rd:].tolist(), ang[t].tolist()), atol=1e-6)
    back = apply_rope_tail(out, freqs.real.unsqueeze(0).unsqueeze(2), freqs.imag.unsqueeze(0).unsqueeze(2), rd,
                           inverse=True)
    close(back, x, atol=1e-6)


def test_precompute_freqs_cis_plain():
    dim, seqlen, theta = 8, 7, 10000.0
    f = precompute_freqs_cis(dim, seqlen, 0, theta, 40.0, 32, 1)  # factor ignored without YaRN
    assert f.shape == (seqlen, dim // 2) and f.is_complex()
    for t in range(seqlen):
        for i in range(dim // 2):
            a = t * theta ** (-2 * i / dim)
            assert abs(f[t, i].real.item() - math.cos(a)) < 1e-5
            assert abs(f[t, i].imag.item() - math.sin(a)) < 1e-5
    close(f.abs(), torch.ones(seqlen, dim // 2), atol=1e-6)
    # hand values: i = 0 is 1 rad per position, i = 1 is theta^(-1/4) = 0.1 rad per position
    close(torch.angle(f[1]), [1.0, 0.1, 0.01, 0.001], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dim, base, orig, factor, low, high", [
    # Flash compressed layers: correction_dim(32) = 64 ln(65536 / (64 pi)) / (2 ln 160000) = 15.45 -> floor 15,
    # correction_dim(1) = 64 ln(65536 / (2 pi)) / (2 ln 160000) = 24.71 -> ceil 25
    (64, 160000.0, 65536, 16.0, 15, 25),
    # tiny config: 16 ln(64 / (64 pi)) / (2 ln 1e4) = -0.99 -> floor -1 -> clamped to 0; 16 ln(64 / 2pi) / 2 ln 1e4
    # = 2.02 -> ceil 3
    (16, 10000.0, 64, 4.0, 0, 3),
    # high is clamped to dim - 1 (as DeepSeek's code does), not dim / 2 - 1: 16 ln(65536 / (64 pi)) / (2 ln 1e4)
    # = 5.03 -> 5, 16 ln(65536 / 2pi) / (2 ln 1e4) = 8.04 -> 9 > 7, so the ramp never reaches 1 here
    (16, 10000.0, 65536, 4.0, 5, 9),
])
def test_precompute_freqs_cis_yarn_ramp(dim, base, orig, factor, low, high):
    # check the hand-computed correction dims
    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    assert max(math.floor(corr(32)), 0) == low and min(math.ceil(corr(1)), dim - 1) == high
    f = precompute_freqs_cis(dim, 3, orig, base, factor, 32, 1)
    got = torch.angle(f[1]).double()  # one position: the frequency itself (all < pi)
    for i in range(dim // 2):
        plain = base ** (-2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        exp = plain / factor * ramp + plain * (1 - ramp)
        assert abs(got[i].item() - exp) <= 1e-6 * exp + 1e-9, (i, got[i].item(), exp)
        if i <= low:  # high frequencies unchanged
            assert abs(got[i].item() - plain) <= 1e-6 * plain
        if i >= high:  # low frequencies interpolated by the factor
            assert abs(got[i].item() - plain / factor) <= 1e-6 * plain
    # position 2 is twice position 1
    close(torch.angle(f[2]), 2 * got, rtol=1e-5, atol=1e-7)


def test_precompute_freqs_cis_yarn_midpoint_hand_value():
    # Flash ramp (low 15, high 25): i = 20 is halfway, freq = plain * (1/16 * 1/2 + 1/2) = plain * 17/32
    f = precompute_freqs_cis(64, 2, 65536, 160000.0, 16.0, 32, 1)
    plain = 160000.0 ** (-40 / 64)
    assert abs(torch.angle(f[1, 20]).item() - plain * 17 / 32) < 1e-6 * plain


# ---------------------------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------------------------

def loop_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, mask: torch.Tensor, scale: float):
    b, s, h, d = q.shape
    out = torch.zeros(b, s, h, d, dtype=torch.float64)
    for i in range(b):
        for t in range(s):
            keys = [j for j in range(kv.shape[1]) if bool(mask[i, t, j])]
            for hh in range(h):
                sc = [sum(float(q[i, t, hh, k]) * float(kv[i, j, k]) for k in range(d)) * scale for j in keys]
                m = max(sc)
                e = [math.exp(v - m) for v in sc]
                den = sum(e) + math.exp(float(sink[hh]) - m)
                for k in range(d):
                    out[i, t, hh, k] = sum(e[a] / den * float(kv[i, j, k]) for a, j in enumerate(keys))
    return out


def random_mask(b: int, s: int, n: int, seed: int) -> torch.Tensor:
    mask = torch.rand(b, s, n, generator=gen(seed)) < 0.5
    for i in range(b):
        for t in range(s):
            mask[i, t, (i + t) % n] = True  # at least one key per query
    return mask


def test_sparse_attn_vs_loop():
    b, s, h, d, n = 2, 3, 2, 8, 6
    q = randn(b, s, h, d, seed=30)
    kv = randn(b, n, d, seed=31)
    sink = torch.tensor([0.5, -1.0])
    mask = random_mask(b, s, n, 32)
    scale = d ** -0.5
    out = sparse_attn(q, kv, mask, sink, scale)
    assert out.shape == (b, s, h, d) and out.dtype == torch.float32
    close(out, loop_attn(q, kv, sink, mask, scale), atol=1e-5)


def test_sparse_attn_single_key_and_sink_only_in_denominator():
    d = 4
    q = torch.tensor([[[[1.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]]]])  # [1, 1, 2 heads, 4]
    kv = torch.tensor([[[2.0, 1.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]]])
    mask = torch.tensor([[[True, False]]])  # only key 0
    sink = torch.tensor([math.log(2.0), 1.0])
    out = sparse_attn(q, kv, mask, sink, 1.0)
    # head 0: score 2, p = e^2 / (e^2 + 2); head 1: score 2, p = e^2 / (e^2 + e)
    p0 = math.exp(2) / (math.exp(2) + 2)
    p1 = math.exp(2) / (math.exp(2) + math.e)
    close(out[0, 0], [[2 * p0, p0, 0, 0], [2 * p1, p1, 0, 0]], atol=1e-6)
    assert d == out.shape[-1]


def test_sparse_attn_sink_very_negative_is_plain_softmax():
    b, s, h, d, n = 2, 2, 3, 4, 5
    q = randn(b, s, h, d, seed=33)
    kv = randn(b, n, d, seed=34)
    mask = random_mask(b, s, n, 35)
    out = sparse_attn(q, kv, mask, torch.full((h,), -1e4), 0.5)
    exp = torch.zeros(b, s, h, d, dtype=torch.float64)
    for i in range(b):
        for t in range(s):
            keys = [j for j in range(n) if bool(mask[i, t, j])]
            for hh in range(h):
                sc = [0.5 * sum(float(q[i, t, hh, k]) * float(kv[i, j, k]) for k in range(d)) for j in keys]
                z = sum(math.exp(v) for v in sc)
                for k in range(d):
                    exp[i, t, hh, k] = sum(math.exp(sc[a]) / z * float(kv[i, j, k]) for a, j in enumerate(keys))
    close(out, exp, atol=1e-5)
    # weights sum to one: with kv all ones the output is all ones
    ones = sparse_attn(q, torch.ones(b, n, d), mask, torch.full((h,), -1e4), 0.5)
    close(ones, torch.ones(b, s, h, d), atol=1e-6)


def test_sparse_attn_large_scores_stay_finite():
    q = torch.full((1, 2, 1, 4), 30.0)
    kv = torch.full((1, 3, 4), 30.0)
    kv[0, 1] = -30.0
    mask = torch.tensor([[[True, True, False], [True, True, True]]])
    out = sparse_attn(q, kv, mask, torch.tensor([0.0]), 1.0)
    assert torch.isfinite(out).all()
    close(out, loop_attn(q, kv, torch.tensor([0.0]), mask, 1.0), atol=1e-4)


def test_sparse_attn_bf16():
    b, s, h, d, n = 2, 3, 2, 16, 7
    q = randn(b, s, h, d, seed=36, dtype=torch.bfloat16)
    kv = randn(b, n, d, seed=37, dtype=torch.bfloat16)
    sink = torch.tensor([0.2, -0.3])
    mask = random_mask(b, s, n, 38)
    out = sparse_attn(q, kv, mask, sink, d ** -0.5)
    assert out.dtype == torch.bfloat16
    close(out, loop_attn(q.float(), kv.float(), sink, mask, d ** -0.5), atol=3e-2, rtol=2e-2)


def test_sparse_attn_bf16_rounds_probabilities_to_kv_dtype():
    # documented behaviour (as the reference kernel): p is rounded to bf16 before the PV product. A channel of
    # +-1e5 cancelling values makes that rounding visible in the output.
    def bf(v: float) -> float:
        return float(torch.tensor(v).to(torch.bfloat16))

    kv = torch.tensor([[[1.1, 1e5], [0.5, -1e5], [0.2, 1.0]]], dtype=torch.bfloat16)
    q = torch.tensor([[[[1.0, 0.0]]]], dtype=torch.bfloat16)
    out = sparse_attn(q, kv, torch.ones(1, 1, 3, dtype=torch.bool), torch.tensor([0.0]), 1.0)
    k = kv[0].double().tolist()
    den = sum(math.exp(row[0]) for row in k) + 1.0  # sink 0 -> e^0 in the denominator
    p = [math.exp(row[0]) / den for row in k]
    rounded = sum(bf(p[j]) * k[j][1] for j in range(3))
    exact = sum(p[j] * k[j][1] for j in range(3))
    assert bf(rounded) != bf(exact)
    assert out[0, 0, 0, 1].item() == bf(rounded)


def test_sparse_attn_gathered_keys_equal_the_same_keys_shared():
    """Keys gathered per query (sel) give what the same keys in the shared set under a mask give."""
    b, s, h, d, n, k = 2, 5, 3, 8, 7, 4
    q = randn(b, s, h, d, seed=70)
    kv = randn(b, n, d, seed=71)
    comp = randn(b, 9, d, seed=72)
    sink = torch.tensor([0.3, -0.2, 1.0])
    mask = random_mask(b, s, n, 73)
    idx = torch.randint(0, 9, (b, s, k), generator=gen(74))
    valid = torch.rand(b, s, k, generator=gen(75)) < 0.7
    valid[:, :, 0] = True
    idx[0, 0] = torch.tensor([2, 2, 5, 6])  # a duplicate index counts twice, like a duplicated key
    sel = comp[torch.arange(b).view(-1, 1, 1), idx]  # [b, s, k, d]
    out = sparse_attn(q, kv, mask, sink, 0.4, sel, valid)
    for i in range(b):
        for t in range(s):
            keys = torch.cat([kv[i], sel[i, t]])[None]
            m = torch.cat([mask[i, t], valid[i, t]])[None, None]
            close(out[i, t], loop_attn(q[i:i + 1, t:t + 1], keys, sink, m, 0.4)[0, 0], atol=1e-5)


def test_query_slices_cover_the_chunk_within_the_workspace():
    for s, heads, keys, ws in ((1, 4, 10, 1 << 20), (100, 16, 640, 1 << 20), (7, 1, 1, 8), (5000, 64, 9000, 1 << 27)):
        per = query_bytes(heads, keys, 64, 512)
        assert per == 20 * heads * (keys + 64) + 12 * 64 * 512
        sl = query_slices(s, per, ws)
        assert [t for x in sl for t in range(x.start, x.stop)] == list(range(s))
        assert all((x.stop - x.start) * per <= ws for x in sl) or len(sl) == s


def loop_window(start: int, s: int, w: int) -> list[list[bool]]:
    """The keys a chunk's queries see: ring slot i holds the newest position < start that is i mod w; then the
    chunk's own tokens. Query t (position start + t) sees positions (start + t - w, start + t]."""
    rows = []
    for t in range(s):
        p = start + t
        held = [max([q for q in range(start) if q % w == i], default=None) for i in range(w)]
        ring = [h is not None and p - w < h <= p for h in held]
        own = [u <= t and p - w < start + u for u in range(s)]
        rows.append(ring + own)
    return rows


@pytest.mark.parametrize("start", [0, 1, 3, 15, 16, 17, 40])
@pytest.mark.parametrize("s", [1, 3, 4, 5, 16, 17, 33])
def test_window_mask_vs_loop(start, s):
    for w in (4, 16):
        m = window_mask(torch.tensor([start]), s, w)
        assert m.dtype == torch.bool and m.shape == (1, s, w + s)
        assert m[0].tolist() == loop_window(start, s, w)
        assert m[0].sum(-1).tolist() == [min(start + t + 1, w) for t in range(s)]  # every query sees a full window


def test_window_mask_rows_at_different_starts():
    m = window_mask(torch.tensor([0, 5, 37]), 1, 16)
    for row, start in enumerate((0, 5, 37)):
        assert m[row].tolist() == loop_window(start, 1, 16)


@pytest.mark.parametrize("start", [0, 2, 3, 4, 15, 16, 31])
def test_closed_mask_vs_loop(start):
    for r, n in ((4, 16), (16, 4)):
        m = closed_mask(torch.tensor([start]), 9, n, r)
        assert m.shape == (1, 9, n) and m.dtype == torch.bool
        # entry j covers tokens [j r, (j + 1) r) and is visible from the token that closes it, (j + 1) r - 1, on
        assert m[0].tolist() == [[(j + 1) * r - 1 <= start + t for j in range(n)] for t in range(9)]


# ---------------------------------------------------------------------------------------------------------------
# indexer
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_scores_vs_loop(dtype):
    b, s, H, d, n = 2, 3, 4, 8, 5
    q = randn(b, s, H, d, seed=40, dtype=dtype)
    k = randn(b, n, d, seed=41, dtype=dtype)
    w = randn(b, s, H, seed=42, dtype=dtype)
    out = index_scores(q, k, w)
    assert out.shape == (b, s, n)
    exp = torch.zeros(b, s, n, dtype=torch.float64)
    for i in range(b):
        for t in range(s):
            for j in range(n):
                tot = 0.0
                for h in range(H):
                    dot = sum(float(q[i, t, h, c]) * float(k[i, j, c]) for c in range(d))
                    tot += max(dot, 0.0) * float(w[i, t, h])
                exp[i, t, j] = tot
    if dtype == torch.float32:
        close(out, exp, atol=1e-5)
    else:
        close(out.float(), exp, atol=0.1, rtol=3e-2)


def test_index_scores_relu_hand_case():
    q = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # two heads
    k = torch.tensor([[[2.0, -3.0], [-1.0, 4.0]]])
    w = torch.tensor([[[0.5, 2.0]]])
    # key 0: relu(2) * .5 + relu(-3) * 2 = 1; key 1: relu(-1) * .5 + relu(4) * 2 = 8
    close(index_scores(q, k, w), [[[1.0, 8.0]]], atol=0)


def loop_topk(scores: list[float], valid: list[bool], k: int) -> list[int]:
    """The tie rule: by score descending, then by entry index ascending."""
    order = sorted((j for j in range(len(scores)) if valid[j]), key=lambda j: (-scores[j], j))
    return order[:k]


def chosen_lists(idx: torch.Tensor, ok: torch.Tensor) -> list:
    return [[[int(j) for j, v in zip(idx[i, t], ok[i, t], strict=True) if v] for t in range(idx.size(1))]
            for i in range(idx.size(0))]


@pytest.mark.parametrize("k", [0, 1, 3, 6, 20])
def test_select_topk_vs_loop(k):
    b, s, n = 2, 4, 10
    scores = torch.randperm(b * s * n, generator=gen(43)).float().view(b, s, n)  # distinct
    valid = torch.rand(b, s, n, generator=gen(44)) < 0.6
    valid[0, 0] = False  # no valid entry at all
    valid[0, 1] = False
    valid[0, 1, 2] = True  # one valid entry
    scores[1, 2] = torch.arange(n).float() * 100
    valid[1, 2] = torch.arange(n) < 5  # the invalid ones are the highest scored
    idx, ok = select_topk(scores, valid, k)
    assert idx.shape == ok.shape == (b, s, min(k, n)) and ok.dtype == torch.bool
    got = chosen_lists(idx, ok)
    for i in range(b):
        for t in range(s):
            assert got[i][t] == loop_topk(scores[i, t].tolist(), valid[i, t].tolist(), k), (i, t)


def test_select_topk_ties_lower_entry_wins_at_any_length():
    """Exact ties (ReLU'd scores of 0) go to the lower entry index, whatever the length: torch.topk alone returns
    other tied entries for 100 and 1,000 zeros."""
    for n in (5, 100, 1000, 4097):
        scores = torch.zeros(1, 1, n)
        scores[0, 0, n // 2] = 1.0
        idx, ok = select_topk(scores, torch.ones(1, 1, n, dtype=torch.bool), 3)
        assert chosen_lists(idx, ok) == [[[n // 2, 0, 1]]]
    # -0.0 ties with 0.0; negative scores rank below both
    scores = torch.tensor([[[0.0, -0.0, -1.0, 0.0, -0.0]]])
    idx, ok = select_topk(scores, torch.ones(1, 1, 5, dtype=torch.bool), 4)
    assert chosen_lists(idx, ok) == [[[0, 1, 3, 4]]]
    # bf16 scores keep the same rule
    idx, ok = select_topk(torch.tensor([[[2.0, 1.0, 2.0, 1.0]]], dtype=torch.bfloat16),
                          torch.ones(1, 1, 4, dtype=torch.bool), 3)
    assert chosen_lists(idx, ok) == [[[0, 2, 1]]]


def test_rank_keys_order_floats_and_indices():
    vals = torch.tensor([-float("inf"), -3.5, -1e-30, -0.0, 0.0, 1e-38, 1.0, 7.25, float("inf")])
    keys = rank_keys(vals, torch.zeros(len(vals), dtype=torch.long), torch.ones(len(vals), dtype=torch.bool))
    assert keys[3] == keys[4]  # -0.0 == 0.0
    order = [0, 1, 2, 4, 5, 6, 7, 8]
    assert all(keys[a] < keys[b] for a, b in zip(order, order[1:], strict=False))
    same = rank_keys(torch.ones(3), torch.tensor([0, 7, 2]), torch.ones(3, dtype=torch.bool))
    assert same[0] > same[2] > same[1]  # equal scores: the lower entry ranks higher
    invalid = rank_keys(torch.tensor([-float("inf")]), torch.tensor([0]), torch.tensor([False]))
    assert invalid[0] < keys.min()


@pytest.mark.parametrize("step", [1, 3, 7, 64])
def test_select_topk_sliced_equals_whole(step):
    """Scoring entries a slice at a time (merging the running top-k) chooses what scoring them all at once
    chooses, ties included; queries see only their closed entries."""
    b, s, n, k = 2, 6, 23, 5
    scores = torch.randint(-2, 3, (b, s, n), generator=gen(45)).float().relu()  # many exact ties at 0 and 1
    closed = torch.randint(0, n + 1, (b, s), generator=gen(46))
    valid = torch.arange(n).view(1, 1, -1) < closed.unsqueeze(-1)
    whole = select_topk(scores, valid, k)
    sliced = select_topk_sliced(lambda j0, j1: scores[..., j0:j1], n, closed, k, step)
    assert chosen_lists(*sliced) == chosen_lists(*whole)
    for i in range(b):
        for t in range(s):
            assert chosen_lists(*whole)[i][t] == loop_topk(scores[i, t].tolist(), valid[i, t].tolist(), k)


def test_entry_step_bounds_the_workspace():
    assert entry_step(1, 64, 1 << 20) == (1 << 20) // (3 * 256)
    assert entry_step(10**6, 64, 1 << 20) == 1


def test_select_topk_edge_cases():
    idx, ok = select_topk(torch.zeros(2, 3, 0), torch.zeros(2, 3, 0, dtype=torch.bool), 4)
    assert idx.shape == (2, 3, 0)
    scores = torch.tensor([[[3.0, 1.0, 2.0]]])
    ones = torch.ones(1, 1, 3, dtype=torch.bool)
    assert select_topk(scores, ones, 0)[0].shape == (1, 1, 0)
    assert chosen_lists(*select_topk(scores, ones, 2)) == [[[0, 2]]]
    assert chosen_lists(*select_topk(scores, torch.tensor([[[False, True, True]]]), 5)) == [[[2, 1]]]
    assert chosen_lists(*select_topk(scores, torch.zeros(1, 1, 3, dtype=torch.bool), 2)) == [[[]]]
    for k in (3, 4, 100):  # k >= n: every valid entry
        assert sorted(chosen_lists(*select_topk(scores, ones, k))[0][0]) == [0, 1, 2]
    # negative scores (relu * negative weights) are still chosen over nothing
    neg = torch.tensor([[[-5.0, -1.0, -3.0]]])
    assert chosen_lists(*select_topk(neg, ones, 1)) == [[[1]]]


# ---------------------------------------------------------------------------------------------------------------
# compressor
# ---------------------------------------------------------------------------------------------------------------

def test_overlap_transform_layout():
    b, g, r, d = 2, 3, 4, 3
    t = randn(b, g, r, 2 * d, seed=50)
    out = overlap_transform(t, -7.0)
    assert out.shape == (b, g, 2 * r, d)
    for i in range(b):
        for gg in range(g):
            for row in range(2 * r):
                for c in range(d):
                    if row < r:
                        exp = -7.0 if gg == 0 else float(t[i, gg - 1, row, c])  # previous group, first half
                    else:
                        exp = float(t[i, gg, row - r, d + c])  # this group, second half
                    assert float(out[i, gg, row, c]) == exp, (i, gg, row, c)


def loop_compress(kv: torch.Tensor, score: torch.Tensor, r: int, overlap: bool) -> torch.Tensor:
    """The spec's text: per group, per channel, softmax over the group's tokens of score, weighting kv."""
    b, total, cd = kv.shape
    d = cd // 2 if overlap else cd
    g = total // r
    out = torch.zeros(b, g, d, dtype=torch.float64)
    for i in range(b):
        for j in range(g):
            for c in range(d):
                cand = []  # (score, kv) of every token the entry pools over, for this channel
                if overlap:
                    if j > 0:  # the previous group's first-half channels; none for the first entry (-inf scores)
                        cand += [(float(score[i, (j - 1) * r + t, c]), float(kv[i, (j - 1) * r + t, c]))
                                 for t in range(r)]
                    cand += [(float(score[i, j * r + t, d + c]), float(kv[i, j * r + t, d + c])) for t in range(r)]
                else:
                    cand += [(float(score[i, j * r + t, c]), float(kv[i, j * r + t, c])) for t in range(r)]
                m = max(sc for sc, _ in cand)
                z = sum(math.exp(sc - m) for sc, _ in cand)
                out[i, j, c] = sum(math.exp(sc - m) / z * v for sc, v in cand)
    return out


def chunked_compress(kv: torch.Tensor, score: torch.Tensor, r: int, overlap: bool, chunk: int) -> torch.Tensor:
    """compress_chunk over a sequence in chunks of `chunk` tokens (state carried) -> its closed entries [b, g, d]."""
    b, total, cd = kv.shape
    lead = r if overlap else 0
    kv_state = torch.zeros(b, lead + r, cd)
    score_state = torch.full((b, lead + r, cd), float("-inf"))
    entries = {}
    for c0 in range(0, total, chunk):
        start = torch.full((b,), c0)
        pooled, closed, entry, kv_state, score_state = compress_chunk(
            kv_state, score_state, kv[:, c0:c0 + chunk], score[:, c0:c0 + chunk], start, r, overlap)
        for g in range(closed.size(1)):
            if bool(closed[0, g]):
                assert bool(closed[:, g].all())
                entries[int(entry[0, g])] = pooled[:, g]
    assert sorted(entries) == list(range(total // r))  # every closed group once, none before it closes
    return torch.stack([entries[j] for j in range(total // r)], dim=1) if entries else torch.zeros(b, 0, cd)


@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 16, 17, 64])
@pytest.mark.parametrize("r, overlap, groups", [(4, True, 1), (4, True, 4), (16, False, 1), (16, False, 3)])
def test_compress_chunk_vs_loop(r, overlap, groups, chunk):
    b, d = 2, 5
    c = 2 if overlap else 1
    total = groups * r + 3  # an open group at the end
    kv = randn(b, total, c * d, seed=51)
    score = randn(b, total, c * d, seed=52, scale=2.0)
    out = chunked_compress(kv, score, r, overlap, chunk)
    assert out.shape == (b, groups, d)
    close(out, loop_compress(kv[:, :groups * r], score[:, :groups * r], r, overlap), atol=1e-5)


@pytest.mark.parametrize("r, overlap", [(4, True), (16, False), (128, False)])
def test_add_to_open_group_is_compress_chunks_state(r, overlap):
    """A chunk that closes no group and begins no sequence (`stays_open`): writing its tokens into the open group
    (eager decode's shortcut) leaves bitwise the state compress_chunk returns, in rows taken out of order; a chunk
    that reaches a group's end, or starts a sequence, does not stay open."""
    lead, c = (r if overlap else 0), 6
    for s in (1, 2, 3):
        for pre in range(1, r - s):
            big = 5
            kv_state, score_state = randn(big, lead + r, c, seed=60 + s), randn(big, lead + r, c, seed=61 + s)
            rows = torch.tensor([3, 0])
            start = torch.tensor([pre, 2 * r + pre])
            kv, score = randn(2, s, c, seed=62), randn(2, s, c, seed=63)
            assert stays_open(start, s, r)
            *_, want_kv, want_score = compress_chunk(kv_state[rows], score_state[rows], kv, score, start, r, overlap)
            add_to_open_group(kv_state, score_state, rows, kv, score, start, r, overlap)
            assert torch.equal(kv_state[rows], want_kv) and torch.equal(score_state[rows], want_score)
        assert not stays_open(torch.tensor([1, r - s]), s, r)  # the second row closes its group
        assert not stays_open(torch.tensor([0, 1]), s, r)  # the first row begins its sequence


def test_compress_chunk_rows_at_different_positions():
    """One token per row, rows at different positions (a decode step): each row closes its own group."""
    r, d = 4, 3
    kv = randn(3, 12, 2 * d, seed=56)
    score = randn(3, 12, 2 * d, seed=57)
    want = loop_compress(kv, score, r, True)  # [3, 3, d]
    kv_state = torch.zeros(3, 2 * r, 2 * d)
    score_state = torch.full((3, 2 * r, 2 * d), float("-inf"))
    lag = [0, 1, 3]  # row i starts `lag` steps late
    got = {}
    for step in range(12 + max(lag)):
        pos = torch.tensor([min(max(step - g, 0), 11) for g in lag])
        live = torch.tensor([0 <= step - g <= 11 for g in lag])
        pooled, closed, entry, nk, ns = compress_chunk(
            kv_state, score_state, kv[torch.arange(3), pos].unsqueeze(1), score[torch.arange(3), pos].unsqueeze(1),
            pos, r, True)
        kv_state = torch.where(live.view(-1, 1, 1), nk, kv_state)
        score_state = torch.where(live.view(-1, 1, 1), ns, score_state)
        for i in range(3):
            for g in range(closed.size(1)):
                if bool(closed[i, g]) and bool(live[i]):
                    got[(i, int(entry[i, g]))] = pooled[i, g]
    for i in range(3):
        for j in range(3):
            close(got[(i, j)], want[i, j], atol=1e-5)


def test_compress_chunk_hand_case_first_entry_ignores_missing_group():
    # ratio 4, overlap, d = 1: channel 0 = first half (for the next entry), channel 1 = second half
    r = 4
    kv = torch.zeros(1, 2 * r, 2)
    score = torch.zeros(1, 2 * r, 2)
    kv[0, :r, 1] = torch.tensor([1.0, 2.0, 3.0, 4.0])  # group 0, second half
    kv[0, :r, 0] = torch.tensor([10.0, 10.0, 10.0, 10.0])  # group 0, first half (used by entry 1)
    kv[0, r:, 1] = torch.tensor([0.0, 0.0, 0.0, 0.0])  # group 1, second half
    kv[0, r:, 0] = 100.0  # group 1's first half: never used by these two entries
    score[0, 0, 1] = math.log(5.0)  # token 0 weighs 5 against 1, 1, 1 -> weights 5/8, 1/8, 1/8, 1/8
    out = chunked_compress(kv, score, r, True, 2 * r)
    # entry 0: only group 0's second half: (5 * 1 + 2 + 3 + 4) / 8 = 14 / 8
    # entry 1: four 10s (group 0 first half) and four 0s (group 1 second half), equal scores -> 5
    close(out, [[[14 / 8], [5.0]]], atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_scores_vs_formulas(dtype):
    T, E, d = 3, 5, 6
    x = randn(T, d, seed=60, dtype=dtype)
    w = randn(E, d, seed=61, dtype=dtype)
    logits = [[sum(float(x[t, c]) * float(w[e, c]) for c in range(d)) for e in range(E)] for t in range(T)]
    sq = gate_scores(x, w, "sqrtsoftplus")
    sg = gate_scores(x, w, "sigmoid")
    sm = gate_scores(x, w, "softmax")
    for out in (sq, sg, sm):
        assert out.dtype == torch.float32 and out.shape == (T, E)
    close(sq, [[math.sqrt(math.log1p(math.exp(v))) for v in row] for row in logits], atol=1e-5)
    close(sg, [[sigmoid(v) for v in row] for row in logits], atol=1e-6)
    close(sm, [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits], atol=1e-6)


def test_gate_scores_hand_values():
    x = torch.tensor([[1.0]])
    w = torch.tensor([[0.0], [math.log(math.e - 1)]])  # softplus(0) = ln 2, softplus(ln(e - 1)) = 1
    close(gate_scores(x, w, "sqrtsoftplus"), [[math.sqrt(math.log(2)), 1.0]], atol=1e-6)


def test_route_bias_changes_selection_not_weights():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.7, 0.2, 0.3],
                           [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    w, idx = route(scores, 2, 1.0, "sqrtsoftplus")
    assert [sorted(r) for r in idx.tolist()] == [[0, 1], [4, 5]]
    ws = {int(e): float(v) for e, v in zip(idx[0], w[0], strict=True)}
    assert abs(ws[0] - 0.9 / 1.7) < 1e-6 and abs(ws[1] - 0.8 / 1.7) < 1e-6
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    w, idx = route(scores, 2, 2.5, "sqrtsoftplus", bias=bias)
    assert [sorted(r) for r in idx.tolist()] == [[2, 5], [2, 5]]
    ws = [{int(e): float(v) for e, v in zip(idx[t], w[t], strict=True)} for t in range(2)]
    # unbiased scores of the chosen experts, renormalised, times the scale
    assert abs(ws[0][2] - 2.5 * 0.1 / 0.4) < 1e-6 and abs(ws[0][5] - 2.5 * 0.3 / 0.4) < 1e-6
    assert abs(ws[1][2] - 2.5 * 0.3 / 0.9) < 1e-6 and abs(ws[1][5] - 2.5 * 0.6 / 0.9) < 1e-6
    close(w.sum(-1), [2.5, 2.5], atol=1e-6)
    # sigmoid is renormalised the same way
    w, idx = route(scores, 3, 1.0, "sigmoid")
    close(w.sum(-1), [1.0, 1.0], atol=1e-6)


def test_route_random_vs_loop():
    T, E, k, scale = 5, 16, 6, 1.5
    scores = torch.rand(T, E, generator=gen(62)) + 0.01
    bias = randn(E, seed=63, scale=0.3)
    w, idx = route(scores, k, scale, "sqrtsoftplus", bias=bias)
    assert w.shape == (T, k) and idx.shape == (T, k) and w.dtype == torch.float32
    for t in range(T):
        biased = [float(scores[t, e]) + float(bias[e]) for e in range(E)]
        exp_ids = sorted(range(E), key=lambda e: -biased[e])[:k]
        assert sorted(idx[t].tolist()) == sorted(exp_ids)
        tot = sum(float(scores[t, e]) for e in exp_ids)
        for e, v in zip(idx[t].tolist(), w[t].tolist(), strict=True):
            assert abs(v - scale * float(scores[t, e]) / tot) < 1e-6


def test_route_hash_ids_used_as_given():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.7, 0.2, 0.3],
                           [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    ids = torch.tensor([[3, 1], [0, 5]])
    w, idx = route(scores, 2, 1.5, "sqrtsoftplus", hash_ids=ids)
    assert idx.tolist() == ids.tolist()
    close(w, [[1.5 * 0.7 / 1.5, 1.5 * 0.8 / 1.5], [1.5 * 0.1 / 0.7, 1.5 * 0.6 / 0.7]], atol=1e-6)


def test_swiglu_clamp_hand_values():
    g = torch.tensor([-3.0, 1.0, 5.0, 0.5])
    u = torch.tensor([-5.0, 0.5, 3.0, -1.0])
    out = swiglu(g, u, 2.0)
    # g -> min(g, 2) = [-3, 1, 2, .5] (no lower clamp); u -> clamp(u, -2, 2) = [-2, .5, 2, -1]
    close(out, [silu(-3.0) * -2.0, silu(1.0) * 0.5, silu(2.0) * 2.0, silu(0.5) * -1.0], atol=1e-6)
    for limit in (0.0, -1.0):  # no clamp
        close(swiglu(g, u, limit), [silu(a) * b for a, b in zip(g.tolist(), u.tolist(), strict=True)], atol=1e-6)


def test_swiglu_bf16_in_fp32_out():
    g = randn(3, 7, seed=64, scale=8.0, dtype=torch.bfloat16)
    u = randn(3, 7, seed=65, scale=8.0, dtype=torch.bfloat16)
    out = swiglu(g, u, 10.0)
    assert out.dtype == torch.float32
    exp = [[silu(min(float(a), 10.0)) * min(max(float(b), -10.0), 10.0) for a, b in zip(ra, rb, strict=True)]
           for ra, rb in zip(g.tolist(), u.tolist(), strict=True)]
    close(out, exp, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------------------------------------------

def manual_act_fp8(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Blocks of `block` along K (the last one partial), scale = 2^ceil(log2(max(amax, 1e-4) / 448))."""
    xf = x.double()
    out = torch.empty_like(xf)
    K = x.shape[-1]
    for start in range(0, K, block):
        blk = xf[..., start:start + block]
        amax = blk.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4)
        scale = torch.tensor(2.0) ** torch.ceil(torch.log2(amax / 448.0))
        q = (blk / scale).clamp(-448, 448).float().to(torch.float8_e4m3fn).double()
        out[..., start:start + block] = q * scale
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_act_quant(dtype):
    b, s, K, O = 2, 3, 200, 5  # K = 128 + 72: one full block and a partial one
    x = randn(b, s, K, seed=70, dtype=dtype)
    x[0, 0, 3] = 300.0  # a large value in block 0 only: block 1's scale must not see it
    x[1, 2, 150] = -0.001
    w = randn(O, K, seed=71, scale=0.1)  # a dequantised (fp32) weight
    out = linear(x, w, act_quant=True)
    assert out.shape == (b, s, O) and out.dtype == dtype
    xq = manual_act_fp8(x.float())
    exp = xq @ w.double().T
    if dtype == torch.float32:
        close(out, exp, atol=1e-4, rtol=1e-5)
    else:
        close(out.float(), exp, atol=2e-2, rtol=1e-2)
    plain = x.double() @ w.double().T
    assert (exp - plain).abs().max() > 1e-3  # the simulation really changes the product
    if dtype == torch.float32:
        assert not torch.allclose(out.double(), plain, atol=1e-4, rtol=1e-5)


def test_linear_act_quant_partial_block_scale_hand_case():
    # K = 130: block 0 has amax 448 -> scale 1; block 1 (2 values) has amax 0.75 -> 0.75 / 448 = 0.00167 -> 2^-9.
    # With power-of-two scales a block's scale only matters where x / scale falls into e4m3's subnormals
    # (below 2^-6, step 2^-9), so 0.001 tells the two blocks' scales apart.
    x = torch.zeros(1, 130)
    x[0, 0] = 448.0
    x[0, 1] = 0.3  # scale 1: e4m3 in [0.25, 0.5) has step 2^-5; 0.3 = 9.6 steps -> 10 -> 0.3125
    x[0, 100] = 0.001  # same block as 448 (scale 1): subnormal, 0.512 steps of 2^-9 -> 1 step -> 2^-9
    x[0, 128] = 0.75  # scale 2^-9: 384, exact
    x[0, 129] = 0.001  # scale 2^-9: 0.512 -> step 2^-4 in [0.5, 1) -> 0.5 -> 0.5 * 2^-9 = 2^-10
    w = torch.zeros(4, 130)
    w[0, 1] = 1.0
    w[1, 100] = 1.0
    w[2, 128] = 1.0
    w[3, 129] = 1.0
    out = linear(x, w, act_quant=True)
    close(out, [[0.3125, 2.0 ** -9, 0.75, 2.0 ** -10]], atol=0, rtol=0)
    close(linear(x, w), [[0.3, 0.001, 0.75, 0.001]], atol=1e-9, rtol=1e-6)


def test_linear_mixed_dtype_runs_in_fp32():
    x = randn(2, 3, 200, seed=72, dtype=torch.bfloat16)
    w = randn(4, 200, seed=73, scale=0.1)  # fp32
    out = linear(x, w)
    assert out.dtype == torch.bfloat16
    exp = x.double() @ w.double().T
    # an fp32 GEMM rounded once to bf16: within one bf16 ulp of the exact product
    err = (out.double() - exp).abs()
    assert (err <= exp.abs() * 2 ** -8 + 1e-6).all()
    # fp32 in, fp32 weight: plain product
    xf = x.float()
    close(linear(xf, w), exp, atol=1e-5)
    # same dtype bf16: runs (in bf16), output bf16
    assert linear(x, w.to(torch.bfloat16)).dtype == torch.bfloat16
