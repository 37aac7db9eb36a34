"""Golden token files: record what a model generates greedily, then check another run against it.

The schema is described in docs/golden.md. In short: per prompt, the prompt ids, the generated tokens and,
per generated token, the top-k (id, log-prob) pairs and the top-1 minus top-2 logit margin. A check compares
tokens one by one; the first divergence fails the check unless the golden margin at that step is below the
file's tolerance (a near-tie, where a rounding-level difference may legitimately flip the argmax).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mhcrun.errors import GoldenError
from mhcrun.fileio import read_text, write_atomic
from mhcrun.prompts import Prompt

if TYPE_CHECKING:  # generate.py pulls in the model; golden files do not need it
    from mhcrun.generate import GenerationResult

FORMAT = "mhcrun-golden"
VERSION = 1
DTYPES = ("fp32", "bf16")
END = "<end>"  # stands for "no token here": the sequence had already ended

_LOGPROB_DIGITS = 6
_MARGIN_DIGITS = 6


# ---------------------------------------------------------------------------------------------- building


def _step(top: Sequence[Sequence[Any]], margin: float, token: int) -> dict[str, Any]:
    pairs = [[int(t), round(float(lp), _LOGPROB_DIGITS)] for t, lp in top]
    # with an exact tie, topk and argmax may order tied ids differently: put the chosen one first
    for j, (t, lp) in enumerate(pairs):
        if j and t == token and pairs[0][0] != token and lp == pairs[0][1]:
            pairs.insert(0, pairs.pop(j))
            break
    return {"top": pairs, "margin": round(float(margin), _MARGIN_DIGITS)}


def golden_from_results(model: dict, settings: dict, prompts: Sequence[Any],
                        results: Sequence[GenerationResult], tolerance: float = 0.01) -> dict:
    """Build a golden document from greedy generation results (one result per prompt, same order).

    `prompts` are `Prompt`-like objects (`.id`, `.text`); the recorded prompt ids are the ones the model
    actually saw (`result.prompt_ids`). The document is validated before it is returned, so an inconsistent
    result (a step count that does not match the tokens, a non-finite log-prob) raises GoldenError here
    rather than producing a file that cannot be loaded.
    """
    if len(prompts) != len(results):
        raise GoldenError(f"cannot record a golden file: {len(prompts)} prompts but {len(results)} results")
    entries = []
    for prompt, res in zip(prompts, results, strict=True):
        tokens = [int(t) for t in res.tokens]
        if len(res.top_logprobs) != len(tokens) or len(res.margins) != len(tokens):
            raise GoldenError(f"cannot record prompt {prompt.id!r}: {len(tokens)} tokens but "
                              f"{len(res.top_logprobs)} top-k lists and {len(res.margins)} margins")
        steps = [_step(top, margin, tok)
                 for top, margin, tok in zip(res.top_logprobs, res.margins, tokens, strict=True)]
        entries.append({
            "id": str(prompt.id),
            "text": getattr(prompt, "text", None),
            "prompt_ids": [int(t) for t in res.prompt_ids],
            "tokens": tokens,
            "steps": steps,
        })
    golden = {
        "format": FORMAT,
        "version": VERSION,
        "model": {k: model.get(k) for k in ("name", "config_hash", "weights_hash")},
        "settings": dict(settings),
        "tolerance": float(tolerance),
        "prompts": entries,
    }
    validate_golden(golden, "golden (being recorded)")
    return golden


def golden_prompts(golden: dict) -> list[Prompt]:
    """The golden file's prompts, as prompts to re-run: ids exactly as recorded (BOS already included)."""
    return [Prompt(id=p["id"], text=p["text"], ids=list(p["prompt_ids"])) for p in golden["prompts"]]


# ---------------------------------------------------------------------------------------------- file I/O


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def dumps_golden(golden: dict) -> str:
    """Serialize with a stable layout: one line per step, one line per small object."""
    out = ["{"]
    head = [k for k in golden if k != "prompts"]
    for k in head:
        out.append(f" {_dumps(k)}: {_dumps(golden[k])},")
    out.append(' "prompts": [')
    prompts = golden.get("prompts", [])
    for i, p in enumerate(prompts):
        out.append("  {")
        for k in p:
            if k == "steps":
                continue
            out.append(f"   {_dumps(k)}: {_dumps(p[k])},")
        steps = p.get("steps", [])
        out.append('   "steps": [')
        for j, s in enumerate(steps):
            out.append(f"    {_dumps(s)}" + ("," if j + 1 < len(steps) else ""))
        out.append("   ]")
        out.append("  }" + ("," if i + 1 < len(prompts) else ""))
    out.append(" ]")
    out.append("}")
    return "\n".join(out) + "\n"


def write_golden(path: str | Path, golden: dict, force: bool) -> None:
    """Validate and write atomically; an existing file is refused (InputError) unless `force`."""
    validate_golden(golden, str(path))
    write_atomic(path, dumps_golden(golden), force=force)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def load_golden(path: str | Path) -> dict:
    """Read and fully validate a golden file; any problem raises a one-line GoldenError."""
    p = Path(path)
    raw = read_text(p, GoldenError, "golden file")
    try:
        golden = json.loads(raw, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise GoldenError(f"{p}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:
        raise GoldenError(f"{p}: not valid JSON ({e})") from None
    validate_golden(golden, str(p))
    return golden


# ---------------------------------------------------------------------------------------------- schema


class _Bad(Exception):
    def __init__(self, where: str, msg: str):
        super().__init__(f"{where}: {msg}")


def _get(obj: dict, key: str, where: str) -> Any:
    if key not in obj:
        raise _Bad(where or "top level", f"missing key '{key}'")
    return obj[key]


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _obj(v: Any, where: str) -> dict:
    if not isinstance(v, dict):
        raise _Bad(where or "top level", "expected an object")
    return v


def _list(v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise _Bad(where, "expected a list")
    return v


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise _Bad(where, "expected a string")
    return v


def _bool(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise _Bad(where, "expected true or false")
    return v


def _int(v: Any, where: str, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Bad(where, "expected an integer")
    if v < minimum:
        raise _Bad(where, f"expected an integer >= {minimum}, got {v}")
    return v


def _num(v: Any, where: str, minimum: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Bad(where, "expected a number")
    if not math.isfinite(v):
        raise _Bad(where, "expected a finite number")
    if minimum is not None and v < minimum:
        raise _Bad(where, f"expected a number >= {minimum}, got {v}")
    return float(v)


def _int_list(v: Any, where: str, allow_empty: bool) -> list[int]:
    items = _list(v, where)
    if not items and not allow_empty:
        raise _Bad(where, "expected a non-empty list")
    for i, t in enumerate(items):
        _int(t, f"{where}[{i}]")
    return items


def _check_schema(g: Any) -> None:
    _obj(g, "")
    fmt = _get(g, "format", "")
    if fmt != FORMAT:
        raise _Bad("format", f"expected {FORMAT!r}, got {fmt!r} (not an mhcrun golden file)")
    version = _get(g, "version", "")
    if version != VERSION:
        raise _Bad("version", f"version {version!r} is not supported (this mhcrun reads version {VERSION})")

    model = _obj(_get(g, "model", ""), "model")
    for key in ("name", "config_hash", "weights_hash"):
        _str(_get(model, key, "model"), f"model.{key}")

    settings = _obj(_get(g, "settings", ""), "settings")
    dtype = _str(_get(settings, "dtype", "settings"), "settings.dtype")
    if dtype not in DTYPES:
        raise _Bad("settings.dtype", f"expected one of {', '.join(DTYPES)}, got {dtype!r}")
    _bool(_get(settings, "quant_sim", "settings"), "settings.quant_sim")
    _str(_get(settings, "graph_mode", "settings"), "settings.graph_mode")
    max_new = _int(_get(settings, "max_new_tokens", "settings"), "settings.max_new_tokens", 1)
    top_k = _int(_get(settings, "top_k", "settings"), "settings.top_k", 1)
    _bool(_get(settings, "ignore_eos", "settings"), "settings.ignore_eos")

    _num(_get(g, "tolerance", ""), "tolerance", 0.0)

    prompts = _list(_get(g, "prompts", ""), "prompts")
    if not prompts:
        raise _Bad("prompts", "expected at least one prompt")
    seen: dict[str, int] = {}
    for i, p in enumerate(prompts):
        w = f"prompts[{i}]"
        _obj(p, w)
        pid = _str(_get(p, "id", w), f"{w}.id")
        if pid in seen:
            raise _Bad(f"{w}.id", f"duplicate id {pid!r} (also prompts[{seen[pid]}])")
        seen[pid] = i
        text = _get(p, "text", w)
        if text is not None:
            _str(text, f"{w}.text")
        _int_list(_get(p, "prompt_ids", w), f"{w}.prompt_ids", allow_empty=False)
        tokens = _int_list(_get(p, "tokens", w), f"{w}.tokens", allow_empty=True)
        if len(tokens) > max_new:
            raise _Bad(f"{w}.tokens", f"{len(tokens)} tokens but settings.max_new_tokens is {max_new}")
        steps = _list(_get(p, "steps", w), f"{w}.steps")
        if len(steps) != len(tokens):
            raise _Bad(f"{w}.steps",
                       f"{len(steps)} steps but {len(tokens)} tokens (expected one step per token)")
        for j, s in enumerate(steps):
            ws = f"{w}.steps[{j}]"
            _obj(s, ws)
            top = _list(_get(s, "top", ws), f"{ws}.top")
            if not 1 <= len(top) <= top_k:
                raise _Bad(f"{ws}.top", f"expected 1 to {top_k} (settings.top_k) entries, got {len(top)}")
            ids_here: set[int] = set()
            for k, entry in enumerate(top):
                we = f"{ws}.top[{k}]"
                if not isinstance(entry, list) or len(entry) != 2:
                    raise _Bad(we, "expected a [token_id, logprob] pair")
                tid = _int(entry[0], f"{we}[0]")
                _num(entry[1], f"{we}[1]")
                if tid in ids_here:
                    raise _Bad(f"{we}[0]", f"token {tid} appears twice in the top-k list")
                ids_here.add(tid)
            _num(_get(s, "margin", ws), f"{ws}.margin", 0.0)
            if top[0][0] != tokens[j]:
                raise _Bad(f"{ws}.top[0][0]", f"top-1 token {top[0][0]} differs from the generated token "
                                              f"{w}.tokens[{j}] = {tokens[j]}")


def validate_golden(golden: Any, where: str = "golden file") -> None:
    """Raise GoldenError `<where>: <json path>: <problem>` on the first schema violation."""
    try:
        _check_schema(golden)
    except _Bad as e:
        raise GoldenError(f"{where}: {e}") from None


# ---------------------------------------------------------------------------------------------- identity


def check_model_identity(golden: dict, model: dict, force: bool, where: str = "golden file") -> list[str]:
    """Refuse a golden file recorded for another model (different config or weights hash) unless `force`.

    Returns warnings: the forced differences, and a model name that differs while the hashes agree.
    """
    recorded = golden["model"]
    warnings: list[str] = []
    for key, what in (("config_hash", "config"), ("weights_hash", "weights")):
        theirs, ours = recorded.get(key), model.get(key)
        if theirs == ours:
            continue
        msg = (f"{where}: recorded for another model ({what} {theirs} vs {ours}, "
               f"recorded as {recorded.get('name')!r})")
        if not force:
            raise GoldenError(f"{msg}; use --force to check anyway")
        warnings.append(msg)
    if not warnings and recorded.get("name") != model.get("name"):
        warnings.append(f"{where}: recorded under the name {recorded.get('name')!r}, this model is "
                        f"{model.get('name')!r} (the hashes agree)")
    return warnings


def check_fits_model(golden: dict, vocab_size: int, context: int, where: str = "golden file") -> None:
    """Refuse (GoldenError naming the prompt) a golden file whose ids this model cannot take: a prompt id, golden
    token or candidate outside its vocabulary, or a prompt and its tokens beyond its context (a file recorded for
    another model, checked with --force)."""
    for p in golden["prompts"]:
        ids = {"prompt id": p["prompt_ids"], "token": p["tokens"],
               "candidate": [t for s in p["steps"] for t, _ in s["top"]]}
        for what, values in ids.items():
            bad = next((t for t in values if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise GoldenError(f"{where}: prompt {p['id']!r}: {what} {bad} is outside this model's vocabulary "
                                  f"[0, {vocab_size})")
        if len(p["prompt_ids"]) + len(p["tokens"]) > context:
            raise GoldenError(f"{where}: prompt {p['id']!r}: {len(p['prompt_ids'])} prompt tokens + "
                              f"{len(p['tokens'])} golden tokens exceed this model's context of {context}")


# ---------------------------------------------------------------------------------------------- comparing


STATUSES = ("match", "near-tie", "mismatch", "non-finite")


@dataclass
class PromptCheck:
    id: str
    status: str  # one of STATUSES
    matched: int  # leading tokens equal to the golden ones (teacher-forced: steps within the tolerance)
    total: int  # golden token count
    step: int | None = None  # first divergence step (teacher-forced: the first step beyond the tolerance)
    expected: int | str | None = None  # golden token there, or END
    got: int | str | None = None  # this run's token there, or END
    margin: float | None = None  # golden top-1 minus top-2 logit at that step
    note: str | None = None
    max_logprob_diff: float | None = None  # largest |log-prob difference| of a golden candidate, over the steps
    max_logprob_diff_step: int | None = None  # compared (teacher-forced: all; free-running: up to the divergence)
    greedy_differs: bool | None = None  # teacher-forced: whether this run's argmax differs from the golden token
    # at the step of the largest difference
    first_region: str | None = None  # --locate: the first region that differs, and by how much


@dataclass
class CheckReport:
    prompts: list[PromptCheck]
    tolerance: float  # near-tie tolerance on the golden margin
    logprob_tol: float
    teacher_forced: bool = False
    counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.counts = {s: sum(p.status == s for p in self.prompts) for s in STATUSES}

    @property
    def ok(self) -> bool:
        return self.counts["mismatch"] == 0 and self.counts["non-finite"] == 0

    @property
    def exit_code(self) -> int:
        """0 pass, 1 a mismatch, 3 a run whose logits turned non-finite (a failed run)."""
        return 3 if self.counts["non-finite"] else 0 if self.ok else 1


# Default tolerances of the checks by path, measured on the bundled goldens (docs/golden.md): the
# largest |log-prob difference| of a golden candidate (teacher-forced, and the free-running near-tie rule), and the
# relative difference of a region's output from the eager fp32 reference that --locate reports.
TOLERANCES = {
    # the same fp32 arithmetic in another order (compiled regions, the NKI simulator): measured up to 4.6e-4, the
    # NKI simulator's fused hc kernels up to 5.8e-4 (tests/golden/tiny.json, eager)
    "fp32": (1e-3, 1e-3),
    # the FP8 activation simulation over kept-quantised weights in another summation order (the fused kernel
    # against torch's decoders or dequantised weights): up to 7e-6 where no rounding flips, but one flipped FP8
    # rounding moved a candidate by 2.3 on the tiny FP8 model
    "fp32-kernel": (3.0, 0.05),
    # bf16 activations (inductor keeps intermediates in fp32 where eager rounds each op): up to 5.6 between
    # compiled and eager bf16, 6.0 between bf16 and an fp32 golden, on low-probability candidates
    "bf16": (8.0, 0.1),
    # the hc steps in the NKI simulator's device-like numerics (MHCRUN_NKI_SIM=device: every Scalar-engine
    # activation off by up to 2^-9), teacher-forced, 14 prompts x 32 tokens, the fused hc_post_pre: up to 3.83
    # against tests/golden/tiny-random.json (at step 31), 0.23 against tests/golden/tiny.json (4.86 there before,
    # with the unfused kernels and a bf16 lo of fn; 3 teacher-forced argmax flips at near-ties). The other sums'
    # order moves it: on a Zen 4 VM tiny-random.json reached 6.74 (text2, step 26: a flip at golden margin 1.12)
    # with the AVX-512 GEMV kernel and 6.77 with torch's, 3.0 with the AVX2 kernel; tiny.json 0.12-0.82. The
    # locate tolerance is not measured
    "nki-device": (8.0, 0.05),
}


def path_kind(dtype: str, golden_dtype: str, quant_sim: bool, quantised_weights: bool,
              nki_sim: str | None = None) -> str:
    """Which TOLERANCES entry a path under test takes: quantised_weights when the checkpoint stores FP8/FP4
    weights (the golden or this run may have kept them quantised, summing in the kernel's order); nki_sim the NKI
    simulator's numerics the hc steps run in ("exact", "device" or None: not simulated)."""
    if nki_sim == "device":
        return "nki-device"
    if "bf16" in (dtype, golden_dtype):
        return "bf16"
    return "fp32-kernel" if quant_sim and quantised_weights else "fp32"


def _logprobs(pairs: Sequence[Sequence[Any]]) -> dict[int, float]:
    return {int(t): float(lp) for t, lp in pairs}


def _largest_diff(check: PromptCheck, diffs: list[float]) -> None:
    if diffs:
        j = max(range(len(diffs)), key=diffs.__getitem__)
        check.max_logprob_diff, check.max_logprob_diff_step = diffs[j], j


def _free_running(entry: dict, res: GenerationResult, tolerance: float, logprob_tol: float) -> PromptCheck:
    """vLLM's rule: a first divergence passes ("near-tie") when each run's token is in the other's top-k and
    both tokens' log-probs agree within logprob_tol; the golden margin is reported beside it."""
    want: list[int] = entry["tokens"]
    got = [int(t) for t in res.tokens]
    check = PromptCheck(id=entry["id"], status="match", matched=0, total=len(want))
    n = 0
    while n < len(want) and n < len(got) and want[n] == got[n]:
        n += 1
    check.matched = n
    diffs = []
    for j in range(min(n, len(res.top_logprobs))):  # steps in the same context: the candidates both list
        gold, mine = _logprobs(entry["steps"][j]["top"]), _logprobs(res.top_logprobs[j])
        diffs.append(max((abs(mine[t] - lp) for t, lp in gold.items() if t in mine), default=0.0))
    _largest_diff(check, diffs)
    if n == len(want) and n == len(got):
        return check
    check.step = n
    check.expected = want[n] if n < len(want) else END
    check.got = got[n] if n < len(got) else END
    check.margin = entry["steps"][n]["margin"] if n < len(want) else None
    check.status = "mismatch"
    if check.got == END:
        check.note = "this run ended early"
    elif check.expected == END:
        check.note = "this run generated more tokens"
    elif n < len(res.top_logprobs):
        gold, mine = _logprobs(entry["steps"][n]["top"]), _logprobs(res.top_logprobs[n])
        g, r = check.expected, check.got
        tie = check.margin is not None and check.margin < tolerance
        margin_note = f"golden margin {check.margin:.4g} {'<' if tie else '>='} tolerance {tolerance:g}"
        if g in mine and r in gold:
            gap = max(abs(mine[g] - gold[g]), abs(mine[r] - gold[r]))
            if gap <= logprob_tol:
                check.status = "near-tie"
                check.note = (f"each token in the other's top-k, log-probs within {gap:.2g} <= {logprob_tol:g}; "
                              f"{margin_note}; later tokens not compared")
            else:
                check.note = f"log-probs of the two tokens differ by {gap:.3g} > {logprob_tol:g}; {margin_note}"
        else:
            check.note = f"a token outside the other run's top-{len(gold)}; {margin_note}"
    return check


def _teacher_forced(entry: dict, steps: Sequence[tuple[list[float], int]], logprob_tol: float) -> PromptCheck:
    """steps[t] = (this run's log-probs of step t's golden candidates, in the golden order; its argmax token)."""
    want: list[int] = entry["tokens"]
    check = PromptCheck(id=entry["id"], status="match", matched=len(want), total=len(want))
    diffs = [max(abs(mine - lp) for mine, (_, lp) in zip(lps, entry["steps"][t]["top"], strict=True))
             for t, (lps, _) in enumerate(steps)]
    _largest_diff(check, diffs)
    if check.max_logprob_diff_step is not None:
        check.greedy_differs = steps[check.max_logprob_diff_step][1] != want[check.max_logprob_diff_step]
    flips = [t for t, (_, top) in enumerate(steps) if top != want[t]]
    over = [t for t, d in enumerate(diffs) if d > logprob_tol]
    if len(steps) < len(want):
        check.status, check.matched = "mismatch", len(steps)
        check.note = f"only {len(steps)} of {len(want)} steps ran"
    if over:
        t = over[0]
        check.status, check.matched, check.step = "mismatch", t, t
        check.expected, check.got, check.margin = want[t], steps[t][1], entry["steps"][t]["margin"]
        check.note = f"log-prob {diffs[t]:.3g} from the golden one (> {logprob_tol:g}) at step {t}"
    elif flips:
        t = flips[0]
        check.note = (f"greedy would differ at step {t} (golden margin {entry['steps'][t]['margin']:.4g}), "
                      f"log-probs within {logprob_tol:g}")
    return check


def compare(golden: dict, results: Sequence[GenerationResult], logprob_tol: float = 0.05,
            forced: Sequence[Sequence[tuple[list[float], int]]] | None = None) -> CheckReport:
    """Compare results (one per golden prompt, same order) with the golden file. Free-running: tokens one by one,
    a first divergence judged by `_free_running`. Teacher-forced (`forced`: per prompt, per step what
    `_teacher_forced` takes): log-probs of the golden candidates at every step. A result whose logits turned
    non-finite (`nonfinite`) is its own status."""
    entries = golden["prompts"]
    if len(entries) != len(results):
        raise GoldenError(f"the golden file has {len(entries)} prompts but {len(results)} results were given")
    tolerance = float(golden["tolerance"])
    checks = []
    for i, (e, r) in enumerate(zip(entries, results, strict=True)):
        if [int(t) for t in r.prompt_ids] != e["prompt_ids"]:
            check = PromptCheck(id=e["id"], status="mismatch", matched=0, total=len(e["tokens"]),
                                note="prompt ids differ from the recorded ones")
        elif forced is not None:
            check = _teacher_forced(e, forced[i], logprob_tol)
        else:
            check = _free_running(e, r, tolerance, logprob_tol)
        if getattr(r, "nonfinite", None):
            check.status, check.note = "non-finite", r.nonfinite
            check.step = len(r.tokens)
        checks.append(check)
    return CheckReport(checks, tolerance, logprob_tol, forced is not None)


# ---------------------------------------------------------------------------------------------- reporting

_STATUS_STYLE = {
    "match": "[green]match[/]",
    "near-tie": "[yellow]near-tie[/]",
    "mismatch": "[bold red]MISMATCH[/]",
    "non-finite": "[bold red]non-finite[/]",
}


def _token_cell(tok: int | str | None, decode: Callable[[list[int]], str] | None) -> str:
    if tok is None:
        return ""
    if isinstance(tok, str):
        return escape(tok)
    if decode is None:
        return str(tok)
    return f"{tok} {escape(repr(decode([tok])))}"


def render_report(report: CheckReport, console: Console,
                  decode: Callable[[list[int]], str] | None = None) -> None:
    """Print one row per prompt, the notes of the prompts that have one, then a one-line verdict."""
    kind = "teacher-forced" if report.teacher_forced else "free-running"
    table = Table(title=f"golden check ({kind})", title_justify="left")
    for name in ("prompt", "status", "matched", "step", "expected", "got", "margin", "max |dlogp| @step"):
        table.add_column(name, justify="left" if name in ("prompt", "status", "expected", "got") else "right")
    if report.teacher_forced:
        table.add_column("flip", justify="center")
    located = any(p.first_region for p in report.prompts)
    if located:
        table.add_column("first region that differs")
    for p in report.prompts:
        row = [
            escape(p.id),
            _STATUS_STYLE[p.status],
            f"{p.matched}/{p.total}",
            "" if p.step is None else str(p.step),
            _token_cell(p.expected, decode),
            _token_cell(p.got, decode),
            "" if p.margin is None else f"{p.margin:.4g}",
            "" if p.max_logprob_diff is None else f"{p.max_logprob_diff:.1e} @{p.max_logprob_diff_step}",
        ]
        if report.teacher_forced:
            row.append("" if p.greedy_differs is None else "yes" if p.greedy_differs else "no")
        if located:
            row.append(escape(p.first_region or ""))
        table.add_row(*row)
    console.print(table)
    for p in report.prompts:
        if p.note:
            console.print(f"{escape(p.id)}: {escape(p.note)}", soft_wrap=True)
    c = report.counts
    verdict = "[bold green]OK[/]" if report.ok else "[bold red]FAILED[/]"
    console.print(f"{verdict}: {len(report.prompts)} prompts, {c['match']} match, {c['near-tie']} near-tie, "
                  f"{c['mismatch']} mismatch, {c['non-finite']} non-finite ({kind}, log-prob tolerance "
                  f"{report.logprob_tol:g}, near-tie margin tolerance {report.tolerance:g})")


def report_to_json(report: CheckReport) -> dict:
    return {
        "ok": report.ok,
        "teacher_forced": report.teacher_forced,
        "tolerance": report.tolerance,
        "logprob_tol": report.logprob_tol,
        "counts": dict(report.counts),
        "prompts": [
            {"id": p.id, "status": p.status, "matched": p.matched, "total": p.total, "step": p.step,
             "expected": p.expected, "got": p.got, "margin": p.margin, "note": p.note,
             "max_logprob_diff": p.max_logprob_diff, "max_logprob_diff_step": p.max_logprob_diff_step,
             "greedy_differs": p.greedy_differs, "first_region": p.first_region}
            for p in report.prompts
        ],
    }
