"""MoE routing and the SwiGLU expert (fp32 math), as in DeepSeek V4."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gate_scores(x: torch.Tensor, weight: torch.Tensor, score_func: str) -> torch.Tensor:
    """Affinity scores [T, E] in fp32."""
    logits = F.linear(x.float(), weight.float())
    if score_func == "softmax":
        return logits.softmax(dim=-1)
    if score_func == "sigmoid":
        return logits.sigmoid()
    return F.softplus(logits).sqrt()


def route(scores: torch.Tensor, topk: int, route_scale: float, score_func: str, bias: torch.Tensor | None = None,
          hash_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]). The bias shifts selection only; hash layers take fixed ids."""
    if hash_ids is not None:
        idx = hash_ids
    else:
        biased = scores + bias if bias is not None else scores
        idx = biased.topk(topk, dim=-1).indices
    weights = scores.gather(1, idx)
    if score_func != "softmax":
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * route_scale, idx


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, L)) * clamp(u, -L, L) in fp32 (no clamp when L <= 0)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up
