import nki
import nki.language as nl
import nki.isa as nisa

# NKI kernels of mhcrun: the mHC steps (expand, mixes + Sinkhorn, collapse, post, head), RMSNorm, SwiGLU.
#
# This file is kernel source for the real ``nki`` package and imports nothing else: on a Neuron device it is
# imported as is, on CPU mhcrun's simulator executes it unchanged (``mhcrun.nki.sim.load_kernel_module``).
# The math follows ``mhcrun/ops/hc.py`` (see shared/spec/deepseek-v4.md section 1).
#
# Written against the NKI 0.3 API (mhcrun.nki.sim.target) in the Python subset the NKI compiler accepts
# (mhcrun.nki.sim.lint): module-level functions, plain loops (no lambdas, comprehensions or closures), HBM
# vectors repeated over partitions with a stride-0 access pattern (``.ap``; ``.broadcast`` is NKI 0.5).
#
# Layout: every kernel works on 2-D HBM tensors with tokens on the rows; token rows go onto the partition axis
# in tiles of 128 (plus one partial tile), features lie along the free axis in chunks. Activations are bf16 or
# fp32 (tiles take the input's dtype), coefficients fp32, all engine math fp32. The mixes GEMM multiplies by fn as
# bf16 hi + lo (mhcrun.nki.ops.split_hi_lo): on bf16 operands for bf16 x, on fp32 ones for fp32 x, where lo comes in
# fp32 and hi + lo is fn exactly.
#
# The three imports above stay exactly as the NKI docs write them (nki, nki.language, nki.isa):
# ruff: noqa: I001

# ------------------------------------------------------------------------------------------ baked constants

HC_MULT = 4  # n: parallel residual streams
MIX = (2 + HC_MULT) * HC_MULT  # 24 mixes per token: n pre, n post, n*n comb
SINKHORN_ITERS = 20
HC_EPS = 1e-6
POST_MULT = 2.0
NORM_EPS_V4 = 1e-6  # rms_norm_eps of V4 (also used inside the mixes)
NORM_EPS_V41 = 1e-20  # rms_norm_eps of V4.1

PMAX = 128  # partitions per tile (nl.tile_size.pmax)
K_TILE = 128  # contraction rows per nc_matmul
K_CHUNK = 512  # columns of x loaded at once by the mixes GEMM (a multiple of K_TILE)
FREE_CHUNK = 1024  # columns per elementwise tile (fp32: 4 KiB of a partition's 192 KiB)


def n_tiles(total, size):
    """Pieces of ``size`` covering ``total`` (the last one may be shorter): piece i starts at i * size and is
    ``piece_width(total, size, i)`` wide."""
    return (total + size - 1) // size


def piece_width(total, size, i):
    return min(size, total - i * size)


def mixes_supported(hc_mult, sinkhorn_iters, hc_eps, norm_eps) -> bool:
    """True when a layer's mHC constants are the ones baked into ``hc_mixes_*`` / ``hc_head_*``."""
    return (
        hc_mult == HC_MULT
        and sinkhorn_iters == SINKHORN_ITERS
        and hc_eps == HC_EPS
        and norm_eps in (NORM_EPS_V4, NORM_EPS_V41)
    )


# ------------------------------------------------------------------------------------------ plain helpers


def _row_broadcast(vec, lo, hi, tp):
    """SBUF fp32 [tp, hi - lo]: HBM vector ``vec[lo:hi]`` (shape [F] or [1, F], contiguous) repeated on every
    partition, through a stride-0 access pattern on the partition axis."""
    return nl.load(vec.ap(pattern=[[0, tp], [1, hi - lo]], offset=lo))


def _transpose(dst, src):
    """dst [F, P] (SBUF, any float dtype) = src [P, F] (SBUF, F <= 128) through the Tensor Engine."""
    p, f = src.shape
    if src.dtype != nl.float32:  # PSUM holds fp32: widen first (exact)
        wide = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=wide, src=src)
        src = wide
    ps = nl.ndarray((f, p), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=ps, data=src)
    nisa.tensor_copy(dst=dst, src=ps)


def _add_sum_of_squares(acc, xc):
    """acc [tp, 1] fp32 += sum(xc^2) over the free axis (Scalar Engine square with a row reduction)."""
    tp, w = xc.shape
    sq = nl.ndarray((tp, w), dtype=nl.float32, buffer=nl.sbuf)
    part = nl.ndarray((tp, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation_reduce(dst=sq, op=nl.square, data=xc, reduce_op=nl.add, reduce_res=part)
    nisa.tensor_tensor(dst=acc, data1=acc, data2=part, op=nl.add)


def _rsqrt_mean(sumsq, count, eps):
    """[tp, 1] fp32: rsqrt(sumsq / count + eps)."""
    tp = sumsq.shape[0]
    m = nl.ndarray((tp, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=m, data=sumsq, op0=nl.multiply, operand0=1.0 / count, op1=nl.add, operand1=eps)
    r = nl.ndarray((tp, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=r, op=nl.rsqrt, data=m)
    return r


# ------------------------------------------------------------------------------------------ mHC steps


def _load_fn_transposed(fn, mm_dtype):
    """SBUF [128, K/128, mix] in the GEMM dtype: fn [mix, K] with its K axis moved onto the partitions."""
    mix, k = fn.shape
    nk = k // K_TILE
    fn_t = nl.ndarray((K_TILE, nk, mix), dtype=mm_dtype, buffer=nl.sbuf)
    for kc in nl.affine_range(nk):
        blk = nl.load(fn[:, kc * K_TILE:(kc + 1) * K_TILE])
        _transpose(fn_t[:, kc, :], blk)
    return fn_t


def _norm_mixes(x, fn_hi_t, fn_lo_t, t0, tp, norm_eps):
    """SBUF fp32 [tp, mix]: (x @ (hi + lo)^T) * rsqrt(mean(x^2) + eps) for token rows t0 .. t0 + tp.

    x is read once, in K_CHUNK column pieces: each piece feeds the sum of squares and, transposed onto the
    partition axis 128 columns at a time, two matmuls (hi and lo) accumulating in one fp32 PSUM tile.
    """
    k = x.shape[1]
    mix = fn_hi_t.shape[2]
    sumsq = nl.zeros((tp, 1), dtype=nl.float32, buffer=nl.sbuf)
    acc = nl.ndarray((tp, mix), dtype=nl.float32, buffer=nl.psum)
    for c in nl.affine_range(n_tiles(k, K_CHUNK)):
        c0 = c * K_CHUNK
        cw = piece_width(k, K_CHUNK, c)
        xc = nl.load(x[t0:t0 + tp, c0:c0 + cw])
        _add_sum_of_squares(sumsq, xc)
        for j in range(cw // K_TILE):
            kc = c0 // K_TILE + j
            x_t = nl.ndarray((K_TILE, tp), dtype=fn_hi_t.dtype, buffer=nl.sbuf)
            _transpose(x_t, xc[:, j * K_TILE:(j + 1) * K_TILE])
            nisa.nc_matmul(dst=acc, stationary=x_t, moving=fn_hi_t[:, kc, :])
            nisa.nc_matmul(dst=acc, stationary=x_t, moving=fn_lo_t[:, kc, :])
    r = _rsqrt_mean(sumsq, k, norm_eps)
    mixes = nl.ndarray((tp, mix), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=mixes, data=acc, op0=nl.multiply, operand0=r)
    return mixes


def _affine(mixes, lo, hi, scale_col, base):
    """SBUF fp32 [tp, hi - lo]: mixes[:, lo:hi] * scale + base[:, lo:hi] (scale a [tp, 1] column)."""
    tp = mixes.shape[0]
    z = nl.ndarray((tp, hi - lo), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=z, data=mixes[:, lo:hi], op0=nl.multiply, operand0=scale_col, op1=nl.add,
                              operand1=base[:, lo:hi])
    return z


def _sigmoid_weights(z, mult, add):
    """SBUF fp32 like z: sigmoid(z) * mult + add."""
    w = nl.ndarray(z.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=w, op=nl.sigmoid, data=z)
    nisa.tensor_scalar(dst=w, data=w, op0=nl.multiply, operand0=mult, op1=nl.add, operand1=add)
    return w


def _normalise_rows(c, eps):
    """Each row of the n x n block (per token) of the whole tile c [tp, n*n]: row / (row sum + eps), as a multiply
    by the reciprocal; the reciprocals repeat along each row through a stride-0 access pattern (one instruction)."""
    n = HC_MULT
    tp = c.shape[0]
    c3 = c.reshape((tp, n, n))
    inv = nl.ndarray((tp, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=inv, op=nl.add, data=c3, axis=2)
    if eps != 0.0:
        nisa.tensor_scalar(dst=inv, data=inv, op0=nl.add, operand0=eps)
    nisa.reciprocal(dst=inv, data=inv)
    nisa.tensor_tensor(dst=c3, data1=c3, data2=inv.ap(pattern=[[n, tp], [1, n], [0, n]], offset=0), op=nl.multiply)


def _normalise_cols(c, eps):
    """Each column of the n x n block (per token) of the whole tile c [tp, n*n]: column / (column sum + eps); the
    columns are summed through a transposing access pattern, the reciprocals repeat down them by a stride-0 one."""
    n = HC_MULT
    tp = c.shape[0]
    c3 = c.reshape((tp, n, n))
    inv = nl.ndarray((tp, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=inv, op=nl.add, data=c.ap(pattern=[[n * n, tp], [1, n], [n, n]], offset=0), axis=2)
    nisa.tensor_scalar(dst=inv, data=inv, op0=nl.add, operand0=eps)
    nisa.reciprocal(dst=inv, data=inv)
    nisa.tensor_tensor(dst=c3, data1=c3, data2=inv.ap(pattern=[[n, tp], [0, n], [1, n]], offset=0), op=nl.multiply)


def _sinkhorn(c):
    """In place on SBUF fp32 [tp, n*n] (row-major n x n per token; rows = input streams).

    softmax over each row + eps, a column normalisation, then (SINKHORN_ITERS - 1) rounds of row and column
    normalisation: the same sequence as mhcrun/ops/hc.py's sinkhorn.
    """
    n = HC_MULT
    tp = c.shape[0]
    neg_max = nl.ndarray((tp, n), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=c.reshape((tp, n, n)), axis=2, negate=True)
    for i in range(n):
        row = c[:, i * n:(i + 1) * n]
        nisa.activation(dst=row, op=nl.exp, data=row, bias=neg_max[:, i:i + 1])
    _normalise_rows(c, 0.0)
    nisa.tensor_scalar(dst=c, data=c, op0=nl.add, operand0=HC_EPS)
    _normalise_cols(c, HC_EPS)
    for _ in nl.sequential_range(SINKHORN_ITERS - 1):
        _normalise_rows(c, HC_EPS)
        _normalise_cols(c, HC_EPS)


def _weights(mixes, scale, base):
    """(pre, post, comb) SBUF fp32 [tp, n], [tp, n], [tp, n*n] from the norm-applied mixes [tp, mix]."""
    n = HC_MULT
    tp = mixes.shape[0]
    sc = _row_broadcast(scale, 0, 3, tp)
    bs = _row_broadcast(base, 0, MIX, tp)
    pre_w = _sigmoid_weights(_affine(mixes, 0, n, sc[:, 0:1], bs), 1.0, HC_EPS)
    post_w = _sigmoid_weights(_affine(mixes, n, 2 * n, sc[:, 1:2], bs), POST_MULT, 0.0)
    c = _affine(mixes, 2 * n, MIX, sc[:, 2:3], bs)
    _sinkhorn(c)
    return pre_w, post_w, c


def _mixes_tile(x, fn_hi_t, fn_lo_t, scale, base, pre, post, comb, t0, tp, norm_eps):
    pre_w, post_w, c = _weights(_norm_mixes(x, fn_hi_t, fn_lo_t, t0, tp, norm_eps), scale, base)
    nl.store(pre[t0:t0 + tp, :], value=pre_w)
    nl.store(post[t0:t0 + tp, :], value=post_w)
    nl.store(comb[t0:t0 + tp, :], value=c)


def _gemm_dtype(x):
    return nl.float32 if x.dtype == nl.float32 else nl.bfloat16


def _hc_mixes(x, fn_hi, fn_lo, scale, base, norm_eps):
    """x [T, n*d]; fn_hi [mix, n*d] bf16, fn_lo bf16 (fp32 with fp32 x); scale [3]; base [mix] ->
    pre [T, n], post [T, n], comb [T, n*n]."""
    t, k = x.shape
    n = HC_MULT
    assert k % K_TILE == 0, "hc_mixes: n*d must be a multiple of 128"
    assert fn_hi.shape[0] == MIX and fn_lo.shape[0] == MIX, "hc_mixes: fn must have (2+n)*n rows"
    pre = nl.ndarray((t, n), dtype=nl.float32, buffer=nl.shared_hbm)
    post = nl.ndarray((t, n), dtype=nl.float32, buffer=nl.shared_hbm)
    comb = nl.ndarray((t, n * n), dtype=nl.float32, buffer=nl.shared_hbm)
    fn_hi_t = _load_fn_transposed(fn_hi, _gemm_dtype(x))
    fn_lo_t = _load_fn_transposed(fn_lo, _gemm_dtype(x))
    for i in nl.affine_range(n_tiles(t, PMAX)):
        _mixes_tile(x, fn_hi_t, fn_lo_t, scale, base, pre, post, comb, i * PMAX, piece_width(t, PMAX, i), norm_eps)
    return pre, post, comb


@nki.jit
def hc_mixes_v4(x, fn_hi, fn_lo, scale, base):
    """hc_mixes with V4's norm epsilon (1e-6)."""
    return _hc_mixes(x, fn_hi, fn_lo, scale, base, NORM_EPS_V4)


@nki.jit
def hc_mixes_v41(x, fn_hi, fn_lo, scale, base):
    """hc_mixes with V4.1's norm epsilon (1e-20)."""
    return _hc_mixes(x, fn_hi, fn_lo, scale, base, NORM_EPS_V41)


hc_mixes = hc_mixes_v4


def _collapse_chunk(x, pre_w, t0, tp, c0, cw, d):
    """SBUF [tp, cw] in x's dtype: sum_m pre_w[:, m] * x[t0:t0+tp, m*d+c0 : m*d+c0+cw], fp32 accumulation."""
    n = HC_MULT
    acc = nl.ndarray((tp, cw), dtype=nl.float32, buffer=nl.sbuf)
    xm = nl.load(x[t0:t0 + tp, c0:c0 + cw])
    nisa.tensor_scalar(dst=acc, data=xm, op0=nl.multiply, operand0=pre_w[:, 0:1])
    res = nl.ndarray((tp, cw), dtype=x.dtype, buffer=nl.sbuf)
    for m in range(1, n):
        xm = nl.load(x[t0:t0 + tp, m * d + c0:m * d + c0 + cw])
        dst = res if m == n - 1 else acc
        nisa.scalar_tensor_tensor(dst=dst, data=xm, op0=nl.multiply, operand0=pre_w[:, m:m + 1], op1=nl.add,
                                  operand1=acc)
    return res


def _collapse_tile(x, pre_w, out, t0, tp):
    """out[t0:t0+tp] = sum_m pre_w[:, m] * x[t0:t0+tp, m*d:(m+1)*d] in fp32, stored in out's dtype."""
    d = out.shape[1]
    for c in nl.affine_range(n_tiles(d, FREE_CHUNK)):
        c0 = c * FREE_CHUNK
        cw = piece_width(d, FREE_CHUNK, c)
        nl.store(out[t0:t0 + tp, c0:c0 + cw], value=_collapse_chunk(x, pre_w, t0, tp, c0, cw, d))


def _collapse_from_hbm_tile(x, pre, out, t0, tp):
    pre_w = nl.load(pre[t0:t0 + tp, :])
    _collapse_tile(x, pre_w, out, t0, tp)


@nki.jit
def hc_collapse(x, pre):
    """x [T, n*d] (bf16/fp32), pre [T, n] fp32 -> [T, d] in x's dtype: sum_m pre[m] * x[m], fp32 accumulation."""
    t, k = x.shape
    d = k // HC_MULT
    out = nl.ndarray((t, d), dtype=x.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(n_tiles(t, PMAX)):
        _collapse_from_hbm_tile(x, pre, out, i * PMAX, piece_width(t, PMAX, i))
    return out


def _expand_tile(e, out, t0, tp):
    d = e.shape[1]
    for c in nl.affine_range(n_tiles(d, FREE_CHUNK)):
        c0 = c * FREE_CHUNK
        cw = piece_width(d, FREE_CHUNK, c)
        tile = nl.load(e[t0:t0 + tp, c0:c0 + cw])
        for m in range(HC_MULT):
            nl.store(out[t0:t0 + tp, m * d + c0:m * d + c0 + cw], value=tile)


@nki.jit
def hc_expand(e):
    """e [T, d] -> [T, n*d]: n copies of each row, stream-major (out[:, m*d:(m+1)*d] = e)."""
    t, d = e.shape
    out = nl.ndarray((t, HC_MULT * d), dtype=e.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(n_tiles(t, PMAX)):
        _expand_tile(e, out, i * PMAX, piece_width(t, PMAX, i))
    return out


def _attn_out_tile(y, residual, post, comb, out, t0, tp):
    """out[o] = post[o] * y + sum_i comb[i, o] * residual[i] for token rows t0 .. t0 + tp."""
    n = HC_MULT
    d = y.shape[1]
    post_w = nl.load(post[t0:t0 + tp, :])
    comb_w = nl.load(comb[t0:t0 + tp, :])
    for c in nl.affine_range(n_tiles(d, FREE_CHUNK)):
        c0 = c * FREE_CHUNK
        cw = piece_width(d, FREE_CHUNK, c)
        yc = nl.load(y[t0:t0 + tp, c0:c0 + cw])
        res = []
        for i in range(n):
            res.append(nl.load(residual[t0:t0 + tp, i * d + c0:i * d + c0 + cw]))
        for o in range(n):
            mixed = nl.ndarray((tp, cw), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=mixed, data=res[0], op0=nl.multiply, operand0=comb_w[:, o:o + 1])
            for i in range(1, n):
                nisa.scalar_tensor_tensor(dst=mixed, data=res[i], op0=nl.multiply,
                                          operand0=comb_w[:, i * n + o:i * n + o + 1], op1=nl.add, operand1=mixed)
            oc = nl.ndarray((tp, cw), dtype=y.dtype, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=oc, data=yc, op0=nl.multiply, operand0=post_w[:, o:o + 1], op1=nl.add,
                                      operand1=mixed)
            nl.store(out[t0:t0 + tp, o * d + c0:o * d + c0 + cw], value=oc)


@nki.jit
def hc_attn_out(y, residual, post, comb):
    """y [T, d], residual [T, n*d], post [T, n], comb [T, n*n] (row-major, first index = input stream)
    -> [T, n*d] in y's dtype: out[o] = post[o] * y + sum_i comb[i, o] * residual[i], fp32 math."""
    t, d = y.shape
    out = nl.ndarray((t, HC_MULT * d), dtype=y.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(n_tiles(t, PMAX)):
        _attn_out_tile(y, residual, post, comb, out, i * PMAX, piece_width(t, PMAX, i))
    return out


def _head_tile(x, fn_hi_t, fn_lo_t, scale, base, out, t0, tp, norm_eps):
    mixes = _norm_mixes(x, fn_hi_t, fn_lo_t, t0, tp, norm_eps)
    sc = _row_broadcast(scale, 0, 1, tp)
    bs = _row_broadcast(base, 0, HC_MULT, tp)
    pre_w = _sigmoid_weights(_affine(mixes, 0, HC_MULT, sc[:, 0:1], bs), 1.0, HC_EPS)
    _collapse_tile(x, pre_w, out, t0, tp)


def _hc_head(x, fn_hi, fn_lo, scale, base, norm_eps):
    """x [T, n*d]; fn_hi [n, n*d] bf16, fn_lo bf16 (fp32 with fp32 x); scale [1]; base [n] -> [T, d] in x's dtype."""
    t, k = x.shape
    assert k % K_TILE == 0, "hc_head: n*d must be a multiple of 128"
    assert fn_hi.shape[0] == HC_MULT and fn_lo.shape[0] == HC_MULT, "hc_head: fn must have n rows"
    out = nl.ndarray((t, k // HC_MULT), dtype=x.dtype, buffer=nl.shared_hbm)
    fn_hi_t = _load_fn_transposed(fn_hi, _gemm_dtype(x))
    fn_lo_t = _load_fn_transposed(fn_lo, _gemm_dtype(x))
    for i in nl.affine_range(n_tiles(t, PMAX)):
        _head_tile(x, fn_hi_t, fn_lo_t, scale, base, out, i * PMAX, piece_width(t, PMAX, i), norm_eps)
    return out


@nki.jit
def hc_head_v4(x, fn_hi, fn_lo, scale, base):
    """V4's final collapse: pre = sigmoid(norm-applied mixes * scale + base) + eps (no Sinkhorn), then collapse."""
    return _hc_head(x, fn_hi, fn_lo, scale, base, NORM_EPS_V4)


@nki.jit
def hc_head_v41(x, fn_hi, fn_lo, scale, base):
    """hc_head with V4.1's norm epsilon (1e-20)."""
    return _hc_head(x, fn_hi, fn_lo, scale, base, NORM_EPS_V41)


hc_head = hc_head_v4

MIXES_KERNELS = {NORM_EPS_V4: "hc_mixes_v4", NORM_EPS_V41: "hc_mixes_v41"}
HEAD_KERNELS = {NORM_EPS_V4: "hc_head_v4", NORM_EPS_V41: "hc_head_v41"}


# ------------------------------------------------------------------------------------------ RMSNorm, SwiGLU


def _rmsnorm_tile(x, w, out, t0, tp, eps):
    d = x.shape[1]
    sumsq = nl.zeros((tp, 1), dtype=nl.float32, buffer=nl.sbuf)
    for c in nl.affine_range(n_tiles(d, FREE_CHUNK)):
        c0 = c * FREE_CHUNK
        _add_sum_of_squares(sumsq, nl.load(x[t0:t0 + tp, c0:c0 + piece_width(d, FREE_CHUNK, c)]))
    r = _rsqrt_mean(sumsq, d, eps)
    for c in nl.affine_range(n_tiles(d, FREE_CHUNK)):
        c0 = c * FREE_CHUNK
        cw = piece_width(d, FREE_CHUNK, c)
        xc = nl.load(x[t0:t0 + tp, c0:c0 + cw])
        wc = _row_broadcast(w, c0, c0 + cw, tp)
        yc = nl.ndarray((tp, cw), dtype=x.dtype, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=yc, data=xc, op0=nl.multiply, operand0=r, op1=nl.multiply, operand1=wc)
        nl.store(out[t0:t0 + tp, c0:c0 + cw], value=yc)


@nki.jit
def rmsnorm(x, w, eps):
    """x [T, d] (bf16/fp32), w [d] fp32 -> [T, d] in x's dtype: w * x * rsqrt(mean(x^2) + eps), fp32 math."""
    t, d = x.shape
    out = nl.ndarray((t, d), dtype=x.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(n_tiles(t, PMAX)):
        _rmsnorm_tile(x, w, out, i * PMAX, piece_width(t, PMAX, i), eps)
    return out


def _swiglu_tile(g, u, out, t0, tp, limit):
    f = g.shape[1]
    for c in nl.affine_range(n_tiles(f, FREE_CHUNK)):
        c0 = c * FREE_CHUNK
        cw = piece_width(f, FREE_CHUNK, c)
        gc = nl.load(g[t0:t0 + tp, c0:c0 + cw])
        uc = nl.load(u[t0:t0 + tp, c0:c0 + cw])
        if limit > 0:
            gl = nl.ndarray((tp, cw), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=gl, data=gc, op0=nl.minimum, operand0=limit)
            ul = nl.ndarray((tp, cw), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=ul, data=uc, op0=nl.minimum, operand0=limit, op1=nl.maximum, operand1=-limit)
            gc, uc = gl, ul
        act = nl.ndarray((tp, cw), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=act, op=nl.silu, data=gc)
        yc = nl.ndarray((tp, cw), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=yc, data1=act, data2=uc, op=nl.multiply)
        nl.store(out[t0:t0 + tp, c0:c0 + cw], value=yc)


@nki.jit
def swiglu(g, u, limit):
    """g, u [T, f] (bf16/fp32) -> [T, f] fp32: silu(min(g, L)) * clamp(u, -L, L) (no clamp when L <= 0)."""
    t, f = g.shape
    out = nl.ndarray((t, f), dtype=nl.float32, buffer=nl.shared_hbm)
    for i in nl.affine_range(n_tiles(t, PMAX)):
        _swiglu_tile(g, u, out, i * PMAX, piece_width(t, PMAX, i), limit)
    return out


# ------------------------------------------------------------------------------------------ fused pre and post
#
# hc_pre: the mHC pre step of a site in one launch: mixes (with Sinkhorn), the collapse and the sublayer's RMSNorm
# (y = rms_norm(collapse(x, pre), w), the collapse rounded to x's dtype first as the unfused path does), plus the
# post and comb weights the post step needs. hc_post_fused: the post step. Each picks its layout by shape:
#
# - prefill (T > DECODE_MAX_T): tokens on the partition axis in tiles of 128, as the kernels above;
# - decode (T <= DECODE_MAX_T): hidden on the partition axis. Hidden element k = m*d + p*dj + i of stream m goes
#   to partition p (dj = d / 128), so one DMA brings all of x ([128, T, n, dj]) and one each of fn's hi and lo
#   ([128, mix, n, dj], 6 KiB per partition); the GEMM contracts over partitions with one matmul per (m, i); the
#   per-token weights are spread over the partitions by a matmul with ones. DECODE_MAX_T = 32 keeps the spread
#   comb weights (T * n * n fp32) in one PSUM bank.

DECODE_MAX_T = 32


def _identity(t):
    """SBUF fp32 [t, t]: the identity (iota of column - row, compared with 0)."""
    io = nl.ndarray((t, t), dtype=nl.int32, buffer=nl.sbuf)
    nisa.iota(io, [[1, t]], 0, channel_multiplier=-1)
    eye = nl.ndarray((t, t), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=eye, data=io, op0=nl.equal, operand0=0)
    return eye


def _spread(v, eye, ones_t):
    """SBUF fp32 [128, t*w] with out[p, r*w + j] = v[r, j] for every partition p: v [t, w] fp32 on t partitions,
    made block-diagonal ([t, t*w], row r holding v[r] in its block) and summed over rows by a matmul with ones."""
    t, w = v.shape
    blocks = nl.ndarray((t, t * w), dtype=nl.float32, buffer=nl.sbuf)
    for r in range(t):
        nisa.tensor_scalar(dst=blocks[:, r * w:(r + 1) * w], data=v, op0=nl.multiply, operand0=eye[:, r:r + 1])
    ps = nl.ndarray((PMAX, t * w), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=ps, stationary=ones_t, moving=blocks)
    out = nl.ndarray((PMAX, t * w), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out, src=ps)
    return out


def _partition_sum(part, ones_col):
    """SBUF fp32 [t, 1]: the sum over the 128 partitions of part [128, t] (a matmul with a ones column)."""
    t = part.shape[1]
    ps = nl.ndarray((t, 1), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=ps, stationary=part, moving=ones_col)
    out = nl.ndarray((t, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out, src=ps)
    return out


def _ones(p, f):
    one = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(one, 1.0)
    return one


def _hidden_view(a, t, d):
    """The HBM view of a [t, n*d] tensor as [128, t, n, d/128]: element (p, r, m, i) = a[r, m*d + p*(d/128) + i]."""
    dj = d // PMAX
    return a.ap(pattern=[[dj, PMAX], [HC_MULT * d, t], [d, HC_MULT], [1, dj]], offset=0)


def _load_hidden_fn(fn, d, mm_dtype):
    """SBUF [128, mix, n, dj] in the GEMM dtype: fn [mix, n*d] with hidden on the partitions, in one DMA."""
    raw = nl.load(_hidden_view(fn, fn.shape[0], d))
    if mm_dtype == raw.dtype:
        return raw
    wide = nl.ndarray(raw.shape, dtype=mm_dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=wide, src=raw)
    return wide


def _hidden_mixes(xs, fn_hi_h, fn_lo_h, ones_col, d, norm_eps):
    """SBUF fp32 [t, mix]: the norm-applied mixes of the t rows held hidden-on-partitions in xs [128, t, n, dj]."""
    t = xs.shape[1]
    dj = d // PMAX
    mix = fn_hi_h.shape[1]
    acc = nl.ndarray((t, mix), dtype=nl.float32, buffer=nl.psum)
    for m in range(HC_MULT):
        for i in range(dj):
            nisa.nc_matmul(dst=acc, stationary=xs[:, :, m, i], moving=fn_hi_h[:, :, m, i])
            nisa.nc_matmul(dst=acc, stationary=xs[:, :, m, i], moving=fn_lo_h[:, :, m, i])
    part = nl.ndarray((PMAX, t), dtype=nl.float32, buffer=nl.sbuf)
    sq = nl.ndarray((PMAX, HC_MULT * dj), dtype=nl.float32, buffer=nl.sbuf)
    flat = xs.reshape((PMAX, t, HC_MULT * dj))
    for r in range(t):
        nisa.activation_reduce(dst=sq, op=nl.square, data=flat[:, r, :], reduce_op=nl.add,
                               reduce_res=part[:, r:r + 1])
    rs = _rsqrt_mean(_partition_sum(part, ones_col), HC_MULT * d, norm_eps)
    mixes = nl.ndarray((t, mix), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=mixes, data=acc, op0=nl.multiply, operand0=rs)
    return mixes


def _hidden_pre(x, fn_hi, fn_lo, scale, base, w, y, post, comb, norm_eps):
    """hc_pre for t <= DECODE_MAX_T rows, hidden on the partitions."""
    t, k = x.shape
    _hidden_pre_of(nl.load(_hidden_view(x, t, k // HC_MULT)), fn_hi, fn_lo, scale, base, w, y, post, comb, norm_eps)


def _hidden_pre_of(xs, fn_hi, fn_lo, scale, base, w, y, post, comb, norm_eps):
    """hc_pre of the rows held in SBUF as xs [128, t, n, d/128] (hidden on the partitions)."""
    t = xs.shape[1]
    d = y.shape[1]
    dj = d // PMAX
    mm = _gemm_dtype(xs)
    if mm != xs.dtype:
        xw = nl.ndarray(xs.shape, dtype=mm, buffer=nl.sbuf)
        nisa.tensor_copy(dst=xw, src=xs)
        xg = xw
    else:
        xg = xs
    ones_col = _ones(PMAX, 1)
    mixes = _hidden_mixes(xg, _load_hidden_fn(fn_hi, d, mm), _load_hidden_fn(fn_lo, d, mm), ones_col, d, norm_eps)
    pre_w, post_w, c = _weights(mixes, scale, base)
    nl.store(post[0:t, :], value=post_w)
    nl.store(comb[0:t, :], value=c)
    eye = _identity(t)
    ones_t = _ones(t, PMAX)
    pre_b = _spread(pre_w, eye, ones_t)  # [128, t*n]
    ys = nl.ndarray((PMAX, t, dj), dtype=xs.dtype, buffer=nl.sbuf)
    acc = nl.ndarray((PMAX, dj), dtype=nl.float32, buffer=nl.sbuf)
    for r in range(t):
        j = r * HC_MULT
        nisa.tensor_scalar(dst=acc, data=xs[:, r, 0, :], op0=nl.multiply, operand0=pre_b[:, j:j + 1])
        for m in range(1, HC_MULT):
            dst = ys[:, r, :] if m == HC_MULT - 1 else acc
            nisa.scalar_tensor_tensor(dst=dst, data=xs[:, r, m, :], op0=nl.multiply,
                                      operand0=pre_b[:, j + m:j + m + 1], op1=nl.add, operand1=acc)
    part = nl.ndarray((PMAX, t), dtype=nl.float32, buffer=nl.sbuf)
    sq = nl.ndarray((PMAX, dj), dtype=nl.float32, buffer=nl.sbuf)
    for r in range(t):
        nisa.activation_reduce(dst=sq, op=nl.square, data=ys[:, r, :], reduce_op=nl.add,
                               reduce_res=part[:, r:r + 1])
    rs_b = _spread(_rsqrt_mean(_partition_sum(part, ones_col), d, norm_eps), eye, ones_t)  # [128, t]
    wt = nl.load(w.ap(pattern=[[dj, PMAX], [1, dj]], offset=0))
    out = nl.ndarray((PMAX, t, dj), dtype=xs.dtype, buffer=nl.sbuf)
    for r in range(t):
        nisa.scalar_tensor_tensor(dst=out[:, r, :], data=ys[:, r, :], op0=nl.multiply, operand0=rs_b[:, r:r + 1],
                                  op1=nl.multiply, operand1=wt)
    nl.store(y.ap(pattern=[[dj, PMAX], [d, t], [1, dj]], offset=0), value=out)


def _token_pre_tile(x, fn_hi_t, fn_lo_t, scale, base, w, y, post, comb, t0, tp, norm_eps):
    """hc_pre for token rows t0 .. t0 + tp, tokens on the partitions."""
    d = y.shape[1]
    pre_w, post_w, c = _weights(_norm_mixes(x, fn_hi_t, fn_lo_t, t0, tp, norm_eps), scale, base)
    nl.store(post[t0:t0 + tp, :], value=post_w)
    nl.store(comb[t0:t0 + tp, :], value=c)
    chunks = []
    sumsq = nl.zeros((tp, 1), dtype=nl.float32, buffer=nl.sbuf)
    for ci in nl.affine_range(n_tiles(d, FREE_CHUNK)):
        res = _collapse_chunk(x, pre_w, t0, tp, ci * FREE_CHUNK, piece_width(d, FREE_CHUNK, ci), d)
        _add_sum_of_squares(sumsq, res)
        chunks.append(res)
    r = _rsqrt_mean(sumsq, d, norm_eps)
    for ci in nl.affine_range(n_tiles(d, FREE_CHUNK)):
        c0 = ci * FREE_CHUNK
        cw = piece_width(d, FREE_CHUNK, ci)
        wc = _row_broadcast(w, c0, c0 + cw, tp)
        yc = nl.ndarray((tp, cw), dtype=y.dtype, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=yc, data=chunks[ci], op0=nl.multiply, operand0=r, op1=nl.multiply,
                                  operand1=wc)
        nl.store(y[t0:t0 + tp, c0:c0 + cw], value=yc)


def _hc_pre(x, fn_hi, fn_lo, scale, base, w, norm_eps, layout):
    """x [T, n*d]; fn_hi [mix, n*d] bf16, fn_lo bf16 (fp32 with fp32 x); scale [3]; base [mix]; w [d] fp32 ->
    y [T, d] (x's dtype) = rms_norm(collapse(x, pre), w), post [T, n], comb [T, n*n] (fp32).
    ``layout``: "hidden" (hidden on partitions, T <= DECODE_MAX_T), "tokens", or "auto" (by T)."""
    t, k = x.shape
    d = k // HC_MULT
    assert d % PMAX == 0, "hc_pre: d must be a multiple of 128"
    assert fn_hi.shape[0] == MIX and fn_lo.shape[0] == MIX, "hc_pre: fn must have (2+n)*n rows"
    y = nl.ndarray((t, d), dtype=x.dtype, buffer=nl.shared_hbm)
    post = nl.ndarray((t, HC_MULT), dtype=nl.float32, buffer=nl.shared_hbm)
    comb = nl.ndarray((t, HC_MULT * HC_MULT), dtype=nl.float32, buffer=nl.shared_hbm)
    hidden = layout == "hidden" or (layout == "auto" and t <= DECODE_MAX_T)
    if hidden:
        assert t <= DECODE_MAX_T, "hc_pre: the hidden-on-partitions layout takes at most DECODE_MAX_T rows"
        _hidden_pre(x, fn_hi, fn_lo, scale, base, w, y, post, comb, norm_eps)
    else:
        fn_hi_t = _load_fn_transposed(fn_hi, _gemm_dtype(x))
        fn_lo_t = _load_fn_transposed(fn_lo, _gemm_dtype(x))
        for i in nl.affine_range(n_tiles(t, PMAX)):
            _token_pre_tile(x, fn_hi_t, fn_lo_t, scale, base, w, y, post, comb, i * PMAX, piece_width(t, PMAX, i),
                            norm_eps)
    return y, post, comb


@nki.jit
def hc_pre_v4(x, fn_hi, fn_lo, scale, base, w):
    """The fused pre step with V4's norm epsilon (1e-6), layout by T."""
    return _hc_pre(x, fn_hi, fn_lo, scale, base, w, NORM_EPS_V4, "auto")


@nki.jit
def hc_pre_v41(x, fn_hi, fn_lo, scale, base, w):
    """The fused pre step with V4.1's norm epsilon (1e-20), layout by T."""
    return _hc_pre(x, fn_hi, fn_lo, scale, base, w, NORM_EPS_V41, "auto")


@nki.jit
def hc_pre_tokens_v4(x, fn_hi, fn_lo, scale, base, w):
    """hc_pre_v4 with tokens on the partitions at any T (the prefill layout)."""
    return _hc_pre(x, fn_hi, fn_lo, scale, base, w, NORM_EPS_V4, "tokens")


PRE_KERNELS = {NORM_EPS_V4: "hc_pre_v4", NORM_EPS_V41: "hc_pre_v41"}


def _hidden_post(y, residual, post, comb, out):
    """hc_post for t <= DECODE_MAX_T rows, hidden on the partitions: three large DMAs (y, residual, out)."""
    t, d = y.shape
    nl.store(_hidden_view(out, t, d), value=_hidden_post_of(y, residual, post, comb))


def _hidden_post_of(y, residual, post, comb):
    """SBUF [128, t, n, d/128] in y's dtype: the post step's new streams, hidden on the partitions."""
    t, d = y.shape
    n = HC_MULT
    dj = d // PMAX
    ys = nl.load(y.ap(pattern=[[dj, PMAX], [d, t], [1, dj]], offset=0))
    rs = nl.load(_hidden_view(residual, t, d))
    eye = _identity(t)
    ones_t = _ones(t, PMAX)
    post_b = _spread(nl.load(post), eye, ones_t)  # [128, t*n]
    comb_b = _spread(nl.load(comb), eye, ones_t)  # [128, t*n*n]
    os = nl.ndarray((PMAX, t, n, dj), dtype=y.dtype, buffer=nl.sbuf)
    mixed = nl.ndarray((PMAX, dj), dtype=nl.float32, buffer=nl.sbuf)
    for r in range(t):
        for o in range(n):
            cb = r * n * n
            nisa.tensor_scalar(dst=mixed, data=rs[:, r, 0, :], op0=nl.multiply, operand0=comb_b[:, cb + o:cb + o + 1])
            for i in range(1, n):
                j = cb + i * n + o
                nisa.scalar_tensor_tensor(dst=mixed, data=rs[:, r, i, :], op0=nl.multiply,
                                          operand0=comb_b[:, j:j + 1], op1=nl.add, operand1=mixed)
            pj = r * n + o
            nisa.scalar_tensor_tensor(dst=os[:, r, o, :], data=ys[:, r, :], op0=nl.multiply,
                                      operand0=post_b[:, pj:pj + 1], op1=nl.add, operand1=mixed)
    return os


@nki.jit
def hc_post(y, residual, post, comb):
    """hc_attn_out with the layout by T: hidden on the partitions for T <= DECODE_MAX_T, else tokens."""
    t, d = y.shape
    out = nl.ndarray((t, HC_MULT * d), dtype=y.dtype, buffer=nl.shared_hbm)
    if t <= DECODE_MAX_T and d % PMAX == 0:
        _hidden_post(y, residual, post, comb, out)
    else:
        for i in nl.affine_range(n_tiles(t, PMAX)):
            _attn_out_tile(y, residual, post, comb, out, i * PMAX, piece_width(t, PMAX, i))
    return out


def _hc_post_pre(y, residual, post, comb, fn_hi, fn_lo, scale, base, w, norm_eps):
    """One site's post step and the next site's pre step in one launch, for t <= DECODE_MAX_T rows (hidden on the
    partitions): the new streams stay in SBUF between the two and are stored once (the next post's residual).
    -> x_new [t, n*d] (y's dtype), and hc_pre's y [t, d], post [t, n], comb [t, n*n] of the next site."""
    t, d = y.shape
    assert t <= DECODE_MAX_T and d % PMAX == 0, "hc_post_pre: at most DECODE_MAX_T rows, d a multiple of 128"
    x_new = nl.ndarray((t, HC_MULT * d), dtype=y.dtype, buffer=nl.shared_hbm)
    y_next = nl.ndarray((t, d), dtype=y.dtype, buffer=nl.shared_hbm)
    post_next = nl.ndarray((t, HC_MULT), dtype=nl.float32, buffer=nl.shared_hbm)
    comb_next = nl.ndarray((t, HC_MULT * HC_MULT), dtype=nl.float32, buffer=nl.shared_hbm)
    xs = _hidden_post_of(y, residual, post, comb)
    nl.store(_hidden_view(x_new, t, d), value=xs)
    _hidden_pre_of(xs, fn_hi, fn_lo, scale, base, w, y_next, post_next, comb_next, norm_eps)
    return x_new, y_next, post_next, comb_next


@nki.jit
def hc_post_pre_v4(y, residual, post, comb, fn_hi, fn_lo, scale, base, w):
    """hc_post, then hc_pre_v4 of the next site on its result, in one launch (decode rows)."""
    return _hc_post_pre(y, residual, post, comb, fn_hi, fn_lo, scale, base, w, NORM_EPS_V4)


@nki.jit
def hc_post_pre_v41(y, residual, post, comb, fn_hi, fn_lo, scale, base, w):
    """hc_post, then hc_pre_v41 of the next site on its result, in one launch (decode rows)."""
    return _hc_post_pre(y, residual, post, comb, fn_hi, fn_lo, scale, base, w, NORM_EPS_V41)


POST_PRE_KERNELS = {NORM_EPS_V4: "hc_post_pre_v4", NORM_EPS_V41: "hc_post_pre_v41"}
