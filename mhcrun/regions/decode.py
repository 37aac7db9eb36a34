"""One decode step as region stages with static shapes, for compilation.

A region is half a layer: the attention half (mHC mixes and collapse -> attn_norm -> attention with its
compressor and indexer state updates -> mHC post) or the MoE half (mixes and collapse -> ffn_norm -> MoE ->
post); the head is a region of its own. Each region is a list of stages; a stage is a function
`stage(spec, carry, inp) -> carry` where
- spec: the region kind's constants (a frozen dataclass: baked into the graph),
- carry: the tensors flowing between stages (x, h, post, comb, ...),
- inp: this layer's inputs: `w` (its weights), `roots` (the kind's root state buffers, stacked over the
  layers of the kind), `layer` (this layer's row in the roots, a 1-element int64 tensor), `pos` [B]
  (positions), `cos`/`sin` [max_seq, rd/2] (rope tables), `tokens` [B].
Every row of the batch is computed every step (B is fixed); a finished row just repeats its last step.
Nothing depends on tensor values in Python, so a stage traces to one graph, and layers of one kind share it.

The eager model (`mhcrun.model`) is the reference these stages are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mhcrun.model import grouped_output
from mhcrun.nki import ops as hc_ops
from mhcrun.ops.attention import compress_mask_decode, sparse_attn, window_mask_decode
from mhcrun.ops.compress import gather_overlap_state, pool
from mhcrun.ops.index import index_scores, select_topk
from mhcrun.ops.moe import gate_scores, route, swiglu
from mhcrun.ops.norm import rms_norm
from mhcrun.ops.qlinear import dequantize, fused_fits, gemv_fused, qgemv_expert_set, qlinear
from mhcrun.ops.quant import fp4_simulate, fp8_simulate, hadamard
from mhcrun.ops.rope import apply_rope_tail_real

Carry = dict[str, torch.Tensor]
Inputs = dict


@dataclass(frozen=True)
class HcSpec:
    n: int
    iters: int
    eps: float
    norm_eps: float


@dataclass(frozen=True)
class AttnSpec:
    ratio: int
    window: int
    n_heads: int
    head_dim: int
    rope_dim: int
    n_groups: int
    o_lora_rank: int
    norm_eps: float
    pow2: bool
    quant_sim: bool
    act_quant: frozenset[str]  # weight names whose GEMM rounds its activation to FP8 (quantised weights)
    formats: frozenset[tuple[str, str, int]]  # (name, fp8|fp4, block) of the weights kept quantised
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc: HcSpec


@dataclass(frozen=True)
class MoeSpec:
    hash: bool
    topk: int
    route_scale: float
    score_func: str
    limit: float
    norm_eps: float
    quant_sim: bool
    act_quant: frozenset[str]
    formats: frozenset[tuple[str, str, int]]
    hc: HcSpec
    inter: int  # routed experts' inner size


@dataclass(frozen=True)
class HeadSpec:
    hc: HcSpec


def weight_format(spec: AttnSpec | MoeSpec, name: str) -> tuple[str, int]:
    """(fmt, block) of a weight input: fp8 / fp4 when kept quantised (its scale is input `name_scale`)."""
    for n, fmt, block in spec.formats:
        if n == name:
            return fmt, block
    return "float", 0


def lin(spec: AttnSpec | MoeSpec, w: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    fmt, block = weight_format(spec, name)
    return qlinear(x, w[name], w.get(f"{name}_scale"), fmt, block, spec.quant_sim and name in spec.act_quant)


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
    """Projections, cache and compressor/indexer state updates, sparse attention, grouped output."""
    w, roots, layer, pos = inp["w"], inp["roots"], inp["layer"], inp["pos"]
    h = c["h"]  # [B, 1, d]
    B = h.size(0)
    rows = torch.arange(B, device=h.device)
    lb = layer.expand(B)
    cos, sin = inp["cos"][pos].unsqueeze(1), inp["sin"][pos].unsqueeze(1)  # [B, 1, rd/2]
    rd, win = spec.rope_dim, spec.window

    qr = rms_norm(lin(spec, w, "wq_a", h), w["q_norm"], spec.norm_eps)
    q = lin(spec, w, "wq_b", qr).unflatten(-1, (spec.n_heads, spec.head_dim))
    q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + spec.norm_eps)
    q = apply_rope_tail_real(q, cos.unsqueeze(2), sin.unsqueeze(2), rd)
    kv = apply_rope_tail_real(rms_norm(lin(spec, w, "wkv", h), w["kv_norm"], spec.norm_eps), cos, sin, rd)
    if spec.quant_sim:
        kv = simulate_kv_fp8(kv, rd, spec.pow2)
    roots["kv"].index_put_((lb, rows, pos % win), kv[:, 0])

    mask = window_mask_decode(pos, win)
    if spec.ratio:
        n_comp = roots["kv"].size(2) - win
        if spec.ratio == 4:
            chosen = indexer_step(spec, h, qr, inp)
        compressor_step(spec, spec.ratio, spec.head_dim, False, h, inp, "comp", roots["kv"], win)
        if spec.ratio != 4:
            chosen = compress_mask_decode(pos, n_comp, spec.ratio)
        mask = torch.cat([mask, chosen], dim=-1)
    cache = roots["kv"].index_select(0, layer).squeeze(0)  # [B, window + n_comp, hd]
    o = sparse_attn(q, cache, w["attn_sink"], mask.unsqueeze(1), spec.head_dim ** -0.5)
    o = apply_rope_tail_real(o, cos.unsqueeze(2), sin.unsqueeze(2), rd, inverse=True)
    o = o.reshape(B, 1, spec.n_groups, -1)
    o = grouped_output(o, w["wo_a"], w.get("wo_a_scale"), *weight_format(spec, "wo_a"), spec.n_groups)
    return {"x": c["x"], "y": lin(spec, w, "wo_b", o.flatten(2)), "post": c["post"], "comb": c["comb"]}


def simulate_kv_fp8(kv: torch.Tensor, rope_dim: int, pow2: bool) -> torch.Tensor:
    nope, pe = kv.split([kv.size(-1) - rope_dim, rope_dim], dim=-1)
    return torch.cat([fp8_simulate(nope, 64, pow2), pe], dim=-1)


def compressor_step(spec: AttnSpec, ratio: int, head_dim: int, rotate: bool, h: torch.Tensor, inp: Inputs,
                    prefix: str, cache_root: torch.Tensor, cache_offset: int) -> None:
    """Add this token to the open group; rows whose group closes write its pooled entry to the cache."""
    w, roots, layer, pos = inp["w"], inp["roots"], inp["layer"], inp["pos"]
    B = h.size(0)
    rows = torch.arange(B, device=h.device)
    lb = layer.expand(B)
    overlap, r = ratio == 4, ratio
    x = h.float()
    kv = qlinear(x, w[f"{prefix}_wkv"])[:, 0]
    score = qlinear(x, w[f"{prefix}_wgate"])[:, 0] + w[f"{prefix}_ape"][pos % r]
    slot = pos % r + (r if overlap else 0)
    kv_root, score_root = roots[f"{prefix}_kv"], roots[f"{prefix}_score"]
    kv_root.index_put_((lb, rows, slot), kv)
    score_root.index_put_((lb, rows, slot), score)
    kv_state = kv_root.index_select(0, layer).squeeze(0)  # [B, c*r, c*hd]
    score_state = score_root.index_select(0, layer).squeeze(0)
    if overlap:
        pooled = pool(gather_overlap_state(kv_state, r, head_dim), gather_overlap_state(score_state, r, head_dim), 1)
    else:
        pooled = pool(kv_state, score_state, 1)
    done = (pos + 1) % r == 0  # [B]
    start = (pos + 1 - r).clamp(min=0)  # the closing group's first position
    out = apply_rope_tail_real(rms_norm(pooled.to(h.dtype), w[f"{prefix}_norm"], spec.norm_eps),
                               inp["cos"][start], inp["sin"][start], spec.rope_dim)
    if rotate:
        out = hadamard(out)
        if spec.quant_sim:
            out = fp4_simulate(out, 32)
    elif spec.quant_sim:
        out = simulate_kv_fp8(out, spec.rope_dim, spec.pow2)
    # rows whose group is still open write their current entry back unchanged; clamp keeps a row at its
    # last position inside the cache
    entry = cache_offset + (pos // r).clamp(max=cache_root.size(2) - cache_offset - 1)
    current = cache_root.index_select(0, layer).squeeze(0)[rows, entry]
    cache_root.index_put_((lb, rows, entry), torch.where(done.unsqueeze(1), out.to(cache_root.dtype), current))
    if overlap:  # the closed group becomes the previous group of the next entry
        first = torch.arange(r, device=h.device).unsqueeze(0)
        keep = done.view(B, 1, 1)
        kv_root.index_put_((lb.unsqueeze(1), rows.unsqueeze(1), first),
                           torch.where(keep, kv_state[:, r:], kv_state[:, :r]))
        score_root.index_put_((lb.unsqueeze(1), rows.unsqueeze(1), first),
                              torch.where(keep, score_state[:, r:], score_state[:, :r]))


def indexer_step(spec: AttnSpec, h: torch.Tensor, qr: torch.Tensor, inp: Inputs) -> torch.Tensor:
    """The indexer's compressor step, then the top-k closed entries for each row -> mask [B, n_comp]."""
    w, roots, layer, pos = inp["w"], inp["roots"], inp["layer"], inp["pos"]
    cos, sin = inp["cos"][pos].view(-1, 1, 1, spec.rope_dim // 2), inp["sin"][pos].view(-1, 1, 1, spec.rope_dim // 2)
    q = lin(spec, w, "idx_wq_b", qr).unflatten(-1, (spec.index_heads, spec.index_head_dim))
    q = hadamard(apply_rope_tail_real(q, cos, sin, spec.rope_dim))
    if spec.quant_sim:
        q = fp4_simulate(q, 32)
    compressor_step(spec, 4, spec.index_head_dim, True, h, inp, "idx_comp", roots["idx_kv"], 0)
    weights = lin(spec, w, "idx_weights_proj", h) * (spec.index_head_dim ** -0.5 * spec.index_heads ** -0.5)
    keys = roots["idx_kv"].index_select(0, layer).squeeze(0)  # [B, n_comp, ihd]
    scores = index_scores(q, keys, weights)  # [B, 1, n_comp]
    valid = compress_mask_decode(pos, keys.size(1), 4).unsqueeze(1)
    return select_topk(scores, valid, spec.index_topk)[:, 0]


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
    scores = gate_scores(x, w["gate"], spec.score_func)
    if spec.hash:
        weights, idx = route(scores, spec.topk, spec.route_scale, spec.score_func,
                             hash_ids=w["tid2eid"][inp["tokens"]])
    else:
        weights, idx = route(scores, spec.topk, spec.route_scale, spec.score_func, bias=w["gate_bias"])
    quant = spec.quant_sim and "experts" in spec.act_quant
    fmt, block = weight_format(spec, "experts")

    def routed(name: str, xs: torch.Tensor) -> torch.Tensor:
        """xs [B, k or 1, in] through each row's k routed experts' weights `name` -> [B, k, out] (fp32)."""
        if f"{name}_set" in w:  # the fused CPU kernel, reading the experts where they are
            out = d if name == "w2" else spec.inter
            return qgemv_expert_set(xs.float(), w[f"{name}_set"], idx, fmt, block, out)
        data = w[name][idx]  # [B, k, out, in']
        if fmt != "float" and fused_fits(data, fmt, block, 1):  # dequantisation fused into the reduction
            return gemv_fused(xs.float().unsqueeze(-2), data, w[f"{name}_scale"][idx], fmt, block)
        weight = data.float() if fmt == "float" else dequantize(data, w[f"{name}_scale"][idx], fmt, block)
        return torch.einsum("bkd,bkfd->bkf", xs.float().expand(-1, weight.size(1), -1), weight)

    xq = fp8_simulate(x, 128) if quant else x
    g = routed("w1", xq.unsqueeze(1)).to(x.dtype)  # [B, k, inter]
    u = routed("w3", xq.unsqueeze(1)).to(x.dtype)
    mid = (swiglu(g, u, spec.limit) * weights.unsqueeze(-1)).to(x.dtype)
    if quant:
        mid = fp8_simulate(mid, 128)
    y = routed("w2", mid).to(x.dtype).float().sum(dim=1)
    shared = lin(spec, w, "shared_w2", swiglu(lin(spec, w, "shared_w1", x), lin(spec, w, "shared_w3", x),
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
    return {"logits": qlinear(h.float(), w["head"])}


STAGES = {
    "attn": [("mix", attn_mix), ("core", attn_core), ("post", post_step)],
    "moe": [("mix", moe_mix), ("core", moe_core), ("post", post_step)],
    "head": [("head", head)],
}
