"""One decode step as region stages with static shapes, for compilation.

A region is half a layer: the attention half (mHC mixes and collapse -> attn_norm -> attention with its
compressor and indexer state updates -> mHC post) or the MoE half (mixes and collapse -> ffn_norm -> MoE ->
post); the head is a region of its own. Each region is a list of stages; a stage is a function
`stage(spec, carry, inp) -> carry` where
- spec: the region kind's constants (a frozen dataclass: baked into the graph),
- carry: the tensors flowing between stages (x, h, post, comb, ...),
- inp: this layer's inputs: `w` (its weights, keyed by their weights-table names after `layers.i.`, e.g.
  `attn.wq_a`, with `.scale` for those kept quantised: `regions.runner.region_inputs`), `roots` (the kind's
  root state buffers, stacked over the layers of the kind), `layer` (this layer's row in the roots, a 1-element
  int64 tensor), `pos` [B] (positions), `cos`/`sin` [max_seq, rd/2] (rope tables), `tokens` [B].
Every row of the batch is computed every step (B is fixed); a finished row just repeats its last step.
Nothing depends on tensor values in Python, so a stage traces to one graph, and layers of one kind share it.

The eager model (`mhcrun.model`) is the reference these stages are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mhcrun.model import finish_entry, finish_index_queries
from mhcrun.nki import ops as hc_ops
from mhcrun.ops import kvcache
from mhcrun.ops.attention import closed_mask, sparse_attn, window_mask
from mhcrun.ops.compress import compress_chunk
from mhcrun.ops.index import index_scores, select_topk
from mhcrun.ops.kvcache import CacheFormat
from mhcrun.ops.moe import gate_scores, route, swiglu
from mhcrun.ops.norm import rms_norm
from mhcrun.ops.qlinear import dequantize, fused_fits, gemv_fused, qgemv_expert_set, qlinear, qlinear_grouped
from mhcrun.ops.quant import ACT_FP8_BLOCK, fp8_simulate
from mhcrun.ops.qweight import QWeight
from mhcrun.ops.rope import apply_rope_tail_real
from mhcrun.parallel import SINGLE, Shard, all_reduce, gather_vocab

Carry = dict[str, torch.Tensor]
Inputs = dict


@dataclass(frozen=True)
class LinearSpec:
    """What a graph knows of a weight input beyond its tensors (its QWeight's block and kernel flag, fixed
    while tracing) and whether its GEMM rounds the activation to FP8 (a weight stored quantised)."""

    block: int
    kernel: bool
    act_quant: bool


@dataclass(frozen=True)
class HcSpec:
    n: int
    iters: int
    eps: float
    norm_eps: float


@dataclass(frozen=True)
class AttnSpec:
    """Under --tp, n_heads, n_groups and index_heads are this rank's (`tp`), and its outputs are all-reduced."""

    ratio: int
    window: int
    n_heads: int
    head_dim: int
    rope_dim: int
    n_groups: int
    o_lora_rank: int
    norm_eps: float
    quant_sim: bool
    kv_fmt: CacheFormat  # how the KV cache stores an entry (FP8 with the simulation on)
    idx_fmt: CacheFormat  # how the indexer's key cache stores an entry (FP4 with the simulation on)
    max_seq: int  # the cache's context: the compressed entry slots are max_seq // ratio
    linears: tuple[tuple[str, LinearSpec], ...]  # every weight input a GEMM takes (regions.runner.region_inputs)
    index_heads: int
    index_head_dim: int
    index_topk: int
    index_weight_scale: float  # index_head_dim ** -0.5 * (every rank's index heads) ** -0.5
    hc: HcSpec
    tp: Shard = SINGLE


@dataclass(frozen=True)
class MoeSpec:
    hash: bool
    topk: int
    route_scale: float
    score_func: str
    limit: float
    norm_eps: float
    quant_sim: bool
    linears: tuple[tuple[str, LinearSpec], ...]
    hc: HcSpec
    inter: int  # routed experts' inner size
    experts: tuple[int, int] = (0, 0)  # [first, end) of this rank's routed experts (all of them on one rank)
    tp: Shard = SINGLE


@dataclass(frozen=True)
class HeadSpec:
    hc: HcSpec
    linears: tuple[tuple[str, LinearSpec], ...]
    vocab: int = 0  # the whole vocabulary (each rank's head holds its rows under --tp)
    tp: Shard = SINGLE


Spec = AttnSpec | MoeSpec | HeadSpec


def weight(spec: Spec, w: dict[str, torch.Tensor], name: str) -> QWeight:
    """Weight input `name` (and `name.scale` when kept quantised) as the QWeight it was loaded as."""
    ls = dict(spec.linears)[name]
    return QWeight(w[name], w.get(f"{name}.scale"), ls.block, ls.kernel)


def lin(spec: Spec, w: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    quant = getattr(spec, "quant_sim", False) and dict(spec.linears)[name].act_quant
    return qlinear(x, weight(spec, w, name), quant)


def mixes(hc: HcSpec, x: torch.Tensor, w: dict[str, torch.Tensor], site: str):
    return hc_ops.hc_mixes(x, w[f"hc_{site}_fn"], w[f"hc_{site}_fn_hi"], w[f"hc_{site}_fn_lo"],
                           w[f"hc_{site}_scale"], w[f"hc_{site}_base"], hc.n, hc.iters, hc.eps, hc.norm_eps)


# ---------------------------------------------------------------------------------------------- attention


def mix_and_collapse(spec: AttnSpec | MoeSpec, c: Carry, inp: Inputs, site: str) -> Carry:
    """mHC mixes of a site ("attn" or "ffn"), collapse, then the sublayer's norm."""
    w = inp["w"]
    pre, post, comb = mixes(spec.hc, c["x"], w, site)
    h = rms_norm(hc_ops.hc_collapse(c["x"], pre), w[f"{site}_norm"], spec.norm_eps)
    return {"x": c["x"], "h": h, "post": post, "comb": comb}


def post_step(spec: AttnSpec | MoeSpec, c: Carry, inp: Inputs) -> Carry:
    """mHC post: the sublayer output y back into the streams."""
    return {"x": hc_ops.hc_post(c["y"], c["x"], c["post"], c["comb"])}


def attn_mix(spec: AttnSpec, c: Carry, inp: Inputs) -> Carry:
    return mix_and_collapse(spec, c, inp, "attn")


def attn_core(spec: AttnSpec, c: Carry, inp: Inputs) -> Carry:
    """Projections, cache and compressor/indexer state updates, sparse attention, grouped output: the eager
    `Attention.forward` for a chunk of one token per row, on fixed shapes (the window's ring, then this token;
    CSA's top-k gathered into a fixed [B, index_topk] set with a validity mask; HCA's entries under a mask)."""
    w, roots, layer, pos = inp["w"], inp["roots"], inp["layer"], inp["pos"]
    h = c["h"]  # [B, 1, d]
    B, dtype = h.size(0), h.dtype
    at = cache_index(layer, B)
    cos, sin = inp["cos"][pos].unsqueeze(1), inp["sin"][pos].unsqueeze(1)  # [B, 1, rd/2]
    rd, win, fmt = spec.rope_dim, spec.window, spec.kv_fmt

    qr = rms_norm(lin(spec, w, "attn.wq_a", h), w["attn.q_norm"], spec.norm_eps)
    q = lin(spec, w, "attn.wq_b", qr).unflatten(-1, (spec.n_heads, spec.head_dim))
    q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + spec.norm_eps)
    q = apply_rope_tail_real(q, cos.unsqueeze(2), sin.unsqueeze(2), rd)
    kv = apply_rope_tail_real(rms_norm(lin(spec, w, "attn.wkv", h), w["attn.kv_norm"], spec.norm_eps), cos, sin, rd)
    stored = kvcache.encode(fmt, kv)
    kv = kvcache.decode(fmt, stored, dtype)
    ring = read_cache(roots, "kv", fmt, at(torch.arange(win, device=h.device)), dtype)  # before this token
    keys, mask = torch.cat([ring, kv], dim=1), window_mask(pos, 1, win)
    kvcache.store(kvcache.parts_of(roots, "kv", fmt), at((pos % win).unsqueeze(1)), stored)

    sel = sel_mask = None
    if spec.ratio == 4:
        chosen, valid = indexer_step(spec, h, qr, inp)  # [B, 1, k]
    if spec.ratio:
        compressor_step(spec, spec.ratio, spec.head_dim, False, h, inp, "attn.compressor", "comp", "kv", fmt, win)
    if spec.ratio == 4:
        sel, sel_mask = read_cache(roots, "kv", fmt, at(win + chosen[:, 0]), dtype).unsqueeze(1), valid
    elif spec.ratio:
        n_comp = spec.max_seq // spec.ratio
        comp = read_cache(roots, "kv", fmt, at(win + torch.arange(n_comp, device=h.device)), dtype)
        keys, mask = torch.cat([keys, comp], dim=1), torch.cat([mask, closed_mask(pos, 1, n_comp, spec.ratio)], -1)
    o = sparse_attn(q, keys, mask, w["attn.attn_sink"], spec.head_dim ** -0.5, sel, sel_mask)
    o = apply_rope_tail_real(o, cos.unsqueeze(2), sin.unsqueeze(2), rd, inverse=True)
    o = qlinear_grouped(o.reshape(B, 1, spec.n_groups, -1), weight(spec, w, "attn.wo_a"), spec.n_groups)
    y = all_reduce(lin(spec, w, "attn.wo_b", o.flatten(2)), spec.tp)  # every rank's o_groups
    return {"x": c["x"], "y": y, "post": c["post"], "comb": c["comb"]}


def cache_index(layer: torch.Tensor, B: int):
    """-> at(slots [B, n]) = the index (layer, row, slot) of n cache entries per row in a kind's root buffers."""
    lb, rows = layer.expand(B).unsqueeze(1), torch.arange(B, device=layer.device).unsqueeze(1)
    return lambda slots: (lb, rows, slots)


def read_cache(roots: dict, name: str, fmt: CacheFormat, index: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The entries at `index` of cache `name`, decoded (only those entries are read)."""
    return kvcache.read(kvcache.parts_of(roots, name, fmt), fmt, index, dtype)


def compressor_step(spec: AttnSpec, ratio: int, head_dim: int, rotate: bool, h: torch.Tensor, inp: Inputs,
                    weights: str, state: str, cache: str, fmt: CacheFormat, cache_offset: int) -> None:
    """Add this token to the open group (`compress_chunk`, as the eager compressor); rows whose group closes
    store its entry, the others write their current entry back unchanged."""
    w, roots, layer, pos = inp["w"], inp["roots"], inp["layer"], inp["pos"]
    B = h.size(0)
    at = cache_index(layer, B)
    x = h.float()
    kv = lin(spec, w, f"{weights}.wkv", x)
    score = lin(spec, w, f"{weights}.wgate", x) + w[f"{weights}.ape"][pos % ratio].unsqueeze(1)
    kv_root, score_root = roots[f"{state}_kv"], roots[f"{state}_score"]
    fresh = (pos == 0).view(-1, 1, 1)
    kv_state = kv_root.index_select(0, layer).squeeze(0).masked_fill(fresh, 0.0)  # [B, c*r, c*hd]
    score_state = score_root.index_select(0, layer).squeeze(0).masked_fill(fresh, float("-inf"))
    pooled, closed, entry, new_kv, new_score = compress_chunk(kv_state, score_state, kv, score, pos, ratio,
                                                              ratio == 4)
    state_at = (layer.expand(B), torch.arange(B, device=h.device))
    kv_root.index_put_(state_at, new_kv)
    score_root.index_put_(state_at, new_score)
    g = 1 if ratio == 4 else 0  # the buffer group that holds this token (after the previous group with overlap)
    done, entry = closed[:, g], entry[:, g]
    cos, sin = inp["cos"][entry * ratio], inp["sin"][entry * ratio]
    out = finish_entry(pooled[:, g].to(h.dtype), w[f"{weights}.norm"], spec.norm_eps,
                       lambda t: apply_rope_tail_real(t, cos, sin, spec.rope_dim), rotate)
    # a row whose group is still open writes its current entry back; clamp keeps a row's last slot in the cache
    slot = (cache_offset + entry.clamp(max=spec.max_seq // ratio - 1)).unsqueeze(1)
    parts = kvcache.parts_of(roots, cache, fmt)
    stored = {}
    for p, v in kvcache.encode(fmt, out).items():
        current = as_bytes(parts[p][at(slot)][:, 0])  # FP8 codes as their bytes: inductor cannot select float8
        new = as_bytes(v.to(parts[p].dtype))
        stored[p] = torch.where(done.view(-1, *[1] * (v.dim() - 1)), new, current).view(parts[p].dtype).unsqueeze(1)
    kvcache.store(parts, at(slot), stored)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def indexer_step(spec: AttnSpec, h: torch.Tensor, qr: torch.Tensor, inp: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's compressor step, then each row's top-k closed entries (the tie rule of `mhcrun.ops.index`)
    among all its entry slots -> (entries, valid) [B, 1, min(index_topk, n_comp)]."""
    w, roots, pos = inp["w"], inp["roots"], inp["pos"]
    cos, sin = inp["cos"][pos].view(-1, 1, 1, spec.rope_dim // 2), inp["sin"][pos].view(-1, 1, 1, spec.rope_dim // 2)
    q = lin(spec, w, "attn.indexer.wq_b", qr).unflatten(-1, (spec.index_heads, spec.index_head_dim))
    q = finish_index_queries(q, lambda t: apply_rope_tail_real(t, cos, sin, spec.rope_dim), spec.quant_sim)
    compressor_step(spec, 4, spec.index_head_dim, True, h, inp, "attn.indexer.compressor", "idx_comp", "idx_kv",
                    spec.idx_fmt, 0)
    weights = lin(spec, w, "attn.indexer.weights_proj", h) * spec.index_weight_scale
    n_comp = spec.max_seq // 4
    at = cache_index(inp["layer"], h.size(0))
    keys = read_cache(roots, "idx_kv", spec.idx_fmt, at(torch.arange(n_comp, device=h.device)), q.dtype)
    scores = all_reduce(index_scores(q, keys, weights), spec.tp)  # [B, 1, n_comp], every rank's heads
    return select_topk(scores, closed_mask(pos, 1, n_comp, 4), spec.index_topk)


# ---------------------------------------------------------------------------------------------- MoE


def moe_mix(spec: MoeSpec, c: Carry, inp: Inputs) -> Carry:
    return mix_and_collapse(spec, c, inp, "ffn")


def moe_core(spec: MoeSpec, c: Carry, inp: Inputs) -> Carry:
    """Route each row's token, then run its experts as gathered batched GEMMs (static shapes), plus the
    shared expert."""
    w = inp["w"]
    h = c["h"]  # [B, 1, d]
    B, d = h.size(0), h.size(-1)
    x = h.reshape(B, d)
    scores = gate_scores(x, w["ffn.gate"], spec.score_func)
    if spec.hash:
        weights, idx = route(scores, spec.topk, spec.route_scale, spec.score_func,
                             hash_ids=w["ffn.gate.tid2eid"][inp["tokens"]])
    else:
        weights, idx = route(scores, spec.topk, spec.route_scale, spec.score_func, bias=w["ffn.gate.bias"])
    quant = spec.quant_sim and dict(spec.linears)["ffn.experts.w1"].act_quant
    if spec.tp.world > 1:  # this rank's experts only: the others' routes weigh nothing here
        e0, e1 = spec.experts
        weights = weights * ((idx >= e0) & (idx < e1))
        idx = (idx - e0).clamp(0, e1 - e0 - 1)

    def routed(name: str, xs: torch.Tensor) -> torch.Tensor:
        """xs [B, k or 1, in] through each row's k routed experts' weights `name` -> [B, k, out] (fp32)."""
        key = f"ffn.experts.{name}"
        if f"{key}.set" in w:  # the fused CPU kernel, reading the experts where they are
            return qgemv_expert_set(xs.float(), w[f"{key}.set"], idx, d if name == "w2" else spec.inter)
        scale = w.get(f"{key}.scale")
        ew = QWeight(w[key][idx], None if scale is None else scale[idx], dict(spec.linears)[key].block)
        if ew.fmt != "float" and fused_fits(ew, 1):  # [B, k, out, in']: dequantisation fused into the reduction
            return gemv_fused(xs.float().unsqueeze(-2), ew)
        return torch.einsum("bkd,bkfd->bkf", xs.float().expand(-1, idx.size(1), -1), dequantize(ew))

    xq = fp8_simulate(x, ACT_FP8_BLOCK) if quant else x
    g = routed("w1", xq.unsqueeze(1)).to(x.dtype)  # [B, k, inter]
    u = routed("w3", xq.unsqueeze(1)).to(x.dtype)
    mid = (swiglu(g, u, spec.limit) * weights.unsqueeze(-1)).to(x.dtype)
    if quant:
        mid = fp8_simulate(mid, ACT_FP8_BLOCK)
    y = all_reduce(routed("w2", mid).to(x.dtype).float().sum(dim=1), spec.tp)  # every rank's experts
    s = "ffn.shared_experts"
    shared = lin(spec, w, f"{s}.w2", swiglu(lin(spec, w, f"{s}.w1", x), lin(spec, w, f"{s}.w3", x),
                                            spec.limit).to(x.dtype))
    y = (y + shared).to(x.dtype).view(B, 1, d)
    return {"x": c["x"], "y": y, "post": c["post"], "comb": c["comb"]}


# ---------------------------------------------------------------------------------------------- head


def head(spec: HeadSpec, c: Carry, inp: Inputs) -> Carry:
    """V4's head collapse, final norm, logits (fp32)."""
    w, hc = inp["w"], spec.hc
    h = hc_ops.hc_head(c["x"], w["hc_head_fn"], w["hc_head_fn_hi"], w["hc_head_fn_lo"], w["hc_head_scale"],
                       w["hc_head_base"], hc.eps, hc.norm_eps)
    h = rms_norm(h, w["norm"], hc.norm_eps)[:, -1]
    return {"logits": gather_vocab(lin(spec, w, "head", h.float()), spec.tp, spec.vocab)}


STAGES = {
    "attn": [("mix", attn_mix), ("core", attn_core), ("post", post_step)],
    "moe": [("mix", moe_mix), ("core", moe_core), ("post", post_step)],
    "head": [("head", head)],
}
