"""Compiled decode by regions: the modules' own forward on its fixed-shape path (`static=True`), compiled one
graph per region kind and reused by every layer of that kind.

Region kinds: `attn:window`, `attn:csa`, `attn:hca` (by compress ratio), `moe:hash`, `moe:routed`, `head`.
`Transformer.forward` runs each layer half through `RegionDecoder.run`, which calls its kind's compiled
function with the layer's module as an argument: the module's tensors (weights and state buffers) are graph
inputs, never constants, so the 43 layers of V4-Flash compile the same handful of graphs that 4 layers do. A
group whose compile fails runs eagerly (the same code, uncompiled), with a warning naming it; the tokens do not
change. A layer half takes and returns a `Carry` (the streams with the last site's post step to do): its graph
runs that post step fused with its own site's pre step, then the sublayer. With the "split" stage plan each layer
half compiles as two graphs: the mHC post+pre step (`Block.enter`: the carried post, the mixes, collapse and the
sublayer's norm) and the sublayer.

A step of shapes an earlier step of the decoder had skips dynamo: on CPU each region calls the graph its kind compiled
for such a step directly (`DirectCall`: its inputs taken where dynamo took them, its result made as dynamo made it),
~35 us a call where dynamo's frame, guard lookup and bytecode took ~175 on a 2-core CPU, and, where AOT's wrappers of
the graph had nothing to do, inductor's code below them (~50 us more; BENCHMARKS.md, issue 20); elsewhere dynamo runs
it without evaluating its guards (~110 us instead of ~350).
"""

from __future__ import annotations

import contextlib
import time
import types
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch._inductor.config
from torch.utils._pytree import tree_flatten, tree_unflatten

from mhcrun.errors import InputError
from mhcrun.model import Attention, Block, Carry, Compressor, MoE, Probe, Transformer
from mhcrun.nki import ops as hc_ops
from mhcrun.ops.qgemv import MAX_ROWS
from mhcrun.regions.builds import Builds, built, failure
from mhcrun.regions.shims import c_shims
from mhcrun.settings import regions_context
from mhcrun.snapshot import keep_chunks


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
    wrapper: str = ""  # the language of its compiled wrapper (`counting_backend`): "C++" or "Python"
    first_call_s: float | None = None  # its first call's wall time: trace, compile and run
    builds: list[Future] = field(default_factory=list)  # its wrappers' builds in the background (`builds`)


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


def region_function(fn: Callable, name: str) -> Callable:
    """fn under a code object of its own: torch's compile cache lives on the code object, so kinds never evict
    or recompile each other."""

    def region(*args):
        return fn(*args)

    return clone_function(region, name)


class CompiledGroup:
    """One compiled function of a region kind (`fn(module, *args)`): compiled once, called for every layer of
    the kind with that layer's module."""

    def __init__(self, stats: GraphStats, fn: Callable, backend: str | None, mode: str | None,
                 cpp_wrapper: bool = False, builds: Callable[[], Builds | None] = lambda: None,
                 step: Callable[[], tuple | None] = lambda: None):
        self.stats, self.eager, self.step = stats, fn, step
        self.direct: dict[tuple, DirectCall | None] = {}  # by step key: the call to make, None where dynamo's
        self.seen: list | None = None  # while a call is watched: the graphs dynamo called, with what (`Graph`)
        if backend is None:
            self.fn = fn
            return
        name = f"region_{stats.region.replace(':', '_')}_{stats.stages.replace('+', '_')}"
        region = region_function(fn, name)
        self.globals = region.__globals__
        counting = counting_backend(backend, stats, cpp_wrapper, builds, lambda: self.seen)
        self.fn = torch.compile(region, backend=counting, mode=mode, dynamic=False, fullgraph=True)

    def __call__(self, *args):
        if self.stats.first_call_s is None:
            t0 = time.perf_counter()
            out = self.call(*args)
            self.stats.first_call_s = time.perf_counter() - t0
            return out
        return self.call(*args)

    def call(self, *args):
        if self.fn is self.eager:
            return self.eager(*args)
        step = self.step()  # (the step's key, whether its every region has run guarded), or None
        if step is not None and step[1] and (direct := self.direct.get(step[0])) is not None:
            return direct(args)
        watch = step is not None and not step[1]
        self.seen = [] if watch else None
        try:
            out = self.fn(*args)
        except Exception as e:  # a failed compile: this group runs eagerly from now on
            if self.stats.graphs and self.stats.fallback is None and not is_compile_error(e):
                raise
            self.fall_back(e)
            return self.eager(*args)
        finally:
            seen, self.seen = self.seen, None
        if watch:
            self.learn(step[0], args, seen, out)
        return out

    def learn(self, key: tuple, args: tuple, seen: list, out: Any) -> None:
        """A guarded call of step `key`: the call its later steps make (`DirectCall`), where every layer's call of
        the step ran the same graph, with inputs found where the graph's sources say and a result made alike;
        else they go through dynamo."""
        learnt = DirectCall.learn(seen[0], args, out, self.globals) if len(seen) == 1 else None
        if key not in self.direct:
            self.direct[key] = learnt
        elif not (learnt is not None and learnt.same(self.direct[key])):
            self.direct[key] = None

    def fall_back(self, e: BaseException) -> None:
        """A failed compile (or wrapper build): the group runs eagerly from now on, with a warning naming it."""
        self.stats.fallback = describe_error(e)
        warnings.warn(f"region {self.stats.region} stage {self.stats.stages}: compile failed "
                      f"({self.stats.fallback}); running it eagerly", RuntimeWarning, stacklevel=4)
        self.fn = self.eager


def counting_backend(backend: str, stats: GraphStats, cpp_wrapper: bool = False,
                     builds: Callable[[], Builds | None] = lambda: None,
                     watch: Callable[[], list | None] = lambda: None) -> Callable:
    """Wrap a torch.compile backend to count the graphs it compiles, their compile time and cache hits.
    `cpp_wrapper`: inductor writes each graph's wrapper (the code that allocates its buffers and calls its kernels and
    ops) in C++ rather than Python: with the kernel's ops in C++ (`CpuKernel.ops`) a call of the graph then runs no
    Python (BENCHMARKS.md: 15-25% off a CPU decode step; a cold compile takes longer). Its compiles skip inductor's
    build-and-load probe of each instruction set's vector headers (`vec_isa_ok`; ~5 s of a cold compile): the run's
    kernel, built by the same compiler with AVX2, AVX-512 and AMX code, and its ops, built against this torch and
    loaded, have shown what the probe shows; inductor still checks the instructions each set adds. `builds()`: the
    compile ahead's background builds (`mhcrun.regions.builds`), where one is under way. Each graph it returns is a
    `Graph`: while `watch()` gives a list, a call appends itself to it."""
    inner = torch._dynamo.lookup_backend(backend)
    stats.wrapper = "C++" if cpp_wrapper else "Python"
    patch = wrapper_config(cpp_wrapper)

    def count(gm, example_inputs):
        stats.graphs += 1
        hits = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]
        t0 = time.perf_counter()
        later = builds() if cpp_wrapper else None
        with torch._inductor.config.patch(patch), wrapper_header(), \
                (later.submitting() if later else contextlib.nullcontext([])) as futures:
            out = inner(gm, example_inputs)
        stats.compile_s += time.perf_counter() - t0
        stats.cache_hits += torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"] - hits
        stats.builds += futures
        return Graph(built(out, gm, futures) if futures else out, sources_of(gm), watch).call

    return count


def wraps_in_cpp(model: Transformer, backend: str | None) -> bool:
    """Whether the region graphs' wrappers are C++ (`counting_backend`): inductor on a CPU where the run loaded the
    kernel's ops in C++."""
    return backend == "inductor" and model.device.type == "cpu" and bool(model.opts.cpu.ops)


def wrapper_config(cpp_wrapper: bool) -> dict:
    """inductor's settings while a graph compiles (`counting_backend`) and its wrapper builds: a C++ wrapper calls
    the kernel's ops by their C shims (`mhcrun.regions.shims`; through the dispatcher where this torch has no such
    setting)."""
    if not cpp_wrapper:
        return {"cpp_wrapper": False}
    shims = hasattr(torch._inductor.config.aot_inductor, "custom_ops_to_c_shims")
    return {"cpp_wrapper": True, "cpp.vec_isa_ok": True} | (
        {"aot_inductor.custom_ops_to_c_shims": c_shims()} if shims else {})


WRAPPER_HEADERS = Path(__file__).with_name("cpp_wrapper_headers.h")


@contextlib.contextmanager
def wrapper_header():
    """While a graph compiles: the header inductor precompiles for a CPU graph's C++ wrapper is
    cpp_wrapper_headers.h, everything the wrapper includes, rather than torch's cpu.h alone: g++ no longer parses
    the kernels' vector headers (cpp_prefix.h) for every graph (BENCHMARKS.md; the header itself takes 6 s once a
    machine on a 2-core VM). The generated code and its flags are the same, so is what runs. Left as torch has it
    where torch has no such hook (another torch version)."""
    from torch._inductor.codecache import CppWrapperCodeCache

    torchs = getattr(CppWrapperCodeCache, "_get_uncompiled_header", None)
    if torchs is None:
        yield
        return

    def header(cls, device: str) -> str | None:
        return str(WRAPPER_HEADERS) if device.startswith("cpu") else torchs(device)

    with mock.patch.object(CppWrapperCodeCache, "_get_uncompiled_header", classmethod(header)):
        yield


def describe_error(e: BaseException) -> str:
    """One line naming a compile failure by its root cause (a backend error wraps the real one)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def is_compile_error(e: Exception) -> bool:
    return isinstance(e, (torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.Unsupported,
                          torch._dynamo.exc.TorchRuntimeError, torch._dynamo.exc.UserError))


def sources_of(gm: torch.fx.GraphModule) -> list[str] | None:
    """Where dynamo takes each input of the graph it is compiling: a Python expression over the frame's locals `L` and
    globals `G` (`L['args'][0]._parameters['hc_attn_fn']`); None where an input has none, or where the frame does
    more than call the graph and return what it gives: a side effect dynamo replays after it (a module's attribute
    set, e.g. a verify's compressor keeping its chunk) or one it cannot tell."""
    try:
        from torch._dynamo.variables.base import AttributeMutationNew, ValueMutationNew

        effects = torch._dynamo.symbolic_convert.InstructionTranslator.current_tx().output.side_effects
        made = (AttributeMutationNew, ValueMutationNew)  # objects the frame made (its result): no effect outside
        changed = [v for v in effects.id_to_variable.values() if effects.is_modified(v)]
        if effects.tensor_hooks or effects.save_for_backward or any(
                not isinstance(v.mutation_type, made) for v in changed):
            return None
    except Exception:  # not compiling under dynamo, or a torch without these
        return None
    sources = []
    for node in gm.graph.find_nodes(op="placeholder"):
        arg = node.meta.get("grapharg")
        if arg is None or arg.source is None:
            return None
        sources.append(arg.source.name)
    return sources


class Graph:
    """A graph the backend compiled (`counting_backend`), as dynamo calls it (`call`: its inputs in order -> its
    outputs), with its inputs' `sources_of`; while `watch()` gives a list, a call appends (graph, inputs, outputs)."""

    def __init__(self, fn: Callable, sources: list[str] | None, watch: Callable[[], list | None]):
        self.fn, self.sources, self.watch = fn, sources, watch

    def call(self, *inputs):
        if (seen := self.watch()) is None:
            return self.fn(*inputs)
        with inductor_calls() as ran:
            out = self.fn(*inputs)
        seen.append((self, inputs, out, ran))
        return out


@contextlib.contextmanager
def inductor_calls():
    """While a watched graph runs: the calls of inductor's compiled code below dynamo's graph and AOT's wrappers
    (`CompiledFxGraph`), as (the function it called, the inputs it gave, the outputs it returned); none where this
    torch has no such class."""
    ran: list[tuple[Callable, list, Any]] = []
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except ImportError:
        yield ran
        return
    plain = CompiledFxGraph.__call__

    def record(graph, inputs):
        given, fn = list(inputs), graph.current_callable  # (its callable clears the list it is given)
        out = plain(graph, inputs)
        ran.append((fn, given, out))
        return out

    with mock.patch.object(CompiledFxGraph, "__call__", record):
        yield ran


class DirectCall:
    """A region call of a step whose every region has run with dynamo's guards, made without dynamo: the graph that
    step ran, its inputs found where its sources say, the result made as dynamo made it from the graph's outputs and
    inputs. The inputs a layer's module holds (its weights and state buffers) and the globals' are found once a
    module (`fixed`; the decoder starts afresh when the caches are set up again, `RegionDecoder.forward`), the others
    (the carried streams, the step's positions) each call (`varying`): a decode step's GEMVs leave the modules'
    attributes out of cache, where finding 20-50 inputs again took ~40 us a call. The decoder asks for one only where
    its guards would pass (the step's key, every region's guards checked at an earlier step of that key).
    `inner`: inductor's compiled code below the graph's AOT wrappers, called in their stead where at the guarded call
    they did nothing but pass it the graph's very inputs and return its very outputs (no input mutation or aliased
    output to replay, no input deduplicated or added; `inductor_calls`): ~50 us a call of Python on a 2-core CPU."""

    def __init__(self, graph: Graph, globals_: dict, leaves: list[tuple[str, Any]], spec,
                 inner: Callable[[list], Any] | None = None):
        self.graph, self.leaves, self.spec, self.inner = graph, leaves, spec, inner
        sources = graph.sources
        at = [i for i, s in enumerate(sources) if s.startswith(("L['args'][0]", "G["))]
        rest = [i for i in range(len(sources)) if i not in at]
        self.fixed = expression("L", [sources[i] for i in at], {"G": globals_})
        self.varying = expression("L", [sources[i] for i in rest], {"G": globals_})
        place = {i: f"F[{n}]" for n, i in enumerate(at)} | {i: f"V[{n}]" for n, i in enumerate(rest)}
        self.merge = expression("F, V", [place[i] for i in range(len(sources))])
        values = [v for how, v in leaves if how == "value"]
        picks, k = [], 0
        for how, v in leaves:
            picks.append(f"O[{v}]" if how == "out" else f"I[{v}]" if how == "in" else f"K[{k}]")
            k += how == "value"
        self.pick = expression("O, I", picks, {"K": values})
        self.make = maker(spec)
        self.fixed_of: dict[torch.nn.Module, tuple] = {}  # each module's fixed inputs

    def __call__(self, args: tuple):
        frame = {"args": args}
        fixed = self.fixed_of.get(args[0])
        if fixed is None:
            fixed = self.fixed_of[args[0]] = self.fixed(frame)
        inputs = self.merge(fixed, self.varying(frame))
        out = self.graph.fn(*inputs) if self.inner is None else self.inner(list(inputs))
        return self.make(self.pick(out, inputs))

    @staticmethod
    def learn(seen: tuple, args: tuple, result: Any, globals_: dict) -> DirectCall | None:
        """From a guarded call (its graph, the inputs dynamo gave it, the outputs it gave and the calls of inductor's
        code below it; the region's arguments, the result dynamo made, the region function's globals) -> the call,
        or None where its inputs are not found where the sources say (the very tensors dynamo gave) or a tensor of
        the result is neither an input nor an output of the graph."""
        graph, given, out, ran = seen
        if graph.sources is None or not isinstance(out, (list, tuple)) or not isinstance(args[0], torch.nn.Module):
            return None
        values, spec = tree_flatten(result)
        leaves = []
        for v in values:
            if not isinstance(v, torch.Tensor):
                leaves.append(("value", v))
            elif (i := next((i for i, o in enumerate(out) if o is v), None)) is not None:
                leaves.append(("out", i))
            elif (i := next((i for i, t in enumerate(given) if t is v), None)) is not None:
                leaves.append(("in", i))
            else:
                return None
        try:
            inner = ran[0][0] if len(ran) == 1 and identical(ran[0][1], given) and identical(ran[0][2], out) else None
            call, frame = DirectCall(graph, globals_, leaves, spec, inner), {"args": args}
            found = call.merge(call.fixed(frame), call.varying(frame))
        except Exception:  # a source that is not an expression over the arguments and the globals
            return None
        return call if identical(found, given) else None

    def same(self, other: DirectCall | None) -> bool:
        """Whether another layer's call runs the same graph and makes its result alike."""
        return other is not None and other.graph is self.graph and other.inner is self.inner and \
            other.leaves == self.leaves and other.spec == self.spec


def identical(a: Any, b: Any) -> bool:
    """Whether two sequences hold the very same objects, in order."""
    return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b) and \
        all(x is y for x, y in zip(a, b, strict=True))


def expression(params: str, items: list[str], scope: dict | None = None) -> Callable:
    """`lambda {params}: (item, item, ...)`, compiled once (the items Python expressions over params and scope)."""
    return eval(f"lambda {params}: ({''.join(f'{item}, ' for item in items)})", dict(scope or {}))


def maker(spec) -> Callable[[tuple], Any]:
    """What makes a structure of spec (torch's pytree) from its leaves: a tuple's or named tuple's own constructor
    where its items are the leaves (a `Carry`, the head's (logits, streams)), else `tree_unflatten`."""
    flat = spec.type in (tuple, list) or (isinstance(spec.type, type) and issubclass(spec.type, tuple))
    if flat and all(child.is_leaf() for child in spec.children()):
        return getattr(spec.type, "_make", spec.type)
    return lambda leaves: tree_unflatten(list(leaves), spec)


# The "split" plan's two graphs of a layer half: the carried post and the site's pre step (mixes, collapse, norm),
# the sublayer.
def attn_core(block: Block, h: torch.Tensor, rows: torch.Tensor, start: torch.Tensor,
              static: bool) -> torch.Tensor:
    return Attention.forward(block.attn, h, rows, start, static)


def moe_core(block: Block, h: torch.Tensor, tokens: torch.Tensor, static: bool) -> torch.Tensor:
    return MoE.forward(block.ffn, h, tokens, static)


SPLIT = {"attn": ("attn", attn_core), "moe": ("ffn", moe_core)}


class SplitHalf:
    """A layer half as two compiled groups: enter (post+pre), core (as `Block.attn_half` / `Block.ffn_half`)."""

    def __init__(self, site: str, enter: CompiledGroup, core: CompiledGroup):
        self.site, self.enter, self.core = site, enter, core

    def __call__(self, block: Block, c: Carry, *args) -> Carry:
        x, h, post, comb = self.enter(block, c, self.site)
        return Carry(x, self.core(block, h, *args), post, comb)


class RegionDecoder:
    """Decode steps of a model whose caches are set up: a chunk of s tokens (s fixed, 1 for plain decode) for
    every cache row, through the modules' static path, compiled by regions (or uncompiled).

    mode: "regions" (a graph per region kind and stage group), "step" (the whole step as one graph: the
    baseline regions are measured against) or "eager" (the same code, uncompiled).
    """

    def __init__(self, model: Transformer, mode: str = "regions", backend: str | None = "inductor",
                 stages: str = "whole", cuda_graphs: bool = False):
        self.model, self.mode, self.stages = model, mode, stages
        for block in model.layers:
            block.ffn.gather_experts()
        self.rows = torch.arange(model.max_batch, device=model.device)
        self.backend = None if mode == "eager" else backend
        self.cpp_wrapper = wraps_in_cpp(model, backend)
        self.cg_mode = "reduce-overhead" if cuda_graphs else None
        self.layers_of: dict[str, list[int]] = {"head": [len(model.layers)]}
        for i, kinds in enumerate(model.region_kinds):
            for kind in kinds:
                self.layers_of.setdefault(kind, []).append(i)
        self.stats: list[GraphStats] = []
        self.groups: list[CompiledGroup] = []
        self.kinds: dict[str, Callable] = {}
        self.builds: Builds | None = None  # while `compile_ahead` runs: the wrappers building in the background
        self.guarded: set[tuple] = set()  # the steps (`step_key`) whose every region has run with its guards checked
        self.step: tuple | None = None  # during a step on CPU: (its key, whether in `guarded`), for `CompiledGroup`
        self.setups = model.setups  # the caches the steps in `guarded` ran on (`Transformer.setups`)
        self.compressors = [m for m in model.layers.modules() if isinstance(m, Compressor)]
        if mode == "step":
            self.step_stats = GraphStats("step", "all", list(range(len(model.layers) + 1)))
            self.stats.append(self.step_stats)
            self.step_fn = torch.compile(Transformer.forward,
                                         backend=counting_backend(backend, self.step_stats, self.cpp_wrapper),
                                         dynamic=False, fullgraph=True)

    def group(self, kind: str, stages: str, fn: Callable) -> CompiledGroup:
        stats = GraphStats(kind, stages, self.layers_of[kind])
        self.stats.append(stats)
        self.groups.append(CompiledGroup(stats, fn, self.backend, self.cg_mode, self.cpp_wrapper,
                                         lambda: self.builds, lambda: self.step))
        return self.groups[-1]

    def run(self, kind: str, fn: Callable, module, *args) -> torch.Tensor:
        """`Transformer.forward`'s regions: fn(module, *args) through its kind's compiled function (made on the
        kind's first call)."""
        if kind not in self.kinds:
            family = kind.split(":")[0]
            if self.stages == "whole" or family == "head":
                self.kinds[kind] = self.group(kind, "post+pre+core" if family != "head" else "head", fn)
            else:
                site, core = SPLIT[family]
                self.kinds[kind] = SplitHalf(site, self.group(kind, "post+pre", Block.enter),
                                             self.group(kind, "core", core))
        return self.kinds[kind](module, *args)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, probe: Probe | None = None) -> torch.Tensor:
        """tokens [B] or [B, s], pos [B] (every cache row, B fixed) -> logits [B, vocab] of each row's last token;
        `probe` as the eager model's."""
        return self.forward(tokens, pos, probe, False)

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, pos: torch.Tensor,
               probe: Probe | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A speculative verify step (`mhcrun.speculate`): tokens [B, s] at pos [B] (every cache row) -> (logits
        [B, s, vocab] of every position, the streams before the head [B, s, n, d])."""
        return self.forward(tokens, pos, probe, True)

    @property
    def compiles_ahead(self) -> bool:
        """Whether a run on fresh caches compiles this decoder's graphs ahead of its prefill (`compile_ahead`):
        where their C++ wrappers build in the background (`wraps_in_cpp`); elsewhere at the first step (CUDA
        graphs keep the addresses of the caches, which setting them up afresh after a step ahead would change)."""
        return self.cpp_wrapper and self.mode == "regions"

    def compile_ahead(self, draft_tokens: int = 0, probe: Probe | None = None) -> float:
        """Compile the graphs this decoder's steps run, ahead of them: a decode step of every cache row (with
        `draft_tokens` K: a speculative verify of K + 1 tokens a row, as `speculate` runs it) on the model's caches,
        which must be fresh; they are set up afresh after it. Meanwhile the graphs' C++ wrappers build in the
        background (`mhcrun.regions.builds`); a wrapper that failed to build leaves its group eager, with a warning.
        -> seconds taken (a warm compile cache: dynamo's tracing alone)."""
        model, t0 = self.model, time.perf_counter()
        rows = self.rows.size(0)
        builds = Builds(wrapper_config(True)) if self.compiles_ahead else None
        # the header the builds precompile, kept until they end
        with wrapper_header(), builds or contextlib.nullcontext():
            self.builds = builds
            try:
                zeros = torch.zeros(rows, dtype=torch.long, device=model.device)
                if draft_tokens:  # as `speculate` runs a verify: the compressors keep the chunk (for `rewind_span`)
                    keep_chunks(model.layers, True)
                    self.verify(torch.zeros(rows, draft_tokens + 1, dtype=torch.long, device=model.device), zeros,
                                probe)
                    keep_chunks(model.layers, False)
                else:
                    self(zeros, zeros, probe)
            finally:
                self.builds = None
        for group in self.groups:
            if (e := failure(group.stats.builds)) is not None and group.fn is not group.eager:
                group.fall_back(e)
        model.setup_caches(rows, model.max_seq)
        model.opts.hc.reset()  # the calls the step counted are not the run's
        return time.perf_counter() - t0

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, probe: Probe | None, every: bool):
        """`Transformer.forward` of every cache row through the regions (or the step's one graph)."""
        model = self.model
        tokens = tokens.view(self.rows.size(0), -1)
        # a verify's compressors keep their chunk (`snapshot.keep_chunks`): a flag the graphs are guarded on
        key = (*step_key(tokens, pos, probe), every, tuple(m.keep_chunk for m in self.compressors), model.max_seq)
        if model.setups != self.setups:  # the caches were set up again: their buffers are other tensors
            self.setups, self.guarded = model.setups, set()
            for group in self.groups:
                group.direct.clear()
        guarded = key in self.guarded
        # on CPU the regions call their graphs directly at a step of a key seen before (`DirectCall`)
        self.step = (key, guarded) if model.device.type == "cpu" and self.cg_mode is None else None
        try:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=self.backend is not None and guarded):
                if self.mode == "step":
                    out = self.step_fn(model, tokens, self.rows, pos, None, True, None, every, every)
                else:
                    out = model(tokens, self.rows, pos, probe, static=True, regions=self.run, every=every,
                                streams=every)
        finally:
            self.step = None
        self.guarded.add(key)
        self.count_hc_calls(tokens.numel(), tokens.device.type)
        return out

    def count_hc_calls(self, rows: int, device_type: str) -> None:
        """The hc steps of a compiled forward over `rows` tokens (B x s), on the torch path or the real kernels
        (neuron),
        are not counted as they run (a counter in a graph would recompile it): count them here, as the forward
        calls them (`hc_ops.site_kernels` a site, the head's post and collapse). The custom ops (simulator)
        count themselves."""
        hc, cfg = self.model.opts.hc, self.model.cfg
        path = hc.path(device_type)
        if self.backend is None or path == "nki-sim":
            return
        if not hc_ops.mixes_supported(cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps):
            path = "torch"  # constants the kernels do not bake: the torch reference on every backend

        def graph_path(kernel: str) -> str:  # on CPU the graphs call the kernel's C++ for the post+pre step alone (its
            if path != "cpu":  # op, where the run loaded the kernel's ops: torch_ops.cpp); the rest is torch's
                return path
            return "cpu" if kernel == "hc_post_pre" and self.model.opts.cpu.ops and rows <= MAX_ROWS else "torch"

        sites = 2 * len(self.model.layers)
        for kernel in hc_ops.site_kernels(rows):
            hc.count(kernel, graph_path(kernel), sites)
        for kernel in ("hc_post", "hc_head"):
            hc.count(kernel, graph_path(kernel))

    def graph_count(self) -> int:
        return sum(s.graphs for s in self.stats)


def step_key(tokens: torch.Tensor, pos: torch.Tensor, probe: Probe | None) -> tuple:
    """What may change the graphs a decode step runs: its shapes and whether a probe watches it. The modules are
    the same and their tensors keep their shapes (the static path), so a step whose key an earlier step had, every
    region's guards then checked, passes the same guards: it runs without evaluating them all (dynamo's
    `skip_guard_eval_unsafe` still checks those that tell a region's graphs apart, the tensor shapes among them, and
    raises rather than recompile)."""
    return tuple(tokens.shape), tokens.dtype, tuple(pos.shape), pos.dtype, tokens.device, probe is None


def compile_all(model: Transformer, batch: int, context: int, stages: str = "whole", backend: str | None = None,
                on_progress: Callable[[int, int, str], None] | None = None, draft_tokens: int = 0) -> dict:
    """Compile every region kind of `model` for a decode batch and context (rounded up as generate's runs round
    theirs: `settings.regions_context`), by running one decode step on fresh caches; report each graph (its first
    call's wall time: trace, compile and run) and the cache length compiled for. `draft_tokens` K: the graphs of a
    speculative verify of K + 1 tokens a row instead (what a regions run with --draft-tokens K runs)."""
    context = regions_context(context, model.cfg.max_position_embeddings)
    model.setup_caches(batch, context)
    backend = backend or default_backend(model.device.type)
    dec = RegionDecoder(model, "regions", backend, stages, cuda_graphs=model.device.type == "cuda")
    kinds = {k for ks in model.region_kinds for k in ks} | {"head"}
    total = sum(1 if k == "head" or stages == "whole" else 2 for k in kinds)
    done: set[int] = set()

    def progress(name: str, t: torch.Tensor) -> None:  # a region finished: report the graphs it compiled
        for s in dec.stats:
            if id(s) not in done and s.first_call_s is not None:
                done.add(id(s))
                if on_progress:
                    on_progress(len(done), total, f"{s.region} [{s.stages}]")

    total_s = dec.compile_ahead(draft_tokens, progress)
    regions = [{"region": s.region, "layers": s.layers, "stages": s.stages,
                "compile_s": s.first_call_s or 0.0, "backend_compile_s": s.compile_s,
                "graph_breaks": 0 if s.fallback is None else None, "cache_hit": s.cache_hits > 0,
                "graphs": s.graphs, "fallback": s.fallback, "wrapper": s.wrapper} for s in dec.stats]
    return {"backend": backend, "stages": stages, "graphs": dec.graph_count(), "layers": len(model.layers),
            "batch": batch, "context": context, "draft_tokens": draft_tokens, "total_s": total_s, "regions": regions}
