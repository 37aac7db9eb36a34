"""Lightning indexer scoring and top-k selection of compressed kv entries (CSA layers).

Ties: ReLU'd index scores are exactly 0 whenever every index head is negative, so equal scores at the top-k
boundary are common. mhcrun decides them one way on every path (eager, compiled regions, any chunk size,
batch size or slicing): **among equal scores the lower entry index wins**. Each score becomes a unique int64
rank key (the score's order in the high 32 bits, the inverted entry index in the low 32), so top-k has no ties
left to decide and its result does not depend on how torch orders equal values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mhcrun.ops.kvcache import decode_fp4
from mhcrun.ops.qgemv import CpuKernel, index_topk_shape

INDEX_WORKSPACE = 192 << 20  # bytes the indexer's per-head fp32 scores and their copies take at once (entries
# in slices; three [s, heads, slice] tensors live at once: the dot products, their ReLU and the weighted ones)
_INVALID = torch.iinfo(torch.int64).min
_LOW = 0xFFFFFFFF


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """score[t] = sum_h relu(q_h . k_t) * w_h. q [b,s,H,d], k [b,n,d], w [b,s,H] -> [b,s,n] (q's dtype)."""
    s = torch.einsum("bshd,bnd->bshn", q, k)
    return (s.relu() * w.unsqueeze(-1)).sum(dim=2)


def rank_keys(scores: torch.Tensor, entries: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys that order (score descending, entry index ascending); invalid entries rank last.

    scores [..., n] (any float dtype; -0.0 counts as 0.0), entries [n] or broadcastable int64 entry indices
    (< 2**32), valid [..., n] bool."""
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    order = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32 in the floats' order
    key = (order.to(torch.int64) << 32) | (_LOW - entries)
    return key.masked_fill(~valid, _INVALID)


def top_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest rank keys along the last dim, largest first."""
    return keys.topk(min(k, keys.size(-1)), dim=-1).values


def keys_to_entries(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank keys -> (entry indices, valid); an invalid key's index is 0."""
    valid = keys != _INVALID
    return torch.where(valid, _LOW - (keys & _LOW), 0), valid


def select_topk(scores: torch.Tensor, valid: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top `topk` valid entries per query under the tie rule: scores [b,s,n], valid [b,s,n] ->
    (entry indices [b,s,min(topk,n)], valid [b,s,min(topk,n)]); fewer valid entries than topk leave slots
    marked invalid."""
    entries = torch.arange(scores.size(-1), device=scores.device)
    return keys_to_entries(top_keys(rank_keys(scores, entries, valid), topk))


def select_topk_sliced(score_slice: Callable[[int, int], torch.Tensor], n: int, closed: torch.Tensor,
                       topk: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """select_topk over n entries scored `step` at a time: score_slice(j0, j1) -> [b,s,j1-j0]; closed [b,s]
    says how many entries each query may see (j < closed). The running top-k keys merge slice by slice, so
    memory stays O(s * (step + topk)); the result equals select_topk on the whole score matrix."""
    best = torch.empty(*closed.shape, 0, dtype=torch.int64, device=closed.device)  # no entries: [b, s, 0]
    for j0 in range(0, n, step):
        j1 = min(j0 + step, n)
        entries = torch.arange(j0, j1, device=closed.device)
        keys = rank_keys(score_slice(j0, j1), entries, entries.view(1, 1, -1) < closed.unsqueeze(-1))
        best = top_keys(torch.cat([best, keys], dim=-1), topk)
    return keys_to_entries(best)


def entry_step(s: int, heads: int, workspace: int = INDEX_WORKSPACE) -> int:
    """Entries per slice so that a chunk's per-head fp32 scores [s, heads, step] (three copies) fit the workspace."""
    return max(1, workspace // max(1, 3 * 4 * s * heads))


@torch.library.custom_op("mhcrun::index_topk_cpu", mutates_args=())
def index_topk_cpu(q: Tensor, w: Tensor, packed: Tensor, scale: Tensor, rows: Tensor, closed: Tensor, n: int,
                   topk: int, block: int, library: str, isa: int) -> tuple[Tensor, Tensor]:
    """The CPU kernel's indexer scores and top-k (`CpuKernel.index_topk`) as an opaque op of compiled graphs; where the
    kernel declines, `select_topk` of `index_scores` over the first n fp4 keys of cache rows `rows` (decoded as the
    cache decodes them): what its C++ twin `mhcrun::index_topk_native` (torch_ops.cpp) hands over when it does not
    take the call. -> (entries int64, valid bool) [b, s, min(topk, n)]."""
    out = CpuKernel(library, isa).index_topk(q, w, packed, scale, rows, closed, n, topk, block)
    if out is None:
        keys = decode_fp4(packed[rows, :n], scale[rows, :n], block).to(q.dtype)
        seen = torch.arange(n, device=q.device).view(1, 1, -1) < closed.unsqueeze(-1)
        out = select_topk(index_scores(q, keys, w), seen, topk)
    return out[0].contiguous(), out[1].contiguous()


index_topk_cpu.register_fake(index_topk_shape)
