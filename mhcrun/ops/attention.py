"""Sparse attention over a selected set of kv rows with a per-head sink (V == K), and its masks.

The selection is a boolean mask over the kv rows instead of an index list: the same set, so the same
result, and a static shape for compiled decode.
"""

from __future__ import annotations

import torch


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, mask: torch.Tensor,
                scale: float) -> torch.Tensor:
    """q [b,s,h,d], kv [b,n,d], sink [h] fp32, mask [b,s,n] bool -> o [b,s,h,d] in q's dtype.

    p = softmax([q.k_j * scale ..., sink_h]) where the sink only adds to the denominator; o = sum_j p_j k_j.
    Scores are fp32; the probabilities are rounded to kv's dtype before the PV product (as the reference
    kernel does), which is a no-op in fp32.
    """
    scores = torch.einsum("bshd,bnd->bshn", q.float(), kv.float()) * scale
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)  # every query sees at least itself
    e = torch.exp(scores - m)
    denom = e.sum(dim=-1, keepdim=True) + torch.exp(sink.view(1, 1, -1, 1).float() - m)
    p = (e / denom).to(kv.dtype)
    return torch.einsum("bshn,bnd->bshd", p.float(), kv.float()).to(q.dtype)


def window_mask_prefill(seqlen: int, window: int, device=None) -> torch.Tensor:
    """[s, s]: query t sees tokens (t - window, t]."""
    t = torch.arange(seqlen, device=device)
    d = t.unsqueeze(1) - t.unsqueeze(0)
    return (d >= 0) & (d < window)


def compress_mask_prefill(seqlen: int, ratio: int, device=None) -> torch.Tensor:
    """[s, s // ratio]: query t sees compressed entry j once its group is closed, j < (t + 1) // ratio."""
    t = torch.arange(seqlen, device=device)
    j = torch.arange(seqlen // ratio, device=device)
    return j.unsqueeze(0) < ((t + 1) // ratio).unsqueeze(1)


def window_mask_decode(pos: torch.Tensor, window: int) -> torch.Tensor:
    """[b, window]: ring slot i holds a token of the window once any token reached it, i <= pos."""
    return torch.arange(window, device=pos.device).unsqueeze(0) <= pos.unsqueeze(1)


def compress_mask_decode(pos: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """[b, n_entries]: compressed entry j is closed at position pos when j < (pos + 1) // ratio."""
    j = torch.arange(n_entries, device=pos.device)
    return j.unsqueeze(0) < ((pos + 1) // ratio).unsqueeze(1)
