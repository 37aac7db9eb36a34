"""Snapshots of one sequence's state: everything a later token can read, copied out of a cache row and back.

V4's state is more than a KV cache, and it cannot be cut back: after N tokens a row holds the window ring (the
last `window` kv entries, slot = position % window), each compressed layer's entries closed so far (N // ratio
of them) with its compressor's open group (and, for the overlapping ratio-4 compressor, the previous group), and
on CSA layers the indexer's keys (N // 4) and its own compressor's state. A later token overwrites ring slots and
closes groups, so the state after M < N tokens cannot be recovered from the state after N: it must have been
copied when the row was at M. `take_snapshot` copies exactly those parts of a row, in the cache's stored formats
(FP8/FP4 codes and scales when the quantisation simulation is on); `restore_snapshot` writes them into a row
(the rest of the row zeroed), after which the row continues at position N exactly as the original did.

A snapshot's tensors are keyed "<ratio>.<root key>" over `Transformer.roots` (ratio 0: window-only layers), each
[L, ...] over the layers of that kind, so a snapshot is as many bytes as the state it copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mhcrun.model import Transformer


@dataclass
class Snapshot:
    """The state of one sequence after `n_tokens` tokens; tensors keyed "<ratio>.<root key>", [L, ...]."""

    n_tokens: int
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def split_key(key: str) -> tuple[int, str]:
    ratio, _, name = key.partition(".")
    return int(ratio), name


def extent(window: int, ratio: int, name: str, n_tokens: int, size: int) -> int:
    """How many of a root buffer's `size` entries along its third dim (after [L, B]) hold state after `n_tokens`
    tokens: the ring and, for compressed kinds, the entries closed so far; the indexer's closed keys; a
    compressor's whole open-group state."""
    root = name.split(".", 1)[0]
    if root == "kv":
        return window + (n_tokens // ratio if ratio else 0)
    if root == "idx_kv":
        return n_tokens // 4
    return size  # comp_* / idx_comp_*: the whole state


def row_extent(model: Transformer, ratio: int, name: str, n_tokens: int) -> int:
    return extent(model.cfg.window_size, ratio, name, n_tokens, model.roots[ratio][name].size(2))


def take_snapshot(model: Transformer, row: int, n_tokens: int) -> Snapshot:
    """Copy the state of cache row `row`, which has run exactly `n_tokens` tokens of its sequence."""
    check_row(model, row)
    if not 0 <= n_tokens <= model.max_seq:
        raise ValueError(f"a snapshot after {n_tokens} tokens does not fit caches of {model.max_seq}")
    tensors = {}
    for ratio, roots in model.roots.items():
        for name, t in roots.items():
            tensors[f"{ratio}.{name}"] = t[:, row, :row_extent(model, ratio, name, n_tokens)].clone()
    return Snapshot(n_tokens, tensors)


def restore_snapshot(model: Transformer, snap: Snapshot, row: int) -> None:
    """Make cache row `row` hold the snapshot's state: the row continues at position `snap.n_tokens` as the
    sequence it was taken from did. Everything else in the row is zeroed (a stale key behind a mask still
    multiplies 0 by its value)."""
    check_row(model, row)
    check_fits(model, snap)
    for ratio, roots in model.roots.items():
        for name, t in roots.items():
            src = snap.tensors[f"{ratio}.{name}"]
            t[:, row].zero_()
            t[:, row, :src.size(1)] = src


def check_row(model: Transformer, row: int) -> None:
    if not 0 <= row < model.max_batch:
        raise ValueError(f"cache row {row} does not exist (caches set up for {model.max_batch} rows)")


def check_fits(model: Transformer, snap: Snapshot) -> None:
    """A snapshot must name exactly the model's state buffers, with their per-row shapes and dtypes."""
    want = {f"{ratio}.{name}": t for ratio, roots in model.roots.items() for name, t in roots.items()}
    if set(want) != set(snap.tensors):
        missing, extra = sorted(set(want) - set(snap.tensors)), sorted(set(snap.tensors) - set(want))
        raise ValueError(f"the snapshot's state does not match this model's (missing {missing}, unexpected {extra})")
    if snap.n_tokens > model.max_seq:
        raise ValueError(f"a snapshot after {snap.n_tokens} tokens does not fit caches of {model.max_seq}")
    for key, src in snap.tensors.items():
        t = want[key]
        ratio, name = split_key(key)
        shape = (t.size(0), row_extent(model, ratio, name, snap.n_tokens), *t.shape[3:])
        if tuple(src.shape) != shape or src.dtype != t.dtype:
            raise ValueError(f"snapshot tensor {key}: {tuple(src.shape)} {src.dtype}, this model's state needs "
                             f"{shape} {t.dtype}")
