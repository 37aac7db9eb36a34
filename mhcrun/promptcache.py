"""Prompt caches on disk (`generate --prompt-cache FILE`, `chat --prompt-cache FILE`): the state after a prompt,
saved so that a later run whose prompt starts with the same tokens prefills only the rest.

The file is safetensors: the snapshot's tensors (`state.<path>`, in the cache's stored formats), `tokens`
(int64, the prompt it holds), `logits` (fp32, the last token's: a prompt equal to the cached one needs no step)
and, saved from a model loaded with its MTP layer (--draft-tokens), that layer's state (`state.mtp.*`) and
pending input (`mtp_streams`, the main model's streams at the last position; `mtp_start` in the metadata). Its
metadata names the format, the model (config and weights hashes, as golden files do) and every run setting that
changes the state (dtype, quantisation simulation, layers, --tp); loading checks each and refuses a file that
differs, naming what differs. A file with the MTP layer's state serves a run without that layer too (its part is
left out); one without it cannot serve a run that drafts. Files are written atomically and never overwritten
without --force.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from mhcrun.errors import InputError
from mhcrun.fileio import write_atomic
from mhcrun.session import Kept, Pending
from mhcrun.snapshot import Snapshot

if TYPE_CHECKING:
    from mhcrun.runner import Runner
    from mhcrun.session import Session

FORMAT = "mhcrun-prompt-cache/1"
STATE = "state."
IDENTITY_KEYS = ("config_hash", "weights_hash")
MTP_STREAMS = "mtp_streams"
MTP_STATE = "mtp."  # the MTP layer's state buffers' paths (`Transformer.state`)


def describe(identity: dict, settings: dict) -> dict[str, str]:
    """The metadata a cache is saved with and checked against: the model's identity and the run's settings."""
    return {"format": FORMAT, "model": str(identity.get("name")),
            **{k: str(identity[k]) for k in IDENTITY_KEYS}, **{f"setting.{k}": str(v) for k, v in settings.items()}}


def save_prompt_cache(path: str | Path, cache: Kept, identity: dict, settings: dict, force: bool = False) -> Path:
    """Write `cache` (the state after a whole prompt: its logits kept) to `path` atomically (refused if it exists,
    unless `force`)."""
    tensors = {STATE + k: t.contiguous() for k, t in cache.snapshot.tensors.items()}
    tensors["tokens"] = torch.tensor(cache.tokens, dtype=torch.int64)
    tensors["logits"] = cache.logits.detach().float().reshape(-1).contiguous()
    meta = describe(identity, settings) | {"n_tokens": str(cache.snapshot.n_tokens)}
    if cache.pending is not None:
        tensors[MTP_STREAMS] = cache.pending.streams.contiguous()
        meta["mtp_start"] = str(cache.pending.start)
    return write_atomic(path, save_bytes(tensors, meta), force)


def load_prompt_cache(path: str | Path, identity: dict, settings: dict, mtp: bool = False) -> Kept:
    """Read a prompt cache, refusing (InputError naming the file) one that is not a whole safetensors file of
    this format, or that was saved for another model or with other settings. `mtp`: the run's model has its MTP
    layer (the file must hold that layer's state; without, a file's MTP state is left out)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise InputError(f"prompt cache {p}: cannot read ({e.strerror or e})") from None
    meta = read_metadata(p, data)
    if meta.get("format") != FORMAT:
        raise InputError(f"prompt cache {p}: not an mhcrun prompt cache (format {meta.get('format')!r}, "
                         f"expected {FORMAT!r})")
    want = describe(identity, settings)
    for key in (*IDENTITY_KEYS, *(k for k in want if k.startswith("setting."))):
        if meta.get(key) != want[key]:
            what = key.removeprefix("setting.")
            raise InputError(f"prompt cache {p}: saved with {what} {meta.get(key)} (model {meta.get('model')}), this "
                             f"run has {want[key]}")
    try:
        tensors = load_bytes(data)
    except (SafetensorError, ValueError) as e:
        raise InputError(f"prompt cache {p}: corrupt ({e})") from None
    if "tokens" not in tensors or "logits" not in tensors:
        raise InputError(f"prompt cache {p}: corrupt (no tokens or logits)")
    tokens = tensors.pop("tokens").tolist()
    n = meta_int(meta, "n_tokens")
    if n != len(tokens) or n < 1:
        raise InputError(f"prompt cache {p}: corrupt ({len(tokens)} tokens, metadata says {n})")
    logits = tensors.pop("logits")
    pending = None
    if MTP_STREAMS in tensors:
        start = meta_int(meta, "mtp_start")
        streams = tensors.pop(MTP_STREAMS)
        if start < 0 or start + streams.size(0) != n:
            raise InputError(f"prompt cache {p}: corrupt (the MTP layer's input at {start} does not end at token {n})")
        pending = Pending(start, streams)
    if mtp and pending is None:
        raise InputError(f"prompt cache {p}: saved without the MTP layer's state, which --draft-tokens needs (give "
                         f"another file, or run without --draft-tokens)")
    state = {k.removeprefix(STATE): t for k, t in tensors.items()
             if k.startswith(STATE) and (mtp or not k.startswith(STATE + MTP_STATE))}
    return Kept(tokens, Snapshot(n, state), logits, pending if mtp else None)


def meta_int(meta: dict[str, str], key: str) -> int:
    """An integer in the metadata (-1 where it is missing or not one)."""
    value = meta.get(key, "")
    return int(value) if value.isdigit() else -1


def read_metadata(p: Path, data: bytes) -> dict[str, str]:
    """The safetensors header's metadata, after checking that the bytes are a whole safetensors file."""
    if len(data) < 8:
        raise InputError(f"prompt cache {p}: not a safetensors file ({len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise InputError(f"prompt cache {p}: not a safetensors file, or truncated (a header of {n} bytes in a file "
                         f"of {len(data)})")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InputError(f"prompt cache {p}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise InputError(f"prompt cache {p}: not a safetensors file (its header is not a JSON object)")
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
            and "data_offsets" in v]
    if 8 + n + max(ends, default=0) != len(data):
        raise InputError(f"prompt cache {p}: truncated or corrupt ({len(data)} bytes, its header describes "
                         f"{8 + n + max(ends, default=0)})")
    meta = header.get("__metadata__") or {}
    return meta if isinstance(meta, dict) else {}


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run_settings(runner: Runner) -> dict:
    """The run settings that change the state a prompt cache holds."""
    return {"dtype": runner.dtype, "quant_sim": runner.quant_sim, "layers": runner.n_layers, "tp": runner.tp.world}


def open_prompt_cache(runner: Runner, path: Path, ids: list[int] | None = None) -> Kept | None:
    """The prompt cache at `path` (None when there is none), checked against this model and these settings, and
    with `ids` against the prompt, which must start with the cached tokens."""
    if not path.exists():
        return None
    cache = load_prompt_cache(path, runner.identity, run_settings(runner), mtp=runner.mtp)
    n = shared_prefix(cache.tokens, ids) if ids is not None else len(cache.tokens)
    if n < len(cache.tokens):
        raise InputError(f"prompt cache {path}: this prompt does not start with its {len(cache.tokens)} tokens "
                         f"(they part at token {n}); give another file, or delete it to cache this prompt")
    return cache


def save_new_prompt_cache(runner: Runner, path: Path, session: Session, ids: list[int]) -> bool:
    """Write the state after the prompt `ids` (the session's snapshot of it) to `path` when no file is there
    (rank 0 writes under --tp) -> whether it was written."""
    kept = next((k for k in session.kept if k.tokens == ids and k.logits is not None), None)
    if path.exists() or kept is None:
        return False
    if runner.tp.rank == 0:
        save_prompt_cache(path, kept, runner.identity, run_settings(runner))
    return True
