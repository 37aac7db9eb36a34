"""Speculative decoding with the checkpoint's MTP layer (`generate --draft-tokens K`).

Each step of a row at position n (its last token t_n not yet run): the MTP layer (`model.MTPBlock`) drafts K
tokens, from the main model's hc streams before the head at n - 1 and t_n (then, for K > 1, from its own output
streams and its last draft, as vLLM re-applies V4's single layer); the main model runs the chunk
[t_n, d_1 .. d_K] at positions n .. n + K in one forward, with the logits of every position (the verify). Greedy:
the drafts are accepted while each equals the argmax of the position before it, then the argmax after the last
accepted one is taken too (a + 1 tokens per step for a accepted drafts). With temperature: the standard
speculative sampling rule (`accept_drafts`).

Rollback, built on snapshots of the spans a chunk writes (`mhcrun.snapshot`): V4's state cannot be cut back (a
compressor keeps a shifted window of the previous and the open group, not a positional ring), so before the
verify each row's span of K + 1 positions is copied (`take_span`: ring slots, compressors' open-group state, the
entries the chunk can close, indexer keys included) and the compressors keep the chunk's kv and score. A row that
accepts a < K drafts is rewound without running anything again (`rewind_span`): what its a + 1 accepted tokens
wrote stays (a position's kv, and a group closed by accepted tokens, depend on nothing after them), the ring slots
and entries of the rejected positions get their copies back, and each compressor's open group is rebuilt from its
copy and the accepted tokens' kept kv and score (`compress_chunk` over that prefix, as a chunk of a + 1 tokens
would have left it). The MTP layer's own state: its draft positions n .. n + K - 2 ran on its own streams, so they
are put back (`restore_span`) and run again at the next step with the main model's streams of the accepted
positions (one MTP chunk, which also drafts the next first token).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mhcrun.errors import InputError
from mhcrun.generate import (
    GenerationResult,
    finish_stats,
    nonfinite_rows,
    record_step,
    sampling_probs,
    start_decoder,
    step_name,
)
from mhcrun.memory import default_prefill_chunk
from mhcrun.model import Transformer
from mhcrun.session import Pending, Session, advance_mtp, no_pending
from mhcrun.settings import MAX_DRAFT_TOKENS, SamplingOptions, cache_length, check_range
from mhcrun.snapshot import SpanSnapshot, keep_chunks, keep_rows, restore_span, rewind_span, take_span


def draft_limit(model: Transformer) -> int:
    """The largest K --draft-tokens takes for this model."""
    return min(MAX_DRAFT_TOKENS, model.cfg.window_size - 1)


def check_draft_tokens(model: Transformer, k: int) -> None:
    """A one-line InputError for a K out of range or a model built without its MTP layer."""
    limit = draft_limit(model)
    why = " (K + 1 within the sliding window)" if limit < MAX_DRAFT_TOKENS else ""
    check_range("--draft-tokens", k, 1, limit, why)
    if not len(model.mtp):
        raise InputError("--draft-tokens: the model was loaded without its MTP layer")


@dataclass
class DraftStats:
    """Per run: drafts proposed and accepted at each draft position (1 .. K), verify steps (row-steps)."""

    k: int
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    steps: int = 0

    def __post_init__(self) -> None:
        self.proposed, self.accepted = [0] * self.k, [0] * self.k

    def add(self, a: int) -> None:
        """One row's verify step that accepted a drafts."""
        self.steps += 1
        for j in range(self.k):
            self.proposed[j] += 1
            self.accepted[j] += j < a

    def as_dict(self) -> dict:
        """mean_accepted_length: tokens per verify step (accepted drafts + 1), as vLLM's acceptance length."""
        return {"draft_tokens": self.k, "verify_steps": self.steps, "drafts_proposed": self.proposed,
                "drafts_accepted": self.accepted,
                "mean_accepted_length": 1 + sum(self.accepted) / self.steps if self.steps else 0.0}


def stats_note(spec: dict) -> str:
    """The stats line's part: e.g. "drafts 3: accepted 61% 35% 18%, mean accepted length 2.14"."""
    rates = " ".join(f"{100 * a / p:.0f}%" if p else "-"
                     for a, p in zip(spec["drafts_accepted"], spec["drafts_proposed"], strict=True))
    return f"drafts {spec['draft_tokens']}: accepted {rates}, mean accepted length {spec['mean_accepted_length']:.2f}"


def accept_drafts(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                  gen: torch.Generator) -> tuple[int, int]:
    """The speculative sampling rule: p [K+1, V] the target distributions (position i's is for the token after
    i), q [K, V] the draft distributions the drafts [K] were drawn from. Draft i is accepted with probability
    min(1, p_i(d) / q_i(d)); at the first rejection a token is drawn from normalised max(0, p_i - q_i); after K
    acceptances one is drawn from p_K. -> (accepted drafts a, the token after them). Every token it yields is
    distributed as p's (Leviathan et al. 2023, Chen et al. 2023)."""
    k = drafts.numel()
    u = torch.rand(k, generator=gen, device=p.device, dtype=torch.float64).tolist()
    for i in range(k):
        d = int(drafts[i])
        if u[i] * float(q[i, d]) < float(p[i, d]):  # u < p/q, without dividing by q
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q on their support: the residual is empty, p itself is right
            residual = p[i]
        return i, int(torch.multinomial(residual, 1, generator=gen))
    return k, int(torch.multinomial(p[k], 1, generator=gen))


def accept_greedy(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
    """logits [K+1, V] of the verify, drafts [K] -> (a: the drafts that equal the argmax before them, the argmax
    after the last accepted one)."""
    best = logits.argmax(dim=-1)
    a = 0
    while a < drafts.numel() and int(drafts[a]) == int(best[a]):
        a += 1
    return a, int(best[a])


def prefill_row(model: Transformer, ids: list[int], row: int, chunk: int) -> tuple[torch.Tensor, Pending]:
    """Prefill one prompt into cache row `row` chunk by chunk, and the MTP layer over it as far as the next
    tokens are known (its position len(ids) - 1 waits for the first generated token) -> (logits [1, V] of the
    last token, the pending MTP input of the last position, its token still to be added)."""
    dev = model.device
    rows = torch.tensor([row], device=dev)
    pending = no_pending(model)
    for c0 in range(0, len(ids), chunk):
        logits, streams = model(torch.tensor([ids[c0:c0 + chunk]], device=dev), rows, c0, streams=True)
        pending = advance_mtp(model, ids, pending.after(streams[0]), row, len(ids))
    return logits, pending


def group_by(values: list[int]) -> dict[int, list[int]]:
    """value -> the indices holding it."""
    out: dict[int, list[int]] = {}
    for i, v in enumerate(values):
        out.setdefault(v, []).append(i)
    return out


def draft(model: Transformer, pending: list[Pending], rows: torch.Tensor, k: int, sampling: SamplingOptions,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None, SpanSnapshot | None]:
    """Run each row's pending MTP inputs (grouped by length), then K - 1 more MTP steps on its own streams ->
    (drafts [b, K], their draft distributions [b, K, V] when sampling, the MTP span snapshot to restore)."""
    mtp, dev = model.mtp[0], model.device
    b = rows.numel()
    logits = torch.empty(b, model.cfg.vocab_size, device=dev)
    x = torch.empty(b, 1, *pending[0].streams.shape[1:], dtype=pending[0].streams.dtype, device=dev)
    for idx in group_by([len(p.tokens) for p in pending]).values():
        at = torch.tensor(idx, device=dev)
        gl, gx = mtp(model, torch.stack([pending[i].streams for i in idx]),
                     torch.tensor([pending[i].tokens for i in idx], device=dev), rows[at],
                     torch.tensor([pending[i].start for i in idx], device=dev))
        logits[at], x[at] = gl, gx[:, -1:]
    start = torch.tensor([p.start + len(p.tokens) for p in pending], device=dev)  # each row's position n
    snap = take_span(model.mtp, rows, start, k - 1) if k > 1 else None
    drafts, probs = [], []
    for j in range(k):
        if j:
            logits, x = mtp(model, x, drafts[-1].view(-1, 1), rows, start + j - 1)
        if sampling.temperature > 0:
            probs.append(normalised_probs(logits, sampling))
            drafts.append(torch.multinomial(probs[-1], 1, generator=gen).squeeze(-1))
        else:
            drafts.append(logits.argmax(dim=-1))
    return torch.stack(drafts, 1), torch.stack(probs, 1) if probs else None, snap


@torch.inference_mode()
def speculate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, eos_id: int, k: int,
              sampling: SamplingOptions | None = None, ignore_eos: bool = False, record_topk: int = 0,
              on_token: Callable[[int, int], None] | None = None, graph_mode: str = "eager",
              backend: str | None = None, stages: str = "whole", prefill_chunk: int | None = None,
              session: Session | None = None, marks: tuple[int, ...] = (), decoder=None) -> list[GenerationResult]:
    """`generate` with K draft tokens per step from the model's MTP layer (see the module docstring); the same
    results, with stats["speculative"] (`DraftStats.as_dict`). graph_mode "regions": the verify runs the
    compiled regions at a static chunk of K + 1 tokens for every cache row; the MTP layer runs eagerly.
    max_new_tokens >= 1 (`generate` runs prompts alone itself). With `session` (one prompt, its caches set up),
    the prompt is prefilled by the session (`mhcrun.session`: reused state, snapshots at `marks`), and it learns
    what the row holds after: the prompt and every token but the last, as after `generate`; `decoder`: the
    session's compiled regions, kept across its runs (else made here in regions mode)."""
    sampling = sampling or SamplingOptions()
    dev = model.device
    check_draft_tokens(model, k)
    chunk = prefill_chunk or default_prefill_chunk(model.cfg)
    results = [GenerationResult(prompt_ids=list(p), tokens=[]) for p in prompts]
    stats = DraftStats(k)
    gen = torch.Generator(device=dev).manual_seed(sampling.seed)
    model.opts.hc.reset()
    max_seq = max(len(p) for p in prompts) + max_new_tokens + k  # a verify runs up to K past the last token
    if session is None:
        model.setup_caches(len(prompts), cache_length(max_seq, graph_mode, model.cfg.max_position_embeddings))
    elif len(prompts) != 1 or max_seq > model.max_seq:
        raise InputError(f"a session runs one prompt of at most {model.max_seq} tokens with its reply and "
                         f"--draft-tokens {k}")
    decoder, ahead_s = start_decoder(model, graph_mode, backend, stages, decoder,
                                     session is None and max_new_tokens > 1, k)

    def finished(row: int) -> bool:
        toks = results[row].tokens
        return (results[row].nonfinite is not None or len(toks) >= max_new_tokens
                or (not ignore_eos and bool(toks) and toks[-1] == eos_id))

    def emit(row: int, tokens: list[int], logits: torch.Tensor, step: int) -> None:
        """Take tokens (logits [len, V], each token's distribution) until the row finishes; logits that are not
        finite end the row before a token is taken from them (its result's `nonfinite`, `raise_nonfinite`)."""
        res = results[row]
        for i, (token, lg) in enumerate(zip(tokens, logits, strict=True)):
            if finished(row):
                return
            bad = nonfinite_rows(lg.unsqueeze(0))
            if bad:
                res.nonfinite = (f"prompt {row}: the logits of step {step + i} ({step_name(step + i)}) hold "
                                 f"{bad[0][1]} (with --draft-tokens {k}: not located); no token was emitted from "
                                 f"them")
                return
            res.tokens.append(token)
            if record_topk:
                pairs, margin = record_step(lg, record_topk)
                res.top_logprobs.append(pairs)
                res.margins.append(margin)
            if on_token:
                on_token(row, token)

    pending: list[Pending] = []
    prefill_s = []
    for row, ids in enumerate(prompts):
        t0 = time.perf_counter()
        if session is None:
            logits, p = prefill_row(model, ids, row, chunk)
        else:
            session.chunk, session.row = chunk, row
            logits = session.prefill(ids, marks)
            p = Pending(session.pending.start, session.pending.streams)
        prefill_s.append(time.perf_counter() - t0)
        first = 0 if nonfinite_rows(logits) else sample_one(logits, sampling, gen)  # emit ends such a row
        emit(row, [first], logits, 0)
        p.tokens.append(first)
        pending.append(p)

    step_s: list[float] = []
    decode_tokens, moved0 = 0, model.opts.tp.traffic.bytes
    active = [r for r in range(len(pending)) if not finished(r)]
    while active:
        t0 = time.perf_counter()
        rows = torch.tensor(active, device=dev)
        n = torch.tensor([len(prompts[r]) + len(results[r].tokens) - 1 for r in active], device=dev)
        before = [len(results[r].tokens) for r in active]
        drafts, q, mtp_snap = draft(model, [pending[r] for r in active], rows, k, sampling, gen)
        chunk_ids = torch.cat([torch.tensor([[results[r].tokens[-1]] for r in active], device=dev), drafts], 1)
        main_snap = take_span(model.layers, rows, n, k + 1)
        keep_chunks(model.layers, True)
        logits, streams = verify(model, decoder, chunk_ids, rows, n)
        kept = []
        for i, r in enumerate(active):
            if sampling.temperature > 0 and not nonfinite_rows(logits[i]):
                a, nxt = accept_drafts(normalised_probs(logits[i], sampling), q[i], drafts[i], gen)
            else:
                a, nxt = accept_greedy(logits[i], drafts[i])
            stats.add(a)
            emit(r, [*drafts[i, :a].tolist(), nxt], logits[i, :a + 1], before[i])
            # the row keeps what it emitted but the last (all a + 1 but where it finished first)
            kept.append(max(1, len(results[r].tokens) - before[i]))
            pending[r] = Pending(int(n[i]), streams[i, :kept[-1]], [*drafts[i, :a].tolist(), nxt][:kept[-1]])
        redo = torch.tensor([e < k + 1 for e in kept], device=dev)
        # rejected drafts: the state after the kept tokens, rebuilt from the span (no rerun)
        rewind_span(model.layers, main_snap, n, torch.tensor(kept, device=dev), redo)
        keep_chunks(model.layers, False)
        if mtp_snap is not None:  # the MTP layer's draft positions ran on its own streams: put them back
            restore_span(model.mtp, mtp_snap)
        step_s.append(time.perf_counter() - t0)
        decode_tokens += sum(len(results[r].tokens) - before[i] for i, r in enumerate(active))
        active = [r for r in active if not finished(r)]

    if session is not None and results[0].nonfinite is not None:
        session.lose_live_state()
    elif session is not None:
        session.fed(results[0].tokens[:-1], Pending(pending[0].start, pending[0].streams))
    finish_stats(model, results, prefill_s, step_s, decode_tokens, decoder is not None,
                 None if session is None else [session.prefilled], ahead_s)
    for res in results:
        res.stats["speculative"] = stats.as_dict()
        if model.opts.tp.world > 1:  # what one rank put into all-reduces per decoded token (fp32)
            res.stats["collective_bytes_per_token"] = (model.opts.tp.traffic.bytes - moved0) / max(decode_tokens, 1)
    return results


def normalised_probs(logits: torch.Tensor, sampling: SamplingOptions) -> torch.Tensor:
    """logits [..., V] -> the sampling distribution (temperature, top-p), summing to 1: the ratios p / q of the
    acceptance rule need both normalised."""
    p = sampling_probs(logits, sampling)
    return p / p.sum(dim=-1, keepdim=True)


def sample_one(logits: torch.Tensor, sampling: SamplingOptions, gen: torch.Generator) -> int:
    """logits [1, V] -> one token: argmax, or a draw from the sampling distribution."""
    if sampling.temperature <= 0:
        return int(logits[0].argmax())
    return int(torch.multinomial(sampling_probs(logits[0], sampling), 1, generator=gen))


def verify(model: Transformer, decoder, chunk: torch.Tensor, rows: torch.Tensor,
           n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The main model on chunk [b, K+1] at positions n [b] of cache rows `rows` -> (logits [b, K+1, V] of every
    position, the streams before the head [b, K+1, n, d]). With compiled regions (`decoder`) every cache row runs
    at the static chunk size: the other rows (finished) run their last tokens again, their results dropped."""
    if decoder is None:
        return model(chunk, rows, n, every=True, streams=True)
    b, s = model.max_batch, chunk.size(1)
    full = torch.zeros(b, s, dtype=torch.long, device=chunk.device)
    at = torch.full((b,), model.max_seq - s, dtype=torch.long, device=chunk.device)
    full[rows], at[rows] = chunk, n
    logits, streams = decoder.verify(full, at)
    keep_rows(model.layers, rows)
    return logits[rows], streams[rows]
