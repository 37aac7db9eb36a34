"""mhcrun.nki.ops: the custom ops, the backend choice (torch / nki-sim / nki) and the execution counts.

Tolerances of the simulator path against the torch reference (see tests/test_nki_kernels.py for the per-kernel
sweeps): pre / post / comb 2e-5 absolute (the bf16 hi/lo split of fn), collapsed / post-mixed / normed
activations 1e-5 relative in fp32, swiglu 1e-5 relative.
"""

from __future__ import annotations

import sys

import pytest
import torch

from mhcrun.ops import hc as ref
from mhcrun.ops.moe import swiglu as ref_swiglu
from mhcrun.ops.norm import rms_norm as ref_rms_norm

pytest.importorskip("mhcrun.nki.sim", reason="mhcrun's NKI simulator (mhcrun/nki/sim) is not present")

from mhcrun.nki import ops  # noqa: E402

N = 4
B, S, D = 2, 3, 128
EPS, NORM_EPS, ITERS = 1e-6, 1e-6, 20
HC_OPS = ("hc_expand", "hc_mixes", "hc_collapse", "hc_post", "hc_head")
BLOCK = (*HC_OPS, "rmsnorm", "swiglu")  # the kernels of the compiled block below


@pytest.fixture(name="sim")
def sim_backend():
    """A run's hc backend with the simulator on (MHCRUN_NKI_SIM=1)."""
    return ops.HcBackend(sim="exact")


@pytest.fixture
def case():
    """Inputs of one V4 block's mHC sites plus the head, on the tiny model's sizes (fp32 activations)."""
    g = torch.Generator().manual_seed(0)
    c = {
        "e": torch.randn(B, S, D, generator=g),
        "x": torch.randn(B, S, N, D, generator=g),
        "y": torch.randn(B, S, D, generator=g),
        "fn": torch.randn((2 + N) * N, N * D, generator=g) * (N * D) ** -0.5,
        "scale": torch.rand(3, generator=g) + 0.5,
        "base": torch.randn((2 + N) * N, generator=g) * 0.5,
        "head_fn": torch.randn(N, N * D, generator=g) * (N * D) ** -0.5,
        "head_scale": torch.rand(1, generator=g) + 0.5,
        "head_base": torch.randn(N, generator=g) * 0.5,
        "w": torch.randn(D, generator=g),
        "gate": torch.randn(B, S, 64, generator=g) * 8,
        "up": torch.randn(B, S, 64, generator=g) * 8,
    }
    c["hi"], c["lo"] = ops.split_hi_lo(c["fn"])
    c["head_hi"], c["head_lo"] = ops.split_hi_lo(c["head_fn"])
    return c


def run_all(c, hc: ops.HcBackend):
    """Every public op once, in a block's order, on `hc`; returns the outputs by op name."""
    t = hc
    pre, post, comb = ops.hc_mixes(c["x"], c["fn"], c["hi"], c["lo"], c["scale"], c["base"], N, ITERS, EPS, NORM_EPS,
                                   t)
    return {
        "hc_expand": ops.hc_expand(c["e"], N, t),
        "hc_mixes": (pre, post, comb),
        "hc_collapse": ops.hc_collapse(c["x"], pre, t),
        "hc_post": ops.hc_post(c["y"], c["x"], post, comb, t),
        "hc_head": ops.hc_head(c["x"], c["head_fn"], c["head_hi"], c["head_lo"], c["head_scale"], c["head_base"],
                               EPS, NORM_EPS, t),  # fmt: skip
        "rmsnorm": ops.rms_norm(c["y"], c["w"], NORM_EPS, t),
        "swiglu": ops.swiglu(c["gate"], c["up"], 10.0, t),
        "hc_pre": ops.hc_pre(c["x"], c["fn"], c["hi"], c["lo"], c["scale"], c["base"], c["w"], N, ITERS, EPS,
                             NORM_EPS, t),
        "hc_post_pre": ops.hc_post_pre(c["y"], c["x"], post, comb, c["fn"], c["hi"], c["lo"], c["scale"], c["base"],
                                       c["w"], N, ITERS, EPS, NORM_EPS, t),
    }


def reference_all(c):
    pre, post, comb = ref.hc_mixes(c["x"], c["fn"], c["scale"], c["base"], N, ITERS, EPS, NORM_EPS)
    return {
        "hc_expand": ref.hc_expand(c["e"], N),
        "hc_mixes": (pre, post, comb),
        "hc_collapse": ref.hc_collapse(c["x"], pre),
        "hc_post": ref.hc_post(c["y"], c["x"], post, comb),
        "hc_head": ref.hc_head(c["x"], c["head_fn"], c["head_scale"], c["head_base"], EPS, NORM_EPS),
        "rmsnorm": ref_rms_norm(c["y"], c["w"], NORM_EPS),
        "swiglu": ref_swiglu(c["gate"], c["up"], 10.0),
        "hc_pre": (ref_rms_norm(ref.hc_collapse(c["x"], pre), c["w"], NORM_EPS), post, comb),
        "hc_post_pre": _ref_post_pre(c, post, comb),
    }


def _ref_post_pre(c, post, comb):
    x_new = ref.hc_post(c["y"], c["x"], post, comb)
    p2, post2, comb2 = ref.hc_mixes(x_new, c["fn"], c["scale"], c["base"], N, ITERS, EPS, NORM_EPS)
    return x_new, ref_rms_norm(ref.hc_collapse(x_new, p2), c["w"], NORM_EPS), post2, comb2


def _flat(v):
    return list(v) if isinstance(v, tuple) else [v]


def assert_counts(hc: ops.HcBackend, backend: str, times: int = 1, kernels=ops.KERNEL_NAMES):
    stats = hc.stats()
    for k in kernels:
        want = {b: (times if b == backend else 0) for b in ops.BACKENDS}
        assert stats[k] == want, f"{k}: {stats[k]} != {want}"


# ------------------------------------------------------------------------------------------ backends


def test_hc_backend_follows_the_simulator_setting_and_the_runs_torch_switch():
    assert ops.HcBackend().path("cpu") == "torch" and ops.HcBackend().path("neuron") == "nki"  # no CPU kernel
    assert ops.HcBackend(sim="exact").path("cpu") == "nki-sim" and ops.HcBackend(sim="device").path("neuron") == "nki"
    off = ops.HcBackend(torch_only=True, sim="exact")
    assert off.path("cpu") == "torch" and off.path("neuron") == "torch"


def test_the_cpu_kernel_runs_eager_post_steps_and_never_inside_a_graph(case):
    """With the run's CPU kernel on, eager hc_post / hc_post_pre / hc_head calls on decode rows run its C++ ("cpu",
    counted), within rounding of the torch path (the post step bitwise); the other ops and a compiled graph (which
    traces the torch reference) take torch; MHCRUN_NKI_HC=0 (torch_only) and the simulator keep their paths."""
    from conftest import cpu_kernel

    kernel = cpu_kernel()
    if not kernel.on:
        pytest.skip(kernel.status())
    hc = ops.HcBackend(cpu=kernel)
    assert hc.path("cpu") == "cpu" and hc.path("cuda") == "torch" and hc.path("neuron") == "nki"
    assert ops.HcBackend(torch_only=True, cpu=kernel).path("cpu") == "torch"
    assert ops.HcBackend(sim="exact", cpu=kernel).path("cpu") == "nki-sim"
    c = case
    post, comb = torch.rand(B, S, N) * 2, torch.rand(B, S, N, N)
    args = (c["y"], c["x"], post, comb, c["fn"], c["hi"], c["lo"], c["scale"], c["base"], c["w"], N, ITERS, EPS,
            NORM_EPS)
    got, want = ops.hc_post_pre(*args, hc), ops.hc_post_pre(*args)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    assert torch.equal(ops.hc_post(c["y"], c["x"], post, comb, hc), ref.hc_post(c["y"], c["x"], post, comb))
    head_args = (c["x"], c["head_fn"], c["head_hi"], c["head_lo"], c["head_scale"], c["head_base"], EPS, NORM_EPS)
    torch.testing.assert_close(ops.hc_head(*head_args, hc), ops.hc_head(*head_args), rtol=2e-6, atol=2e-6)
    stats = hc.stats()
    assert stats["hc_post_pre"]["cpu"] == stats["hc_post"]["cpu"] == stats["hc_head"]["cpu"] == 1
    hc.reset()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda *a: ops.hc_post_pre(*a, hc), backend="aot_eager", fullgraph=True)(*args)
    finally:
        torch._dynamo.reset()
    assert not any(sum(v.values()) for v in hc.stats().values())  # traced torch: the regions' decoder counts them
    for a, b in zip(compiled, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_the_environment_sets_the_backend_through_env_only(monkeypatch):
    """MHCRUN_NKI_SIM and MHCRUN_NKI_HC reach the ops only through the command's `Env` (read once): a run built
    from another environment is not switched by this process's variables."""
    from mhcrun.settings import Env

    env = Env.read({"MHCRUN_NKI_SIM": "device", "MHCRUN_NKI_HC": "1"})
    assert (env.nki_sim, env.hc_torch) == ("device", False)
    assert Env.read({"MHCRUN_NKI_HC": "0"}).hc_torch and Env.read({}).nki_sim is None
    monkeypatch.setenv("MHCRUN_NKI_SIM", "1")
    assert ops.HcBackend().path("cpu") == "torch"  # the process's variable is not read below the entry point


def test_torch_path_equals_reference_exactly(case):
    hc = ops.HcBackend()
    got, want = run_all(case, hc), reference_all(case)
    for k in want:
        for a, b in zip(_flat(got[k]), _flat(want[k]), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), k
    assert_counts(hc, "torch")


def test_hc_disabled_calls_reference_and_counts_torch(case):
    hc = ops.HcBackend(torch_only=True, sim="exact")
    got, want = run_all(case, hc), reference_all(case)
    for k in want:
        for a, b in zip(_flat(got[k]), _flat(want[k]), strict=True):
            assert torch.equal(a, b), k
    assert_counts(hc, "torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sim_path_close_to_reference_and_counted(case, sim, dtype):
    for k in ("e", "x", "y", "gate", "up"):
        case[k] = case[k].to(dtype)
    got, want = run_all(case, sim), reference_all(case)
    assert_counts(sim, "nki-sim")
    for a, b in zip(got["hc_mixes"], want["hc_mixes"], strict=True):
        assert a.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    assert torch.equal(got["hc_expand"], want["hc_expand"])
    bf16_tol = {"rtol": 2**-7, "atol": 1e-5}  # one bf16 ulp
    for k in ("hc_collapse", "hc_post", "hc_head", "rmsnorm"):
        assert got[k].dtype == want[k].dtype == dtype and got[k].shape == want[k].shape, k
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else bf16_tol
        torch.testing.assert_close(got[k], want[k], **tol)
    torch.testing.assert_close(got["swiglu"], want["swiglu"], rtol=1e-5, atol=1e-6)
    y, post, comb = got["hc_pre"]
    torch.testing.assert_close(post, want["hc_pre"][1], rtol=0, atol=2e-5)
    torch.testing.assert_close(comb, want["hc_pre"][2], rtol=0, atol=2e-5)
    # y: rounded twice in bf16 (the collapse, then the norm), so up to two ulps
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-6, "atol": 1e-5}
    torch.testing.assert_close(y, want["hc_pre"][0], **tol)
    x_new, y2, post2, comb2 = got["hc_post_pre"]
    torch.testing.assert_close(x_new, want["hc_post_pre"][0], **(tol if dtype == torch.float32 else bf16_tol))
    # the post/comb of the next site see the bf16-rounded streams: 2e-5 as hc_mixes, a little more in bf16
    torch.testing.assert_close(post2, want["hc_post_pre"][2], rtol=0, atol=2e-5 if dtype == torch.float32 else 1e-3)
    torch.testing.assert_close(comb2, want["hc_post_pre"][3], rtol=0, atol=2e-5 if dtype == torch.float32 else 1e-3)
    torch.testing.assert_close(y2, want["hc_post_pre"][1], rtol=1e-5 if dtype == torch.float32 else 2**-5, atol=1e-4)


def test_sim_path_without_precomputed_split(case, sim):
    x, fn, scale, base = case["x"], case["fn"], case["scale"], case["base"]
    got = ops.hc_mixes(x, fn, None, None, scale, base, N, ITERS, EPS, NORM_EPS, sim)
    want = ops.hc_mixes(x, fn, case["hi"], case["lo"], scale, base, N, ITERS, EPS, NORM_EPS, sim)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert sim.stats()["hc_mixes"]["nki-sim"] == 2


def test_unsupported_constants_and_shapes_fall_back_to_torch(case, sim):
    x, fn, hi, lo, scale, base = (case[k] for k in ("x", "fn", "hi", "lo", "scale", "base"))
    for iters, eps, norm_eps in ((10, EPS, NORM_EPS), (ITERS, 1e-5, NORM_EPS), (ITERS, EPS, 1e-5)):
        got = ops.hc_mixes(x, fn, hi, lo, scale, base, N, iters, eps, norm_eps, sim)
        want = ref.hc_mixes(x, fn, scale, base, N, iters, eps, norm_eps)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    hf, hh, hl, hs, hb = (case[k] for k in ("head_fn", "head_hi", "head_lo", "head_scale", "head_base"))
    assert torch.equal(ops.hc_head(x, hf, hh, hl, hs, hb, EPS, 1e-5, sim), ref.hc_head(x, hf, hs, hb, EPS, 1e-5))
    assert torch.equal(ops.hc_expand(case["e"], 2, sim), ref.hc_expand(case["e"], 2))  # n != 4
    x16, pre = x.half(), torch.rand(B, S, N)
    assert torch.equal(ops.hc_collapse(x16, pre, sim), ref.hc_collapse(x16, pre))  # fp16 activations
    stats = sim.stats()
    assert stats["hc_mixes"] == {"torch": 3, "nki-sim": 0, "nki": 0, "cpu": 0}
    assert stats["hc_head"] == {"torch": 1, "nki-sim": 0, "nki": 0, "cpu": 0}
    assert stats["hc_expand"] == {"torch": 1, "nki-sim": 0, "nki": 0, "cpu": 0}
    assert stats["hc_collapse"] == {"torch": 1, "nki-sim": 0, "nki": 0, "cpu": 0}


def test_split_hi_lo(case):
    fn = case["fn"]
    hi, lo = ops.split_hi_lo(fn)
    assert hi.dtype == lo.dtype == torch.bfloat16 and hi.shape == lo.shape == fn.shape
    assert torch.equal(hi, fn.to(torch.bfloat16))
    err = (hi.float() + lo.float() - fn).abs()
    assert (err <= fn.abs() * 2.0**-16).all()
    assert err.max() < (fn - hi.float()).abs().max() / 100


def test_split_hi_lo_for_fp32_activations_is_exact(case):
    """With fp32 activations lo stays fp32 and hi + lo is fn itself (a bf16 lo leaves up to 2^-18 |fn|)."""
    fn = case["fn"]
    hi, lo = ops.split_hi_lo(fn, torch.float32)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.float32
    assert torch.equal(hi, fn.to(torch.bfloat16))
    assert torch.equal(hi.float() + lo, fn)
    assert not torch.equal(hi.float() + ops.split_hi_lo(fn)[1].float(), fn)


def test_mixes_with_the_fp32_split_match_torch_as_closely_as_fp32_does(case, sim):
    """The simulator's mixes over fp32 activations with the fp32 lo are as close to float64 as torch's fp32 ones
    (seeds 0-4: 1.4e-7 to 2.0e-7 of the largest value; torch 1.4e-7 to 2.9e-7); with a bf16 lo 1.6e-6 to 2.5e-6."""
    c = case
    x = c["x"]
    xf = x.flatten(2).double()  # the float64 reference
    mixes = (xf @ c["fn"].double().T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + NORM_EPS)
    want = ref.hc_split_sinkhorn(mixes, c["scale"].double(), c["base"].double(), N, ITERS, EPS)

    def worst(hi, lo):
        got = ops.hc_mixes(x, c["fn"], hi, lo, c["scale"], c["base"], N, ITERS, EPS, NORM_EPS, sim)
        return max(((g.double() - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want, strict=True))

    exact, bf16_lo = worst(*ops.split_hi_lo(c["fn"], torch.float32)), worst(c["hi"], c["lo"])
    assert sim.stats()["hc_mixes"]["nki-sim"] == 2
    assert exact < 5e-7 < bf16_lo, (exact, bf16_lo)


@pytest.mark.parametrize("t", [2, 40], ids=["hidden-layout", "tokens-layout"])
def test_pre_step_with_the_fp32_split_is_as_close_to_float64_as_torch(t, sim):
    """hc_pre over fp32 activations with the fp32 lo, in both layouts: y, post and comb within 5e-7 of float64
    (seeds 0-2: up to 2.3e-7; torch's own up to 3.4e-7), where a bf16 lo leaves up to 2.3e-6."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, t, N, D, generator=g)
    fn = torch.randn((2 + N) * N, N * D, generator=g) * (N * D) ** -0.5
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + N) * N, generator=g) * 0.5
    w = torch.randn(D, generator=g)
    xf = x.flatten(2).double()
    mixes = (xf @ fn.double().T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + NORM_EPS)
    pre, post, comb = ref.hc_split_sinkhorn(mixes, scale.double(), base.double(), N, ITERS, EPS)
    want = (ref_rms_norm(ref.hc_collapse(x.double(), pre), w.double(), NORM_EPS), post, comb)

    def worst(hi, lo):
        got = ops.hc_pre(x, fn, hi, lo, scale, base, w, N, ITERS, EPS, NORM_EPS, sim)
        return max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want, strict=True))

    exact, bf16_lo = worst(*ops.split_hi_lo(fn, torch.float32)), worst(*ops.split_hi_lo(fn))
    assert sim.stats()["hc_pre"]["nki-sim"] == 2
    assert exact < 5e-7 < bf16_lo, (exact, bf16_lo)


def test_kernel_stats_is_a_snapshot_of_one_runs_counts():
    hc, other = ops.HcBackend(), ops.HcBackend()
    snap = hc.stats()
    assert set(snap) == set(ops.KERNEL_NAMES) and all(set(v) == set(ops.BACKENDS) for v in snap.values())
    snap["hc_expand"]["torch"] = 99
    assert hc.stats()["hc_expand"]["torch"] == 0
    ops.hc_expand(torch.ones(1, 1, 8), N, hc)
    assert hc.stats()["hc_expand"]["torch"] == 1 and other.stats()["hc_expand"]["torch"] == 0
    hc.reset()
    assert hc.stats()["hc_expand"]["torch"] == 0


# ------------------------------------------------------------------------------------------ op registration


def _op_samples(c):
    hi, lo = c["hi"], c["lo"]
    return {
        "hc_expand": (c["e"], N),
        "hc_mixes": (c["x"], c["fn"], hi, lo, c["scale"], c["base"], N, ITERS, EPS, NORM_EPS),
        "hc_collapse": (c["x"], torch.rand(B, S, N)),
        "hc_post": (c["y"], c["x"], torch.rand(B, S, N), torch.rand(B, S, N, N)),
        "hc_head": (c["x"], c["head_fn"], c["head_hi"], c["head_lo"], c["head_scale"], c["head_base"], EPS, NORM_EPS),
        "rmsnorm": (c["y"], c["w"], NORM_EPS),
        "swiglu": (c["gate"], c["up"], 10.0),
        "hc_pre": (c["x"], c["fn"], hi, lo, c["scale"], c["base"], c["w"], N, ITERS, EPS, NORM_EPS),
        "hc_post_pre": (c["y"], c["x"], torch.rand(B, S, N), torch.rand(B, S, N, N), c["fn"], hi, lo, c["scale"],
                        c["base"], c["w"], N, ITERS, EPS, NORM_EPS),
    }


@pytest.mark.parametrize("sim_on", [False, True], ids=["torch", "nki-sim"])
def test_opcheck(case, sim_on):
    hc = ops.HcBackend(sim="exact" if sim_on else None)
    for name, args in _op_samples(case).items():
        torch.library.opcheck(getattr(torch.ops.mhcrun, name).default, (*args, hc.sim or "", hc.calls))
        getattr(torch.ops.mhcrun, name)(*args, hc.sim or "", hc.calls)  # counts into the run's `calls`
    assert_counts(hc, "nki-sim" if sim_on else "torch")


def test_ops_compile_fullgraph_as_single_nodes(case, sim):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def block(e, x, y, fn, hi, lo, scale, base, hfn, hhi, hlo, hscale, hbase, w, gate, up):
        x0 = ops.hc_expand(e, N, sim)
        pre, post, comb = ops.hc_mixes(x, fn, hi, lo, scale, base, N, ITERS, EPS, NORM_EPS, sim)
        h = ops.rms_norm(ops.hc_collapse(x, pre, sim), w, NORM_EPS, sim)
        x1 = ops.hc_post(h + y, x, post, comb, sim)
        out = ops.hc_head(x1, hfn, hhi, hlo, hscale, hbase, EPS, NORM_EPS, sim)
        return x0, out, ops.swiglu(gate, up, 10.0, sim)

    keys = ("e", "x", "y", "fn", "hi", "lo", "scale", "base", "head_fn", "head_hi", "head_lo", "head_scale",
            "head_base", "w", "gate", "up")  # fmt: skip
    args = [case[k] for k in keys]
    torch._dynamo.reset()
    try:
        compiled = torch.compile(block, backend=backend, fullgraph=True)
        first = compiled(*args)
        second = compiled(*args)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    for name in (*HC_OPS, "rmsnorm", "swiglu"):
        packet = getattr(torch.ops.mhcrun, name)
        assert sum(t in (packet, packet.default) for t in targets) == 1, name
    # the custom ops count the graph's executions: twice each, on the simulator
    assert_counts(sim, "nki-sim", times=2, kernels=BLOCK)
    sim.reset()
    eager = block(*args)
    assert_counts(sim, "nki-sim", times=1, kernels=BLOCK)
    for a, b, c in zip(first, second, eager, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    # through AOTAutograd too (the fake kernels trace the graph, the real ones run it)
    sim.reset()
    torch._dynamo.reset()
    try:
        aot = torch.compile(block, backend="aot_eager", fullgraph=True)(*args)
    finally:
        torch._dynamo.reset()
    assert_counts(sim, "nki-sim", times=1, kernels=BLOCK)
    for a, c in zip(aot, eager, strict=True):
        assert torch.equal(a, c)


def test_site_ops_run_under_inductor(case, sim):
    """The model's two site ops, hc_pre then hc_post, compiled by inductor (the CPU regions' backend): the custom
    ops run once each, in the simulator, and give the eager call's values."""

    def site(x, y, fn, hi, lo, scale, base, w):
        h, post, comb = ops.hc_pre(x, fn, hi, lo, scale, base, w, N, ITERS, EPS, NORM_EPS, sim)
        return ops.hc_post(h + y, x, post, comb, sim)

    args = [case[k] for k in ("x", "y", "fn", "hi", "lo", "scale", "base", "w")]
    torch._dynamo.reset()
    try:
        got = torch.compile(site, backend="inductor", fullgraph=True)(*args)
    finally:
        torch._dynamo.reset()
    assert_counts(sim, "nki-sim", times=1, kernels=("hc_pre", "hc_post"))
    assert torch.equal(got, site(*args))


def test_mixes_supported_matches_the_kernels():
    from mhcrun.nki.sim import load_kernel_module

    kernels = load_kernel_module(ops.KERNEL_SOURCE)
    for args in [(4, 20, 1e-6, 1e-6), (4, 20, 1e-6, 1e-20), (4, 20, 1e-6, 1e-5), (2, 20, 1e-6, 1e-6),
                 (4, 19, 1e-6, 1e-6), (4, 20, 1e-7, 1e-6)]:  # fmt: skip
        assert ops.mixes_supported(*args) == kernels.mixes_supported(*args), args


def test_head_on_a_strided_last_position(case, sim):
    """The model calls hc_head on x[:, -1:], a non-contiguous view."""
    x = case["x"][:, -1:]
    assert not x.is_contiguous()
    hf, hh, hl, hs, hb = (case[k] for k in ("head_fn", "head_hi", "head_lo", "head_scale", "head_base"))
    got = ops.hc_head(x, hf, hh, hl, hs, hb, EPS, NORM_EPS, sim)
    torch.testing.assert_close(got, ref.hc_head(x, hf, hs, hb, EPS, NORM_EPS), rtol=1e-5, atol=1e-5)
    assert sim.stats()["hc_head"]["nki-sim"] == 1


def test_no_neuron_import_off_device(case):
    run_all(case, ops.HcBackend())
    assert "torch_neuronx" not in sys.modules


def test_tp_on_neuron_joins_torchneuron_s_neuron_backend(monkeypatch):
    """--tp on --device neuron: `import torch_neuronx` (lazily, on that path only), then the `neuron` backend."""
    import types
    from pathlib import Path

    import torch.distributed as dist

    from mhcrun import parallel

    calls = []
    fake = types.ModuleType("torch_neuronx")
    monkeypatch.setitem(sys.modules, "torch_neuronx", fake)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw["rank"])))
    parallel.init_workers(parallel.Shard(1, 2), "neuron")
    assert calls == [("neuron", 1)]
    src = Path(parallel.__file__).read_text()
    assert "torch_xla" not in src and '"xla"' not in src


# ------------------------------------------------------------------------------------------ the model's regions


def test_compiled_regions_hold_one_post_pre_node_per_layer_half():
    """The model's compiled region graphs (MHCRUN_NKI_SIM=1) call the fused kernels as custom-op nodes: every layer
    half's graph one mhcrun::hc_post_pre (the post step carried in, its own site's pre), the head's one
    mhcrun::hc_post and one mhcrun::hc_head, none of the unfused site kernels; the step counts them as it runs
    them, and the compiled step's logits are the eager step's within rounding."""
    from mhcrun.config import config_from_hf
    from mhcrun.model import build_model
    from mhcrun.regions.runner import RegionDecoder
    from mhcrun.tiny import init_tensors, tiny_config_raw

    cfg = config_from_hf(dict(tiny_config_raw(), compress_ratios=[0, 4, 16], num_hidden_layers=3))
    model = build_model(cfg, init_tensors(cfg, 0), set())
    model.opts.hc = ops.HcBackend(sim="exact")
    model.setup_caches(1, 8)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    dec = RegionDecoder(model, "regions", capture)
    zero = torch.zeros(1, dtype=torch.long)
    torch._dynamo.reset()
    try:
        with torch.inference_mode():
            compiled = dec(zero, zero)
    finally:
        torch._dynamo.reset()
    assert [s.region for s in dec.stats] == ["attn:window", "moe:hash", "attn:csa", "moe:routed", "attn:hca", "head"]
    site_ops = ("hc_pre", "hc_post", "hc_head", "hc_mixes", "hc_collapse", "hc_post_pre")
    for stats, gm in zip(dec.stats, graphs, strict=True):
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        calls = {k: sum(t in (getattr(torch.ops.mhcrun, k), getattr(torch.ops.mhcrun, k).default) for t in targets)
                 for k in site_ops}
        want = {"hc_head": 1, "hc_post": 1} if stats.region == "head" else {"hc_post_pre": 1}
        assert calls == {k: want.get(k, 0) for k in site_ops}, (stats.region, calls)
    counts = model.opts.hc.stats()
    assert counts["hc_post_pre"]["nki-sim"] == 2 * len(model.layers)
    assert counts["hc_head"]["nki-sim"] == counts["hc_post"]["nki-sim"] == 1
    assert counts["hc_pre"]["nki-sim"] == counts["hc_expand"]["nki-sim"] == 0
    with torch.inference_mode():
        eager = model(zero.view(1, 1), zero, 0, static=True)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)  # measured 2.4e-6: the graph's op order
