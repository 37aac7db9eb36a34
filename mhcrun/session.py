"""One sequence kept between runs: a cache row, the tokens its state holds, and snapshots to go back to.

`Session.prefill(ids)` makes the row hold `ids` running as few tokens as it can. If the row's live state holds a
prefix of `ids`, only the rest runs. Otherwise (V4's state cannot be cut back: see `mhcrun.snapshot`) it restores
the longest snapshot whose tokens start `ids` and runs from there, or starts afresh. Prefilling takes snapshots at
the `marks` the caller names (a chat turn marks where the next turn's rendering of the history will part from this
prompt) and after the whole prompt (with its last logits, so the same prompt again needs no step).

A prefill split at a mark runs the same tokens in other chunks than one unsplit prefill, so its logits equal an
unsplit run's within the last bits of a GEMM, not bit for bit; a restore equals, bit for bit, running on from the
point it was taken.

A model loaded with its MTP layer (speculative decoding, `mhcrun.speculate`) keeps that layer's state in the row
too. The MTP layer at position t takes the main model's streams at t and the token at t + 1, so it runs a position
behind: after N tokens it has run positions 0 .. N - 2, and the main model's streams at N - 1 wait in `pending`
for the next token. The session's live state, each snapshot and each prompt cache file carry that pending input
with the row's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mhcrun.model import Transformer
from mhcrun.snapshot import Snapshot, restore_snapshot, take_snapshot

KEEP = 8  # snapshots a session keeps (the newest); each is the state after its tokens, no more


@dataclass
class Pending:
    """The MTP layer's inputs not yet run in a row: the main model's streams [m, n, d] (pre-head) at positions
    start .. start + m - 1, and the tokens one ahead of them as far as they are known (`tokens`, at most m)."""

    start: int
    streams: torch.Tensor
    tokens: list[int] = field(default_factory=list)

    def after(self, streams: torch.Tensor) -> Pending:
        """These inputs followed by the streams [s, n, d] of the next s positions."""
        return Pending(self.start, torch.cat([self.streams, streams]), list(self.tokens))


@dataclass
class Kept:
    """The state after `tokens` (a snapshot, or a prompt cache file's)."""

    tokens: list[int]
    snapshot: Snapshot
    logits: torch.Tensor | None = None  # [V] after the last of `tokens`, when taken at the end of a prompt
    pending: Pending | None = None  # the MTP layer's input at the last position, when the model has that layer


@dataclass
class Session:
    """Cache row `row` of `model` (caches already set up) as one sequence across runs."""

    model: Transformer
    chunk: int
    row: int = 0
    tokens: list[int] = field(default_factory=list)  # what the row's live state holds ([] when unknown)
    pending: Pending | None = None  # with an MTP layer: its input not yet run (positions len(tokens) - m ..)
    kept: list[Kept] = field(default_factory=list)
    reused: int = 0  # of the last prefill: tokens whose state was reused, and tokens run
    prefilled: int = 0

    def reset(self) -> None:
        """Forget the sequence and its snapshots."""
        self.tokens, self.pending, self.kept = [], None, []

    @property
    def mtp(self) -> bool:
        """Whether the row also holds the MTP layer's state."""
        return len(self.model.mtp) > 0

    def lose_live_state(self) -> None:
        """The row's state is no longer known (a step was interrupted): only snapshots can be reused."""
        self.tokens, self.pending = [], None

    def keep(self, kept: Kept) -> None:
        """Hold a snapshot for later prefills (one given from outside, e.g. a prompt cache file). With an MTP layer
        it must carry that layer's pending input."""
        if self.mtp and kept.pending is None:
            raise ValueError("a session of a model with its MTP layer keeps only snapshots with its pending input")
        self.kept = [k for k in self.kept if k.tokens != kept.tokens][-(KEEP - 1):] + [kept]

    def fed(self, tokens: list[int], pending: Pending | None = None) -> None:
        """Decode ran these tokens through the row after the prompt; with an MTP layer, `pending` is that layer's
        input left after them (without it the row's MTP state is not known: the live state is lost)."""
        if not tokens:
            return
        if self.mtp and pending is None:
            self.lose_live_state()
            return
        self.tokens, self.pending = self.tokens + list(tokens), pending

    @torch.inference_mode()
    def prefill(self, ids: list[int], marks: tuple[int, ...] = ()) -> torch.Tensor:
        """Make the row hold `ids` -> logits [1, V] of the last token. Sets `reused` and `prefilled`."""
        if not ids:
            raise ValueError("a session prefills at least one token")
        n, logits = self.resume(ids)
        self.reused, self.prefilled = n, len(ids) - n
        stops = sorted({m for m in marks if n < m < len(ids)} | {len(ids)})
        dev = self.model.device
        rows = torch.tensor([self.row], device=dev)
        for stop in stops if n < len(ids) else []:
            for c0 in range(n, stop, self.chunk):
                c1 = min(c0 + self.chunk, stop)
                logits, streams = self.model(torch.tensor([ids[c0:c1]], device=dev), rows,
                                             torch.tensor([c0], device=dev), streams=True)
                if self.mtp:
                    self.pending = advance_mtp(self.model, ids, self.pending.after(streams[0]), self.row, stop)
            n = stop
            self.keep(Kept(ids[:stop], take_snapshot(self.model, self.row, stop),
                           logits[0] if stop == len(ids) else None, self.pending))
        self.tokens = list(ids)
        return logits

    def resume(self, ids: list[int]) -> tuple[int, torch.Tensor | None]:
        """Bring the row to the longest prefix of `ids` it can reach without running a token -> (its length, the
        logits [1, V] after it when `ids` is reached whole, else None)."""
        live = len(self.tokens) if self.tokens and self.tokens == ids[:len(self.tokens)] else 0
        if live == len(ids):
            live = 0  # the live state ran past the logits of its last token: go back to a snapshot
        best = max((k for k in self.kept if k.tokens == ids[:len(k.tokens)]
                    and (len(k.tokens) < len(ids) or k.logits is not None)), key=lambda k: len(k.tokens), default=None)
        if best is not None and len(best.tokens) > live:
            restore_snapshot(self.model, best.snapshot, self.row)
            self.pending = best.pending
            if len(best.tokens) == len(ids):
                return len(ids), best.logits.view(1, -1)
            return len(best.tokens), None
        if live:
            return live, None
        self.model.clear_row(self.row)  # a fresh sequence: nothing stale behind a mask
        self.pending = no_pending(self.model) if self.mtp else None
        return 0, None


def no_pending(model: Transformer) -> Pending:
    """A new sequence's MTP input: nothing yet."""
    return Pending(0, torch.empty(0, model.cfg.hc_mult, model.cfg.dim, dtype=model.dtype, device=model.device))


def advance_mtp(model: Transformer, ids: list[int], pending: Pending, row: int, stop: int) -> Pending:
    """Run `model`'s MTP layer in cache row `row` over the pending positions whose next token is among ids[:stop]
    (a state after ids[:stop] holds no later token) -> the inputs left pending (the last position's, at least)."""
    m = min(pending.streams.size(0), stop - 1 - pending.start)
    if m > 0:
        dev = model.device
        model.mtp[0](model, pending.streams[None, :m], torch.tensor([ids[pending.start + 1:pending.start + 1 + m]],
                     device=dev), torch.tensor([row], device=dev), torch.tensor([pending.start], device=dev))
    return Pending(pending.start + m, pending.streams[m:].clone())  # not a view that holds a chunk's streams
