"""Looking inside a forward: probes that watch each region's output (`mhcrun.model.Probe`).

A region is what compiled regions compile one graph for: a layer's attention half or MoE half, or the head
(the embedding's mHC expand is reported as "embed"). The eager model and the compiled regions call a probe with
the same names, so one path can be checked, or two paths compared, region by region:
- `FirstNonFinite`: the first region whose output holds NaN or Inf (its input was finite, or an earlier region
  would have been named);
- `first_nonfinite_op`: forward hooks on the eager model's modules, naming the first module that made a
  non-finite value from finite inputs;
- `Capture` and `first_difference`: the outputs of every region, and the first region where two runs differ.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn


def nonfinite_kind(t: torch.Tensor) -> str | None:
    """"NaN" or "Inf" when t holds one (NaN first), else None."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        return "NaN" if bool(torch.isnan(t).any()) else "Inf"
    return None


@dataclass
class FirstNonFinite:
    """A probe (of one row: `generate.row_probe`) that remembers the first region, in run order, whose output
    is not finite, and at which step."""

    region: str | None = None
    kind: str | None = None
    step: int | None = None
    current_step: int = 0

    def __call__(self, name: str, t: torch.Tensor) -> None:
        if self.region is None and (kind := nonfinite_kind(t)) is not None:
            self.region, self.kind, self.step = name, kind, self.current_step


@dataclass
class OpWatch:
    """Forward hooks on every module of a model: the first module that produced a non-finite output from finite
    tensor inputs, named by its path in the model (`layers.1.attn.wq_a`) and class."""

    first: str | None = None

    def hook(self, name: str):
        def check(module: nn.Module, args: tuple, output) -> None:
            if self.first is not None:
                return
            outs = output if isinstance(output, (tuple, list)) else (output,)
            kinds = [k for o in outs if isinstance(o, torch.Tensor) and (k := nonfinite_kind(o))]
            if kinds and all(nonfinite_kind(a) is None for a in args if isinstance(a, torch.Tensor)):
                self.first = f"{name} ({type(module).__name__})"

        return check


@contextlib.contextmanager
def first_nonfinite_op(model: nn.Module) -> Iterator[OpWatch]:
    """Watch every submodule of `model` while the block runs (eager paths only: compiled graphs call no hooks)."""
    watch = OpWatch()
    handles = [m.register_forward_hook(watch.hook(name)) for name, m in model.named_modules() if name]
    try:
        yield watch
    finally:
        for h in handles:
            h.remove()


@dataclass
class Capture:
    """A probe (of one row) that keeps the output of every region while `on` (a step's forwards; prefill
    chunks are joined along the sequence)."""

    on: bool = False
    outputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def __call__(self, name: str, t: torch.Tensor) -> None:
        if self.on:
            self.outputs.setdefault(name, []).append(t[0].detach().float().cpu().clone())

    def joined(self) -> dict[str, torch.Tensor]:
        return {name: torch.cat([t if t.dim() > 1 else t.view(1, -1) for t in ts]) for name, ts in
                self.outputs.items()}


@dataclass
class RegionDiff:
    region: str
    max_abs: float  # max |test - reference| over the region's output
    rel: float  # max_abs / max |reference|


def region_diffs(reference: dict[str, torch.Tensor], test: dict[str, torch.Tensor]) -> list[RegionDiff]:
    """Per region, in the reference's run order, how far the test run's output is from the reference's."""
    out = []
    for name, ref in reference.items():
        got = test.get(name)
        if got is None or got.shape != ref.shape:
            out.append(RegionDiff(name, float("inf"), float("inf")))
            continue
        d = (got - ref).abs()
        d = torch.where(torch.isnan(d), torch.full_like(d, float("inf")), d)  # NaN on one side is a difference
        max_abs = float(d.max()) if d.numel() else 0.0
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        out.append(RegionDiff(name, max_abs, max_abs / scale if scale > 0 else max_abs))
    return out


def first_difference(diffs: list[RegionDiff], tolerance: float) -> tuple[RegionDiff | None, float]:
    """The first region whose relative difference exceeds `tolerance`, and the largest relative difference of
    the regions before it."""
    before = 0.0
    for d in diffs:
        if d.rel > tolerance:
            return d, before
        before = max(before, d.rel)
    return None, before
