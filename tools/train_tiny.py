"""Train the bundled tiny model: DeepSeek V4's architecture at toy size, plus its MTP layer, on the docstrings of
Python's standard library.

    python tools/train_tiny.py --out mhcrun/data/tiny --force          # the bundled checkpoint (~15 min, 2 cores)
    python tools/train_tiny.py --out /tmp/t --steps 3 --max-docs 200   # a smoke run
    python tools/train_tiny.py --evaluate mhcrun/data/tiny              # held-out numbers of a written model

The text: every docstring (module, class, function) of the running Python's standard library (`ast` over
`sysconfig`'s stdlib directory; test packages, idlelib's tests and site-packages left out; ASCII docstrings only,
so that the byte-level vocabulary never has to spell a multi-byte character). Python's standard library is under
the PSF License. One module in twenty (by a hash of its path) is held out for evaluation. The tokenizer is
mhcrun's byte-level BPE (`mhcrun.tokenizer.build_tiny_tokenizer`) trained on the training docstrings.

The forward pass (`forward`) is a differentiable formulation of what mhcrun's eager model computes for a chunk
at start 0 with the quantisation simulation off, built on mhcrun's reference ops (`mhcrun.ops`): mHC mixes with
Sinkhorn, collapse and post (in the reference's summation form, which autograd takes), sliding-window attention
with sinks, the overlapping 4:1 compressor with the Lightning indexer (CSA) and the 16:1 compressor (HCA), hash
and routed MoE with a shared expert, V4's head collapse. `tests/test_train_tiny.py` holds its logits to mhcrun's.
What is not differentiable is handled as DeepSeek's training does:
- **Indexer top-k**: the selection (`mhcrun.ops.index.select_topk`, mhcrun's tie rule) takes no gradient. The
  indexer learns from its own loss, as in DeepSeek V3.2's dense warm-up: the KL divergence from the main
  attention's distribution over the closed compressed entries (each head's softmax over them, averaged over
  heads, detached) to the softmax of the index scores; the indexer's inputs are detached, so that loss trains
  the indexer only and the main loss does not reach it.
- **MoE routing**: top-k and the hash table `tid2eid` (fixed, drawn from the seed) choose experts without
  gradient; the gate weights get gradient through the selected experts' scores. The selection bias of routed
  layers is moved by DeepSeek's auxiliary-loss-free rule: after each step, bias += rate * sign(mean load - load).
- **MTP** (DeepSeek's objective, one layer `mtp.0`): from the main model's hc streams before the head at position
  t (un-collapsed, [n, d] per token) and the embedding of token t+1, predict token t+2: e_proj(enorm(embed)) is
  added to h_proj(hnorm(streams)) on every stream, a V4 block runs (attention of kind `compress_ratios[n_layers]`,
  routed MoE), then the MTP layer's own head collapse and norm, and the shared head. Its loss is weighted by
  `MTP_WEIGHT`. The MTP tensors' names and shapes are `mhcrun.weights.mtp_tensor_specs`'; mhcrun runs the layer
  to draft tokens (`generate --draft-tokens`, `mhcrun.speculate`).

Deterministic from `--seed` for a given Python (its docstrings), torch version and thread count (`--threads`).
Prints the held-out loss of the written (bf16) checkpoint beside a unigram baseline, and bits per byte.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F

from mhcrun.checkpoint import write_checkpoint
from mhcrun.config import ModelConfig, config_from_hf
from mhcrun.errors import ConfigError, InputError, run_script
from mhcrun.fileio import read_json
from mhcrun.ops.attention import closed_mask, sparse_attn, window_mask
from mhcrun.ops.compress import compress_chunk
from mhcrun.ops.hc import hc_mixes, hc_norm_mixes
from mhcrun.ops.index import index_scores, select_topk
from mhcrun.ops.moe import gate_scores, route, swiglu
from mhcrun.ops.norm import rms_norm
from mhcrun.ops.quant import hadamard
from mhcrun.ops.rope import apply_rope_tail, precompute_freqs_cis
from mhcrun.tiny import init_tensor, release_tensor, tiny_config_raw
from mhcrun.tokenizer import SPECIAL_TOKENS, build_tiny_tokenizer
from mhcrun.weights import mtp_tensor_specs, tensor_specs

VOCAB = 1024
SEQ = 128  # training sequence: 8 windows, 32 CSA groups, 8 HCA groups
MTP_WEIGHT = 0.3  # DeepSeek V3's MTP loss weight (early training)
INDEX_WEIGHT = 1.0
BIAS_RATE = 1e-3  # aux-loss-free balancing step
HOLD_OUT = 20  # one module in HOLD_OUT is held out
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "lib2to3"}


def rope_tail(x: torch.Tensor, freqs: torch.Tensor, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """mhcrun's RoPE on the last rope_dim channels, from a complex table [..., rd/2] (its cos and sin parts)."""
    return apply_rope_tail(x, freqs.real, freqs.imag, rope_dim, inverse)


# ---------------------------------------------------------------- text

def stdlib_docstrings(root: Path, max_docs: int | None = None) -> tuple[list[str], list[str]]:
    """(training, held-out) docstrings of the standard library under `root`, in file order."""
    train, held = [], []
    files = sorted(p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts))
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        rel = path.relative_to(root).as_posix()
        out = held if int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HOLD_OUT == 0 else train
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and doc.isascii():
                    out.append(doc)
    if max_docs is not None:
        train, held = train[:max_docs], held[:max(1, max_docs // HOLD_OUT)]
    return train, held


def token_stream(tok, docs: list[str]) -> torch.Tensor:
    """BOS doc EOS BOS doc EOS ... as one int64 stream."""
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids += [0, *enc.ids, 1]
    return torch.tensor(ids, dtype=torch.long)


def byte_lengths(tok) -> torch.Tensor:
    """Bytes each id spells (byte-level BPE: one character of a token per byte; special tokens 0)."""
    lens = torch.zeros(tok.get_vocab_size(), dtype=torch.float64)
    for s, i in tok.get_vocab().items():
        lens[i] = 0 if s in SPECIAL_TOKENS else len(s)
    return lens


# ---------------------------------------------------------------- model

def trained_config_raw() -> dict:
    """The bundled model's config: the random tiny model's architecture, a 1,024-id vocabulary, one MTP layer
    (sliding window, as V4's)."""
    raw = tiny_config_raw()
    raw["vocab_size"] = VOCAB
    raw["num_nextn_predict_layers"] = 1
    raw["compress_ratios"] = list(raw["compress_ratios"]) + [0]
    return raw


def all_specs(cfg: ModelConfig):
    return tensor_specs(cfg) + mtp_tensor_specs(cfg)


def init_params(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """fp32 parameters (requires_grad) and int64 tables, drawn from `seed` (mhcrun.tiny's roles; a small head)."""
    g = torch.Generator().manual_seed(seed)
    params = {}
    for spec in all_specs(cfg):
        t = init_tensor(spec.name, spec.shape, cfg, g)
        if spec.name == "head.weight":
            t = t / 8.0
        if t.dtype == torch.int32:
            params[spec.name] = t.long()
        else:
            params[spec.name] = t.float().requires_grad_(not spec.name.endswith("gate.bias"))
    return params


@dataclass
class Ctx:
    cfg: ModelConfig
    freqs: dict  # 0 -> window rope, "compressed" -> YaRN rope, each [S, rd/2] complex
    aux: list  # indexer losses of this forward
    loads: dict  # routed layer prefix -> expert counts of this forward


def make_ctx(cfg: ModelConfig, s: int) -> Ctx:
    c = cfg
    return Ctx(cfg, {0: precompute_freqs_cis(c.rope_head_dim, s, 0, c.rope_theta, c.rope_factor, c.beta_fast,
                                              c.beta_slow),
                     "compressed": precompute_freqs_cis(c.rope_head_dim, s, c.original_seq_len,
                                                        c.compress_rope_theta, c.rope_factor, c.beta_fast,
                                                        c.beta_slow)}, [], {})


def linear(P: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, P[name + ".weight"])


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_m pre[m] X[m]: x [b,s,n,d], pre [b,s,n] -> [b,s,d] (the reference's form of mhcrun's hc_collapse)."""
    return (pre.unsqueeze(-1) * x).sum(dim=2)


def post_step(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'[o] = post[o] y + sum_i comb[i, o] R[i] (the reference's form of mhcrun's hc_post)."""
    return post.unsqueeze(-1) * y.unsqueeze(-2) + (comb.unsqueeze(-1) * res.unsqueeze(-2)).sum(dim=2)


def compressed_entries(P: dict, p: str, x: torch.Tensor, ratio: int, f: torch.Tensor, eps: float,
                       rope_dim: int, rotate: bool) -> torch.Tensor:
    """Every closed group of a sequence at start 0 pooled into its entry: x [b,S,d] -> [b, S // ratio, hd]."""
    b, s, _ = x.shape
    overlap = ratio == 4
    lead = ratio if overlap else 0
    kv = linear(P, p + "wkv", x)
    score = linear(P, p + "wgate", x) + P[p + "ape"][torch.arange(s) % ratio]
    width = kv.size(-1)
    state_kv = kv.new_zeros(b, lead + ratio, width)
    state_score = kv.new_full((b, lead + ratio, width), float("-inf"))
    pooled = compress_chunk(state_kv, state_score, kv, score, torch.zeros(b, dtype=torch.long), ratio, overlap)[0]
    n = s // ratio
    pooled = pooled[:, lead // ratio: lead // ratio + n]
    out = rope_tail(rms_norm(pooled, P[p + "norm.weight"], eps), f[torch.arange(n) * ratio], rope_dim)
    return hadamard(out) if rotate else out


def attention(P: dict, p: str, x: torch.Tensor, ratio: int, ctx: Ctx) -> torch.Tensor:
    """mhcrun's Attention.forward for a sequence at start 0 (quant simulation off): x [b,S,d] -> [b,S,d]."""
    c = ctx.cfg
    b, s, _ = x.shape
    H, hd, rd, eps = c.n_heads, c.head_dim, c.rope_head_dim, c.norm_eps
    f = ctx.freqs["compressed" if ratio else 0][:s]
    qr = rms_norm(linear(P, p + "wq_a", x), P[p + "q_norm.weight"], eps)
    q = linear(P, p + "wq_b", qr).unflatten(-1, (H, hd))
    q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)
    q = rope_tail(q, f.unsqueeze(1), rd)
    kv = rope_tail(rms_norm(linear(P, p + "wkv", x), P[p + "kv_norm.weight"], eps), f, rd)
    start = torch.zeros(b, dtype=torch.long)
    keys = torch.cat([kv.new_zeros(b, c.window_size, hd), kv], dim=1)  # an empty ring, then the sequence
    mask = window_mask(start, s, c.window_size)
    sel = sel_mask = None
    if ratio:
        comp = compressed_entries(P, p + "compressor.", x, ratio, f, eps, rd, rotate=False)
        closed = closed_mask(start, s, comp.size(1), ratio)
        if ratio == 4:
            sel, sel_mask = indexed_entries(P, p + "indexer.", x, qr, q, comp, closed, f, ctx)
        else:
            keys, mask = torch.cat([keys, comp], dim=1), torch.cat([mask, closed], dim=-1)
    o = sparse_attn(q, keys, mask, P[p + "attn_sink"], hd ** -0.5, sel, sel_mask)
    o = rope_tail(o, f.unsqueeze(1), rd, inverse=True).reshape(b, s, c.o_groups, -1)
    w = P[p + "wo_a.weight"]
    o = torch.einsum("bsgd,grd->bsgr", o, w.view(c.o_groups, -1, w.size(-1)))
    return linear(P, p + "wo_b", o.flatten(2))


def indexed_entries(P: dict, p: str, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, comp: torch.Tensor,
                    closed: torch.Tensor, f: torch.Tensor, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """CSA: the indexer's top-k entries per query, gathered -> (sel [b,S,k,hd], valid [b,S,k]). Adds the
    indexer's KL loss (its scores against the main attention's distribution over the closed entries) to ctx.aux."""
    c = ctx.cfg
    b, s, _ = x.shape
    x, qr = x.detach(), qr.detach()  # the indexer learns from its own loss only
    iq = linear(P, p + "wq_b", qr).unflatten(-1, (c.index_n_heads, c.index_head_dim))
    iq = hadamard(rope_tail(iq, f.unsqueeze(1), c.rope_head_dim))
    keys = compressed_entries(P, p + "compressor.", x, 4, f, c.norm_eps, c.rope_head_dim, rotate=True)
    w = linear(P, p + "weights_proj", x) * (c.index_head_dim ** -0.5 * c.index_n_heads ** -0.5)
    scores = index_scores(iq, keys, w)  # [b, S, n]
    chosen, valid = select_topk(scores.detach(), closed, c.index_topk)
    rows = closed.any(-1)
    if bool(rows.any()):
        att = torch.einsum("bshd,bnd->bshn", q.detach(), comp.detach()) * c.head_dim ** -0.5
        target = att.masked_fill(~closed.unsqueeze(2), float("-inf")).softmax(-1).mean(2)[rows]
        logp = scores.masked_fill(~closed, float("-inf")).log_softmax(-1)[rows]
        kl = (target * (target.clamp_min(1e-30).log() - logp.clamp_min(-1e4))).masked_fill(target == 0, 0.0)
        ctx.aux.append(kl.sum(-1).mean())
    sel = comp[torch.arange(b).view(-1, 1, 1), chosen]
    return sel, valid


def moe(P: dict, p: str, x: torch.Tensor, token_ids: torch.Tensor, hash_layer: bool, ctx: Ctx) -> torch.Tensor:
    """mhcrun's MoE: x [b,S,d] -> [b,S,d] (routed experts weighted by their renormalised scores, plus the
    shared expert)."""
    c = ctx.cfg
    shape = x.shape
    x = x.reshape(-1, c.dim)
    scores = gate_scores(x, P[p + "gate.weight"], c.score_func)
    if hash_layer:
        weights, idx = route(scores, c.n_activated_experts, c.route_scale, c.score_func,
                             hash_ids=P[p + "gate.tid2eid"][token_ids.reshape(-1)])
    else:
        weights, idx = route(scores, c.n_activated_experts, c.route_scale, c.score_func, bias=P[p + "gate.bias"])
        ctx.loads[p] = torch.bincount(idx.flatten(), minlength=c.n_routed_experts)
    y = torch.zeros_like(x)
    for e in range(c.n_routed_experts):  # only the tokens routed to each expert, as mhcrun's MoE
        tok, slot = torch.where(idx == e)
        if tok.numel():
            q = f"{p}experts.{e}."
            h = swiglu(linear(P, q + "w1", x[tok]), linear(P, q + "w3", x[tok]), c.swiglu_limit)
            y = y.index_add(0, tok, linear(P, q + "w2", weights[tok, slot, None] * h))
    s = p + "shared_experts."
    y = y + linear(P, s + "w2", swiglu(linear(P, s + "w1", x), linear(P, s + "w3", x), c.swiglu_limit))
    return y.view(shape)


def block(P: dict, p: str, layer: int, x: torch.Tensor, token_ids: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    """One V4 layer (Block.attn_half then ffn_half): x [b,S,n,d] -> [b,S,n,d]."""
    c = ctx.cfg

    def mixes(site: str):
        return hc_mixes(x, P[f"{p}hc_{site}_fn"], P[f"{p}hc_{site}_scale"], P[f"{p}hc_{site}_base"], c.hc_mult,
                        c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps)

    pre, post, comb = mixes("attn")
    h = attention(P, p + "attn.", rms_norm(collapse(x, pre), P[p + "attn_norm.weight"], c.norm_eps),
                  c.compress_ratios[layer], ctx)
    x = post_step(h, x, post, comb)
    pre, post, comb = mixes("ffn")
    h = moe(P, p + "ffn.", rms_norm(collapse(x, pre), P[p + "ffn_norm.weight"], c.norm_eps), token_ids,
            layer < c.n_hash_layers, ctx)
    return post_step(h, x, post, comb)


def head(P: dict, p: str, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """V4's head collapse (hc_head_* under prefix p), norm, shared head: x [b,S,n,d] -> logits [b,S,V]."""
    pre = torch.sigmoid(hc_norm_mixes(x, P[p + "hc_head_fn"], cfg.norm_eps) * P[p + "hc_head_scale"]
                        + P[p + "hc_head_base"]) + cfg.hc_eps
    return F.linear(rms_norm(collapse(x, pre), P[p + "norm.weight"], cfg.norm_eps), P["head.weight"])


def forward(P: dict, tokens: torch.Tensor, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [b,S] at positions [0, S) -> (logits [b,S,V] at every position, the hc streams before the head
    [b,S,n,d])."""
    c = ctx.cfg
    x = P["embed.weight"][tokens].unsqueeze(2).repeat(1, 1, c.hc_mult, 1)
    for i in range(c.n_layers):
        x = block(P, f"layers.{i}.", i, x, tokens, ctx)
    return head(P, "", x, c), x


def mtp_forward(P: dict, streams: torch.Tensor, next_tokens: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    """DeepSeek's MTP layer mtp.0: the main model's streams at positions t [b,S,n,d] and the tokens at t+1 [b,S]
    -> logits [b,S,V] for the tokens at t+2."""
    c = ctx.cfg
    p = "mtp.0."
    e = rms_norm(P["embed.weight"][next_tokens], P[p + "enorm.weight"], c.norm_eps)
    h = rms_norm(streams, P[p + "hnorm.weight"], c.norm_eps)
    x = linear(P, p + "e_proj", e).unsqueeze(2) + linear(P, p + "h_proj", h)
    x = block(P, p, c.n_layers, x, next_tokens, ctx)
    return head(P, p, x, c)


def losses(P: dict, batch: torch.Tensor, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """batch [b, S+1] -> (main CE, MTP CE, indexer KL), in nats per token."""
    ctx.aux.clear()
    ctx.loads.clear()
    logits, streams = forward(P, batch[:, :-1], ctx)
    main = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    mtp_logits = mtp_forward(P, streams[:, :-1], batch[:, 1:-1], ctx)
    mtp = F.cross_entropy(mtp_logits.flatten(0, 1), batch[:, 2:].flatten())
    index = torch.stack(ctx.aux).mean() if ctx.aux else main.new_zeros(())
    return main, mtp, index


# ---------------------------------------------------------------- training

def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(P: dict, cfg: ModelConfig, stream: torch.Tensor, steps: int, batch: int, seq: int, lr: float,
          seed: int, log_every: int = 50) -> None:
    g = torch.Generator().manual_seed(seed + 1)
    ctx = make_ctx(cfg, seq)
    trainable = [t for t in P.values() if t.requires_grad]
    decay = [t for t in trainable if t.dim() >= 2]
    no_decay = [t for t in trainable if t.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    t0 = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([stream[s:s + seq + 1] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, max(1, steps // 20))
        main, mtp, index = losses(P, x, ctx)
        loss = main + MTP_WEIGHT * mtp + INDEX_WEIGHT * index
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        with torch.no_grad():  # auxiliary-loss-free balancing of the routed layers' selection bias
            for p, load in ctx.loads.items():
                P[p + "gate.bias"] += BIAS_RATE * torch.sign(load.float().mean() - load.float())
        if step % log_every == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {main.item():.3f}  mtp {mtp.item():.3f}  index-kl {index.item():.3f}  "
                  f"{time.perf_counter() - t0:6.0f} s", flush=True)


@torch.no_grad()
def evaluate(P: dict, cfg: ModelConfig, stream: torch.Tensor, seq: int, byte_len: torch.Tensor,
             batch: int = 16) -> dict:
    """Held-out main and MTP loss (nats/token) over consecutive windows of the stream, bits per byte, and how
    often the MTP layer's top-1 is the token at t+2."""
    ctx = make_ctx(cfg, seq)
    n = (stream.numel() - 1) // seq
    nll = mtp_nll = 0.0
    tokens = mtp_tokens = mtp_hits = 0
    nbytes = 0.0
    for i in range(0, n, batch):
        rows = [stream[j * seq: j * seq + seq + 1] for j in range(i, min(n, i + batch))]
        x = torch.stack(rows)
        logits, streams = forward(P, x[:, :-1], ctx)
        nll += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        tokens += x[:, 1:].numel()
        nbytes += byte_len[x[:, 1:]].sum().item()
        m = mtp_forward(P, streams[:, :-1], x[:, 1:-1], ctx)
        mtp_nll += F.cross_entropy(m.flatten(0, 1), x[:, 2:].flatten(), reduction="sum").item()
        mtp_tokens += x[:, 2:].numel()
        mtp_hits += (m.argmax(-1) == x[:, 2:]).sum().item()
    return {"loss": nll / tokens, "mtp_loss": mtp_nll / mtp_tokens, "mtp_top1": mtp_hits / mtp_tokens,
            "tokens": tokens, "bytes": nbytes, "bits_per_byte": nll / math.log(2) / nbytes}


def unigram_loss(train: torch.Tensor, held: torch.Tensor, vocab: int) -> float:
    """Cross entropy (nats/token) of the held-out targets under the training stream's add-one unigram."""
    counts = torch.bincount(train, minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return -logp[held].mean().item()


def stored_tensors(P: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in the release's dtypes (bf16; fp32 for the mHC, sink, ape and bias tensors)."""
    return {s.name: release_tensor(s.name, P[s.name].detach()) for s in all_specs(cfg)}


def load_params(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A written checkpoint's tensors as the training forward takes them (fp32, int64 tables), MTP included."""
    from safetensors.torch import load_file  # read the shards as written

    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out |= load_file(path / shard)
    return {s.name: out[s.name].long() if s.kind == "index" else out[s.name].float() for s in all_specs(cfg)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="checkpoint directory to write")
    ap.add_argument("--evaluate", metavar="DIR", help="only evaluate a checkpoint this script wrote (held-out text)")
    ap.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=SEQ)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (results depend on it)")
    ap.add_argument("--max-docs", type=int, default=None, help="train on the first N docstrings only (tests)")
    args = ap.parse_args(argv)

    if (args.out is None) == (args.evaluate is None):
        ap.error("give --out (train and write) or --evaluate DIR")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    root = Path(sysconfig.get_paths()["stdlib"])
    train_docs, held_docs = stdlib_docstrings(root, args.max_docs)
    print(f"text: docstrings of Python {sys.version.split()[0]}'s standard library ({root}; PSF License): "
          f"{len(train_docs)} training docstrings ({sum(map(len, train_docs)):,} characters), {len(held_docs)} "
          f"held out ({sum(map(len, held_docs)):,})", flush=True)
    if args.evaluate:
        out = Path(args.evaluate)
        raw = read_json(out / "config.json", ConfigError)
        if not (out / "tokenizer.json").is_file():
            raise InputError(f"--evaluate {out}: no tokenizer.json (give a checkpoint this script wrote)")
        tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    else:
        raw = trained_config_raw()
        raw["vocab_size"] = VOCAB if args.max_docs is None else min(VOCAB, 512)
        tok = build_tiny_tokenizer("\n\n".join(train_docs), raw["vocab_size"])
    cfg = config_from_hf(raw)
    train_stream, held_stream = token_stream(tok, train_docs), token_stream(tok, held_docs)
    print(f"tokens: {train_stream.numel():,} training, {held_stream.numel():,} held out "
          f"(vocabulary {cfg.vocab_size})")

    if not args.evaluate:
        P = init_params(cfg, args.seed)
        n_params = sum(t.numel() for t in P.values() if t.is_floating_point())
        print(f"model: {n_params:,} parameters ({cfg.n_layers} layers + 1 MTP layer, dim {cfg.dim})", flush=True)
        t_train = time.perf_counter()
        train(P, cfg, train_stream, args.steps, args.batch, args.seq, args.lr, args.seed)
        train_s = time.perf_counter() - t_train
        out = write_checkpoint(args.out, raw, stored_tensors(P, cfg), n_shards=2,
                               extra_files={"tokenizer.json": tok.to_str()}, force=args.force)
        print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB)")
        print(f"training: {args.steps} steps of {args.batch} x {args.seq} tokens in {train_s:.0f} s "
              f"({time.perf_counter() - t_start:.0f} s in all, {args.threads} threads)")
    shipped = load_params(out, cfg)  # evaluate what was written (bf16)
    res = evaluate(shipped, cfg, held_stream, args.seq, byte_lengths(tok))
    n_eval = (held_stream.numel() - 1) // args.seq * args.seq  # the targets `evaluate` scored
    uni = unigram_loss(train_stream, held_stream[1:n_eval + 1], cfg.vocab_size)
    uni_bpb = uni * res["tokens"] / math.log(2) / res["bytes"]
    print(f"held-out loss {res['loss']:.3f} nats/token (unigram baseline {uni:.3f}), {res['bits_per_byte']:.3f} "
          f"bits/byte (unigram {uni_bpb:.3f}) over {res['tokens']:,} tokens / {res['bytes']:,.0f} bytes; MTP "
          f"(token t+2) loss {res['mtp_loss']:.3f}, top-1 right {100 * res['mtp_top1']:.1f}%")
    return 0

if __name__ == "__main__":
    run_script(main)
