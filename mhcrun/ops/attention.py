"""Sparse attention with a per-head sink (V == K) over a query's window entries plus its compressed entries.

A query's keys come in two sets: `kv` [b, n, d], shared by the queries of a chunk and selected per query by a
mask (the sliding window: the ring as it was before the chunk, then the chunk's own entries; HCA's closed
entries), and `sel` [b, s, k, d], gathered per query by index (CSA: the indexer's top-k entries) with a
validity mask. The cost per query is O(n + k), whatever the context.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mhcrun.ops.qgemv import CpuKernel, attend_shape

ATTN_WORKSPACE = 192 << 20  # bytes a prefill chunk's attention takes at once (its queries go in slices)


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float,
                sel: torch.Tensor | None = None, sel_mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [b,s,h,d], kv [b,n,d] with mask [b,s,n] bool, optional sel [b,s,k,d] with sel_mask [b,s,k], sink [h]
    fp32 -> o [b,s,h,d] in q's dtype.

    p = softmax([q.k_j * scale ..., sink_h]) over the valid keys of both sets, where the sink only adds to the
    denominator; o = sum_j p_j k_j. Scores are fp32; the probabilities are rounded to kv's dtype before the
    PV product (as the reference kernel does), which is a no-op in fp32.
    """
    scores = torch.einsum("bshd,bnd->bshn", q.float(), kv.float()) * scale
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    if sel is not None:
        s_sel = torch.einsum("bshd,bskd->bshk", q.float(), sel.float()) * scale
        scores = torch.cat([scores, s_sel.masked_fill(~sel_mask.unsqueeze(2), float("-inf"))], dim=-1)
    m = scores.amax(dim=-1, keepdim=True)  # every query sees at least itself
    e = torch.exp(scores - m)
    denom = e.sum(dim=-1, keepdim=True) + torch.exp(sink.view(1, 1, -1, 1).float() - m)
    p = (e / denom).to(kv.dtype).float()
    n = kv.size(1)
    o = torch.einsum("bshn,bnd->bshd", p[..., :n], kv.float())
    if sel is not None:
        o = o + torch.einsum("bshk,bskd->bshd", p[..., n:], sel.float())
    return o.to(q.dtype)


def query_bytes(heads: int, keys: int, gathered: int, dim: int) -> int:
    """Workspace bytes one query takes: its fp32 scores over `keys` + `gathered` keys (about five copies live:
    scores, masked, exp, probabilities, cast) and its gathered keys decoded to fp32 (about three copies)."""
    return 5 * 4 * heads * (keys + gathered) + 3 * 4 * gathered * dim


def query_slices(s: int, per_query: int, workspace: int = ATTN_WORKSPACE, max_len: int | None = None) -> list[slice]:
    """Slices of a chunk's s queries (at most `max_len` each) whose workspace (`per_query` bytes each) fits."""
    step = max(1, min(workspace // max(1, per_query), max_len or s))
    return [slice(i, min(i + step, s)) for i in range(0, s, step)]


def window_mask(start: torch.Tensor, s: int, window: int) -> torch.Tensor:
    """Which window keys each query of a chunk sees -> [b, s, window + s].

    Keys: the ring's `window` slots as they were before the chunk (slot i holds the latest position before
    `start` that is i mod window), then the chunk's s entries. Query t (at position start + t) sees the
    positions (start + t - window, start + t]."""
    t = torch.arange(s, device=start.device)
    slot = torch.arange(window, device=start.device)
    held = start.view(-1, 1) - 1 - (start.view(-1, 1) - 1 - slot) % window  # [b, window]: position in slot
    ring = (held >= 0).unsqueeze(1) & (held.unsqueeze(1) > (start.view(-1, 1, 1) + t.view(1, -1, 1) - window))
    d = t.view(-1, 1) - t.view(1, -1)
    own = ((d >= 0) & (d < window)).unsqueeze(0).expand(start.size(0), -1, -1)
    return torch.cat([ring, own], dim=-1)


def closed_mask(start: torch.Tensor, s: int, n_entries: int, ratio: int) -> torch.Tensor:
    """[b, s, n_entries]: query t (position start + t) sees compressed entry j once its group is closed,
    j < (start + t + 1) // ratio."""
    pos = start.view(-1, 1) + torch.arange(s, device=start.device)
    j = torch.arange(n_entries, device=start.device)
    return j.view(1, 1, -1) < ((pos + 1) // ratio).unsqueeze(-1)


@torch.library.custom_op("mhcrun::attend_cpu", mutates_args=())
def attend_cpu(q: Tensor, kv: Tensor, mask: Tensor, sink: Tensor, scale: float, sel: Tensor | None,
               sel_mask: Tensor | None, library: str, isa: int) -> Tensor:
    """The CPU kernel's attention (`CpuKernel.attend`) as an opaque op of compiled graphs, `sparse_attn` where the
    kernel declines: what its C++ twin `mhcrun::attend_native` (torch_ops.cpp) hands over when it does not take the
    call. fp32 q -> o [b, s, h, d] fp32."""
    o = CpuKernel(library, isa).attend(q, kv, mask, sink, scale, sel, sel_mask)
    return (sparse_attn(q, kv, mask, sink, scale, sel, sel_mask) if o is None else o).float().contiguous()


attend_cpu.register_fake(attend_shape)
