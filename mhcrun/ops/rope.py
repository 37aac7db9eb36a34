"""Rotary embeddings in DeepSeek's interleaved form (pairs (2i, 2i+1) rotate together), with YaRN."""

from __future__ import annotations

import math

import torch


def precompute_freqs_cis(dim: int, seqlen: int, original_seq_len: int, base: float, factor: float,
                         beta_fast: int, beta_slow: int) -> torch.Tensor:
    """Complex rotations [seqlen, dim // 2]; YaRN frequency interpolation when original_seq_len > 0."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:
        def correction_dim(rotations: float) -> float:
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    angles = torch.outer(torch.arange(seqlen), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate x [..., rd] by freqs (complex, broadcastable to [..., rd // 2]); result in x's dtype."""
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    if inverse:
        freqs = freqs.conj()
    return torch.view_as_real(xc * freqs).flatten(-2).to(x.dtype)


def apply_rope_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`apply_rope` without complex tensors (for compilers that lack them): pairs (2i, 2i+1) rotate by
    (cos, sin) [..., rd // 2] broadcastable to x's pairs."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    if inverse:
        sin = -sin
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


def apply_rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int,
                    inverse: bool = False) -> torch.Tensor:
    """Rotate only the last `rope_dim` channels of x (DeepSeek puts RoPE at the end of each head) by (cos, sin)
    [..., rope_dim // 2] (`apply_rope_real`)."""
    nope, pe = x.split([x.size(-1) - rope_dim, rope_dim], dim=-1)
    return torch.cat([nope, apply_rope_real(pe, cos, sin, inverse)], dim=-1)
