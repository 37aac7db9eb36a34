"""Gated pooling of kv groups (the compressor of CSA/HCA layers).

Each closed group of r tokens pools into one entry: per channel, softmax over the group's tokens of
`score = wgate(x) + ape[position in group]`, weighting `kv = wkv(x)`. With overlap (r == 4) an entry spans
2r tokens: the previous group's first-half channels and this group's second-half channels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mhcrun.ops.qgemv import CpuKernel, compress_step_shape


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


def compress_chunk(kv_state: torch.Tensor, score_state: torch.Tensor, kv: torch.Tensor, score: torch.Tensor,
                   start: torch.Tensor, ratio: int, overlap: bool):
    """Add a chunk of s tokens to each row's open group and pool every group the chunk closes.

    State [b, lead + r, C] (lead = r with overlap: the previous closed group, then the open group by position
    mod r); kv, score [b, s, C] (score already + ape) at positions start [b] + [0, s).
    -> pooled [b, G, d] for the buffer's groups, closed [b, G] (the groups this chunk closes), entry [b, G]
    (their compressed entry index), and the new state (kv, score). Rows may start at different positions.
    """
    r, lead = ratio, ratio if overlap else 0
    b, s, C = kv.shape
    pre = start % r
    n_slots = -(-(lead + 2 * r + s) // r) * r
    buf_kv = kv.new_zeros(b, n_slots, C)
    buf_score = score.new_full((b, n_slots, C), float("-inf"))
    buf_kv[:, :lead + r] = kv_state
    buf_score[:, :lead + r] = score_state
    slot = (lead + pre.view(-1, 1) + torch.arange(s, device=kv.device)).unsqueeze(-1).expand(-1, -1, C)
    buf_kv = buf_kv.scatter(1, slot, kv)
    buf_score = buf_score.scatter(1, slot, score)
    groups_kv, groups_score = buf_kv.unflatten(1, (-1, r)), buf_score.unflatten(1, (-1, r))
    if overlap:
        groups_kv = overlap_transform(groups_kv, 0.0)
        groups_score = overlap_transform(groups_score, float("-inf"))
    pooled = pool(groups_kv, groups_score, dim=2)  # [b, G, d]
    g = torch.arange(n_slots // r, device=kv.device).unsqueeze(0)
    end = lead + pre + s  # [b]: slots filled
    closed = (g >= lead // r) & ((g + 1) * r <= end.unsqueeze(1))
    entry = (start // r - lead // r).unsqueeze(1) + g
    keep = ((end // r - lead // r) * r).unsqueeze(1) + torch.arange(lead + r, device=kv.device)  # the new state
    keep = keep.unsqueeze(-1).expand(-1, -1, C)
    return pooled, closed, entry, buf_kv.gather(1, keep), buf_score.gather(1, keep)


def state_rows(kv_state: Tensor, score_state: Tensor, rows: Tensor, start: Tensor) -> tuple[Tensor, Tensor]:
    """The state rows `rows` [b] of the buffers [B, lead + r, C], a row at position start 0 (a new sequence) emptied:
    no previous group, no open group."""
    fresh = (start == 0).view(-1, 1, 1)
    return kv_state[rows].masked_fill(fresh, 0.0), score_state[rows].masked_fill(fresh, float("-inf"))


def compress_step(kv_state: Tensor, score_state: Tensor, rows: Tensor, kv: Tensor, score: Tensor, start: Tensor,
                  ratio: int, overlap: bool) -> tuple[Tensor, Tensor]:
    """compress_chunk of one token a row (kv, score [b, 1, C], score with its bias) at positions start [b] on the state
    rows `rows` [b] (`state_rows`), the new state written back into the buffers -> (pooled [b, d]: the group the
    token closes, zeros where it closes none; closed [b] bool). One token can close only the group after the lead."""
    pooled, closed, _, kv_state[rows], score_state[rows] = compress_chunk(
        *state_rows(kv_state, score_state, rows, start), kv, score, start, ratio, overlap)
    done = closed[:, 1 if overlap else 0]
    return pooled[:, 1 if overlap else 0].masked_fill(~done.unsqueeze(-1), 0.0), done


@torch.library.custom_op("mhcrun::compress_step_cpu", mutates_args=("kv_state", "score_state"))
def compress_step_cpu(kv_state: Tensor, score_state: Tensor, rows: Tensor, kv: Tensor, raw: Tensor, ape: Tensor,
                      start: Tensor, ratio: int, overlap: bool, library: str, isa: int) -> tuple[Tensor, Tensor]:
    """The CPU kernel's compressor step (`CpuKernel.compress_step`) as an opaque op of compiled graphs, writing the
    state rows; where the kernel declines, `compress_step` of the token with its bias (raw + ape[position % ratio]):
    what its C++ twin `mhcrun::compress_step_native` (torch_ops.cpp) hands over when it does not take the call.
    -> (pooled [b, d], closed [b] bool)."""
    out = CpuKernel(library, isa).compress_step(kv_state, score_state, rows, kv, raw, ape, start, ratio, overlap)
    if out is None:
        score = raw + ape[start.view(-1, 1) % ratio]
        out = compress_step(kv_state, score_state, rows, kv, score, start, ratio, overlap)
    return out[0].contiguous(), out[1].contiguous()


compress_step_cpu.register_fake(compress_step_shape)


def stays_open(start: torch.Tensor, s: int, ratio: int) -> bool:
    """Whether a chunk of s tokens at positions start [b] + [0, s) closes no group and begins no sequence in any
    row: then all compress_chunk does is `add_to_open_group` (most decode steps)."""
    return all(p % ratio + s < ratio and p != 0 for p in start.tolist())  # Python ints: a decode step's few rows


def add_to_open_group(kv_state: torch.Tensor, score_state: torch.Tensor, rows: torch.Tensor, kv: torch.Tensor,
                      score: torch.Tensor, start: torch.Tensor, ratio: int, overlap: bool) -> None:
    """compress_chunk's new state for a chunk that `stays_open`, written in place into rows `rows` [b] of the state
    buffers [B, lead + r, C]: kv, score [b, s, C] into the open group's slots lead + start % r + [0, s); nothing
    closes, so nothing is pooled."""
    slot = (ratio if overlap else 0) + start.view(-1, 1) % ratio + torch.arange(kv.size(1), device=kv.device)
    kv_state[rows.view(-1, 1), slot] = kv
    score_state[rows.view(-1, 1), slot] = score
