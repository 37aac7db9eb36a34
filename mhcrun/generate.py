"""Generation: eager prefill per prompt, then batched decode with per-sequence positions.

Each prompt is prefilled alone into its own cache row, so a sequence's tokens do not depend on what it
is batched with; decode then advances every unfinished row by one token per step.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mhcrun.errors import InputError, NonFiniteError
from mhcrun.memory import default_prefill_chunk
from mhcrun.model import Transformer
from mhcrun.nki import ops as hc_ops


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]  # generated ids (eos included when it was generated)
    # per step: the top-k (token id, log-prob) pairs of the distribution the token was chosen from
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # per step: top-1 minus top-2 logit
    text: str = ""
    stats: dict = field(default_factory=dict)


@dataclass
class SamplingOptions:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0


def peak_rss_mb() -> float:
    """This process's peak resident set (MiB): VmHWM of /proc/self/status where there is one (getrusage's
    ru_maxrss also counts the parent's peak at exec when started by a big process), else ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def check_prompts(prompts: list[list[int]], max_new_tokens: int, vocab_size: int, context: int,
                  names: list[str] | None = None) -> None:
    """Raise InputError (naming the prompt) for an empty prompt, an id outside the vocabulary,
    or a prompt that with its new tokens does not fit the context."""
    if max_new_tokens < 0:
        raise InputError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if not prompts:
        raise InputError("no prompts given")
    for i, ids in enumerate(prompts):
        name = names[i] if names else f"prompt {i}"
        if not ids:
            raise InputError(f"{name}: the prompt is empty (it needs at least one token)")
        for j, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                raise InputError(f"{name}: token id {t} at position {j} is outside the vocabulary [0, {vocab_size})")
        if len(ids) > context:
            raise InputError(f"{name}: the prompt has {len(ids)} tokens, longer than the context of {context}")
        if len(ids) + max_new_tokens > context:
            raise InputError(f"{name}: {len(ids)} prompt tokens + {max_new_tokens} new tokens exceed the context "
                             f"of {context}")


def check_finite(logits: torch.Tensor, rows: list[int], step: int) -> None:
    """NonFiniteError naming the first row (prompt) and step whose logits [b, V] hold NaN or Inf: argmax would
    turn them into plausible-looking token ids."""
    bad = ~torch.isfinite(logits).all(dim=-1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        kind = "NaN" if bool(torch.isnan(logits[i]).any()) else "Inf"
        what = "prefill" if step == 0 else f"decode step {step}"
        raise NonFiniteError(f"prompt {rows[i]}: the logits of step {step} ({what}) hold {kind}; no token was "
                             f"emitted from them")


def sample(logits: torch.Tensor, opts: SamplingOptions, gen: torch.Generator) -> torch.Tensor:
    """logits [b, V] (fp32) -> token ids [b]: argmax when greedy, else temperature + top-p sampling."""
    if opts.temperature <= 0:
        return logits.argmax(dim=-1)
    probs = (logits / opts.temperature).softmax(dim=-1)
    if opts.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(dim=-1) - sorted_p > opts.top_p  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def record_step(logits: torch.Tensor, k: int) -> tuple[list[tuple[int, float]], float]:
    """Top-k (id, log-prob) and the top-1/top-2 logit margin of one row's logits [V]."""
    logp = logits.float().log_softmax(dim=-1)
    top = logp.topk(min(k, logp.numel()))
    pairs = [(int(i), float(v)) for i, v in zip(top.indices, top.values, strict=True)]
    top2 = logits.topk(2).values
    return pairs, float(top2[0] - top2[1])


def prefill(model: Transformer, ids: list[int], row: int, chunk: int) -> torch.Tensor:
    """Prefill one prompt into cache row `row`, `chunk` tokens at a time -> logits [1, V] of its last token."""
    dev = model.device
    rows = torch.tensor([row], device=dev)
    for c0 in range(0, len(ids), chunk):
        logits = model(torch.tensor([ids[c0:c0 + chunk]], device=dev), rows, c0)
    return logits


@torch.inference_mode()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, eos_id: int,
             sampling: SamplingOptions | None = None, ignore_eos: bool = False, record_topk: int = 0,
             on_token: Callable[[int, int], None] | None = None, graph_mode: str = "eager",
             backend: str | None = None, stages: str = "whole",
             prefill_chunk: int | None = None) -> list[GenerationResult]:
    """Generate up to max_new_tokens for each prompt (token id lists). on_token(row, id) streams.

    Each prompt is prefilled eagerly in chunks of `prefill_chunk` tokens (default: `default_prefill_chunk`).
    graph_mode "eager" decodes with the model's eager code (a chunk of one token per row); "regions" with
    compiled region graphs (`mhcrun.regions`)."""
    sampling = sampling or SamplingOptions()
    cfg = model.cfg
    check_prompts(prompts, max_new_tokens, cfg.vocab_size, cfg.max_position_embeddings)
    results = [GenerationResult(prompt_ids=list(p), tokens=[]) for p in prompts]
    if max_new_tokens == 0:
        for res in results:
            res.stats = {"prefill_tok_s": 0.0, "decode_tok_s": 0.0, "compile_s": 0.0, "peak_rss_mb": peak_rss_mb()}
        return results
    dev = model.device
    gen = torch.Generator(device=dev).manual_seed(sampling.seed)
    hc_ops.reset_kernel_stats()
    model.setup_caches(len(prompts), max(len(p) for p in prompts) + max_new_tokens)

    def accept(row: int, logits: torch.Tensor, token: int) -> None:
        res = results[row]
        res.tokens.append(token)
        if record_topk:
            pairs, margin = record_step(logits, record_topk)
            res.top_logprobs.append(pairs)
            res.margins.append(margin)
        if on_token:
            on_token(row, token)

    def finished(row: int) -> bool:
        toks = results[row].tokens
        return len(toks) >= max_new_tokens or (not ignore_eos and toks[-1] == eos_id)

    chunk = prefill_chunk or default_prefill_chunk(cfg)
    if chunk < 1:
        raise InputError(f"--prefill-chunk must be >= 1, got {chunk}")
    prefill_s = []
    for row, ids in enumerate(prompts):
        t0 = time.perf_counter()
        logits = prefill(model, ids, row, chunk)
        prefill_s.append(time.perf_counter() - t0)
        check_finite(logits, [row], 0)
        accept(row, logits[0], int(sample(logits, sampling, gen)[0]))

    decoder = None
    if graph_mode == "regions":
        from mhcrun.regions.runner import RegionDecoder, default_backend

        decoder = RegionDecoder(model, "regions", backend or default_backend(dev.type), stages,
                                cuda_graphs=dev.type == "cuda")
    step_s: list[float] = []
    decode_tokens = 0
    active = [r for r in range(len(prompts)) if not finished(r)]
    while active:
        t0 = time.perf_counter()
        if decoder is None:  # eager: only the unfinished rows
            tokens = torch.tensor([[results[r].tokens[-1]] for r in active], device=dev)
            pos = torch.tensor([len(prompts[r]) + len(results[r].tokens) - 1 for r in active], device=dev)
            logits = model(tokens, torch.tensor(active, device=dev), pos)  # a chunk of one token per row
        else:  # compiled: every row, static shapes; a finished row repeats its last step
            tokens = torch.tensor([res.tokens[-1] for res in results], device=dev)
            pos = torch.tensor([len(p) + len(res.tokens) - 1 for p, res in zip(prompts, results, strict=True)],
                               device=dev)
            logits = decoder(tokens, pos)[torch.tensor(active, device=dev)]
        check_finite(logits, active, len(results[active[0]].tokens))
        next_ids = sample(logits, sampling, gen).tolist()
        step_s.append(time.perf_counter() - t0)
        decode_tokens += len(active)
        for i, r in enumerate(active):
            accept(r, logits[i], next_ids[i])
        active = [r for r in active if not finished(r)]

    compile_s = 0.0
    if decoder is not None and step_s:  # the first compiled step also compiles: report that apart
        typical = sum(step_s[1:]) / (len(step_s) - 1) if len(step_s) > 1 else 0.0
        compile_s = max(0.0, step_s[0] - typical)
    decode_s = sum(step_s) - compile_s

    rss = peak_rss_mb()
    for row, res in enumerate(results):
        res.stats = {
            "prefill_tok_s": len(prompts[row]) / prefill_s[row] if prefill_s[row] > 0 else 0.0,
            "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,  # batch throughput
            "compile_s": compile_s,
            "peak_rss_mb": rss,
            "kernels": hc_ops.kernel_stats(),  # calls per kernel and backend (torch, nki-sim, nki), whole batch
        }
    return results
