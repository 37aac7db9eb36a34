"""The mHC steps, RMSNorm and SwiGLU as torch custom ops backed by mhcrun's NKI kernels.

Each step is a ``torch.library.custom_op`` (``mhcrun::hc_expand``, ``mhcrun::hc_mixes``, ``mhcrun::hc_collapse``,
``mhcrun::hc_post``, ``mhcrun::hc_head``, ``mhcrun::rmsnorm``, ``mhcrun::swiglu``, and ``mhcrun::hc_pre``: the
fused pre step with the sublayer's RMSNorm) with a fake kernel, so it sits
in a ``torch.compile`` graph as one node. The public functions below pick a backend per call, from the run's
`HcBackend` (the model's `RunOptions.hc`, made from the environment the command read: `mhcrun.settings.Env`):

- ``MHCRUN_NKI_HC=0`` (``torch_only``): the torch reference functions (``mhcrun.ops``) are called directly, no
  custom op.
- a tensor on a ``neuron`` device: the real kernel of ``mhcrun/nki/kernels.py`` through
  ``torch_neuronx.nki_hop.wrap_nki`` (imported only there).
- ``MHCRUN_NKI_SIM=1`` (``sim``): the custom op, whose CPU implementation runs the kernel on mhcrun's NKI simulator
  (exact fp32 engine math); ``MHCRUN_NKI_SIM=device``: the same with the simulator's device-like numerics
  (Scalar-engine activations carry the target's bounded error, ``mhcrun.nki.sim.numerics``). The simulator
  first checks kernels.py against the NKI compiler's rules; a refused kernel stops the run (``KernelRefused``,
  exit 2).
- a CPU tensor with the run's CPU kernel on (`HcBackend.cpu`), eager: the post and post+pre steps of decode rows in
  the kernel's C++ (backend "cpu"; `CpuKernel.hc_post` / `hc_pre`), everything else the torch reference;
- otherwise (a CPU or CUDA tensor): the torch reference, as plain torch that a compiled region can fuse.

Shapes and constants the kernels do not cover (``mixes_supported`` false, other dtypes, n != 4, no tokens)
always take the torch reference. The simulator's numerics are an argument of each custom op (fixed into a compiled
graph when it is traced). ``HcBackend.stats()`` counts real executions per kernel and backend: the custom ops
count inside their implementation into the backend's ``calls`` tensor (one of their arguments), so calls from
compiled graphs are counted when the graph runs.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from mhcrun.errors import MhcrunError
from mhcrun.ops import hc as _ref
from mhcrun.ops.moe import swiglu as _ref_swiglu
from mhcrun.ops.norm import rms_norm as _ref_rms_norm
from mhcrun.ops.qgemv import KERNEL_OFF, CpuKernel, post_pre_shape

KERNEL_SOURCE = Path(__file__).with_name("kernels.py")
KERNEL_NAMES = ("hc_expand", "hc_mixes", "hc_collapse", "hc_post", "hc_head", "rmsnorm", "swiglu", "hc_pre",
                "hc_post_pre")
BACKENDS = ("torch", "nki-sim", "nki", "cpu")
_ACT_DTYPES = (torch.bfloat16, torch.float32)


class KernelRefused(MhcrunError):
    """The NKI simulator refused mhcrun's kernel source (a rule of the NKI compiler or the target hardware)."""


@functools.cache
def sim_kernels(source: Path, numerics: str):
    """kernels.py loaded into the simulator (checked against the NKI compiler's rules) with ``numerics``."""
    from mhcrun.nki.sim import NkiSimError, load_kernel_module

    try:
        return load_kernel_module(source, numerics=numerics)
    except NkiSimError as e:
        raise KernelRefused(f"NKI simulator refused {e}") from None


def _read_constants():
    from mhcrun.nki.sim import load_kernel_module

    return load_kernel_module(KERNEL_SOURCE, check=False)


# kernels.py executed once for its baked constants, copied into plain values here so that torch.compile traces the
# backend choice without entering the kernel module (the kernels themselves come from `sim_kernels`).
_SIM = _read_constants()
HC_MULT: int = _SIM.HC_MULT
SINKHORN_ITERS: int = _SIM.SINKHORN_ITERS
HC_EPS: float = _SIM.HC_EPS
MIXES_KERNELS: dict[float, str] = dict(_SIM.MIXES_KERNELS)  # norm_eps -> kernel name
HEAD_KERNELS: dict[float, str] = dict(_SIM.HEAD_KERNELS)
PRE_KERNELS: dict[float, str] = dict(_SIM.PRE_KERNELS)
POST_PRE_KERNELS: dict[float, str] = dict(_SIM.POST_PRE_KERNELS)
DECODE_MAX_T: int = _SIM.DECODE_MAX_T  # rows up to which the kernels put hidden on the partitions


def mixes_supported(hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> bool:
    """kernels.mixes_supported: True only for the constants baked into the hc_mixes / hc_head kernels."""
    return (hc_mult == HC_MULT and sinkhorn_iters == SINKHORN_ITERS and hc_eps == HC_EPS
            and norm_eps in MIXES_KERNELS)  # fmt: skip


# ------------------------------------------------------------------------------------------ stats, backend choice

def _tally(calls: Tensor, kernel: str, backend: str, n: int = 1) -> None:
    calls[KERNEL_NAMES.index(kernel), BACKENDS.index(backend)] += n


def _new_calls() -> Tensor:
    return torch.zeros(len(KERNEL_NAMES), len(BACKENDS), dtype=torch.int64)


@dataclass(frozen=True)
class HcBackend:
    """A run's backend for the hc steps (the model's `RunOptions.hc`) and its count of their executions.

    `torch_only` (MHCRUN_NKI_HC=0): always the torch reference. `sim` (MHCRUN_NKI_SIM: "exact" or "device", None
    off): CPU calls run the kernels in the simulator with those numerics. Executions are counted per kernel and
    backend (KERNEL_NAMES x BACKENDS; `stats` sums the two counts): `calls` [kernel, backend] by the custom ops as they
    run (also inside compiled graphs: `calls` is one of their arguments, which they update), `counted` by `count`:
    eager calls and the regions' torch calls per step."""

    torch_only: bool = False
    sim: str | None = None
    calls: Tensor = field(default_factory=_new_calls, compare=False, repr=False)
    # the counts made outside custom ops, [kernel][backend] flat, in Python: a tensor element's += costs ~15-60 us
    counted: list[int] = field(default_factory=lambda: [0] * len(KERNEL_NAMES) * len(BACKENDS), compare=False,
                               repr=False)
    cpu: CpuKernel = KERNEL_OFF  # the run's CPU kernel: its C++ runs the post and post+pre steps of decode rows

    def path(self, device_type: str) -> str:
        """The backend a kernel call on a tensor of ``device_type`` takes: "torch", "nki-sim", "nki" or "cpu" (the
        CPU kernel's C++ where it covers the call, else torch; never inside a compiled graph, which traces torch)."""
        if self.torch_only:
            return "torch"
        if device_type == "neuron":
            return "nki"
        if self.sim:
            return "nki-sim"
        return "cpu" if device_type == "cpu" and self.cpu.on else "torch"

    def count(self, kernel: str, backend: str, n: int = 1) -> None:
        """Count n executions outside a custom op (an eager call, or a compiled region's torch calls)."""
        if torch.compiler.is_compiling():  # a traced count would be a guard on the counter: a recompile per call
            return
        self.counted[KERNEL_NAMES.index(kernel) * len(BACKENDS) + BACKENDS.index(backend)] += n

    def stats(self) -> dict[str, dict[str, int]]:
        """Executions per kernel ("hc_expand", ..., "swiglu") per backend ("torch", "nki-sim", "nki")."""
        rows, nb = self.calls.tolist(), len(BACKENDS)
        return {k: {b: rows[i][j] + self.counted[i * nb + j] for j, b in enumerate(BACKENDS)}
                for i, k in enumerate(KERNEL_NAMES)}

    def reset(self) -> None:
        self.calls.zero_()
        self.counted[:] = [0] * len(self.counted)


def _count(hc: HcBackend | None, kernel: str, backend: str) -> None:
    if hc is not None:
        hc.count(kernel, backend)


@functools.cache
def _neuron_kernel(name: str):
    """The real kernel ``name`` of kernels.py wrapped for torch-neuronx (a higher-order op usable under compile)."""
    from torch_neuronx.nki_hop import wrap_nki

    return wrap_nki(getattr(importlib.import_module("mhcrun.nki.kernels"), name))


def _sim_getter(sim: str) -> Callable[[str], Callable]:
    """name -> the kernel of kernels.py in the simulator with numerics `sim` ("exact" or "device")."""
    return lambda name: getattr(sim_kernels(KERNEL_SOURCE, sim), name)


def split_hi_lo(fn: Tensor, act_dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor]:
    """fp32 ``fn`` as bf16 ``hi`` plus ``lo = fn - hi``, for the mixes GEMM over activations of ``act_dtype``; done
    once, eagerly, at load. bf16 activations: the GEMM runs on bf16 operands and lo is rounded to bf16
    (|fn - hi - lo| <= 2^-18 |fn|). fp32 activations: the GEMM runs on fp32 operands and lo stays fp32, so
    hi + lo == fn exactly (a value minus its rounding is representable) and the mixes are the fp32 GEMM's up to
    the summation order (a bf16 lo made them ~10x less accurate than torch's fp32 GEMM)."""
    fn = fn.detach().float()
    hi = fn.to(torch.bfloat16)
    lo = fn - hi.float()
    return hi, lo if act_dtype == torch.float32 else lo.to(torch.bfloat16)


# ------------------------------------------------------------------------------------------ what the kernels cover


def _act(*ts: Tensor) -> bool:
    return all(t.dtype in _ACT_DTYPES for t in ts) and all(t.dtype == ts[0].dtype for t in ts)


def _fp32(*ts: Tensor) -> bool:
    return all(t.dtype == torch.float32 for t in ts)


def _expand_ok(e: Tensor, n: int) -> bool:
    return n == HC_MULT and e.numel() > 0 and _act(e)


def _gemm_ok(x: Tensor, fn_hi: Tensor, fn_lo: Tensor, scale: Tensor, base: Tensor, mix: int) -> bool:
    """x [..., n, d] and the split fn [mix, n*d] in the layout the mixes GEMM of the kernels takes (`split_hi_lo`:
    hi bf16, lo bf16 or, with fp32 activations, fp32)."""
    if x.dim() < 2 or x.shape[-2] != HC_MULT or x.numel() == 0 or not _act(x):
        return False
    k = HC_MULT * x.shape[-1]
    lo_dtypes = (torch.bfloat16, torch.float32) if x.dtype == torch.float32 else (torch.bfloat16,)
    return (
        k % 128 == 0
        and tuple(fn_hi.shape) == (mix, k) and tuple(fn_lo.shape) == (mix, k)
        and fn_hi.dtype == torch.bfloat16 and fn_lo.dtype in lo_dtypes
        and _fp32(scale, base) and base.numel() == mix
    )  # fmt: skip


def _mixes_ok(x, fn_hi, fn_lo, scale, base, n, iters, eps, norm_eps) -> bool:
    return (mixes_supported(n, iters, eps, norm_eps) and scale.numel() == 3
            and _gemm_ok(x, fn_hi, fn_lo, scale, base, (2 + n) * n))  # fmt: skip


def _head_ok(x, fn_hi, fn_lo, scale, base, eps, norm_eps) -> bool:
    return (mixes_supported(HC_MULT, SINKHORN_ITERS, eps, norm_eps) and scale.numel() == 1
            and _gemm_ok(x, fn_hi, fn_lo, scale, base, HC_MULT))  # fmt: skip


def _pre_ok(x, fn_hi, fn_lo, scale, base, weight, n, iters, eps, norm_eps) -> bool:
    return (_mixes_ok(x, fn_hi, fn_lo, scale, base, n, iters, eps, norm_eps) and x.shape[-1] % 128 == 0
            and _fp32(weight) and weight.shape == x.shape[-1:])  # fmt: skip


def _post_pre_ok(y, residual, post, comb, fn_hi, fn_lo, scale, base, weight, n, iters, eps, norm_eps) -> bool:
    rows = y.numel() // max(y.shape[-1], 1)
    return (rows <= DECODE_MAX_T and _post_ok(y, residual, post, comb)
            and _pre_ok(residual, fn_hi, fn_lo, scale, base, weight, n, iters, eps, norm_eps))  # fmt: skip


def _collapse_ok(x: Tensor, pre: Tensor) -> bool:
    return x.dim() >= 2 and x.shape[-2] == HC_MULT and x.numel() > 0 and _act(x) and _fp32(pre)


def _post_ok(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> bool:
    return residual.dim() >= 2 and residual.shape[-2] == HC_MULT and y.numel() > 0 and _act(y, residual) \
        and _fp32(post, comb)


def _rmsnorm_ok(x: Tensor, weight: Tensor) -> bool:
    return x.numel() > 0 and _act(x) and _fp32(weight) and weight.shape == x.shape[-1:]


def _swiglu_ok(gate: Tensor, up: Tensor) -> bool:
    return gate.numel() > 0 and _act(gate) and _act(up) and gate.shape == up.shape


# ------------------------------------------------------------------------------------------ kernel calls (2-D views)


def _run_expand(get, e: Tensor, n: int) -> Tensor:
    d = e.shape[-1]
    out = get("hc_expand")(e.reshape(-1, d).contiguous())
    return out.view(*e.shape[:-1], n, d)


def _run_mixes(get, x, fn_hi, fn_lo, scale, base, norm_eps):
    *lead, n, d = x.shape
    kernel = get(MIXES_KERNELS[norm_eps])
    pre, post, comb = kernel(x.reshape(-1, n * d).contiguous(), fn_hi.contiguous(), fn_lo.contiguous(),
                             scale.reshape(1, -1).contiguous(), base.contiguous())  # fmt: skip
    return pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n)


def _run_pre(get, x, fn_hi, fn_lo, scale, base, weight, norm_eps):
    *lead, n, d = x.shape
    kernel = get(PRE_KERNELS[norm_eps])
    y, post, comb = kernel(x.reshape(-1, n * d).contiguous(), fn_hi.contiguous(), fn_lo.contiguous(),
                           scale.reshape(1, -1).contiguous(), base.contiguous(), weight.contiguous())  # fmt: skip
    return y.view(*lead, d), post.view(*lead, n), comb.view(*lead, n, n)


def _run_post_pre(get, y, residual, post, comb, fn_hi, fn_lo, scale, base, weight, norm_eps):
    *lead, n, d = residual.shape
    kernel = get(POST_PRE_KERNELS[norm_eps])
    x_new, y_next, post_next, comb_next = kernel(
        y.reshape(-1, d).contiguous(), residual.reshape(-1, n * d).contiguous(), post.reshape(-1, n).contiguous(),
        comb.reshape(-1, n * n).contiguous(), fn_hi.contiguous(), fn_lo.contiguous(), scale.reshape(1, -1).contiguous(),
        base.contiguous(), weight.contiguous())  # fmt: skip
    return x_new.view(*lead, n, d), y_next.view(*lead, d), post_next.view(*lead, n), comb_next.view(*lead, n, n)


def _ref_post_pre(y, residual, post, comb, fn, scale, base, weight, n, iters, eps, norm_eps):
    x_new = _ref.hc_post(y, residual, post, comb)
    return (x_new, *_ref_pre(x_new, fn, scale, base, weight, n, iters, eps, norm_eps))


def _ref_pre(x, fn, scale, base, weight, n, iters, eps, norm_eps):
    pre, post, comb = _ref.hc_mixes(x, fn, scale, base, n, iters, eps, norm_eps)
    return _ref_rms_norm(_ref.hc_collapse(x, pre), weight, norm_eps), post, comb


def _run_collapse(get, x: Tensor, pre: Tensor) -> Tensor:
    *lead, n, d = x.shape
    out = get("hc_collapse")(x.reshape(-1, n * d).contiguous(), pre.reshape(-1, n).contiguous())
    return out.view(*lead, d)


def _run_post(get, y: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    *lead, n, d = residual.shape
    out = get("hc_post")(y.reshape(-1, d).contiguous(), residual.reshape(-1, n * d).contiguous(),
                             post.reshape(-1, n).contiguous(), comb.reshape(-1, n * n).contiguous())  # fmt: skip
    return out.view(*lead, n, d)


def _run_head(get, x, fn_hi, fn_lo, scale, base, norm_eps) -> Tensor:
    *lead, n, d = x.shape
    kernel = get(HEAD_KERNELS[norm_eps])
    out = kernel(x.reshape(-1, n * d).contiguous(), fn_hi.contiguous(), fn_lo.contiguous(),
                 scale.reshape(1, -1).contiguous(), base.contiguous())  # fmt: skip
    return out.view(*lead, d)


def _run_rmsnorm(get, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    d = x.shape[-1]
    return get("rmsnorm")(x.reshape(-1, d).contiguous(), weight.contiguous(), float(eps)).view(x.shape)


def _run_swiglu(get, gate: Tensor, up: Tensor, limit: float) -> Tensor:
    f = gate.shape[-1]
    out = get("swiglu")(gate.reshape(-1, f).contiguous(), up.reshape(-1, f).contiguous(), float(limit))
    return out.view(gate.shape)


# ------------------------------------------------------------------------------------------ custom ops


def _sim_or_ref(name: str, sim: str, calls: Tensor, ok: bool, run: Callable, ref: Callable):
    """A custom op's CPU body: kernel `name` in the simulator with numerics `sim` where it covers the inputs (`ok`),
    else the torch reference (its outputs made contiguous, as a custom op must return); the execution counted in
    the run's `calls`."""
    if sim and ok:
        _tally(calls, name, "nki-sim")
        return run(_sim_getter(sim))
    _tally(calls, name, "torch")
    out = ref()
    return tuple(t.contiguous() for t in out) if isinstance(out, tuple) else out.contiguous()


@torch.library.custom_op("mhcrun::hc_expand", mutates_args=("calls",))
def _hc_expand_op(e: Tensor, n: int, sim: str, calls: Tensor) -> Tensor:
    return _sim_or_ref("hc_expand", sim, calls, _expand_ok(e, n), lambda get: _run_expand(get, e, n),
                       lambda: _ref.hc_expand(e, n))


@_hc_expand_op.register_fake
def _(e: Tensor, n: int, sim: str, calls: Tensor) -> Tensor:
    return e.new_empty((*e.shape[:-1], n, e.shape[-1]))


@torch.library.custom_op("mhcrun::hc_mixes", mutates_args=("calls",))
def _hc_mixes_op(x: Tensor, fn: Tensor, fn_hi: Tensor, fn_lo: Tensor, scale: Tensor, base: Tensor, n: int, iters: int,
                 eps: float, norm_eps: float, sim: str, calls: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _sim_or_ref("hc_mixes", sim, calls, _mixes_ok(x, fn_hi, fn_lo, scale, base, n, iters, eps, norm_eps),
                       lambda get: _run_mixes(get, x, fn_hi, fn_lo, scale, base, norm_eps),
                       lambda: _ref.hc_mixes(x, fn, scale, base, n, iters, eps, norm_eps))


@_hc_mixes_op.register_fake
def _(x, fn, fn_hi, fn_lo, scale, base, n, iters, eps, norm_eps, sim, calls):
    lead = x.shape[:-2]
    f32 = torch.float32
    return x.new_empty((*lead, n), dtype=f32), x.new_empty((*lead, n), dtype=f32), x.new_empty((*lead, n, n), dtype=f32)


@torch.library.custom_op("mhcrun::hc_pre", mutates_args=("calls",))
def _hc_pre_op(x: Tensor, fn: Tensor, fn_hi: Tensor, fn_lo: Tensor, scale: Tensor, base: Tensor, weight: Tensor, n: int,
               iters: int, eps: float, norm_eps: float, sim: str, calls: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _sim_or_ref("hc_pre", sim, calls, _pre_ok(x, fn_hi, fn_lo, scale, base, weight, n, iters, eps, norm_eps),
                       lambda get: _run_pre(get, x, fn_hi, fn_lo, scale, base, weight, norm_eps),
                       lambda: _ref_pre(x, fn, scale, base, weight, n, iters, eps, norm_eps))


@_hc_pre_op.register_fake
def _(x, fn, fn_hi, fn_lo, scale, base, weight, n, iters, eps, norm_eps, sim, calls):
    lead = x.shape[:-2]
    f32 = torch.float32
    return (x.new_empty((*lead, x.shape[-1])), x.new_empty((*lead, n), dtype=f32),
            x.new_empty((*lead, n, n), dtype=f32))  # fmt: skip


@torch.library.custom_op("mhcrun::hc_post_pre", mutates_args=("calls",))
def _hc_post_pre_op(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor, fn: Tensor, fn_hi: Tensor, fn_lo: Tensor,
                    scale: Tensor, base: Tensor, weight: Tensor, n: int, iters: int, eps: float,
                    norm_eps: float, sim: str, calls: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    args = (y, residual, post, comb, fn_hi, fn_lo, scale, base, weight)
    return _sim_or_ref("hc_post_pre", sim, calls, _post_pre_ok(*args, n, iters, eps, norm_eps),
                       lambda get: _run_post_pre(get, *args, norm_eps),
                       lambda: _ref_post_pre(y, residual, post, comb, fn, scale, base, weight, n, iters, eps, norm_eps))


@_hc_post_pre_op.register_fake
def _(y, residual, post, comb, fn, fn_hi, fn_lo, scale, base, weight, n, iters, eps, norm_eps, sim, calls):
    f32 = torch.float32
    return (residual.new_empty(residual.shape, dtype=y.dtype), y.new_empty(y.shape),
            post.new_empty(post.shape, dtype=f32), comb.new_empty(comb.shape, dtype=f32))  # fmt: skip


@torch.library.custom_op("mhcrun::hc_post_pre_cpu", mutates_args=())
def hc_post_pre_cpu(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor, fn: Tensor, scale: Tensor, base: Tensor,
                    weight: Tensor, iters: int, eps: float, norm_eps: float, library: str,
                    isa: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The CPU kernel's post+pre step (`CpuKernel.hc_post_pre`) as an opaque op of compiled graphs, the reference
    where the kernel declines: what its C++ twin `mhcrun::hc_post_pre_native` (torch_ops.cpp) hands over when it does
    not take the call."""
    out = CpuKernel(library, isa).hc_post_pre(y, residual, post, comb, fn, scale, base, weight, iters, eps, norm_eps)
    if out is None:
        out = _ref_post_pre(y, residual, post, comb, fn, scale, base, weight, residual.shape[-2], iters, eps, norm_eps)
    return tuple(t.contiguous() for t in out)


hc_post_pre_cpu.register_fake(post_pre_shape)


@torch.library.custom_op("mhcrun::hc_collapse", mutates_args=("calls",))
def _hc_collapse_op(x: Tensor, pre: Tensor, sim: str, calls: Tensor) -> Tensor:
    return _sim_or_ref("hc_collapse", sim, calls, _collapse_ok(x, pre), lambda get: _run_collapse(get, x, pre),
                       lambda: _ref.hc_collapse(x, pre))


@_hc_collapse_op.register_fake
def _(x: Tensor, pre: Tensor, sim: str, calls: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-2], x.shape[-1]))


@torch.library.custom_op("mhcrun::hc_post", mutates_args=("calls",))
def _hc_post_op(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor, sim: str, calls: Tensor) -> Tensor:
    return _sim_or_ref("hc_post", sim, calls, _post_ok(y, residual, post, comb),
                       lambda get: _run_post(get, y, residual, post, comb),
                       lambda: _ref.hc_post(y, residual, post, comb))


@_hc_post_op.register_fake
def _(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor, sim: str, calls: Tensor) -> Tensor:
    return residual.new_empty(residual.shape, dtype=y.dtype)


@torch.library.custom_op("mhcrun::hc_head", mutates_args=("calls",))
def _hc_head_op(x: Tensor, fn: Tensor, fn_hi: Tensor, fn_lo: Tensor, scale: Tensor, base: Tensor, eps: float,
                norm_eps: float, sim: str, calls: Tensor) -> Tensor:
    return _sim_or_ref("hc_head", sim, calls, _head_ok(x, fn_hi, fn_lo, scale, base, eps, norm_eps),
                       lambda get: _run_head(get, x, fn_hi, fn_lo, scale, base, norm_eps),
                       lambda: _ref.hc_head(x, fn, scale, base, eps, norm_eps))


@_hc_head_op.register_fake
def _(x, fn, fn_hi, fn_lo, scale, base, eps, norm_eps, sim, calls):
    return x.new_empty((*x.shape[:-2], x.shape[-1]))


@torch.library.custom_op("mhcrun::rmsnorm", mutates_args=("calls",))
def _rmsnorm_op(x: Tensor, weight: Tensor, eps: float, sim: str, calls: Tensor) -> Tensor:
    return _sim_or_ref("rmsnorm", sim, calls, _rmsnorm_ok(x, weight), lambda get: _run_rmsnorm(get, x, weight, eps),
                       lambda: _ref_rms_norm(x, weight, eps))


@_rmsnorm_op.register_fake
def _(x: Tensor, weight: Tensor, eps: float, sim: str, calls: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("mhcrun::swiglu", mutates_args=("calls",))
def _swiglu_op(gate: Tensor, up: Tensor, limit: float, sim: str, calls: Tensor) -> Tensor:
    return _sim_or_ref("swiglu", sim, calls, _swiglu_ok(gate, up), lambda get: _run_swiglu(get, gate, up, limit),
                       lambda: _ref_swiglu(gate, up, limit))


@_swiglu_op.register_fake
def _(gate: Tensor, up: Tensor, limit: float, sim: str, calls: Tensor) -> Tensor:
    return gate.new_empty(gate.shape, dtype=torch.float32)


# ------------------------------------------------------------------------------------------ public API


def _dispatch(name: str, t: Tensor, ok: Callable[[], bool], run: Callable, ref: Callable[[], object],
              op: Callable[[str, Tensor], object], hc: HcBackend | None,
              native: Callable[[CpuKernel], object | None] | None = None, graphs: bool = False):
    """One call of kernel `name` on tensors like `t` under `hc` (None: the torch reference, uncounted): the real
    kernel on a neuron device (when it covers the shapes), the custom op in the simulator (its CPU implementation
    runs the kernel and counts), the CPU kernel's C++ (`native`: None where it declines; eager only, unless `graphs`:
    then compiled graphs call it as an op), else the torch reference: plain torch that a compiled region can fuse."""
    path = "torch" if hc is None else hc.path(t.device.type)
    if path == "nki-sim":
        if not torch.compiler.is_compiling():
            sim_kernels(KERNEL_SOURCE, hc.sim)  # a refused kernel stops the run here, outside the custom op
        return op(hc.sim, hc.calls)
    if path == "nki" and ok():
        hc.count(name, "nki")
        return run(_neuron_kernel)
    if path == "cpu" and native is not None and (graphs or not torch.compiler.is_compiling()):
        out = native(hc.cpu)
        if out is not None:
            hc.count(name, "cpu")
            return out
    _count(hc, name, "torch")
    return ref()


def hc_expand(e: Tensor, n: int, hc: HcBackend | None = None) -> Tensor:
    """[b, s, d] -> [b, s, n, d]: n identical copies (mhcrun.ops.hc.hc_expand)."""
    return _dispatch("hc_expand", e, lambda: _expand_ok(e, n), lambda get: _run_expand(get, e, n),
                     lambda: _ref.hc_expand(e, n), lambda *b: torch.ops.mhcrun.hc_expand(e, n, *b), hc)


def hc_mixes(x: Tensor, fn: Tensor, fn_hi: Tensor | None, fn_lo: Tensor | None, scale: Tensor, base: Tensor, n: int,
             iters: int, eps: float, norm_eps: float, hc: HcBackend | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """x [b, s, n, d] -> pre [b, s, n], post [b, s, n], comb [b, s, n, n] (fp32), as mhcrun.ops.hc.hc_mixes.

    ``fn`` is the fp32 weight (torch path); ``fn_hi`` / ``fn_lo`` its ``split_hi_lo`` (kernel paths; split here
    when None). Constants other than the kernels' baked ones take the torch path.
    """
    def ref():
        return _ref.hc_mixes(x, fn, scale, base, n, iters, eps, norm_eps)

    if not mixes_supported(n, iters, eps, norm_eps):
        _count(hc, "hc_mixes", "torch")
        return ref()
    if fn_hi is None or fn_lo is None:
        fn_hi, fn_lo = split_hi_lo(fn)
    return _dispatch("hc_mixes", x, lambda: _mixes_ok(x, fn_hi, fn_lo, scale, base, n, iters, eps, norm_eps),
                     lambda get: _run_mixes(get, x, fn_hi, fn_lo, scale, base, norm_eps), ref,
                     lambda *b: torch.ops.mhcrun.hc_mixes(x, fn, fn_hi, fn_lo, scale, base, n, iters, eps, norm_eps,
                                                          *b), hc)


def hc_pre(x: Tensor, fn: Tensor, fn_hi: Tensor | None, fn_lo: Tensor | None, scale: Tensor, base: Tensor,
           weight: Tensor, n: int, iters: int, eps: float, norm_eps: float,
           hc: HcBackend | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The mHC pre step of a site and its sublayer's RMSNorm in one kernel: x [b, s, n, d] ->
    y [b, s, d] = rms_norm(hc_collapse(x, pre), weight, norm_eps), post [b, s, n], comb [b, s, n, n] (fp32).
    The same values as hc_mixes, hc_collapse and rms_norm one after the other (the layer's RMSNorm epsilon is
    the mixes' norm epsilon in V4 and V4.1)."""
    def ref():
        return _ref_pre(x, fn, scale, base, weight, n, iters, eps, norm_eps)

    if not mixes_supported(n, iters, eps, norm_eps):
        _count(hc, "hc_pre", "torch")
        return ref()
    if fn_hi is None or fn_lo is None:
        fn_hi, fn_lo = split_hi_lo(fn)
    return _dispatch("hc_pre", x, lambda: _pre_ok(x, fn_hi, fn_lo, scale, base, weight, n, iters, eps, norm_eps),
                     lambda get: _run_pre(get, x, fn_hi, fn_lo, scale, base, weight, norm_eps), ref,
                     lambda *b: torch.ops.mhcrun.hc_pre(x, fn, fn_hi, fn_lo, scale, base, weight, n, iters, eps,
                                                     norm_eps, *b), hc)


def site_kernels(rows: int) -> tuple[str, ...]:
    """The kernels a site's post+pre step (`hc_post_pre`) launches over `rows` token rows: one for decode rows
    (hidden on the partitions, the streams kept on chip), hc_post then hc_pre above (tokens on the partitions)."""
    return ("hc_post_pre",) if rows <= DECODE_MAX_T else ("hc_post", "hc_pre")


def post_pre_native(rows: int, n: int, iters: int, eps: float, norm_eps: float, device_type: str,
                    hc: HcBackend | None) -> bool:
    """Whether an eager `hc_post_pre` of `rows` rows on `device_type` runs the run's CPU kernel (`HcBackend.cpu`), where
    it takes the call: one kernel for the site (`site_kernels`), the constants the kernels bake in, the "cpu" path. A
    caller that makes that call itself counts it (`HcBackend.count`)."""
    return (hc is not None and len(site_kernels(rows)) == 1 and mixes_supported(n, iters, eps, norm_eps)
            and hc.path(device_type) == "cpu")


def hc_post_pre(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor, fn: Tensor, fn_hi: Tensor | None,
                fn_lo: Tensor | None, scale: Tensor, base: Tensor, weight: Tensor, n: int, iters: int, eps: float,
                norm_eps: float, hc: HcBackend | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A site's post step and the next site's pre step (``fn`` ... ``weight`` are the next site's): the new streams
    [b, s, n, d] and hc_pre's (y, post, comb) of them. One kernel for decode rows (b * s <= DECODE_MAX_T), where
    the streams stay on chip between the two; above, hc_post then hc_pre."""
    rows = y.numel() // max(y.shape[-1], 1)
    if len(site_kernels(rows)) > 1 or not mixes_supported(n, iters, eps, norm_eps):
        x_new = hc_post(y, residual, post, comb, hc)
        return (x_new, *hc_pre(x_new, fn, fn_hi, fn_lo, scale, base, weight, n, iters, eps, norm_eps, hc))
    if fn_hi is None or fn_lo is None:
        fn_hi, fn_lo = split_hi_lo(fn)
    args = (y, residual, post, comb, fn_hi, fn_lo, scale, base, weight)

    def native(cpu: CpuKernel):
        return cpu.hc_post_pre(y, residual, post, comb, fn, scale, base, weight, iters, eps, norm_eps)

    return _dispatch("hc_post_pre", y, lambda: _post_pre_ok(*args, n, iters, eps, norm_eps),
                     lambda get: _run_post_pre(get, *args, norm_eps),
                     lambda: _ref_post_pre(y, residual, post, comb, fn, scale, base, weight, n, iters, eps, norm_eps),
                     lambda *b: torch.ops.mhcrun.hc_post_pre(y, residual, post, comb, fn, fn_hi, fn_lo, scale, base,
                                                          weight, n, iters, eps, norm_eps, *b), hc, native,
                     graphs=True)


def hc_collapse(x: Tensor, pre: Tensor, hc: HcBackend | None = None) -> Tensor:
    """sum_m pre[m] * x[m] in fp32, in x's dtype: x [b, s, n, d], pre [b, s, n] -> [b, s, d]."""
    return _dispatch("hc_collapse", x, lambda: _collapse_ok(x, pre), lambda get: _run_collapse(get, x, pre),
                     lambda: _ref.hc_collapse(x, pre), lambda *b: torch.ops.mhcrun.hc_collapse(x, pre, *b), hc)


def hc_post(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor, hc: HcBackend | None = None) -> Tensor:
    """X'[o] = post[o] * y + sum_i comb[i, o] * R[i]: y [b, s, d], residual [b, s, n, d] -> [b, s, n, d]."""
    return _dispatch("hc_post", y, lambda: _post_ok(y, residual, post, comb),
                     lambda get: _run_post(get, y, residual, post, comb),
                     lambda: _ref.hc_post(y, residual, post, comb),
                     lambda *b: torch.ops.mhcrun.hc_post(y, residual, post, comb, *b), hc,
                     lambda cpu: cpu.hc_post(y, residual, post, comb))


def hc_head(x: Tensor, fn: Tensor, fn_hi: Tensor | None, fn_lo: Tensor | None, scale: Tensor, base: Tensor,
            eps: float, norm_eps: float, hc: HcBackend | None = None) -> Tensor:
    """V4's final collapse (mhcrun.ops.hc.hc_head): x [b, s, n, d] -> [b, s, d]."""
    def ref():
        return _ref.hc_head(x, fn, scale, base, eps, norm_eps)

    if not mixes_supported(HC_MULT, SINKHORN_ITERS, eps, norm_eps):
        _count(hc, "hc_head", "torch")
        return ref()
    if fn_hi is None or fn_lo is None:
        fn_hi, fn_lo = split_hi_lo(fn)
    return _dispatch("hc_head", x, lambda: _head_ok(x, fn_hi, fn_lo, scale, base, eps, norm_eps),
                     lambda get: _run_head(get, x, fn_hi, fn_lo, scale, base, norm_eps), ref,
                     lambda *b: torch.ops.mhcrun.hc_head(x, fn, fn_hi, fn_lo, scale, base, eps, norm_eps, *b), hc,
                     lambda cpu: cpu.hc_head(x, fn, scale, base, eps, norm_eps))


def rms_norm(x: Tensor, weight: Tensor, eps: float, hc: HcBackend | None = None) -> Tensor:
    """RMSNorm in fp32, cast back to x's dtype (mhcrun.ops.norm.rms_norm)."""
    return _dispatch("rmsnorm", x, lambda: _rmsnorm_ok(x, weight), lambda get: _run_rmsnorm(get, x, weight, eps),
                     lambda: _ref_rms_norm(x, weight, eps), lambda *b: torch.ops.mhcrun.rmsnorm(x, weight, eps, *b),
                     hc)


def swiglu(gate: Tensor, up: Tensor, limit: float, hc: HcBackend | None = None) -> Tensor:
    """silu(min(g, L)) * clamp(u, -L, L) in fp32 (mhcrun.ops.moe.swiglu)."""
    return _dispatch("swiglu", gate, lambda: _swiglu_ok(gate, up), lambda get: _run_swiglu(get, gate, up, limit),
                     lambda: _ref_swiglu(gate, up, limit), lambda *b: torch.ops.mhcrun.swiglu(gate, up, limit, *b), hc)
