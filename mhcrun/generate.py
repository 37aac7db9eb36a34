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
from mhcrun.model import Probe, Transformer
from mhcrun.nki import ops as hc_ops
from mhcrun.parallel import MOVED, Shard, gather_text, gather_values
from mhcrun.probes import Capture, FirstNonFinite, first_nonfinite_op
from mhcrun.session import Session


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]  # generated ids (eos included when it was generated)
    # per step: the top-k (token id, log-prob) pairs of the distribution the token was chosen from
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # per step: top-1 minus top-2 logit
    text: str = ""
    stats: dict = field(default_factory=dict)
    nonfinite: str | None = None  # the line saying where its logits turned NaN/Inf (generate's on_nonfinite="stop")


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


def nonfinite_rows(logits: torch.Tensor) -> list[tuple[int, str]]:
    """(index, "NaN" or "Inf") of the rows of logits [b, V] that hold a non-finite value: argmax would turn them
    into plausible-looking token ids. One isfinite reduction over [b, V] per step."""
    bad = ~torch.isfinite(logits).all(dim=-1)
    if not bool(bad.any()):
        return []
    return [(i, "NaN" if bool(torch.isnan(logits[i]).any()) else "Inf") for i in bad.nonzero()[:, 0].tolist()]


def step_name(step: int) -> str:
    return "prefill" if step == 0 else f"decode step {step}"


def sample(logits: torch.Tensor, opts: SamplingOptions, gen: torch.Generator) -> torch.Tensor:
    """logits [b, V] (fp32) -> token ids [b]: argmax when greedy, else temperature + top-p sampling."""
    if opts.temperature <= 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(sampling_probs(logits, opts), 1, generator=gen).squeeze(-1)


def sampling_probs(logits: torch.Tensor, opts: SamplingOptions) -> torch.Tensor:
    """logits [..., V] -> the distribution a token is drawn from: softmax at the temperature, cut to top-p
    (unnormalised after the cut: multinomial normalises)."""
    probs = (logits / opts.temperature).softmax(dim=-1)
    if opts.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(dim=-1) - sorted_p > opts.top_p  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs


def record_step(logits: torch.Tensor, k: int) -> tuple[list[tuple[int, float]], float]:
    """Top-k (id, log-prob) and the top-1/top-2 logit margin of one row's logits [V]."""
    logp = logits.float().log_softmax(dim=-1)
    top = logp.topk(min(k, logp.numel()))
    pairs = [(int(i), float(v)) for i, v in zip(top.indices, top.values, strict=True)]
    top2 = logits.topk(2).values
    return pairs, float(top2[0] - top2[1])


def prefill(model: Transformer, ids: list[int], row: int, chunk: int, probe: Probe | None = None) -> torch.Tensor:
    """Prefill one prompt into cache row `row`, `chunk` tokens at a time -> logits [1, V] of its last token."""
    dev = model.device
    rows = torch.tensor([row], device=dev)
    for c0 in range(0, len(ids), chunk):
        logits = model(torch.tensor([ids[c0:c0 + chunk]], device=dev), rows, c0, probe)
    return logits


def row_probe(probe: Probe, i: int) -> Probe:
    """`probe` seeing only row i of each region's output (as a batch of one)."""
    return fan_out({i: probe})


def fan_out(probes: dict[int, Probe]) -> Probe | None:
    """One probe for a batch: probes[i] sees row i of each region's output."""
    if not probes:
        return None

    def probe(name: str, t: torch.Tensor) -> None:
        for i, p in probes.items():
            p(name, t[i:i + 1])

    return probe


def replay(model: Transformer, decoder, ids: list[int], tokens: list[int], row: int, chunk: int,
           probe_at: Callable[[int], Probe | None]) -> torch.Tensor:
    """Run one sequence again in cache row `row`: prefill `ids`, then decode `tokens` (forced) on the eager model
    or `decoder` (compiled regions; its other rows start afresh), with `probe_at(step)` watching each step's
    regions for this row. -> the logits [V] of the last step."""
    dev = model.device
    model.clear_row(row)
    probe = probe_at(0)
    logits = prefill(model, ids, row, chunk, probe and row_probe(probe, 0))[0]
    for step, token in enumerate(tokens, start=1):
        probe, pos = probe_at(step), len(ids) + step - 1
        if decoder is None:
            logits = model(torch.tensor([[token]], device=dev), torch.tensor([row], device=dev),
                           torch.tensor([pos], device=dev), probe and row_probe(probe, 0))[0]
        else:
            b = model.max_batch
            toks = torch.zeros(b, dtype=torch.long, device=dev).index_fill_(0, torch.tensor([row], device=dev), token)
            at = torch.zeros(b, dtype=torch.long, device=dev).index_fill_(0, torch.tensor([row], device=dev), pos)
            logits = decoder(toks, at, probe and row_probe(probe, row))[row]
    return logits


@torch.inference_mode()
def capture_step(model: Transformer, ids: list[int], tokens: list[int], max_seq: int, chunk: int,
                 graph_mode: str = "eager", backend: str | None = None,
                 stages: str = "whole") -> dict[str, torch.Tensor]:
    """Every region's output (`Capture`) at the step after teacher-forcing `tokens` behind prompt `ids`, on a
    fresh cache of one row and `max_seq` tokens: step 0 is the prefill, step t decodes tokens[t - 1]."""
    model.setup_caches(1, max_seq)
    decoder = make_decoder(model, backend, stages) if graph_mode == "regions" and tokens else None
    cap = Capture()

    def probe_at(step: int) -> Probe:
        cap.on = step == len(tokens)
        return cap

    replay(model, decoder, ids, tokens, 0, chunk, probe_at)
    return cap.joined()


def locate_nonfinite(model: Transformer, decoder, ids: list[int], tokens: list[int], row: int, chunk: int) -> str:
    """Where a sequence's first non-finite value appears: its prefill and decode steps run again on the same path
    with every region checked (the embedding, each layer's attention and MoE half, the head), and, where the
    step runs eagerly, every module. -> e.g. "layer 2 attn:csa produced NaN from finite inputs (in
    layers.2.attn.wq_a, Linear)"."""
    first = FirstNonFinite()

    def probe_at(step: int) -> Probe:
        first.current_step = step
        return first

    with first_nonfinite_op(model) as ops:
        replay(model, decoder, ids, tokens, row, chunk, probe_at)
    first_op = deepest_on_any_rank(ops.first, model.opts.tp)
    if first.region is None:
        return "not located: a run again of its steps stayed finite"
    where = f"{first.region} produced {first.kind}"
    where += " (the embedding of the tokens)" if first.region == "embed" else " from finite inputs"
    if first.step is not None and first.step != len(tokens):
        where += f" at step {first.step}"
    if first_op is not None:
        where += f", first in {first_op}"
    elif decoder is None or first.step == 0:
        where += ", in the mHC steps"
    return where


def deepest_on_any_rank(found: str | None, tp: Shard) -> str | None:
    """The module each rank found first non-finite ("layers.1.attn.wq_b (Linear)"), across ranks: the rank that
    holds a bad share sees it in the module itself, the others only after the all-reduce that spreads it (in a
    module around it), so the deepest module any rank names is where it began."""
    names = [n for n in gather_text(found or "", tp) if n]
    return max(names, key=lambda n: n.split(" ")[0].count("."), default=None)


def make_decoder(model: Transformer, backend: str | None = None, stages: str = "whole"):
    """Compiled region decode for a model whose caches are set up (`mhcrun.regions`)."""
    from mhcrun.regions.runner import RegionDecoder, default_backend

    dev = model.device
    return RegionDecoder(model, "regions", backend or default_backend(dev.type), stages,
                         cuda_graphs=dev.type == "cuda")


@torch.inference_mode()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, eos_id: int,
             sampling: SamplingOptions | None = None, ignore_eos: bool = False, record_topk: int = 0,
             on_token: Callable[[int, int], None] | None = None, graph_mode: str = "eager",
             backend: str | None = None, stages: str = "whole", prefill_chunk: int | None = None,
             forced: list[list[int]] | None = None, on_logits: Callable[[int, int, torch.Tensor], None] | None = None,
             probe_at: Callable[[int, int], Probe | None] | None = None,
             on_nonfinite: str = "raise", session: Session | None = None,
             marks: tuple[int, ...] = (), draft_tokens: int = 0) -> list[GenerationResult]:
    """Generate up to max_new_tokens for each prompt (token id lists). on_token(row, id) streams.

    Each prompt is prefilled eagerly in chunks of `prefill_chunk` tokens (default: `default_prefill_chunk`).
    graph_mode "eager" decodes with the model's eager code (a chunk of one token per row); "regions" with
    compiled region graphs (`mhcrun.regions`).
    Teacher forcing: with `forced`, row r is fed forced[r][t] after step t whatever it would have chosen, and runs
    len(forced[r]) steps. on_logits(row, step, logits [V]) sees every step's logits; probe_at(row, step) may give
    a probe for that step's regions (`mhcrun.probes`).
    Logits that are not finite end their row before a token is taken from them; the row's steps run again to
    find where the value first appeared (`locate_nonfinite`). on_nonfinite "raise": a NonFiniteError naming the
    prompt, the step and that place; "stop": the row's result carries the same line in `nonfinite` and the
    other rows go on.
    With `session` (one prompt; the session's caches already set up), the prompt is prefilled by the session,
    which reuses the state it holds (`mhcrun.session`; snapshots at `marks`) and learns the tokens decode runs.
    `draft_tokens` K > 0: speculative decoding with the model's MTP layer (`mhcrun.speculate`)."""
    if draft_tokens:
        from mhcrun.speculate import speculate

        if forced is not None or on_logits or probe_at or session is not None:
            raise InputError("--draft-tokens does not run with teacher forcing, probes or a session / prompt cache")
        return speculate(model, prompts, max_new_tokens, eos_id, draft_tokens, sampling, ignore_eos, record_topk,
                         on_token, graph_mode, backend, stages, prefill_chunk)
    sampling = sampling or SamplingOptions()
    cfg = model.cfg
    check_prompts(prompts, max_new_tokens, cfg.vocab_size, cfg.max_position_embeddings)
    results = [GenerationResult(prompt_ids=list(p), tokens=[]) for p in prompts]
    if max_new_tokens == 0:
        rss = peak_rss_mb()
        per_rank = gather_values([rss], model.opts.tp)  # every rank gets here
        for res in results:
            res.stats = {"prefill_tok_s": 0.0, "decode_tok_s": 0.0, "compile_s": 0.0, "peak_rss_mb": rss,
                         "tp": model.opts.tp.world, "peak_rss_mb_per_rank": per_rank}
        return results
    if forced is not None and (len(forced) != len(prompts) or any(len(f) > max_new_tokens for f in forced)):
        raise InputError(f"teacher forcing needs one token list per prompt of at most {max_new_tokens} tokens")
    dev = model.device
    gen = torch.Generator(device=dev).manual_seed(sampling.seed)
    hc_ops.reset_kernel_stats()
    if session is None:
        model.setup_caches(len(prompts), max(len(p) for p in prompts) + max_new_tokens)
    elif len(prompts) != 1 or len(prompts[0]) + max_new_tokens > model.max_seq or forced is not None:
        raise InputError(f"a session runs one prompt of at most {model.max_seq} tokens with its reply, not teacher "
                         f"forced")
    bad: dict[int, tuple[int, str]] = {}  # row -> (step, NaN|Inf)

    def accept(row: int, logits: torch.Tensor, token: int) -> None:
        res = results[row]
        step = len(res.tokens)
        if on_logits:
            on_logits(row, step, logits)
        if forced is not None:
            token = forced[row][step]
        res.tokens.append(token)
        if record_topk:
            pairs, margin = record_step(logits, record_topk)
            res.top_logprobs.append(pairs)
            res.margins.append(margin)
        if on_token:
            on_token(row, token)

    def finished(row: int) -> bool:
        toks = results[row].tokens
        if row in bad:
            return True
        if forced is not None:
            return len(toks) >= len(forced[row])
        return len(toks) >= max_new_tokens or (not ignore_eos and toks[-1] == eos_id)

    def probe(row: int, i: int | None = None) -> Probe | None:
        p = probe_at(row, len(results[row].tokens)) if probe_at else None
        return p if p is None or i is None else row_probe(p, i)

    def take(rows: list[int], logits: torch.Tensor) -> None:
        """Accept one step's logits [len(rows), V] (one row per entry of rows), except non-finite ones."""
        for i, kind in nonfinite_rows(logits):
            bad[rows[i]] = (len(results[rows[i]].tokens), kind)
        ok = [i for i, r in enumerate(rows) if r not in bad]
        next_ids = sample(logits[ok], sampling, gen).tolist() if ok else []
        for i, token in zip(ok, next_ids, strict=True):
            accept(rows[i], logits[i], token)

    chunk = prefill_chunk or default_prefill_chunk(cfg)
    if chunk < 1:
        raise InputError(f"--prefill-chunk must be >= 1, got {chunk}")
    prefill_s = []
    for row, ids in enumerate(prompts):
        if forced is not None and not forced[row]:
            prefill_s.append(0.0)
            continue
        t0 = time.perf_counter()
        if session is None:
            logits = prefill(model, ids, row, chunk, probe(row, 0))
        else:
            session.chunk, session.row = chunk, row
            logits = session.prefill(ids, marks)
        prefill_s.append(time.perf_counter() - t0)
        take([row], logits)
        if bad and on_nonfinite == "raise":
            break

    decoder = make_decoder(model, backend, stages) if graph_mode == "regions" else None
    step_s: list[float] = []
    decode_tokens = 0
    moved0 = MOVED["bytes"]
    active = [r for r in range(len(prompts)) if r < len(prefill_s) and not finished(r)]
    while active and not (bad and on_nonfinite == "raise"):
        t0 = time.perf_counter()
        if decoder is None:  # eager: only the unfinished rows
            tokens = torch.tensor([[results[r].tokens[-1]] for r in active], device=dev)
            pos = torch.tensor([len(prompts[r]) + len(results[r].tokens) - 1 for r in active], device=dev)
            probes = {i: p for i, r in enumerate(active) if (p := probe(r)) is not None}
            logits = model(tokens, torch.tensor(active, device=dev), pos, fan_out(probes))  # one token per row
        else:  # compiled: every row, static shapes; a finished row repeats its last step
            tokens = torch.tensor([res.tokens[-1] if res.tokens else 0 for res in results], device=dev)
            pos = torch.tensor([len(p) + len(res.tokens) - 1 for p, res in zip(prompts, results, strict=True)],
                               device=dev).clamp(min=0)
            probes = {r: p for r in active if (p := probe(r)) is not None}
            logits = decoder(tokens, pos, fan_out(probes))[torch.tensor(active, device=dev)]
        take(active, logits)
        step_s.append(time.perf_counter() - t0)
        decode_tokens += len(active)
        active = [r for r in active if not finished(r)]
    if session is not None and bad:
        session.lose_live_state()
    elif session is not None:  # the row holds the prompt and every token fed back (all but the last one taken)
        session.fed(results[0].tokens[:-1])

    for row, (step, kind) in sorted(bad.items()):
        where = locate_nonfinite(model, decoder, prompts[row], results[row].tokens[:step], row, chunk)
        line = (f"prompt {row}: the logits of step {step} ({step_name(step)}) hold {kind}; {where}; no token was "
                f"emitted from them")
        if on_nonfinite == "raise":
            raise NonFiniteError(line)
        results[row].nonfinite = line

    compile_s = 0.0
    if decoder is not None and step_s:  # the first compiled step also compiles: report that apart
        typical = sum(step_s[1:]) / (len(step_s) - 1) if len(step_s) > 1 else 0.0
        compile_s = max(0.0, step_s[0] - typical)
    decode_s = sum(step_s) - compile_s

    rss = peak_rss_mb()
    per_rank = gather_values([rss], model.opts.tp)  # a collective: every rank gets here in step
    for row, res in enumerate(results):
        res.stats = {
            "prefill_tok_s": len(prompts[row]) / prefill_s[row] if row < len(prefill_s) and prefill_s[row] > 0
            else 0.0,
            "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,  # batch throughput
            "compile_s": compile_s,
            "peak_rss_mb": rss,
            "kernels": hc_ops.kernel_stats(),  # calls per kernel and backend (torch, nki-sim, nki), whole batch
            "tp": model.opts.tp.world,
            "peak_rss_mb_per_rank": per_rank,
        }
        if model.opts.tp.world > 1:  # what one rank put into all-reduces per decoded token (fp32)
            res.stats["collective_bytes_per_token"] = (MOVED["bytes"] - moved0) / max(decode_tokens, 1)
    return results
