"""The fused CPU GEMV kernel (mhcrun/ops/qgemv.cpp) against dequantise-then-fp32-matmul.

Shapes cover partial tiles and groups, inner sizes that end inside a 16/32-byte vector, tile and group sizes
that are not multiples of the vector width, every remainder of the four-rows-at-a-time loop, grouped outputs
(wo_a) and each scale encoding. Results are compared with the two-summation-orders fp32 bound of
test_qlinear; a weight whose scales could overflow is not given to the kernel (QWeight.kernel, decided at load)
and qlinear gives the reference's values; NaN codes come out as NaN rows, as the reference gives them.
"""

from __future__ import annotations

import ctypes
import functools
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_ISAS, cpu_kernel, gemm_in, kernel_in
from test_qlinear import (
    assert_gemm_close,
    fp4_weight,
    fp8_weight,
    gen,
    qw,
    reference_qlinear,
    reference_weight,
    weight_of,
)

from mhcrun.ops import native, qgemv
from mhcrun.ops.attention import sparse_attn
from mhcrun.ops.index import index_scores, select_topk
from mhcrun.ops.qgemv import CpuKernel, expert_set, open_cpu_kernel
from mhcrun.ops.qlinear import dequantize, qlinear
from mhcrun.ops.quant import float_to_e8m0, fp8_simulate
from mhcrun.ops.qweight import QWeight
from mhcrun.ops.rope import apply_rope_tail
from mhcrun.settings import Env

needs_kernel = pytest.mark.skipif(not cpu_kernel().on, reason=f"CPU kernel {cpu_kernel().status()}")


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def cpu_vendor() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    return ""


def run(kernel: CpuKernel, x3: torch.Tensor, data, scale, fmt: str, block: int, groups: int = 1) -> torch.Tensor:
    y = kernel.qgemv(x3, qw(data, scale, block), groups)
    assert y is not None, "the kernel declined"
    return y


def check_groups(y: torch.Tensor, x3: torch.Tensor, w_ref: torch.Tensor) -> None:
    m, groups, k = x3.shape
    r = w_ref.shape[0] // groups
    assert y.shape == (m, groups, r) and y.dtype == torch.float32
    for gi in range(groups):
        rows = w_ref[gi * r:(gi + 1) * r]
        assert_gemm_close(y[:, gi], F.linear(x3[:, gi], rows), x3[:, gi], rows)


def test_kernel_builds_where_it_can():
    """On an AVX-512 CPU with a C++ compiler the kernel must be in use (a broken build must not hide)."""
    if not {"avx512f", "avx512bw", "avx512vl", "f16c", "fma"} <= cpu_flags():
        pytest.skip("CPU without AVX-512")
    if shutil.which(Env.read().cxx) is None:
        pytest.skip("no C++ compiler")
    bf16 = {"avx512_bf16", "avx512_vnni", "avx512vbmi", "bmi2"} <= cpu_flags()
    amx = " + amx" if bf16 and {"amx_tile", "amx_bf16"} <= cpu_flags() else ""  # prefill chunks by AMX tiles
    assert cpu_kernel().on and cpu_kernel().status() == ("avx512bf16" if bf16 and (cpu_vendor() == "AuthenticAMD"
                                                                                    or amx) else "avx512") + amx
    assert cpu_kernel("avx512bf16").status() == ("avx512bf16" if bf16 else "avx512")  # asked for: where it runs
    assert cpu_kernel("amx").status() == ("avx512bf16" if bf16 else "avx512") + amx
    assert cpu_kernel().gemm == (4 if amx else 3 if cpu_kernel().isa == 3 else 0)


def test_kernel_isa_can_be_capped():
    best = cpu_kernel()
    if not best.on:
        pytest.skip(f"CPU kernel {best.status()}")
    assert cpu_kernel("avx2").status() == "avx2"
    assert cpu_kernel("avx512").status() == ("avx512" if best.isa >= 2 else best.status())
    assert cpu_kernel("avx512").gemm == 0 and cpu_kernel("avx2").gemm == 0  # capped below the prefill GEMMs
    assert cpu_kernel("avx2").library == best.library  # one library, another instruction set


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2"])
@pytest.mark.parametrize("fmt", ["fp8", "fp4", "bf16"])
@pytest.mark.parametrize("rows", [1, 3])
def test_linear_in_one_call_is_act_quant_then_gemv(isa, fmt, rows):
    """CpuKernel.linear (qlinear's eager decode step in one call, `mhc_qlinear`) gives bitwise what the activation
    rounding (`act_quant_fp8`) then the GEMV rows (`qgemv`) give, with the rounding and without, and qlinear takes it.
    It declines x holding NaN or inf (torch's rules for them then apply), bf16 x, rows the GEMV rows do not take, and
    the kernel off."""
    k = kernel_in(isa)
    g = gen(4200 + rows)
    if fmt == "bf16":
        wq = qw(torch.randn(72, 320, generator=g).bfloat16())
    else:
        data, scale = fp8_weight(72, 320, 64, g) if fmt == "fp8" else fp4_weight(72, 320, g)
        wq = qw(data, scale, 64 if fmt == "fp8" else 32)
    x = torch.randn(rows, 1, 320, generator=g) * 3
    for act in (128, 0):
        xa = k.act_quant_fp8(x, act) if act else x
        want = k.qgemv(xa.reshape(rows, 1, 320), wq, 1).reshape(rows, 1, 72)
        got = k.linear(x, wq, act)
        assert got is not None and got.shape == (rows, 1, 72) and torch.equal(got, want)
        assert torch.equal(qlinear(x, wq, act > 0, cpu=k), want)
    bad = x.clone()
    bad[0, 0, 5] = float("nan")
    assert k.linear(bad, wq, 128) is None
    ref = qlinear(bad, wq, True)  # torch's path: the NaN's block of the rounding is NaN, as the reference's
    assert torch.equal(qlinear(bad, wq, True, cpu=k).isnan(), ref.isnan())
    assert k.linear(x.bfloat16(), wq, 128) is None
    assert k.linear(torch.randn(qgemv.MAX_ROWS + 1, 320), wq, 128) is None
    assert cpu_kernel("0").linear(x, wq, 128) is None


def test_the_kernel_setting_is_read_only_through_env(monkeypatch):
    """MHCRUN_CPU_KERNEL takes effect through the run's Env (read at the entry point) and the kernel opened from
    it, never through os.environ below it: off, every GEMV takes the torch path; on, the environment saying
    otherwise changes nothing."""
    off = open_cpu_kernel(Env.read({"MHCRUN_CPU_KERNEL": "0"}))
    assert off.status() == "off (MHCRUN_CPU_KERNEL=0)" and not off.on
    w, s = fp8_weight(64, 64, 32, gen(1000))
    x = torch.randn(1, 64, generator=gen(1001))
    wq = qw(w, s, 32)
    assert wq.kernel and off.qgemv(x[:, None], wq, 1) is None and off.act_quant_fp8(x, 128) is None
    assert not off.decodes(wq) and not off.takes(wq, 1)
    monkeypatch.setenv("MHCRUN_CPU_KERNEL", "0")
    on = open_cpu_kernel(replace(Env.read(), cpu_kernel="1"))
    assert on == cpu_kernel()
    if on.on:
        assert on.qgemv(x[:, None], wq, 1) is not None and on.isa in qgemv.ISAS.values()
    for ops_file in Path(qgemv.__file__).parent.glob("*.py"):
        source = ops_file.read_text()
        assert "os.environ" not in source and "getenv" not in source, ops_file.name


@needs_kernel
@pytest.mark.parametrize("n, k, block", [(200, 320, 128), (37, 45, 32), (100, 300, 24), (1, 128, 128),
                                         (130, 7, 32), (64, 1, 128), (256, 512, 128)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_fp8_against_reference(isa, n, k, block, m):
    g = gen(100 + m)
    w, s = fp8_weight(n, k, block, g, e8m0=bool(m % 2))
    w_ref = reference_weight(w, s, "fp8", block)
    x3 = torch.randn(m, 1, k, generator=g)
    check_groups(run(isa, x3, w, s, "fp8", block), x3, w_ref)


@needs_kernel
@pytest.mark.parametrize("n, k, block", [(200, 320, 32), (33, 70, 32), (50, 128, 64), (17, 96, 8),
                                         (40, 144, 48), (5, 2, 32), (64, 4096, 32), (9, 96, 32), (7, 160, 96)])
@pytest.mark.parametrize("m", [1, 3, 4, 6])
def test_fp4_against_reference(isa, n, k, block, m):
    """AVX-512: groups of 32 and 64 take the two-chunk loop, 8 and 48 inputs the general one. AVX2: 64 inputs a
    step, each 32 inside one group, so it takes blocks of 32, 64, 96 and declines 8 and 48 (no checkpoint has them:
    DeepSeek's FP4 block is 32), which then take the reference. 70, 96 and 160 inputs end mid-step, 2 mid-vector.
    Each case twice: x of fp32 values (the fp32 rows) and FP8-rounded x (the integer rows where the CPU has them:
    avx2, avx512bf16 for groups of 32; with AVX2 groups of 64 and 96 take them too)."""
    g = gen(200 + m)
    p, s = fp4_weight(n, k, g, e8m0=bool(m % 2), block=block)
    w_ref = dequantize(QWeight(p, s, block))
    for x3 in (torch.randn(m, 1, k, generator=g), act_rounded(m, 1, k, g=g)):
        if isa.status() == "avx2" and block % 32:
            assert isa.qgemv(x3, qw(p, s, block), 1) is None
            continue
        check_groups(run(isa, x3, p, s, "fp4", block), x3, w_ref)


@needs_kernel
@pytest.mark.parametrize("n, k", [(40, 77), (300, 256), (3, 16), (17, 2050), (9, 94), (5, 64)])
@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_bf16_against_reference(isa, n, k, m):
    """AVX-512 splits x into even and odd inputs for an even k (64 weights a step, a tail of 2 to 30), and takes
    the widening loop for an odd one; AVX2 splits x for any k (each half zero-padded to 8), one, two or four steps
    of 16 weights a pass for four, two or one row of x (a tail of 1 to 15)."""
    g = gen(300 + m)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x3 = torch.randn(m, 1, k, generator=g)
    check_groups(run(isa, x3, w, None, "float", 0), x3, w.float())


@needs_kernel
@pytest.mark.parametrize("fmt", ["fp8", "fp4", "float"])
def test_grouped_rows_take_their_group_of_x(isa, fmt):
    """wo_a: output rows in 4 groups of 48 (straddling 32-row fp8 tiles), each against its own x."""
    g = gen(400)
    data, scale = weight_of(fmt, 192, 96, g)
    w_ref = reference_weight(data, scale, fmt, 32)
    x3 = torch.randn(5, 4, 96, generator=g)
    check_groups(run(isa, x3, data, scale, fmt, 32, 4), x3, w_ref)


@needs_kernel
def test_fp4_non_power_of_two_scales_round_like_the_reference(isa):
    """fp32 scales that are not powers of two: the kernel scales the e2m1 table (one rounding, as the
    reference's dequantisation), so the products are the reference weight's."""
    g = gen(500)
    p, _ = fp4_weight(64, 256, g)
    s = torch.rand(64, 8, generator=g) * 3 + 0.1
    w_ref = dequantize(QWeight(p, s, 32))
    x3 = torch.randn(2, 1, 256, generator=g)
    check_groups(run(isa, x3, p, s, "fp4", 32), x3, w_ref)


@needs_kernel
def test_subnormal_scales_and_inputs(isa):
    """Scales of 2**-127 and inputs of 2**100 and 2**-140: on AVX2 such x is scaled by less than the FP8 rows' usual
    2**112 (scale_x), and the rows' sums take the difference back."""
    g = gen(600)
    w, _ = fp8_weight(64, 128, 32, g)
    s = float_to_e8m0(torch.full((2, 4), 2.0**-127))
    w_ref = reference_weight(w, s, "fp8", 32)
    x3 = torch.randn(3, 1, 128, generator=g) * 2.0**100
    x3[0, 0, :7] = 2.0**-140  # subnormal inputs
    check_groups(run(isa, x3, w, s, "fp8", 32), x3, w_ref)


@needs_kernel
def test_same_result_on_any_thread_count(isa):
    """Each output row is one thread's sum in a fixed order: 1 and 2 threads agree bitwise."""
    g = gen(700)
    w, s = fp8_weight(512, 256, 128, g)
    x3 = torch.randn(2, 1, 256, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(isa, x3, w, s, "fp8", 128)
        torch.set_num_threads(2)
        two = run(isa, x3, w, s, "fp8", 128)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_nan_codes_and_bad_scales_give_the_references_values(isa):
    """NaN codes: the kernel writes their rows as NaN, as dequantise-then-matmul gives them. NaN (e8m0 0xFF) scales
    and scales whose products could overflow: the weight is not the kernel's (decided once, when it is made), and
    qlinear gives NaN / inf exactly where dequantise-then-matmul does."""
    g = gen(800)
    w, s = fp8_weight(64, 64, 32, g)
    bad_w = w.view(torch.uint8).clone()
    bad_w[5, 3] = 0x7F
    bad_w[40, 63] = 0xFF
    bad_w = bad_w.view(torch.float8_e4m3fn)
    x = torch.randn(2, 64, generator=g)
    y = run(isa, x[:, None], bad_w, s, "fp8", 32)[:, 0]
    w_ref = reference_weight(bad_w, s, "fp8", 32)
    assert torch.equal(torch.isnan(y), torch.isnan(F.linear(x, w_ref))) and int(torch.isnan(y).sum()) == 4
    keep = [c for c in range(64) if c not in (5, 40)]
    assert_gemm_close(y[:, keep], F.linear(x, w_ref[keep]), x, w_ref[keep])
    nan_s = s.view(torch.uint8).clone()
    nan_s[1, 0] = 255
    big = torch.full((2, 2), 2.0**125)
    for scale in (nan_s.view(torch.float8_e8m0fnu), nan_s, big, float_to_e8m0(big)):
        wq = qw(w, scale, 32)
        assert not wq.kernel and isa.qgemv(x[:, None], wq, 1) is None
        w_ref = reference_weight(w, scale.view(torch.float8_e8m0fnu) if scale.dtype == torch.uint8 else scale,
                                 "fp8", 32)
        y, ref = qlinear(x, wq, cpu=isa), F.linear(x, w_ref)
        assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.equal(torch.isinf(y), torch.isinf(ref))
    assert qw(w, torch.full((2, 2), 2.0**119), 32).kernel and not qw(w, torch.full((2, 2), 2.0**120), 32).kernel


@needs_kernel
def test_declines_what_it_does_not_cover():
    kernel = cpu_kernel()
    g = gen(900)
    w, s = fp8_weight(64, 64, 32, g)
    x = torch.randn(1, 1, 64, generator=g)
    assert kernel.qgemv(torch.randn(qgemv.MAX_ROWS + 1, 1, 64), qw(w, s, 32), 1) is None
    assert kernel.qgemv(x, qw(w.t(), s, 32), 1) is None  # not contiguous
    assert kernel.qgemv(x, qw(torch.randn(8, 64).half(), None, 0), 1) is None
    with pytest.raises(ValueError, match="scale dtype"):  # refused when the weight is made, not at run time
        qw(w, s.view(torch.uint8).to(torch.int16), 32)
    p, ps = fp4_weight(8, 64, g)
    assert kernel.qgemv(x, qw(p, ps, 33), 1) is None  # odd groups split a byte


def test_build_is_cached_and_atomic(tmp_path):
    cxx = Env.read().cxx
    if shutil.which(cxx) is None:
        pytest.skip("no C++ compiler")
    first = native.build(qgemv.SOURCE, tmp_path, cxx)
    stamp = first.stat().st_mtime_ns
    assert native.build(qgemv.SOURCE, tmp_path, cxx) == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    assert [f.name for f in tmp_path.iterdir()] == [first.name]  # no temporary files left


def test_build_failure_is_one_line(tmp_path):
    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    "echo 'qgemv.cpp:1: error: broken' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="failed on qgemv.cpp: qgemv.cpp:1: error: broken"):
        native.build(qgemv.SOURCE, tmp_path / "cache", str(fake))
    assert not any((tmp_path / "cache").iterdir())
    kernel = open_cpu_kernel(Env(kernel_cache=tmp_path / "cache", cxx=str(fake)))
    assert not kernel.on
    assert kernel.status() == f"off: not built ({fake} failed on qgemv.cpp: qgemv.cpp:1: error: broken)"


@needs_kernel
def test_kernels_decline_when_subnormals_are_flushed():
    """The GEMV and the rounding decline (their callers take torch's path); the expert-set op, which holds no
    tensors to fall back on, says why it cannot run."""
    kernel = cpu_kernel()
    g = gen(1100)
    w, s = fp8_weight(64, 64, 32, g)
    x = torch.randn(1, 1, 64, generator=g)
    wq = qw(w, s, 32)
    experts = expert_set([wq])
    args = (experts.ptrs, torch.zeros(1, 1, dtype=torch.int64), experts.fmt, experts.kind, experts.block, 64, 64,
            kernel.library, kernel.isa)
    if not torch.set_flush_denormal(True):
        pytest.skip("no flush-denormal mode on this CPU")
    try:
        assert kernel.qgemv(x, wq, 1) is None
        assert kernel.act_quant_fp8(x, 128) is None
        with pytest.raises(RuntimeError, match="flushes subnormals"):
            torch.ops.mhcrun.qgemv_expert_set(x, *args)
    finally:
        torch.set_flush_denormal(False)
    assert kernel.qgemv(x, wq, 1) is not None
    assert torch.equal(torch.ops.mhcrun.qgemv_expert_set(x, *args)[:, 0], kernel.qgemv(x, wq, 1)[:, 0])


@needs_kernel
def test_pool_made_while_flushing_follows_the_caller_afterwards(tmp_path):
    """A fresh process whose first kernel call runs under torch.set_flush_denormal(True) (so that its thread pool is
    made flushing, as a pool thread keeps the mode of the thread that made it): the call declines, and once the
    caller stops flushing the kernel runs again on every thread, bitwise what a process that never flushed gives.
    (Before the pool's threads took the caller's mode, the kernel declined for the rest of such a process.)"""
    script = tmp_path / "flush.py"
    script.write_text(
        "import sys, torch\n"
        "from mhcrun.ops.qgemv import open_cpu_kernel\n"
        "from mhcrun.ops.quant import quantize_weight_fp8\n"
        "from mhcrun.ops.qweight import QWeight\n"
        "from mhcrun.settings import Env\n"
        "torch.set_num_threads(2)\n"
        "g = torch.Generator().manual_seed(5)\n"
        "w, s = quantize_weight_fp8(torch.randn(64, 128, generator=g) * 0.02, 128)\n"  # too small for torch's pool
        "x = torch.randn(1, 1, 128, generator=g)\n"
        "k = open_cpu_kernel(Env())\n"
        "flush = sys.argv[1] == '1'\n"
        "if flush and torch.set_flush_denormal(True):\n"
        "    assert k.qgemv(x, QWeight(w, s, 128, kernel=True), 1) is None\n"
        "    torch.set_flush_denormal(False)\n"
        "y = k.qgemv(x, QWeight(w, s, 128, kernel=True), 1)\n"
        "assert y is not None\n"
        "from safetensors.torch import save_file\n"
        "save_file({'y': y}, sys.argv[2])\n")
    import subprocess
    import sys

    from safetensors.torch import load_file

    for flush in ("1", "0"):
        res = subprocess.run([sys.executable, str(script), flush, str(tmp_path / f"y{flush}.safetensors")],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
    assert torch.equal(load_file(tmp_path / "y1.safetensors")["y"], load_file(tmp_path / "y0.safetensors")["y"])


# ---------------------------------------------------------------- activation quantisation


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


ACT_QUANT_PATHS = ["avx512", "avx2"]  # the AVX-512 blocks, the AVX2 ones (their tails by the scalar loop)


@needs_kernel
@pytest.mark.parametrize("path", ACT_QUANT_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_quant_bitwise_equal_to_fp8_simulate(path, dtype):
    """Random magnitudes from 2**-30 to 2**30, zeros of both signs, values far below their block's amax (subnormal
    e4m3 codes, and quotients that are subnormal floats or round to -0.0), partial last blocks, several rows."""
    g = gen(1200)
    for trial in range(120):
        k = int(torch.randint(1, 700, (1,), generator=g))
        rows = int(torch.randint(1, 6, (1,), generator=g))
        x = torch.randn(rows, k, generator=g) * 2.0 ** float(torch.randint(-30, 30, (1,), generator=g))
        if trial % 3 == 0:
            x[..., ::7] *= 1e-6
        if trial % 5 == 0:
            x[..., ::3] = 0
            x[..., 1::3] = -0.0
        if trial % 4 == 1:
            x[..., ::5] = -(2.0**-140)
        x = x.to(dtype)
        assert torch.equal(bits(kernel_in(path).act_quant_fp8(x, 128)), bits(fp8_simulate(x, 128, pow2_scale=True)))


@needs_kernel
@pytest.mark.parametrize("path", ACT_QUANT_PATHS)
def test_act_quant_rounds_every_e4m3_value_and_tie_like_torch(path):
    """Every finite e4m3 value, every midpoint between neighbours (ties to even) and the floats either side of
    each midpoint, in one block whose amax is 448 (scale 1)."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids, mids.nextafter(torch.full_like(mids, 1e9)), mids.nextafter(torch.full_like(mids, -1e9))])
    x = x[x.abs() <= 448][None]
    assert float(x.abs().max()) == 448.0
    want = fp8_simulate(x, x.shape[1], pow2_scale=True)
    assert torch.equal(bits(kernel_in(path).act_quant_fp8(x, x.shape[1])), bits(want))


@needs_kernel
@pytest.mark.parametrize("path", ACT_QUANT_PATHS)
def test_act_quant_leaves_non_finite_x_to_torch(path):
    x = torch.randn(2, 256)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[1, 5] = bad
        assert kernel_in(path).act_quant_fp8(y, 128) is None
        assert kernel_in(path).act_quant_fp8(y[:, :250], 128) is None  # in a partial block
        w, s = fp8_weight(64, 256, 128, gen(1300))
        w_ref = reference_weight(w, s, "fp8", 128)
        ref = F.linear(fp8_simulate(y, 128, pow2_scale=True), w_ref)  # torch's rules for NaN / inf blocks
        out = qlinear(y, qw(w, s, 128), True, cpu=cpu_kernel())
        assert torch.equal(out.isnan(), ref.isnan())
        assert_gemm_close(out[:1], ref[:1], y[:1], w_ref, act_quant=True)  # the clean row
        if bad > 0:  # torch's rounding clamps inf to 448 at scale 1: a finite row
            xq = fp8_simulate(y[1:], 128, pow2_scale=True)
            assert_gemm_close(out[1:], ref[1:], xq, w_ref)


@needs_kernel
@pytest.mark.parametrize("path", ACT_QUANT_PATHS)
def test_act_quant_of_a_prefill_chunk_on_any_thread_count(path):
    """A prefill chunk's rows (far more than decode's), split over threads: bitwise fp8_simulate's on 1 and 2
    threads, a partial last block included."""
    g = gen(1310)
    x = torch.randn(300, 2048 + 40, generator=g) * 2.0 ** torch.randint(-20, 20, (300, 1), generator=g).float()
    x[7, ::5] = 0
    want = bits(fp8_simulate(x, 128, pow2_scale=True))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(bits(kernel_in(path).act_quant_fp8(x, 128)), want)
    finally:
        torch.set_num_threads(before)


def test_generate_reports_the_kernel(tmp_path):
    """generate says whether its CPU decode GEMVs took the kernel, in --json stats and on the summary line."""
    from test_cli import cli, gen_json, ok

    ids = ("--prompt-ids", "0,5,6", "-n", 3)
    kernel = open_cpu_kernel(Env.read())  # as the command opens it
    assert gen_json(*ids)[0]["stats"]["cpu_gemv_kernel"] == kernel.status()
    off = gen_json(*ids, env={"MHCRUN_CPU_KERNEL": "0"})[0]
    assert off["stats"]["cpu_gemv_kernel"] == "off (MHCRUN_CPU_KERNEL=0)"
    r = cli("generate", *ids)
    ok(r)
    assert f"CPU GEMV kernel {kernel.status()}" in r.stderr


# ---------------------------------------------------------------- BF16 dot products (isa avx512bf16)


def bf16_kernel() -> CpuKernel:
    """The kernel in avx512bf16 (skipping where this CPU lacks AVX-512 BF16, VNNI or VBMI)."""
    return kernel_in("avx512bf16")


def act_rounded(*shape: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """x as DeepSeek's FP8 activation rounding leaves it before an FP8/FP4 GEMM: exact in bf16."""
    return fp8_simulate(torch.randn(*shape, generator=g) * scale, 128, pow2_scale=True)


def every_code_fp8(n: int, k: int) -> torch.Tensor:
    """An e4m3 weight holding every non-NaN code (subnormals, zeros of both signs) in turn."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    return codes.repeat(-(-n * k // codes.numel()))[:n * k].view(n, k).view(torch.float8_e4m3fn)


def every_byte_fp4(n: int, k: int) -> torch.Tensor:
    """Packed e2m1 codes [n, k / 2] holding every byte in turn (every code in both nibbles)."""
    return torch.arange(n * k // 2, dtype=torch.int64).remainder(256).to(torch.uint8).view(torch.int8).view(n, k // 2)


@needs_kernel
@pytest.mark.parametrize("n, k, block", [(200, 320, 128), (37, 45, 128), (64, 200, 64), (1, 128, 128),
                                         (130, 7, 128), (33, 2048, 128), (9, 1000, 64)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_bf16_dot_fp8_against_reference(n, k, block, m):
    """FP8 weights decoded to bf16 and multiplied by vdpbf16ps, x rounded as the reference rounds it: every code,
    tiles and rows that end inside a 64-byte step, every remainder of the four-rows loop, both scale encodings."""
    kernel, g = bf16_kernel(), gen(3000 + m + k)
    w = every_code_fp8(n, k)
    _, s = fp8_weight(n, k, block, g, e8m0=bool(m % 2))
    w_ref = reference_weight(w, s, "fp8", block)
    x3 = act_rounded(m, 1, k, g=g)
    assert kernel.takes_bf16(x3)
    check_groups(run(kernel, x3, w, s, "fp8", block), x3, w_ref)


def fp4_rows_x(rows: str, m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """x [m, 1, k] for the FP4 rows named: "int" (FP8-rounded: one 15-bit window a chunk of 128 inputs, or two
    where a chunk's values span more), "int2" (in odd rows every chunk's first value 1.5 * 2**-14, its lowest bit
    2**-15, with values of about 1 beside it: two windows in every chunk of those rows, where the even rows' take
    one), "bf16" (1.5 * 2**-40 in every row: a chunk spans more than 30 bits, so the BF16 dot products take it)."""
    x3 = act_rounded(m, 1, k, g=g)
    if rows == "int2":  # (a single row takes it)
        x3[min(m - 1, 1)::2, :, ::128] = 1.5 * 2.0**-14
    elif rows == "bf16":
        x3[..., ::128] = 1.5 * 2.0**-40
    return x3


@needs_kernel
@pytest.mark.parametrize("n, k", [(200, 320), (33, 70), (64, 4096), (5, 2), (9, 96), (7, 160), (3, 256)])
@pytest.mark.parametrize("m", [1, 3, 4, 6])
@pytest.mark.parametrize("isa, rows", [("avx512bf16", "int"), ("avx512bf16", "int2"), ("avx512bf16", "bf16"),
                                       ("avx2", "int"), ("avx2", "int2")])
def test_fp4_dot_rows_against_reference(n, k, m, isa, rows):
    """FP4 weights (every byte, so every code in both nibbles) by 16-bit integer dot products (one window or two:
    vpdpwssd in avx512bf16, four groups of 32 a step; vpmaddwd in avx2, two) or by vdpbf16ps: rows that end inside a
    step or a group's 16 bytes, scales past the row's end never read, both scale encodings, and e8m0 byte 0 (2**-127,
    subnormal) as every scale of the first row (whose result then rests on them alone: x times 2**80 keeps it far
    above the check's absolute slack) and one of the second's."""
    kernel, g = kernel_in(isa), gen(3100 + m + k)
    p = every_byte_fp4(n, k)
    _, s = fp4_weight(n, k, g, e8m0=bool(m % 2))
    if m % 2:
        s.view(torch.uint8)[0] = 0
        s.view(torch.uint8)[1:2, 0] = 0
    w_ref = dequantize(QWeight(p, s, 32))
    x3 = fp4_rows_x(rows, m, k, g) * 2.0**(80 if m % 2 else 0)
    assert kernel.takes_bf16(x3) == (isa == "avx512bf16") and kernel.takes_int(x3) == (rows != "bf16")
    check_groups(run(kernel, x3, p, s, "fp4", 32), x3, w_ref)


@needs_kernel
@pytest.mark.parametrize("n, k", [(37, 256), (16, 128), (1, 384), (200, 2048), (33, 1024)])
@pytest.mark.parametrize("m", [4, 6, 7, 13])
@pytest.mark.parametrize("rows", ["int", "int2", "span30"])
def test_fp4_panels_against_reference(n, k, m, rows):
    """AVX2 with four rows of x or more, e8m0 scales a group of 32 and whole chunks of 128 inputs (a prefill's
    experts): the weights decoded once into panels of 16 rows, four rows of x at a time (avx2::run_panels). Panels cut
    short at the end (n not a multiple of 16), every remainder of the four-rows loop, random codes (every byte in turn
    would hide a swap of neighbouring bytes' high nibbles: they are mostly the same), e8m0
    byte 0 (2**-127) as every scale of the first row; x of one window a chunk, of two ("int2": a chunk's top bits, then
    the bits below them of its tiny first value), and of the widest span taken ("span30": 1 and 2**-29 in one chunk:
    the top window and the rest 15 bits each). Besides the usual bound, a tight one against float64: a group's
    products sum exactly in int32 and every scale is a power of two, so only the fold of each group's sum (and of each
    pair below a split chunk's top window) rounds: a dropped or misscaled rest, worth about 2**-15 of its chunk's
    largest value, fails it where the two-orders bound would not see it."""
    kernel, g = kernel_in("avx2"), gen(3120 + m + k + n)
    p, s = fp4_weight(n, k, g)
    s.view(torch.uint8)[0] = 0
    w_ref = dequantize(QWeight(p, s, 32))
    x3 = fp4_rows_x("int2" if rows == "int2" else "int", m, k, g)
    if rows == "span30":
        x3[:, :, :128] = 1.0
        x3[1::2, :, 7] = 2.0**-29
    assert kernel.takes_int(x3)
    y = run(kernel, x3, p, s, "fp4", 32)
    check_groups(y, x3, w_ref)
    exact = F.linear(x3[:, 0].double(), w_ref.double())
    assert_gemm_close(y[:, 0], exact, x3[:, 0], w_ref, rel=2 * (k // 32 + 8) * 2.0**-24)


def int_x(kernel: CpuKernel, x: torch.Tensor, isa: int, top: bool) -> tuple[torch.Tensor, ...] | None:
    """The integer x of rows x [rows, k] (`mhc_int_x`): with `top`, the panels' (the scalar loop, isa 0, or AVX2's,
    isa 1); else the AVX-512 rows' (the scalar loop, isa 0, or AVX-512's, isa 3): windows [rows, chunks, 2, 128] int16,
    scales and splits (or flags) [rows, chunks]; None where x does not qualify."""
    rows, k = x.shape
    chunks = -(-k // 128)
    v = torch.full((rows, chunks, 2, 128), 7, dtype=torch.int16)
    scale, two = torch.full((rows, chunks), 3.0), torch.full((rows, chunks), 9, dtype=torch.uint8)
    ok = qgemv.load_library(kernel.library).mhc_int_x(x.data_ptr(), rows, k, isa, int(top), v.data_ptr(),
                                                      scale.data_ptr(), two.data_ptr())
    return (v, scale, two) if ok else None


def fp4_slot(i: int) -> int:
    """Where the AVX-512 rows' decoded weights hold input i of a chunk of 128 (qgemv.cpp's avx512bf16::fp4_slot)."""
    return 32 * (i % 4) + i // 4


@needs_kernel
@pytest.mark.parametrize("isa, top", [("avx2", True), ("avx512bf16", False)])
@pytest.mark.parametrize("k", [512, 320])
def test_int_x_by_vectors_is_the_scalar_loop(isa, top, k):
    """x as integers a whole chunk at a time by vectors is the scalar loop's, bitwise: windows, scales and splits:
    the panels' (input order, each chunk split at its top bits) by AVX2 (int_chunk_top) and the AVX-512 rows' (their
    order, the low 15 bits then the bits above) by AVX-512 (int_chunk_rows). On FP8-rounded rows (one window, two),
    chunks of every span from 1 to 30 bits between two values of random signs among zeros and -0.0, an all-zero chunk,
    the bounds 2**-125 and 2**99 (k = 320: a last chunk of 64 inputs, the scalar loop's in both); both refuse the same
    rows (a span of 31 bits, a subnormal, inf, NaN, 2**-126, 2**100), and the integers rebuild x."""
    kernel, g = kernel_in(isa), gen(3170 + k)
    rows = [fp4_rows_x("int", 3, k, g)[:, 0], fp4_rows_x("int2", 3, k, g)[:, 0]]
    for span in range(30):  # 1.5 (lowest bit 2**-1, top 2**1) and 2**-span: 1 + span bits
        r = torch.zeros(1, k)
        r[0, 1::5] = -0.0
        at = torch.randperm(128, generator=g)[:2] + 128 * (span % (k // 128))  # one chunk
        r[0, at[0]], r[0, at[1]] = 1.5 * (-1.0) ** span, 2.0**-span * (-1.0) ** (span // 3)
        rows.append(r)
    edge = torch.zeros(2, k)
    edge[0, 3], edge[0, 9], edge[1, 5] = 2.0**-125, 2.0**-111, 2.0**99 * 1.75
    x = torch.cat(rows + [edge])
    vec = {"avx2": 1, "avx512bf16": 3}[isa]
    fast, slow = int_x(kernel, x, vec, top), int_x(kernel, x, 0, top)
    assert fast is not None and slow is not None
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    v, scale, two = fast
    first, second = v[:, :, 0].double(), v[:, :, 1].double()
    if top:
        assert int(two.max()) == 15 and int((two > 0).sum()) > 4  # the widest split, and several chunks split
        whole = (first + second * 2.0 ** -two.double()[..., None]) * scale.double()[..., None] * 2  # 2**(q + s - 1)
    else:
        assert int(two.max()) == 1 and int((two > 0).sum()) > 4  # several chunks in two windows
        whole = (first + second * 2.0**15)[..., [fp4_slot(i) for i in range(128)]] * scale.double()[..., None] * 2
    assert torch.equal(whole.reshape(len(x), -1)[:, :k], x.double())
    for bad in (2.0**-30, 1e-40, math.inf, math.nan, 2.0**-126, 2.0**100):
        y = torch.zeros(1, k)
        y[0, 0], y[0, 1] = 1.0, bad
        assert int_x(kernel, y, vec, top) is None and int_x(kernel, y, 0, top) is None, bad


@needs_kernel
@pytest.mark.parametrize("isa, plain", [("avx512bf16", "avx512"), ("avx2", "off")])
def test_fp4_int_rows_take_and_refuse(isa, plain):
    """The integer rows take a chunk of 128 inputs spanning 30 bits and refuse 31 (to the BF16 dot products, or the
    fp32 rows where x is not exact in bf16 or the CPU lacks them), a non-finite value, and values outside 2**-125 ..
    2**100; where they take x the result equals the reference within the fp32 bound (a kernel that dropped the high
    window would miss by about 2**15 times the rest); where they refuse it, NaN where the plain path gives NaN."""
    kernel, g = kernel_in(isa), gen(3150)
    n, k = 48, 256
    p, s = fp4_weight(n, k, g)
    w_ref = dequantize(QWeight(p, s, 32))
    x3 = torch.zeros(1, 1, k)
    x3[0, 0, :128] = 1.0
    x3[0, 0, 5] = (2.0**24 - 1.0) * 2.0**6  # below 2**30, the chunk's lowest bit 2**0: two windows
    x3[0, 0, 130:140] = -3.0 * 2.0**-40
    assert kernel.takes_int(x3)
    check_groups(run(kernel, x3, p, s, "fp4", 32), x3, w_ref)
    for i, value in ((5, 2.0**30), (7, 2.0**-126), (9, 2.0**101), (11, math.inf), (13, math.nan)):
        bad = x3.clone()
        bad[0, 0, i] = value
        assert not kernel.takes_int(bad), value
        y = run(kernel, bad, p, s, "fp4", 32)
        ref = run(kernel_in(plain), bad, p, s, "fp4", 32) if plain != "off" else F.linear(bad[:, 0], w_ref)[:, None]
        assert torch.equal(torch.isnan(y), torch.isnan(ref)), value
        if math.isfinite(value):
            check_groups(y, bad, w_ref)


@needs_kernel
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_bf16_dot_grouped_rows_experts_and_threads(fmt):
    """Grouped outputs (wo_a) take their group of x; experts read in place; 1 and 2 threads agree bitwise."""
    kernel, g = bf16_kernel(), gen(3200)
    block = 128 if fmt == "fp8" else 32
    data, scale = fp8_weight(128, 384, block, g) if fmt == "fp8" else fp4_weight(128, 384, g)
    x3 = act_rounded(3, 4, 384, g=g)
    check_groups(run(kernel, x3, data, scale, fmt, block, 4), x3, reference_weight(data, scale, fmt, block))
    experts = [fp8_weight(64, 256, 128, g) if fmt == "fp8" else fp4_weight(64, 256, g) for _ in range(3)]
    weights = [qw(w, s, block) for w, s in experts]
    found, idx, x = expert_set(weights), torch.tensor([[0, 2], [1, 1]]), act_rounded(2, 2, 256, g=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.experts_at(found, idx, x)
        torch.set_num_threads(2)
        two = kernel.experts_at(found, idx, x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    for b, row in enumerate(idx.tolist()):
        for j, e in enumerate(row):
            ref = reference_weight(*experts[e], fmt, block)
            assert_gemm_close(one[b, j][None], F.linear(x[b, j][None], ref), x[b, j][None], ref)


@needs_kernel
@pytest.mark.parametrize("n, k, block", [(200, 320, 128), (37, 45, 128), (64, 200, 64), (1, 128, 128),
                                         (130, 7, 128), (33, 2048, 128), (9, 1000, 64)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_fp8_rows_of_fp32_x_against_reference(n, k, block, m):
    """FP8 weights against an x not exact in bf16 (DeepSeek's grouped wo_a, a run without the activation rounding)
    on the BF16 kernel: decoded through the bf16 tables, multiplied by fp32 FMAs (fp8_f32_row). Every code, tiles and
    rows that end inside a 64-byte step, every remainder of the four-rows loop, both scale encodings; x of fp32
    values with some tiny ones among them (products below fp32's normal range, rounded as the reference rounds them);
    the grouped rows; NaN codes make their rows NaN."""
    kernel, g = bf16_kernel(), gen(3500 + m + k)
    w = every_code_fp8(n, k)
    _, s = fp8_weight(n, k, block, g, e8m0=bool(m % 2))
    w_ref = reference_weight(w, s, "fp8", block)
    x3 = torch.randn(m, 1, k, generator=g)
    x3[..., ::7] *= 2.0**-100
    assert not kernel.takes_bf16(x3)
    check_groups(run(kernel, x3, w, s, "fp8", block), x3, w_ref)
    x4 = torch.randn(m, 4, k, generator=g)
    w4 = every_code_fp8(4 * n, k)
    _, s4 = fp8_weight(4 * n, k, block, g)
    check_groups(run(kernel, x4, w4, s4, "fp8", block, 4), x4, reference_weight(w4, s4, "fp8", block))
    bad = w.view(torch.uint8).clone()
    bad[n // 2, k - 1], bad[0, 0] = 0x7F, 0xFF
    y = run(kernel, x3, bad.view(torch.float8_e4m3fn), s, "fp8", block)[:, 0]
    assert sorted(torch.isnan(y).nonzero()[:, 1].unique().tolist()) == sorted({0, n // 2})


@needs_kernel
def test_bf16_dot_keeps_nan_codes():
    kernel, g = bf16_kernel(), gen(3300)
    w, s = fp8_weight(64, 128, 128, g)
    bad = w.view(torch.uint8).clone()
    bad[5, 3], bad[40, 127] = 0x7F, 0xFF
    x3 = act_rounded(2, 1, 128, g=g)
    y = run(kernel, x3, bad.view(torch.float8_e4m3fn), s, "fp8", 128)[:, 0]
    assert torch.isnan(y).nonzero()[:, 1].unique().tolist() == [5, 40]


@needs_kernel
def test_bf16_dot_refuses_x_it_would_not_multiply_exactly():
    """x that is not exact in bf16, a value below 2**-110 (its products with the smallest e4m3 values would be
    subnormal, which vdpbf16ps flushes), or a non-finite one takes the fp32 rows (fp8_f32_row): the reference's
    result, and the avx512 kernel's NaN and inf where a value is not finite."""
    kernel, plain, g = bf16_kernel(), kernel_in("avx512"), gen(3400)
    w, s = fp8_weight(64, 256, 128, g)
    good = act_rounded(1, 1, 256, g=g)
    assert kernel.takes_bf16(good) and not plain.takes_bf16(good)
    for i, value in ((0, 1.0 + 2.0**-10), (7, 2.0**-115), (9, -(2.0**-111)), (3, math.inf), (4, math.nan)):
        x3 = good.clone()
        x3[0, 0, i] = value
        assert not kernel.takes_bf16(x3), value
        y = run(kernel, x3, w, s, "fp8", 128)
        if math.isfinite(value):
            check_groups(y, x3, reference_weight(w, s, "fp8", 128))
        else:
            assert torch.equal(y.nan_to_num(), run(plain, x3, w, s, "fp8", 128).nan_to_num()), value
    edge = good.clone()
    edge[0, 0, 5] = -(2.0**-110)
    assert kernel.takes_bf16(edge)
    check_groups(run(kernel, edge, w, s, "fp8", 128), edge, reference_weight(w, s, "fp8", 128))
    # the reference's rounding floors a block's largest magnitude at 1e-4, so its nonzero values are at least
    # 2**-31: every x it rounds qualifies, however small
    tiny = act_rounded(1, 1, 256, g=g, scale=2.0**-105)
    assert kernel.takes_bf16(tiny) and tiny.abs().max() == 0
    small = act_rounded(1, 1, 256, g=g, scale=1e-6)
    assert kernel.takes_bf16(small) and 0 < small.abs().max() < 1e-4


GEMM_ENGINES = ["avx512bf16", "amx"]  # what multiplies a prefill chunk: BF16 dot products, AMX tiles


@needs_kernel
@pytest.mark.parametrize("engine", GEMM_ENGINES)
@pytest.mark.parametrize("fmt, block, m, n, k", [
    (fmt, block, m, n, k)
    for fmt, block in [("fp8", 128), ("fp8", 64), ("fp8", 48), ("fp4", 32), ("fp4", 64), ("fp4", 48)]
    for m, n, k in [(37, 70, 200), (64, 128, 256), (100, 33, 96), (17, 40, 77), (9, 5, 2), (40, 64, 1000),
                    (33, 600, 256), (70, 300, 2048), (12, 300, 512)]
    if fmt == "fp8" or k % 2 == 0])  # FP4 rows hold an even number of values (two codes a byte)
def test_bf16_gemm_against_reference(engine, fmt, block, m, n, k):
    """A prefill chunk's GEMM by bf16 panels (`CpuKernel.qgemm`), by BF16 dot products or AMX tiles, the panels
    decoded straight from the codes (blocks of a multiple of 32) or through fp32 rows (48): panels of 32
    output rows that end early, row tiles of 8 (AMX: blocks of 32, or tiles of the rows there are up to 16) that end
    early, an odd K (fp8), K that ends inside
    an AMX tile step, tiles and groups that end inside the row, several groups of AMX panels a thread, both scale
    encodings (fp32 powers of two too), every code; 1 and 2 threads bitwise alike."""
    kernel, g = gemm_in(engine), gen(3500 + m + n + k)
    e8m0 = bool((m + k) % 2)
    if fmt == "fp8":
        data = every_code_fp8(n, k)
        scale = fp8_weight(n, k, block, g, e8m0=e8m0)[1]
    else:
        data = every_byte_fp4(n, k)
        scale = fp4_weight(n, k, g, e8m0=e8m0, block=block)[1]
    w_ref = dequantize(QWeight(data, scale, block))
    x = act_rounded(m, k, g=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.qgemm(x, qw(data, scale, block))
        torch.set_num_threads(2)
        two = kernel.qgemm(x, qw(data, scale, block))
    finally:
        torch.set_num_threads(before)
    assert one is not None and torch.equal(one, two)
    assert_gemm_close(one, F.linear(x, w_ref), x, w_ref)


@needs_kernel
@pytest.mark.parametrize("engine", GEMM_ENGINES)
@pytest.mark.parametrize("fmt, m, n, k", [("fp4", 12, 200, 576), ("fp4", 3, 40, 96), ("fp4", 20, 33, 6240),
                                          ("fp8", 12, 200, 251), ("fp8", 9, 70, 96), ("fp8", 17, 130, 4200)])
def test_bf16_panels_from_the_codes_equal_the_decoded_rows(engine, fmt, m, n, k):
    """The panels decoded straight from the codes (blocks of a multiple of 32: the codes transposed in registers, the
    scales' exponents added) are bitwise those of the generic decode through fp32 rows (blocks of 48): a weight in
    blocks of 96 and the same weight in blocks of 48 (each scale repeated) give the same GEMM bit for bit. Every code
    (FP8 NaN codes too: one opens the row after an odd K's row, whose decode must stop at K), both scale encodings,
    partial panels, an odd K (FP8), K past 64 scale groups (FP4's scales transposed 64 groups at a time) and past a
    64-byte step."""
    kernel, g = gemm_in(engine), gen(3560 + m + n + k)
    for e8m0 in (True, False):
        if fmt == "fp8":
            data = every_code_fp8(n, k).view(torch.uint8).clone()
            data[5, 3], data[10, 0], data[n - 1, k - 1] = 0x7F, 0x7F, 0xFF  # NaN codes (row 9's odd K ends by row 10)
            data = data.view(torch.float8_e4m3fn)
            s96 = fp8_weight(n, k, 96, g, e8m0=False)[1]
            s48 = s96.repeat_interleave(2, 0).repeat_interleave(2, 1)[:-(-n // 48), :-(-k // 48)]
        else:
            data = every_byte_fp4(n, k)
            s96 = fp4_weight(n, k, g, e8m0=False, block=96)[1]
            s48 = s96.repeat_interleave(2, 1)[:, :-(-k // 48)]
        if e8m0:
            s96, s48 = float_to_e8m0(s96), float_to_e8m0(s48)
        x = act_rounded(m, k, g=g)
        direct, rows = kernel.qgemm(x, qw(data, s96, 96)), kernel.qgemm(x, qw(data, s48, 48))
        assert direct is not None and rows is not None
        torch.testing.assert_close(direct, rows, rtol=0, atol=0, equal_nan=True)
        if fmt == "fp8":
            assert torch.isnan(direct[:, [5, 10, n - 1]]).all() and not torch.isnan(direct[:, 9]).any()


@needs_kernel
@pytest.mark.parametrize("engine", GEMM_ENGINES)
def test_bf16_gemm_refuses_what_it_would_not_multiply_exactly(engine):
    """x not exact in bf16 or with a value below 2**-40; a scale that is not a power of two, below 2**-70 (e8m0
    byte 0 among them) or a float weight: qgemm declines (None) and qlinear takes its fp32 path, whose result it
    gives; the avx512 kernel never takes it."""
    kernel, g = gemm_in(engine), gen(3600)
    w, s = fp8_weight(64, 256, 128, g)
    x = act_rounded(20, 256, g=g)
    assert kernel.qgemm(x, qw(w, s, 128)) is not None and kernel_in("avx512").qgemm(x, qw(w, s, 128)) is None
    for i, value in ((0, 1.0 + 2.0**-10), (7, 2.0**-41), (9, math.inf)):
        bad = x.clone()
        bad[3, i] = value
        assert kernel.qgemm(bad, qw(w, s, 128)) is None, value
    edge = x.clone()
    edge[3, 5] = -(2.0**-40)
    assert kernel.qgemm(edge, qw(w, s, 128)) is not None
    s32 = s.float()
    for scale in (s32 * 3, s32 * 0 + 2.0**-71, float_to_e8m0(s32 * 0 + 2.0**-71)):
        assert kernel.qgemm(x, qw(w, scale, 128)) is None
        w_ref = reference_weight(w, scale, "fp8", 128)
        assert_gemm_close(qlinear(x, qw(w, scale, 128), cpu=kernel), F.linear(x, w_ref), x, w_ref)
    codes = every_code_fp8(64, 256)  # subnormal codes too, at the smallest scale it takes and at a large one
    for scale in (s32 * 0 + 2.0**-70, float_to_e8m0(s32 * 0 + 2.0**-70), s32 * 0 + 2.0**100):
        w_ref = reference_weight(codes, scale, "fp8", 128)
        assert_gemm_close(kernel.qgemm(x, qw(codes, scale, 128)), F.linear(x, w_ref), x, w_ref)
    assert kernel.qgemm(x, qw(torch.randn(64, 256).to(torch.bfloat16))) is None


@needs_kernel
@pytest.mark.parametrize("engine", GEMM_ENGINES)
def test_bf16_gemm_scratch_kept_between_calls_never_leaks(engine):
    """Each thread keeps its panels' scratch from call to call: a small GEMM after a large one (whose panels filled
    it with other values), with K and rows ending inside a tile step, gives bitwise what it gave before them."""
    kernel, g = gemm_in(engine), gen(3620)
    small_w, small_s = fp8_weight(70, 200 + 31, 128, g)
    big_w, big_s = fp8_weight(300, 2048, 128, g)
    x, big_x = act_rounded(37, 200 + 31, g=g), act_rounded(70, 2048, g=g)
    first = kernel.qgemm(x, qw(small_w, small_s, 128))
    assert kernel.qgemm(big_x, qw(big_w, big_s, 128)) is not None
    for fmt_w, fmt_s, block in ((every_byte_fp4(64, 512), fp4_weight(64, 512, g)[1], 32), (big_w, big_s, 128)):
        assert kernel.qgemm(act_rounded(40, fmt_w.shape[1] * (2 if block == 32 else 1), g=g),
                            qw(fmt_w, fmt_s, block)) is not None
    assert torch.equal(kernel.qgemm(x, qw(small_w, small_s, 128)), first)


@needs_kernel
@pytest.mark.parametrize("engine", GEMM_ENGINES)
def test_bf16_gemm_keeps_nan_codes_and_empty_inputs(engine):
    """NaN codes give NaN columns exactly where dequantise-then-matmul does; K = 0 gives zeros."""
    kernel, g = gemm_in(engine), gen(3650)
    w, s = fp8_weight(70, 256, 128, g)
    bad = w.view(torch.uint8).clone()
    bad[5, 3], bad[40, 255] = 0x7F, 0xFF
    bad = bad.view(torch.float8_e4m3fn)
    x = act_rounded(20, 256, g=g)
    y = kernel.qgemm(x, qw(bad, s, 128))
    assert torch.equal(torch.isnan(y), torch.isnan(F.linear(x, reference_weight(bad, s, "fp8", 128))))
    assert torch.isnan(y).any(dim=0).nonzero().flatten().tolist() == [5, 40]
    empty = kernel.qgemm(torch.zeros(20, 0), qw(torch.zeros(70, 0).to(torch.float8_e4m3fn),
                                                 float_to_e8m0(torch.ones(1, 0)), 128))
    assert empty is not None and torch.equal(empty, torch.zeros(20, 70))


@needs_kernel
@pytest.mark.parametrize("engine", GEMM_ENGINES)
def test_prefill_qlinear_takes_the_bf16_gemm(engine):
    """qlinear of a chunk of rows with the activation rounding, through the panels: the reference's values within
    the two-orders bound, for FP8 and FP4 weights; from the engine's GEMM_ROWS rows on (below them the GEMV rows: up
    to MAX_ROWS)."""
    kernel, g = gemm_in(engine), gen(3700)
    for data, scale, block, fmt in (*fp8_weight(96, 384, 128, g), 128, "fp8"), (*fp4_weight(96, 384, g), 32, "fp4"):
        first = qgemv.GEMM_ROWS[kernel.gemm]
        for rows in (50, qgemv.MAX_ROWS, qgemv.MAX_ROWS - 1, first, first - 1):
            x = torch.randn(rows, 384, generator=g)
            w_ref = reference_weight(data, scale, fmt, block)
            y = qlinear(x, qw(data, scale, block), act_quant=True, cpu=kernel)
            assert_gemm_close(y, reference_qlinear(x, w_ref, act_quant=True), x, w_ref, act_quant=True)
            xq = fp8_simulate(x, 128, pow2_scale=True)
            panels = rows >= first or rows > qgemv.MAX_ROWS
            assert kernel.gemm_first(rows) == (rows >= first)
            took = kernel.qgemm(xq, qw(data, scale, block)) if panels else kernel.qgemv(xq[:, None],
                                                                                      qw(data, scale, block), 1)[:, 0]
            assert torch.equal(y, took), rows


# ---------------------------------------------------------------- inside compiled graphs


@needs_kernel
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_expert_set_op_reads_each_rows_experts_in_place(isa, fmt):
    """mhcrun::qgemv_expert_set: a set of expert weights by their addresses (no copy), each row of x through its
    own experts (repeats, one x per row or one per expert slot, more rows of one expert than a kernel call
    takes)."""
    g = gen(1400)
    experts = [fp8_weight(64, 96, 32, g) if fmt == "fp8" else fp4_weight(64, 96, g) for _ in range(5)]
    refs = [reference_weight(w, s, fmt, 32) for w, s in experts]
    weights = [qw(w, s, 32) for w, s in experts]  # kept alive here, as a layer keeps its experts
    found = expert_set(weights)
    assert found.out_features == 64 and found.in_features == 96 and found.ptrs.shape == (5, 2)
    assert found.ptrs[:, 0].tolist() == [w.data.data_ptr() for w in weights]  # read where they lie
    assert found.ptrs[:, 1].tolist() == [w.scale.data_ptr() for w in weights]
    many = qgemv.MAX_ROWS + 3
    for idx in (torch.tensor([[0, 3], [4, 4], [2, 1]]), torch.full((many, 1), 2)):
        for slots in (1, idx.shape[1]):
            x = torch.randn(idx.shape[0], slots, 96, generator=g)
            y = torch.ops.mhcrun.qgemv_expert_set(x, found.ptrs, idx, found.fmt, found.kind, found.block, 64, 96,
                                                  isa.library, isa.isa)
            assert y.shape == (*idx.shape, 64)
            for b, row in enumerate(idx.tolist()):
                for j, e in enumerate(row):
                    xr = x[b, j if slots > 1 else 0][None]
                    assert_gemm_close(y[b, j][None], F.linear(xr, refs[e]), xr, refs[e])


@needs_kernel
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_routed_prefill_chunk_splits_over_threads(isa, fmt):
    """A prefill chunk's routed call large enough that its gathers, x preparation, swiglu and sums split over the
    threads (mhc_moe_routed: PARALLEL_VALUES, 65,536 values a loop): the torch path's result within rounding, and the
    same bits on one thread as on two (every expert's rows go to the same rows of the same kernel either way; FP4
    takes the panels, four rows of x and more an expert)."""
    from mhcrun.model import swiglu_expert
    from mhcrun.ops.qlinear import qlinear_gathered

    g = gen(1560)
    d, inter, n_exp, k, rows = 512, 512, 8, 4, 32  # 128 routes: the most MAX_ROWS an expert allows; 65,536 values
    block = 128 if fmt == "fp8" else 32

    def experts(out_f: int, in_f: int) -> list[QWeight]:
        return [qw(*(fp8_weight(out_f, in_f, 128, g) if fmt == "fp8" else fp4_weight(out_f, in_f, g)), block)
                for _ in range(n_exp)]

    kept = experts(inter, d), experts(inter, d), experts(d, inter)
    sets = [expert_set(ws) for ws in kept]
    x, weights = torch.randn(rows, d, generator=g), torch.rand(rows, k, generator=g)
    idx = torch.randint(0, n_exp, (rows, k), generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = isa.moe_routed(x, weights, idx, *sets, 10.0, 128)
        torch.set_num_threads(2)
        two = isa.moe_routed(x, weights, idx, *sets, 10.0, 128)
    finally:
        torch.set_num_threads(before)
    assert one is not None and torch.equal(one, two)

    def proj(i: int):
        return functools.partial(qlinear_gathered, w=sets[i], idx=idx, act_quant=True, cpu=isa)

    want = swiglu_expert(proj(0), proj(2), proj(1), 10.0, x.unsqueeze(1), weights.unsqueeze(-1)).float().sum(1)
    torch.testing.assert_close(one, want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("rows, limit", [(1, 10.0), (3, 0.05), (2, 0.0), (20, 10.0)])
def test_routed_experts_in_one_call(isa, fmt, rows, limit, monkeypatch):
    """CpuKernel.moe_routed (MoE.routed_gathered of decode rows in one call, and of a prefill chunk's: 20 rows) gives
    what the torch path gives (each projection through qlinear_gathered over the sets read in place, swiglu, the
    routing weights, the k results summed) within rounding (silu's exp is the C library's), with the activation
    rounding and without, experts repeated within a row, the clamps biting (limit 0.05) or off (0). It declines NaN x
    (torch's rules then apply), more routes than its bound (`routed_routes`: MAX_ROWS rows an expert on average, or
    ROUTED_CALL_BYTES of transients where panels take the experts: AVX2's FP4, avx512bf16's FP4 and FP8 on a CPU
    without AMX), and sets of two layouts."""
    from mhcrun.model import swiglu_expert
    from mhcrun.ops.qlinear import qlinear_gathered

    g = gen(1500 + rows)
    d, inter, n_exp, k = 256, 128, 6, 3

    def experts(out_f: int, in_f: int) -> list[QWeight]:
        return [qw(*(fp8_weight(out_f, in_f, 128, g) if fmt == "fp8" else fp4_weight(out_f, in_f, g)),
                   128 if fmt == "fp8" else 32) for _ in range(n_exp)]

    kept = experts(inter, d), experts(inter, d), experts(d, inter)  # the layer's weights, alive while read in place
    sets = [expert_set(ws) for ws in kept]
    x, weights = torch.randn(rows, d, generator=g), torch.rand(rows, k, generator=g)
    idx = torch.randint(0, n_exp, (rows, k), generator=g)
    idx[0, 1] = idx[0, 0]  # an expert twice in one row
    for act in (True, False):
        got = isa.moe_routed(x, weights, idx, *sets, limit, 128 if act else 0)

        def proj(i: int, act: bool = act):
            return functools.partial(qlinear_gathered, w=sets[i], idx=idx, act_quant=act, cpu=isa)

        want = swiglu_expert(proj(0), proj(2), proj(1), limit, x.unsqueeze(1), weights.unsqueeze(-1)).float().sum(1)
        assert got is not None and got.shape == (rows, d)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    bad = x.clone()
    bad[0, 7] = float("nan")
    assert isa.moe_routed(bad, weights, idx, *sets, limit, 128) is None
    floor = qgemv.MAX_ROWS * sets[0].ptrs.shape[0]
    monkeypatch.setattr(qgemv, "ROUTED_CALL_BYTES", 2 * floor * qgemv.route_bytes(d, inter))
    panels = isa.isa == qgemv.ISAS["avx512bf16"] and job_panels(isa) or fmt == "fp4" and isa.isa == qgemv.ISAS["avx2"]
    assert isa.routed_routes(sets[0], sets[2]) == (2 * floor if panels else floor)
    many = isa.routed_routes(sets[0], sets[2]) // k + 1  # more routes than the call's bound
    assert isa.moe_routed(torch.randn(many, d), torch.rand(many, k), torch.zeros(many, k, dtype=torch.long), *sets,
                          limit, 128) is None
    fits = many - 1  # a prefill chunk's worth: one call all the same
    xs, ws, ids = torch.randn(fits, d), torch.rand(fits, k), torch.randint(0, sets[0].ptrs.shape[0], (fits, k))
    assert isa.moe_routed(xs, ws, ids, *sets, limit, 128) is not None
    other = expert_set(experts(inter, d)) if fmt == "fp4" else None
    if other is not None:
        assert isa.moe_routed(x, weights, idx, sets[0], sets[1], replace(other, block=64), limit, 128) is None


def job_panels(kernel: CpuKernel) -> bool:
    """Whether the kernel's GEMV jobs of many rows take the BF16 panels (qgemv.cpp's job_panels: CPUs without AMX)."""
    return not qgemv.load_library(kernel.library).mhc_qgemm_amx()


@needs_kernel
@pytest.mark.parametrize("n, k", [(37, 256), (64, 2048), (1, 96)])
def test_gemv_rows_take_the_bf16_panels_from_job_rows(n, k):
    """With BF16 dot products on a CPU without AMX, a GEMV call of gemm::JOB_ROWS_FP4 (4) to MAX_ROWS rows of x
    whose values and scales qualify (the activation rounding's) runs its FP4 weight by the panels (gemm::run_job):
    bit for bit what the prefill GEMM gives (`qgemm`: the same panels and sums), one output row and panels cut short
    (n not a multiple of 32) included; below 4 rows the GEMV rows, the two-orders bound against the reference."""
    kernel, g = gemm_in("avx512bf16"), gen(3900 + n + k)
    if not job_panels(kernel):
        pytest.skip("an AMX CPU: its GEMV jobs keep the GEMV rows")
    data, scale = fp4_weight(n, k, g)
    w = qw(data, scale, 32)
    w_ref = reference_weight(data, scale, "fp4", 32)
    for rows in (3, 4, 7, 13, qgemv.MAX_ROWS - 1):
        x = fp8_simulate(torch.randn(rows, k, generator=g), 128, pow2_scale=True)
        y = kernel.qgemv(x[:, None], w, 1)[:, 0]
        assert_gemm_close(y, F.linear(x, w_ref), x, w_ref)
        if rows >= 4:
            assert torch.equal(y, kernel.qgemm(x, w)), rows


@needs_kernel
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_routed_experts_by_the_bf16_panels(fmt):
    """A prefill chunk's routed call with BF16 dot products whose experts get 16 rows and more (gemm::run_job): the
    torch path's result within rounding; where one expert's w3 has a scale the panels refuse (2**-127 in e8m0,
    2**-126 in fp32: below 2**-70) while its w1 takes them, that w3 prepares its own x (not w1's pairs) and the
    result is still the torch path's."""
    from mhcrun.model import swiglu_expert
    from mhcrun.ops.qlinear import qlinear_gathered

    kernel, g = gemm_in("avx512bf16"), gen(3950)
    if not job_panels(kernel):
        pytest.skip("an AMX CPU: its GEMV jobs keep the GEMV rows")
    d, inter, n_exp, k, rows = 256, 128, 4, 2, 40  # 20 rows an expert on average
    block = 128 if fmt == "fp8" else 32

    def experts(out_f: int, in_f: int) -> list[QWeight]:
        return [qw(*(fp8_weight(out_f, in_f, 128, g) if fmt == "fp8" else fp4_weight(out_f, in_f, g)), block)
                for _ in range(n_exp)]

    kept = experts(inter, d), experts(inter, d), experts(d, inter)
    tiny = kept[1][0].scale.view(torch.uint8) if fmt == "fp4" else kept[1][0].scale
    tiny[0, 0] = 0 if fmt == "fp4" else 2.0**-126  # w3 of expert 0: a scale the panels refuse (their exponent wraps)
    sets = [expert_set(ws) for ws in kept]
    x, weights = torch.randn(rows, d, generator=g), torch.rand(rows, k, generator=g)
    idx = torch.randint(0, n_exp, (rows, k), generator=g)
    idx[:, 0] = 0  # expert 0 in every row
    got = kernel.moe_routed(x, weights, idx, *sets, 10.0, 128)

    def proj(i: int):
        return functools.partial(qlinear_gathered, w=sets[i], idx=idx, act_quant=True, cpu=kernel)

    want = swiglu_expert(proj(0), proj(2), proj(1), 10.0, x.unsqueeze(1), weights.unsqueeze(-1)).float().sum(1)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_routed_experts_refuse_routes_outside_the_set(isa, fmt):
    """An expert index outside the set, or x of another width than the experts', is refused with a ValueError that
    names it, before any weight byte is read (the kernel reads experts through raw addresses: a bad index would read
    whatever memory lies past the table)."""
    g = gen(1460)
    kept = [qw(*(fp8_weight(64, 128, 128, g) if fmt == "fp8" else fp4_weight(64, 128, g)),
               128 if fmt == "fp8" else 32) for _ in range(3)]
    found = expert_set(kept)
    x = torch.randn(2, 1, 128, generator=g)
    assert isa.experts_at(found, torch.tensor([[0, 2], [1, 2]]), x) is not None
    for bad in ([[0, 3], [1, 2]], [[0, 1], [-1, 2]]):
        with pytest.raises(ValueError, match="outside the 3 experts"):
            isa.experts_at(found, torch.tensor(bad), x)
        with pytest.raises(ValueError, match="outside the 3 experts"):
            torch.ops.mhcrun.qgemv_expert_set(x, found.ptrs, torch.tensor(bad), found.fmt, found.kind, found.block, 64,
                                              128, isa.library, isa.isa)
    with pytest.raises(ValueError, match="take 128 inputs a row, not 96"):
        isa.experts_at(found, torch.tensor([[0, 1], [1, 2]]), x[..., :96])
    for wrong in (x[:1], torch.randn(2, 3, 128, generator=g), x[0]):  # fewer rows than routes, 3 slots for 2, 2-D
        with pytest.raises(ValueError, match="x must be"):
            isa.experts_at(found, torch.tensor([[0, 1], [1, 2]]), wrong)
    w2 = expert_set([qw(*(fp8_weight(128, 64, 128, g) if fmt == "fp8" else fp4_weight(128, 64, g)),
                        128 if fmt == "fp8" else 32) for _ in range(3)])
    xr, weights = torch.randn(2, 128, generator=g), torch.rand(2, 2, generator=g)
    assert isa.moe_routed(xr, weights, torch.tensor([[0, 2], [1, 1]]), found, found, w2, 0.0, 0) is not None
    with pytest.raises(ValueError, match="outside the 3 experts"):
        isa.moe_routed(xr, weights, torch.tensor([[0, 2], [1, 3]]), found, found, w2, 0.0, 0)
    short = expert_set([qw(*(fp8_weight(128, 32, 128, g) if fmt == "fp8" else fp4_weight(128, 32, g)),
                           128 if fmt == "fp8" else 32) for _ in range(3)])
    with pytest.raises(ValueError, match="take 32 inputs a row, not 64"):
        isa.moe_routed(xr, weights, torch.tensor([[0, 2], [1, 1]]), found, found, short, 0.0, 0)


@needs_kernel
@pytest.mark.parametrize("fmt", ["fp8", "fp4", "float"])
@pytest.mark.parametrize("m, groups", [(1, 1), (3, 1), (qgemv.MAX_ROWS, 1), (2, 4)])
def test_native_gemv_op_is_the_python_op_in_cpp(isa, fmt, m, groups):
    """mhcrun::qgemv_native (torch_ops.cpp: the op compiled graphs call, whose C++ wrapper then runs no Python) gives
    mhcrun::qgemv's results bitwise, on both scale encodings, rows up to MAX_ROWS and grouped outputs; where the kernel
    declines (a thread that flushes subnormals) it hands the call to the Python op, whose torch path gives its
    result."""
    assert isa.ops, "the kernel's torch ops were not built"
    g = gen(1470 + m)
    data, scale = weight_of(fmt, 96, 160, g)
    w = qw(data, scale, 32)
    x3 = torch.randn(m, groups, 160, generator=g)
    scales = [None] if scale is None else [w.scale, w.graph_scale()]  # fp32 scales or e8m0 bytes, as graphs take them
    for s in scales:
        args = (x3, w.data, s, w.block, groups, isa.library, isa.isa)
        want = torch.ops.mhcrun.qgemv(*args)
        got = torch.ops.mhcrun.qgemv_native(*args)
        assert got.shape == want.shape == (m, groups, 96 // groups) and torch.equal(got, want)
    if fmt == "fp8" and m == 1 and torch.set_flush_denormal(True):
        try:
            assert isa.qgemv(x3, w, groups) is None  # the kernel declines: both take torch's path
            assert torch.equal(torch.ops.mhcrun.qgemv_native(*args), torch.ops.mhcrun.qgemv(*args))
        finally:
            torch.set_flush_denormal(False)


@needs_kernel
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_native_expert_set_op_is_the_python_op_in_cpp(isa, fmt):
    """mhcrun::qgemv_expert_set_native gives mhcrun::qgemv_expert_set's results bitwise (one x per row or per slot),
    and what the Python op refuses it refuses with the same error (an index outside the set, another width, x of
    another shape, a thread that flushes subnormals): it hands those calls to the Python op."""
    g = gen(1480)
    kept = [qw(*(fp8_weight(64, 96, 32, g) if fmt == "fp8" else fp4_weight(64, 96, g)), 32) for _ in range(4)]
    found = expert_set(kept)
    set_args = (found.fmt, found.kind, found.block, 64, 96, isa.library, isa.isa)
    idx = torch.tensor([[0, 3], [2, 2], [1, 0]])
    for slots in (1, 2):
        x = torch.randn(3, slots, 96, generator=g)
        want = torch.ops.mhcrun.qgemv_expert_set(x, found.ptrs, idx, *set_args)
        assert torch.equal(torch.ops.mhcrun.qgemv_expert_set_native(x, found.ptrs, idx, *set_args), want)
    x = torch.randn(3, 1, 96, generator=g)
    with pytest.raises(ValueError, match="outside the 4 experts"):
        torch.ops.mhcrun.qgemv_expert_set_native(x, found.ptrs, torch.tensor([[0, 4], [1, 1], [2, 2]]), *set_args)
    with pytest.raises(ValueError, match="take 96 inputs a row, not 64"):
        torch.ops.mhcrun.qgemv_expert_set_native(x[..., :64], found.ptrs, idx, *set_args)
    with pytest.raises(ValueError, match="x must be"):
        torch.ops.mhcrun.qgemv_expert_set_native(x[:2], found.ptrs, idx, *set_args)
    if torch.set_flush_denormal(True):
        try:
            with pytest.raises(RuntimeError, match="flushes subnormals"):
                torch.ops.mhcrun.qgemv_expert_set_native(x, found.ptrs, idx, *set_args)
        finally:
            torch.set_flush_denormal(False)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, d", [(1, 256), (3, 131), (qgemv.MAX_ROWS, 64)])
def test_native_post_pre_op_is_the_python_op_in_cpp(isa, dtype, rows, d):
    """mhcrun::hc_post_pre_native (the post+pre step compiled graphs call) gives mhcrun::hc_post_pre_cpu's results
    bitwise, which are the kernel's (`CpuKernel.hc_post_pre`); what the C++ does not read (a weight of another shape)
    or the kernel declines (a thread that flushes subnormals) goes to the Python op, whose reference gives its result
    or its error."""
    from mhcrun.nki.ops import _ref_post_pre

    assert isa.ops, "the kernel's torch ops were not built"
    c = hc_case(rows, d, dtype, seed=rows)
    args = [c["y"], c["x"], c["post"], c["comb"], c["fn"], c["scale"], c["base"], c["w"], 20, 1e-6, 1e-6]
    want = isa.hc_post_pre(*args)
    for op in (torch.ops.mhcrun.hc_post_pre_native, torch.ops.mhcrun.hc_post_pre_cpu):
        got = op(*args, isa.library, isa.isa)
        assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want, strict=True))
    ref = _ref_post_pre(*args[:8], 4, *args[8:])
    assert torch.equal(want[0], ref[0])  # the post step is bitwise; the rest within rounding (test_hc_steps_...)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # fn of one input fewer: the reference refuses it
        torch.ops.mhcrun.hc_post_pre_native(*args[:4], c["fn"][:, 1:], *args[5:], isa.library, isa.isa)
    if dtype == torch.float32 and rows == 1 and torch.set_flush_denormal(True):
        try:
            assert isa.hc_post_pre(*args) is None
            got = torch.ops.mhcrun.hc_post_pre_native(*args, isa.library, isa.isa)
            assert all(torch.equal(g, r.contiguous()) for g, r in zip(got, ref, strict=True))
        finally:
            torch.set_flush_denormal(False)


@needs_kernel
@pytest.mark.parametrize("b, s, h, n, k, d", [(1, 1, 16, 129, 64, 512), (2, 1, 16, 129, 0, 512), (2, 3, 3, 7, 2, 72)])
def test_native_attend_op_is_the_python_op_in_cpp(isa, b, s, h, n, k, d):
    """mhcrun::attend_native (the attention compiled graphs call) gives mhcrun::attend_cpu's results bitwise, which
    are the kernel's (`CpuKernel.attend`, within rounding of sparse_attn); what the C++ does not read (a mask torch
    would broadcast, gathered keys without their mask) or the kernel declines goes to the Python op: sparse_attn's
    result or its error."""
    assert isa.ops, "the kernel's torch ops were not built"
    args = attn_case(b, s, h, n, k, d, seed=b * 100 + k)
    want = isa.attend(*args)
    for op in (torch.ops.mhcrun.attend_native, torch.ops.mhcrun.attend_cpu):
        assert torch.equal(op(*args, isa.library, isa.isa), want)
    torch.testing.assert_close(want, sparse_attn(*args), rtol=1e-5, atol=1e-6)
    q, kv, mask, sink, scale, sel, sm = args
    broadcast = torch.ops.mhcrun.attend_native(q, kv, mask[..., :1], sink, scale, sel, sm, isa.library, isa.isa)
    assert torch.equal(broadcast, sparse_attn(q, kv, mask[..., :1], sink, scale, sel, sm))
    if k:
        with pytest.raises(AttributeError):  # sparse_attn's error: None.unsqueeze
            torch.ops.mhcrun.attend_native(q, kv, mask, sink, scale, sel, None, isa.library, isa.isa)
    if torch.set_flush_denormal(True):
        try:
            got = torch.ops.mhcrun.attend_native(*args, isa.library, isa.isa)
            assert isa.attend(*args) is None and torch.equal(got, sparse_attn(*args))
        finally:
            torch.set_flush_denormal(False)


@needs_kernel
@pytest.mark.parametrize("b, s, n, closed", [(1, 1, 200, [[200]]), (2, 1, 50, [[50], [23]]),
                                             (1, 3, 20, [[18, 19, 20]])])
def test_native_index_topk_op_is_the_python_op_in_cpp(isa, b, s, n, closed):
    """mhcrun::index_topk_native (the indexer's top-k compiled graphs call) gives mhcrun::index_topk_cpu's results
    bitwise, which are the kernel's (`CpuKernel.index_topk`); where the kernel declines (a NaN score) both give the
    reference: select_topk of index_scores on the decoded keys. Traced, it is one op in the graph."""
    assert isa.ops, "the kernel's torch ops were not built"
    q, w, packed, scale = index_case(b, s, 16, 128, 3, n + 5, False, seed=7 * n + b)
    rows, closed = torch.tensor([2, 0][:b]), torch.tensor(closed)
    args = (q, w, packed, scale, rows, closed, n, 64, 32)
    want = isa.index_topk(*args)
    for op in (torch.ops.mhcrun.index_topk_native, torch.ops.mhcrun.index_topk_cpu):
        got = op(*args, isa.library, isa.isa)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    nan = q.clone()
    nan[0, 0, 1, 3] = float("nan")
    assert isa.index_topk(nan, *args[1:]) is None
    ref = reference_index_topk(nan, w, packed, scale, rows, closed, n, 64)
    for op in (torch.ops.mhcrun.index_topk_native, torch.ops.mhcrun.index_topk_cpu):
        got = op(nan, *args[1:], isa.library, isa.isa)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    torch._dynamo.reset()
    targets = []

    def record(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    got = torch.compile(isa.index_topk, backend=record, fullgraph=True)(*args)
    assert "mhcrun.index_topk_native" in targets, targets
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_kernel
def test_compiled_attention_and_post_pre_call_the_kernel_ops(isa):
    """Traced, the kernel's attention and post+pre step are one op each in the graph (their C++ kernels
    mhcrun::attend_native and mhcrun::hc_post_pre_native where the run loaded the kernel's ops; else nothing: the
    caller traces the torch reference), and the compiled call gives the eager call's result."""
    torch._dynamo.reset()
    targets = []

    def record(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    args = attn_case(1, 1, 16, 129, 64, 512)
    got = torch.compile(isa.attend, backend=record, fullgraph=True)(*args)
    c = hc_case(1, 256, torch.float32)
    hc_args = (c["y"], c["x"], c["post"], c["comb"], c["fn"], c["scale"], c["base"], c["w"], 20, 1e-6, 1e-6)
    got_hc = torch.compile(isa.hc_post_pre, backend=record, fullgraph=True)(*hc_args)
    if not isa.ops:
        assert got is None and got_hc is None
        return
    assert "mhcrun.attend_native" in targets and "mhcrun.hc_post_pre_native" in targets, targets
    assert torch.equal(got, isa.attend(*args))
    assert all(torch.equal(g, w) for g, w in zip(got_hc, isa.hc_post_pre(*hc_args), strict=True))


def test_torch_ops_that_cannot_be_built_are_none(tmp_path):
    """Where the kernel's torch ops cannot be built, the kernel has none (`CpuKernel.ops` ""): graphs then call the
    Python ops, with a Python wrapper (RegionDecoder)."""
    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    "echo 'torch_ops.cpp:1: error: broken' >&2\nexit 1\n")
    fake.chmod(0o755)
    assert qgemv.load_torch_ops(Env(kernel_cache=tmp_path / "cache", cxx=str(fake))) == ""
    assert not any((tmp_path / "cache").iterdir())


def test_expert_set_only_of_weights_the_kernel_takes_alike():
    """A set is made only where the kernel takes every expert in one layout; else None (the layer stacks them)."""
    g = gen(1450)
    (w, s), (w2, s2) = fp8_weight(64, 96, 32, g), fp8_weight(64, 96, 32, g)
    assert expert_set([qw(w, s, 32), qw(w2, s2, 32)]) is not None
    assert expert_set([qw(w, s, 32), qw(w2, torch.full((2, 3), 2.0**125), 32)]) is None  # scales could overflow
    assert expert_set([qw(w, s, 32), qw(w2, s2.float(), 32)]) is None  # e8m0 beside fp32 scales
    assert expert_set([qw(w, s, 32), qw(*fp8_weight(64, 64, 32, g), 32)]) is None  # another shape
    assert expert_set([qw(torch.randn(64, 96).to(torch.bfloat16))]) is None  # bf16 experts stay stacked


@needs_kernel
@pytest.mark.parametrize("fmt", ["fp8", "fp4", "float"])
def test_compiled_qlinear_calls_the_kernel_op(isa, fmt):
    """A compiled decode GEMV is one mhcrun::qgemv call in the graph (its C++ kernel mhcrun::qgemv_native where the
    run loaded the kernel's ops; no traced dequantisation), for plain and grouped (wo_a) outputs."""
    from mhcrun.ops.qlinear import qlinear_grouped

    torch._dynamo.reset()
    g = gen(1500)
    data, scale = weight_of(fmt, 96, 160, g)
    w_ref = reference_weight(data, scale, fmt, 32)
    targets = []

    def record(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    w = qw(data, scale, 32)
    assert w.kernel

    def linear(x, d, s):
        return qlinear(x, QWeight(d, s, w.block, w.kernel), cpu=isa)

    def grouped(x, d, s):
        return qlinear_grouped(x, QWeight(d, s, w.block, w.kernel), 4, isa)

    x = torch.randn(2, 160, generator=g)
    y = torch.compile(linear, backend=record, fullgraph=True)(x, data, scale)
    assert_gemm_close(y, F.linear(x, w_ref), x, w_ref)
    op = "mhcrun.qgemv_native" if isa.ops else "mhcrun.qgemv"  # the C++ kernel of the op, where the run loaded it
    assert op in targets and not any("bitwise" in t for t in targets)
    xg = torch.randn(3, 4, 160, generator=g)
    yg = torch.compile(grouped, backend=record, fullgraph=True)(xg, data, scale)
    for gi in range(4):
        rows = w_ref[gi * 24:(gi + 1) * 24]
        assert_gemm_close(yg[:, gi], F.linear(xg[:, gi], rows), xg[:, gi], rows)


# ---------------------------------------------------------------- the mHC steps of decode rows


def hc_case(rows: int, d: int, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = 4
    return {"y": torch.randn(rows, 1, d, generator=g).to(dtype), "x": torch.randn(rows, 1, n, d, generator=g).to(dtype),
            "post": torch.rand(rows, 1, n, generator=g) * 2, "comb": torch.rand(rows, 1, n, n, generator=g),
            "fn": torch.randn((2 + n) * n, n * d, generator=g) * 0.05, "scale": torch.rand(3, generator=g) + 0.5,
            "base": torch.randn((2 + n) * n, generator=g) * 0.5, "w": torch.rand(d, generator=g) + 0.5}


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, d", [(1, 256), (3, 131), (16, 64), (2, 7), (1, 2048)])
def test_hc_steps_against_the_reference(isa, dtype, rows, d):
    """The C++ post step equals mhcrun.ops.hc.hc_post bitwise (stream order, no FMA; AVX-512: sixteen values a step,
    the last step partial; a prefill's rows: `test_hc_post_of_a_prefill_is_the_reference`); the pre step (mixes GEMV,
    Sinkhorn, collapse, RMSNorm) and the head's collapse are within rounding of the torch references: post and comb
    within 2e-6 (more for longer sums; a mean of squares over one value fewer is refused), the sublayer input and the
    head's output within 2e-6 relative (fp32) or one bf16 step. Rows up to MAX_ROWS, d not a multiple of the eight or
    sixteen lanes, and the mid-size config's width."""
    from mhcrun.nki.ops import _ref_pre
    from mhcrun.ops import hc as ref

    k, c = kernel_in(isa), hc_case(rows, d, dtype)
    got = k.hc_post(c["y"], c["x"], c["post"], c["comb"])
    want = ref.hc_post(c["y"], c["x"], c["post"], c["comb"])
    assert got.dtype == dtype and torch.equal(got, want)
    h, post, comb = k.hc_pre(want, c["fn"], c["scale"], c["base"], c["w"], 20, 1e-6, 1e-6)
    rh, rpost, rcomb = _ref_pre(want, c["fn"], c["scale"], c["base"], c["w"], 4, 20, 1e-6, 1e-6)
    tol = 2e-6 * max(1.0, math.sqrt(4 * d / 1024))  # the mixes sum 4 d products: rounding grows as its square root
    torch.testing.assert_close(post, rpost, rtol=0, atol=tol)
    torch.testing.assert_close(comb, rcomb, rtol=0, atol=tol)
    # the tolerance refuses a slip: the mixes' mean of squares over n d - 1 values (fn scaled by sqrt((nd - 1) / nd))
    nd = 4 * d
    _, spost, scomb = _ref_pre(want, c["fn"] * math.sqrt((nd - 1) / nd), c["scale"], c["base"], c["w"], 4, 20, 1e-6,
                               1e-6)
    for slip, ref_t in ((spost, rpost), (scomb, rcomb)):
        with pytest.raises(AssertionError):
            torch.testing.assert_close(slip, ref_t, rtol=0, atol=tol)
    assert h.dtype == dtype and h.shape == rh.shape
    if dtype == torch.float32:
        torch.testing.assert_close(h, rh, rtol=2e-6, atol=2e-6)
    else:  # a value within rounding of a bf16 midpoint may round to the neighbouring bf16
        step = rh.float().abs().clamp_min(2.0 ** -126) * 2.0 ** -7
        assert ((h.float() - rh.float()).abs() <= step).all()
    assert (comb.sum(-2) - 1).abs().max() < 1e-5  # Sinkhorn ends on a column step
    head = k.hc_head(want, c["fn"][:4], c["scale"][:1], c["base"][:4], 1e-6, 1e-6)  # V4's final collapse
    rhead = ref.hc_head(want, c["fn"][:4], c["scale"][:1], c["base"][:4], 1e-6, 1e-6)
    assert head.dtype == dtype and head.shape == rhead.shape
    if dtype == torch.float32:
        torch.testing.assert_close(head, rhead, rtol=2e-6, atol=2e-6)
    else:
        assert ((head.float() - rhead.float()).abs() <= rhead.float().abs().clamp_min(2.0 ** -126) * 2.0 ** -7).all()
    assert k.hc_head(want, c["fn"], c["scale"][:1], c["base"][:4], 1e-6, 1e-6) is None  # the pre step's mixes


@pytest.mark.parametrize("d", [7, 131, 2048, 8192])
def test_avx2_lane_sums_are_the_plain_ones(d):
    """The AVX2 eight-lane dot products (the mixes, the mean squares of RMSNorm and of the pre step) sum each lane in
    the order of the plain C++ loop (isa 0), each product rounded before it is added: bitwise its results, widths on
    and off the lanes."""
    k = kernel_in("avx2")
    lib = qgemv.load_library(k.library)
    g = gen(90 + d)
    x, w = torch.randn(5, d, generator=g) * 3, torch.rand(d, generator=g) + 0.5
    outs = [torch.empty_like(x) for _ in range(2)]
    for isa, out in zip((0, 1), outs, strict=True):
        assert lib.mhc_rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), 5, d, 1e-6, isa) == 0
    assert torch.equal(outs[0], outs[1])
    n = 4
    if d % n:
        return
    c = hc_case(1, d // n, torch.float32)
    res = []
    for isa in (0, 1):
        h, post, comb = torch.empty(1, d // n), torch.empty(1, n), torch.empty(1, n, n)
        assert lib.mhc_hc_pre(0, c["x"].data_ptr(), c["fn"].data_ptr(), c["scale"].data_ptr(), c["base"].data_ptr(),
                              c["w"].data_ptr(), h.data_ptr(), post.data_ptr(), comb.data_ptr(), 1, n, d // n, 20,
                              ctypes.c_float(1e-6), ctypes.c_float(1e-6), None, isa, 1) == 0
        res.append((h, post, comb))
    assert all(torch.equal(a, b) for a, b in zip(*res, strict=True))


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("shape", [(1, 1, 1024), (3, 1, 512), (qgemv.MAX_ROWS, 7), (2, 2048)])
def test_rms_norm_in_one_call(isa, shape):
    """CpuKernel.rms_norm is mhcrun.ops.norm.rms_norm within rounding (the mean of squares summed in another order; the
    products then as torch's): 2 ulp-scale relative; rows up to MAX_ROWS, widths off the lanes; without a weight (the
    attention's per-head norm), decode's rows of heads. It declines more rows, bf16, a weight of another width, the
    kernel off; a NaN in a row makes that row NaN, as the reference."""
    from mhcrun.ops.norm import rms_norm

    k = kernel_in(isa)
    g = gen(77 + shape[-1])
    x, w = torch.randn(*shape, generator=g) * 3, torch.rand(shape[-1], generator=g) + 0.5
    got, want = k.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)
    assert got is not None and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=3e-7, atol=0)
    slip = w * (x * torch.rsqrt(x.square().sum(-1, keepdim=True) / (shape[-1] - 1) + 1e-6))  # a mean over d - 1
    with pytest.raises(AssertionError):  # the tolerance refuses it, even at the widest d
        torch.testing.assert_close(slip, want, rtol=3e-7, atol=0)
    assert k.rms_norm(torch.randn(qgemv.MAX_ROWS + 1, 64), torch.ones(64), 1e-6) is None
    assert k.rms_norm(x.bfloat16(), w, 1e-6) is None and k.rms_norm(x, w[:-1], 1e-6) is None
    assert cpu_kernel("0").rms_norm(x, w, 1e-6) is None
    bad = x.reshape(-1, shape[-1]).clone()
    bad[0, 3] = float("nan")
    assert torch.equal(k.rms_norm(bad, w, 1e-6).isnan(), rms_norm(bad, w, 1e-6).isnan())
    heads = x.reshape(-1, shape[-1]).expand(qgemv.HEAD_ROWS, -1, -1)  # no weight: the attention's per-head norm
    torch.testing.assert_close(k.rms_norm(heads, None, 1e-6), heads * torch.rsqrt(heads.square().mean(-1, True) + 1e-6),
                               rtol=3e-7, atol=0)
    assert k.rms_norm(torch.randn(qgemv.MAX_ROWS * qgemv.HEAD_ROWS + 1, 8), None, 1e-6) is None


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("starts, s", [([5], 1), ([1, 6], 1), ([4, 9], 2), ([130, 2], 1)])
def test_open_group_step_in_one_call(overlap, starts, s):
    """CpuKernel.open_group is Compressor.forward's step that closes no group, bitwise: the positional bias added to the
    score, then compress.add_to_open_group into the given state rows (rows out of order, the slots of a group's middle
    and its end, positions past a window); the other rows and slots untouched. It refuses other dtypes and a bias of
    another shape, and the kernel off."""
    from mhcrun.ops.compress import add_to_open_group, stays_open

    k = cpu_kernel()
    if not k.on:
        pytest.skip(k.status())
    r, c, g = (4 if overlap else 8), 24, gen(900 + s)
    start = torch.tensor(starts)
    assert stays_open(start, s, r)
    rows = torch.tensor([2, 0][:len(starts)])
    lead, length = (r, 2 * r) if overlap else (0, r)
    kv_state, score_state = torch.randn(3, length, c, generator=g), torch.randn(3, length, c, generator=g)
    kv, raw = torch.randn(len(starts), s, c, generator=g), torch.randn(len(starts), s, c, generator=g)
    ape = torch.randn(r, c, generator=g)
    want_kv, want_score = kv_state.clone(), score_state.clone()
    pos = start.view(-1, 1) + torch.arange(s)
    add_to_open_group(want_kv, want_score, rows, kv, raw + ape[pos % r], start, r, overlap)
    assert k.open_group(kv_state, score_state, rows, kv, raw, ape, start, r, lead)
    assert torch.equal(kv_state, want_kv) and torch.equal(score_state, want_score)
    assert not k.open_group(kv_state, score_state, rows, kv.double(), raw, ape, start, r, lead)
    assert not k.open_group(kv_state, score_state, rows, kv, raw, ape[:-1], start, r, lead)
    assert not cpu_kernel("0").open_group(kv_state, score_state, rows, kv, raw, ape, start, r, lead)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("starts", [[3], [7, 131], [11, 3], [5, 7]])
def test_close_group_step_in_one_call(overlap, starts):
    """CpuKernel.close_group is the decode step that closes each row's group (Compressor.forward through
    compress.compress_chunk): the pooled groups within rounding of the softmax and sum (with overlap the previous
    group's first half of the channels, then this group's second half), the new state bitwise (the closed group kept as
    the previous one, the open group emptied; a row whose group stays open given its token only), the other rows
    untouched; rows out of order, the first group, a group past a window, rows at other positions in a group. It
    refuses a step that closes no group, a row twice, other dtypes and the kernel off."""
    from mhcrun.ops.compress import compress_chunk

    k = cpu_kernel()
    if not k.on:
        pytest.skip(k.status())
    r, c, g = 4, 24, gen(77 + len(starts))
    if not overlap:
        r, starts = 8, [2 * p + 1 for p in starts]  # the last token of a group of 8
    lead = r if overlap else 0
    start = torch.tensor(starts)
    rows = torch.tensor([2, 0][:len(starts)])
    kv_state, score_state = torch.randn(3, lead + r, c, generator=g), torch.randn(3, lead + r, c, generator=g)
    kv, raw = torch.randn(len(starts), 1, c, generator=g), torch.randn(len(starts), 1, c, generator=g)
    ape = torch.randn(r, c, generator=g)
    score = raw + ape[start.view(-1, 1) % r]
    pooled, closed, entry, new_kv, new_score = compress_chunk(kv_state[rows], score_state[rows], kv, score, start, r,
                                                              overlap)
    want_kv, want_score = kv_state.clone(), score_state.clone()
    want_kv[rows], want_score[rows] = new_kv, new_score
    shut = closed.any(1)
    want = torch.zeros(len(starts), want_kv.shape[-1] // (2 if overlap else 1))
    want[shut] = pooled[closed]
    assert torch.equal(entry[closed], start[shut] // r)
    got = k.close_group(kv_state, score_state, rows, kv, raw, ape, start, r, lead)
    assert got is not None and torch.equal(got[1], shut) and got[0].shape == want.shape
    torch.testing.assert_close(got[0], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(kv_state, want_kv) and torch.equal(score_state, want_score)
    none = start.clone()
    none[shut] += 1
    assert k.close_group(kv_state, score_state, rows, kv, raw, ape, none, r, lead) is None  # closes none
    assert k.close_group(kv_state, score_state, torch.tensor([1, 1]), kv.expand(2, 1, c).contiguous(),
                         raw.expand(2, 1, c).contiguous(), ape, start[:1].expand(2), r, lead) is None  # a row twice
    assert k.close_group(kv_state, score_state, rows, kv.double(), raw, ape, start, r, lead) is None
    assert cpu_kernel("0").close_group(kv_state, score_state, rows, kv, raw, ape, start, r, lead) is None
    assert torch.equal(kv_state, want_kv) and torch.equal(score_state, want_score)  # the refusals wrote nothing


@needs_kernel
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("starts", [[3], [7, 130], [5, 6], [0, 3]])
def test_native_compress_step_op_is_the_python_op_in_cpp(isa, overlap, starts):
    """mhcrun::compress_step_native (the static path's compressor step in compiled graphs) writes the state and gives
    the pooled group as mhcrun::compress_step_cpu does, which is the kernel's (`CpuKernel.compress_step`: close_group
    where a row's token closes its group, open_group where none does), bitwise; each is the reference
    (`compress.compress_step`: compress_chunk of the token) with the state bitwise and the pooled group within
    rounding; where the kernel declines (a row at position 0, which starts afresh) both give the reference bitwise.
    Rows out of order, closing and not in one step, a group past a window. Traced, it is one op in the graph."""
    from mhcrun.ops.compress import compress_step

    assert isa.ops, "the kernel's torch ops were not built"
    r = 4 if overlap else 8
    starts = starts if overlap else [2 * p + 1 if p else 0 for p in starts]  # the same cases, groups of 8
    g, c = gen(31 + len(starts) + sum(starts)), 24
    start, rows = torch.tensor(starts), torch.tensor([2, 0][:len(starts)])
    state = torch.randn(3, 2 * r if overlap else r, c, generator=g), torch.randn(3, 2 * r if overlap else r, c,
                                                                                generator=g)
    kv, raw = torch.randn(len(starts), 1, c, generator=g), torch.randn(len(starts), 1, c, generator=g)
    ape = torch.randn(r, c, generator=g)
    want_state = tuple(t.clone() for t in state)
    want = compress_step(*want_state, rows, kv, raw + ape[start.view(-1, 1) % r], start, r, overlap)
    args = (rows, kv, raw, ape, start, r, overlap)
    kernel_state = tuple(t.clone() for t in state)
    mine = isa.compress_step(*kernel_state, *args)
    assert (mine is None) == (min(starts) == 0)
    for op in (torch.ops.mhcrun.compress_step_native, torch.ops.mhcrun.compress_step_cpu):
        got_state = tuple(t.clone() for t in state)
        got = op(*got_state, *args, isa.library, isa.isa)
        assert all(torch.equal(a, b) for a, b in zip(got_state, want_state, strict=True))
        assert torch.equal(got[1], want[1]) and got[0].shape == want[0].shape
        if mine is None:
            assert torch.equal(got[0], want[0])
        else:
            assert torch.equal(got[0], mine[0]) and torch.equal(got[1], mine[1])
            torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    if mine is not None:
        torch._dynamo.reset()
        targets = []

        def record(gm, example_inputs):
            targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
            return gm.forward

        traced_state = tuple(t.clone() for t in state)
        got = torch.compile(isa.compress_step, backend=record, fullgraph=True)(*traced_state, *args)
        assert "mhcrun.compress_step_native" in targets, targets
        assert torch.equal(got[0], mine[0])
        assert all(torch.equal(a, b) for a, b in zip(traced_state, want_state, strict=True))


def fp8_cache(n_rows: int, length: int, nope: int, rd: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A kv cache of the fp8 format [n_rows, length, ...] holding random entries, as kvcache.encode stores them."""
    from mhcrun.ops import kvcache

    fmt = kvcache.CacheFormat("fp8", nope + rd, rd, True)
    entries = kvcache.encode(fmt, torch.randn(n_rows, length, nope + rd, generator=g))
    return {p: t.contiguous() for p, t in entries.items()}


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("layer, starts", [
    ("window", [0]), ("window", [5, 40]), ("window", [15, 16]), ("window", [17, 3]),  # a new sequence; window edges
    ("csa", [9, 70]), ("csa", [33]),  # top-k entries, some invalid
    ("hca", [7]), ("hca", [31, 64]),  # every closed entry: none yet, and rows with different counts
])
@pytest.mark.parametrize("h", [5, 12])
def test_attend_decode_is_the_chunk_path(isa, layer, starts, h):
    """`CpuKernel.attend_decode` (a decode step's attention reading the caches where they lie) against the model's
    chunk path: the token's kv encoded into its ring slot bitwise (the other slots and rows untouched), and o within
    rounding of sparse_attn over the ring as it was plus the token's own kv (window_mask) and the compressor's entries
    (top-k by index with invalid slots, or every closed entry), on rows out of order at window-edge positions, a
    partial fp8 block (nope 100 of block 64), 5 heads (a partial head group) or 12 (a whole group and a partial one,
    each decoding the row's keys: on one thread the second reuses the first's, and o is bitwise two threads'). It
    declines a non-finite kv (writing nothing), a row twice, an entry outside the cache, other formats and the kernel
    off."""
    from mhcrun.ops import kvcache
    from mhcrun.ops.attention import closed_mask, window_mask

    kern = kernel_in(isa)
    g = gen(300 + sum(starts))
    win, nope, rd, n_rows, c_len = 16, 100, 32, 3, 20
    d, fmt = nope + rd, kvcache.CacheFormat("fp8", nope + rd, rd, True)
    b, start, rows = len(starts), torch.tensor(starts), torch.tensor([2, 0][:len(starts)])
    ring, comp = fp8_cache(n_rows, win, nope, rd, g), fp8_cache(n_rows, c_len, nope, rd, g)
    q, kv = torch.randn(b, 1, h, d, generator=g), torch.randn(b, 1, d, generator=g) * 3
    sink = torch.randn(h, generator=g)
    idx = valid = sel = sel_mask = None
    keys = [kvcache.decode(fmt, {p: t[rows] for p, t in ring.items()}, torch.float32),
            kvcache.simulate(fmt, kv)]
    masks = [window_mask(start, 1, win)]
    if layer == "csa":
        idx = torch.randint(0, c_len, (b, 1, 6), generator=g)
        valid = torch.rand(b, 1, 6, generator=g) < 0.7
        sel = kvcache.decode(fmt, {p: t[rows.view(-1, 1, 1), idx] for p, t in comp.items()}, torch.float32)
        sel_mask = valid
    if layer == "hca":
        n = int((start + 1).max()) // 8
        idx, valid = torch.arange(n).expand(b, 1, n), closed_mask(start, 1, n, 8)
        keys.append(kvcache.decode(fmt, {p: t[rows.view(-1, 1), torch.arange(n)] for p, t in comp.items()},
                                   torch.float32))
        masks.append(valid)
    want = sparse_attn(q, torch.cat(keys, 1), torch.cat(masks, -1), sink, 0.3, sel, sel_mask)
    want_ring = {p: t.clone() for p, t in ring.items()}
    kvcache.store(want_ring, (rows.view(-1, 1), (start % win).view(-1, 1)), kvcache.encode(fmt, kv))
    before = {p: t.clone() for p, t in ring.items()}
    c = None if layer == "window" else comp
    bad = kv.clone()
    bad[-1, 0, 7] = float("inf")
    assert kern.attend_decode(q, bad, ring, rows, start, c, idx, valid, sink, 0.3, 64) is None
    assert all(torch.equal(ring[p].view(torch.uint8), before[p].view(torch.uint8)) for p in ring)  # nothing written
    got = kern.attend_decode(q, kv, ring, rows, start, c, idx, valid, sink, 0.3, 64)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(ring[p].view(torch.uint8), want_ring[p].view(torch.uint8)) for p in ring)
    # another token's kv on one thread and on the default threads, each into a copy of the cache as it was: bitwise
    # the same (keys a thread decoded for an earlier call are not taken for this one's)
    kv2, outs, threads = torch.randn(b, 1, d, generator=g), [], torch.get_num_threads()
    for n_threads in (1, threads):
        try:
            torch.set_num_threads(n_threads)
            cache = {p: t.clone() for p, t in before.items()}
            outs.append(kern.attend_decode(q, kv2, cache, rows, start, c, idx, valid, sink, 0.3, 64))
        finally:
            torch.set_num_threads(threads)
    assert outs[0] is not None and torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], got)
    assert kern.attend_decode(q[:1].expand(2, 1, h, d), kv[:1].expand(2, 1, d), ring, torch.tensor([1, 1]),
                              start[:1].expand(2), None, None, None, sink, 0.3, 64) is None  # a row twice
    if idx is not None and idx.numel():
        assert kern.attend_decode(q, kv, ring, rows, start, c, idx + c_len, valid, sink, 0.3, 64) is None
    plain = {"values": torch.zeros(n_rows, win, d)}
    assert kern.attend_decode(q, kv, plain, rows, start, None, None, None, sink, 0.3, 64) is None
    assert cpu_kernel("0").attend_decode(q, kv, ring, rows, start, c, idx, valid, sink, 0.3, 64) is None


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("t, d, hashed", [(1, 2048, False), (3, 100, False), (2, 64, True)])
def test_route_is_gate_scores_and_route(isa, score_func, t, d, hashed):
    """`CpuKernel.route` (the gate's scores and routing in one call) against moe.gate_scores + moe.route: the same
    experts in the same order and the weights within rounding, by score with a bias or by hash ids, one or several
    rows, widths off the vectors, logits past softplus's threshold of 20; two equal experts (an exact tie inside the
    top-k) come lower first. It declines NaN scores, other dtypes, more rows than decode's, a hash id outside the
    experts, and the kernel off."""
    from mhcrun.ops.moe import gate_scores, route

    kern, g, e, k = kernel_in(isa), gen(500 + t + d), 64, 6
    x, weight = torch.randn(t, d, generator=g), torch.randn(e, d, generator=g) * (3 / d ** 0.5)
    weight[9] = weight[5]  # experts 5 and 9 score the same
    x[0] = weight[5] * (40 / weight[5].square().sum())  # row 0's logit of 5 and 9: 40, past the threshold
    bias = None if hashed else torch.randn(e, generator=g) * 0.1
    if bias is not None:
        bias[9] = bias[5]
    ids = torch.randint(0, e, (t, k), generator=g) if hashed else None
    got = kern.route(x, weight, bias, ids, k, 1.5, score_func)
    scores = gate_scores(x, weight, score_func)
    want = route(scores, k, 1.5, score_func, bias=bias, hash_ids=ids)
    if not hashed:  # torch.topk leaves the order of exact ties open: the lower expert first, as the kernel puts them
        biased = (scores + bias).tolist()
        order = [sorted(range(k), key=lambda m, r=r: (-biased[r][want[1][r, m]], want[1][r, m].item()))
                 for r in range(t)]
        want = tuple(v.gather(1, torch.tensor(order)) for v in want)
    assert got is not None and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=1e-7)
    if not hashed:
        assert {5, 9} <= set(got[1][0].tolist()) and got[1][0].tolist().index(5) < got[1][0].tolist().index(9)
        nan = x.clone()
        nan[-1, 3] = float("nan")
        assert kern.route(nan, weight, bias, ids, k, 1.5, score_func) is None
    else:
        assert kern.route(x, weight, bias, ids + e, k, 1.5, score_func) is None
    assert kern.route(x.double(), weight, bias, ids, k, 1.5, score_func) is None
    assert kern.route(x.expand(qgemv.MAX_ROWS + 1, d) if t == 1 else x[:0], weight, bias, None, k, 1.5,
                      score_func) is None
    assert cpu_kernel("0").route(x, weight, bias, ids, k, 1.5, score_func) is None


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hc_post_of_a_prefill_is_the_reference(isa, dtype):
    """A prefill chunk's post step (130 rows of 2,048: split over the threads) is mhcrun.ops.hc.hc_post bitwise, on
    one thread and on two."""
    from mhcrun.ops import hc as ref

    k, c = kernel_in(isa), hc_case(130, 2048, dtype)
    want = ref.hc_post(c["y"], c["x"], c["post"], c["comb"])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = k.hc_post(c["y"], c["x"], c["post"], c["comb"])
            assert got.dtype == dtype and torch.equal(got, want), threads
    finally:
        torch.set_num_threads(before)


def test_hc_steps_decline_what_they_do_not_take_and_keep_nan():
    """The pre step above MAX_ROWS rows, other dtypes, mixed dtypes and the kernel off: None (the caller takes
    torch). A NaN in a stream comes out NaN where the reference puts it."""
    from mhcrun.ops import hc as ref

    k = cpu_kernel()
    if not k.on:
        pytest.skip(k.status())
    c = hc_case(qgemv.MAX_ROWS + 1, 64, torch.float32)
    assert k.hc_pre(c["x"], c["fn"], c["scale"], c["base"], c["w"], 20, 1e-6, 1e-6) is None
    c = hc_case(2, 64, torch.float16)
    assert k.hc_post(c["y"], c["x"], c["post"], c["comb"]) is None
    c = hc_case(2, 64, torch.float32)
    assert k.hc_post(c["y"].bfloat16(), c["x"], c["post"], c["comb"]) is None
    assert cpu_kernel("0").hc_post(c["y"], c["x"], c["post"], c["comb"]) is None
    c["x"][1, 0, 2, 5] = float("nan")
    got, want = k.hc_post(c["y"], c["x"], c["post"], c["comb"]), ref.hc_post(c["y"], c["x"], c["post"], c["comb"])
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


# ---------------------------------------------------------------- attention of decode rows


def attn_case(b: int, s: int, h: int, n: int, k: int, d: int, seed: int = 0) -> tuple:
    """sparse_attn's arguments: queries, window/compressed keys with a mask (each query sees its first key), gathered
    keys with a validity mask (k = 0: none), a sink per head."""
    g = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(b, s, h, d, generator=g), torch.randn(b, n, d, generator=g)
    mask = torch.rand(b, s, n, generator=g) > 0.3
    mask[..., 0] = True
    sel = torch.randn(b, s, k, d, generator=g) if k else None
    sel_mask = torch.rand(b, s, k, generator=g) > 0.3 if k else None
    return q, kv, mask, torch.randn(h, generator=g), d ** -0.5, sel, sel_mask


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("b, s, h, n, k, d", [(1, 1, 16, 162, 64, 512), (2, 1, 16, 129, 0, 512), (2, 3, 3, 7, 0, 72),
                                              (2, 1, 13, 9, 4, 13), (1, 2, 9, 1, 0, 8), (1, 1, 1, 1, 1, 1),
                                              (1, 1, 5, 4, 3, 40)])
def test_attend_against_sparse_attn(isa, b, s, h, n, k, d):
    """The C++ attention of decode rows (`CpuKernel.attend`) is within rounding of the reference sparse_attn, in
    AVX-512 and AVX2: the decode shapes of CSA (window + compressed + gathered) and of the window alone, batch > 1,
    several queries a row, heads not a multiple of the eight taken together, dims not a multiple of the lanes (8, 16,
    and 32 channels at a time: partial halves), an odd number of keys (two at a time), a single key. A row whose
    gathered keys are all invalid, and gathered keys that hold the largest scores, included."""
    k_ = kernel_in(isa)
    args = list(attn_case(b, s, h, n, k, d))
    if k:
        args[6][0, 0] = False  # no gathered key valid
        args[5][-1, -1] *= 4.0  # the largest scores among the gathered ones
    got, want = k_.attend(*args), sparse_attn(*args)
    assert got is not None and got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_attend_declines_what_it_does_not_take_and_keeps_nan(isa):
    """bf16 tensors, more than MAX_ROWS queries a row, shapes other than the ones it reads (a broadcast mask, gathered
    keys without their mask) and the kernel off: None (the caller takes sparse_attn). NaN
    comes out where the reference puts it: a NaN in a key nobody sees (its channel: 0 * NaN), a query with no valid key
    (all of it)."""
    k = kernel_in(isa)
    q, kv, mask, sink, scale, sel, sm = attn_case(2, 1, 4, 6, 3, 16)
    assert k.attend(q.bfloat16(), kv.bfloat16(), mask, sink, scale, sel.bfloat16(), sm) is None
    assert k.attend(q, kv, mask, sink, scale, sel.bfloat16(), sm) is None
    big = attn_case(1, qgemv.MAX_ROWS + 1, 2, 4, 0, 8)
    assert k.attend(*big) is None
    assert k.attend(q, kv, mask[:1], sink, scale, sel, sm) is None  # a mask torch would broadcast: not read as is
    assert k.attend(q, kv, mask, sink, scale, sel, None) is None
    assert cpu_kernel("0").attend(q, kv, mask, sink, scale, sel, sm) is None
    mask[1, 0, 5] = False
    kv[1, 5, 3] = float("nan")  # masked: its probability is 0, and 0 * NaN is NaN
    mask[0, 0] = False
    sm[0, 0] = False  # query 0 sees no key
    got, want = k.attend(q, kv, mask, sink, scale, sel, sm), sparse_attn(q, kv, mask, sink, scale, sel, sm)
    assert want[0].isnan().all() and want[1, ..., 3].isnan().all() and want.isnan().sum() == 4 * 16 + 4
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- RoPE of decode rows


@pytest.mark.parametrize("x_shape, c_shape", [((1, 1, 16, 512), (1, 1, 1, 32)), ((2, 1, 512), (2, 1, 32)),
                                              ((3, 128), (3, 32)), ((2, 2, 4, 72), (2, 2, 1, 16)),
                                              ((1, 1, 3, 2), (1, 1, 1, 1)), ((1, 40, 16, 512), (1, 40, 1, 32))])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail_equals_the_reference_bitwise(x_shape, c_shape, inverse):
    """`CpuKernel.rope_tail` equals apply_rope_tail bit for bit (queries with a shared head dim, kv rows, compressed
    entries, batch > 1, odd head counts, the whole vector rotated, a prefill's queries split over the threads: on one
    thread and on two), forwards and inverse, NaN and infinities where the reference puts them."""
    k = cpu_kernel()
    if not k.on:
        pytest.skip(k.status())
    g = torch.Generator().manual_seed(7)
    x = torch.randn(x_shape, generator=g) * 100
    cos, sin = torch.randn(c_shape, generator=g), torch.randn(c_shape, generator=g)
    x.view(-1)[-1], x.view(-1)[-4] = float("nan"), float("inf")
    want = apply_rope_tail(x, cos, sin, 2 * c_shape[-1], inverse)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = k.rope_tail(x, cos, sin, 2 * c_shape[-1], inverse)
            assert got is not None and torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), threads
    finally:
        torch.set_num_threads(before)


def test_rope_tail_declines_what_it_does_not_take():
    """bf16, tables that do not broadcast as a shared head dim, the kernel off: None."""
    k = cpu_kernel()
    if not k.on:
        pytest.skip(k.status())
    x, c = torch.randn(2, 1, 4, 64), torch.randn(2, 1, 1, 16)
    assert k.rope_tail(x.bfloat16(), c, c, 32) is None
    assert k.rope_tail(x, c[:, :, :, :8], c[:, :, :, :8], 32) is None  # tables for another rope_dim
    assert k.rope_tail(x, c.squeeze(2), c.squeeze(2), 32) is None  # not x's rank: torch would broadcast otherwise
    assert k.rope_tail(x, torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16), 32) is None  # a table per head
    assert cpu_kernel("0").rope_tail(x, c, c, 32) is None


# ---------------------------------------------------------------- Hadamard rotation of indexer queries and keys


@pytest.mark.parametrize("shape", [(1, 1, 16, 128), (2, 1, 3, 128), (5, 1), (3, 2), (1, 8), (700, 256),
                                   (1, 40, 16, 128)])
def test_hadamard_is_the_reference_bitwise(shape):
    """`CpuKernel.hadamard` equals quant.hadamard bit for bit (the butterflies in the reference's order, the product by
    n**-0.5 as torch rounds it): decode's queries, a key, widths 1 .. 256, a prefill's queries split over the threads
    (on one thread and on two), values from 2**-140 (subnormal sums) to 2**120 (sums that overflow to infinity), NaN
    where the reference puts it."""
    from mhcrun.ops.quant import hadamard

    k = cpu_kernel()
    if not k.on:
        pytest.skip(k.status())
    g = torch.Generator().manual_seed(17)
    before = torch.get_num_threads()
    try:
        for trial in range(6):
            x = torch.randn(shape, generator=g) * 2.0 ** torch.randint(-140, 121, (*shape[:-1], 1), generator=g).float()
            if trial == 5:
                x.view(-1)[-1] = float("nan")
            want = hadamard(x)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                got = k.hadamard(x)
                assert got is not None and torch.equal(got.isnan(), want.isnan())
                assert torch.equal(got.nan_to_num().view(torch.int32), want.nan_to_num().view(torch.int32)), threads
    finally:
        torch.set_num_threads(before)


def test_hadamard_declines_what_it_does_not_take():
    """A last dim that is not a power of two, bf16, an empty x, the kernel off: None."""
    k = cpu_kernel()
    if not k.on:
        pytest.skip(k.status())
    x = torch.randn(2, 128)
    assert k.hadamard(torch.randn(2, 12)) is None and k.hadamard(x.bfloat16()) is None
    assert k.hadamard(torch.randn(0, 128)) is None and cpu_kernel("0").hadamard(x) is None


def test_store_entries_declines_what_it_does_not_take():
    """`CpuKernel.store_entries` (a compressor's closed groups finished and stored in one call; its values against the
    module's calls: tests/test_quantized.py) writes nothing and says so for a cache row, an entry slot or a position
    outside the buffers, a plain cache, parts of another width, and with the kernel off."""
    from mhcrun.ops import kvcache

    k = cpu_kernel()
    if not k.on:
        pytest.skip(k.status())
    fmt = kvcache.CacheFormat("fp8", 128, 64)
    parts = kvcache.make_parts(fmt, (2, 5), torch.float32, "cpu")
    normed, cos, sin = torch.randn(1, 128), torch.rand(16, 32), torch.rand(16, 32)
    one = torch.tensor([1])

    def store(at=one, slot=one, first=one, kind="fp8", parts=parts, kernel=k):
        return kernel.store_entries(normed, at, slot, first, cos, sin, 64, False, kind, 64, parts)

    before = {n: p.clone() for n, p in parts.items()}
    for bad in (dict(at=torch.tensor([2])), dict(slot=torch.tensor([5])), dict(first=torch.tensor([16])),
                dict(at=torch.tensor([-1])), dict(kind="plain"), dict(kernel=cpu_kernel("0")),
                dict(parts={**parts, "rope": torch.zeros(2, 5, 32)})):
        assert not store(**bad), bad
    assert all(torch.equal(p.view(torch.uint8), before[n].view(torch.uint8)) for n, p in parts.items())
    assert store() and not torch.equal(parts["scale"], before["scale"])  # the same call in range writes its entry


# ---------------------------------------------------------------- fp8 kv cache entries


@pytest.mark.parametrize("lead, nope, rd", [((1, 128), 448, 64), ((2, 1), 448, 64), ((3, 5), 100, 6), ((1,), 64, 0)])
def test_kv_fp8_decodes_entries_bitwise(lead, nope, rd):
    """`CpuKernel.kv_fp8` equals kvcache.decode of the fp8 format bit for bit: every code (NaN codes included, with
    scales from 2**-60 to 2**60), a window of entries (threads) and single ones, a last block that is partial, no
    rope channels."""
    from mhcrun.ops import kvcache
    from mhcrun.ops.quant import KV_FP8_BLOCK

    k = cpu_kernel()
    if not k.on:
        pytest.skip(k.status())
    g = torch.Generator().manual_seed(11)
    fmt = kvcache.CacheFormat("fp8", nope + rd, rd)
    codes = torch.randint(0, 256, (*lead, nope), generator=g, dtype=torch.uint8)
    codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)[: codes.numel()]
    blocks = -(-nope // KV_FP8_BLOCK)
    scale = 2.0 ** torch.randint(-60, 61, (*lead, blocks), generator=g).float()
    parts = {"fp8": codes.view(torch.float8_e4m3fn), "scale": scale, "rope": torch.randn(*lead, rd, generator=g)}
    got, want = k.kv_fp8(parts["fp8"], scale, parts["rope"], KV_FP8_BLOCK), kvcache.decode(fmt, parts,
                                                                                           torch.float32)
    assert got is not None and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num().view(torch.int32), want.nan_to_num().view(torch.int32))


def test_kv_fp8_declines_what_it_does_not_take():
    """bf16 rope channels or scales, scales for another block, other code dtypes, the kernel off: None."""
    k = cpu_kernel()
    if not k.on:
        pytest.skip(k.status())
    codes = torch.zeros(2, 128, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale, rope = torch.ones(2, 2), torch.zeros(2, 64)
    assert k.kv_fp8(codes, scale, rope, 64) is not None
    assert k.kv_fp8(codes, scale, rope.bfloat16(), 64) is None
    assert k.kv_fp8(codes, scale.bfloat16(), rope, 64) is None
    assert k.kv_fp8(codes, scale, rope, 32) is None
    assert k.kv_fp8(codes.view(torch.uint8), scale, rope, 64) is None
    assert cpu_kernel("0").kv_fp8(codes, scale, rope, 64) is None


def test_kv_fp8_encode_is_the_reference_bitwise():
    """`CpuKernel.kv_fp8_encode` gives kvcache.encode's codes, scales and rope channels bit for bit: every e4m3
    value of both signs, the midpoints between neighbours (ties to even) and values just off them, -0.0, blocks
    below the amax floor, subnormal results, random rows at scales 2**-40 .. 2**40; non-finite x and other
    formats are declined."""
    from mhcrun.ops import kvcache

    k = cpu_kernel()
    if not k.on:
        pytest.skip(k.status())
    fmt = kvcache.kv_format(512, 64, True, True)
    values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (values[:-1] + values[1:]) / 2
    probe = torch.cat([values, -values, mids, -mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(
        torch.tensor(1e9)), torch.tensor([-0.0])])
    blocks = probe.split(63)
    x = torch.cat([torch.cat([torch.tensor([448.0]), b, torch.zeros(63 - b.numel())]) for b in blocks])  # scale 1
    x = torch.cat([x, torch.zeros(-x.numel() % 448)]).view(-1, 448)
    x = torch.cat([x, torch.randn(x.shape[0], 64)], dim=-1)  # [rows, 512]: every block scaled by 448 -> 1
    g = torch.Generator().manual_seed(5)
    rnd = torch.randn(6, 512, generator=g) * 2.0 ** torch.randint(-40, 41, (6, 1), generator=g).float()
    rnd[0, :64] *= 1e-30  # below the amax floor: subnormal codes
    rnd[1, :448] = 0.0
    for xs in (x, rnd.view(2, 3, 512), rnd[:1]):
        got, want = k.kv_fp8_encode(xs, 64, 64), kvcache.encode(fmt, xs)
        assert got is not None and got.keys() == want.keys()
        assert torch.equal(got["fp8"].view(torch.uint8), want["fp8"].view(torch.uint8))
        assert torch.equal(got["scale"], want["scale"]) and torch.equal(got["rope"], want["rope"])
    bad = rnd.clone()
    bad[2, 3] = float("inf")
    assert k.kv_fp8_encode(bad, 64, 64) is None
    assert k.kv_fp8_encode(rnd.bfloat16(), 64, 64) is None
    assert cpu_kernel("0").kv_fp8_encode(rnd, 64, 64) is None


# ---------------------------------------------------------------- FP4 rounding of indexer queries


@pytest.mark.parametrize("shape", [(1, 1, 16, 128), (2, 1, 3, 100), (1, 5), (1, 40, 16, 128)])
def test_fp4_simulate_is_the_reference_bitwise(shape):
    """`CpuKernel.fp4_simulate` equals quant.fp4_simulate bit for bit, and `CpuKernel.kv_fp4_encode` kvcache.encode of
    the fp4 format (codes and scales): the e2m1 grid, its midpoints (ties to the even mantissa) and their neighbours,
    both signs and -0.0, blocks at scales 2**-130 .. 2**125 (subnormal inputs, the amax floor, the largest scales), a
    partial last block, a prefill's queries (split over the threads); an odd width, or more than decode's entries, is
    declined by the encoder."""
    from mhcrun.ops import kvcache
    from mhcrun.ops.quant import fp4_simulate

    k = cpu_kernel()
    if not k.on:
        pytest.skip(k.status())
    g = torch.Generator().manual_seed(13)
    grid = torch.tensor([0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6])
    for trial in range(40):
        x = torch.randn(shape, generator=g)
        x *= 2.0 ** torch.randint(-130, 126, (*shape[:-1], 1), generator=g).float()
        flat = x.view(-1)
        if trial % 2 == 0 and flat.numel() >= 64:
            flat[:15], flat[15:30], flat[31] = grid, -grid, 6.0
            flat[32:47], flat[47] = grid.nextafter(torch.tensor(10.0)), 6.0
        flat[min(3, flat.numel() - 1)] = -0.0
        got, want = k.fp4_simulate(x, 32), fp4_simulate(x, 32)
        assert got is not None and torch.equal(got.view(torch.int32), want.view(torch.int32))
        if math.prod(shape[:-1]) > qgemv.MAX_ROWS * 16:  # the encoder takes decode's few entries
            assert k.kv_fp4_encode(x, 32) is None
            continue
        enc = k.kv_fp4_encode(x, 32)  # the same rounding as the indexer keys' cache entries
        if shape[-1] % 2:
            assert enc is None  # two codes a byte
            continue
        ref = kvcache.encode(kvcache.CacheFormat("fp4", shape[-1]), x)
        assert enc is not None and torch.equal(enc["fp4"], ref["fp4"]) and torch.equal(enc["scale"], ref["scale"])


def test_fp4_simulate_declines_what_it_does_not_take():
    """Non-finite x (torch's own rules apply there), bf16, the kernel off: None."""
    k = cpu_kernel()
    if not k.on:
        pytest.skip(k.status())
    x = torch.randn(1, 1, 16, 128)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[0, 0, 2, 7] = bad
        assert k.fp4_simulate(y, 32) is None and k.kv_fp4_encode(y, 32) is None
    assert k.kv_fp4_encode(x.bfloat16(), 32) is None and cpu_kernel("0").kv_fp4_encode(x, 32) is None
    assert k.fp4_simulate(x.bfloat16(), 32) is None
    assert cpu_kernel("0").fp4_simulate(x, 32) is None


@pytest.mark.parametrize("lead, k", [((1, 40), 128), ((2, 3), 100), ((1,), 32)])
def test_kv_fp4_decodes_entries_bitwise(lead, k):
    """`CpuKernel.kv_fp4` equals kvcache.decode of the fp4 format (indexer keys) bit for bit: every byte, scales
    from 2**-126 to 2**60, a partial last block; other dtypes and the kernel off are declined."""
    from mhcrun.ops import kvcache

    kern = cpu_kernel()
    if not kern.on:
        pytest.skip(kern.status())
    g = torch.Generator().manual_seed(17)
    packed = torch.randint(0, 256, (*lead, k // 2), generator=g, dtype=torch.uint8)
    packed.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)[: packed.numel()]
    scale = 2.0 ** torch.randint(-126, 61, (*lead, -(-k // 32)), generator=g).float()
    got = kern.kv_fp4(packed, scale, 32)
    want = kvcache.decode(kvcache.CacheFormat("fp4", k), {"fp4": packed, "scale": scale}, torch.float32)
    assert got is not None and torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert kern.kv_fp4(packed.view(torch.int8), scale, 32) is None
    assert kern.kv_fp4(packed, scale.bfloat16(), 32) is None
    assert kern.kv_fp4(packed, scale, 8) is None  # scales for another block
    assert cpu_kernel("0").kv_fp4(packed, scale, 32) is None


def index_case(b: int, s: int, h: int, d: int, n_rows: int, length: int, exact: bool, seed: int):
    """q [b, s, h, d], w [b, s, h] and an fp4 index-key cache (packed, scale) [n_rows, length, ...]. `exact`: values
    whose every product and sum is exact in fp32 in any order (small integers, power-of-two scales and weights),
    every other key zero (scores exactly 0) and keys repeated (equal scores): ties."""
    g = gen(seed)
    packed = torch.randint(0, 256, (n_rows, length, d // 2), generator=g, dtype=torch.uint8)
    if exact:
        packed[:, ::2] = 0  # every other key is zero: its score is exactly 0
        twins = len(range(3, length, 4))
        packed[:, 3::4] = packed[:, 1::4][:, :twins]  # and keys repeated: equal scores
        q = torch.randint(-6, 3, (b, s, h, d), generator=g).float()
        scale = 2.0 ** torch.randint(-3, 3, (n_rows, length, -(-d // 32)), generator=g).float()
        scale[:, 3::4] = scale[:, 1::4][:, :twins]
        sign = (torch.rand(b, s, h, generator=g) - 0.2).sign()
        w = 2.0 ** torch.randint(-2, 2, (b, s, h), generator=g).float() * sign
    else:
        q = torch.randn(b, s, h, d, generator=g)
        scale = 2.0 ** torch.randint(-20, 20, (n_rows, length, -(-d // 32)), generator=g).float()
        w = torch.randn(b, s, h, generator=g)
    return q, w, packed, scale


def reference_index_topk(q, w, packed, scale, rows, closed, n, topk):
    """mhcrun.ops.index on the decoded keys: (entries, valid) and the scores [b, s, n]."""
    from mhcrun.ops import kvcache

    keys = kvcache.decode(kvcache.CacheFormat("fp4", q.shape[-1]), {"fp4": packed[rows, :n], "scale": scale[rows, :n]},
                          torch.float32)
    scores = index_scores(q, keys, w)
    return (*select_topk(scores, torch.arange(n) < closed.unsqueeze(-1), topk), scores)


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("b, s, h, d, n, topk, closed", [
    (1, 1, 16, 128, 37, 64, [[37]]),  # fewer entries than top-k: every one chosen
    (1, 1, 16, 128, 200, 64, [[200]]),  # decode's shape past 800 tokens
    (2, 1, 4, 64, 50, 16, [[50], [23]]),  # rows at different positions: the shorter one's tail invalid
    (1, 3, 3, 96, 20, 8, [[18, 19, 20]]),  # a verify chunk of three queries; a partial fp4 block (96 = 3 x 32)
    (2, 2, 2, 32, 9, 12, [[0, 1], [8, 9]]),  # a query that sees no entry: every slot invalid
])
def test_index_topk_is_select_topk_of_the_scores(isa, b, s, h, d, n, topk, closed):
    """`CpuKernel.index_topk` (the indexer's scores and top-k in one call) against index_scores + select_topk on the
    decoded cache: with exact values (every sum exact in any order; most scores tie at 0) the same entries in the same
    order, bit for bit, the tie rule (lower entry first) deciding the ties (a higher-entry-first rule would give other
    entries: the check refuses it); with random values the chosen entries' reference scores are the reference's top
    scores within rounding, and the validity the same."""
    kern = kernel_in(isa)
    rows, closed = torch.tensor([2, 0][:b]), torch.tensor(closed)
    for exact in (True, False):
        q, w, packed, scale = index_case(b, s, h, d, 3, n + 5, exact, seed=31 * n + s)
        got = kern.index_topk(q, w, packed, scale, rows, closed, n, topk, 32)
        assert got is not None
        ent, val, scores = reference_index_topk(q, w, packed, scale, rows, closed, n, topk)
        assert torch.equal(got[1], val)
        if exact:
            assert torch.equal(got[0], ent)
            seen = torch.arange(n) < closed.unsqueeze(-1)
            if seen.sum() > topk:  # ties are there to decide at the top-k's edge: the other rule is refused
                back, back_valid = select_topk(scores.flip(-1), seen.flip(-1), topk)  # higher entries first
                assert not torch.equal(torch.where(back_valid, n - 1 - back, 0), got[0])
        else:
            chosen = torch.where(val, scores.gather(-1, got[0]), 0.0)
            best = torch.where(val, scores.gather(-1, ent), 0.0)
            torch.testing.assert_close(chosen, best, rtol=1e-5, atol=1e-5)


def test_index_topk_declines_what_it_does_not_take():
    """NaN scores (the reference's keys order NaN), rows or entries outside the cache, other dtypes, more queries
    than decode's and the kernel off: None, the caller taking the reference."""
    kern = cpu_kernel()
    if not kern.on:
        pytest.skip(kern.status())
    q, w, packed, scale = index_case(1, 1, 4, 64, 2, 10, False, seed=5)
    rows, closed = torch.tensor([1]), torch.tensor([[10]])
    assert kern.index_topk(q, w, packed, scale, rows, closed, 10, 4, 32) is not None
    nan = q.clone()
    nan[0, 0, 1, 3] = float("nan")
    assert kern.index_topk(nan, w, packed, scale, rows, closed, 10, 4, 32) is None
    assert kern.index_topk(q, w, packed, scale, torch.tensor([2]), closed, 10, 4, 32) is None  # row 2 of 2
    assert kern.index_topk(q, w, packed, scale, rows, closed, 11, 4, 32) is None  # 11 entries of 10
    assert kern.index_topk(q.bfloat16(), w, packed, scale, rows, closed, 10, 4, 32) is None
    assert kern.index_topk(q, w, packed, scale[..., :1], rows, closed, 10, 4, 32) is None
    many = q.expand(1, qgemv.MAX_ROWS + 1, 4, 64)
    assert kern.index_topk(many, w.expand(1, qgemv.MAX_ROWS + 1, 4), packed, scale, rows,
                           closed.expand(1, qgemv.MAX_ROWS + 1), 10, 4, 32) is None
    assert cpu_kernel("0").index_topk(q, w, packed, scale, rows, closed, 10, 4, 32) is None


def test_window_mask_is_the_reference():
    """`CpuKernel.window_mask` equals attention.window_mask: sequences starting, inside the first window, on and
    around window edges, rows at different positions, chunks of several tokens, a window of one; more rows than
    decode's and other dtypes are declined."""
    from mhcrun.ops.attention import window_mask

    k = cpu_kernel()
    if not k.on:
        pytest.skip(k.status())
    for start in ([0], [1], [5], [127], [128], [129], [300], [0, 5, 37], [255, 256]):
        for s in (1, 2, 3):
            for w in (1, 4, 128):
                got = k.window_mask(torch.tensor(start), s, w)
                assert got is not None and torch.equal(got, window_mask(torch.tensor(start), s, w)), (start, s, w)
    assert k.window_mask(torch.zeros(qgemv.MAX_ROWS + 1, dtype=torch.int64), 1, 8) is None
    assert k.window_mask(torch.tensor([3], dtype=torch.int32), 1, 8) is None
    assert cpu_kernel("0").window_mask(torch.tensor([3]), 1, 8) is None


@needs_kernel
@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_greedy_pick_is_nonfinite_rows_and_argmax(isa):
    """Greedy decoding's pick in one call (`CpuKernel.greedy`: AVX-512 sixteen values a step, else one by one) gives
    `nonfinite_rows` and torch's argmax: rows of 1 to 32,768 values (whole vectors and a partial last one), the largest
    value anywhere (first, last, in a partial vector), exact ties (the first wins), -0.0 tied with 0.0, and rows
    holding NaN, +Inf, -Inf or both NaN and Inf beside finite rows."""
    from mhcrun.generate import nonfinite_rows

    kernel, g = kernel_in(isa), gen(3400)
    for v in (1, 5, 16, 17, 1000, 32768):
        x = torch.randn(6, v, generator=g)
        x[1, -1] = x[1].max() + 1  # the last value, in a partial vector where v % 16
        x[2, 0] = x[2].max() + 1
        if v > 3:
            x[3, 1] = x[3, v - 2] = x[3].max() + 2  # a tie: the first
        x[4] = 0.0
        x[4, v // 2:] = -0.0
        bad, ids = kernel.greedy(x)
        assert bad == [] and torch.equal(ids, x.argmax(-1)), v
    x = torch.randn(6, 100, generator=g)
    x[1, 7], x[2, 3], x[3, 99], x[4, 2], x[4, 3] = math.nan, math.inf, -math.inf, math.inf, math.nan
    bad, ids = kernel.greedy(x)
    assert bad == nonfinite_rows(x) == [(1, "NaN"), (2, "Inf"), (3, "Inf"), (4, "NaN")]
    assert ids[0] == x[0].argmax() and ids[5] == x[5].argmax()
    assert cpu_kernel("0").greedy(x) is None and kernel.greedy(x.double()) is None and kernel.greedy(x[0]) is None
