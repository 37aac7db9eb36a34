"""mhcrun's NKI simulator: correct kernels compute right answers, and every hardware rule is enforced.

Kernels are written exactly as for the real ``nki`` package (``import nki`` ...) and loaded through
``load_kernel_module``, which binds those imports to the simulator.
"""

from __future__ import annotations

import sys
import textwrap
import types

import numpy as np
import pytest
import torch

from mhcrun.nki.sim import NkiSimError, load_kernel_module

HEADER = "import nki\nimport nki.language as nl\nimport nki.isa as nisa\n\n\n"


@pytest.fixture
def load(tmp_path):
    count = iter(range(1000))

    def _load(src: str) -> types.ModuleType:
        path = tmp_path / f"kernel_{next(count)}.py"
        path.write_text(HEADER + textwrap.dedent(src))
        return load_kernel_module(path)

    return _load


# ------------------------------------------------------------------------------------------ correct kernels

MATMUL = """
@nki.jit
def matmul(a_t, b, explicit):
    # out[M, N] = a_t[K, M].T @ b[K, N], tiled over K (accumulated in PSUM), M and N, partial last tiles.
    K, M = a_t.shape
    N = b.shape[1]
    out = nl.ndarray((M, N), dtype=b.dtype, buffer=nl.shared_hbm)
    for mi in nl.affine_range((M + 127) // 128):
        m0, m1 = mi * 128, min((mi + 1) * 128, M)
        for ni in nl.affine_range((N + 511) // 512):
            n0, n1 = ni * 512, min((ni + 1) * 512, N)
            acc = nl.ndarray((m1 - m0, n1 - n0), dtype=nl.float32, buffer=nl.psum)
            for ki in nl.sequential_range((K + 127) // 128):
                k0, k1 = ki * 128, min((ki + 1) * 128, K)
                st = nl.ndarray((k1 - k0, m1 - m0), dtype=a_t.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=st, src=a_t[k0:k1, m0:m1])
                mv = nl.load(b[k0:k1, n0:n1])
                if explicit:
                    nisa.nc_matmul(dst=acc, stationary=st, moving=mv, accumulate=(ki > 0))
                else:
                    nisa.nc_matmul(acc, st, mv)
            res = nl.ndarray((m1 - m0, n1 - n0), dtype=b.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=acc)
            nl.store(out[m0:m1, n0:n1], value=res)
    return out
"""


@pytest.mark.parametrize("explicit", [True, False])
def test_tiled_matmul_accumulates_k_with_partial_tiles(load, explicit):
    m = load(MATMUL)
    g = torch.Generator().manual_seed(0)
    a_t, b = torch.randn(300, 200, generator=g), torch.randn(300, 700, generator=g)
    out = m.matmul(a_t, b, explicit)
    assert out.dtype == torch.float32 and out.shape == (200, 700)
    torch.testing.assert_close(out, a_t.T @ b, rtol=1e-5, atol=1e-4)


def test_bf16_matmul_rounds_only_the_output(load):
    m = load(MATMUL)
    g = torch.Generator().manual_seed(1)
    a_t = torch.randn(256, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(256, 96, generator=g).to(torch.bfloat16)
    out = m.matmul(a_t, b, True)
    assert out.dtype == torch.bfloat16
    ref = (a_t.float().T @ b.float()).to(torch.bfloat16)  # fp32 accumulation, one rounding into bf16
    assert (out.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()


RMSNORM = """
@nki.jit
def rmsnorm(x, w, eps):
    # y = x * rsqrt(mean(x^2) + eps) * w, rows on partitions; w is [128, D] (pre-broadcast rows).
    T, D = x.shape
    y = nl.ndarray((T, D), dtype=x.dtype, buffer=nl.shared_hbm)
    wt = nl.load(w)
    for i in nl.affine_range((T + 127) // 128):
        r0, r1 = i * 128, min((i + 1) * 128, T)
        P = r1 - r0
        xt = nl.load(x[r0:r1, :])
        sq = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
        ss = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=sq, op=nl.square, data=xt, reduce_op=nl.add, reduce_res=ss,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        ms = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=ms, data=ss, op0=nl.multiply, operand0=1.0 / D, op1=nl.add, operand1=eps)
        rstd = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=rstd, op=nl.rsqrt, data=ms)
        xn = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=xn, data=xt, op0=nl.multiply, operand0=rstd)
        out = nl.ndarray((P, D), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=out, data1=xn, data2=wt[0:P, :], op=nl.multiply)
        nl.store(y[r0:r1, :], value=out)
    return y
"""


def test_rmsnorm_kernel_matches_torch(load):
    m = load(RMSNORM)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200, 256, generator=g).to(torch.bfloat16)
    w = torch.randn(256, generator=g).to(torch.bfloat16)
    y = m.rmsnorm(x, w.expand(128, 256).contiguous(), 1e-6)
    xf = x.float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2)


TRANSPOSE = """
@nki.jit
def transpose(x):
    P, F = x.shape
    out = nl.ndarray((F, P), dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x)
    tp = nl.ndarray((F, P), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_transpose(dst=tp, data=t)
    ts = nl.ndarray((F, P), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=ts, src=tp)
    nl.store(out, value=ts)
    return out


@nki.jit
def small_transpose(x):
    P, F = x.shape
    out = nl.ndarray((F, P), dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x)
    tv = nl.ndarray((F, P), dtype=x.dtype, buffer=nl.sbuf)
    nisa.nc_transpose(dst=tv, data=t, engine=nisa.engine.vector)
    nl.store(out, value=tv)
    return out
"""


def test_transposes(load):
    m = load(TRANSPOSE)
    x = torch.randn(100, 70)
    assert torch.equal(m.transpose(x), x.T)
    s = torch.randn(32, 20).to(torch.bfloat16)
    assert torch.equal(m.small_transpose(s), s.T)


ROUNDING = """
@nki.jit
def to_dtypes(x, y):
    P, F = x.shape
    o_bf = nl.ndarray((P, F), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    o_st = nl.ndarray((P, F), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    o_f8 = nl.ndarray((P, F), dtype=nl.float8_e4m3, buffer=nl.shared_hbm)
    t = nl.load(x)
    b = nl.ndarray((P, F), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=b, src=t)
    nl.store(o_bf, value=b)
    nl.store(o_st, value=t)  # fp32 tile into a bf16 HBM tensor: rounded on the store
    f8 = nl.ndarray((P, F), dtype=nl.float8_e4m3, buffer=nl.sbuf)
    nisa.activation(dst=f8, op=nl.copy, data=nl.load(y), scale=0.5)
    nl.store(o_f8, value=f8)
    return o_bf, o_st, o_f8
"""


def test_bf16_and_fp8_rounding_on_write(load):
    m = load(ROUNDING)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 300, generator=g) * 10
    x[0, :4] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.0e38])  # ties to even, overflow
    y = x.clone()
    y[0, :4] = torch.tensor([479.0, -479.0, 400.0, 2.0**-10])  # 239.5 and 200 round within trn2's e4m3 (max 240)
    o_bf, o_st, o_f8 = m.to_dtypes(x, y)
    assert o_bf.dtype == torch.bfloat16 and o_f8.dtype == torch.float8_e4m3fn  # torch's holder of the <=240 values
    assert torch.equal(o_bf, x.to(torch.bfloat16))
    assert torch.equal(o_st, x.to(torch.bfloat16))
    assert torch.equal(o_f8.float(), (y * 0.5).to(torch.float8_e4m3fn).float())
    assert o_f8[0, :3].tolist() == [240.0, -240.0, 192.0]


def test_fp8_is_the_targets_e4m3_with_240_its_largest_value(load):
    m = load(ROUNDING)
    x = torch.ones(4, 8)
    y = torch.ones(4, 8)
    y[1, 2] = 2 * 250.0  # 250 rounds to 256: a value OCP e4m3fn has (up to 448), trn2's float8_e4m3 has not
    with pytest.raises(NkiSimError, match="float8_e4m3 overflow: 250 rounds beyond 240"):
        m.to_dtypes(x, y)
    with pytest.raises(NkiSimError, match="float8_e4m3fn exists only from NeuronCore-v4"):
        load("@nki.jit\ndef k():\n    t = nl.ndarray((4, 4), dtype=nl.float8_e4m3fn, buffer=nl.sbuf)\n").k()


MISC = """
@nki.jit
def misc(x, col):
    P, F = x.shape
    t = nl.load(x)
    c = nl.load(col)
    e = nl.exp(t)                      # nl.* math on tiles -> new SBUF tiles
    s = nl.ndarray((P, F), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=s, data=e, op0=nl.add, operand0=c)  # a [P, 1] column broadcasts in tensor_scalar
    s2 = nl.multiply(s, 2.0)
    r = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=r, op=nl.maximum, data=s2, axis=1, keepdims=True)
    io = nl.ndarray((P, F), dtype=nl.int32, buffer=nl.sbuf)
    nisa.iota(io, [[1, F]], 0, channel_multiplier=F)
    o1 = nl.ndarray((P, F), dtype=nl.float32, buffer=nl.shared_hbm)
    o2 = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    o3 = nl.ndarray((P, F), dtype=nl.int32, buffer=nl.shared_hbm)
    nl.store(o1, value=s2)
    nl.store(o2, value=r)
    nl.store(o3, value=io)
    return o1, o2, o3


@nki.jit
def spmd(x):
    P, F = x.shape
    out = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.shared_hbm)
    n = nl.num_programs(0)
    pid = nl.program_id(0)
    w = F // n
    t = nl.load(x[:, pid * w:(pid + 1) * w])
    d = nl.ndarray((P, w), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=d, data=t, op0=nl.add, operand0=float(pid))
    nl.store(out[:, pid * w:(pid + 1) * w], value=d)
    return out
"""


def test_nl_math_reduce_iota_and_spmd_grid(load):
    m = load(MISC)
    x, col = torch.randn(16, 40), torch.randn(16, 1)
    o1, o2, o3 = m.misc(x, col)
    ref = (x.exp() + col) * 2
    torch.testing.assert_close(o1, ref)
    torch.testing.assert_close(o2, ref.amax(1, keepdim=True))
    assert torch.equal(o3, torch.arange(16 * 40, dtype=torch.int32).reshape(16, 40))
    y = m.spmd[2](x)
    assert torch.equal(y, torch.cat([x[:, :20], x[:, 20:] + 1], dim=1))


INPLACE = """
@nki.jit
def scale_in_place(x):
    t = nl.load(x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=3.0)
    nisa.dma_copy(dst=x, src=t)
    return x
"""


def test_inputs_written_by_the_kernel_are_written_back(load):
    m = load(INPLACE)
    x = torch.randn(8, 5).to(torch.bfloat16)
    x0 = x.clone()
    y = m.scale_in_place(x)
    assert torch.equal(x, (x0.float() * 3).to(torch.bfloat16)) and torch.equal(y, x)


def test_language_surface(load):
    m = load(MATMUL)
    nl, nisa = m.nl, m.nisa
    assert not hasattr(nl, "divide")  # NKI has no division; nl.reciprocal + nl.multiply instead
    assert nl.tile_size.pmax == 128 and nl.tile_size.psum_fmax == 512
    assert nl.tile_size.gemm_stationary_fmax == 128 and nl.tile_size.gemm_moving_fmax == 512
    assert nl.bfloat16 == "bfloat16" and nl.float8_e4m3 == "float8_e4m3"
    with pytest.raises(NkiSimError, match="not implemented by mhcrun's NKI simulator"):
        nisa.nc_matmul_mx  # noqa: B018


def test_load_kernel_module_leaves_sys_modules_as_it_found_them(load):
    assert "nki" not in sys.modules
    m = load(MATMUL)
    assert "nki" not in sys.modules and "nki.language" not in sys.modules and "nki.isa" not in sys.modules
    fake = types.ModuleType("nki")  # stands for a real installation
    sys.modules["nki"] = fake
    try:
        m2 = load(MATMUL)
        assert sys.modules["nki"] is fake and "nki.isa" not in sys.modules
    finally:
        del sys.modules["nki"]
    assert m.nl.__name__ == m2.nl.__name__ == "mhcrun.nki.sim.language"
    x = torch.randn(16, 8)
    torch.testing.assert_close(m2.matmul(x, x, True), x.T @ x)


# ------------------------------------------------------------------------------------------ rule violations


def _err(load, body: str, *args):
    m = load("@nki.jit\ndef k(" + ", ".join(f"a{i}" for i in range(len(args))) + "):\n" + textwrap.indent(body, "    "))
    with pytest.raises(NkiSimError) as ei:
        m.k(*args)
    return str(ei.value)


X = torch.randn(128, 64)


def sb(shape, dtype="nl.float32"):
    return f"nl.ndarray({shape}, dtype={dtype}, buffer=nl.sbuf)"


def ps(shape):
    return f"nl.ndarray({shape}, dtype=nl.float32, buffer=nl.psum)"


def test_tile_of_129_partitions(load):
    assert "tile of 129 partitions exceeds nl.tile_size.pmax (128)" in _err(load, f"t = {sb('(129, 4)')}\n")


def test_psum_tile_must_be_fp32(load):
    msg = _err(load, "t = nl.ndarray((128, 64), dtype=nl.bfloat16, buffer=nl.psum)\n")
    assert "PSUM tile must be float32" in msg


def test_psum_tile_larger_than_psum(load):
    assert "PSUM tile of 16388 bytes per partition exceeds a PSUM partition (8 banks x 2048 bytes)" in _err(
        load, f"t = {ps('(128, 4097)')}\n")


def test_nl_binary_ops_do_not_broadcast_a_column(load):
    body = f"s = nl.load(a0)\nc = {sb('(128, 1)')}\nnisa.memset(c, 2.0)\nd = nl.add(s, c)\n"
    assert "binary nl.* operations do not broadcast" in _err(load, body, X)


def test_matmul_stationary_free_limit(load):
    body = f"s = {sb('(128, 130)')}\nnisa.memset(s, 1.0)\nm = {sb('(128, 64)')}\nnisa.memset(m, 1.0)\n"
    body += f"d = {ps('(128, 64)')}\nnisa.nc_matmul(d, s, m)\n"
    assert "nc_matmul: stationary free size 130 exceeds 128 (stationary shape (128, 130))" in _err(load, body)


def test_matmul_moving_free_limit(load):
    body = f"s = {sb('(128, 64)')}\nnisa.memset(s, 1.0)\nm = {sb('(128, 1024)')}\nnisa.memset(m, 1.0)\n"
    body += f"d = {ps('(64, 512)')}\nnisa.nc_matmul(d, s, m)\n"
    assert "nc_matmul: moving free size 1024 exceeds 512" in _err(load, body)


def test_matmul_contraction_mismatch(load):
    body = f"s = {sb('(128, 64)')}\nnisa.memset(s, 1.0)\nm = {sb('(64, 256)')}\nnisa.memset(m, 1.0)\n"
    body += f"d = {ps('(64, 256)')}\nnisa.nc_matmul(d, s, m)\n"
    msg = _err(load, body)
    assert "nc_matmul: contraction (partition) sizes differ: stationary K=128" in msg and "moving K=64" in msg


def test_matmul_contraction_over_128(load):
    # A K=256 operand cannot exist on chip: the load into SBUF is what fails.
    body = "s = nl.load(a0)\n"
    assert "tile of 256 partitions exceeds nl.tile_size.pmax (128)" in _err(load, body, torch.randn(256, 64))


def test_matmul_dst_must_be_psum(load):
    body = f"s = nl.load(a0)\nd = {sb('(64, 64)')}\nnisa.nc_matmul(d, s, s)\n"
    assert "nc_matmul: dst must be a PSUM tile" in _err(load, body, X)


def test_matmul_operand_in_hbm(load):
    body = f"s = nl.load(a0)\nd = {ps('(64, 64)')}\nnisa.nc_matmul(d, a0, s)\n"
    msg = _err(load, body, X)
    assert "nc_matmul: compute on HBM: stationary 'a0'" in msg


def test_store_from_psum(load):
    body = (
        f"s = nl.load(a0)\nd = {ps('(64, 64)')}\nnisa.nc_matmul(d, s, s)\n"
        "o = nl.ndarray((64, 64), dtype=nl.float32, buffer=nl.shared_hbm)\nnl.store(o, value=d)\nreturn o\n"
    )
    assert "store from PSUM: copy it to SBUF with nisa.tensor_copy first" in _err(load, body, X)


def test_compute_on_hbm(load):
    body = f"s = nl.load(a0)\nd = {sb('(128, 64)')}\nnisa.tensor_tensor(dst=d, data1=s, data2=a0, op=nl.add)\n"
    assert "tensor_tensor: compute on HBM: data2 'a0'" in _err(load, body, X)


def test_tensor_tensor_has_no_broadcasting(load):
    body = (
        f"s = nl.load(a0)\nc = {sb('(128, 1)')}\nnisa.memset(c, 2.0)\nd = {sb('(128, 64)')}\n"
        "nisa.tensor_tensor(dst=d, data1=s, data2=c, op=nl.multiply)\n"
    )
    assert "broadcasting is not supported by tensor_tensor: shapes (128, 64) and (128, 1)" in _err(load, body, X)


def test_tensor_scalar_operand_shape(load):
    body = (
        f"s = nl.load(a0)\nc = {sb('(128, 4)')}\nnisa.memset(c, 2.0)\nd = {sb('(128, 64)')}\n"
        "nisa.tensor_scalar(dst=d, data=s, op0=nl.multiply, operand0=c)\n"
    )
    assert "tensor_scalar: operand0 must be a compile-time scalar or a [P, 1] tile" in _err(load, body, X)


def test_tensor_reduce_not_over_partitions(load):
    body = f"s = nl.load(a0)\nd = {sb('(1, 64)')}\nnisa.tensor_reduce(dst=d, op=nl.add, data=s, axis=0)\n"
    assert "tensor_reduce: cannot reduce over the partition axis 0" in _err(load, body, X)


def test_read_of_unwritten_sbuf(load):
    body = f"s = {sb('(128, 64)')}\nd = {sb('(128, 64)')}\nnisa.tensor_copy(dst=d, src=s)\n"
    msg = _err(load, body)
    assert "tensor_copy: read of unwritten memory: src" in msg and "8192 of 8192 elements never written" in msg


def test_accumulate_into_unwritten_psum(load):
    body = f"s = nl.load(a0)\nd = {ps('(64, 64)')}\nnisa.nc_matmul(d, s, s, accumulate=True)\n"
    assert "nc_matmul: accumulate=True into unwritten PSUM" in _err(load, body, X)


def test_partially_written_tile(load):
    body = f"s = {sb('(128, 64)')}\nnisa.dma_copy(dst=s[0:100, :], src=a0[0:100, :])\nt = nl.exp(s)\n"
    msg = _err(load, body, X)
    assert "nl.exp: read of unwritten memory: x" in msg and "1792 of 8192 elements never written" in msg


def test_python_control_flow_on_a_tile(load):
    body = "s = nl.load(a0)\nif s:\n    pass\n"
    assert "Python truth test" in _err(load, body, X)
    assert "float() conversion" in _err(load, "s = nl.load(a0)\nv = float(s[0, 0])\n", X)


def test_loading_from_sbuf(load):
    body = "s = nl.load(a0)\nt = nl.load(s)\n"
    assert "nl.load: loading from SBUF" in _err(load, body, X)


def test_output_never_fully_written(load):
    body = "o = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.shared_hbm)\n"
    body += "nl.store(o[0:64], value=nl.load(a0[0:64]))\n"
    msg = _err(load, body + "return o\n", X)
    assert "kernel output 'shared_hbm_" in msg and "4096 of 8192 elements never written" in msg


def test_matmul_reaccumulation_after_read_needs_explicit_flag(load):
    body = (
        f"s = nl.load(a0)\nd = {ps('(64, 64)')}\nnisa.nc_matmul(d, s[:, 0:64], s)\n"
        f"r = {sb('(64, 64)')}\nnisa.tensor_copy(dst=r, src=d)\nnisa.nc_matmul(d, s[:, 0:64], s)\n"
    )
    assert "accumulate=None on PSUM tile" in _err(load, body, X)


def test_tensor_scalar_vector_operand_must_be_fp32(load):
    body = (
        f"s = nl.load(a0)\nc = {sb('(128, 1)', 'nl.bfloat16')}\nnisa.memset(c, 2.0)\nd = {sb('(128, 64)')}\n"
        "nisa.tensor_scalar(dst=d, data=s, op0=nl.multiply, operand0=c)\n"
    )
    assert "tensor_scalar: operand0 tile must be float32" in _err(load, body, X)


def test_out_of_bounds_slice(load):
    assert "index out of bounds: slice 0:130 on axis 0 of size 128" in _err(load, "t = nl.load(a0[0:130, :])\n", X)


def test_activation_reduce_needs_a_reset(load):
    body = (
        f"s = nl.load(a0)\nd = {sb('(128, 64)')}\nr = {sb('(128, 1)')}\n"
        "nisa.activation(dst=d, op=nl.exp, data=s, reduce_op=nl.add, reduce_res=r)\n"
    )
    assert "pass reduce_cmd=nisa.reduce_cmd.reset_reduce" in _err(load, body, X)


def test_numpy_inputs_and_nki_simulate(load):
    m = load(MATMUL)
    a = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    from mhcrun.nki.sim import simulate

    out = simulate(m.matmul)(a, a, True)
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, a.T @ a, rtol=1e-5, atol=1e-4)
