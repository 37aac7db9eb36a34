"""Quantised weights kept quantised: same tokens as the dequantised reference, the memory plan, --layers, and
the bad inputs of quantised checkpoints (scales, FP4 sizes, block size, memory budget)."""

from __future__ import annotations

import gc
import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import cpu_kernel, kernel_in
from safetensors.torch import load_file, save_file
from test_cli import cli, gen_json, ok, user_error

from mhcrun.checkpoint import INDEX_FILE, load_checkpoint, plan_checkpoint
from mhcrun.generate import generate
from mhcrun.memory import parse_size, plan_memory
from mhcrun.model import Linear, build_model
from mhcrun.ops import qgemv
from mhcrun.ops.qgemv import ExpertSet
from mhcrun.regions.runner import RegionDecoder
from mhcrun.synthetic import make_synthetic
from mhcrun.tiny import make_tiny

MID = Path(__file__).resolve().parent.parent / "configs" / "v4-mid.json"
PROMPTS = [[0, 12, 40, 7, 9], [0, 3], list(range(1, 40))]  # crosses the window (16) and HCA group (16)
WQ = "layers.1.attn.wq_a"


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("t8") / "tiny-fp8", fp8=True)


@pytest.fixture(scope="module")
def mid2(tmp_path_factory) -> Path:
    """The mid-size config (dim 2048, 64 FP4 experts, FP8 block 128) at full width, its first 2 layers."""
    return make_synthetic(MID, tmp_path_factory.mktemp("mid") / "mid2", 2, seed=1)


def models(path: Path, n_layers: int | None = None) -> tuple[torch.nn.Module, torch.nn.Module]:
    kept = load_checkpoint(path, n_layers)
    ref = load_checkpoint(path, n_layers, dequantize=True)
    return (build_model(kept.config, kept.tensors, kept.quantized, n_layers=n_layers),
            build_model(ref.config, ref.tensors, ref.quantized, n_layers=n_layers))


@pytest.mark.parametrize("quant_sim", [True, False])
def test_tiny_fp8_kept_quantised_generates_the_dequantised_tokens(tiny_fp8, quant_sim):
    kept, ref = models(tiny_fp8)
    assert kept.layers[1].attn.wq_a.w.fmt == "fp8" and kept.layers[0].ffn.experts[0].w1.w.fmt == "fp4"
    assert ref.layers[1].attn.wq_a.w.fmt == "float" and ref.layers[1].attn.wq_a.weight.dtype == torch.float32
    for m in (kept, ref):
        m.opts.quant_sim = quant_sim
    a = generate(kept, PROMPTS, 24, eos_id=1, ignore_eos=True, record_topk=2)
    b = generate(ref, PROMPTS, 24, eos_id=1, ignore_eos=True, record_topk=2)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    for ra, rb in zip(a, b, strict=True):  # same distributions, not only the same argmax
        for pa, pb in zip(ra.top_logprobs, rb.top_logprobs, strict=True):
            assert [i for i, _ in pa] == [i for i, _ in pb]
            assert max(abs(x - y) for (_, x), (_, y) in zip(pa, pb, strict=True)) < 1e-4


def test_quant_sim_changes_the_quantised_run(tiny_fp8):
    kept, _ = models(tiny_fp8)
    kept.setup_caches(1, 64)
    with torch.inference_mode():
        on = kept(torch.tensor([PROMPTS[2]]), torch.tensor([0]))
        kept.opts.quant_sim = False
        kept.setup_caches(1, 64)
        off = kept(torch.tensor([PROMPTS[2]]), torch.tensor([0]))
    assert (on - off).abs().max() > 1e-4  # activations really are rounded to FP8 before the kept GEMMs


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_kept_quantised_regions_stages_match_eager(tiny_fp8, kernel):
    """The region stages (uncompiled) on kept-quantised weights: gathered experts read in place by the fused
    kernel, or stacked and dequantised in the graph."""
    kept, _ = models(tiny_fp8)
    kept.opts.cpu = cpu_kernel(kernel)
    eager = generate(kept, PROMPTS, 12, eos_id=1, ignore_eos=True)
    kept2, _ = models(tiny_fp8)
    kept2.opts.cpu = cpu_kernel(kernel)
    kept2.setup_caches(len(PROMPTS), 64)
    RegionDecoder(kept2, "eager", None)
    w1 = kept2.layers[0].ffn.gathered["w1"]  # fp4: a set the kernel reads in place, or stacked as stored
    if kept2.opts.cpu.on:
        assert isinstance(w1, ExpertSet) and w1.ptrs[0, 0] == kept2.layers[0].ffn.experts[0].w1.w.data.data_ptr()
    else:
        assert w1.data.dtype == torch.int8 and w1.block == 32
    regions = generate(kept2, PROMPTS, 12, eos_id=1, ignore_eos=True, graph_mode="regions", backend="eager")
    assert [r.tokens for r in regions] == [r.tokens for r in eager]


def kernel_moe(path: Path) -> tuple:
    """(the model on the run's CPU kernel, its layer 1's MoE, 3 rows of x for it); skips where the kernel is off."""
    kernel = cpu_kernel()
    if not kernel.on:
        pytest.skip(f"CPU kernel {kernel.status()}")
    model, _ = models(path)
    model.opts.cpu = kernel
    return model, model.layers[1].ffn, torch.randn(3, model.cfg.dim)


def test_eager_decode_reads_the_experts_in_place(tiny_fp8):
    """With the fused kernel, an eager step of at most MAX_ROWS tokens runs a layer's routed experts as the static
    path does (one kernel call a projection over the experts read in place), giving the per-expert loop's output;
    more rows, or the kernel off, take the loop and read nothing in place."""
    model, ffn, x = kernel_moe(tiny_fp8)
    weights, idx = ffn.gate(x, torch.tensor([5, 9, 11]))
    assert ffn.reads_in_place(3) and all(isinstance(ffn.gathered[w], ExpertSet) for w in ("w1", "w2", "w3"))
    assert not ffn.reads_in_place(qgemv.MAX_ROWS + 1)
    torch.testing.assert_close(ffn.routed_gathered(x, weights, idx), ffn.routed_loop(x, weights, idx),
                               rtol=1e-5, atol=1e-6)
    off, _ = models(tiny_fp8)
    off.opts.cpu = cpu_kernel("0")
    assert not off.layers[1].ffn.reads_in_place(1) and not off.layers[1].ffn.gathered


@pytest.mark.parametrize("extra", [3, "long", "panels"])
def test_eager_prefill_chunk_runs_the_routed_experts_in_one_call(tiny_fp8, monkeypatch, extra):
    """A prefill chunk of more than MAX_ROWS tokens whose routes come to decode-sized rows an expert takes one
    `moe_routed` call (not a call an expert and weight); a longer one as few calls as that bound allows, of even size,
    the kernel's transients staying what one such call needs, except where a GEMM engine (AMX's tiles, the BF16 dot
    products) multiplies an expert's many rows (`CpuKernel.gemm_first`): there it goes expert by expert, by the
    engine's GEMMs, in no such call, unless the call's own panels take that many routes (the BF16 panels on a CPU
    without AMX: one call); each gives the per-expert loop's output within rounding; with the kernel off it takes the
    loop."""
    model, ffn, _ = kernel_moe(tiny_fp8)
    panels = bool(model.opts.cpu.gemm)
    if extra == "panels" and not panels:
        pytest.skip(f"no GEMM engine (CPU kernel {model.opts.cpu.status()})")
    if extra == "long" and panels:  # the same instructions without a GEMM engine: the calls' slices
        model.opts.cpu = cpu_kernel("avx512")
    span = qgemv.MAX_ROWS * model.cfg.n_routed_experts // model.cfg.n_activated_experts
    t = qgemv.MAX_ROWS + 3 if extra == 3 else 2 * span + 5
    x = torch.randn(t, model.cfg.dim, generator=torch.Generator().manual_seed(7))
    weights, idx = ffn.gate(x, torch.arange(t) + 5)
    calls, fused = [], type(model.opts.cpu).moe_routed
    monkeypatch.setattr(type(model.opts.cpu), "moe_routed",
                        lambda self, *a: calls.append(a[2].shape) or fused(self, *a))
    got = ffn.routed(x, weights, idx, static=False)
    k = model.cfg.n_activated_experts
    even = -(-t // 3)  # three calls of even size (not two of `span` and one of five tokens)
    one_call = t * k <= model.opts.cpu.routed_routes(ffn.gathered["w1"], ffn.gathered["w2"])  # the kernel's panels
    assert calls == {3: [idx.shape], "panels": [idx.shape] if one_call else []}.get(
        extra, [(even, k), (even, k), (t - 2 * even, k)])
    assert all(shape[0] * k <= qgemv.MAX_ROWS * model.cfg.n_routed_experts for shape in calls) or one_call
    torch.testing.assert_close(got, ffn.routed_loop(x, weights, idx), rtol=1e-5, atol=1e-6)
    off, _ = models(tiny_fp8)
    off.opts.cpu = cpu_kernel("0")
    off_ffn = off.layers[1].ffn
    ref = off_ffn.routed_loop(x, weights, idx)  # torch's: dequantised experts (the engines' loop: the kernel's GEMMs)
    torch.testing.assert_close(off_ffn.routed(x, weights, idx, static=False), ref)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_routed_prefill_slices_grow_where_the_panels_take_them(mid2, monkeypatch):
    """With AVX2's panels (FP4 experts, e8m0 groups of 32, whole chunks: the mid-size config), a routed call takes as
    many routes as ROUTED_CALL_BYTES of its transients hold (`route_bytes` a route), more than MAX_ROWS rows an
    expert, so that a panel decoded once serves more rows; a longer chunk still takes calls of even size within that
    bound, the per-expert loop's output within rounding. Other experts keep the MAX_ROWS bound."""
    kernel = kernel_in("avx2")  # the panels are AVX2's: an AVX-512 CPU runs them capped at AVX2
    kept = load_checkpoint(mid2, 2)
    model = build_model(kept.config, kept.tensors, kept.quantized, n_layers=2)
    model.opts.cpu = kernel
    ffn, cfg = model.layers[1].ffn, model.cfg
    assert ffn.reads_in_place(1)
    w1, w2 = ffn.gathered["w1"], ffn.gathered["w2"]
    floor = qgemv.MAX_ROWS * cfg.n_routed_experts
    monkeypatch.setattr(qgemv, "ROUTED_CALL_BYTES", 3 * floor * qgemv.route_bytes(cfg.dim, cfg.moe_inter_dim) // 2)
    assert kernel.routed_routes(w1, w2) == 3 * floor // 2
    assert kernel.routed_routes(replace(w1, fmt=qgemv.FORMATS["fp8"]), w2) == floor
    assert kernel.routed_routes(replace(w1, block=64), w2) == floor
    k = cfg.n_activated_experts
    t = 2 * (3 * floor // 2 // k) + 5
    x = torch.randn(t, cfg.dim, generator=torch.Generator().manual_seed(8))
    weights, idx = ffn.gate(x, torch.arange(t) + 5)
    calls, fused = [], type(kernel).moe_routed
    monkeypatch.setattr(type(kernel), "moe_routed", lambda self, *a: calls.append(a[2].shape) or fused(self, *a))
    got = ffn.routed(x, weights, idx, static=False)
    even = -(-t // 3)
    assert calls == [(even, k), (even, k), (t - 2 * even, k)] and floor < even * k <= 3 * floor // 2
    torch.testing.assert_close(got, ffn.routed_loop(x, weights, idx), rtol=1e-5, atol=1e-5)


def test_eager_decode_runs_the_shared_expert_in_one_call(tiny_fp8):
    """With the fused kernel, an eager step's shared expert is one `moe_routed` call over a set of that one expert read
    in place, weighted 1: the module's own forward within rounding (silu's exp), with the activation rounding and
    without; bf16 rows, or the kernel off, take the module's forward."""
    model, ffn, x = kernel_moe(tiny_fp8)
    for quant_sim in (True, False):
        model.opts.quant_sim = quant_sim
        torch.testing.assert_close(ffn.shared(x), ffn.shared_experts(x), rtol=1e-5, atol=1e-6)
    sets = ffn.shared_in_place
    assert len(sets) == 3 and sets[0].ptrs[0, 0] == ffn.shared_experts.w1.w.data.data_ptr()
    assert torch.equal(ffn.shared(x.bfloat16()), ffn.shared_experts(x.bfloat16()))
    off, _ = models(tiny_fp8)
    off.opts.cpu = cpu_kernel("0")
    assert torch.equal(off.layers[1].ffn.shared(x), off.layers[1].ffn.shared_experts(x))
    assert off.layers[1].ffn.shared_in_place is None


BITWISE_STEPS = ("rope_tail", "kv_fp8", "kv_fp8_encode", "kv_fp4", "kv_fp4_encode", "fp4_simulate", "window_mask",
                 "hadamard")


def decode_logits(path: Path, prompts: list[list[int]], steps: int, quant_sim: bool = True) -> list[torch.Tensor]:
    """`teacher_forced` of the kept-quantised model on the run's CPU kernel."""
    model, _ = models(path)
    model.opts.cpu, model.opts.quant_sim = cpu_kernel(), quant_sim
    return teacher_forced(model, prompts, steps)


def teacher_forced(model: torch.nn.Module, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Each decode step's logits [rows, V] of `model` on fresh caches, every row fed the same teacher-forced tokens
    after its own prompt (rows at different positions)."""
    from mhcrun.generate import Stepper

    model.setup_caches(len(prompts), 64)
    st = Stepper(model, 8)
    for row, ids in enumerate(prompts):
        st.prefill(row, ids)
    rows = list(range(len(prompts)))
    return [st.decode(rows, [(7 * t + 3) % 200 + 5] * len(rows)) for t in range(steps)]


def scoped_decode_logits(path: Path, prompts: list[list[int]], steps: int, mode: str, scoped: bool,
                         n_layers: int | None = None) -> tuple[list[torch.Tensor], int]:
    """`decode_logits` on the run's CPU kernel, eager or by compiled regions (aot_eager: the graphs call the kernel's
    ops), each step run in a `StepScope` of two threads (`scoped`) or not -> (the logits, the bytes read ahead)."""
    from mhcrun.generate import Stepper

    model = models(path, n_layers)[0]
    model.opts.cpu = cpu_kernel()
    model.setup_caches(len(prompts), 64)
    decoder = RegionDecoder(model, "regions", "aot_eager") if mode == "regions" else None
    st = Stepper(model, 8, decoder)
    st.scope = qgemv.StepScope(model.opts.cpu.library, 2) if scoped else None
    for row, ids in enumerate(prompts):
        st.prefill(row, ids)
    rows = list(range(len(prompts)))
    logits = [st.decode(rows, [(7 * t + 3) % 200 + 5] * len(rows)) for t in range(steps)]
    return logits, st.scope.read_ahead() if scoped else 0


@pytest.mark.parametrize("case", ["tiny eager", "tiny regions", "mid eager"])
def test_decode_steps_in_a_step_scope_give_the_logits_of_plain_steps(tiny_fp8, mid2, case):
    """Decode steps each run in one parallel region of the kernel (`StepScope`: its worker joins the GEMVs' units, the
    mHC mixes, the routing logits and the decode attention's loops, and reads the next call's weights ahead between
    them) give bit for bit the logits of plain steps, eager and through compiled regions, across the window's and the
    compressors' group edges (tiny: 20 steps of 2 rows at different positions), on the mid-size config's shapes too
    (its routing logits parallel); weights were read ahead."""
    if not cpu_kernel().on:
        pytest.skip(f"CPU kernel {cpu_kernel().status()}")
    name, mode = case.split()
    path, steps, layers = (tiny_fp8, 20, None) if name == "tiny" else (mid2, 3, 2)
    prompts = DECODE_PROMPTS if name == "tiny" else [[0, 5, 6, 7]]
    with torch.inference_mode():
        want, _ = scoped_decode_logits(path, prompts, steps, mode, False, layers)
        got, read = scoped_decode_logits(path, prompts, steps, mode, True, layers)
    assert read > 0
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step}"


LAYER_STEPS = ("mhc_attn_project", "mhc_attn_output", "mhc_compress_open", "mhc_ffn_half", "mhc_moe_step",
               "mhc_index_queries", "mhc_attend_output", "mhc_open_attend_output", "mhc_finish")


@pytest.mark.parametrize("quant_sim, hc", [(True, "kernel"), (False, "kernel"), (True, "torch")])
@pytest.mark.parametrize("case", ["tiny", "mid"])
def test_eager_decode_layer_steps_in_one_call_give_the_modules_logits(tiny_fp8, mid2, monkeypatch, case, quant_sim,
                                                                      hc):
    """In CPU eager decode the attention's projections, its attention with its output (the output alone where the
    caches are plain: the simulation off), the indexer's queries, a compressor's step that closes no group, the MoE
    half (the post+pre step, then router, routed and shared experts, their sum) and the model's finish (the last post
    step, the head collapse, the final norm, the head) are one kernel call each (`mhc_attn_project`,
    `mhc_attend_output` / `mhc_attn_output`, `mhc_index_queries`, `mhc_compress_open`, `mhc_ffn_half`, `mhc_finish`;
    a compressor's step closing no group and the attention with its output in one, `mhc_open_attend_output`; the MoE
    alone, `mhc_moe_step`, where the hc steps take torch: MHCRUN_NKI_HC=0, and no finish): bit for bit the
    logits of the modules' own calls, which forward hooks on the modules bring back (`probes.first_nonfinite_op`),
    across the window's and the compressors' group edges with 2 rows at different positions (tiny), on the mid-size
    config's shapes too; each call was made, and none under the hooks."""
    from mhcrun.probes import first_nonfinite_op

    if not cpu_kernel().on:
        pytest.skip(f"CPU kernel {cpu_kernel().status()}")
    path, steps, layers, prompts = ((tiny_fp8, 20, None, DECODE_PROMPTS) if case == "tiny" else
                                    (mid2, 6, 2, [[0, 5, 6, 7], list(range(1, 11))]))
    model = models(path, layers)[0]
    model.opts.cpu, model.opts.quant_sim = cpu_kernel(), quant_sim
    model.opts.hc = replace(model.opts.hc, torch_only=hc == "torch")
    lib = qgemv.load_library(model.opts.cpu.library)
    calls = dict.fromkeys(LAYER_STEPS, 0)

    def counted(name: str, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    for name in LAYER_STEPS:
        monkeypatch.setattr(lib, name, counted(name, getattr(lib, name)))

    with torch.inference_mode():
        got = teacher_forced(model, prompts, steps)
        made = dict(calls)
        calls.update(dict.fromkeys(LAYER_STEPS, 0))
        with first_nonfinite_op(model):
            want = teacher_forced(model, prompts, steps)
    # the MoE half's call makes the MoE's; the attention's call makes its output's, which alone serves plain caches
    unused = {"mhc_ffn_half" if hc == "torch" else "mhc_moe_step", "mhc_attn_output" if quant_sim else
              "mhc_attend_output"} | (set() if quant_sim else {"mhc_open_attend_output"}) | \
        ({"mhc_finish"} if hc == "torch" else set())
    assert all(made[name] for name in LAYER_STEPS if name not in unused), made
    assert not any(calls.values()), calls
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step}"


@pytest.mark.parametrize("quant_sim", [True, False])
@pytest.mark.parametrize("case", ["tiny", "mid"])
def test_closed_groups_stored_in_one_call_are_the_modules_entries(tiny_fp8, mid2, monkeypatch, case, quant_sim):
    """A compressor's groups closed in a decode step are finished and stored in one kernel call after their norm
    (`mhc_store_entries`: RoPE at the group's first position, for indexer keys the Hadamard rotation, the FP8 / FP4
    encoding, the store): the decode's logits and every cache and state buffer equal, bit for bit, those of the calls
    the module otherwise makes (the call turned off), across the compressors' group edges, 2 rows at different
    positions (tiny); with the simulation off (plain caches) the call declines and nothing changes."""
    if not cpu_kernel().on:
        pytest.skip(f"CPU kernel {cpu_kernel().status()}")
    path, steps, layers, prompts = ((tiny_fp8, 20, None, DECODE_PROMPTS) if case == "tiny" else
                                    (mid2, 9, 2, [[0, 5, 6, 7], list(range(1, 11))]))
    model = models(path, layers)[0]
    model.opts.cpu, model.opts.quant_sim = cpu_kernel(), quant_sim
    made = [0]
    store = qgemv.CpuKernel.store_entries

    def counted(self, *args):
        ok = store(self, *args)
        made[0] += ok
        return ok

    with torch.inference_mode():
        monkeypatch.setattr(qgemv.CpuKernel, "store_entries", counted)
        got = teacher_forced(model, prompts, steps)
        got_state = {k: v.clone() for k, v in model.state().items()}
        monkeypatch.setattr(qgemv.CpuKernel, "store_entries", lambda self, *args: False)
        want = teacher_forced(model, prompts, steps)
    assert made[0] > 0 if quant_sim else made[0] == 0, made
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step}"
    for name, t in model.state().items():
        assert torch.equal(got_state[name].view(torch.uint8), t.view(torch.uint8)), name


@torch.inference_mode()
def test_finish_in_one_call_declines_what_it_does_not_take(tiny_fp8):
    """`CpuKernel.finish` (the model's finish of decode rows in one call; its logits against the module's calls: the
    test above) gives the streams and logits of the calls it makes, and None for a chunk of two positions, bf16
    streams, a head of another width, no head table, mixes of another shape, the kernel off."""
    from mhcrun.model import act_blocks, learnt_table

    if not cpu_kernel().on:
        pytest.skip(f"CPU kernel {cpu_kernel().status()}")
    model = models(tiny_fp8)[0]
    model.opts.cpu = cpu_kernel()
    n, d, g = model.cfg.hc_mult, model.cfg.dim, torch.Generator().manual_seed(5)
    y, x = torch.randn(2, 1, d, generator=g), torch.randn(2, 1, n, d, generator=g)
    post, comb = torch.rand(2, 1, n, generator=g), torch.rand(2, 1, n, n, generator=g) / n
    table = learnt_table(model, "head", model.head)

    def finish(y=y, x=x, post=post, comb=comb, fn=model.hc_head_fn, head=table, kernel=cpu_kernel()):
        return kernel.finish(y, x, post, comb, fn, model.hc_head_scale, model.hc_head_base, model.cfg.hc_eps,
                             model.cfg.norm_eps, model.norm.weight, model.norm.eps, head,
                             act_blocks(model.opts, model.head)[0])

    logits, streams = finish()
    k = cpu_kernel()
    want_streams = k.hc_post(y, x, post, comb)
    h = k.hc_head(want_streams, model.hc_head_fn, model.hc_head_scale, model.hc_head_base, model.cfg.hc_eps,
                  model.cfg.norm_eps)
    want = model.head(model.norm(h))[:, -1]
    assert torch.equal(streams, want_streams) and torch.equal(logits, want)
    two = dict(y=y.expand(2, 2, d), x=x.expand(2, 2, n, d), post=post.expand(2, 2, n), comb=comb.expand(2, 2, n, n))
    for bad in (two, dict(x=x.bfloat16(), y=y.bfloat16()), dict(head=None), dict(fn=model.hc_head_fn[:, :-1]),
                dict(head=qgemv.weight_table(model.layers[0].attn.wq_b.w)),
                dict(kernel=cpu_kernel("0"))):
        assert finish(**bad) is None, list(bad)


def strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a tensor that is not contiguous (every other float of a buffer twice t's size)."""
    out = torch.empty(*t.shape, 2, dtype=t.dtype).select(-1, 0)
    out.copy_(t)
    assert not out.is_contiguous()
    return out


@pytest.mark.parametrize("rows", [1, 3])
def test_layer_steps_take_strided_inputs(tiny_fp8, rows):
    """The MoE half (`CpuKernel.ffn_half`) and the MoE (`moe_step`) in one call read strided carried streams, mixes and
    x through contiguous copies that live through the call: the results of contiguous inputs, bit for bit, each from a
    call the kernel made."""
    if not cpu_kernel().on:
        pytest.skip(f"CPU kernel {cpu_kernel().status()}")
    from mhcrun.model import Carry

    model = models(tiny_fp8)[0]
    model.opts.cpu = cpu_kernel()
    block, d, n = model.layers[1], model.cfg.dim, model.cfg.hc_mult
    g = torch.Generator().manual_seed(rows)
    c = Carry(torch.randn(rows, 1, n, d, generator=g), torch.randn(rows, 1, d, generator=g),
              torch.rand(rows, 1, n, generator=g), torch.rand(rows, 1, n, n, generator=g) / n)
    ids = torch.randint(0, model.cfg.vocab_size, (rows, 1), generator=g)
    with torch.inference_mode():
        want = block.ffn_half_in_one_call(c, ids)
        got = block.ffn_half_in_one_call(Carry(*(strided(t) for t in c)), ids)
        assert want is not None and got is not None
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        x = torch.randn(rows, d, generator=g)
        want = block.ffn.forward_in_one_call(x, ids.view(-1))
        got = block.ffn.forward_in_one_call(strided(x), ids.view(-1))
        assert want is not None and got is not None and torch.equal(got, want)


def test_a_decode_step_that_compiles_runs_outside_the_step_scope(tiny_fp8):
    """A compiled-regions decode step whose graphs compile (the first here: no compile ahead) runs outside a step's
    parallel region, where torch's compile has both cores, and so does the next (the decoder's last step compiled);
    from then on the steps, which compile nothing, run inside."""
    from mhcrun.generate import Stepper

    if not cpu_kernel().on:
        pytest.skip(f"CPU kernel {cpu_kernel().status()}")
    model = models(tiny_fp8)[0]
    model.opts.cpu = cpu_kernel()
    model.setup_caches(1, 64)
    decoder = RegionDecoder(model, "regions", "aot_eager")
    st, scoped = Stepper(model, 8, decoder), []
    st.scope = qgemv.StepScope(model.opts.cpu.library, 2)
    run = st.scope.run
    st.scope.run = lambda fn: scoped.append(decoder.graph_count()) or run(fn)
    with torch.inference_mode():
        st.prefill(0, [0, 5, 6])
        for t in range(4):
            st.decode([0], [t + 7])
    assert scoped == [decoder.graph_count()] * 2 and decoder.graph_count() > 0


def test_a_step_scope_raises_its_steps_error_after_the_region_and_runs_on():
    """A step's exception leaves `StepScope.run` as it was raised, once the parallel region has ended (no hang), and
    the scope runs the next step; a step within a step runs as it is (on the one region's threads)."""
    if not cpu_kernel().on:
        pytest.skip(f"CPU kernel {cpu_kernel().status()}")
    scope = qgemv.StepScope(cpu_kernel().library, 2)

    def fails():
        raise ValueError("a step failed")

    with pytest.raises(ValueError, match="a step failed"):
        scope.run(fails)
    assert scope.run(lambda: 5) == 5
    assert scope.run(lambda: scope.run(lambda: 7)) == 7


def test_a_step_scope_frees_its_state_when_collected():
    """A scope's C++ state (mhc_scope_new's) is freed once, when the scope is collected."""
    if not cpu_kernel().on:
        pytest.skip(f"CPU kernel {cpu_kernel().status()}")
    scope = qgemv.StepScope(cpu_kernel().library, 2)
    assert scope.run(lambda: 3) == 3
    free = scope.free
    assert free.alive
    del scope
    gc.collect()
    assert not free.alive


def test_threads_that_sleep_leave_the_step_scope_off(monkeypatch):
    """A run whose idle OpenMP threads sleep (OMP_WAIT_POLICY=passive: two processes sharing the cores, as the suite's
    workers) runs no step in a scope, whose worker spins through a step; other runs with the kernel do."""
    from mhcrun.settings import Env

    assert Env.read({"OMP_WAIT_POLICY": "PASSIVE"}).threads_sleep
    assert not Env.read({"OMP_WAIT_POLICY": "active"}).threads_sleep and not Env.read({}).threads_sleep
    assert not cpu_kernel().reads_ahead  # the suite's kernel: conftest sets OMP_WAIT_POLICY=PASSIVE
    if not cpu_kernel().on:
        pytest.skip(f"CPU kernel {cpu_kernel().status()}")
    assert qgemv.open_cpu_kernel(replace(Env.read(), threads_sleep=False)).reads_ahead


# within rounding of their references (sums in another order)
ROUNDING_STEPS = ("attend", "attend_decode", "index_topk", "compress_step", "route", "moe_routed")
KERNEL_STEPS = {name: getattr(qgemv.CpuKernel, name) for name in (*BITWISE_STEPS, *ROUNDING_STEPS)}  # as defined


# the layer steps whose one call makes a one-call step's call among its own (`CpuKernel.ffn_half`, ...): off with it
CONTAINING = {"route": ("moe_step", "ffn_half"), "moe_routed": ("moe_step", "ffn_half"),
              "rope_tail": ("attn_project", "attn_output", "attend_output", "index_queries", "store_entries"),
              "attend_decode": ("attend_output",),
              "fp4_simulate": ("index_queries",), "hadamard": ("index_queries", "store_entries"),
              "kv_fp8_encode": ("store_entries",), "kv_fp4_encode": ("store_entries",)}


def small_steps(monkeypatch, names: tuple[str, ...], on: bool) -> dict[str, int]:
    """The CPU kernel's one-call steps `names` counted as they run (on), or declining so that torch runs (off); either
    way the layer steps that contain one decline, so that the modules make their calls."""
    calls = dict.fromkeys(names, 0)
    for layer_step in {c for name in names for c in CONTAINING.get(name, ())}:
        monkeypatch.setattr(qgemv.CpuKernel, layer_step, lambda self, *args, **kw: None)
    for name in names:
        def counted(self, *args, _f=KERNEL_STEPS[name], _n=name, **kw):
            out = _f(self, *args, **kw) if on else None
            calls[_n] += out is not None
            return out
        monkeypatch.setattr(qgemv.CpuKernel, name, counted)
    return calls


DECODE_PROMPTS = [[0, 5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]]


@torch.inference_mode()
def test_eager_decode_bitwise_small_steps_give_the_torch_ops_logits(tiny_fp8, monkeypatch):
    """Eager decode with the CPU kernel's bitwise one-call steps (RoPE, kv cache coding, FP4 rounding, the window
    mask: `model.eager_first`) gives bit for bit the logits of the same decode on their torch references (attention
    on torch in both), with the quantisation simulation on: 30 steps of 2 rows at different positions, across the
    window's edge (16) and the compressors' group edges (4, 16)."""
    if not cpu_kernel().on:
        pytest.skip(f"CPU kernel {cpu_kernel().status()}")
    small_steps(monkeypatch, ROUNDING_STEPS, on=False)
    calls = small_steps(monkeypatch, BITWISE_STEPS, on=True)
    fast = decode_logits(tiny_fp8, DECODE_PROMPTS, 30)
    assert all(calls.values()), calls  # every one-call step ran
    small_steps(monkeypatch, BITWISE_STEPS, on=False)
    ref = decode_logits(tiny_fp8, DECODE_PROMPTS, 30)
    for step, (f, r) in enumerate(zip(fast, ref, strict=True)):
        assert torch.equal(f, r), f"step {step}"


@torch.inference_mode()
@pytest.mark.parametrize("name", ROUNDING_STEPS)
def test_eager_decode_rounding_calls_are_within_rounding(tiny_fp8, monkeypatch, name):
    """Each one-call step that is within rounding of its reference, inside the model's decode, the others on their
    references in both runs: the attention (`CpuKernel.attend`) against sparse_attn, a decode step's attention on
    the caches where they lie (`CpuKernel.attend_decode`) against the chunk path, the indexer's scores and top-k
    (`CpuKernel.index_topk`) against index_scores + select_topk, a compressor's step that closes a group
    (`CpuKernel.compress_step`) against compress_chunk, the gate (`CpuKernel.route`) against gate_scores + route,
    the routed and shared experts (`CpuKernel.moe_routed`) against their GEMVs and swiglu. Without the FP8 simulation
    (which can turn a last-bit difference into a flipped FP8 rounding, as any summation order can: docs/quantized.md)
    the logits stay within rounding over 30 steps of 2 rows across the window's and the groups' edges; with it, the
    first steps agree as closely (the steps that read the FP8 and FP4 caches where they lie run only with it)."""
    if not cpu_kernel().on:
        pytest.skip(f"CPU kernel {cpu_kernel().status()}")
    others = tuple(n for n in ROUNDING_STEPS if n != name)
    for quant_sim, steps in ((False, 30), (True, 8)):
        if not quant_sim and name in ("index_topk", "attend_decode"):  # plain caches take the reference
            continue
        small_steps(monkeypatch, others, on=False)
        calls = small_steps(monkeypatch, (name,), on=True)
        fast = decode_logits(tiny_fp8, DECODE_PROMPTS, steps, quant_sim)
        assert calls[name] > 0
        small_steps(monkeypatch, (name,), on=False)
        ref = decode_logits(tiny_fp8, DECODE_PROMPTS, steps, quant_sim)
        for step, (f, r) in enumerate(zip(fast, ref, strict=True)):
            torch.testing.assert_close(f, r, rtol=1e-4, atol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")


def test_mid_size_kept_quantised_matches_dequantised(mid2):
    """Full-width mid-size shapes (FP8 block 128, e8m0 scales, 64 FP4 experts) through the CLI with --layers."""
    args = ("-m", mid2, "--layers", 2, "--prompt-ids", "0,5,6,7,8,9,10", "-n", 6, "--ignore-eos")
    kept = gen_json(*args)[0]
    ref = gen_json(*args, "--dequantize")[0]
    assert kept["tokens"] == ref["tokens"]
    r = cli("generate", "-m", mid2, "-n", 2)  # only 2 of the config's 4 layers are in the checkpoint
    user_error(r, "layers.2.", "missing", "holds no layer 2", "--layers 2")
    user_error(cli("info", "-m", mid2), "--layers 2")


def test_layers_runs_the_first_n_layers(tiny_fp8):
    full = gen_json("-m", tiny_fp8, "--prompt-ids", "0,5,6", "-n", 8)[0]
    one = gen_json("-m", tiny_fp8, "--prompt-ids", "0,5,6", "-n", 8, "--layers", 1)[0]
    ck = load_checkpoint(tiny_fp8, 1)
    model = build_model(ck.config, ck.tensors, ck.quantized, n_layers=1)
    assert len(model.layers) == 1
    want = generate(model, [[0, 5, 6]], 8, eos_id=-1)[0].tokens
    assert one["tokens"][:len(want)] == want[:len(one["tokens"])] and one["tokens"] != full["tokens"]


@pytest.mark.parametrize("layers", [0, 5, -1])
def test_layers_out_of_range(layers):
    user_error(cli("generate", "--layers", layers, "-n", 1), "--layers", "4 layers")


# ---------------------------------------------------------------------------------------------- memory plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_plan_matches_what_is_built(tiny_fp8, dtype):
    plan = plan_checkpoint(tiny_fp8)
    for dequantize in (False, True):
        mp = plan_memory(plan, plan.config.n_layers, batch=3, context=64, dtype=dtype, dequantize=dequantize,
                         available=1 << 40)
        ck = load_checkpoint(tiny_fp8, dequantize=dequantize)
        model = build_model(ck.config, ck.tensors, ck.quantized, dtype)
        model.setup_caches(3, 64)
        state = sum(t.nbytes for t in model.state().values())
        assert mp.state["kv_cache"] + mp.state["compressor_state"] + mp.state["indexer_cache"] == state
        assert mp.state["rope_tables"] == sum(t.nbytes for f in model.rope.values() for t in f)
        weights = [t for m in model.modules() if isinstance(m, Linear) for t in (m.w.data, m.w.scale)
                   if t is not None]
        tensors = list(model.parameters()) + weights
        made = sum(t.nbytes for t in tensors if t.untyped_storage().resizable())  # torch allocations
        mapped = sum(plan.bytes_by_dtype.values())
        assert mp.weights == (made if dequantize else mapped + made), dequantize
        assert mp.total == mp.weights + sum(mp.state.values()) + mp.activations + mp.runtime and mp.fits


def test_state_bytes_of_flash_shapes():
    """V4-Flash's state by hand: 2 window layers, a CSA and an HCA layer, batch 2, context 8192, bf16."""
    from mhcrun.config import load_config
    from mhcrun.memory import state_bytes

    cfg = load_config(MID.parent / "v4-flash.json")
    state = state_bytes(cfg, 4, 2, 8192, torch.bfloat16, quant_sim=False)
    # window layers 0, 1: [2, 128, 512] bf16 each; CSA layer 2: window + 8192/4 entries, indexer 8192/4 x 128;
    # each compressed cache has one spare slot (the groups a chunk leaves open are written there)
    assert state["kv_cache"] == 2 * (2 * 128 * 512 * 2) + 2 * (128 + 2049) * 512 * 2 + 2 * (128 + 65) * 512 * 2
    assert state["indexer_cache"] == 2 * 2049 * 128 * 2
    # with the simulation on the cache stores what it rounds to: an entry is 448 e4m3 bytes, 7 fp32 scales and 64
    # bf16 rope values (604 bytes instead of 1024); an indexer key 64 bytes of e2m1 pairs and 4 fp32 scales
    fp8 = state_bytes(cfg, 4, 2, 8192, torch.bfloat16)
    assert fp8["kv_cache"] == 2 * (2 * 128 * 604) + 2 * (128 + 2049) * 604 + 2 * (128 + 65) * 604
    assert fp8["indexer_cache"] == 2 * 2049 * 80


def test_info_prints_the_memory_plan(mid2):
    r = cli("info", "-m", mid2, "--layers", 2, "--context", 1024, "--batch", 2, "--json")
    ok(r)
    mp = json.loads(r.stdout)["memory_plan"]
    disk = sum(f.stat().st_size for f in mid2.glob("*.safetensors"))
    assert mp["layers"] == 2 and mp["batch"] == 2 and mp["context"] == 1024
    assert {"float8_e4m3fn", "float8_e8m0fnu", "int8", "bfloat16"} <= set(mp["disk_by_dtype"])
    assert 0.99 * disk < mp["disk_bytes"] <= disk  # the shards minus their headers
    assert mp["disk_bytes"] < mp["weights_bytes"] < 1.1 * mp["disk_bytes"]
    assert mp["state_bytes"]["kv_cache"] > 0 and mp["total_bytes"] > mp["weights_bytes"]
    r = cli("info", "-m", mid2, "--layers", 2, "--dequantize", "--json")
    assert json.loads(r.stdout)["memory_plan"]["weights_bytes"] > 3 * mp["disk_bytes"]
    r = cli("info", "-m", mid2, "--layers", 2)
    ok(r)
    assert "memory plan" in r.stdout and "kv cache" in r.stdout and "fits" in r.stdout


def test_generate_refuses_a_plan_over_budget_unless_forced(tiny_fp8):
    line = user_error(cli("generate", "-m", tiny_fp8, "-n", 2, "--memory-limit", "100MB"), "memory plan",
                      "--force", "available")
    assert "95.37 MiB" in line  # the limit given, in the plan's units
    ok(cli("generate", "-m", tiny_fp8, "-n", 2, "--memory-limit", "100MB", "--force"))
    ok(cli("generate", "-m", tiny_fp8, "-n", 2, "--memory-limit", "4GiB"))


def test_info_context_defaults_to_the_models_maximum_and_is_checked():
    r = cli("info", "--json")  # the tiny model's maximum is 512 tokens
    ok(r)
    assert json.loads(r.stdout)["memory_plan"]["context"] == 512
    for args, says in ((("--context", 513), "error: --context must be in [1, 512] (the model's maximum), got 513"),
                       (("--context", 0), "error: --context must be in [1, 512] (the model's maximum), got 0"),
                       (("--batch", 0), "error: --batch must be >= 1, got 0")):  # the bad option alone
        r = cli("info", *args)
        assert r.exit_code == 2 and r.stderr.splitlines() == [says], r.stderr


@pytest.mark.parametrize("text,want", [("24G", 24 * 10**9), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000),
                                       ("100000", 100000), (" 2 kib ", 2048)])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "abc", "12XB", "-1G", "0"])
def test_bad_memory_limit(text):
    user_error(cli("generate", "-n", 1, "--memory-limit", text), "--memory-limit")


# ---------------------------------------------------------------------------------------------- bad input


def rewrite(ckpt: Path, name: str, tensor: torch.Tensor) -> None:
    index = json.loads((ckpt / INDEX_FILE).read_text())
    shard = ckpt / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensor
    save_file(tensors, shard, metadata={"format": "pt"})


def copy_of(src: Path, dst: Path) -> Path:
    import shutil

    return Path(shutil.copytree(src, dst))


def test_scale_shape_mismatch_is_one_line(tiny_fp8, tmp_path):
    d = copy_of(tiny_fp8, tmp_path / "ck")
    rewrite(d, f"{WQ}.scale", torch.ones(3, 3).to(torch.float8_e8m0fnu))
    user_error(cli("generate", "-m", d, "-n", 1), f"{WQ}.scale", "shape [3, 3]", "expected [2, 4]")


def test_block_size_disagreeing_with_scales_is_one_line(tiny_fp8, tmp_path):
    d = copy_of(tiny_fp8, tmp_path / "ck")
    raw = json.loads((d / "config.json").read_text())
    raw["quantization_config"]["weight_block_size"] = [64, 64]
    (d / "config.json").write_text(json.dumps(raw))
    user_error(cli("generate", "-m", d, "-n", 1), "fits FP8 block size 32", "weight_block_size is 64")
    user_error(cli("info", "-m", d), "fits FP8 block size 32")


def test_fp4_odd_inner_size_is_one_line(tiny_fp8, tmp_path):
    d = copy_of(tiny_fp8, tmp_path / "ck")
    raw = json.loads((d / "config.json").read_text())
    raw["moe_intermediate_size"] = 63
    (d / "config.json").write_text(json.dumps(raw))
    user_error(cli("generate", "-m", d, "-n", 1), "FP4 inner size 63 is odd")


def test_kept_quantised_compiled_regions_match_eager(tiny_fp8, gemv_path):
    """Inductor graphs over kept-quantised weights (e8m0 scales passed as bytes) give the eager tokens, with the
    fused kernel as an op in the graphs (routed experts read in place) and with the dequantisation traced. The
    kernel on two layers (window attention with the hash MoE, CSA with the routed one: every GEMM kind and both
    expert sets, four graphs fewer to compile than the whole model's); the traced dequantisation, the same code for
    every FP8 / FP4 weight, on the first (FP8 projections, FP4 experts, the grouped output projection)."""
    torch._dynamo.reset()  # graphs traced under the other path must not be reused
    kept, _ = models(tiny_fp8, n_layers=2 if gemv_path.on else 1)
    kept.opts.cpu = gemv_path
    prompts = PROMPTS[:2]
    eager = generate(kept, prompts, 6, eos_id=1, ignore_eos=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = generate(kept, prompts, 6, eos_id=1, ignore_eos=True, graph_mode="regions", backend="inductor")
    assert not [w for w in caught if "compile failed" in str(w.message)]  # really compiled, no eager fallback
    assert [r.tokens for r in compiled] == [r.tokens for r in eager]


def test_kept_experts_read_in_place_compile_one_graph_per_kind(tiny_fp8):
    """With the fused kernel each layer's routed experts enter the graphs as their addresses (an int64 tensor per
    weight, a graph input like the layer's other tensors): one graph per region kind serves all of its layers
    (moe:routed: three), and the compiled steps give the uncompiled ones' logits."""
    kernel = cpu_kernel()
    if not kernel.on:
        pytest.skip(f"CPU kernel {kernel.status()}")
    torch._dynamo.reset()
    runs = []
    for backend in ("aot_eager", None):
        model, _ = models(tiny_fp8)
        model.opts.cpu = kernel
        model.setup_caches(2, 64)
        dec = RegionDecoder(model, "regions" if backend else "eager", backend)
        assert all(isinstance(b.ffn.gathered[w], ExpertSet) for b in model.layers for w in ("w1", "w2", "w3"))
        tokens, steps = torch.tensor([3, 7]), []
        for pos in range(3):
            steps.append(dec(tokens, torch.full((2,), pos)))
            tokens = steps[-1].argmax(-1)
        runs.append((dec, torch.stack(steps)))
    (compiled, got), (_, want) = runs
    assert len(compiled.layers_of["moe:routed"]) == 3
    assert all(s.graphs == 1 and s.fallback is None for s in compiled.stats), compiled.stats
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_macs_per_token_counts_the_models_gemms(tiny_fp8):
    """decode_macs_per_token (bench_cpu_peer's prefill rate) from the checkpoint's plan equals the GEMMs the
    built model runs for one token: its Linear modules (routed experts at n_activated / n_routed), the gates and
    the hc mixes' fn."""
    from mhcrun.memory import decode_macs_per_token
    from mhcrun.model import Gate, Linear

    ck = load_checkpoint(tiny_fp8)
    model = build_model(ck.config, ck.tensors, ck.quantized)
    share = ck.config.n_activated_experts / ck.config.n_routed_experts
    want = 0.0
    for name, mod in model.named_modules():
        if isinstance(mod, Linear):
            want += mod.w.out_features * mod.w.in_features * (share if ".experts." in name else 1)
        elif isinstance(mod, Gate):
            want += mod.weight.numel()
    want += sum(t.numel() for name, t in model.named_parameters() if name.endswith("_fn"))
    want += sum(t.numel() for name, t in model.named_buffers() if name.endswith("_fn"))
    assert decode_macs_per_token(plan_checkpoint(tiny_fp8)) == int(want)
