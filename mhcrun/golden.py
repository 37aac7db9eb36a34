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
from mhcrun.fileio import write_atomic
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
    if p.is_dir():
        raise GoldenError(f"{p}: is a directory, not a golden file")
    if not p.is_file():
        raise GoldenError(f"{p}: golden file not found")
    try:
        raw = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise GoldenError(f"{p}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise GoldenError(f"{p}: cannot read ({e.strerror or e})") from None
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


# ---------------------------------------------------------------------------------------------- comparing


@dataclass
class PromptCheck:
    id: str
    status: str  # "match" | "near-tie" | "mismatch"
    matched: int  # leading tokens equal to the golden ones
    total: int  # golden token count
    step: int | None = None  # first divergence step
    expected: int | str | None = None  # golden token there, or END
    got: int | str | None = None  # this run's token there, or END
    margin: float | None = None  # golden top-1 minus top-2 logit at that step
    note: str | None = None


@dataclass
class CheckReport:
    prompts: list[PromptCheck]
    tolerance: float
    counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.counts = {s: sum(p.status == s for p in self.prompts) for s in ("match", "near-tie", "mismatch")}

    @property
    def ok(self) -> bool:
        return self.counts["mismatch"] == 0


def _compare_one(entry: dict, res: GenerationResult, tolerance: float) -> PromptCheck:
    want: list[int] = entry["tokens"]
    got = [int(t) for t in res.tokens]
    check = PromptCheck(id=entry["id"], status="match", matched=0, total=len(want))
    if [int(t) for t in res.prompt_ids] != entry["prompt_ids"]:
        check.status = "mismatch"
        check.note = "prompt ids differ from the recorded ones"
        return check
    n = 0
    while n < len(want) and n < len(got) and want[n] == got[n]:
        n += 1
    check.matched = n
    if n == len(want) and n == len(got):
        return check
    check.step = n
    check.expected = want[n] if n < len(want) else END
    check.got = got[n] if n < len(got) else END
    check.margin = entry["steps"][n]["margin"] if n < len(want) else None
    both_tokens = isinstance(check.expected, int) and isinstance(check.got, int)
    if both_tokens and check.margin is not None and check.margin < tolerance:
        check.status = "near-tie"
        check.note = f"golden margin {check.margin:.4g} < tolerance {tolerance:g}; later tokens not compared"
    else:
        check.status = "mismatch"
        if check.got == END:
            check.note = "this run ended early"
        elif check.expected == END:
            check.note = "this run generated more tokens"
    return check


def compare(golden: dict, results: Sequence[GenerationResult]) -> CheckReport:
    """Compare results (one per golden prompt, same order) with the golden tokens."""
    entries = golden["prompts"]
    if len(entries) != len(results):
        raise GoldenError(f"the golden file has {len(entries)} prompts but {len(results)} results were given")
    tolerance = float(golden["tolerance"])
    checks = [_compare_one(e, r, tolerance) for e, r in zip(entries, results, strict=True)]
    return CheckReport(checks, tolerance)


# ---------------------------------------------------------------------------------------------- reporting

_STATUS_STYLE = {
    "match": "[green]match[/]",
    "near-tie": "[yellow]near-tie[/]",
    "mismatch": "[bold red]MISMATCH[/]",
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
    """Print one row per prompt, then a one-line verdict."""
    table = Table(title="golden check", title_justify="left")
    table.add_column("prompt")
    table.add_column("status")
    table.add_column("matched", justify="right")
    table.add_column("step", justify="right")
    table.add_column("expected")
    table.add_column("got")
    table.add_column("margin", justify="right")
    for p in report.prompts:
        table.add_row(
            escape(p.id),
            _STATUS_STYLE[p.status],
            f"{p.matched}/{p.total}",
            "" if p.step is None else str(p.step),
            _token_cell(p.expected, decode),
            _token_cell(p.got, decode) if p.note is None or p.step is not None else escape(p.note),
            "" if p.margin is None else f"{p.margin:.4g}",
        )
    console.print(table)
    c = report.counts
    verdict = "[bold green]OK[/]" if report.ok else "[bold red]FAILED[/]"
    console.print(f"{verdict}: {len(report.prompts)} prompts, {c['match']} match, {c['near-tie']} near-tie, "
                  f"{c['mismatch']} mismatch (near-tie tolerance {report.tolerance:g})")


def report_to_json(report: CheckReport) -> dict:
    return {
        "ok": report.ok,
        "tolerance": report.tolerance,
        "counts": dict(report.counts),
        "prompts": [
            {"id": p.id, "status": p.status, "matched": p.matched, "total": p.total, "step": p.step,
             "expected": p.expected, "got": p.got, "margin": p.margin, "note": p.note}
            for p in report.prompts
        ],
    }
