"""Snapshots of one sequence's state: everything a later token can read, copied out of a cache row and back.

V4's state is more than a KV cache, and it cannot be cut back: after N tokens a row holds the window ring (the
last `window` kv entries, slot = position % window), each compressed layer's entries closed so far (N // ratio
of them) with its compressor's open group (and, for the overlapping ratio-4 compressor, the previous group), and
on CSA layers the indexer's keys (N // 4) and its own compressor's state. A later token overwrites ring slots and
closes groups, so the state after M < N tokens cannot be recovered from the state after N: it must have been
copied when the row was at M. `take_snapshot` copies exactly those parts of a row, in the cache's stored formats
(FP8/FP4 codes and scales when the quantisation simulation is on); `restore_snapshot` writes them into a row
(the rest of the row zeroed), after which the row continues at position N exactly as the original did.

A snapshot's tensors are keyed by the state buffers' paths (`Transformer.state()`: `layers.1.attn.ring.fp8`,
`layers.1.attn.compressor.cache.fp8`, ...), each one row's [n, ...], so a snapshot is as many bytes as the state
it copies.

Span snapshots (speculative decoding, `mhcrun.speculate`): `take_span` copies only what one chunk of a few tokens
per row can change (its ring slots, the compressors' open groups, the entries it can close); `restore_span` puts
it back, and `rewind_span` leaves the state after the chunk's first tokens only (the compressors having kept the
chunk's kv and score, `keep_chunks`), without running them again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mhcrun.model import Attention, Compressor, Transformer
from mhcrun.ops.compress import compress_chunk


@dataclass
class Snapshot:
    """The state of one sequence after `n_tokens` tokens; tensors keyed "<ratio>.<root key>", [L, ...]."""

    n_tokens: int
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def state_extents(module: nn.Module, n_tokens: int) -> dict[str, int]:
    """How many entries (along dim 1 of a state buffer [B, n, ...]) hold state after `n_tokens` tokens, for the
    buffers that hold less than their whole length: each compressor's closed entries (n_tokens // ratio; the
    indexer's keys are its compressor's). The ring (the window) and the compressors' open-group state are whole."""
    return {f"{name}.cache.{part}": n_tokens // m.ratio for name, m in module.named_modules()
            if isinstance(m, Compressor) for part in m.cache.parts()}


def take_snapshot(model: Transformer, row: int, n_tokens: int) -> Snapshot:
    """Copy the state of cache row `row`, which has run exactly `n_tokens` tokens of its sequence."""
    check_row(model, row)
    if not 0 <= n_tokens <= model.max_seq:
        raise ValueError(f"a snapshot after {n_tokens} tokens does not fit caches of {model.max_seq}")
    extents = state_extents(model, n_tokens)
    return Snapshot(n_tokens, {path: t[row, :extents.get(path, t.size(1))].clone()
                               for path, t in model.state().items()})


def restore_snapshot(model: Transformer, snap: Snapshot, row: int) -> None:
    """Make cache row `row` hold the snapshot's state: the row continues at position `snap.n_tokens` as the
    sequence it was taken from did. Everything else in the row is zeroed (a stale key behind a mask still
    multiplies 0 by its value)."""
    check_row(model, row)
    check_fits(model, snap)
    for path, t in model.state().items():
        src = snap.tensors[path]
        t[row].zero_()
        t[row, :src.size(0)] = src


@dataclass
class SpanSnapshot:
    """What a chunk of `length` tokens per row at positions start [b] + [0, length) can change in cache rows
    `rows` [b] of a module's state (a speculative verify step, `mhcrun.speculate`): per state buffer path (as in
    `named_buffers`), the slots along dim 1 it copied (`index` [b, m], None: the whole row) and their values."""

    rows: torch.Tensor
    index: dict[str, torch.Tensor | None]
    tensors: dict[str, torch.Tensor]


def span_slots(module: nn.Module, start: torch.Tensor, length: int) -> dict[str, torch.Tensor | None]:
    """Per state buffer of `module`, the slots [b, m] a chunk of `length` tokens at start [b] writes: the ring's
    slots of those positions (length <= window), each compressor's open-group state whole (None) and the entries
    the chunk can close (position // ratio for its positions: start // ratio + [0, length // ratio + 1), the
    spare last slot past the end)."""
    out: dict[str, torch.Tensor | None] = {}
    steps = torch.arange(length, device=start.device)
    for name, m in module.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(m, Attention):
            if length > m.window:
                raise ValueError(f"a span of {length} tokens is longer than the window ring of {m.window}")
            slots = (start.view(-1, 1) + steps) % m.window
            out.update({f"{prefix}ring.{p}": slots for p in m.ring.parts()})
        elif isinstance(m, Compressor):
            out[f"{prefix}kv_state"] = out[f"{prefix}score_state"] = None
            entries = start.view(-1, 1) // m.ratio + torch.arange(length // m.ratio + 1, device=start.device)
            out.update({f"{prefix}cache.{p}": entries.clamp(max=m.n_entries) for p in m.cache.parts()})
    return out


def take_span(module: nn.Module, rows: torch.Tensor, start: torch.Tensor, length: int) -> SpanSnapshot:
    """Copy what a chunk of `length` tokens at start [b] can change in cache rows `rows` [b] of `module`'s state
    (`span_slots`): far fewer bytes than a whole row's `take_snapshot`. Raises when a buffer is not one of the
    kinds it knows (every state buffer must be covered)."""
    index = span_slots(module, start, length)
    buffers = dict(module.named_buffers())
    if set(buffers) != set(index):
        raise ValueError(f"take_span: state buffers it does not know: {sorted(set(buffers) - set(index))}")
    tensors = {p: (t[rows] if index[p] is None else t[rows.view(-1, 1), index[p]]).clone()
               for p, t in buffers.items()}
    return SpanSnapshot(rows, index, tensors)


def restore_span(module: nn.Module, snap: SpanSnapshot, which: torch.Tensor | None = None) -> None:
    """Write the span's copies back into their rows (`which` [b] bool: only those of `snap.rows`): the rows hold
    the state they had before the chunk, as if it had never run."""
    keep = slice(None) if which is None else which
    rows = snap.rows[keep]
    for p, t in module.named_buffers():
        idx = snap.index[p]
        if idx is None:
            t[rows] = snap.tensors[p][keep]
        else:
            t[rows.view(-1, 1), idx[keep]] = snap.tensors[p][keep]


def keep_chunks(module: nn.Module, keep: bool) -> None:
    """Make `module`'s compressors keep (or stop keeping) each chunk's kv and score, for `rewind_span`."""
    for m in module.modules():
        if isinstance(m, Compressor):
            m.keep_chunk, m.chunk = keep, None


def keep_rows(module: nn.Module, rows: torch.Tensor) -> None:
    """The chunks `module`'s compressors kept, cut to the batch entries `rows` [b] (a chunk run over every cache
    row, whose span covers some of them)."""
    for m in module.modules():
        if isinstance(m, Compressor) and m.chunk is not None:
            m.chunk = (m.chunk[0][rows], m.chunk[1][rows])


def rewind_span(module: nn.Module, snap: SpanSnapshot, start: torch.Tensor, kept: torch.Tensor,
                which: torch.Tensor) -> None:
    """After a chunk at start [b] ran in the span's rows with its compressors keeping their chunk (`keep_chunks`):
    make the rows in `which` [b] hold the state after only the chunk's first kept [b] tokens, without running
    them again. The ring slots and the entries of the positions past the kept ones get their copies back; what
    the kept tokens wrote stays (a position's kv and the groups it closes depend on nothing after it); each
    compressor's open-group state is rebuilt from its copy and the kept tokens' kv and score
    (`compress_chunk`, as the kept prefix alone would have left it)."""
    rows = snap.rows
    buffers = dict(module.named_buffers())
    owners = {name: m for name, m in module.named_modules()}
    for path, idx in snap.index.items():
        if idx is None:
            continue
        owner = owners[path.rsplit(".", 2)[0]]
        if isinstance(owner, Compressor):  # entry e is closed at position (e + 1) * ratio - 1
            back = (idx + 1) * owner.ratio - 1 >= (start + kept).view(-1, 1)
        else:  # ring slot of position start + j
            back = torch.arange(idx.size(1), device=idx.device) >= kept.view(-1, 1)
        back = back & which.view(-1, 1)
        t = buffers[path]
        now = t[rows.view(-1, 1), idx]
        mask = back.view(*back.shape, *([1] * (now.dim() - 2)))
        t[rows.view(-1, 1), idx] = torch.where(mask, snap.tensors[path], now)
    for name, m in module.named_modules():
        if not isinstance(m, Compressor) or not bool(which.any()):
            continue
        if m.chunk is None:
            raise ValueError(f"rewind_span: compressor {name} kept no chunk (keep_chunks before the chunk)")
        kv, score = m.chunk
        prefix = f"{name}." if name else ""
        for n in kept[which].unique().tolist():
            sel = which & (kept == n)
            r, fresh = rows[sel], (start[sel] == 0).view(-1, 1, 1)  # as Compressor.forward: a new sequence
            kv_state = snap.tensors[f"{prefix}kv_state"][sel].masked_fill(fresh, 0.0)
            score_state = snap.tensors[f"{prefix}score_state"][sel].masked_fill(fresh, float("-inf"))
            state = compress_chunk(kv_state, score_state, kv[sel, :n], score[sel, :n], start[sel], m.ratio, m.overlap)
            m.kv_state[r], m.score_state[r] = state[3], state[4]


def check_row(model: Transformer, row: int) -> None:
    if not 0 <= row < model.max_batch:
        raise ValueError(f"cache row {row} does not exist (caches set up for {model.max_batch} rows)")


def check_fits(model: Transformer, snap: Snapshot) -> None:
    """A snapshot must name exactly the model's state buffers, with their per-row shapes and dtypes."""
    want = model.state()
    if set(want) != set(snap.tensors):
        missing, extra = sorted(set(want) - set(snap.tensors)), sorted(set(snap.tensors) - set(want))
        raise ValueError(f"the snapshot's state does not match this model's (missing {missing}, unexpected {extra})")
    if snap.n_tokens > model.max_seq:
        raise ValueError(f"a snapshot after {snap.n_tokens} tokens does not fit caches of {model.max_seq}")
    extents = state_extents(model, snap.n_tokens)
    for key, src in snap.tensors.items():
        t = want[key]
        shape = (extents.get(key, t.size(1)), *t.shape[2:])
        if tuple(src.shape) != shape or src.dtype != t.dtype:
            raise ValueError(f"snapshot tensor {key}: {tuple(src.shape)} {src.dtype}, this model's state needs "
                             f"{shape} {t.dtype}")
