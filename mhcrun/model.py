"""DeepSeek V4 as DeepSeek's inference code computes it, in plain torch on the ops in `mhcrun.ops`.

Module and parameter names equal DeepSeek's checkpoint names (`layers.0.attn.wq_a.weight`, ...). The modules
declare no tensors: the weights table (`weights.tensor_specs`: name, shape, format, split) is their one
description, and `build_model` places each tensor where its name says (a Linear's weight as a `QWeight`).
One entry point, as DeepSeek's `forward(tokens, start_pos)`: `forward(tokens [b, s], rows [b], start [b])` runs
a chunk of s tokens per row at positions start + [0, s), attending to what earlier chunks left in the caches.
A prompt is prefilled chunk by chunk; a decode step is a chunk of one token per row (rows may be at different
positions). KV caches and compressor state live in buffers made by `setup_caches`; row r of every buffer
belongs to one sequence, and a chunk at start 0 begins a new sequence in its row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mhcrun.config import ModelConfig
from mhcrun.nki import ops as hc_ops
from mhcrun.ops import kvcache
from mhcrun.ops.attention import closed_mask, query_bytes, query_slices, sparse_attn, window_mask
from mhcrun.ops.compress import compress_chunk
from mhcrun.ops.index import entry_step, index_scores, select_topk_sliced
from mhcrun.ops.kvcache import CacheFormat, index_format, kv_format
from mhcrun.ops.moe import gate_scores, route, swiglu
from mhcrun.ops.norm import rms_norm
from mhcrun.ops.qlinear import qlinear, qlinear_grouped
from mhcrun.ops.quant import INDEX_FP4_BLOCK, fp4_simulate, hadamard
from mhcrun.ops.qweight import QWeight
from mhcrun.ops.rope import apply_rope_tail, precompute_freqs_cis
from mhcrun.parallel import SINGLE, Shard, all_reduce, gather_vocab
from mhcrun.weights import TensorSpec, dequantized_dtype, tensor_specs

# Called with each region's output as a forward runs: ("embed", x), ("layer 2 attn:csa", x) after each layer
# half (the residual streams [b, s, n, d]), ("head", logits [b, V]). Compiled regions call it with the same
# names (`mhcrun.regions`), so two paths can be compared region by region.
Probe = Callable[[str, torch.Tensor], None]
ATTN_KINDS = {0: "window", 4: "csa"}


@dataclass
class RunOptions:
    """Settings every module reads at run time (one shared instance per model)."""

    quant_sim: bool = True
    tp: Shard = SINGLE  # under --tp: this rank; its modules hold their share and reduce (`mhcrun.parallel`)


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
        return qlinear(x, self.w, self.act_quant and self.opts.quant_sim)


class Embedding(nn.Module):
    """tokens -> rows of `weight` [vocab (this rank's), d]."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Compressor(nn.Module):
    """Pools each closed group of `ratio` tokens into one compressed entry; partial groups wait in state buffers."""

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int, opts: RunOptions, rotate: bool = False):
        super().__init__()
        self.ratio, self.head_dim, self.rope_dim = ratio, head_dim, cfg.rope_head_dim
        self.overlap = ratio == 4
        self.rotate = rotate  # indexer keys: Hadamard-rotated (then stored FP4 instead of FP8)
        self.opts = opts
        self.wkv = Linear(opts)  # fp32 weights, fp32 math
        self.wgate = Linear(opts)
        self.norm = RMSNorm(cfg.norm_eps)

    def bind(self, kv_state: torch.Tensor, score_state: torch.Tensor, cache: dict[str, torch.Tensor],
             fmt: CacheFormat, freqs: torch.Tensor) -> None:
        """Use views of the root state buffers: kv/score state [B, c*r, c*hd], cache parts [B, max_seq // r, ...]."""
        self.kv_state, self.score_state, self.cache, self.fmt, self.freqs = kv_state, score_state, cache, fmt, freqs

    def forward(self, x: torch.Tensor, rows: torch.Tensor, start: torch.Tensor) -> None:
        """x [b, s, d] at positions start [b] + [0, s): every group the chunk closes is pooled, normed, rotated
        at its first position and stored (in the cache's format) as compressed entry `position // ratio`."""
        r, s = self.ratio, x.size(1)
        pos = start.view(-1, 1) + torch.arange(s, device=x.device)
        kv = self.wkv(x.float())
        score = self.wgate(x.float()) + self.ape[pos % r]
        fresh = (start == 0).view(-1, 1, 1)  # a new sequence: no previous group, no open group
        kv_state = self.kv_state[rows].masked_fill(fresh, 0.0)
        score_state = self.score_state[rows].masked_fill(fresh, float("-inf"))
        pooled, closed, entry, self.kv_state[rows], self.score_state[rows] = compress_chunk(
            kv_state, score_state, kv, score, start, r, self.overlap)
        if not bool(closed.any()):
            return
        bi, gi = closed.nonzero(as_tuple=True)
        e = entry[bi, gi]
        out = finish_entry(pooled[bi, gi].to(x.dtype), self.norm.weight, self.norm.eps,
                           lambda t: apply_rope_tail(t, self.freqs[e * r], self.rope_dim), self.rotate)
        kvcache.write(self.cache, self.fmt, (rows[bi], e), out)


def finish_entry(pooled: torch.Tensor, norm: torch.Tensor, eps: float, rope, rotate: bool) -> torch.Tensor:
    """A pooled group -> its compressed entry before storage: norm, RoPE at the group's first position (`rope`),
    and for indexer keys the Hadamard rotation. Storing rounds it (FP8 kv / FP4 keys with the simulation on)."""
    out = rope(rms_norm(pooled, norm, eps))
    return hadamard(out) if rotate else out


def finish_index_queries(q: torch.Tensor, rope, quant_sim: bool) -> torch.Tensor:
    """Indexer queries [..., heads, ihd] after wq_b -> as they are scored: RoPE on the tail (`rope`), the Hadamard
    rotation, and with the simulation on the reference's FP4 rounding."""
    q = hadamard(rope(q))
    return fp4_simulate(q, INDEX_FP4_BLOCK) if quant_sim else q


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

    def bind(self, roots: dict[str, torch.Tensor], j: int, fmt: CacheFormat, freqs: torch.Tensor) -> None:
        self.cache = {p: t[j] for p, t in kvcache.parts_of(roots, "idx_kv", fmt).items()}  # [B, max_seq // 4, ...]
        self.fmt = fmt
        self.compressor.bind(roots["idx_comp_kv"][j], roots["idx_comp_score"][j], self.cache, fmt, freqs)

    def queries(self, qr: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        return finish_index_queries(q, lambda t: apply_rope_tail(t, freqs.unsqueeze(2), self.rope_dim),
                                    self.opts.quant_sim)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, rows: torch.Tensor, start: torch.Tensor,
                freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (entry indices, valid) [b, s, min(topk, closed)]: each query's top-k closed entries (tie rule in
        `mhcrun.ops.index`), scored a slice of entries at a time with the heads reduced as they go."""
        b, s = x.shape[:2]
        q = self.queries(qr, freqs)
        self.compressor(x, rows, start)
        w = self.weights_proj(x) * self.weight_scale
        closed = (start.view(-1, 1) + torch.arange(1, s + 1, device=x.device)) // 4  # [b, s]
        n = int(closed.max())

        def score_slice(j0: int, j1: int) -> torch.Tensor:
            keys = kvcache.read(self.cache, self.fmt, (rows.view(-1, 1), torch.arange(j0, j1, device=x.device)),
                                q.dtype)
            return all_reduce(index_scores(q, keys, w), self.opts.tp)  # every rank's heads, before the top-k

        if n == 0:
            empty_idx = torch.zeros(b, s, 0, dtype=torch.long, device=x.device)
            return empty_idx, empty_idx.bool()
        return select_topk_sliced(score_slice, n, closed, self.topk, entry_step(b * s, self.n_heads))


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
        self.q_norm = RMSNorm(cfg.norm_eps)
        self.wq_b = Linear(opts)
        self.wkv = Linear(opts)
        self.kv_norm = RMSNorm(cfg.norm_eps)
        self.wo_a = Linear(opts)
        self.wo_b = Linear(opts)
        if self.ratio:
            self.compressor = Compressor(cfg, self.ratio, self.head_dim, opts)
        if self.ratio == 4:
            self.indexer = Indexer(cfg, opts)

    def bind(self, roots: dict[str, torch.Tensor], j: int, formats: dict[str, CacheFormat],
             freqs: torch.Tensor) -> None:
        """Use row j of this attention kind's root state buffers (see `make_state_roots`)."""
        self.fmt = formats["kv"]
        cache = {p: t[j] for p, t in kvcache.parts_of(roots, "kv", self.fmt).items()}  # [B, window + n_comp, ...]
        self.window_cache = {p: t[:, :self.window] for p, t in cache.items()}
        self.comp_cache = {p: t[:, self.window:] for p, t in cache.items()}
        self.freqs = freqs
        if self.ratio:
            self.compressor.bind(roots["comp_kv"][j], roots["comp_score"][j], self.comp_cache, self.fmt, freqs)
        if self.ratio == 4:
            self.indexer.bind(roots, j, formats["idx_kv"], freqs)

    def project(self, x: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> qr [b,s,q_lora], q [b,s,H,hd], kv [b,s,hd] (before storage rounds it); freqs [b, s, rd/2]."""
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps)  # weightless per-head norm
        q = apply_rope_tail(q, freqs.unsqueeze(2), self.rope_dim)
        kv = apply_rope_tail(self.kv_norm(self.wkv(x)), freqs, self.rope_dim)
        return qr, q, kv

    def output(self, o: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """De-rotate, then the grouped low-rank output: o [b,s,H,hd] -> [b,s,d]."""
        b, s = o.shape[:2]
        o = apply_rope_tail(o, freqs.unsqueeze(2), self.rope_dim, inverse=True)
        o = o.reshape(b, s, self.n_groups, -1)
        o = qlinear_grouped(o, self.wo_a.w, self.n_groups)  # [b, s, G, o_lora_rank]
        return all_reduce(self.wo_b(o.flatten(2)), self.opts.tp)  # this rank's o_groups -> every rank's

    def forward(self, x: torch.Tensor, rows: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """x [b, s, d] at positions start [b] + [0, s) -> [b, s, d]. Each query attends to its window (the ring
        as the earlier chunks left it, then this chunk) plus its compressed entries: CSA's top-k gathered by
        index, HCA's closed entries."""
        b, s, _ = x.shape
        win, dev, dtype = self.window, x.device, x.dtype
        pos = start.view(-1, 1) + torch.arange(s, device=dev)
        freqs = self.freqs[pos]  # [b, s, rd/2]
        qr, q, kv = self.project(x, freqs)
        stored = kvcache.encode(self.fmt, kv)
        kv = kvcache.decode(self.fmt, stored, dtype)  # what the cache gives back: the reference's FP8 rounding
        ring = kvcache.read(self.window_cache, self.fmt, (rows,), dtype)  # [b, window, hd]
        chosen = valid = None
        if self.ratio == 4:
            chosen, valid = self.indexer(x, qr, rows, start, freqs)
        if self.ratio:
            self.compressor(x, rows, start)
        comp = comp_mask = None
        if self.ratio and self.ratio != 4:  # HCA: every closed entry
            n = int((start + s).max()) // self.ratio
            comp = kvcache.read(self.comp_cache, self.fmt, (rows, slice(0, n)), dtype)
            comp_mask = closed_mask(start, s, n, self.ratio)
        mask = window_mask(start, s, win)
        o = torch.empty_like(q)
        n_sel = 0 if chosen is None else chosen.size(-1)
        n_comp = 0 if comp is None else comp.size(1)
        per_query = query_bytes(self.n_heads, 2 * win + n_comp, n_sel, self.head_dim)
        for sl in query_slices(s, per_query, max_len=win):
            # the slice's window keys: the ring, then the chunk's entries from `window` before the slice to its end
            lo = max(0, sl.start - win + 1)
            keys = [ring, kv[:, lo:sl.stop]]
            km = [mask[:, sl, :win], mask[:, sl, win + lo:win + sl.stop]]
            if comp is not None:
                keys.append(comp)
                km.append(comp_mask[:, sl])
            sel = sel_mask = None
            if n_sel:  # CSA: the chosen entries, gathered (and dequantised) per query
                sel = kvcache.read(self.comp_cache, self.fmt, (rows.view(-1, 1, 1), chosen[:, sl]), dtype)
                sel_mask = valid[:, sl]
            o[:, sl] = sparse_attn(q[:, sl], torch.cat(keys, dim=1), torch.cat(km, dim=-1), self.attn_sink,
                                   self.scale, sel, sel_mask)
        last = slice(max(0, s - win), s)  # the chunk's last `window` tokens go into the ring
        kvcache.store(self.window_cache, (rows.view(-1, 1), pos[:, last] % win),
                      {p: t[:, last] for p, t in stored.items()})
        return self.output(o, freqs)


class Expert(nn.Module):
    def __init__(self, limit: float, opts: RunOptions):
        super().__init__()
        self.w1 = Linear(opts)
        self.w2 = Linear(opts)
        self.w3 = Linear(opts)
        self.limit = limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        h = swiglu(self.w1(x), self.w3(x), self.limit)
        if weights is not None:
            h = weights * h
        return self.w2(h.to(x.dtype))


class Gate(nn.Module):
    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__()
        self.topk, self.score_func, self.route_scale = cfg.n_activated_experts, cfg.score_func, cfg.route_scale
        self.hash = layer_id < cfg.n_hash_layers  # routes by token id (tid2eid), else by score (weight, bias)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = gate_scores(x, self.weight, self.score_func)
        if self.hash:
            return route(scores, self.topk, self.route_scale, self.score_func, hash_ids=self.tid2eid[token_ids])
        return route(scores, self.topk, self.route_scale, self.score_func, bias=self.bias)


class MoE(nn.Module):
    def __init__(self, layer_id: int, cfg: ModelConfig, opts: RunOptions):
        super().__init__()
        self.dim, self.n_experts = cfg.dim, cfg.n_routed_experts
        self.opts = opts
        self.gate = Gate(layer_id, cfg)
        self.owned = opts.tp.experts(cfg.n_routed_experts)  # this rank's block of experts; the others hold nothing
        self.experts = nn.ModuleList(
            Expert(cfg.swiglu_limit, opts) if e in self.owned else nn.Identity() for e in range(cfg.n_routed_experts))
        self.shared_experts = Expert(cfg.swiglu_limit, opts)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.dim)
        weights, idx = self.gate(x, token_ids.reshape(-1))
        y = torch.zeros_like(x, dtype=torch.float32)
        counts = torch.bincount(idx.flatten(), minlength=self.n_experts).tolist()
        for e in self.owned:  # only the experts some token routes to
            if counts[e]:
                tok, slot = torch.where(idx == e)
                y[tok] += self.experts[e](x[tok], weights[tok, slot, None])
        y = all_reduce(y, self.opts.tp)  # every rank's experts; the shared expert is added once, after
        y += self.shared_experts(x)
        return y.type_as(x).view(shape)


class Block(nn.Module):
    """One layer in two halves (`Transformer.forward` runs them): mHC site -> attention -> mHC post, then
    mHC site -> MoE -> mHC post."""

    def __init__(self, layer_id: int, cfg: ModelConfig, opts: RunOptions):
        super().__init__()
        self.cfg = cfg
        self.attn = Attention(layer_id, cfg, opts)
        self.ffn = MoE(layer_id, cfg, opts)
        self.attn_norm = RMSNorm(cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.norm_eps)  # and hc_{attn,ffn}_{fn,base,scale}, the mHC parameters

    def mixes(self, x: torch.Tensor, site: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cfg
        return hc_ops.hc_mixes(x, getattr(self, f"hc_{site}_fn"), *self.fn_split[site],
                               getattr(self, f"hc_{site}_scale"), getattr(self, f"hc_{site}_base"), c.hc_mult,
                               c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps)

    def attn_half(self, x: torch.Tensor, rows: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        # x [b, s, n, d] at positions start [b] + [0, s)
        pre, post, comb = self.mixes(x, "attn")
        h = self.attn(self.attn_norm(hc_ops.hc_collapse(x, pre)), rows, start)
        return hc_ops.hc_post(h, x, post, comb)

    def ffn_half(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        pre, post, comb = self.mixes(x, "ffn")
        h = self.ffn(self.ffn_norm(hc_ops.hc_collapse(x, pre)), token_ids)
        return hc_ops.hc_post(h, x, post, comb)



def cache_formats(cfg: ModelConfig, quant_sim: bool) -> dict[str, CacheFormat]:
    """How the KV cache ("kv") and the indexer's key cache ("idx_kv") store an entry."""
    return {"kv": kv_format(cfg.head_dim, cfg.rope_head_dim, quant_sim, cfg.scale_fmt is not None),
            "idx_kv": index_format(cfg.index_head_dim, quant_sim)}


def make_state_roots(cfg: ModelConfig, ratio: int, n_layers: int, max_batch: int, max_seq: int,
                     dtype: torch.dtype, device: torch.device | str = "cpu",
                     quant_sim: bool = True) -> dict[str, torch.Tensor]:
    """Root state buffers of one attention kind, stacked over its `n_layers` layers:
    kv [L, B, window + max_seq // ratio, ...] (ring window then compressed entries; its parts per
    `cache_formats`); for compressed kinds the compressor's open-group state (fp32; scores start at -inf); for
    CSA the indexer's keys and state."""
    B = max_batch
    formats = cache_formats(cfg, quant_sim)
    n_kv = cfg.window_size + (max_seq // ratio if ratio else 0)
    roots = kvcache.make_roots("kv", formats["kv"], (n_layers, B, n_kv), dtype, device)

    def compressor_state(prefix: str, r: int, d: int) -> None:
        c = 2 if r == 4 else 1
        roots[f"{prefix}_kv"] = torch.zeros(n_layers, B, c * r, c * d, dtype=torch.float32, device=device)
        roots[f"{prefix}_score"] = torch.full((n_layers, B, c * r, c * d), float("-inf"), dtype=torch.float32,
                                              device=device)

    if ratio:
        compressor_state("comp", ratio, cfg.head_dim)
    if ratio == 4:
        roots |= kvcache.make_roots("idx_kv", formats["idx_kv"], (n_layers, B, max_seq // 4), dtype, device)
        compressor_state("idx_comp", 4, cfg.index_head_dim)
    return roots


class Transformer(nn.Module):
    """embed -> mHC expand -> blocks -> mHC head -> logits of the last position (fp32)."""

    def __init__(self, cfg: ModelConfig, n_layers: int | None = None, tp: Shard = SINGLE):
        super().__init__()
        self.cfg = cfg
        self.opts = RunOptions(tp=tp)
        self.vocab = tp.part(cfg.vocab_size)  # this rank's vocabulary rows of the embedding and the head
        self.embed = Embedding()
        self.layers = nn.ModuleList(
            Block(i, cfg, self.opts) for i in range(cfg.n_layers if n_layers is None else n_layers))
        self.norm = RMSNorm(cfg.norm_eps)
        self.head = Linear(self.opts)  # and hc_head_{fn,base,scale}
        self.dtype = torch.float32
        self.max_batch = self.max_seq = 0

    def setup_caches(self, max_batch: int, max_seq: int) -> None:
        """Allocate KV caches and compressor state for `max_batch` sequences of up to `max_seq` tokens.

        State lives in one set of root buffers per attention kind (by compress ratio), stacked over the
        layers of that kind; each layer works on views of its row, so a compiled region can take the roots
        and a layer index instead.
        """
        c = self.cfg
        self.freqs = {
            0: precompute_freqs_cis(c.rope_head_dim, max_seq, 0, c.rope_theta, c.rope_factor, c.beta_fast,
                                    c.beta_slow).to(self.device),
            "compressed": precompute_freqs_cis(c.rope_head_dim, max_seq, c.original_seq_len, c.compress_rope_theta,
                                               c.rope_factor, c.beta_fast, c.beta_slow).to(self.device),
        }
        self.roots: dict[int, dict[str, torch.Tensor]] = {}
        self.formats, self.cache_quant_sim = cache_formats(c, self.opts.quant_sim), self.opts.quant_sim
        for ratio, layer_ids in self.layers_by_ratio().items():
            roots = make_state_roots(c, ratio, len(layer_ids), max_batch, max_seq, self.dtype, self.device,
                                     self.opts.quant_sim)
            self.roots[ratio] = roots
            for j, i in enumerate(layer_ids):
                self.layers[i].attn.bind(roots, j, self.formats, self.freqs["compressed" if ratio else 0])
        self.max_batch, self.max_seq = max_batch, max_seq

    def clear_row(self, row: int) -> None:
        """Zero cache row `row` of every state buffer: a run again of a sequence that left NaN in its caches must
        not read them (a masked key still multiplies its value by 0, and 0 * NaN is NaN)."""
        for roots in self.roots.values():
            for t in roots.values():
                t[:, row].zero_()

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

    def layers_by_ratio(self) -> dict[int, list[int]]:
        kinds: dict[int, list[int]] = {}
        for i, layer in enumerate(self.layers):
            kinds.setdefault(layer.attn.ratio, []).append(i)
        return kinds

    def forward(self, tokens: torch.Tensor, rows: torch.Tensor, start: torch.Tensor | int = 0,
                probe: Probe | None = None) -> torch.Tensor:
        """tokens [b, s] at positions start [b] (or an int for every row) + [0, s) of cache rows `rows` [b]
        -> logits [b, vocab] of each row's last token. A chunk at start 0 begins a new sequence in its row.
        `probe` sees every region's output (see `Probe`)."""
        c = self.cfg
        if self.opts.quant_sim != self.cache_quant_sim:
            raise RuntimeError("the quantisation simulation was switched after setup_caches: set it up again")
        probe = probe or skip_probe
        start = torch.as_tensor(start, device=tokens.device).expand(tokens.size(0))
        x = hc_ops.hc_expand(self.embedding(tokens), c.hc_mult)
        probe("embed", x)
        for i, (layer, (akind, mkind)) in enumerate(zip(self.layers, self.region_kinds, strict=True)):
            x = layer.attn_half(x, rows, start)
            probe(f"layer {i} {akind}", x)
            x = layer.ffn_half(x, tokens)
            probe(f"layer {i} {mkind}", x)
        h = hc_ops.hc_head(x[:, -1:], self.hc_head_fn, *self.fn_split, self.hc_head_scale, self.hc_head_base,
                           c.hc_eps, c.norm_eps)
        logits = self.logits(self.norm(h)[:, -1].float())
        probe("head", logits)
        return logits

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


def skip_probe(name: str, t: torch.Tensor) -> None:
    """The probe of a run that looks at nothing."""


def fp32_param(name: str) -> bool:
    """Parameters DeepSeek's reference keeps in fp32 whatever the activation dtype."""
    leaf = name.rsplit(".", 1)[-1]
    return (leaf in ("attn_sink", "ape", "bias") or name.startswith("hc_") or ".hc_" in name
            or "norm.weight" in name or ".compressor.w" in name or name.endswith("gate.weight")
            or name == "head.weight")


STORED_DTYPE = ("embed.weight", "head.weight")


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor | QWeight], quantized: set[str],
                dtype: torch.dtype = torch.float32, n_layers: int | None = None,
                device: torch.device | str = "cpu", tp: Shard = SINGLE) -> Transformer:
    """Make a Transformer and place the checkpoint's tensors in it, each where its name says (the names, shapes
    and formats of `weights.tensor_specs`; under --tp this rank's share, as `load_checkpoint(tp=...)` gives it).

    A weight given as a QWeight stays quantised: its stored bytes (a view of the mapped shard on cpu) and its
    scale go into its Linear as they are. The vocabulary-sized tensors keep their stored dtype; every other
    tensor is copied, cast to its run-time dtype (`quantized` names those stored FP8/FP4 and dequantised).
    """
    model = Transformer(cfg, n_layers, tp)
    model.dtype = dtype
    owned = tp.experts(cfg.n_routed_experts)
    for spec in tensor_specs(cfg, n_layers):
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
            module.w = t.to(device)
            module.act_quant = spec.act_quant and spec.name in quantized
        else:
            module.register_parameter(leaf, nn.Parameter(run_tensor(spec, t, quantized, dtype, device),
                                                         requires_grad=False))
    # the NKI mixes kernels take fn as bf16 hi + lo, split once here (fp32 accuracy from bf16 matmuls)
    for block in model.layers:
        block.fn_split = {site: hc_ops.split_hi_lo(getattr(block, f"hc_{site}_fn")) for site in ("attn", "ffn")}
    model.fn_split = hc_ops.split_hi_lo(model.hc_head_fn)
    return model.eval()


def run_tensor(spec: TensorSpec, t: torch.Tensor, quantized: set[str], dtype: torch.dtype,
               device: torch.device | str) -> torch.Tensor:
    """A stored tensor as the model runs it: int64 tables; the vocabulary-sized tensors as stored, not copied
    (bf16 in the release: the embedding is exact after a cast, and the head's GEMM converts it chunk by chunk,
    so no fp32 copy of either is made); a dequantised weight in `weights.dequantized_dtype`; fp32 where
    DeepSeek's reference keeps fp32 (`fp32_param`); else the activation dtype."""
    if spec.name in STORED_DTYPE and t.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return t.to(device)
    if spec.kind == "index":
        want = torch.int64
    elif spec.name in quantized:
        want = dequantized_dtype(spec, dtype)
    else:
        want = torch.float32 if fp32_param(spec.name) else dtype
    return placed(t, want, device)


def placed(t: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """t itself when it already is a torch allocation of that dtype and device (a dequantised tensor), else a
    fresh copy: CPU GEMV results depend on the operand's alignment, and a mapped tensor sits at its offset
    in the shard."""
    own = t.untyped_storage().resizable() and t.storage_offset() == 0 and t.is_contiguous()
    if own and t.dtype == dtype and t.device == torch.device(device):
        return t
    return torch.empty(t.shape, dtype=dtype, device=device).copy_(t)
