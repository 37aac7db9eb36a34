"""Compiled decode by regions (`mhcrun.regions`): the stages equal the eager model, a region kind compiles one
graph whatever the layer count and never recompiles, a failed region compile falls back to eager alone, and the
inductor-compiled path gives the eager path's tokens (generate, golden-check, compile-regions, the CLI switches).

Structural tests compile with the cheap "aot_eager" backend (same ATen graphs, no code generation); the real
inductor tests share one shape set (batch 3, INDUCTOR_PROMPTS, INDUCTOR_NEW tokens) and the bundled model, as does
the README's compile-regions example, so that torch's compile cache serves the later compiles of identical graphs
(within one test for certain; across tests when another worker compiled them first).
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import CLI, cpu_kernel
from torch._dynamo.utils import counters

from mhcrun.cli import app
from mhcrun.config import config_from_hf
from mhcrun.errors import InputError
from mhcrun.generate import generate
from mhcrun.model import Cache, RMSNorm, build_model
from mhcrun.ops import kvcache
from mhcrun.regions import runner as regions_runner
from mhcrun.regions.runner import RegionDecoder
from mhcrun.tiny import init_tensors, tiny_config_raw

ALL_KINDS = {"attn:window", "attn:csa", "attn:hca", "moe:hash", "moe:routed", "head"}
MIXED = [0, 4, 16, 4]  # every attention kind; layer 0 is the hash-MoE layer (num_hash_layers 1)
PROMPT_LENGTHS = (1, 6, 37)
STRUCT_BACKEND = "aot_eager"
GOLDEN = Path(__file__).resolve().parent / "golden" / "tiny.json"



# ---------------------------------------------------------------------------------------------- helpers


def make_model(ratios: list[int], quant_sim: bool = True, seed: int = 0):
    raw = dict(tiny_config_raw(), compress_ratios=ratios, num_hidden_layers=len(ratios))
    cfg = config_from_hf(raw)
    model = build_model(cfg, init_tensors(cfg, seed), set())
    model.opts.quant_sim = quant_sim
    return model


def make_prompts(lengths=PROMPT_LENGTHS, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[0] + torch.randint(3, 512, (n - 1,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def prefill(model, prompts: list[list[int]], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh caches for the batch, each prompt prefilled eagerly into its row -> (first tokens [B], pos [B])."""
    model.setup_caches(len(prompts), max(map(len, prompts)) + steps + 1)
    first = [int(model(torch.tensor([p]), torch.tensor([r]))[0].argmax()) for r, p in enumerate(prompts)]
    return torch.tensor(first), torch.tensor([len(p) for p in prompts])


def snapshot(model) -> dict:
    return {k: v.clone() for k, v in model.state().items()}


def state_values(model, state: dict) -> dict[str, torch.Tensor]:
    """State buffers as values: each cache's parts (FP8/FP4 codes and scales) decoded, the rest as they are."""
    out = {k: v for k, v in state.items() if k.endswith("_state")}
    for name, m in model.named_modules():
        if isinstance(m, Cache):
            parts = {p: state[f"{name}.{p}"] for p in m.parts()}
            out[name] = kvcache.decode(m.fmt, parts, torch.float32)
    return out


@torch.inference_mode()
def restore(model, snap: dict) -> None:
    """In place: the modules hold these very buffers."""
    state = model.state()
    for k, v in snap.items():
        state[k].copy_(v)


@torch.inference_mode()
def greedy_steps(step, tokens: torch.Tensor, pos: torch.Tensor, steps: int, after_first=None):
    """Run `steps` greedy decode steps of every row through step(tokens, pos) -> logits [B, V];
    -> (logits per step, tokens fed per step)."""
    logits, fed = [], []
    for i in range(steps):
        fed.append(tokens.clone())
        out = step(tokens, pos + i).clone()
        logits.append(out)
        tokens = out.argmax(-1)
        if i == 0 and after_first is not None:
            after_first()
    return logits, fed


def dynamo_counts() -> dict[str, int]:
    """What grows when dynamo traces a frame (a first compile or a recompile) or breaks a graph."""
    return {"calls_captured": counters["stats"]["calls_captured"], "unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


def region_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, RuntimeWarning) and "region" in str(w.message)]


def cli(*args: object, env: dict[str, str | None] | None = None):
    return CLI.invoke(app, [str(a) for a in args], env=env)


def ok(result) -> None:
    assert result.exit_code == 0, f"exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


# ---------------------------------------------------------------------------------------------- 1. stages == model


@pytest.mark.parametrize("quant_sim", [False, True], ids=["no-quant-sim", "quant-sim"])
def test_uncompiled_stages_equal_eager_decode_every_step(quant_sim):
    """RegionDecoder(mode="eager") runs the region stages uncompiled; from the same cache state and the same
    tokens it gives the eager model's decode logits at every step, and leaves the same cache state."""
    model = make_model(MIXED, quant_sim)
    steps = 24  # row 0 crosses the window (16) and an HCA group (16); row 2 closes CSA and HCA groups
    tokens, pos = prefill(model, make_prompts(), steps)
    start = snapshot(model)
    rows = torch.arange(len(pos))
    ref, fed = greedy_steps(lambda t, p: model(t.view(-1, 1), rows, p), tokens, pos, steps)
    ref_state = snapshot(model)

    restore(model, start)
    dec = RegionDecoder(model, "eager", None)
    bound = 1e-2 if quant_sim else 1e-4  # as tests/test_model.py: FP8/FP4 rounding boundaries with the simulation
    with torch.inference_mode():
        for i in range(steps):
            got = dec(fed[i], pos + i)
            assert got.shape == ref[i].shape
            worst = (got - ref[i]).abs().max().item()
            assert worst < bound, f"step {i}: region stages differ from the eager decode by {worst}"
    assert set(dec.kinds) == ALL_KINDS
    got, want = state_values(model, snapshot(model)), state_values(model, ref_state)
    assert got.keys() == want.keys()
    for name in want:  # -inf score slots compare equal; cache codes compare decoded
        torch.testing.assert_close(got[name], want[name], atol=bound, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert all(s.graphs == 0 for s in dec.stats)  # nothing was compiled


def test_static_path_takes_a_chunk_of_several_tokens_per_row():
    """The decoder's fixed-shape path on a chunk of 3 tokens per row (rows at different positions, some
    closing compressed groups inside the chunk) gives the eager chunk's logits and state."""
    model = make_model(MIXED)
    _, pos = prefill(model, make_prompts(), 8)
    start = snapshot(model)
    chunk = torch.randint(3, 512, (len(pos), 3), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want = model(chunk, torch.arange(len(pos)), pos).clone()
        want_state = state_values(model, snapshot(model))
        restore(model, start)
        got = RegionDecoder(model, "eager", None)(chunk, pos)
    assert (got - want).abs().max().item() < 1e-2
    got_state = state_values(model, snapshot(model))
    for name in want_state:
        torch.testing.assert_close(got_state[name], want_state[name], atol=1e-2, rtol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_compiled_regions_run_the_modules_own_code(monkeypatch):
    """A change to one module's computation (RMSNorm scaled by 1.5) changes eager and compiled decode alike:
    the graphs are traced from the modules' forward, not from a second formulation of them. Two layers (window
    attention with the hash MoE, CSA with the routed one) show it for every module kind."""
    model = make_model([0, 4])
    tokens, pos = prefill(model, make_prompts(), 2)
    start = snapshot(model)
    rows = torch.arange(len(pos))

    def eager_and_compiled():
        with torch.inference_mode():
            restore(model, start)
            eager = model(tokens.view(-1, 1), rows, pos).clone()
            restore(model, start)
            dec = RegionDecoder(model, "regions", STRUCT_BACKEND)
            compiled = dec(tokens, pos).clone()
        assert all(s.graphs == 1 and s.fallback is None for s in dec.stats), dec.stats
        return eager, compiled

    eager, compiled = eager_and_compiled()
    original = RMSNorm.forward
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x: 1.5 * original(self, x))
    eager2, compiled2 = eager_and_compiled()
    assert (eager2 - eager).abs().max().item() > 1e-2  # the change does show in the logits
    assert (compiled - eager).abs().max().item() < 1e-4
    assert (compiled2 - eager2).abs().max().item() < 1e-4


# ---------------------------------------------------------------------------------------------- 2. graph structure


def compiled_run(ratios: list[int], stages: str, steps: int):
    """Compile `ratios` by regions with aot_eager and decode `steps` greedy steps, watching dynamo's counters."""
    model = make_model(ratios)
    tokens, pos = prefill(model, make_prompts(), steps)
    start = snapshot(model)
    dec = RegionDecoder(model, "regions", STRUCT_BACKEND, stages)
    marks = {}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        marks["before"] = dynamo_counts()
        logits, fed = greedy_steps(dec, tokens, pos, steps, lambda: marks.update(first=dynamo_counts()))
        marks["last"] = dynamo_counts()
    return {"model": model, "dec": dec, "logits": logits, "fed": fed, "pos": pos, "start": start,
            "marks": marks, "warnings": region_warnings(record)}


@pytest.fixture(scope="module")
def whole3():
    return compiled_run([0, 4, 16], "whole", 20)


@pytest.fixture(scope="module")
def split3():
    return compiled_run([0, 4, 16], "split", 20)


def test_a_cpu_graphs_wrapper_calls_the_ops_c_shims_and_includes_only_what_its_precompiled_header_holds():
    """A CPU graph's C++ wrapper calls the kernel's ops by their C shims (`regions.shims`), not through the
    dispatcher (whose headers and IValue stacks took g++ seconds a graph), and g++ parses no header for it that
    the header inductor precompiles (`wrapper_header`) leaves out: every header a wrapper includes is in
    cpp_wrapper_headers.h, and its precompiled form is what the compile made."""
    import re

    from torch._inductor.codecache import _HEADER_DIR, CppWrapperCodeCache
    from torch._inductor.utils import run_and_get_code

    from mhcrun.ops.qlinear import matmul
    from mhcrun.ops.qweight import QWeight
    from mhcrun.regions.runner import WRAPPER_HEADERS, GraphStats, counting_backend, wrapper_header

    torchs = CppWrapperCodeCache._get_uncompiled_header("cpu")
    with wrapper_header():
        assert CppWrapperCodeCache._get_uncompiled_header("cpu") == str(WRAPPER_HEADERS)
        assert CppWrapperCodeCache._get_uncompiled_header("cuda") != str(WRAPPER_HEADERS)
    assert CppWrapperCodeCache._get_uncompiled_header("cpu") == torchs  # torch's own outside a compile
    kernel = cpu_kernel()
    if not kernel.ops:
        pytest.skip(f"CPU kernel {kernel.status()}: no ops, no C++ wrapper")
    g = torch.Generator().manual_seed(0)
    w = QWeight(torch.randn(64, 96, generator=g).bfloat16()).checked()
    x = torch.randn(96, generator=g)

    def f(x: torch.Tensor) -> torch.Tensor:
        return matmul(x.sin().view(1, 1, 96), w, kernel) + 1

    stats = GraphStats("test", "whole")
    compiled = torch.compile(f, backend=counting_backend("inductor", stats, cpp_wrapper=True), fullgraph=True)
    with torch._inductor.config.patch(fx_graph_cache=False):  # generate the code, not load it
        y, codes = run_and_get_code(compiled, x)
    assert stats.wrapper == "C++" and stats.fallback is None and (y - f(x)).abs().max().item() < 1e-5
    included = set(re.findall(r"#include <([^>]+)>", "\n".join(codes)))
    held = set(re.findall(r"#include <([^>]+)>", WRAPPER_HEADERS.read_text()))
    code = "\n".join(codes)
    assert "aoti_torch_cpu_qgemv_native(" in code and "callBoxed" not in code, code
    assert included <= held, f"precompile these too: {sorted(included - held)}"
    made = [h for h in Path(_HEADER_DIR).glob("*.h") if str(WRAPPER_HEADERS) in h.read_text()]
    assert any(h.with_name(h.name + ext).exists() for h in made for ext in (".gch", ".pch")), made


def test_a_c_shims_declaration_follows_its_ops_schema():
    """inductor writes a shim's declaration into each wrapper as given: each argument by inductor's calling
    convention for its type, each output a handle written through a pointer; an op returning other than tensors has
    none."""
    from mhcrun.regions.shims import declaration

    schema = torch._C.parse_schema("f(Tensor(a!) t, Tensor? o, int i, float x, bool b, str s) -> (Tensor, Tensor)")
    assert declaration("f", schema) == ("AOTITorchError aoti_torch_cpu_f(AtenTensorHandle t, AtenTensorHandle* o, "
                                        "int64_t i, double x, int32_t b, const char* s, AtenTensorHandle* out0, "
                                        "AtenTensorHandle* out1)")
    with pytest.raises(TypeError, match="tensors only"):
        declaration("g", torch._C.parse_schema("g(Tensor t) -> int"))


def test_each_c_shim_in_torch_ops_takes_what_its_declaration_from_the_schema_says():
    """A wrapper calls a shim by the declaration inductor was given (`shims.c_shims`, from the op's schema) and the
    linker finds it by name alone: the parameter types torch_ops.cpp defines for each shim are those, in order."""
    import re

    from mhcrun.ops.qgemv import NATIVE_OPS, TORCH_OPS
    from mhcrun.regions.shims import c_shims

    kernel = cpu_kernel()
    if not kernel.ops:
        pytest.skip(f"CPU kernel {kernel.status()}: no ops")

    def types(params: str) -> list[str]:  # each parameter's type, its name dropped
        return [" ".join(p.split()[:-1]) for p in params.split(",")]

    defined = {name: types(params) for name, params in
               re.findall(r"MHCRUN_SHIM aoti_torch_cpu_(\w+)\(([^)]*)\)", TORCH_OPS.read_text())}
    declared = {re.search(r"aoti_torch_cpu_(\w+)\(", d).group(1): types(re.search(r"\((.*)\)", d).group(1))
                for decls in c_shims().values() for d in decls}
    assert set(declared) == set(NATIVE_OPS)
    assert defined == declared


def test_a_graph_compiled_with_c_shims_raises_the_ops_own_error_and_is_served_from_the_compile_cache(tmp_path):
    """An op's error passes through its shim and the wrapper as through the dispatcher: the graph's call raises the
    op's own message, and each call is recorded under the op's name for torch's profiler (the benchmarks' breakdown
    of a step). The shims' table keys inductor's compile cache by their declarations (an op does not pickle, and a
    setting that does not pickle turns the cache off): a second compile of the graph is a cache hit."""
    import pickle

    from mhcrun.regions.runner import GraphStats, counting_backend
    from mhcrun.regions.shims import c_shims

    kernel = cpu_kernel()
    if not kernel.ops:
        pytest.skip(f"CPU kernel {kernel.status()}: no ops, no C++ wrapper")
    table = c_shims()
    assert pickle.loads(pickle.dumps(table)) == "\n".join(sorted(d for ds in table.values() for d in ds))
    data = torch.randn(8, 16).bfloat16()

    def f(x: torch.Tensor, library: str) -> torch.Tensor:
        return torch.ops.mhcrun.qgemv_native(x.view(1, 1, 16) * 2, data, None, 0, 1, library, kernel.isa) + 1

    x = torch.randn(16)
    want = torch.ops.mhcrun.qgemv_native(x.view(1, 1, 16) * 2, data, None, 0, 1, kernel.library, kernel.isa) + 1
    missing = str(tmp_path / "missing.so")
    with torch._inductor.config.patch(fx_graph_cache=True, fx_graph_remote_cache=False), \
            pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
        for attempt in range(2):
            torch._dynamo.reset()
            stats = GraphStats("test", "whole")
            compiled = torch.compile(functools.partial(f, library=kernel.library), fullgraph=True,
                                     backend=counting_backend("inductor", stats, cpp_wrapper=True))
            torch.testing.assert_close(compiled(x), want, rtol=0, atol=0)
            assert stats.wrapper == "C++" and stats.fallback is None
            assert stats.cache_hits == attempt, f"compile {attempt + 1}: {stats.cache_hits} cache hits"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            compiled(x)
        assert "mhcrun::qgemv_native" in {e.key for e in prof.key_averages()}  # recorded as the dispatcher would
        torch._dynamo.reset()
        failing = torch.compile(functools.partial(f, library=missing), fullgraph=True,
                                backend=counting_backend("inductor", GraphStats("test", "whole"), cpp_wrapper=True))
        with pytest.raises(RuntimeError, match="cannot open the kernel library .*missing.so"):
            failing(x)


def assert_no_recompiles(run) -> None:
    dec, marks = run["dec"], run["marks"]
    assert not run["warnings"], run["warnings"]
    for s in dec.stats:
        assert s.fallback is None, f"{s.region} [{s.stages}] fell back to eager: {s.fallback}"
        assert s.graphs == 1, f"{s.region} [{s.stages}] compiled {s.graphs} graphs over {len(run['logits'])} steps"
    first, last = marks["first"], marks["last"]
    assert first["unique_graphs"] > marks["before"]["unique_graphs"]  # the counters do see the first compiles
    assert last == first, f"dynamo traced again after the first step: {first} -> {last}"
    assert last["graph_breaks"] == marks["before"]["graph_breaks"]


def test_whole_regions_compile_once_and_never_recompile(whole3):
    dec = whole3["dec"]
    assert len(whole3["logits"]) >= 20
    assert {s.region for s in dec.stats} == ALL_KINDS
    assert all(s.stages == "post+pre+core" for s in dec.stats if s.region != "head")
    assert dec.graph_count() == len(ALL_KINDS)
    assert_no_recompiles(whole3)
    # dynamo saw exactly one graph per region kind: no graph breaks split a region
    marks = whole3["marks"]
    assert marks["first"]["unique_graphs"] - marks["before"]["unique_graphs"] == len(ALL_KINDS)


def test_aot_eager_regions_equal_uncompiled_stages(whole3):
    """The compiled graphs compute what the stages compute (same ATen ops: near bit-equal)."""
    model, pos = whole3["model"], whole3["pos"]
    restore(model, whole3["start"])
    dec = RegionDecoder(model, "eager", None)
    with torch.inference_mode():
        for i, (fed, want) in enumerate(zip(whole3["fed"], whole3["logits"], strict=True)):
            worst = (dec(fed, pos + i) - want).abs().max().item()
            assert worst < 1e-4, f"step {i}: compiled regions differ from the stages by {worst}"


def test_compiled_regions_count_the_hc_kernels_the_eager_step_counts(whole3):
    """stats.kernels of a compiled step (whose torch-path hc steps cannot count themselves inside a graph) equal the
    same step's uncompiled: per layer two hc_post_pre launches (a site's pre fused with the post step before it,
    the embedding's expand being the first), the last post and hc_head at the head, no unfused kernel."""
    model, pos, fed = whole3["model"], whole3["pos"], whole3["fed"][0]
    counts = {}
    for label, dec in (("eager", RegionDecoder(model, "eager", None)), ("regions", whole3["dec"])):
        restore(model, whole3["start"])
        model.opts.hc.reset()
        with torch.inference_mode():
            dec(fed, pos)
        counts[label] = model.opts.hc.stats()
    restore(model, whole3["start"])
    eager, n = counts["eager"], len(model.layers)
    assert counts["regions"] == eager
    assert eager["hc_post_pre"]["torch"] == 2 * n and eager["hc_post"]["torch"] == eager["hc_head"]["torch"] == 1
    assert all(sum(eager[k].values()) == 0 for k in ("hc_mixes", "hc_collapse", "hc_pre", "hc_expand")), eager


def test_compiled_steps_count_the_kernels_the_forward_launches_on_each_backend(whole3):
    """A compiled step's hc calls cannot count themselves inside its graphs on the torch path, the CPU kernel's or
    the real kernels (neuron): the decoder counts them per step, as the forward launches them: a hc_post_pre per layer
    half up to 32 rows (hc_post then hc_pre above), the head's hc_post and hc_head; on the simulator the custom ops
    count themselves, so the decoder adds nothing."""
    from mhcrun.nki.ops import HcBackend

    model, kept = whole3["model"], whole3["model"].opts.hc
    dec, sites = RegionDecoder(model, "regions", "inductor"), 2 * len(model.layers)
    try:
        for rows, want in ((3, {"hc_post_pre": sites, "hc_post": 1}), (32, {"hc_post_pre": sites, "hc_post": 1}),
                           (33, {"hc_post": sites + 1, "hc_pre": sites})):
            for device, backend in (("neuron", "nki"), ("cpu", "torch")):
                model.opts.hc = HcBackend(cpu=kept.cpu)
                dec.count_hc_calls(rows, device)
                got = {k: v[backend] for k, v in model.opts.hc.stats().items() if v[backend]}
                assert got == {**want, "hc_head": 1}, (rows, device, got)
        kernel = cpu_kernel()
        if kernel.on:  # the CPU kernel's graphs call its C++ for the post+pre step (its op, where loaded), torch else
            model.opts.hc = HcBackend(cpu=kernel)
            dec.count_hc_calls(3, "cpu")
            stats = model.opts.hc.stats()
            on = "cpu" if kernel.ops else "torch"
            assert stats["hc_post_pre"][on] == sites and stats["hc_post"]["torch"] == stats["hc_head"]["torch"] == 1
            assert sum(sum(v.values()) for v in stats.values()) == sites + 2
        model.opts.hc = HcBackend(sim="exact", cpu=kept.cpu)
        dec.count_hc_calls(3, "cpu")
        assert not any(sum(v.values()) for v in model.opts.hc.stats().values())
    finally:
        model.opts.hc = kept


def test_steps_of_a_shape_seen_before_skip_guard_evaluation(monkeypatch):
    """A step whose shapes and probe an earlier step had (`step_key`) runs without dynamo's guard evaluation; a step of
    a new shape (chunks of 2 tokens a row after single tokens) is guarded: its regions compile graphs of their own
    rather than run the single-token ones, and it gives the uncompiled stages' logits."""
    model = make_model([0, 4])
    tokens, pos = prefill(model, make_prompts(), 8)
    chunk = torch.randint(3, 512, (len(pos), 2), generator=torch.Generator().manual_seed(5))
    start = snapshot(model)
    with torch.inference_mode():
        dec = RegionDecoder(model, "eager", None)
        dec(tokens, pos), dec(tokens, pos + 1)
        want = dec(chunk, pos + 2).clone()
    restore(model, start)
    skips, set_stance = [], torch.compiler.set_stance

    def spy(*args, **kw):
        skips.append(kw.get("skip_guard_eval_unsafe", False))
        return set_stance(*args, **kw)

    monkeypatch.setattr(torch.compiler, "set_stance", spy)
    dec = RegionDecoder(model, "regions", STRUCT_BACKEND)
    with torch.inference_mode():
        dec(tokens, pos), dec(tokens, pos + 1)
        assert skips == [False, True]
        assert all(s.graphs == 1 for s in dec.stats), [(s.region, s.graphs) for s in dec.stats]
        got = dec(chunk, pos + 2)
        assert skips[-1] is False
        assert all(s.graphs == 2 for s in dec.stats), [(s.region, s.graphs) for s in dec.stats]
        assert (got - want).abs().max().item() < 1e-4
        dec(chunk, pos + 4)
    assert skips[-1] is True


def test_later_steps_call_their_graphs_without_dynamo_and_compute_what_dynamo_computes(monkeypatch):
    """After a step whose every region ran with dynamo's guards, a step of the same key calls each region's graph
    directly (`DirectCall`: no frame of the compiled function runs) on every layer (window, CSA and HCA attention,
    hash and routed MoE, the head), over the window's and a compression group's edges, and gives bitwise the logits
    and state of the same steps through dynamo (the direct calls refused: `DirectCall.learn` -> None)."""
    model = make_model([0, 4, 8])
    tokens, pos = prefill(model, make_prompts(), 12)
    start = snapshot(model)

    def run(direct: bool):
        restore(model, start)
        dec = RegionDecoder(model, "regions", STRUCT_BACKEND)
        frames = []
        with torch.inference_mode():
            out = greedy_steps(dec, tokens, pos, 1)[0]
            for group in dec.groups:  # count the calls that enter dynamo from now on
                fn = group.fn
                group.fn = lambda *a, fn=fn: frames.append(1) or fn(*a)
            out += greedy_steps(dec, out[-1].argmax(-1), pos + 1, 11)[0]
        learnt = [d for g in dec.groups for d in g.direct.values()]
        return out, snapshot(model), frames, learnt

    got, got_state, frames, learnt = run(True)
    assert len(learnt) == 6 and all(d is not None for d in learnt), learnt
    assert not frames, f"{len(frames)} region calls went through dynamo"
    with monkeypatch.context() as m:
        m.setattr(regions_runner.DirectCall, "learn", staticmethod(lambda *a: None))
        want, want_state, frames, _ = run(False)
    assert len(frames) == 11 * (2 * 3 + 1)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for k in want_state:
        assert torch.equal(got_state[k], want_state[k]), k


def test_a_decoder_takes_the_new_buffers_after_the_caches_are_set_up_again():
    """Direct calls find a module's weights and state once (`DirectCall.fixed`): caches set up again (new buffers)
    start the decoder afresh, so steps on other prompts afterwards give what a new decoder gives, not steps on the
    old buffers."""
    model = make_model([0, 4])
    first = prefill(model, make_prompts(), 6)
    dec = RegionDecoder(model, "regions", STRUCT_BACKEND)
    greedy_steps(dec, *first, 4)
    tokens, pos = prefill(model, make_prompts(seed=9), 6)
    start = snapshot(model)
    got = greedy_steps(dec, tokens, pos, 4)[0]
    restore(model, start)
    want = greedy_steps(RegionDecoder(model, "regions", STRUCT_BACKEND), tokens, pos, 4)[0]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


class Scaled(torch.nn.Module):
    """A toy region's module: a weight and a Python number (a constant of its graph)."""

    def __init__(self, c: float, seed: int):
        super().__init__()
        self.c, self.calls = c, 0
        self.w = torch.nn.Parameter(torch.randn(8, generator=torch.Generator().manual_seed(seed)), requires_grad=False)


def scaled(m: Scaled, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * m.w + m.c, x


def counted(m: Scaled, x: torch.Tensor) -> torch.Tensor:
    m.calls += 1  # a side effect dynamo replays after the graph
    return x * m.w


@pytest.mark.parametrize("case", ["same graph", "other graph", "side effect"])
def test_a_direct_call_is_made_only_where_it_does_what_dynamo_does(case):
    """A region kind's later calls skip dynamo only where every layer of the guarded step ran the same graph and the
    frame did nothing but call it: layers whose Python constants differ (dynamo compiled a graph each) keep dynamo's
    choice of graph, and a frame with a side effect (an attribute set) keeps it happening; a direct call finds each
    layer's own weights and passes an input through as dynamo does."""
    mods = [Scaled(1.0, 0), Scaled(1.0 if case == "same graph" else 2.0, 1)]
    step: list = [None]
    group = regions_runner.CompiledGroup(regions_runner.GraphStats("toy", "whole"),
                                         counted if case == "side effect" else scaled, STRUCT_BACKEND, None,
                                         step=lambda: step[0])
    x = torch.randn(8)
    with torch.inference_mode():
        step[0] = ("key", False)  # the guarded step: every layer's call
        for m in mods:
            group(m, x)
        step[0] = ("key", True)
        for m in mods:
            out = group(m, x)
            if case == "side effect":
                assert torch.equal(out, x * m.w) and m.calls == 2
            else:
                assert torch.equal(out[0], x * m.w + m.c) and out[1] is x
    assert (group.direct["key"] is not None) == (case == "same graph")


def aliased(m: Scaled, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * m.w, m.w[:4]  # a view of an input: AOT's wrapper makes it again after the graph


def doubled(m: Scaled, x: torch.Tensor) -> torch.Tensor:
    x.mul_(2)  # an input mutated: inside inductor's code
    return x * m.w + m.c


@pytest.mark.parametrize("case", ["plain", "input mutated", "aliased output"])
def test_a_direct_call_runs_inductors_code_below_aots_wrappers_only_where_they_have_nothing_to_do(case, monkeypatch):
    """Where AOT's wrappers of an inductor graph passed it the very inputs and returned its very outputs at the guarded
    call, a direct call calls inductor's code itself (no `CompiledFxGraph` call): results as dynamo's, an input
    mutated in place as there. An output that is a view of an input (AOT makes it again after the graph) keeps the
    wrappers, and the view they make."""
    from torch._inductor.output_code import CompiledFxGraph

    fn = {"plain": scaled, "input mutated": doubled, "aliased output": aliased}[case]
    mods = [Scaled(1.0, 0), Scaled(1.0, 1)]
    step: list = [None]
    group = regions_runner.CompiledGroup(regions_runner.GraphStats("toy", "whole"), fn, "inductor", None,
                                         step=lambda: step[0])
    with torch.inference_mode():
        step[0] = ("key", False)
        for m in mods:
            group(m, torch.randn(8))
        direct = group.direct["key"]
        assert direct is not None and (direct.inner is None) == (case == "aliased output")
        wrapped = []
        plain = CompiledFxGraph.__call__
        monkeypatch.setattr(CompiledFxGraph, "__call__", lambda g, inputs: wrapped.append(1) or plain(g, inputs))
        step[0] = ("key", True)
        for m in mods:
            x = torch.randn(8)
            x0 = x.clone()
            out = group(m, x)
            if case == "plain":
                assert torch.equal(out[0], x0 * m.w + m.c) and out[1] is x
            elif case == "input mutated":
                assert torch.equal(x, 2 * x0) and torch.equal(out, 2 * x0 * m.w + m.c)
            else:
                assert torch.equal(out[0], x0 * m.w) and out[1]._base is m.w and torch.equal(out[1], m.w[:4])
    assert len(wrapped) == (2 if case == "aliased output" else 0)


def test_graph_count_does_not_grow_with_layers(whole3):
    nine = [0, 4, 16, 4, 16, 4, 16, 4, 16]
    run = compiled_run(nine, "whole", 3)
    dec = run["dec"]
    assert dec.graph_count() == whole3["dec"].graph_count() == len(ALL_KINDS)
    assert_no_recompiles(run)
    layers = {s.region: s.layers for s in dec.stats}
    assert layers == {"attn:window": [0], "attn:csa": [1, 3, 5, 7], "attn:hca": [2, 4, 6, 8], "moe:hash": [0],
                      "moe:routed": list(range(1, 9)), "head": [9]}


def test_split_plan_compiles_two_graphs_per_kind_without_recompiles(split3):
    dec = split3["dec"]
    by_kind: dict[str, list[str]] = {}
    for s in dec.stats:
        by_kind.setdefault(s.region, []).append(s.stages)
    assert set(by_kind) == ALL_KINDS
    for kind, stages in by_kind.items():
        assert stages == (["head"] if kind == "head" else ["post+pre", "core"]), kind
    assert dec.graph_count() == 2 * (len(ALL_KINDS) - 1) + 1
    assert_no_recompiles(split3)


def test_split_plan_computes_what_whole_computes(whole3, split3):
    for i, (a, b) in enumerate(zip(whole3["logits"], split3["logits"], strict=True)):
        assert (a - b).abs().max().item() < 1e-4, f"step {i}"


def test_unknown_stage_plan_is_an_input_error():
    from mhcrun.settings import RunSettings

    with pytest.raises(InputError, match="unknown --stages 'bogus'"):
        RunSettings(stages="bogus")


def test_split_stages_of_an_eager_run_are_refused_not_ignored():
    from mhcrun.settings import RunSettings

    with pytest.raises(InputError, match=r"--stages split cuts compiled regions, and this run is eager"):
        RunSettings(stages="split")
    RunSettings(stages="split", graph_mode="regions")
    r = CLI.invoke(app, ["generate", "--prompt", "hi", "-n", "1", "--stages", "split"])
    assert r.exit_code == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.strip() == ("error: --stages split cuts compiled regions, and this run is eager (--graph-mode "
                                "regions compiles them)")


# ---------------------------------------------------------------------------------------------- 3. fallback


def failing_backend(monkeypatch, region: str, stages: str | None = None) -> list:
    """Make the compile of `region` (optionally only its stage group `stages`) fail; -> the GraphStats made."""
    real = regions_runner.counting_backend
    made = []

    def counting_backend(backend, stats, *options):
        made.append(stats)
        inner = real(backend, stats, *options)

        def compile_fn(gm, example_inputs):
            if stats.region == region and stages in (None, stats.stages):
                raise RuntimeError(f"simulated compile failure in {stats.region}")
            return inner(gm, example_inputs)

        return compile_fn

    monkeypatch.setattr(regions_runner, "counting_backend", counting_backend)
    return made


@pytest.mark.parametrize("mode", ["eager", "regions"])
def test_warmup_decode_step_leaves_the_tokens_as_they_were(mode):
    """`generate(..., warmup=True)` (a prompt and a decode step after it, untimed; a compiled step runs every row)
    clears what its step wrote: three rows at different positions take the tokens of a run without it, eager and by
    compiled regions; a compiled run reports the warmup's step apart as compile time, its decode rate from the timed
    steps."""
    model, prompts = make_model(MIXED), make_prompts()
    kw = dict(graph_mode=mode, backend=STRUCT_BACKEND) if mode == "regions" else {}
    want = generate(model, prompts, 8, eos_id=1, ignore_eos=True, record_topk=2, **kw)
    got = generate(model, prompts, 8, eos_id=1, ignore_eos=True, record_topk=2, warmup=True, **kw)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.top_logprobs for r in got] == [r.top_logprobs for r in want]
    assert got[0].stats["decode_tok_s"] > 0 and got[0].stats["compile_s"] >= 0


@pytest.mark.parametrize("ratios,stages,failing", [(MIXED, "whole", None), ([4], "split", "core")],
                         ids=["whole", "split-core"])
def test_failed_region_compile_falls_back_to_eager_for_that_region_alone(monkeypatch, ratios, stages, failing):
    made = failing_backend(monkeypatch, "attn:csa", failing)
    model = make_model(ratios)
    prompts = make_prompts()
    want = [r.tokens for r in generate(model, prompts, 12, eos_id=1, ignore_eos=True)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = generate(model, prompts, 12, eos_id=1, ignore_eos=True, graph_mode="regions",
                       backend=STRUCT_BACKEND, stages=stages)
    assert [r.tokens for r in got] == want
    assert "attn:csa" in {s.region for s in made}
    msgs = region_warnings(record)
    assert len(msgs) == 1, msgs  # once for the group, though it runs for every CSA layer (1 and 3 of MIXED)
    assert "attn:csa" in msgs[0] and "compile failed" in msgs[0]
    if failing:
        assert f"stage {failing}" in msgs[0]
    for s in made:
        if s.region == "attn:csa" and failing in (None, s.stages):
            assert s.fallback, f"{s.region} [{s.stages}] has no fallback recorded"
        else:
            assert s.fallback is None, f"{s.region} [{s.stages}] fell back too: {s.fallback}"
            assert s.graphs == 1, f"{s.region} [{s.stages}] compiled {s.graphs} graphs"


# ---------------------------------------------------------------------------------------------- 4, 5. inductor

INDUCTOR_PROMPTS = [[0], [0, 17, 99, 3, 250, 41], [0] + list(range(5, 48))]  # 1, 6, 44 tokens
INDUCTOR_NEW = 20
# every inductor compile here sees these shapes (batch 3, a context of 64, a cache of 256), as does the README's
# compile-regions example (tests/test_examples.py): identical graphs, which torch's FX graph cache compiles once
INDUCTOR_CONTEXT = max(map(len, INDUCTOR_PROMPTS)) + INDUCTOR_NEW
assert INDUCTOR_CONTEXT == 64


@pytest.fixture(scope="module")
def tiny_runner():
    """The bundled model, as the CLI tests here run it: one set of graphs for every inductor test (its greedy
    margins over these prompts are at least 2e-3, far above the compiled path's last-bit differences)."""
    from mhcrun.runner import load_runner

    return load_runner(None)


def test_inductor_regions_equal_eager_in_generate_and_golden_check(tiny_runner, prompts_file, tmp_path):
    """Inductor-compiled regions give the eager tokens (generate, rows at different positions), then golden-check
    through them passes on a golden file the eager path recorded: the same shapes (batch 3, INDUCTOR_CONTEXT), so
    torch's compile cache serves the CLI run's graphs."""
    kw = {"eos_id": 1, "ignore_eos": True}
    eager = generate(tiny_runner.model, INDUCTOR_PROMPTS, INDUCTOR_NEW, **kw)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        regions = generate(tiny_runner.model, INDUCTOR_PROMPTS, INDUCTOR_NEW, graph_mode="regions", **kw)
    assert not region_warnings(record), region_warnings(record)  # no region fell back to eager
    for i, (e, r) in enumerate(zip(eager, regions, strict=True)):
        assert r.tokens == e.tokens, f"prompt {i}"
    assert regions[0].stats["compile_s"] > 0 and eager[0].stats["compile_s"] == 0
    assert tiny_runner.model.max_seq == 256  # the context of 64 rounded up (regions_context), as compile-regions does

    golden = tmp_path / "golden.json"
    ok(cli("golden-record", "--prompts-file", prompts_file, "-n", INDUCTOR_NEW, "--out", golden))
    result = cli("golden-check", golden, "--graph-mode", "regions", "--json")
    ok(result)
    report = json.loads(result.stdout)
    assert report["graph_mode"] == "regions"
    assert "compile failed" not in result.stderr


def test_inductor_compile_regions_reports_one_graph_per_kind():
    result = cli("compile-regions", "--json", "--batch", len(INDUCTOR_PROMPTS), "--context", INDUCTOR_CONTEXT)
    ok(result)
    report = json.loads(result.stdout)
    assert report["graphs"] == len(ALL_KINDS) == 6 and report["context"] == 256  # rounded as a run rounds it
    assert report["layers"] == 4 and report["backend"] == "inductor" and report["stages"] == "whole"
    regions = report["regions"]
    assert {r["region"] for r in regions} == ALL_KINDS
    for r in regions:
        assert {"region", "layers", "stages", "compile_s", "graph_breaks", "cache_hit"} <= set(r), r
        assert r["graph_breaks"] == 0 and r["compile_s"] > 0 and isinstance(r["cache_hit"], bool), r
        assert r["stages"] == ("head" if r["region"] == "head" else "post+pre+core")
        # with the kernel's ops in C++ a graph's wrapper is C++ too: its calls run no Python (counting_backend)
        assert r["wrapper"] == ("C++" if cpu_kernel().ops else "Python"), r
    assert {r["region"]: r["layers"] for r in regions} == {
        "attn:window": [0], "attn:csa": [1, 3], "attn:hca": [2], "moe:hash": [0], "moe:routed": [1, 2, 3],
        "head": [4]}


def test_a_graph_runs_as_traced_until_its_wrapper_is_built():
    """A compile ahead's graph (`builds.built`) runs its traced graph while its wrapper builds, the compiled one once
    every build finished, and the traced one for good where a build failed (the decoder then falls back)."""
    from concurrent.futures import Future

    from mhcrun.regions.builds import built, failure

    pending, done, failed = Future(), Future(), Future()
    done.set_result(None)
    failed.set_exception(RuntimeError("g++ failed"))
    calls = []
    run = built(lambda x: calls.append(("compiled", x)), lambda x: calls.append(("traced", x)), [done, pending])
    run(1)
    pending.set_result(None)
    run(2)
    run(3)
    assert calls == [("traced", 1), ("compiled", 2), ("compiled", 3)]
    calls.clear()
    built(lambda x: calls.append("compiled"), lambda x: calls.append("traced"), [done, failed])(0)
    assert calls == ["traced"] and str(failure([done, failed])) == "g++ failed" and failure([done]) is None


def test_stopped_builds_end_their_compilers_and_drop_the_rest():
    """An interrupted compile ahead (`Builds.stop`) ends the compiler a running build waits on (a child of the
    worker; here `sleep`), and a build that was to start next (waiting on the first, as a graph's build waits for the
    header) never starts: the process can leave at once."""
    import subprocess
    import time

    from mhcrun.regions.builds import Builds

    builds, started = Builds({}), []

    def compile_for(seconds: int):
        started.append(seconds)
        subprocess.run(["sleep", str(seconds)], check=False)

    builds.submit(compile_for, 30)
    builds.submit(compile_for, 31)
    builds.submit(compile_for, 32)  # queued: two workers
    while len(started) < 2:
        time.sleep(0.01)
    t0 = time.perf_counter()
    builds.stop()
    assert time.perf_counter() - t0 < 5 and all(f.done() for f in builds.tasks)
    assert sorted(started) == [30, 31]  # the third never started
    left = subprocess.run(["pgrep", "-f", "^sleep 3[012]$"], capture_output=True, text=True).stdout.split()
    assert not left, left


def test_a_wrapper_that_fails_to_build_in_the_background_leaves_its_group_eager(tiny_runner, monkeypatch):
    """Compiled ahead, every graph's C++ wrapper builds in the background: where the build fails (g++'s error,
    simulated), the group runs eagerly, with one warning naming the error, and a run gives the eager tokens."""
    from torch._inductor.codecache import CppWrapperCodeCache
    from torch._inductor.utils import fresh_cache

    from mhcrun.generate import make_decoder

    if not cpu_kernel().ops:
        pytest.skip("no C++ wrappers without the kernel's ops")

    def fail(*args, **kwargs):
        raise RuntimeError("simulated g++ failure")

    model = tiny_runner.model
    want = [r.tokens for r in generate(model, INDUCTOR_PROMPTS[:1], 4, eos_id=1, ignore_eos=True)]
    monkeypatch.setattr(CppWrapperCodeCache, "load_pybinding", fail)
    model.setup_caches(1, 256)
    dec = make_decoder(model)
    with fresh_cache(), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dec.compile_ahead()
        got = [r.tokens for r in generate(model, INDUCTOR_PROMPTS[:1], 4, eos_id=1, ignore_eos=True,
                                          graph_mode="regions", decoder=dec)]
    msgs = region_warnings(record)
    assert len(msgs) == len(ALL_KINDS) and all("simulated g++ failure" in m for m in msgs), msgs
    assert all(s.fallback and s.graphs == 1 for s in dec.stats) and got == want


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("regions") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in INDUCTOR_PROMPTS))
    return path


def generate_json(prompts_file, env: dict[str, str | None]) -> list[dict]:
    result = cli("generate", "--prompts-file", prompts_file, "-n", INDUCTOR_NEW, "--ignore-eos", "--json", env=env)
    ok(result)
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def test_env_graph_mode_regions_is_honoured_by_generate(prompts_file):
    regions = generate_json(prompts_file, {"MHCRUN_GRAPH_MODE": "regions"})
    eager = generate_json(prompts_file, {"MHCRUN_GRAPH_MODE": None})
    assert len(regions) == len(eager) == len(INDUCTOR_PROMPTS)
    assert all(r["stats"]["compile_s"] > 0 for r in regions), [r["stats"] for r in regions]
    assert all(e["stats"]["compile_s"] == 0 for e in eager)  # so compile_s > 0 does tell the modes apart
    assert [r["tokens"] for r in regions] == [e["tokens"] for e in eager]


def test_unknown_env_graph_mode_exits_2():
    result = cli("generate", "--prompt-ids", "0,5,6", "-n", 3, env={"MHCRUN_GRAPH_MODE": "bogus"})
    assert result.exit_code == 2, f"exit {result.exit_code}\n{result.stdout}\n{result.stderr}"
    assert "bogus" in result.stderr and "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "0,5,6", "-n", "3"],
                                     ["golden-check", str(GOLDEN)], ["compile-regions"]],
                         ids=["generate", "golden-check", "compile-regions"])
def test_unknown_stages_value_exits_2(command):
    result = cli(*command, "--graph-mode", "regions", "--stages", "bogus") if command[0] != "compile-regions" \
        else cli(*command, "--stages", "bogus")
    assert result.exit_code == 2, f"exit {result.exit_code}\n{result.stdout}\n{result.stderr}"
    assert "bogus" in result.stderr and "--stages" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize("args,says", [
    (("--context", "513"), "error: --context must be in [2, 512] (the model's maximum), got 513"),
    (("--context", "1"), "error: --context must be >= 2, got 1"),
    (("--batch", "0"), "error: --batch must be >= 1, got 0")])
def test_compile_regions_refuses_a_context_the_model_cannot_take(args, says):
    """Before anything compiles: a context beyond the model's max_position_embeddings (512 for the bundled model),
    below 2, or no batch, one line, exit 2."""
    result = cli("compile-regions", *args)
    assert result.exit_code == 2, f"exit {result.exit_code}\n{result.stdout}\n{result.stderr}"
    assert result.stderr.splitlines() == [says]
    assert "Traceback" not in result.stdout + result.stderr


def test_regions_cache_lengths_round_so_that_runs_share_graphs():
    """A regions run's cache length (its graphs' shapes) is the context it needs rounded up: powers of two from
    256, multiples of 8,192 beyond, never past the model's context; eager runs take what they need. A generate in
    regions sets up that length, and compile-regions says which runs its graphs serve."""
    from mhcrun.cli import served
    from mhcrun.settings import cache_length, regions_context

    assert [regions_context(n, 65536) for n in (1, 45, 256, 257, 1000, 1024, 1025, 8192, 8193, 40000, 70000)] == \
        [256, 256, 256, 512, 1024, 1024, 2048, 8192, 16384, 40960, 65536]
    assert regions_context(45, 100) == 100 and cache_length(45, "eager", 65536) == 45
    assert cache_length(45, "regions", 65536) == 256
    assert served(256) == "runs of up to 256 prompt and new tokens"
    assert served(1024) == "runs of 513 to 1,024 prompt and new tokens"
    assert served(16384) == "runs of 8,193 to 16,384 prompt and new tokens"
    model = make_model([0, 4, 128, 4])
    for prompt in ([0, 5, 9], list(range(3, 40))):
        generate(model, [prompt], 3, 1, ignore_eos=True, graph_mode="regions", backend="aot_eager")
        assert model.max_seq == 256
    generate(model, [list(range(3, 40))], 3, 1, ignore_eos=True)
    assert model.max_seq == 40


@pytest.mark.parametrize("draft_tokens", [0, 2], ids=["decode", "verify"])
def test_compile_regions_compiles_the_graphs_a_run_then_runs(monkeypatch, draft_tokens):
    """compile_all (compile-regions) traces exactly the graphs a later run of the same batch and rounded context
    traces (the same code and input shapes: what torch's compile cache keys them by), for plain decode and for a
    speculative verify (whose compressors keep their chunk); aot_eager, the bundled model."""
    from mhcrun.runner import load_runner

    seen: list[tuple] = []
    real = regions_runner.counting_backend

    def recording(backend, stats, *options):
        inner = real(backend, stats, *options)

        def record(gm, example_inputs):
            seen.append((gm.code, tuple(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor))))
            return inner(gm, example_inputs)

        return record

    monkeypatch.setattr(regions_runner, "counting_backend", recording)
    model = load_runner(None, mtp=True).model
    regions_runner.compile_all(model, 1, 45, backend="aot_eager", draft_tokens=draft_tokens)
    ahead, seen[:] = sorted(seen), []
    generate(model, [[0, 5, 9, 14]], 6, 1, ignore_eos=True, graph_mode="regions", backend="aot_eager",
             draft_tokens=draft_tokens)
    assert len(ahead) == 6 and sorted(seen) == ahead


def test_a_verify_that_keeps_its_chunks_is_not_taken_for_one_that_does_not():
    """The decoder skips guard evaluation on a step like one it has guarded; a verify whose compressors keep their
    chunk (what speculate's rewind needs) is not like one whose do not, so its graphs are guarded (and compiled)
    apart and the chunks are kept."""
    from mhcrun.snapshot import keep_chunks

    model = make_model([0, 4, 128, 4])
    model.setup_caches(1, 64)
    dec = RegionDecoder(model, "regions", "aot_eager")
    tokens, pos = torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    dec.verify(tokens, pos)
    keep_chunks(model.layers, True)
    dec.verify(tokens, pos)
    assert all(m.chunk is not None for m in dec.compressors)
