"""Lightning indexer scoring and top-k selection of compressed kv rows (CSA layers)."""

from __future__ import annotations

import torch


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """score[t] = sum_h relu(q_h . k_t) * w_h. q [b,s,H,d], k [b,n,d], w [b,s,H] -> [b,s,n] (q's dtype)."""
    s = torch.einsum("bshd,bnd->bshn", q, k)
    return (s.relu() * w.unsqueeze(-1)).sum(dim=2)


def select_topk(scores: torch.Tensor, valid: torch.Tensor, topk: int) -> torch.Tensor:
    """Mask [b,s,n] of the top `topk` valid entries per query (all valid ones when fewer)."""
    n = scores.size(-1)
    k = min(topk, n)
    if k == 0:
        return torch.zeros_like(valid)
    scores = scores.masked_fill(~valid, float("-inf"))
    idx = scores.topk(k, dim=-1).indices
    chosen = torch.zeros_like(valid).scatter_(-1, idx, True)
    return chosen & valid
