"""One sequence kept between runs: a cache row, the tokens its state holds, and snapshots to go back to.

`Session.prefill(ids)` makes the row hold `ids` running as few tokens as it can. If the row's live state holds a
prefix of `ids`, only the rest runs. Otherwise (V4's state cannot be cut back: see `mhcrun.snapshot`) it restores
the longest snapshot whose tokens start `ids` and runs from there, or starts afresh. Prefilling takes snapshots at
the `marks` the caller names (a chat turn marks where the next turn's rendering of the history will part from this
prompt) and after the whole prompt (with its last logits, so the same prompt again needs no step).

A prefill split at a mark runs the same tokens in other chunks than one unsplit prefill, so its logits equal an
unsplit run's within the last bits of a GEMM, not bit for bit; a restore equals, bit for bit, running on from the
point it was taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mhcrun.model import Transformer
from mhcrun.snapshot import Snapshot, restore_snapshot, take_snapshot

KEEP = 8  # snapshots a session keeps (the newest); each is the state after its tokens, no more


@dataclass
class Kept:
    tokens: list[int]
    snapshot: Snapshot
    logits: torch.Tensor | None = None  # [V] after the last of `tokens`, when taken at the end of a prompt


@dataclass
class Session:
    """Cache row `row` of `model` (caches already set up) as one sequence across runs."""

    model: Transformer
    chunk: int
    row: int = 0
    tokens: list[int] = field(default_factory=list)  # what the row's live state holds ([] when unknown)
    kept: list[Kept] = field(default_factory=list)
    reused: int = 0  # of the last prefill: tokens whose state was reused, and tokens run
    prefilled: int = 0

    def reset(self) -> None:
        """Forget the sequence and its snapshots."""
        self.tokens, self.kept = [], []

    def lose_live_state(self) -> None:
        """The row's state is no longer known (a step was interrupted): only snapshots can be reused."""
        self.tokens = []

    def keep(self, tokens: list[int], snapshot: Snapshot, logits: torch.Tensor | None = None) -> None:
        """Hold a snapshot for later prefills (one given from outside, e.g. a prompt cache file)."""
        self.kept = [k for k in self.kept if k.tokens != tokens][-(KEEP - 1):] + [Kept(list(tokens), snapshot, logits)]

    def fed(self, tokens: list[int]) -> None:
        """Decode ran these tokens through the row after the prompt."""
        self.tokens = self.tokens + list(tokens)

    @torch.inference_mode()
    def prefill(self, ids: list[int], marks: tuple[int, ...] = ()) -> torch.Tensor:
        """Make the row hold `ids` -> logits [1, V] of the last token. Sets `reused` and `prefilled`."""
        if not ids:
            raise ValueError("a session prefills at least one token")
        n, logits = self.resume(ids)
        self.reused, self.prefilled = n, len(ids) - n
        stops = sorted({m for m in marks if n < m < len(ids)} | {len(ids)})
        rows = torch.tensor([self.row], device=self.model.device)
        for stop in stops if n < len(ids) else []:
            for c0 in range(n, stop, self.chunk):
                part = torch.tensor([ids[c0:min(c0 + self.chunk, stop)]], device=self.model.device)
                logits = self.model(part, rows, torch.tensor([c0], device=self.model.device))
            n = stop
            self.keep(ids[:stop], take_snapshot(self.model, self.row, stop), logits[0] if stop == len(ids) else None)
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
            if len(best.tokens) == len(ids):
                return len(ids), best.logits.view(1, -1)
            return len(best.tokens), None
        if live:
            return live, None
        self.model.clear_row(self.row)  # a fresh sequence: nothing stale behind a mask
        return 0, None
