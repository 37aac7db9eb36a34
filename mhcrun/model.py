"""DeepSeek V4 as DeepSeek's inference code computes it, in plain torch on the ops in `mhcrun.ops`.

Module and parameter names equal DeepSeek's checkpoint names (`layers.0.attn.wq_a.weight`, ...). The modules
declare no tensors: the weights table (`weights.tensor_specs`: name, shape, format, split) is their one
description, and `build_model` places each tensor where its name says (a Linear's weight as a `QWeight`).
One entry point, as DeepSeek's `forward(tokens, start_pos)`: `forward(tokens [b, s], rows [b], start [b])` runs
a chunk of s tokens per row at positions start + [0, s), attending to what earlier chunks left in the caches.
A prompt is prefilled chunk by chunk; a decode step is a chunk of one token per row (rows may be at different
positions).

One formulation for every path: each module has one forward, used by eager prefill, eager decode and the
compiled regions (`mhcrun.regions`), which compile these very forwards with the modules' tensors as graph
inputs. `static=True` takes the path of fixed shapes a graph needs (no Python branch on tensor values: the
indexer scores every entry slot, HCA reads every entry slot under a mask, the MoE gathers each token's experts
instead of looping over the experts in use); it computes what the dynamic path computes, and runs the same code
eager and compiled.

State: each module owns its state as buffers made by `setup_caches` (the attention's window ring, each
compressor's open-group state and the compressed entries it writes), row r of every buffer belonging to one
sequence, and reads and writes it by (rows, slots) on every path. A chunk at start 0 begins a new sequence in
its row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from mhcrun.config import ModelConfig
from mhcrun.nki import ops as hc_ops
from mhcrun.ops import kvcache
from mhcrun.ops.attention import closed_mask, query_bytes, query_slices, sparse_attn, window_mask
from mhcrun.ops.compress import add_to_open_group, compress_chunk, state_rows, stays_open
from mhcrun.ops.index import entry_step, index_scores, select_topk_sliced
from mhcrun.ops.kvcache import CacheFormat, index_format, kv_format
from mhcrun.ops.moe import gate_scores, route, swiglu
from mhcrun.ops.norm import rms_norm
from mhcrun.ops.qgemv import MAX_ROWS, CpuKernel, ExpertSet, expert_set, moe_table, weight_table
from mhcrun.ops.qlinear import ScaledMM, qlinear, qlinear_gathered, qlinear_grouped, round_activation
from mhcrun.ops.quant import ACT_FP8_BLOCK, INDEX_FP4_BLOCK, KV_FP8_BLOCK, fp4_simulate, hadamard
from mhcrun.ops.qweight import QWeight
from mhcrun.ops.rope import apply_rope_tail, precompute_freqs_cis
from mhcrun.parallel import SINGLE, Shard, all_reduce, gather_vocab
from mhcrun.weights import TensorSpec, dequantized_dtype, mtp_tensor_specs, tensor_specs

# Called with each region's output as a forward runs: ("embed", x), ("layer 2 attn:csa", x) after each layer
# half (the residual streams [b, s, n, d], the half's post step applied: `Carry.settle`), ("head", logits [b, V]).
# Compiled regions run under the same names (`mhcrun.regions`), so two paths can be compared region by region.
Probe = Callable[[str, torch.Tensor], None]
ATTN_KINDS = {0: "window", 4: "csa"}


T = TypeVar("T")


@dataclass
class RunOptions:
    """Settings every module reads at run time (one shared instance per model)."""

    quant_sim: bool = True
    tp: Shard = SINGLE  # under --tp: this rank; its modules hold their share and reduce (`mhcrun.parallel`)
    scaled_mm: ScaledMM | None = None  # MHCRUN_SCALED_MM=1: CUDA FP8 GEMMs through cuBLASLt
    hc: hc_ops.HcBackend = field(default_factory=hc_ops.HcBackend)  # the hc steps' backend and their counts

    @property
    def cpu(self) -> CpuKernel:
        """The fused CPU kernel the run opened (off: the torch path), held once: the hc backend's (`HcBackend.cpu`),
        which runs the mHC steps of eager decode rows, is the one every GEMV and eager step takes."""
        return self.hc.cpu

    @cpu.setter
    def cpu(self, kernel: CpuKernel) -> None:
        self.hc = replace(self.hc, cpu=kernel)


class Linear(nn.Module):
    """x @ W^T over one weight `w` [out, in]: a float tensor, or kept quantised as stored (FP8 / FP4 with its
    scale), which the GEMM dequantises block by block as it goes (`mhcrun.ops.qlinear`). `act_quant`: the
    reference rounds the activation to FP8 before this GEMM (a weight stored quantised, per its TensorSpec)."""

    def __init__(self, opts: RunOptions):
        super().__init__()
        self.w: QWeight | None = None  # placed by build_model
        self.act_quant = False
        self.opts = opts

    @property
    def weight(self) -> torch.Tensor:
        return self.w.data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return qlinear(x, self.w, self.act_quant and self.opts.quant_sim, self.opts.scaled_mm, self.opts.cpu)


class Embedding(nn.Module):
    """tokens -> rows of `weight` [vocab (this rank's), d]."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, eps: float, opts: RunOptions):
        super().__init__()
        self.eps, self.opts = eps, opts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`rms_norm`; in CPU eager decode the run's kernel does it in one call (`CpuKernel.rms_norm`, within
        rounding)."""
        return eager_first(lambda: self.opts.cpu.rms_norm(x, self.weight, self.eps),
                           lambda: rms_norm(x, self.weight, self.eps))


class Cache(nn.Module):
    """Stored entries [B, n, ...] in a `CacheFormat`: one buffer per part (`mhcrun.ops.kvcache`), read and
    written by (rows, slots)."""

    def __init__(self, opts: RunOptions):
        super().__init__()
        self.opts = opts

    def allocate(self, fmt: CacheFormat, lead: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self._buffers.clear()
        self.fmt = fmt
        for part, t in kvcache.make_parts(fmt, lead, dtype, device).items():
            self.register_buffer(part, t, persistent=False)

    def parts(self) -> dict[str, torch.Tensor]:
        return {p: getattr(self, p) for p in kvcache.part_names(self.fmt)}

    def read(self, index: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The entries at `index`, decoded (only those entries are read)."""
        return decode_entries(self.opts.cpu, self.fmt, {name: p[index] for name, p in self.parts().items()}, dtype)

    def store(self, index: tuple, encoded: dict[str, torch.Tensor]) -> None:
        kvcache.store(self.parts(), index, encoded)


def watched(*modules: nn.Module) -> bool:
    """Whether a forward hook watches any of these modules (`probes.first_nonfinite_op`): a kernel call doing their
    work in one would pass their hooks by."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def learnt_table(module: nn.Module, name: str, *lins: Linear) -> torch.Tensor | None:
    """The `weight_table` of these Linears' weights (None where the run's kernel does not take them all), learnt once
    into `module.tables` under `name`: the weights stay for the model's life."""
    if name not in module.tables:
        module.tables[name] = weight_table(*(lin.w for lin in lins)) if module.opts.cpu.on else None
    return module.tables[name]


def act_blocks(opts: RunOptions, *lins: Linear) -> tuple[int, ...]:
    """Each Linear's activation rounding as the kernel's calls take it: its block where it rounds, else 0."""
    return tuple(ACT_FP8_BLOCK if lin.act_quant and opts.quant_sim else 0 for lin in lins)


def eager_first(fast: Callable[[], T | None], ref: Callable[[], T]) -> T:
    """fast() outside graphs where it applies, else ref(): `fast` is the run's CPU kernel doing a reference op in one
    call (a `CpuKernel` method, None where it does not apply); graphs trace the reference, which inductor fuses."""
    out = None if torch.compiler.is_compiling() else fast()
    return ref() if out is None else out


def kernel_coding(fmt: CacheFormat) -> tuple[str, int] | None:
    """The cache formats whose entries the run's kernel encodes: (kind, block) of the fp8 format with power-of-two
    scales and of the fp4 format; None for others."""
    if fmt.kind == "fp8" and fmt.pow2:
        return "fp8", KV_FP8_BLOCK
    return ("fp4", INDEX_FP4_BLOCK) if fmt.kind == "fp4" else None


def encode_entries(cpu: CpuKernel, fmt: CacheFormat, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """`kvcache.encode`; in CPU eager the run's kernel encodes fp32 entries of the fp8 format (power-of-two scales)
    and of the fp4 format in one call (`CpuKernel.kv_fp8_encode`, `CpuKernel.kv_fp4_encode`, bitwise)."""
    def fast() -> dict[str, torch.Tensor] | None:
        coding = kernel_coding(fmt)
        if coding is None:
            return None
        kind, block = coding
        return cpu.kv_fp8_encode(x, fmt.rope_dim, block) if kind == "fp8" else cpu.kv_fp4_encode(x, block)

    return eager_first(fast, lambda: kvcache.encode(fmt, x))


def decode_entries(cpu: CpuKernel, fmt: CacheFormat, parts: dict[str, torch.Tensor],
                   dtype: torch.dtype) -> torch.Tensor:
    """`kvcache.decode`; in CPU eager the run's kernel decodes fp32 fp8 and fp4 entries in one call
    (`CpuKernel.kv_fp8`, `CpuKernel.kv_fp4`, bitwise)."""
    def fast() -> torch.Tensor | None:
        if fmt.kind == "plain" or dtype != torch.float32:
            return None
        if fmt.kind == "fp8":
            return cpu.kv_fp8(parts["fp8"], parts["scale"], parts["rope"], KV_FP8_BLOCK)
        return cpu.kv_fp4(parts["fp4"], parts["scale"], INDEX_FP4_BLOCK)

    return eager_first(fast, lambda: kvcache.decode(fmt, parts, dtype))


class Rope(nn.Module):
    """The rotary tables a module reads at positions: cos, sin [max_seq, rd/2] (`setup_caches` sets them)."""

    def set_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin

    def at(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [...] -> cos, sin [..., rd/2] (by index_select, which in eager decode costs less than indexing)."""
        p = pos.reshape(-1)
        return (torch.index_select(self.cos, 0, p).view(*pos.shape, -1),
                torch.index_select(self.sin, 0, p).view(*pos.shape, -1))


class Compressor(nn.Module):
    """Pools each closed group of `ratio` tokens into one compressed entry; partial groups wait in state buffers.

    State (`allocate`): kv_state, score_state [B, c*r, c*hd] (fp32; the open group, after the previous group
    with overlap) and `cache` [B, max_seq // r + 1, ...], the compressed entries (the last slot takes the groups
    a chunk leaves open, so every chunk writes the same number of entries: nothing reads that slot)."""

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int, opts: RunOptions, rotate: bool = False):
        super().__init__()
        self.ratio, self.head_dim, self.rope_dim = ratio, head_dim, cfg.rope_head_dim
        self.overlap = ratio == 4
        self.lead = ratio if self.overlap else 0  # the state's slots before the open group (the overlapping half)
        self.rotate = rotate  # indexer keys: Hadamard-rotated (then stored FP4 instead of FP8)
        self.opts = opts
        self.wkv = Linear(opts)  # bf16 as stored, fp32 math (x is fp32)
        self.wgate = Linear(opts)
        self.norm = RMSNorm(cfg.norm_eps, opts)
        self.cache = Cache(opts)
        self.rope = Rope()
        self.n_entries = 0
        self.keep_chunk = False  # a speculative verify: keep each chunk's kv, score to rewind the open group
        self.chunk: tuple[torch.Tensor, torch.Tensor] | None = None
        self.tables: dict[str, torch.Tensor | None] = {}  # forward's `weight_table`, learnt once

    def allocate(self, batch: int, max_seq: int, dtype: torch.dtype, device: torch.device | str,
                 fmt: CacheFormat) -> None:
        c, r, hd = (2 if self.overlap else 1), self.ratio, self.head_dim
        shape = (batch, c * r, c * hd)
        self.register_buffer("kv_state", torch.zeros(shape, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("score_state", torch.full(shape, float("-inf"), dtype=torch.float32, device=device),
                             persistent=False)
        self.n_entries = max_seq // r
        self.cache.allocate(fmt, (batch, self.n_entries + 1), dtype, device)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, start: torch.Tensor, static: bool = False) -> None:
        """x [b, s, d] at positions start [b] + [0, s): every group the chunk closes is pooled, normed, rotated
        at its first position and stored (in the cache's format) as compressed entry `position // ratio`. Eager,
        only the groups closed are finished (in decode most steps close none); with `static` every group of the
        buffer is, an open one (no entry yet) into the spare last slot."""
        opened = self.open_step(x, rows, start, static)
        if opened is not None and self.opts.cpu.compress_open(*opened):  # the calls below, in one
            return
        r, s = self.ratio, x.size(1)
        opens = not static and stays_open(start, s, r)  # most decode steps: the tokens join the open group, no more
        fast = not self.keep_chunk and not torch.compiler.is_compiling()  # the run's kernel may do a step in one call
        kv, raw = self.wkv(x.float()), self.wgate(x.float())
        if opens and fast and self.opts.cpu.open_group(self.kv_state, self.score_state, rows, kv, raw, self.ape,
                                                       start, r, self.lead):
            return
        one = s == 1 and not opens and (fast or static and not self.keep_chunk)  # a decode step: the kernel's call
        closed = self.close_step(rows, kv, raw, start, static) if one else None
        if closed is None:
            closed = self.close(kv, raw, rows, start, opens, static)
        if closed is None:
            return
        at, slot, first, pooled = closed
        fmt = self.cache.fmt
        coding = kernel_coding(fmt)
        normed = rms_norm(pooled.to(x.dtype), self.norm.weight, self.norm.eps)
        if not static and not torch.compiler.is_compiling() and coding and self.opts.cpu.store_entries(  # in one call
                normed, at, slot, first, self.rope.cos, self.rope.sin, self.rope_dim, self.rotate, *coding,
                self.cache.parts()):
            return
        cos, sin = self.rope.at(first)
        out = finish_entry(normed, lambda t: rotate(self.opts.cpu, t, cos, sin, self.rope_dim),
                           (lambda t: spin(self.opts.cpu, t)) if self.rotate else None)
        self.cache.store((at, slot), encode_entries(self.opts.cpu, fmt, out))

    def open_step(self, x: torch.Tensor, rows: torch.Tensor, start: torch.Tensor, static: bool = False) -> tuple | None:
        """`CpuKernel.compress_open`'s arguments for forward's step where its tokens close no group (most decode
        steps) and the run's kernel may make its calls in one (outside graphs and speculative verifies, no hook on
        wkv or wgate); else None."""
        lins = (self.wkv, self.wgate)
        if static or self.keep_chunk or torch.compiler.is_compiling() or watched(*lins) \
                or not stays_open(start, x.size(1), self.ratio):
            return None
        return (x.float(), learnt_table(self, "lins", *lins), act_blocks(self.opts, *lins), self.kv_state,
                self.score_state, rows, self.ape, start, self.ratio, self.lead)

    def close_step(self, rows: torch.Tensor, kv: torch.Tensor, raw: torch.Tensor, start: torch.Tensor,
                   static: bool) -> tuple[torch.Tensor, ...] | None:
        """`close` for a decode step (one token a row) by the run's kernel in one call, in compiled graphs too
        (`CpuKernel.compress_step`, the pooling within rounding): only the group a token closes is pooled; eager, the
        closed groups; with `static` every row's [b, 1], a group left open into the spare slot. None where it does
        not apply (nothing written)."""
        step = self.opts.cpu.compress_step(self.kv_state, self.score_state, rows, kv, raw, self.ape, start, self.ratio,
                                           self.overlap)
        if step is None:
            return None
        pooled, done = step  # [b, d], [b]: the rows whose group closed
        slot = start // self.ratio
        if static:
            slot, done = slot.view(-1, 1), done.view(-1, 1)
            return (rows.view(-1, 1), torch.where(done, slot, self.n_entries), torch.where(done, slot, 0) * self.ratio,
                    pooled.unsqueeze(1))
        if not bool(done.all()):  # rows at other positions: only the closed groups
            rows, slot, pooled = rows[done], slot[done], pooled[done]
        return rows, slot, slot * self.ratio, pooled

    def close(self, kv: torch.Tensor, raw: torch.Tensor, rows: torch.Tensor, start: torch.Tensor, opens: bool,
              static: bool) -> tuple[torch.Tensor, ...] | None:
        """The chunk's tokens into the state; -> the groups it closes as (state rows, entry slots, their first
        positions, pooled [..., hd]) to finish and store (with `static` every group of the buffer, an open one pooled
        as zeros into the spare slot at position 0), or None when it closes none."""
        r, s = self.ratio, kv.size(1)
        pos = start.view(-1, 1) + torch.arange(s, device=kv.device)
        score = raw + self.ape[pos % r]
        if self.keep_chunk:  # `snapshot.rewind_span` rebuilds the state after a prefix of the chunk from them
            self.chunk = (kv, score)
        if opens:
            add_to_open_group(self.kv_state, self.score_state, rows, kv, score, start, r, self.overlap)
            return None
        pooled, closed, entry, self.kv_state[rows], self.score_state[rows] = compress_chunk(
            *state_rows(self.kv_state, self.score_state, rows, start), kv, score, start, r, self.overlap)
        if static:  # [b, G]
            return (rows.view(-1, 1), torch.where(closed, entry, self.n_entries), torch.where(closed, entry, 0) * r,
                    pooled.masked_fill(~closed.unsqueeze(-1), 0.0))
        if not bool(closed.any()):  # [n]: the closed groups only
            return None
        bi, gi = closed.nonzero(as_tuple=True)
        return rows[bi], entry[bi, gi], entry[bi, gi] * r, pooled[bi, gi]


def rotate(cpu: CpuKernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int,
           inverse: bool = False) -> torch.Tensor:
    """`apply_rope_tail`; in CPU eager decode the run's kernel does it in one call (`CpuKernel.rope_tail`, bitwise)."""
    return eager_first(lambda: cpu.rope_tail(x, cos, sin, rope_dim, inverse),
                       lambda: apply_rope_tail(x, cos, sin, rope_dim, inverse))


def spin(cpu: CpuKernel, x: torch.Tensor) -> torch.Tensor:
    """`hadamard` (the rotation of indexer queries and keys); in CPU eager the run's kernel does it in one call
    (`CpuKernel.hadamard`, bitwise)."""
    return eager_first(lambda: cpu.hadamard(x), lambda: hadamard(x))


def finish_entry(normed: torch.Tensor, rope, rotation: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """A pooled group, normed -> its compressed entry before storage: RoPE at the group's first position (`rope`),
    and for indexer keys the Hadamard rotation (`rotation`, else none). Storing rounds it (FP8 kv / FP4 keys with
    the simulation on)."""
    out = rope(normed)
    return out if rotation is None else rotation(out)


class Indexer(nn.Module):
    """Lightning indexer: scores the compressed entries for each query and keeps the top `index_topk`."""

    def __init__(self, cfg: ModelConfig, opts: RunOptions):
        super().__init__()
        self.n_heads = cfg.index_n_heads // opts.tp.world  # this rank's index heads
        self.head_dim, self.rope_dim = cfg.index_head_dim, cfg.rope_head_dim
        self.topk = cfg.index_topk
        self.opts = opts
        self.wq_b = Linear(opts)
        self.weights_proj = Linear(opts)
        self.compressor = Compressor(cfg, 4, self.head_dim, opts, rotate=True)
        self.weight_scale = self.head_dim ** -0.5 * cfg.index_n_heads ** -0.5
        self.tables: dict[str, torch.Tensor | None] = {}  # queries' `weight_table`, learnt once

    def queries(self, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qr [b, s, q_lora] -> index queries [b, s, heads, ihd] as they are scored: RoPE on the tail, the
        Hadamard rotation, and with the simulation on the reference's FP4 rounding. In CPU eager decode the run's kernel
        makes the calls below in one (`CpuKernel.index_queries`: the same calls, the same values) where no hook watches
        wq_b."""
        if not torch.compiler.is_compiling() and not watched(self.wq_b):
            q = self.opts.cpu.index_queries(qr, learnt_table(self, "queries", self.wq_b),
                                            act_blocks(self.opts, self.wq_b)[0], cos, sin, self.n_heads, self.rope_dim,
                                            INDEX_FP4_BLOCK if self.opts.quant_sim else 0)
            if q is not None:
                return q
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = spin(self.opts.cpu, rotate(self.opts.cpu, q, cos.unsqueeze(2), sin.unsqueeze(2), self.rope_dim))
        if not self.opts.quant_sim:
            return q
        return eager_first(lambda: self.opts.cpu.fp4_simulate(q, INDEX_FP4_BLOCK),
                           lambda: fp4_simulate(q, INDEX_FP4_BLOCK))

    def forward(self, x: torch.Tensor, qr: torch.Tensor, rows: torch.Tensor, start: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, static: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (entry indices, valid) [b, s, min(topk, n)]: each query's top-k closed entries (tie rule in
        `mhcrun.ops.index`), scored a slice of entries at a time with the heads reduced as they go (in CPU decode the
        run's kernel scores and selects in one call, `CpuKernel.index_topk`, the scores within rounding, reading the
        key cache where it lies: eager, and in compiled graphs through its op).
        n: the entries the chunk's queries may see, or with `static` every entry slot in one slice."""
        b, s = x.shape[:2]
        q = self.queries(qr, cos, sin)
        self.compressor(x, rows, start, static)
        w = self.weights_proj(x) * self.weight_scale
        closed = (start.view(-1, 1) + torch.arange(1, s + 1, device=x.device)) // 4  # [b, s]
        n = self.compressor.n_entries if static else int(closed.max())
        cache = self.compressor.cache

        def score_slice(j0: int, j1: int) -> torch.Tensor:
            keys = cache.read((rows.view(-1, 1), torch.arange(j0, j1, device=x.device)), q.dtype)
            return all_reduce(index_scores(q, keys, w), self.opts.tp)  # every rank's heads, before the top-k

        def fast() -> tuple[torch.Tensor, torch.Tensor] | None:  # not under --tp: the ranks' scores meet first
            if self.opts.tp.world > 1 or cache.fmt.kind != "fp4":
                return None
            return self.opts.cpu.index_topk(q, w, cache.fp4, cache.scale, rows, closed, n, self.topk, INDEX_FP4_BLOCK)

        out = fast()  # in graphs too (its op): a graph's indexer otherwise decodes and scores every entry slot
        return out if out is not None else select_topk_sliced(score_slice, n, closed, self.topk,
                                                               n if static else entry_step(b * s, self.n_heads))


class Attention(nn.Module):
    """Shared-latent attention (K == V) over a sliding window plus compressed entries (CSA / HCA)."""

    def __init__(self, layer_id: int, cfg: ModelConfig, opts: RunOptions):
        super().__init__()
        world = opts.tp.world  # this rank's heads and o_groups
        self.n_heads, self.head_dim, self.rope_dim = cfg.n_heads // world, cfg.head_dim, cfg.rope_head_dim
        self.window, self.ratio = cfg.window_size, cfg.compress_ratios[layer_id]
        self.n_groups, self.o_lora_rank = cfg.o_groups // world, cfg.o_lora_rank
        self.eps = cfg.norm_eps
        self.opts = opts
        self.scale = self.head_dim ** -0.5
        self.wq_a = Linear(opts)
        self.q_norm = RMSNorm(cfg.norm_eps, opts)
        self.wq_b = Linear(opts)
        self.wkv = Linear(opts)
        self.kv_norm = RMSNorm(cfg.norm_eps, opts)
        self.wo_a = Linear(opts)
        self.wo_b = Linear(opts)
        self.ring = Cache(opts)  # the window: token p in slot p % window
        self.rope = Rope()
        if self.ratio:
            self.compressor = Compressor(cfg, self.ratio, self.head_dim, opts)
        if self.ratio == 4:
            self.indexer = Indexer(cfg, opts)
        self.tables: dict[str, torch.Tensor | None] = {}  # project's and output's `weight_table`s, learnt once

    def compressors(self) -> list[Compressor]:
        return ([self.compressor] if self.ratio else []) + ([self.indexer.compressor] if self.ratio == 4 else [])

    def allocate(self, batch: int, max_seq: int, dtype: torch.dtype, device: torch.device | str,
                 formats: dict[str, CacheFormat], rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Make this layer's state for `batch` sequences of up to `max_seq` tokens (see the module docstring)."""
        self.ring.allocate(formats["kv"], (batch, self.window), dtype, device)
        for m in self.modules():
            if isinstance(m, Rope):
                m.set_tables(*rope)
        if self.ratio:
            self.compressor.allocate(batch, max_seq, dtype, device, formats["kv"])
        if self.ratio == 4:
            self.indexer.compressor.allocate(batch, max_seq, dtype, device, formats["idx_kv"])

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> qr [b,s,q_lora], q [b,s,H,hd], kv [b,s,hd] (before storage rounds it); cos, sin [b, s, rd/2]. In CPU eager
        decode the run's kernel makes the calls below in one (`CpuKernel.attn_project`: the same calls, the same
        values) where no hook watches the modules."""
        lins = (self.wq_a, self.wq_b, self.wkv)
        if not torch.compiler.is_compiling() and self.eps == self.q_norm.eps == self.kv_norm.eps \
                and not watched(*lins, self.q_norm, self.kv_norm):
            out = self.opts.cpu.attn_project(x, learnt_table(self, "project", *lins), act_blocks(self.opts, *lins),
                                             self.q_norm.weight, self.kv_norm.weight, self.eps, cos, sin, self.n_heads,
                                             self.rope_dim)
            if out is not None:
                return out
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = eager_first(lambda: self.opts.cpu.rms_norm(q, None, self.eps),  # weightless per-head norm, in q's dtype
                        lambda: q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps))
        q = rotate(self.opts.cpu, q, cos.unsqueeze(2), sin.unsqueeze(2), self.rope_dim)
        kv = rotate(self.opts.cpu, self.kv_norm(self.wkv(x)), cos, sin, self.rope_dim)
        return qr, q, kv

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """De-rotate, then the grouped low-rank output: o [b,s,H,hd] -> [b,s,d]."""
        b, s = o.shape[:2]
        if not torch.compiler.is_compiling() and not watched(self.wo_b):  # as `project`: the kernel's calls in one
            y = self.opts.cpu.attn_output(o, learnt_table(self, "output", self.wo_a, self.wo_b),
                                          act_blocks(self.opts, self.wo_b)[0], cos, sin, self.n_groups, self.rope_dim)
            if y is not None:
                return all_reduce(y, self.opts.tp)
        o = rotate(self.opts.cpu, o, cos.unsqueeze(2), sin.unsqueeze(2), self.rope_dim, inverse=True)
        o = o.reshape(b, s, self.n_groups, -1)
        o = qlinear_grouped(o, self.wo_a.w, self.n_groups, self.opts.cpu)  # [b, s, G, o_lora_rank]
        return all_reduce(self.wo_b(o.flatten(2)), self.opts.tp)  # this rank's o_groups -> every rank's

    def forward(self, x: torch.Tensor, rows: torch.Tensor, start: torch.Tensor, static: bool = False) -> torch.Tensor:
        """x [b, s, d] at positions start [b] + [0, s) -> [b, s, d]. Each query attends to its window (the ring
        as the earlier chunks left it, then this chunk) plus its compressed entries: CSA's top-k gathered by
        index, HCA's closed entries (with `static`: every entry slot, under the mask)."""
        b, s, _ = x.shape
        pos = start.view(-1, 1) + torch.arange(s, device=x.device)
        cos, sin = self.rope.at(pos)  # [b, s, rd/2]
        qr, q, kv = self.project(x, cos, sin)
        chosen = valid = None
        if self.ratio == 4:
            chosen, valid = self.indexer(x, qr, rows, start, cos, sin, static)
        one = not torch.compiler.is_compiling() and not watched(self.wo_b)  # CPU eager decode: the calls in one
        opened = self.compressor.open_step(x, rows, start, static) if self.ratio and one else None
        if self.ratio and opened is None:
            self.compressor(x, rows, start, static)
        if one:  # with a compressor's step that closes no group, that too
            y = self.attend_output(q, kv, rows, start, chosen, valid, cos, sin, opened)
            if y is not None:
                return y
            if opened is not None:
                self.compressor(x, rows, start, static)
        o = eager_first(lambda: self.attend_one(q, kv, rows, start, chosen, valid),
                        lambda: self.attend_chunk(q, kv, rows, start, pos, chosen, valid, static))
        return self.output(o, cos, sin)

    def attend_chunk(self, q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, start: torch.Tensor,
                     pos: torch.Tensor, chosen: torch.Tensor | None, valid: torch.Tensor | None,
                     static: bool) -> torch.Tensor:
        """The chunk's kv into the ring; q [b, s, H, hd] attending to the window, kv [b, s, hd] (this chunk's, before
        storage rounds it) and the compressed entries (CSA: `chosen` where `valid` [b, s, k]) -> o [b, s, H, hd]."""
        b, s = q.shape[:2]
        win, dev, dtype = self.window, q.device, q.dtype
        stored = encode_entries(self.opts.cpu, self.ring.fmt, kv)
        kv = decode_entries(self.opts.cpu, self.ring.fmt, stored, dtype)  # what the cache gives back
        ring = self.ring.read((rows,), dtype)  # [b, window, hd]
        comp = comp_mask = None
        if self.ratio and self.ratio != 4:  # HCA: every closed entry
            n = self.compressor.n_entries if static else int((start + s).max()) // self.ratio
            comp = self.compressor.cache.read((rows.view(-1, 1), torch.arange(n, device=dev)), dtype)
            comp_mask = closed_mask(start, s, n, self.ratio)
        mask = eager_first(lambda: self.opts.cpu.window_mask(start, s, win), lambda: window_mask(start, s, win))
        o = torch.empty_like(q)
        n_sel = 0 if chosen is None else chosen.size(-1)
        n_comp = 0 if comp is None else comp.size(1)
        per_query = query_bytes(self.n_heads, 2 * win + n_comp, n_sel, self.head_dim)
        # half a window of queries a slice: its window keys come to 1.5 windows, of which each query sees one (whole
        # windows of queries took two: a 1,024-token prefill's attention 0.7x the time, BENCHMARKS.md)
        # a chunk at the start of every row's sequence: the ring holds nothing yet (eager only: no sync in graphs)
        ring_empty = not static and not torch.compiler.is_compiling() and not bool((start > 0).any())
        for sl in query_slices(s, per_query, max_len=max(1, win // 2)):
            # the slice's window keys: the ring (only while a query of the slice can see it: query t sees positions
            # after start + t - window, the ring's are before start), then the chunk's entries from `window` before
            # the slice to its end
            lo = max(0, sl.start - win + 1)
            sees_ring = sl.start < win - 1 and not ring_empty
            keys = [ring, kv[:, lo:sl.stop]] if sees_ring else [kv[:, lo:sl.stop]]
            km = [mask[:, sl, :win]] if sees_ring else []
            km.append(mask[:, sl, win + lo:win + sl.stop])
            if comp is not None:
                keys.append(comp)
                km.append(comp_mask[:, sl])
            sel = sel_mask = None
            if n_sel:  # CSA: the chosen entries, gathered (and dequantised) per query
                sel = self.compressor.cache.read((rows.view(-1, 1, 1), chosen[:, sl]), dtype)
                sel_mask = valid[:, sl]
            o[:, sl] = self.attend(q[:, sl], torch.cat(keys, dim=1), torch.cat(km, dim=-1), self.attn_sink,
                                   self.scale, sel, sel_mask)
        last = slice(max(0, s - win), s)  # the chunk's last `window` tokens go into the ring
        self.ring.store((rows.view(-1, 1), pos[:, last] % win), {p: t[:, last] for p, t in stored.items()})
        return o

    def attend_one(self, q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, start: torch.Tensor,
                   chosen: torch.Tensor | None, valid: torch.Tensor | None) -> torch.Tensor | None:
        """`attend_chunk` for a decode step (one token a row) by the run's kernel in one call, reading the caches
        where they lie (`CpuKernel.attend_decode`, within rounding of it); None where it does not apply (then nothing
        was written)."""
        args = self.decode_args(q, kv, rows, start, chosen, valid)
        return None if args is None else self.opts.cpu.attend_decode(*args)

    def attend_output(self, q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, start: torch.Tensor,
                      chosen: torch.Tensor | None, valid: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor, opened: tuple | None = None) -> torch.Tensor | None:
        """`attend_one`, then `output` of its o, by the run's kernel in one call (`CpuKernel.attend_output`: the calls
        each makes, so the same values), with `opened` (`Compressor.open_step`'s) the compressor's step first; None
        where any does not apply."""
        args = self.decode_args(q, kv, rows, start, chosen, valid)
        y = None if args is None else self.opts.cpu.attend_output(
            *args, learnt_table(self, "output", self.wo_a, self.wo_b), act_blocks(self.opts, self.wo_b)[0], cos, sin,
            self.n_groups, self.rope_dim, opened)
        return None if y is None else all_reduce(y, self.opts.tp)

    def decode_args(self, q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, start: torch.Tensor,
                    chosen: torch.Tensor | None, valid: torch.Tensor | None) -> tuple | None:
        """`CpuKernel.attend_decode`'s arguments for a decode step (HCA: every closed entry chosen), or None where the
        caches are not in its format."""
        if q.size(1) != 1 or self.ring.fmt.kind != "fp8" or not self.ring.fmt.pow2:
            return None
        comp = self.compressor.cache.parts() if self.ratio else None
        if self.ratio and self.ratio != 4:  # HCA: every closed entry
            n = int((start + 1).max()) // self.ratio
            chosen = torch.arange(n, device=q.device).expand(q.size(0), 1, n)
            valid = closed_mask(start, 1, n, self.ratio)
        return (q, kv, self.ring.parts(), rows, start, comp, chosen, valid, self.attn_sink, self.scale, KV_FP8_BLOCK)

    def attend(self, *args) -> torch.Tensor:
        """`sparse_attn(*args)`; for CPU decode rows the run's kernel does it in one call (`CpuKernel.attend`, within
        rounding of it), in compiled graphs too (its op's C++: `mhcrun::attend_native`)."""
        o = self.opts.cpu.attend(*args)
        return sparse_attn(*args) if o is None else o


class Expert(nn.Module):
    def __init__(self, limit: float, opts: RunOptions):
        super().__init__()
        self.w1 = Linear(opts)
        self.w2 = Linear(opts)
        self.w3 = Linear(opts)
        self.limit = limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        return swiglu_expert(self.w1, self.w2, self.w3, self.limit, x, weights)


def swiglu_expert(w1: Callable, w2: Callable, w3: Callable, limit: float, x: torch.Tensor,
                  weights: torch.Tensor | None) -> torch.Tensor:
    """w2(weights * swiglu(w1 x, w3 x)) with the product in fp32 and w2's input in x's dtype: one expert, or
    (GEMMs over gathered experts) each token's k experts at once."""
    h = swiglu(w1(x), w3(x), limit)
    if weights is not None:
        h = weights * h
    return w2(h.to(x.dtype))


class Gate(nn.Module):
    def __init__(self, layer_id: int, cfg: ModelConfig, opts: RunOptions):
        super().__init__()
        self.topk, self.score_func, self.route_scale = cfg.n_activated_experts, cfg.score_func, cfg.route_scale
        self.hash = layer_id < cfg.n_hash_layers  # routes by token id (tid2eid), else by score (weight, bias)
        self.opts = opts

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (weights [T, k], expert ids [T, k]); in CPU eager decode the run's kernel scores and routes in
        one call (`CpuKernel.route`, the scores within rounding)."""
        hash_ids = self.tid2eid[token_ids] if self.hash else None
        bias = None if self.hash else self.bias
        return eager_first(lambda: self.opts.cpu.route(x, self.weight, bias, hash_ids, self.topk, self.route_scale,
                                                       self.score_func),
                           lambda: route(gate_scores(x, self.weight, self.score_func), self.topk, self.route_scale,
                                         self.score_func, bias=bias, hash_ids=hash_ids))


class MoE(nn.Module):
    """Routed experts (this rank's block of them under --tp) plus the shared expert."""

    def __init__(self, layer_id: int, cfg: ModelConfig, opts: RunOptions):
        super().__init__()
        self.dim, self.n_experts = cfg.dim, cfg.n_routed_experts
        self.opts = opts
        self.gate = Gate(layer_id, cfg, opts)
        self.owned = opts.tp.experts(cfg.n_routed_experts)  # this rank's block of experts; the others hold nothing
        self.experts = nn.ModuleList(
            Expert(cfg.swiglu_limit, opts) if e in self.owned else nn.Identity() for e in range(cfg.n_routed_experts))
        self.shared_experts = Expert(cfg.swiglu_limit, opts)
        self.limit = cfg.swiglu_limit
        self.gathered: dict[str, QWeight | ExpertSet] = {}  # made by gather_experts for the static path
        self.in_place: bool | None = None  # whether the run's CPU kernel reads every expert where it lies
        self.shared_in_place: tuple[ExpertSet, ...] | None = None  # the shared expert's w1, w3, w2 so (() where not)
        self.tables: dict[str, torch.Tensor | None] = {}  # forward's `moe_table`, learnt once

    def gather_experts(self) -> None:
        """Make the static path's view of this rank's experts, once per model, per weight name (w1, w2, w3): where
        the run's fused CPU kernel takes every one of them, it reads kept-quantised experts where they are (their
        addresses, `qgemv.expert_set`; the experts' Linears keep the bytes alive); else they are stacked
        [E, out, in] (a copy) and each expert keeps a view of the stack, so their bytes are not held twice."""
        if self.gathered:
            return
        experts = [self.experts[e] for e in self.owned]
        sets = self.in_place_sets()
        for name in ("w1", "w2", "w3"):
            lins = [getattr(e, name) for e in experts]
            first = lins[0].w
            if sets[name] is not None:
                self.gathered[name] = sets[name]
                continue
            data = torch.stack([m.w.data for m in lins])
            scale = None if first.scale is None else torch.stack([m.w.scale for m in lins])
            for j, m in enumerate(lins):
                m.w = replace(m.w, data=data[j], scale=None if scale is None else scale[j], nan_free=None)
            self.gathered[name] = QWeight(data, scale, first.block, all(m.w.kernel for m in lins))

    def in_place_sets(self) -> dict[str, ExpertSet | None]:
        """Per weight name (w1, w2, w3), this rank's experts as the run's CPU kernel reads them where they lie
        (`qgemv.expert_set`), or None where it does not take them all (or is off)."""
        on = self.opts.cpu.on
        return {name: expert_set([getattr(self.experts[e], name).w for e in self.owned]) if on else None
                for name in ("w1", "w2", "w3")}

    def reads_in_place(self, rows: int) -> bool:
        """Whether an eager step of `rows` tokens takes the static path too: at decode sizes, where the run's CPU
        kernel reads every expert in place (`qgemv.expert_set`), one kernel call a projection multiplies all the
        step's experts (not one call an expert). Learnt once; nothing is copied. Not under --tp, where the static
        path would also multiply the slots routed to other ranks' experts (weighted zero)."""
        if rows > MAX_ROWS or not self.opts.cpu.on or self.opts.tp.world > 1:
            return False
        if self.in_place is None:
            sets = self.in_place_sets()
            self.in_place = all(s is not None for s in sets.values())
            if self.in_place and not self.gathered:
                self.gathered = sets
        return self.in_place and all(isinstance(s, ExpertSet) for s in self.gathered.values())

    def routed_loop(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [T, d], each token through the experts it routes to, expert by expert (only those in use) -> fp32."""
        y = torch.zeros_like(x, dtype=torch.float32)
        counts = torch.bincount(idx.flatten(), minlength=self.n_experts).tolist()
        for e in self.owned:
            if counts[e]:
                tok, slot = torch.where(idx == e)
                y[tok] += self.experts[e](x[tok], weights[tok, slot, None])
        return y

    def routed_gathered(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The same on fixed shapes: each token's k experts' weights gathered (`gather_experts`) -> fp32."""
        if self.opts.tp.world > 1:  # this rank's experts only: the others' routes weigh nothing here
            e0, e1 = self.owned.start, self.owned.stop
            weights = weights * ((idx >= e0) & (idx < e1))
            idx = (idx - e0).clamp(0, e1 - e0 - 1)
        act_quant = self.experts[self.owned.start].w1.act_quant and self.opts.quant_sim
        y = self.routed_in_one_call(x, weights, idx)
        if y is not None:  # eager decode: the run's kernel did the rest of this method in one call
            return y

        def gathered(name: str, act: bool = act_quant) -> Callable[[torch.Tensor], torch.Tensor]:
            return functools.partial(qlinear_gathered, w=self.gathered[name], idx=idx, act_quant=act,
                                     cpu=self.opts.cpu)

        x = x.unsqueeze(1)
        if act_quant:  # w1 and w3 take the same rounded x: round it once
            x = round_activation(x, self.opts.cpu)
        y = swiglu_expert(gathered("w1", False), gathered("w2"), gathered("w3", False), self.limit, x,
                          weights.unsqueeze(-1))  # [T, k, d]
        return y.float().sum(dim=1)

    def routed_in_one_call(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor | None:
        """x [T, d] through its routes by the run's CPU kernel in one call (`CpuKernel.moe_routed`: the experts read in
        place, within rounding of the other paths through silu's exp), in eager runs on one rank; None where it does
        not apply (the kernel off or declining, experts it does not read in place, more routes than decode-sized
        rows for every expert: the kernel's call decides) -> fp32."""
        sets = [self.gathered.get(name) for name in ("w1", "w3", "w2")]
        if self.opts.tp.world > 1 or torch.compiler.is_compiling() or not all(isinstance(s, ExpertSet) for s in sets):
            return None
        act_quant = self.experts[self.owned.start].w1.act_quant and self.opts.quant_sim
        return self.opts.cpu.moe_routed(x, weights, idx, *sets, self.limit, ACT_FP8_BLOCK if act_quant else 0)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, static: bool) -> torch.Tensor:
        """The routed experts' sum for x [T, d] -> fp32: decode's rows (and the static path) gathered; an eager
        prefill chunk, where the experts are read in place, by the run's kernel in one call a slice of the chunk whose
        routes come to at most `CpuKernel.routed_routes` (`CpuKernel.moe_routed`: one parallel region a stage,
        the FP4 experts' many rows by its panels; on a 2-core VM a 128-token prefill took 0.77x as long as by a call an
        expert and weight, before the panels, and a 1,024-token one 0.82-0.86x as long as by torch's GEMMs of
        dequantised experts: BENCHMARKS.md); else expert by expert, as also where the chunk is longer than a call
        takes and a GEMM engine multiplies an expert's many rows (`CpuKernel.gemm_first`: a 512-token chunk's experts
        0.59x as long as by the calls' GEMV rows by AMX on an Intel VM, a 128-token one 1.09x; a 1,024-token prefill
        0.70x as long by the BF16 dot products on a Zen 4 VM: BENCHMARKS.md)."""
        if static or self.reads_in_place(x.shape[0]):
            return self.routed_gathered(x, weights, idx)
        if not self.reads_in_place(1):
            return self.routed_loop(x, weights, idx)
        w1, w2 = self.gathered["w1"], self.gathered["w2"]
        most = max(1, self.opts.cpu.routed_routes(w1, w2) // idx.shape[1])  # tokens a call: the kernel's bound
        if x.shape[0] > most and self.opts.cpu.gemm_first(idx.numel() // len(self.owned)):
            return self.routed_loop(x, weights, idx)
        span = -(-x.shape[0] // -(-x.shape[0] // most))  # as few calls, of even size (no call of a few tokens)
        ys = [self.routed_in_one_call(x[t:t + span], weights[t:t + span], idx[t:t + span])
              for t in range(0, x.shape[0], span)]
        return self.routed_loop(x, weights, idx) if any(y is None for y in ys) else torch.cat(ys)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, static: bool = False) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.dim)
        y = None if static or torch.compiler.is_compiling() else self.forward_in_one_call(x, token_ids.reshape(-1))
        if y is None:
            weights, idx = self.gate(x, token_ids.reshape(-1))
            y = self.routed(x, weights, idx, static)
            y = all_reduce(y, self.opts.tp)  # every rank's experts; the shared expert is added once, after
            y += self.shared(x)
        return y.type_as(x).view(shape)

    def forward_in_one_call(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor | None:
        """forward's calls for CPU eager decode rows x [T, d] on one rank, by the run's kernel in one
        (`CpuKernel.moe_step`: the router's, the routed experts' and the shared expert's calls in forward's order, and
        its sum: the same values), where `step_args` gives them; None where it does not apply."""
        args = self.step_args(x.shape[0], token_ids)
        return None if args is None else self.opts.cpu.moe_step(x, *args)

    def step_args(self, rows: int, token_ids: torch.Tensor) -> tuple | None:
        """`CpuKernel.moe_step`'s arguments after x for `rows` decode rows of these tokens [rows]: where the experts are
        read in place, on one rank, and no hook watches the router; else None."""
        if self.opts.tp.world > 1 or watched(self.gate) or not self.reads_in_place(rows) or not self.shared_sets():
            return None
        if "step" not in self.tables:
            routed = tuple(self.gathered[name] for name in ("w1", "w3", "w2"))
            self.tables["step"] = moe_table(routed, self.shared_in_place, self.dim)
        g, sim = self.gate, self.opts.quant_sim
        act = (ACT_FP8_BLOCK if self.experts[self.owned.start].w1.act_quant and sim else 0,
               ACT_FP8_BLOCK if self.shared_experts.w1.act_quant and sim else 0)
        return (g.weight, None if g.hash else g.bias, g.tid2eid[token_ids] if g.hash else None, g.topk, g.route_scale,
                g.score_func, self.tables["step"], act, self.limit)

    def shared_sets(self) -> tuple[ExpertSet, ...]:
        """The shared expert's w1, w3, w2 as the run's CPU kernel reads them in place, learnt once (nothing is copied;
        one activation rounding for all three); () where it does not take them all."""
        if self.shared_in_place is None:
            lins = [getattr(self.shared_experts, name) for name in ("w1", "w3", "w2")]
            sets = tuple(expert_set([lin.w]) for lin in lins)
            same = len({lin.act_quant for lin in lins}) == 1
            self.shared_in_place = sets if same and all(s is not None for s in sets) else ()
        return self.shared_in_place

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert of x [T, d]; in CPU eager decode by the run's kernel in one call, as a routed expert of a
        set of one weighted 1 (`CpuKernel.moe_routed`: within rounding through silu's exp)."""
        def fast() -> torch.Tensor | None:
            if not self.opts.cpu.on:
                return None
            if not self.shared_sets():
                return None
            t, act = x.shape[0], self.shared_experts.w1.act_quant and self.opts.quant_sim
            return self.opts.cpu.moe_routed(x, torch.ones(t, 1), torch.zeros(t, 1, dtype=torch.int64),
                                            *self.shared_in_place, self.limit, ACT_FP8_BLOCK if act else 0)

        return eager_first(fast, lambda: self.shared_experts(x))


class Carry(NamedTuple):
    """What a layer half hands the next: the mHC streams with its own post step still to do, so that the step
    runs as one kernel with the next site's pre step (`hc_ops.hc_post_pre`). The streams are
    hc_post(y, x, post, comb): x [b, s, n, d] before the post step, y [b, s, d] the sublayer's output,
    post [b, s, n] and comb [b, s, n, n] (fp32) the site's mixes."""

    x: torch.Tensor
    y: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor

    @staticmethod
    def of_embedding(e: torch.Tensor, n: int) -> Carry:
        """The embedding e [b, s, d] as a post step on zero streams with post = 1 and comb = 0: its result,
        1 * e + 0, is hc_expand(e) exactly (n copies), so the first site's pre step is a post+pre like any."""
        b, s, d = e.shape
        return Carry(e.new_zeros(b, s, n, d), e, e.new_ones(b, s, n, dtype=torch.float32),
                     e.new_zeros(b, s, n, n, dtype=torch.float32))

    @staticmethod
    def of_streams(x: torch.Tensor) -> Carry:
        """Streams x [b, s, n, d] with nothing to do: y = 0, post = 0, comb = I (each stream kept as it is)."""
        b, s, n, d = x.shape
        eye = torch.eye(n, dtype=torch.float32, device=x.device).expand(b, s, n, n)
        return Carry(x, x.new_zeros(b, s, d), x.new_zeros(b, s, n, dtype=torch.float32), eye)

    def settle(self, hc: hc_ops.HcBackend | None = None) -> torch.Tensor:
        """The streams [b, s, n, d]: the post step applied (one hc_post)."""
        return hc_ops.hc_post(self.y, self.x, self.post, self.comb, hc)


class Block(nn.Module):
    """One layer in two halves (`Transformer.forward` runs them, each a compiled region kind): the previous
    site's mHC post and this site's pre -> attention, then the attention's post and the MoE site's pre -> MoE;
    each half hands on its sublayer's output with the post step to do (`Carry`)."""

    def __init__(self, layer_id: int, cfg: ModelConfig, opts: RunOptions):
        super().__init__()
        self.cfg, self.opts = cfg, opts
        self.attn = Attention(layer_id, cfg, opts)
        self.ffn = MoE(layer_id, cfg, opts)
        self.attn_norm = RMSNorm(cfg.norm_eps, opts)
        self.ffn_norm = RMSNorm(cfg.norm_eps, opts)  # and hc_{attn,ffn}_{fn,base,scale}, the mHC parameters

    def enter(self, c: Carry, site: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The carried post step and the pre step of a site ("attn" or "ffn") as one kernel (`hc_ops.hc_post_pre`):
        the post, then the mixes with Sinkhorn, the collapse and the sublayer's norm. -> (the streams
        x [b, s, n, d], h [b, s, d], post [b, s, n], comb [b, s, n, n]). The norm's epsilon is the mixes' (both
        `cfg.norm_eps`)."""
        cfg = self.cfg
        fn, scale, base, norm = self.mixes(site)
        return hc_ops.hc_post_pre(c.y, c.x, c.post, c.comb, fn, *self.fn_split[site], scale, base, norm, cfg.hc_mult,
                                  cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps, self.opts.hc)

    def mixes(self, site: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A site's ("attn" or "ffn") mHC parameters and its sublayer's norm weight: (fn, scale, base, norm)."""
        norm = self.attn_norm if site == "attn" else self.ffn_norm
        return getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_scale"), getattr(self, f"hc_{site}_base"), \
            norm.weight

    def attn_half(self, c: Carry, rows: torch.Tensor, start: torch.Tensor, static: bool = False) -> Carry:
        # streams at positions start [b] + [0, s)
        x, h, post, comb = self.enter(c, "attn")
        return Carry(x, self.attn(h, rows, start, static), post, comb)

    def ffn_half(self, c: Carry, token_ids: torch.Tensor, static: bool = False) -> Carry:
        out = None if static or torch.compiler.is_compiling() else self.ffn_half_in_one_call(c, token_ids)
        if out is not None:
            return out
        x, h, post, comb = self.enter(c, "ffn")
        return Carry(x, self.ffn(h, token_ids, static), post, comb)

    def ffn_half_in_one_call(self, c: Carry, token_ids: torch.Tensor) -> Carry | None:
        """ffn_half's calls for CPU eager decode rows by the run's kernel in one (`CpuKernel.ffn_half`: the post+pre
        step's call, then the MoE's `moe_step`: the same calls, the same values), where the kernel would make each
        (`hc_ops.post_pre_native`, `MoE.step_args`) and no hook watches the MoE; None where it does not apply."""
        cfg, hc = self.cfg, self.opts.hc
        b, s = c.y.shape[:2]
        if watched(self.ffn) or not hc_ops.post_pre_native(b * s, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                                                            cfg.norm_eps, c.x.device.type, hc):
            return None
        moe = self.ffn.step_args(b * s, token_ids.reshape(-1))
        out = None if moe is None else hc.cpu.ffn_half(c.y, c.x, c.post, c.comb, *self.mixes("ffn"),
                                                       cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps, moe)
        if out is None:
            return None
        hc.count("hc_post_pre", "cpu")
        return Carry(*out)


class MTPBlock(Block):
    """An MTP layer (`mtp.{k}.*`, DeepSeek's `MTPBlock`): a V4 block of layer id n_layers + k whose input at
    position t is the main model's hc streams before the head at t and the embedding of the token at t + 1; its
    own head collapse and norm, then the model's head, give logits for the token at t + 2. It keeps its own
    state (`allocate`) like any layer; `mhcrun.speculate` drafts with it."""

    def __init__(self, layer_id: int, cfg: ModelConfig, opts: RunOptions):
        super().__init__(layer_id, cfg, opts)
        self.e_proj = Linear(opts)
        self.h_proj = Linear(opts)
        self.enorm = RMSNorm(cfg.norm_eps, opts)
        self.hnorm = RMSNorm(cfg.norm_eps, opts)
        self.norm = RMSNorm(cfg.norm_eps, opts)  # and hc_head_{fn,base,scale} (split as fn_split["head"])

    def forward(self, model: Transformer, streams: torch.Tensor, next_tokens: torch.Tensor, rows: torch.Tensor,
                start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [b, s, n, d] (pre-head, at positions start [b] + [0, s)) and the tokens at the next positions
        [b, s] -> (logits [b, vocab] of each row's last position: the token two ahead, its own output streams
        [b, s, n, d]: what a further draft step takes as its streams)."""
        e = self.enorm(model.embedding(next_tokens))
        x = self.e_proj(e).unsqueeze(2) + self.h_proj(self.hnorm(streams))
        c = self.ffn_half(self.attn_half(Carry.of_streams(x), rows, start), next_tokens)
        return model.finish(c, owner=self)


def cache_formats(cfg: ModelConfig, quant_sim: bool) -> dict[str, CacheFormat]:
    """How the KV cache ("kv") and the indexer's key cache ("idx_kv") store an entry."""
    return {"kv": kv_format(cfg.head_dim, cfg.rope_head_dim, quant_sim, cfg.scale_fmt is not None),
            "idx_kv": index_format(cfg.index_head_dim, quant_sim)}


def rope_tables(cfg: ModelConfig, max_seq: int,
                device: torch.device | str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """cos, sin [max_seq, rd/2] (fp32) of the window layers ("window": rope_theta, no YaRN) and of the compressed
    ones ("compressed": compress_rope_theta with YaRN)."""
    c = cfg
    freqs = {"window": precompute_freqs_cis(c.rope_head_dim, max_seq, 0, c.rope_theta, c.rope_factor, c.beta_fast,
                                            c.beta_slow),
             "compressed": precompute_freqs_cis(c.rope_head_dim, max_seq, c.original_seq_len,
                                                c.compress_rope_theta, c.rope_factor, c.beta_fast, c.beta_slow)}
    return {k: (f.real.contiguous().to(device), f.imag.contiguous().to(device)) for k, f in freqs.items()}


class Transformer(nn.Module):
    """embed (the mHC expand as the first post step) -> blocks -> the last post, the mHC head -> logits of the
    last position (fp32)."""

    def __init__(self, cfg: ModelConfig, n_layers: int | None = None, tp: Shard = SINGLE):
        super().__init__()
        self.cfg = cfg
        self.opts = RunOptions(tp=tp)
        self.vocab = tp.part(cfg.vocab_size)  # this rank's vocabulary rows of the embedding and the head
        self.embed = Embedding()
        self.layers = nn.ModuleList(
            Block(i, cfg, self.opts) for i in range(cfg.n_layers if n_layers is None else n_layers))
        self.norm = RMSNorm(cfg.norm_eps, self.opts)
        self.head = Linear(self.opts)  # and hc_head_{fn,base,scale}
        self.tables: dict[str, torch.Tensor | None] = {}  # finish's `weight_table`, learnt once
        self.mtp = nn.ModuleList()  # the MTP layers, when built with them (`build_model(mtp=True)`)
        self.dtype = torch.float32
        self.max_batch = self.max_seq = 0
        self.setups = 0  # times setup_caches made the state buffers (a compiled decoder's inputs: `mhcrun.regions`)

    def setup_caches(self, max_batch: int, max_seq: int) -> None:
        """Allocate every layer's state (KV window, compressor state and compressed entries, indexer keys) for
        `max_batch` sequences of up to `max_seq` tokens, and the rope tables."""
        self.formats, self.cache_quant_sim = cache_formats(self.cfg, self.opts.quant_sim), self.opts.quant_sim
        self.rope = rope_tables(self.cfg, max_seq, self.device)
        for layer in [*self.layers, *self.mtp]:
            a = layer.attn
            a.allocate(max_batch, max_seq, self.dtype, self.device, self.formats,
                       self.rope["compressed" if a.ratio else "window"])
        self.max_batch, self.max_seq = max_batch, max_seq
        self.setups += 1

    def state(self) -> dict[str, torch.Tensor]:
        """Every state buffer by its path (`layers.1.attn.ring.fp8`, `layers.1.attn.compressor.kv_state`, ...)."""
        return dict(self.named_buffers())

    def clear_row(self, row: int) -> None:
        """Zero cache row `row` of every state buffer: a run again of a sequence that left NaN in its caches must
        not read them (a masked key still multiplies its value by 0, and 0 * NaN is NaN)."""
        for t in self.state().values():
            t[row].zero_()

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @functools.cached_property
    def region_kinds(self) -> list[tuple[str, str]]:
        """Per layer, the region kinds of its two halves: attn:window|csa|hca (hca<ratio> when a model has
        several HCA ratios) and moe:hash|routed. Compiled regions compile one graph per kind."""
        hca = {layer.attn.ratio for layer in self.layers} - {0, 4}
        return [("attn:" + ATTN_KINDS.get(b.attn.ratio, "hca" if len(hca) == 1 else f"hca{b.attn.ratio}"),
                 "moe:hash" if b.ffn.gate.hash else "moe:routed") for b in self.layers]

    def forward(self, tokens: torch.Tensor, rows: torch.Tensor, start: torch.Tensor | int = 0,
                probe: Probe | None = None, static: bool = False, regions: Regions | None = None,
                every: bool = False, streams: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens [b, s] at positions start [b] (or an int for every row) + [0, s) of cache rows `rows` [b]
        -> logits [b, vocab] of each row's last token. A chunk at start 0 begins a new sequence in its row.
        `probe` sees every region's output (see `Probe`). `static`: the modules' fixed-shape path; `regions`
        runs each region (the compiled regions give theirs, `mhcrun.regions`). `every`: logits [b, s, vocab] of
        every position (a speculative verify step, `mhcrun.speculate`); `streams`: also the hc streams before
        the head [b, s, n, d] (what an MTP layer drafts from) -> (logits, streams)."""
        if self.opts.quant_sim != self.cache_quant_sim:
            raise RuntimeError("the quantisation simulation was switched after setup_caches: set it up again")
        run = regions or run_eagerly
        start = torch.as_tensor(start, device=tokens.device).expand(tokens.size(0))

        def see(name: str, c: Carry) -> None:  # a probe sees the streams settled (one more post, only then)
            if probe is not None:
                probe(name, c.settle())

        c = Carry.of_embedding(self.embedding(tokens), self.cfg.hc_mult)
        see("embed", c)
        for i, (layer, (akind, mkind)) in enumerate(zip(self.layers, self.region_kinds, strict=True)):
            c = run(akind, Block.attn_half, layer, c, rows, start, static)
            see(f"layer {i} {akind}", c)
            c = run(mkind, Block.ffn_half, layer, c, tokens, static)
            see(f"layer {i} {mkind}", c)
        logits, x = run("head", Transformer.finish, self, c, every)
        if probe is not None:
            probe("head", logits)
        return (logits, x) if streams else logits

    def finish(self, c: Carry, every: bool = False, owner: nn.Module | None = None) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
        """The last post step, then the head -> (logits [b, vocab] (fp32) of each row's last position (with
        `every`: [b, s, vocab], every position), the streams before the head [b, s, n, d]). V4's head collapse,
        the final norm, the head; `owner`: whose head collapse and final norm (an MTP layer's; the head itself
        is the model's)."""
        cfg, o = self.cfg, owner or self
        out = None if every or owner is not None else self.finish_in_one_call(c)
        if out is not None:
            return out
        x = c.settle(self.opts.hc)
        split = self.fn_split if owner is None else owner.fn_split["head"]
        h = hc_ops.hc_head(x if every else x[:, -1:], o.hc_head_fn, *split, o.hc_head_scale, o.hc_head_base,
                           cfg.hc_eps, cfg.norm_eps, self.opts.hc)
        h = o.norm(h).float()
        return self.logits(h if every else h[:, -1]), x

    def finish_in_one_call(self, c: Carry) -> tuple[torch.Tensor, torch.Tensor] | None:
        """finish's calls for CPU eager decode rows (one position each) by the run's kernel in one (`CpuKernel.finish`:
        the post step's, the head collapse's, the final norm's and the head's calls: the same values), where the hc
        steps take the kernel, on one rank, and no hook watches the norm or the head; None where it does not apply."""
        cfg, hc = self.cfg, self.opts.hc
        if c.y.shape[1] != 1 or torch.compiler.is_compiling() or self.opts.tp.world > 1 \
                or watched(self.norm, self.head) or hc.path(c.y.device.type) != "cpu" \
                or not hc_ops.mixes_supported(cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps):
            return None
        out = hc.cpu.finish(c.y, c.x, c.post, c.comb, self.hc_head_fn, self.hc_head_scale, self.hc_head_base,
                            cfg.hc_eps, cfg.norm_eps, self.norm.weight, self.norm.eps,
                            learnt_table(self, "head", self.head), act_blocks(self.opts, self.head)[0])
        if out is None:
            return None
        hc.count("hc_post", "cpu")
        hc.count("hc_head", "cpu")
        return out

    def embedding(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] -> [b, s, d] in the activation dtype; under --tp each rank looks up its vocabulary rows
        (zeros elsewhere) and the ranks' rows are summed."""
        if self.opts.tp.world == 1:
            return self.embed(tokens).to(self.dtype)
        local = tokens - self.vocab.start
        n = self.embed.weight.size(0)
        mine = (local >= 0) & (local < n)
        e = self.embed(local.clamp(0, n - 1)) * mine.unsqueeze(-1)
        return all_reduce(e.float(), self.opts.tp).to(self.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [b, d] (fp32) -> logits [b, vocab] (fp32); under --tp every rank's vocabulary rows, gathered."""
        return gather_vocab(self.head(h), self.opts.tp, self.cfg.vocab_size)


# How a forward runs a region: regions(kind, fn, module, *args) -> fn(module, *args), e.g. compiled per kind.
Regions = Callable[..., torch.Tensor]


def run_eagerly(kind: str, fn: Callable[..., torch.Tensor], module: nn.Module, *args) -> torch.Tensor:
    """The plain run of a region: its module's own code, uncompiled."""
    return fn(module, *args)


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor | QWeight], quantized: set[str],
                dtype: torch.dtype = torch.float32, n_layers: int | None = None,
                device: torch.device | str = "cpu", tp: Shard = SINGLE, mtp: bool = False) -> Transformer:
    """Make a Transformer and place the checkpoint's tensors in it, each where its name says (the names, shapes
    and formats of `weights.tensor_specs`; under --tp this rank's share, as `load_checkpoint(tp=...)` gives it).

    A weight given as a QWeight stays quantised: its stored bytes (a view of the mapped shard on cpu) and its
    scale go into its Linear as they are. The vocabulary-sized tensors keep their stored dtype; every other
    tensor is copied, cast to its run-time dtype (`quantized` names those stored FP8/FP4 and dequantised).
    `mtp`: the first MTP layer too (`mtp.0.*`, `weights.mtp_tensor_specs`), as `model.mtp[0]`.
    """
    model = Transformer(cfg, n_layers, tp)
    model.dtype = dtype
    specs = tensor_specs(cfg, n_layers)
    if mtp:
        model.mtp.append(MTPBlock(cfg.n_layers, cfg, model.opts))
        specs += [s for s in mtp_tensor_specs(cfg) if s.name.startswith("mtp.0.")]
    owned = tp.experts(cfg.n_routed_experts)
    for spec in specs:
        if spec.expert is not None and spec.expert not in owned:
            continue
        if spec.name not in tensors:
            raise ValueError(f"build_model: no tensor {spec.name}")
        owner, _, leaf = spec.name.rpartition(".")
        module = model.get_submodule(owner)
        t = tensors[spec.name]
        if isinstance(module, Linear):
            if not isinstance(t, QWeight):
                t = QWeight(run_tensor(spec, t, quantized, dtype, device)).checked(spec.name)
            t = t.to(device)
            module.w = replace(t, scale=t.graph_scale())  # e8m0 as its bytes: a graph input inductor takes
            module.act_quant = spec.act_quant and spec.name in quantized
        else:
            module.register_parameter(leaf, nn.Parameter(run_tensor(spec, t, quantized, dtype, device),
                                                         requires_grad=False))
    # the NKI mixes kernels take fn as bf16 hi + lo (lo in the GEMM's dtype for these activations), split once here
    for block in [*model.layers, *model.mtp]:
        block.fn_split = {site: hc_ops.split_hi_lo(getattr(block, f"hc_{site}_fn"), dtype) for site in ("attn", "ffn")}
    model.fn_split = hc_ops.split_hi_lo(model.hc_head_fn, dtype)
    for layer in model.mtp:
        layer.fn_split["head"] = hc_ops.split_hi_lo(layer.hc_head_fn, dtype)
    return model.eval()


def run_tensor(spec: TensorSpec, t: torch.Tensor, quantized: set[str], dtype: torch.dtype,
               device: torch.device | str) -> torch.Tensor:
    """A stored tensor as the model runs it, in its table entry's run dtype (`TensorSpec.run`): int64 tables;
    the vocabulary-sized tensors and the compressors' projections as stored, not copied (bf16 in the release: the
    embedding is exact after a cast, and the GEMMs read bf16 with fp32 math, so no fp32 copy is made; fp32 when of
    another dtype); a dequantised weight in `weights.dequantized_dtype`; fp32 where DeepSeek's reference keeps fp32;
    else the activation dtype."""
    if spec.run == "stored" and t.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return t.to(device)
    if spec.run == "int64":
        want = torch.int64
    elif spec.name in quantized:
        want = dequantized_dtype(spec, dtype)
    else:
        want = torch.float32 if spec.run in ("fp32", "stored") else dtype
    return placed(t, want, device)


def placed(t: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """t itself when it already is a torch allocation of that dtype and device (a dequantised tensor), else a
    fresh copy: CPU GEMV results depend on the operand's alignment, and a mapped tensor sits at its offset
    in the shard."""
    own = t.untyped_storage().resizable() and t.storage_offset() == 0 and t.is_contiguous()
    if own and t.dtype == dtype and t.device == torch.device(device):
        return t
    return torch.empty(t.shape, dtype=dtype, device=device).copy_(t)
