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
from mhcrun.ops.qgemv import StepScope
from mhcrun.parallel import Shard, gather_text, gather_values
from mhcrun.probes import Capture, FirstNonFinite, first_nonfinite_op
from mhcrun.session import Session
from mhcrun.settings import SamplingOptions, cache_length


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
    """(index, "NaN" or "Inf") of the rows of logits [b, V] (or of one row [V]: index 0) that hold a non-finite
    value: argmax would turn them into plausible-looking token ids. One sum over [b, V] per step: a non-finite value
    makes its row's sum non-finite, so only then (or where finite values overflow the sum) the rows are checked value
    by value (a quarter of the time of that check for a row of 32,768)."""
    if bool(torch.isfinite(logits.sum(dim=-1)).all()):
        return []
    logits = logits.reshape(-1, logits.shape[-1])
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


def fan_out(probes: dict[int, Probe]) -> Probe | None:
    """One probe for a batch: probes[i] sees row i of each region's output (as a batch of one)."""
    if not probes:
        return None

    def probe(name: str, t: torch.Tensor) -> None:
        for i, p in probes.items():
            p(name, t[i:i + 1])

    return probe


class Stepper:
    """The steps of a batch of sequences, one per cache row, on one path: `prefill(row, ids)` then
    `decode(rows, tokens)`, each feeding a row's tokens at its next positions. Eager decode runs the model's
    forward on the given rows (a chunk of one token each); compiled decode (`decoder`, `mhcrun.regions`) runs
    every row at static shapes, a row not stepped repeating its last step (the same token at the same position
    writes the same state). Probes are keyed by cache row. `ahead_s`: the seconds its decoder's graphs took to
    compile ahead of the run (`RegionDecoder.compile_ahead`), reported as its compile time."""

    def __init__(self, model: Transformer, chunk: int, decoder=None, ahead_s: float = 0.0):
        self.model, self.chunk, self.decoder, self.ahead_s = model, chunk, decoder, ahead_s
        self.length = [0] * model.max_batch  # tokens each row's state holds
        self.last = [0] * model.max_batch  # the token each row ran last
        # on a CPU with the kernel (one process): each decode step in one parallel region of the kernel, whose other
        # threads read the next GEMV call's weights ahead in the step's gaps (`StepScope`; it lives with the run)
        cpu, threads = model.opts.cpu, torch.get_num_threads()
        self.scope = StepScope(cpu.library, threads) if model.device.type == "cpu" and cpu.on and cpu.reads_ahead \
            and threads > 1 and model.opts.tp.world == 1 else None
        self.warm = decoder is None  # whether the decoder's last step compiled nothing (a compile runs outside a scope)

    def prefill(self, row: int, ids: list[int], probe: Probe | None = None) -> torch.Tensor:
        """Row `row` starts the sequence `ids` -> logits [V] of its last token."""
        logits = prefill(self.model, ids, row, self.chunk, probe)[0]
        self.length[row], self.last[row] = len(ids), ids[-1]
        return logits

    def decode(self, rows: list[int], tokens: list[int], probes: dict[int, Probe] | None = None) -> torch.Tensor:
        """Feed tokens[i] to row rows[i] at its next position -> logits [len(rows), V]."""
        if self.scope is None:
            return self.step(rows, tokens, probes)
        if self.warm:
            return self.scope.run(lambda: self.step(rows, tokens, probes))
        graphs = self.decoder.graph_count() if self.decoder is not None else 0
        logits = self.step(rows, tokens, probes)
        self.warm = self.decoder is None or self.decoder.graph_count() == graphs
        return logits

    def step(self, rows: list[int], tokens: list[int], probes: dict[int, Probe] | None) -> torch.Tensor:
        """`decode`'s step."""
        probes, dev = probes or {}, self.model.device
        for r, t in zip(rows, tokens, strict=True):
            self.length[r], self.last[r] = self.length[r] + 1, t
        pos = [max(n - 1, 0) for n in self.length]
        if self.decoder is None:
            at = torch.tensor(rows, device=dev)
            by_index = {i: probes[r] for i, r in enumerate(rows) if r in probes}
            return self.model(torch.tensor([[t] for t in tokens], device=dev), at,
                              torch.tensor([pos[r] for r in rows], device=dev), fan_out(by_index))
        logits = self.decoder(torch.tensor(self.last, device=dev), torch.tensor(pos, device=dev), fan_out(probes))
        if dev.type == "cpu" and rows == list(range(len(self.length))):  # every row, in order: the step's own
            return logits  # logits (a fresh tensor each step; CUDA graphs write theirs again: a copy there)
        return logits[torch.tensor(rows, device=dev)]


def replay(steps: Stepper, ids: list[int], tokens: list[int], row: int,
           probe_at: Callable[[int], Probe | None]) -> torch.Tensor:
    """Run one sequence again in cache row `row`: prefill `ids`, then decode `tokens` (forced), with
    `probe_at(step)` watching each step's regions for this row. -> the logits [V] of the last step."""
    steps.model.clear_row(row)
    probe = probe_at(0)
    logits = steps.prefill(row, ids, probe and fan_out({0: probe}))
    for step, token in enumerate(tokens, start=1):
        probe = probe_at(step)
        logits = steps.decode([row], [token], probe and {row: probe})[0]
    return logits


@torch.inference_mode()
def capture_step(model: Transformer, ids: list[int], tokens: list[int], max_seq: int, chunk: int,
                 graph_mode: str = "eager", backend: str | None = None,
                 stages: str = "whole") -> dict[str, torch.Tensor]:
    """Every region's output (`Capture`) at the step after teacher-forcing `tokens` behind prompt `ids`, on a
    fresh cache of one row and `max_seq` tokens (compiled regions: rounded up, `settings.cache_length`): step 0 is
    the prefill, step t decodes tokens[t - 1]."""
    model.setup_caches(1, cache_length(max_seq, graph_mode, model.cfg.max_position_embeddings))
    decoder = make_decoder(model, backend, stages) if graph_mode == "regions" and tokens else None
    cap = Capture()

    def probe_at(step: int) -> Probe:
        cap.on = step == len(tokens)
        return cap

    replay(Stepper(model, chunk, decoder), ids, tokens, 0, probe_at)
    return cap.joined()


def locate_nonfinite(steps: Stepper, ids: list[int], tokens: list[int], row: int) -> str:
    """Where a sequence's first non-finite value appears: its prefill and decode steps run again on the same path
    with every region checked (the embedding, each layer's attention and MoE half, the head), and, where the
    step runs eagerly, every module. -> e.g. "layer 2 attn:csa produced NaN from finite inputs (in
    layers.2.attn.wq_a, Linear)"."""
    first = FirstNonFinite()

    def probe_at(step: int) -> Probe:
        first.current_step = step
        return first

    with first_nonfinite_op(steps.model) as ops:
        replay(steps, ids, tokens, row, probe_at)
    first_op = deepest_on_any_rank(ops.first, steps.model.opts.tp)
    if first.region is None:
        return "not located: a run again of its steps stayed finite"
    where = f"{first.region} produced {first.kind}"
    where += " (the embedding of the tokens)" if first.region == "embed" else " from finite inputs"
    if first.step is not None and first.step != len(tokens):
        where += f" at step {first.step}"
    if first_op is not None:
        where += f", first in {first_op}"
    elif steps.decoder is None or first.step == 0:
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


def start_decoder(model: Transformer, graph_mode: str, backend: str | None, stages: str, decoder, fresh: bool,
                  draft_tokens: int = 0) -> tuple:
    """A run's decoder: `decoder` where given (a session's, kept across its runs), else in regions mode one made
    here (`make_decoder`), on fresh caches (`fresh`: no session's state, decode steps to come) with its graphs
    compiled ahead of the prefill, where they compile so (`RegionDecoder.compiles_ahead`; with `draft_tokens` K, a
    speculative verify's); eager: None -> (the decoder, the seconds compiled ahead)."""
    if graph_mode != "regions" or decoder is not None:
        return decoder, 0.0
    decoder = make_decoder(model, backend, stages)
    return decoder, decoder.compile_ahead(draft_tokens) if fresh and decoder.compiles_ahead else 0.0


@dataclass
class Batch:
    """Results being made for a batch of prompts: each row's tokens so far, and where its logits turned
    non-finite (row -> step, NaN|Inf)."""

    results: list[GenerationResult]
    bad: dict[int, tuple[int, str]] = field(default_factory=dict)

    def take(self, rows: list[int], logits: torch.Tensor, bad: list[tuple[int, str]] | None = None) -> list[int]:
        """The rows of one step's logits [len(rows), V] that are finite (the others are marked bad; `bad`: their
        `nonfinite_rows`, where the caller has them)."""
        for i, kind in nonfinite_rows(logits) if bad is None else bad:
            self.bad[rows[i]] = (len(self.results[rows[i]].tokens), kind)
        return [i for i, r in enumerate(rows) if r not in self.bad]

    def locate(self, steps: Stepper) -> None:
        """Each bad row's steps run again to find where its value first appeared: its result's `nonfinite`."""
        for row, (step, kind) in sorted(self.bad.items()):
            res = self.results[row]
            where = locate_nonfinite(steps, res.prompt_ids, res.tokens[:step], row)
            res.nonfinite = (f"prompt {row}: the logits of step {step} ({step_name(step)}) hold {kind}; {where}; no "
                             f"token was emitted from them")


def raise_nonfinite(results: list[GenerationResult]) -> list[GenerationResult]:
    """results, or a NonFiniteError with the line of the first whose logits turned non-finite."""
    for res in results:
        if res.nonfinite:
            raise NonFiniteError(res.nonfinite)
    return results


def start_batch(model: Transformer, prompts: list[list[int]], max_seq: int, chunk: int | None, graph_mode: str,
                backend: str | None, stages: str, session: Session | None = None,
                decoder=None, decodes: bool = True) -> tuple[Batch, Stepper]:
    """Results and steps for a batch of prompts (already checked: `check_prompts`) on fresh caches of `max_seq`
    tokens a row (compiled regions: rounded up, `settings.cache_length`), or on a session's; `decoder`: the
    session's compiled regions, kept across its runs (else made here in regions mode, and on fresh caches compiled
    ahead of the prefill where decode steps will run: `decodes`)."""
    model.opts.hc.reset()
    if session is None:
        model.setup_caches(len(prompts), cache_length(max_seq, graph_mode, model.cfg.max_position_embeddings))
    elif len(prompts) != 1 or max_seq > model.max_seq:
        raise InputError(f"a session runs one prompt of at most {model.max_seq} tokens with its reply")
    decoder, ahead_s = start_decoder(model, graph_mode, backend, stages, decoder, session is None and decodes)
    batch = Batch([GenerationResult(prompt_ids=list(p), tokens=[]) for p in prompts])
    return batch, Stepper(model, chunk or default_prefill_chunk(model.cfg), decoder, ahead_s)


@torch.inference_mode()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, eos_id: int,
             sampling: SamplingOptions | None = None, ignore_eos: bool = False, record_topk: int = 0,
             on_token: Callable[[int, int], None] | None = None, graph_mode: str = "eager",
             backend: str | None = None, stages: str = "whole", prefill_chunk: int | None = None,
             session: Session | None = None, marks: tuple[int, ...] = (),
             draft_tokens: int = 0, warmup: bool = False, decoder=None) -> list[GenerationResult]:
    """Generate up to max_new_tokens for each prompt (token id lists, checked by `check_prompts`).

    Each prompt is prefilled eagerly in chunks of `prefill_chunk` tokens (default: `default_prefill_chunk`), then
    decode steps (`Stepper`: eager, or compiled regions with graph_mode "regions") advance every unfinished row by a
    token sampled from its logits (`sample`); on_token(row, id) streams, `record_topk` keeps each step's top-k
    log-probs and margin. With max_new_tokens 0 the prompts are prefilled alone (timed, their logits checked). A row
    whose logits turn non-finite ends before a token is taken from them; its steps run again to find where the value
    first appeared, and its result's `nonfinite` says so (`raise_nonfinite`). With `session` (one prompt; the
    session's caches already set up), the prompt is prefilled by the session, which reuses the state it holds
    (`mhcrun.session`; snapshots at `marks`) and learns the tokens decode runs. `draft_tokens` K > 0: speculative
    decoding with the model's MTP layer (`mhcrun.speculate`, with a session too). `warmup`: the first prompt is
    prefilled once and a decode step run after it, untimed, and the rows cleared before the timed run (`warm_up`, as
    llama-bench warms up: a prompt and a generated token), so that the speeds leave out first-touch costs: the
    weights' pages mapped in, the kernels loaded, the threads started, a decode step's tables learnt (a compiled
    step's compile counts as compile time; no session, no draft tokens). `decoder` (graph_mode "regions", with
    `session`): the compiled regions of the session's caches, kept across its runs so that a chat's later turns run
    the graphs its first compiled (`make_decoder`)."""
    if warmup and (session is not None or draft_tokens):
        raise InputError("--warmup does not run with --prompt-cache or --draft-tokens")
    if draft_tokens and max_new_tokens:  # with none to make, nothing is drafted: the prompts alone, below
        from mhcrun.speculate import speculate

        return speculate(model, prompts, max_new_tokens, eos_id, draft_tokens, sampling, ignore_eos, record_topk,
                         on_token, graph_mode, backend, stages, prefill_chunk, session, marks, decoder)
    sampling = sampling or SamplingOptions()
    batch, steps = start_batch(model, prompts, max(map(len, prompts)) + max_new_tokens, prefill_chunk, graph_mode,
                               backend, stages, session, decoder, max_new_tokens > 1)
    results, gen = batch.results, torch.Generator(device=model.device).manual_seed(sampling.seed)
    warm_s = warm_up(steps, prompts[0], max_new_tokens > 1) if warmup else None

    def take(rows: list[int], logits: torch.Tensor) -> None:
        greedy = model.opts.cpu.greedy(logits) if sampling.temperature <= 0 else None  # the check and argmax, one call
        ok = batch.take(rows, logits, None if greedy is None else greedy[0])
        if greedy is not None:
            ids = greedy[1].tolist()
            tokens = [ids[i] for i in ok]
        else:
            chosen = logits if len(ok) == len(rows) else logits[ok]  # every row finite: no copy
            tokens = sample(chosen, sampling, gen).tolist() if ok else []
        for i, token in zip(ok, tokens, strict=True):
            res = results[rows[i]]
            res.tokens.append(token)
            if record_topk:
                pairs, margin = record_step(logits[i], record_topk)
                res.top_logprobs.append(pairs)
                res.margins.append(margin)
            if on_token:
                on_token(rows[i], token)

    def running(row: int) -> bool:
        toks = results[row].tokens
        return row not in batch.bad and len(toks) < max_new_tokens and (ignore_eos or toks[-1] != eos_id)

    prefill_s, prefilled = [], []  # per row: seconds, and tokens run (a session's reused state is not)
    for row, ids in enumerate(prompts):
        t0 = time.perf_counter()
        if session is None:
            logits = steps.prefill(row, ids)
        else:
            session.chunk, session.row = steps.chunk, row
            logits = session.prefill(ids, marks)[0]
            steps.length[row], steps.last[row] = len(ids), ids[-1]
        prefill_s.append(time.perf_counter() - t0)
        prefilled.append(len(ids) if session is None else session.prefilled)
        if max_new_tokens:
            take([row], logits.unsqueeze(0))
        else:  # the prompt alone (max_new_tokens 0): its logits checked, no token taken
            batch.take([row], logits.unsqueeze(0))

    step_s: list[float] = []
    decode_tokens, moved0 = 0, model.opts.tp.traffic.bytes
    active = [r for r in range(len(prompts)) if running(r)]
    while active:
        t0 = time.perf_counter()
        take(active, steps.decode(active, [results[r].tokens[-1] for r in active]))
        step_s.append(time.perf_counter() - t0)
        decode_tokens += len(active)
        active = [r for r in active if running(r)]
    if session is not None and batch.bad:
        session.lose_live_state()
    elif session is not None:  # the row holds the prompt and every token fed back (all but the last one taken)
        session.fed(results[0].tokens[:-1])
    batch.locate(steps)
    finish_stats(model, results, prefill_s, step_s, decode_tokens, steps.decoder is not None, prefilled,
                 steps.ahead_s, warm_s)
    if model.opts.tp.world > 1:  # what one rank put into all-reduces per decoded token (fp32)
        for res in results:
            res.stats["collective_bytes_per_token"] = (model.opts.tp.traffic.bytes - moved0) / max(decode_tokens, 1)
    return results


@torch.inference_mode()
def teacher_force(model: Transformer, prompts: list[list[int]], forced: list[list[int]],
                  observe: Callable[[int, int, torch.Tensor], None], graph_mode: str = "eager",
                  backend: str | None = None, stages: str = "whole",
                  prefill_chunk: int | None = None) -> list[GenerationResult]:
    """Teacher forcing (golden-check): row r runs len(forced[r]) steps, its prefill then a decode step per forced
    token but the last, and is fed forced[r][t] after step t whatever it would choose; observe(row, step, logits
    [V]) sees every step's logits. A row whose logits turn non-finite stops there (its `nonfinite` says where)."""
    batch, steps = start_batch(model, prompts, max(len(p) + len(f) for p, f in zip(prompts, forced, strict=True)),
                               prefill_chunk, graph_mode, backend, stages, decodes=max(map(len, forced)) > 1)
    results = batch.results

    def take(rows: list[int], logits: torch.Tensor) -> None:
        for i in batch.take(rows, logits):
            res = results[rows[i]]
            observe(rows[i], len(res.tokens), logits[i])
            res.tokens.append(forced[rows[i]][len(res.tokens)])

    prefill_s, step_s = [], []
    for row, ids in enumerate(prompts):
        t0 = time.perf_counter()
        if forced[row]:
            take([row], steps.prefill(row, ids).unsqueeze(0))
        prefill_s.append(time.perf_counter() - t0)
    active = [r for r in range(len(prompts)) if r not in batch.bad and len(results[r].tokens) < len(forced[r])]
    decode_tokens = 0
    while active:
        t0 = time.perf_counter()
        take(active, steps.decode(active, [results[r].tokens[-1] for r in active]))
        step_s.append(time.perf_counter() - t0)
        decode_tokens += len(active)
        active = [r for r in active if r not in batch.bad and len(results[r].tokens) < len(forced[r])]
    batch.locate(steps)
    return finish_stats(model, results, prefill_s, step_s, decode_tokens, steps.decoder is not None,
                        ahead_s=steps.ahead_s)


def warm_up(steps: Stepper, ids: list[int], decodes: bool) -> float | None:
    """`generate --warmup`, as llama-bench warms up: the prompt `ids` prefilled in row 0 and (`decodes`) one decode
    step after it, untimed, then every row cleared (a compiled step runs them all) -> the seconds the step took (None
    without one)."""
    steps.prefill(0, ids)
    warm_s = None
    if decodes:
        t0 = time.perf_counter()
        steps.decode([0], [ids[-1]])
        warm_s = time.perf_counter() - t0
    for row in range(steps.model.max_batch):
        steps.model.clear_row(row)
    return warm_s


def finish_stats(model: Transformer, results: list[GenerationResult], prefill_s: list[float], step_s: list[float],
                 decode_tokens: int, compiled: bool = False, prefilled: list[int] | None = None,
                 ahead_s: float = 0.0, warm_s: float | None = None) -> list[GenerationResult]:
    """Each result's stats: prefill and decode speed (0.0 where nothing was run: a prompt whose state was reused
    whole, no decode step), the compile time reported apart (the graphs compiled ahead, `ahead_s`, and what the
    first compiled step took beyond the others), peak memory (every rank's: a collective, so every rank gets here in
    step), the hc kernels' calls. `prefilled`: the tokens each row's prefill ran (default: its whole prompt)."""
    first, decode_s = 0.0, sum(step_s)
    if compiled and step_s:  # the first compiled step may also compile: report that apart
        if warm_s is None:
            typical = sum(step_s[1:]) / (len(step_s) - 1) if len(step_s) > 1 else 0.0
            first = max(0.0, step_s[0] - typical)
            decode_s -= first
        else:  # the warmup's step was the first
            first = max(0.0, warm_s - decode_s / len(step_s))
    compile_s = ahead_s + first
    rss = peak_rss_mb()
    per_rank = gather_values([rss], model.opts.tp)
    for row, res in enumerate(results):
        took = prefill_s[row] if row < len(prefill_s) else 0.0
        ran = prefilled[row] if prefilled is not None else len(res.prompt_ids)
        res.stats = {
            "prefill_tok_s": ran / took if took > 0 else 0.0,
            "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,  # batch throughput
            "compile_s": compile_s,
            "peak_rss_mb": rss,
            "kernels": model.opts.hc.stats(),  # calls per kernel and backend (torch, nki-sim, nki, cpu), whole batch
            "tp": model.opts.tp.world,
            "peak_rss_mb_per_rank": per_rank,
        }
    return results
