"""Prompts: a JSON Lines prompts file and the `--prompt-ids` flag.

Each non-blank line of a prompts file is one JSON object with exactly one of
  "prompt":     text, tokenized by the runner (BOS prepended), or
  "prompt_ids": a list of non-negative token ids, fed to the model exactly as given (no BOS added),
and optionally "id" (a non-empty string; default "p<N>", N the 0-based index of the prompt in the file).
Other keys are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mhcrun.errors import InputError
from mhcrun.fileio import read_text


@dataclass
class Prompt:
    id: str
    text: str | None
    ids: list[int] | None


def _check_ids(value: Any, vocab_size: int | None) -> str | None:
    """Why `value` is not a usable list of token ids, or None when it is."""
    if not isinstance(value, list):
        return f"'prompt_ids' must be a list of token ids, got {type(value).__name__}"
    if not value:
        return "'prompt_ids' is empty"
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            return f"'prompt_ids'[{i}] = {json.dumps(v)} is not a non-negative integer"
        if vocab_size is not None and v >= vocab_size:
            return f"'prompt_ids'[{i}] = {v} is outside the vocabulary (size {vocab_size})"
    return None


def read_prompts_file(path: str | Path, vocab_size: int | None = None) -> list[Prompt]:
    """Read a JSON Lines prompts file; any problem raises InputError naming the file and line."""
    p = Path(path)
    lines = read_text(p, InputError, "prompts file").splitlines()

    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{p}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        has_text, has_ids = "prompt" in obj, "prompt_ids" in obj
        if has_text == has_ids:
            which = "both" if has_text else "neither"
            raise InputError(f"{where}: each line needs exactly one of 'prompt' or 'prompt_ids' "
                             f"(found {which})")
        text: str | None = None
        ids: list[int] | None = None
        if has_text:
            text = obj["prompt"]
            if not isinstance(text, str):
                raise InputError(f"{where}: 'prompt' must be a string, got {type(text).__name__}")
        else:
            why = _check_ids(obj["prompt_ids"], vocab_size)
            if why:
                raise InputError(f"{where}: {why}")
            ids = list(obj["prompt_ids"])
        pid = obj.get("id", f"p{len(prompts)}")
        if not isinstance(pid, str) or not pid:
            raise InputError(f"{where}: 'id' must be a non-empty string, got {json.dumps(pid)}")
        if pid in seen:
            raise InputError(f"{where}: duplicate id {pid!r} (first used on line {seen[pid]})")
        seen[pid] = lineno
        prompts.append(Prompt(id=pid, text=text, ids=ids))
    if not prompts:
        raise InputError(f"{p}: no prompts (the file is empty)")
    return prompts


def parse_prompt_ids(s: str, vocab_size: int | None = None) -> list[int]:
    """Parse a flag value like "1,2,3" (spaces allowed) into token ids."""
    parts = [part.strip() for part in s.split(",")]
    if not s.strip():
        raise InputError("--prompt-ids: empty (expected comma-separated token ids, e.g. 0,15,27)")
    ids: list[int] = []
    for i, part in enumerate(parts):
        if not part:
            raise InputError(f"--prompt-ids: empty entry at position {i + 1} in {s!r}")
        if not part.isascii() or not part.isdigit():
            raise InputError(f"--prompt-ids: {part!r} is not a non-negative integer")
        v = int(part)
        if vocab_size is not None and v >= vocab_size:
            raise InputError(f"--prompt-ids: {v} is outside the vocabulary (size {vocab_size})")
        ids.append(v)
    return ids
