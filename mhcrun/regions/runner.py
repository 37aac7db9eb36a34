"""Compiled decode by regions: one graph per region kind (and stage), reused by every layer of that kind.

Region kinds: `attn:window`, `attn:csa`, `attn:hca` (by compress ratio), `moe:hash`, `moe:routed`, `head`.
A layer's weights, its root state buffers and its row index are graph inputs, never constants, so the
43 layers of V4-Flash compile the same handful of graphs that 4 layers do. A stage whose compile fails runs
eagerly, with a warning naming it; the tokens do not change.
"""

from __future__ import annotations

import functools
import time
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from mhcrun.errors import InputError
from mhcrun.model import Block, Linear, Probe, Transformer, skip_probe
from mhcrun.nki import ops as hc_ops
from mhcrun.nki.ops import hc_expand
from mhcrun.ops import qgemv
from mhcrun.ops.qlinear import register_experts
from mhcrun.ops.quant import hadamard
from mhcrun.ops.qweight import QWeight
from mhcrun.regions.decode import STAGES, AttnSpec, HcSpec, HeadSpec, LinearSpec, MoeSpec
from mhcrun.weights import TensorSpec, layer_tensor_specs, tensor_specs

Linears = dict[str, LinearSpec]

# how the stages of each region are grouped into compiled graphs
STAGE_PLANS = {
    "whole": {"attn": [["mix", "core", "post"]], "moe": [["mix", "core", "post"]], "head": [["head"]]},
    "split": {"attn": [["mix"], ["core"], ["post"]], "moe": [["mix"], ["core"], ["post"]], "head": [["head"]]},
}


@dataclass
class GraphStats:
    """What one compiled graph (a region kind's stage group) did."""

    region: str
    stages: str
    layers: list[int] = field(default_factory=list)
    graphs: int = 0  # times the backend compiled a graph for it (1 = no recompiles)
    compile_s: float = 0.0
    cache_hits: int = 0
    fallback: str | None = None  # the compile error, when it runs eagerly


def default_backend(device: str) -> str:
    """inductor on cpu and cuda, the TorchNeuron backend on neuron (torch-neuronx imported lazily)."""
    if device == "neuron":
        try:
            import torch_neuronx  # noqa: F401
        except ImportError as e:
            raise InputError("--device neuron needs torch-neuronx (the Neuron pip repository)") from e
        return "neuron"
    return "inductor"


def clone_function(fn: Callable, name: str) -> Callable:
    """A copy of fn with its own code object, so torch's compile cache keeps it apart from other kinds."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def run_stages(stages: list[Callable], spec, carry: dict, inp: dict) -> dict:
    for stage in stages:
        carry = stage(spec, carry, inp)
    return carry


def region_function(stages: list[Callable], spec, name: str) -> Callable:
    """`run_stages` bound to one region kind, as a function with a code object of its own: torch's compile
    cache lives on the code object, so kinds never evict or recompile each other."""

    def region(carry: dict, inp: dict) -> dict:
        for stage in stages:
            carry = stage(spec, carry, inp)
        return carry

    return clone_function(region, name)


class CompiledGroup:
    """A group of stages of one region kind: compiled once, called for every layer of the kind."""

    def __init__(self, stats: GraphStats, stages: list[Callable], spec, backend: str | None, mode: str | None):
        self.stats, self.spec = stats, spec
        name = f"region_{stats.region.replace(':', '_')}_{stats.stages.replace('+', '_')}"
        self.eager = functools.partial(run_stages, stages, spec)
        if backend is None:
            self.fn = self.eager
            return
        self.fn = torch.compile(region_function(stages, spec, name), backend=counting_backend(backend, stats),
                                mode=mode, dynamic=False, fullgraph=True)

    def __call__(self, carry: dict, inp: dict) -> dict:
        if self.fn is self.eager:
            return self.eager(carry, inp)
        try:
            return self.fn(carry, inp)
        except Exception as e:  # a failed compile: this group runs eagerly from now on
            if self.stats.graphs and self.stats.fallback is None and not is_compile_error(e):
                raise
            self.stats.fallback = describe_error(e)
            warnings.warn(f"region {self.stats.region} stage {self.stats.stages}: compile failed "
                          f"({self.stats.fallback}); running it eagerly", RuntimeWarning, stacklevel=2)
            self.fn = self.eager
            return self.eager(carry, inp)


def counting_backend(backend: str, stats: GraphStats) -> Callable:
    """Wrap a torch.compile backend to count the graphs it compiles, their compile time and cache hits."""
    inner = torch._dynamo.lookup_backend(backend)

    def count(gm, example_inputs):
        stats.graphs += 1
        hits = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]
        t0 = time.perf_counter()
        out = inner(gm, example_inputs)
        stats.compile_s += time.perf_counter() - t0
        stats.cache_hits += torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"] - hits
        return out

    return count


def describe_error(e: BaseException) -> str:
    """One line naming a compile failure by its root cause (a backend error wraps the real one)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def is_compile_error(e: Exception) -> bool:
    return isinstance(e, (torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.Unsupported,
                          torch._dynamo.exc.TorchRuntimeError, torch._dynamo.exc.UserError))


def hc_spec(model: Transformer) -> HcSpec:
    c = model.cfg
    return HcSpec(c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps)


def region_inputs(model: Transformer, prefix: str, specs: list[TensorSpec]) -> tuple[dict[str, torch.Tensor], Linears]:
    """The tensors `specs` (all named under `prefix`) as graph inputs, keyed by their weights-table names after
    `prefix` less a final `.weight` (`attn.wq_a`, `attn_norm`, `ffn.gate.bias`): a Linear's weight as its data
    (plus `key.scale` when kept quantised) with what the graph needs to know of it (`LinearSpec`)."""
    w, linears = {}, {}
    for spec in specs:
        key = spec.name[len(prefix):].removesuffix(".weight")
        owner, _, leaf = spec.name.rpartition(".")
        module = model.get_submodule(owner)
        if isinstance(module, Linear):
            w[key] = module.w.data
            if module.w.scale is not None:
                w[f"{key}.scale"] = module.w.graph_scale()
            linears[key] = LinearSpec(module.w.block, module.w.kernel, module.act_quant)
        else:
            w[key] = getattr(module, leaf)
    return w, linears


def half_of(key: str) -> str:
    """The region family of a layer tensor (its name after `layers.i.`): the attention half or the MoE half."""
    return "attn" if key.startswith(("attn", "hc_attn")) else "moe"


def layer_inputs(model: Transformer, i: int, half: str) -> tuple[dict[str, torch.Tensor], Linears]:
    """Layer i's tensors of one half ("attn" or "moe"), from the weights table; routed experts as `expert_inputs`
    gives them; the mHC mixes' fn also split into bf16 hi + lo (`hc_{site}_fn_hi`, `_lo`) for the NKI kernels."""
    prefix = f"layers.{i}."
    block = model.layers[i]
    specs = [s for s in layer_tensor_specs(model.cfg, i) if s.expert is None and half_of(s.name[len(prefix):]) == half]
    w, linears = region_inputs(model, prefix, specs)
    site = "attn" if half == "attn" else "ffn"
    w |= {f"hc_{site}_fn_hi": block.fn_split[site][0], f"hc_{site}_fn_lo": block.fn_split[site][1]}
    if half == "moe":
        ew, el = expert_inputs(block)
        w |= ew
        linears |= el
    return w, linears


EXPERT_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # MoE -> {key: its experts' stack}


def expert_inputs(block: Block) -> tuple[dict[str, torch.Tensor], Linears]:
    """This rank's routed experts' weights (`ffn.experts.w1`, `.w2`, `.w3`) as graph inputs. Kept quantised on a
    CPU with the fused kernel: a handle per weight name (`ffn.experts.w1.set`, `qlinear.register_experts`), the
    experts read in place. Otherwise stacked [E, out, in] (and `.scale`s) once, the experts keeping views of the
    stack: kept-quantised weights are stacked as stored, so this copies their bytes."""
    experts = [block.ffn.experts[e] for e in block.ffn.owned]  # this rank's (all of them on one rank)
    out, linears = {}, {}
    for name in ("w1", "w2", "w3"):
        key = f"ffn.experts.{name}"
        lins = [getattr(e, name) for e in experts]
        first = lins[0].w
        linears[key] = LinearSpec(first.block, all(m.w.kernel for m in lins), lins[0].act_quant)
        if first.fmt != "float" and qgemv.takes(first, 1):
            out[f"{key}.set"] = register_experts(block, [m.w for m in lins])
            continue
        stacks = EXPERT_STACKS.setdefault(block.ffn, {})  # made once per layer, reused by every decoder
        if key not in stacks:  # the experts keep views of the stack, so their bytes are not held twice
            data = torch.stack([m.w.data for m in lins])
            scale = None if first.scale is None else torch.stack([m.w.scale for m in lins])
            for j, m in enumerate(lins):
                m.w = replace(m.w, data=data[j], scale=None if scale is None else scale[j], nan_free=None)
            stacks[key] = QWeight(data, scale, first.block)
        out[key] = stacks[key].data
        if first.scale is not None:
            out[f"{key}.scale"] = stacks[key].graph_scale()
    return out, linears


def head_inputs(model: Transformer) -> tuple[dict[str, torch.Tensor], Linears]:
    """The head region's tensors (every model-level one but the embedding), from the weights table."""
    specs = [s for s in tensor_specs(model.cfg, 0) if s.name != "embed.weight"]
    w, linears = region_inputs(model, "", specs)
    return w | {"hc_head_fn_hi": model.fn_split[0], "hc_head_fn_lo": model.fn_split[1]}, linears


def frozen(linears: Linears) -> tuple[tuple[str, LinearSpec], ...]:
    """A kind's LinearSpecs as a spec field (hashable, baked into the graph)."""
    return tuple(sorted(linears.items()))


def kind_linears(a: Linears, b: Linears) -> Linears:
    """Two layers' LinearSpecs for one region kind (one graph): the kernel only where both layers' weights take
    it."""
    return {k: replace(v, kernel=v.kernel and b[k].kernel) for k, v in a.items()}


class RegionDecoder:
    """Decode steps of a model whose caches are set up, as compiled regions (or eager stages).

    mode: "regions" (a graph per region kind and stage group), "step" (the whole step as one graph: the
    baseline regions are measured against) or "eager" (the same stage functions, uncompiled).
    """

    def __init__(self, model: Transformer, mode: str = "regions", backend: str | None = "inductor",
                 stages: str = "whole", cuda_graphs: bool = False):
        if stages not in STAGE_PLANS:
            raise InputError(f"unknown stage plan {stages!r} (choose from: {', '.join(STAGE_PLANS)})")
        self.model, self.mode = model, mode
        if model.device.type == "cpu":
            qgemv.available()  # build/load the fused GEMV kernel now: graphs decide on it while tracing
        c = model.cfg
        hadamard(torch.zeros(1, c.index_head_dim, device=model.device))  # fill its cache now, not while tracing
        hc = hc_spec(model)
        quant_sim, tp = model.opts.quant_sim, model.opts.tp
        freqs = model.freqs
        self.cos = {k: f.real.contiguous() for k, f in freqs.items()}
        self.sin = {k: f.imag.contiguous() for k, f in freqs.items()}
        self.layer_inputs: list[tuple[str, dict, str, dict]] = []  # (attn kind, attn inp, moe kind, moe inp)
        specs: dict[str, object] = {}
        linears_of: dict[str, Linears] = {}  # per region kind, over its layers
        layers_of: dict[str, list[int]] = {}
        row = {ratio: 0 for ratio in model.roots}
        for i, (block, (akind, mkind)) in enumerate(zip(model.layers, model.region_kinds, strict=True)):
            ratio = block.attn.ratio
            aw, al = layer_inputs(model, i, "attn")
            mw, ml = layer_inputs(model, i, "moe")
            for kind, lins in ((akind, al), (mkind, ml)):
                linears_of[kind] = kind_linears(linears_of[kind], lins) if kind in linears_of else lins
            freq_key = "compressed" if ratio else 0
            ainp = {"w": aw, "roots": model.roots[ratio], "layer": torch.tensor([row[ratio]], device=model.device),
                    "cos": self.cos[freq_key], "sin": self.sin[freq_key]}
            row[ratio] += 1
            self.layer_inputs.append((akind, ainp, mkind, {"w": mw}))
            layers_of.setdefault(akind, []).append(i)
            layers_of.setdefault(mkind, []).append(i)
        for block, (akind, mkind) in zip(model.layers, model.region_kinds, strict=True):
            a, ratio = block.attn, block.attn.ratio  # this rank's heads, o_groups and index heads under --tp
            specs[akind] = AttnSpec(ratio, c.window_size, a.n_heads, c.head_dim, c.rope_head_dim, a.n_groups,
                                    c.o_lora_rank, c.norm_eps, quant_sim, model.formats["kv"],
                                    model.formats["idx_kv"], model.max_seq, frozen(linears_of[akind]),
                                    a.indexer.n_heads if ratio == 4 else c.index_n_heads, c.index_head_dim,
                                    c.index_topk, c.index_head_dim ** -0.5 * c.index_n_heads ** -0.5, hc, tp)
            owned = block.ffn.owned
            specs[mkind] = MoeSpec(block.ffn.gate.hash, c.n_activated_experts, c.route_scale, c.score_func,
                                   c.swiglu_limit, c.norm_eps, quant_sim, frozen(linears_of[mkind]), hc,
                                   c.moe_inter_dim, (owned.start, owned.stop), tp)
        hw, hl = head_inputs(model)
        specs["head"] = HeadSpec(hc, frozen(hl), c.vocab_size, tp)
        layers_of["head"] = [len(model.layers)]
        self.head_inp = {"w": hw}
        self.specs = specs
        compile_backend = None if mode == "eager" else backend
        cg_mode = "reduce-overhead" if cuda_graphs else None
        self.groups: dict[str, list[CompiledGroup]] = {}
        self.stats: list[GraphStats] = []
        if mode == "step":
            self.step_stats = GraphStats("step", "all", list(range(len(model.layers) + 1)))
            self.stats.append(self.step_stats)
            fn = functools.partial(self.run_layers, self.eager_groups())
            self.step_fn = torch.compile(fn, backend=counting_backend(backend, self.step_stats), dynamic=False,
                                         fullgraph=True)
            return
        for kind, spec in specs.items():
            family = kind.split(":")[0]
            groups = []
            for names in STAGE_PLANS[stages][family]:
                fns = [dict(STAGES[family])[n] for n in names]
                stats = GraphStats(kind, "+".join(names), layers_of[kind])
                self.stats.append(stats)
                groups.append(CompiledGroup(stats, fns, spec, compile_backend, cg_mode))
            self.groups[kind] = groups

    def eager_groups(self) -> dict[str, list[Callable]]:
        out = {}
        for kind, spec in self.specs.items():
            family = kind.split(":")[0]
            out[kind] = [functools.partial(run_stages, [f for _, f in STAGES[family]], spec)]
        return out

    def inputs(self, tokens: torch.Tensor, pos: torch.Tensor) -> list[tuple[str, dict, str, dict]]:
        return [(ak, ai | {"pos": pos, "tokens": tokens}, mk, mi | {"tokens": tokens})
                for ak, ai, mk, mi in self.layer_inputs]

    def run_layers(self, groups: dict[str, list[Callable]], x: torch.Tensor, layer_inputs: list,
                   head_inp: dict, probe: Probe | None = None) -> torch.Tensor:
        """The layers' regions, then the head; `probe` sees each region's output (outside the graphs), under
        the eager model's names."""
        probe = probe or skip_probe
        for i, (akind, ainp, mkind, minp) in enumerate(layer_inputs):
            carry = {"x": x}
            for g in groups[akind]:
                carry = g(carry, ainp)
            probe(f"layer {i} {akind}", carry["x"])
            for g in groups[mkind]:
                carry = g(carry, minp)
            x = carry["x"]
            probe(f"layer {i} {mkind}", x)
        for g in groups["head"]:
            x = g({"x": x}, head_inp)
        probe("head", x["logits"])
        return x["logits"]

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, probe: Probe | None = None) -> torch.Tensor:
        """tokens [B], pos [B] (every cache row, B fixed) -> logits [B, vocab]; `probe` as the eager model's."""
        model = self.model
        x = hc_expand(model.embedding(tokens.view(-1, 1)), model.cfg.hc_mult)
        if probe is not None:
            probe("embed", x)
        layer_inputs = self.inputs(tokens, pos)
        if self.mode == "step":
            logits = self.step_fn(x, layer_inputs, self.head_inp)
        else:
            logits = self.run_layers(self.groups, x, layer_inputs, self.head_inp, probe)
        self.count_torch_hc_calls(tokens.device.type)
        return logits

    def count_torch_hc_calls(self, device_type: str) -> None:
        """hc steps on the torch path inside compiled graphs are not counted as they run (a counter in a
        graph would recompile it): count this step's here. The custom ops (simulator) count themselves."""
        if self.mode == "eager" or hc_ops.hc_backend(device_type) != "torch":
            return
        n = len(self.model.layers)
        for kernel, calls in (("hc_expand", 0), ("hc_mixes", 2 * n), ("hc_collapse", 2 * n), ("hc_post", 2 * n),
                              ("hc_head", 1)):
            hc_ops.record_calls(kernel, "torch", calls)

    def graph_count(self) -> int:
        return sum(s.graphs for s in self.stats)


def compile_all(model: Transformer, batch: int, context: int, stages: str = "whole", backend: str | None = None,
                on_progress: Callable[[int, int, str], None] | None = None) -> dict:
    """Compile every region kind of `model` for a decode batch and context, by running one decode step on
    fresh caches; report each graph (its first call's wall time: trace, compile and run)."""
    model.setup_caches(batch, context)
    backend = backend or default_backend(model.device.type)
    dec = RegionDecoder(model, "regions", backend, stages, cuda_graphs=model.device.type == "cuda")
    tokens = torch.zeros(batch, dtype=torch.long, device=model.device)
    pos = torch.zeros(batch, dtype=torch.long, device=model.device)
    first_call: dict[int, float] = {}
    total = len(dec.stats)

    def timed(group: CompiledGroup) -> Callable:
        def call(carry: dict, inp: dict) -> dict:
            t0 = time.perf_counter()
            out = group(carry, inp)
            key = id(group.stats)
            if key not in first_call:
                first_call[key] = time.perf_counter() - t0
                if on_progress:
                    on_progress(len(first_call), total, f"{group.stats.region} [{group.stats.stages}]")
            return out

        return call

    t0 = time.perf_counter()
    with torch.inference_mode():
        x = hc_expand(model.embedding(tokens.view(-1, 1)), model.cfg.hc_mult)
        groups = {kind: [timed(g) for g in gs] for kind, gs in dec.groups.items()}
        dec.run_layers(groups, x, dec.inputs(tokens, pos), dec.head_inp)
    total_s = time.perf_counter() - t0
    regions = [{"region": s.region, "layers": s.layers, "stages": s.stages,
                "compile_s": first_call.get(id(s), 0.0), "backend_compile_s": s.compile_s,
                "graph_breaks": 0 if s.fallback is None else None, "cache_hit": s.cache_hits > 0,
                "graphs": s.graphs, "fallback": s.fallback} for s in dec.stats]
    return {"backend": backend, "stages": stages, "graphs": dec.graph_count(), "layers": len(model.layers),
            "batch": batch, "context": context, "total_s": total_s, "regions": regions}
