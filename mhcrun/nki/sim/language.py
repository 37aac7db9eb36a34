"""Stand-in for ``nki.language`` (``import nki.language as nl``) in mhcrun's NKI simulator.

Implements the subset mhcrun's kernels use: dtypes, buffers, ``tile_size``, tensor creation, ``load`` /
``store``, loops, index helpers, SPMD program ids, and the elementwise / reduction math functions (which both
compute on tiles, returning a new SBUF tile, and name operators for the ``nki.isa`` instructions).
Anything else of the real module raises ``NkiSimUnsupported`` (an AttributeError).
"""

from __future__ import annotations

import builtins
import numbers

import numpy as np

from . import alu
from . import dtypes as _dt
from .alu import OpSpec
from .dtypes import (  # noqa: F401  (re-exported dtype names)
    bfloat16,
    bool_,
    float8_e4m3,
    float8_e4m3fn,
    float8_e5m2,
    float16,
    float32,
    int8,
    int16,
    int32,
    tfloat32,
    uint8,
    uint16,
    uint32,
)
from .errors import NkiSimError, NkiSimUnsupported
from .numerics import activation_result
from .tensor import (  # noqa: F401  (re-exported buffers and the tensor class)
    PMAX,
    Buffer,
    NkiTensor,
    allocate,
    count_dma,
    count_instr,
    current,
    engine_in,
    free_size,
    hbm,
    private_hbm,
    psum,
    read,
    require_on_chip,
    require_tensor,
    sbuf,
    shared_hbm,
    write,
)
from .tensor import describe as _describe


class tile_size:  # noqa: N801  (the real API's spelling)
    """Hardware tile size constants (NeuronCore-v2/v3 values)."""

    pmax = PMAX
    psum_fmax = 512
    psum_bank_fmax = 512
    psum_num_banks = 8
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    bn_stats_fmax = 512
    sbuf_fmax = 192 * 1024 // 4
    sbuf_fmax_bytes = 192 * 1024
    total_available_sbuf_size = 192 * 1024
    psum_min_align = 4
    sbuf_min_align = 1


# ------------------------------------------------------------------------------------------- creation


def ndarray(shape, dtype, buffer=None, name="", address=None):
    """A new tensor of ``shape`` and ``dtype`` on ``buffer`` (default SBUF); its elements start unwritten."""
    return allocate("nl.ndarray", shape, dtype, buffer, name)


def _filled(op, shape, dtype, buffer, name, value):
    t = allocate(op, shape, dtype, buffer, name)
    write(op, t, np.full(t.shape, value, dtype=np.float64))
    t._st.modified = False
    return t


def zeros(shape, dtype, buffer=None, name=""):
    return _filled("nl.zeros", shape, dtype, buffer, name, 0.0)


def ones(shape, dtype, buffer=None, name=""):
    return _filled("nl.ones", shape, dtype, buffer, name, 1.0)


def full(shape, fill_value, dtype, buffer=None, name=""):
    if isinstance(fill_value, NkiTensor) or not isinstance(fill_value, numbers.Number):
        raise NkiSimError(f"nl.full: fill_value must be a compile-time scalar, got {fill_value!r}")
    return _filled("nl.full", shape, dtype, buffer, name, fill_value)


def zeros_like(x, dtype=None, buffer=None, name=""):
    require_tensor("nl.zeros_like", "x", x)
    return zeros(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def ones_like(x, dtype=None, buffer=None, name=""):
    require_tensor("nl.ones_like", "x", x)
    return ones(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def empty_like(x, dtype=None, buffer=None, name=""):
    require_tensor("nl.empty_like", "x", x)
    return allocate("nl.empty_like", x.shape, dtype or x.dtype, buffer or x.buffer, name)


def full_like(x, fill_value, dtype=None, buffer=None, name=""):
    require_tensor("nl.full_like", "x", x)
    return full(x.shape, fill_value, dtype or x.dtype, buffer or x.buffer, name)


def shared_identity_matrix(n, dtype=float32, **kwargs):
    """An ``[n, n]`` identity matrix in SBUF."""
    return _from_values("nl.shared_identity_matrix", np.eye(int(n), dtype=np.float32), dtype, sbuf)


def shared_constant(constant, dtype=None, **kwargs):
    """A shared-HBM tensor holding ``constant`` (a numpy array or nested sequence)."""
    arr = np.asarray(constant)
    return _from_values("nl.shared_constant", arr, dtype or _dt.normalize(arr.dtype, "nl.shared_constant"), shared_hbm)


def _from_values(op, values, dtype, buffer):
    t = allocate(op, values.shape, dtype, buffer)
    write(op, t, values)
    t._st.modified = False
    return t


# ------------------------------------------------------------------------------------------- data movement


def _squeezed(shape) -> tuple:
    return tuple(int(s) for s in shape if s != 1)


def check_copy_shapes(op: str, dst_name: str, dst: NkiTensor, src_name: str, src: NkiTensor) -> None:
    """DMA shape rule: the same shape, up to size-1 axes."""
    if tuple(dst.shape) != tuple(src.shape) and _squeezed(dst.shape) != _squeezed(src.shape):
        raise NkiSimError(f"{op}: shape mismatch: {dst_name} {_describe(dst)} vs {src_name} {_describe(src)}")


def load(src, dtype=None, **kwargs):
    """Copy an HBM tensor (view) into a new SBUF tile of the same shape (optionally cast to ``dtype``)."""
    op = "nl.load"
    if "mask" in kwargs:
        raise NkiSimError(f"{op}: mask= is not part of the NKI 0.3+ API; slice the source instead")
    require_tensor(op, "src", src)
    if src.buffer.on_chip:
        raise NkiSimError(
            f"{op}: loading from {src.buffer.name.upper()}: source {_describe(src)} must be an HBM tensor; "
            "nl.load moves HBM -> SBUF (copy between on-chip tiles with nisa.tensor_copy)"
        )
    out = allocate(op, src.shape, dtype or src.dtype, sbuf)
    count_dma(op, out, src)
    write(op, out, read(op, "src", src), src_dtype=src.dtype)
    return out


def load_transpose2d(src, dtype=None, **kwargs):
    """Load a 2-D HBM tensor ``[F, P]`` into a new SBUF tile ``[P, F]``."""
    op = "nl.load_transpose2d"
    require_tensor(op, "src", src)
    if src.buffer.on_chip or src.ndim != 2:
        raise NkiSimError(f"{op}: source must be a 2-D HBM tensor, got {_describe(src)}")
    out = allocate(op, (src.shape[1], src.shape[0]), dtype or src.dtype, sbuf)
    count_dma(op, out, src)
    write(op, out, read(op, "src", src).T, src_dtype=src.dtype)
    return out


def store(dst, value, **kwargs):
    """Copy an SBUF tile into an HBM tensor (view) of the same shape."""
    op = "nl.store"
    if "mask" in kwargs:
        raise NkiSimError(f"{op}: mask= is not part of the NKI 0.3+ API; slice the destination instead")
    require_tensor(op, "dst", dst)
    require_tensor(op, "value", value)
    if dst.buffer.on_chip:
        raise NkiSimError(f"{op}: destination {_describe(dst)} must be an HBM tensor (nl.store moves SBUF -> HBM)")
    if value.buffer.kind == "psum":
        raise NkiSimError(
            f"{op}: store from PSUM: copy it to SBUF with nisa.tensor_copy first (value {_describe(value)})"
        )
    if not value.buffer.on_chip:
        raise NkiSimError(f"{op}: value {_describe(value)} is in HBM; store takes an SBUF tile")
    check_copy_shapes(op, "dst", dst, "value", value)
    count_dma(op, dst, value)
    write(op, dst, read(op, "value", value), src_dtype=value.dtype)


# ------------------------------------------------------------------------------------------- loops and indexing


def affine_range(start, stop=None, step=1):
    """Loop iterator over independent iterations (runs sequentially in the simulator)."""
    return range(start, stop, step) if stop is not None else range(start)


def sequential_range(start, stop=None, step=1):
    """Loop iterator with a loop-carried dependence."""
    return range(start, stop, step) if stop is not None else range(start)


def static_range(start, stop=None, step=1):
    """Fully unrolled loop iterator."""
    return range(start, stop, step) if stop is not None else range(start)


def ds(start, size):
    """A dynamic slice ``start:start+size`` (start is a compile-time int in the simulator)."""
    return slice(start, start + size)


def arange(start, stop=None, step=1):
    """An index vector for ``nl.arange``-style indexing (``x[nl.arange(128)[:, None], nl.arange(512)[None, :]]``)."""
    if stop is None:
        return np.arange(start)
    return np.arange(start, stop, step)


class _MGrid:
    def __getitem__(self, key):
        if not isinstance(key, tuple):
            key = (key,)
        return tuple(np.ogrid[key])


mgrid = _MGrid()


def program_id(axis=0):
    """Index of the current SPMD program along ``axis`` (0 outside a grid launch)."""
    ctx = current()
    if not ctx.grid:
        return 0
    return ctx.pid[axis]


def num_programs(axes=None):
    """Number of SPMD programs along ``axes`` (all axes multiplied when None)."""
    ctx = current()
    grid = ctx.grid or (1,)
    if axes is None:
        n = 1
        for g in grid:
            n *= g
        return n
    if isinstance(axes, int):
        return grid[axes]
    n = 1
    for a in axes:
        n *= grid[a]
    return n


def program_ndim():
    return len(current().grid)


def device_print(print_prefix, tensor):
    """Print a tensor's values (the simulator prints at once)."""
    require_tensor("nl.device_print", "tensor", tensor)
    print(print_prefix, read("nl.device_print", "tensor", tensor))


# ------------------------------------------------------------------------------------------- math on tiles


def _tag(name: str):
    def deco(f):
        f._nki_op = OpSpec(name)
        return f

    return deco


def _unary(name: str, op: str):
    def f(x, dtype=None, **kwargs):
        if "mask" in kwargs:
            raise NkiSimError(f"{op}: mask= is not part of the NKI 0.3+ API")
        require_on_chip(op, "x", x)
        out = allocate(op, x.shape, dtype or x.dtype, sbuf)
        scalar = OpSpec(name).is_activation
        count_instr("scalar" if scalar else "vector", op, x, out)
        v = engine_in(op, "x", x)
        y = alu.apply_unary(name, v)
        write(op, out, activation_result(name, v, y, current().numerics) if scalar else y)
        return out

    f.__name__ = name
    f.__qualname__ = name
    f.__doc__ = f"Elementwise {name} of a tile, as a new SBUF tile (optionally of ``dtype``)."
    f._nki_op = OpSpec(name)
    return f


def broadcast_operands(op: str, x, y):
    """Values of two nl.* operands and the result shape; only a scalar broadcasts."""
    xt, yt = isinstance(x, NkiTensor), isinstance(y, NkiTensor)
    if not xt and not yt:
        raise NkiSimError(f"{op}: at least one operand must be a tile")
    for nm, v, is_t in (("x", x, xt), ("y", y, yt)):
        if is_t:
            require_on_chip(op, nm, v)
        elif not isinstance(v, numbers.Number):
            raise NkiSimError(f"{op}: operand {nm} must be a tile or a scalar, got {type(v).__name__}")
    if xt and yt:
        xs, ys = tuple(x.shape), tuple(y.shape)
        if xs == ys:
            shape = xs
        else:
            raise NkiSimError(
                f"{op}: broadcasting {xs} against {ys}: binary nl.* operations do not broadcast (NKI 0.3 release "
                "notes); operands must have the same shape, or one a scalar (a [P, 1] column goes through "
                "nisa.tensor_scalar)"
            )
        return engine_in(op, "x", x), engine_in(op, "y", y), shape, _dt.promote(x.dtype, y.dtype)
    if xt:
        return engine_in(op, "x", x), np.float32(y), tuple(x.shape), x.dtype
    return np.float32(x), engine_in(op, "y", y), tuple(y.shape), y.dtype


def _binary(name: str, op: str):
    def f(x, y, dtype=None, **kwargs):
        if "mask" in kwargs:
            raise NkiSimError(f"{op}: mask= is not part of the NKI 0.3+ API")
        xv, yv, shape, rdt = broadcast_operands(op, x, y)
        out = allocate(op, shape, dtype or rdt, sbuf)
        count_instr("vector", op, out)
        write(op, out, np.broadcast_to(alu.apply_binary(name, xv, yv), shape))
        return out

    f.__name__ = name
    f.__qualname__ = name
    f.__doc__ = f"Elementwise {name} of two tiles (or a tile and a scalar / [P, 1] tile), as a new SBUF tile."
    f._nki_op = OpSpec(name)
    return f


copy = _unary("copy", "nl.copy")
exp = _unary("exp", "nl.exp")
log = _unary("log", "nl.log")
sqrt = _unary("sqrt", "nl.sqrt")
rsqrt = _unary("rsqrt", "nl.rsqrt")
reciprocal = _unary("reciprocal", "nl.reciprocal")
square = _unary("square", "nl.square")
sigmoid = _unary("sigmoid", "nl.sigmoid")
silu = _unary("silu", "nl.silu")
silu_dx = _unary("silu_dx", "nl.silu_dx")
gelu = _unary("gelu", "nl.gelu")
gelu_dx = _unary("gelu_dx", "nl.gelu_dx")
gelu_apprx_tanh = _unary("gelu_apprx_tanh", "nl.gelu_apprx_tanh")
relu = _unary("relu", "nl.relu")
tanh = _unary("tanh", "nl.tanh")
softplus = _unary("softplus", "nl.softplus")
mish = _unary("mish", "nl.mish")
erf = _unary("erf", "nl.erf")
erf_dx = _unary("erf_dx", "nl.erf_dx")
sin = _unary("sin", "nl.sin")
cos = _unary("cos", "nl.cos")
tan = _unary("tan", "nl.tan")
arctan = _unary("arctan", "nl.arctan")
sign = _unary("sign", "nl.sign")
abs = _unary("abs", "nl.abs")  # noqa: A001
negative = _unary("negative", "nl.negative")
floor = _unary("floor", "nl.floor")
ceil = _unary("ceil", "nl.ceil")
trunc = _unary("trunc", "nl.trunc")
logical_not = _unary("logical_not", "nl.logical_not")

add = _binary("add", "nl.add")
subtract = _binary("subtract", "nl.subtract")
multiply = _binary("multiply", "nl.multiply")
maximum = _binary("maximum", "nl.maximum")
minimum = _binary("minimum", "nl.minimum")
power = _binary("power", "nl.power")
equal = _binary("equal", "nl.equal")
not_equal = _binary("not_equal", "nl.not_equal")
greater = _binary("greater", "nl.greater")
greater_equal = _binary("greater_equal", "nl.greater_equal")
less = _binary("less", "nl.less")
less_equal = _binary("less_equal", "nl.less_equal")
logical_and = _binary("logical_and", "nl.logical_and")
logical_or = _binary("logical_or", "nl.logical_or")
logical_xor = _binary("logical_xor", "nl.logical_xor")
bitwise_and = _binary("bitwise_and", "nl.bitwise_and")
bitwise_or = _binary("bitwise_or", "nl.bitwise_or")
bitwise_xor = _binary("bitwise_xor", "nl.bitwise_xor")
left_shift = _binary("left_shift", "nl.left_shift")
right_shift = _binary("right_shift", "nl.right_shift")


def reduce_axes(op: str, shape, axis) -> tuple[int, ...]:
    """Validated reduction axes: free axes only, the trailing contiguous ones."""
    nd = len(shape)
    axes = (axis,) if isinstance(axis, numbers.Integral) else tuple(axis)
    if not axes:
        raise NkiSimError(f"{op}: axis must name at least one free axis")
    axes = tuple(sorted(int(a) + nd if int(a) < 0 else int(a) for a in axes))
    if 0 in axes:
        raise NkiSimError(
            f"{op}: cannot reduce over the partition axis 0 (axis={axis}, data shape {tuple(shape)}); only free "
            "axes reduce on the engines: transpose with nisa.nc_transpose or use an nc_matmul with a ones vector"
        )
    if builtins.any(a >= nd for a in axes) or axes != tuple(range(axes[0], nd)):
        raise NkiSimError(
            f"{op}: axis={axis} must be the last contiguous free axes of a rank-{nd} tile (e.g. {nd - 1}, or "
            f"({', '.join(str(a) for a in range(1, nd))}))"
        )
    return axes


def _reduction(name: str, op: str, mean_: bool = False):
    def f(x, axis, dtype=None, keepdims=False, **kwargs):
        if "mask" in kwargs:
            raise NkiSimError(f"{op}: mask= is not part of the NKI 0.3+ API")
        require_on_chip(op, "x", x)
        axes = reduce_axes(op, x.shape, axis)
        count_instr("vector", op, x)
        v = alu.apply_reduce(name, engine_in(op, "x", x), axes, keepdims)
        if mean_:
            n = 1
            for a in axes:
                n *= x.shape[a]
            v = v / np.float32(n)
        out = allocate(op, v.shape if v.ndim else (x.shape[0],), dtype or x.dtype, sbuf)
        write(op, out, v)
        return out

    f.__name__ = op.split(".")[-1]
    f.__doc__ = f"{name} reduction of a tile over free axes, as a new SBUF tile."
    f._nki_op = OpSpec(name)
    return f


sum = _reduction("add", "nl.sum")  # noqa: A001
prod = _reduction("multiply", "nl.prod")
max = _reduction("maximum", "nl.max")  # noqa: A001
min = _reduction("minimum", "nl.min")  # noqa: A001
mean = _reduction("add", "nl.mean", mean_=True)
mean._nki_op = None  # not an ALU operator


def invert(x, dtype=None):
    raise NkiSimUnsupported("nl.invert is not implemented by mhcrun's NKI simulator")


invert._nki_op = OpSpec("invert")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NkiSimUnsupported(
        f"nki.language.{name} is not implemented by mhcrun's NKI simulator (it simulates the subset listed in "
        "shared/spec/nki.md)"
    )
