"""Gated pooling of kv groups (the compressor of CSA/HCA layers).

Each closed group of r tokens pools into one entry: per channel, softmax over the group's tokens of
`score = wgate(x) + ape[position in group]`, weighting `kv = wkv(x)`. With overlap (r == 4) an entry spans
2r tokens: the previous group's first-half channels and this group's second-half channels.
"""

from __future__ import annotations

import torch


def overlap_transform(t: torch.Tensor, fill: float) -> torch.Tensor:
    """[b, g, r, 2d] -> [b, g, 2r, d]: rows [0, r) are group g-1's first half, [r, 2r) group g's second."""
    b, g, r, d2 = t.shape
    d = d2 // 2
    out = t.new_full((b, g, 2 * r, d), fill)
    out[:, :, r:] = t[:, :, :, d:]
    out[:, 1:, :r] = t[:, :-1, :, :d]
    return out


def pool(kv: torch.Tensor, score: torch.Tensor, dim: int) -> torch.Tensor:
    """sum over `dim` of kv * softmax(score) (fp32)."""
    return (kv * score.softmax(dim=dim)).sum(dim=dim)


def compress_groups(kv: torch.Tensor, score: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """Prefill pooling. kv, score [b, g*r, c*d] (score already + ape) -> [b, g, d]."""
    kv = kv.unflatten(1, (-1, ratio))
    score = score.unflatten(1, (-1, ratio))
    if overlap:
        kv = overlap_transform(kv, 0.0)
        score = overlap_transform(score, float("-inf"))
    return pool(kv, score, dim=2)


def gather_overlap_state(state: torch.Tensor, ratio: int, d: int) -> torch.Tensor:
    """Decode: state [b, 2r, 2d] -> [b, 2r, d]: previous group's first half, current group's second half."""
    return torch.cat([state[:, :ratio, :d], state[:, ratio:, d:]], dim=1)
