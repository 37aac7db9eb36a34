"""Generation: eager prefill per prompt, batched decode with per-sequence positions."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]  # generated ids (eos included when it was generated)
    # per step: the top-k (token id, log-prob) pairs of the distribution the token was chosen from
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # per step: top-1 minus top-2 logit
    text: str = ""
    stats: dict = field(default_factory=dict)
