"""Stand-in for the top-level ``nki`` package: ``nki.jit`` (and ``nki.simulate``) running kernels on CPU.

Calling a ``@nki.jit`` kernel with torch tensors (or numpy arrays) puts them in simulated shared HBM (keeping
their dtype), runs the Python kernel body against the simulated ``nki.language`` / ``nki.isa``, and returns
the kernel's returned HBM tensor(s) as torch tensors of their declared dtypes. ``kernel[grid](...)`` runs the
body once per SPMD program (``nl.program_id``), sequentially, with ``shared_hbm`` allocations shared between
the programs. Inputs the kernel wrote into are written back to the caller's tensors.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from . import dtypes as dt
from . import isa, language  # noqa: F401  (nki.isa / nki.language attributes of this module)
from .costs import CostLog
from .errors import NkiSimError, NkiSimUnsupported
from .memory import MemoryPeaks
from .numerics import check_numerics
from .tensor import NkiTensor, SimContext, from_array, pop, push, shared_hbm


@dataclass
class CallReport:
    """One kernel call as the simulator saw it: peaks of on-chip memory (the largest over the SPMD programs, bytes
    per partition) and the DMA transfers and engine instructions of every program."""

    kernel: str
    numerics: str
    programs: int = 1
    peaks: MemoryPeaks = field(default_factory=MemoryPeaks)
    costs: CostLog = field(default_factory=CostLog)

    def add_program(self, ctx: SimContext) -> None:
        p, q = self.peaks, ctx.memory.peaks
        p.sbuf_bytes = max(p.sbuf_bytes, q.sbuf_bytes)
        p.psum_bytes = max(p.psum_bytes, q.psum_bytes)
        p.psum_bank_bytes = [max(a, b) for a, b in zip(p.psum_bank_bytes, q.psum_bank_bytes, strict=True)]
        p.open_groups = max(p.open_groups, q.open_groups)
        self.costs.extend(ctx.costs)


def _to_sim(value, name: str):
    if isinstance(value, NkiTensor):
        return value, None
    if isinstance(value, torch.Tensor):
        arr, dtype = dt.from_torch(value, f"kernel argument '{name}'")
        return from_array(arr, dtype, shared_hbm, name), value
    if isinstance(value, np.ndarray):
        arr, dtype = dt.from_numpy(value, f"kernel argument '{name}'")
        return from_array(arr, dtype, shared_hbm, name), value
    return value, None


def _check_output(t: NkiTensor, what: str) -> None:
    if t.buffer.on_chip:
        raise NkiSimError(
            f"{what}: kernel returned {t.buffer.name} tile '{t.name}' {tuple(t.shape)}; kernel outputs must be HBM "
            "tensors allocated with nl.ndarray(..., buffer=nl.shared_hbm) and written with nl.store / nisa.dma_copy"
        )
    w = t._written()
    if not w.all():
        missing = int(w.size - np.count_nonzero(w))
        raise NkiSimError(
            f"{what}: kernel output '{t.name}' {tuple(t.shape)} {t.dtype} has {missing} of {w.size} elements never "
            "written (a missed tile or a partial last tile?)"
        )


def _convert_out(value, as_numpy: bool, device, what: str):
    if isinstance(value, NkiTensor):
        _check_output(value, what)
        vals = np.array(value._values())
        if as_numpy:
            return vals.copy()
        out = dt.to_torch(vals, value.dtype)
        return out.to(device) if device is not None else out
    if isinstance(value, tuple):
        return tuple(_convert_out(v, as_numpy, device, what) for v in value)
    if isinstance(value, list):
        return [_convert_out(v, as_numpy, device, what) for v in value]
    if isinstance(value, dict):
        return {k: _convert_out(v, as_numpy, device, what) for k, v in value.items()}
    return value


def _write_back(sim: NkiTensor, orig) -> None:
    """Copy an input the kernel modified back into the caller's tensor / array."""
    vals = np.array(sim._values())
    if isinstance(orig, torch.Tensor):
        with torch.no_grad():
            orig.copy_(dt.to_torch(vals, sim.dtype).to(orig.device))
    else:
        orig[...] = vals.astype(orig.dtype)


def _grid_tuple(grid) -> tuple[int, ...]:
    if isinstance(grid, int):
        grid = (grid,)
    g = tuple(int(x) for x in grid)
    if not g or any(x < 1 for x in g):
        raise NkiSimError(f"kernel[grid]: grid must be positive ints, got {grid!r}")
    return g


def run_kernel(func, args, kwargs, grid=(), as_numpy: bool = False, numerics: str = "exact",
               report: CallReport | None = None):
    """Run ``func`` (a kernel body) on simulated memory; see the module docstring. ``report``, when given, receives
    the call's memory peaks and costs."""
    what = getattr(func, "__name__", "kernel")
    check_numerics(numerics)
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except TypeError as e:
        raise NkiSimError(f"{what}: {e}") from None
    device = None
    originals: list[tuple[NkiTensor, object]] = []
    for pname, value in list(bound.arguments.items()):
        sim, orig = _to_sim(value, pname)
        if orig is not None:
            originals.append((sim, orig))
            if device is None and isinstance(orig, torch.Tensor):
                device = orig.device
        bound.arguments[pname] = sim
    for sim, _ in originals:
        sim._st.modified = False
    grid = _grid_tuple(grid) if grid else ()
    pids = list(itertools.product(*(range(g) for g in grid))) if grid else [()]
    shared: list = []
    result = None
    for pid in pids:
        ctx = SimContext(grid=grid, pid=pid, shared=shared, numerics=numerics)
        prev = push(ctx)
        try:
            result = func(*bound.args, **bound.kwargs)
        finally:
            pop(prev)
        if report is not None:
            report.add_program(ctx)
        del ctx
    out = _convert_out(result, as_numpy, device, what)
    for sim, orig in originals:
        if sim._st.modified:
            _write_back(sim, orig)
    return out


class JitKernel:
    """A ``@nki.jit`` kernel: call it, or index it with an SPMD grid first (``kernel[2](x)``)."""

    def __init__(self, func, grid=(), **options):
        self.func = func
        self.grid = grid
        self.options = options
        functools.update_wrapper(self, func)

    @property
    def numerics(self) -> str:
        return self.options.get("numerics", "exact")

    def __call__(self, *args, **kwargs):
        return run_kernel(self.func, args, kwargs, self.grid, numerics=self.numerics)

    def __getitem__(self, grid) -> JitKernel:
        return JitKernel(self.func, grid, **self.options)

    def with_options(self, **options) -> JitKernel:
        """The same kernel with simulator options replaced (``numerics="device"``)."""
        return JitKernel(self.func, self.grid, **{**self.options, **options})

    def __repr__(self) -> str:
        return f"<nki.jit kernel {getattr(self.func, '__name__', '?')} (mhcrun simulator)>"


def jit(func=None, mode=None, **options):
    """``@nki.jit`` / ``@nki.jit(...)``: a kernel that runs on mhcrun's CPU simulator."""
    if func is None:
        return lambda f: JitKernel(f, **options)
    if isinstance(func, JitKernel):
        return func
    return JitKernel(func, **options)


def profile(kernel):
    """``profile(kernel)(*args) -> (outputs, CallReport)``: run a kernel and report its memory peaks and costs."""
    func = kernel.func if isinstance(kernel, JitKernel) else kernel
    grid = kernel.grid if isinstance(kernel, JitKernel) else ()
    numerics = kernel.numerics if isinstance(kernel, JitKernel) else "exact"

    def call(*args, **kwargs):
        rep = CallReport(getattr(func, "__name__", "kernel"), numerics, programs=0)
        out = run_kernel(func, args, kwargs, grid, numerics=numerics, report=rep)
        rep.programs = max(1, len(list(itertools.product(*(range(g) for g in _grid_tuple(grid)))))) if grid else 1
        return out, rep

    return call


def simulate(kernel):
    """``nki.simulate(kernel)(*arrays)``: run a kernel and return numpy outputs (bf16/fp8 as rounded float32)."""
    func = kernel.func if isinstance(kernel, JitKernel) else kernel
    grid = kernel.grid if isinstance(kernel, JitKernel) else ()

    numerics = kernel.numerics if isinstance(kernel, JitKernel) else "exact"

    def call(*args, **kwargs):
        return run_kernel(func, args, kwargs, grid, as_numpy=True, numerics=numerics)

    return call


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NkiSimUnsupported(f"nki.{name} is not implemented by mhcrun's NKI simulator")
