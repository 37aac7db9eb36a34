"""Simulated memory: buffers, tensors and views, written-element tracking, and the per-run context.

A tensor is a view of a storage (one allocation: values plus a bool "written" mask of the same shape, and for
PSUM two more masks: "written by a matmul" and "read since the last matmul write"). Integer/slice indexing
makes numpy views, so reads and writes go through to the parent; indexing with integer arrays
(``nl.arange`` / ``nl.mgrid`` grids) makes an indexed view that reads and writes its parent through the key.
"""

from __future__ import annotations

import itertools
import numbers
import threading
import weakref

import numpy as np

from . import dtypes as dt
from . import target as tg
from .costs import CostLog
from .errors import NkiSimError, NkiSimUnsupported
from .memory import MemoryTracker

PMAX = tg.PMAX
PSUM_FMAX = tg.PSUM_BANK_FP32
GEMM_STATIONARY_FMAX = 128
GEMM_MOVING_FMAX = 512
SBUF_PARTITION_BYTES = tg.SBUF_PARTITION_BYTES


class Buffer:
    """A memory region: ``nl.sbuf``, ``nl.psum``, ``nl.shared_hbm``, ``nl.private_hbm`` (``nl.hbm``)."""

    __slots__ = ("name", "kind")

    def __init__(self, name: str, kind: str):
        self.name = name
        self.kind = kind  # "sbuf" | "psum" | "hbm"

    def __repr__(self) -> str:
        return self.name

    @property
    def on_chip(self) -> bool:
        return self.kind != "hbm"


sbuf = Buffer("sbuf", "sbuf")
psum = Buffer("psum", "psum")
shared_hbm = Buffer("shared_hbm", "hbm")
private_hbm = Buffer("private_hbm", "hbm")
hbm = private_hbm


class Shape(tuple):
    """A tensor shape: a tuple that also compares equal to the same list (``x.shape == [128, 512]``)."""

    def __eq__(self, other):
        if isinstance(other, list):
            other = tuple(other)
        return tuple.__eq__(self, other)

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = tuple.__hash__


def _fmt_shape(shape) -> str:
    return str(tuple(int(s) for s in shape))


def free_size(shape) -> int:
    n = 1
    for s in shape[1:]:
        n *= int(s)
    return n


# --------------------------------------------------------------------------------------------- context


class SimContext:
    """State of one kernel run (one SPMD program): program ids, engine reduce registers, shared allocations."""

    def __init__(self, grid: tuple[int, ...] = (), pid: tuple[int, ...] = (), shared: list | None = None,
                 numerics: str = "exact"):
        self.grid = grid
        self.numerics = numerics
        self.memory = MemoryTracker()
        self.costs = CostLog()
        self.pid = pid
        self.shared = shared if shared is not None else []  # shared_hbm allocations, in allocation order
        self.shared_i = 0
        self.act_regs = np.zeros(PMAX, dtype=np.float32)
        self.act_valid = np.zeros(PMAX, dtype=bool)
        self.vec_regs = np.zeros(PMAX, dtype=np.float32)
        self.vec_valid = np.zeros(PMAX, dtype=bool)
        self.names = itertools.count()


_local = threading.local()


def current() -> SimContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        ctx = SimContext()
        _local.ctx = ctx
    return ctx


def push(ctx: SimContext):
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    return prev


def pop(prev) -> None:
    _local.ctx = prev


# --------------------------------------------------------------------------------------------- storage


class Storage:
    """One allocation."""

    __slots__ = ("name", "buffer", "dtype", "data", "written", "mm", "consumed", "modified", "bank", "nbanks",
                 "__weakref__")

    def __init__(self, name: str, buffer: Buffer, dtype: str, data: np.ndarray, written: bool):
        self.name = name
        self.buffer = buffer
        self.dtype = dtype
        self.data = data
        self.written = np.full(data.shape, written, dtype=bool)
        if buffer.kind == "psum":
            self.mm = np.zeros(data.shape, dtype=bool)  # written by nc_matmul (accumulation may follow)
            self.consumed = np.zeros(data.shape, dtype=bool)  # read since the last matmul write
        else:
            self.mm = None
            self.consumed = None
        self.modified = False
        self.bank = 0  # PSUM: first bank and number of banks of the tile
        self.nbanks = 0


def _check_alloc(op: str, shape, dtype: str, buffer: Buffer) -> None:
    if buffer.kind == "hbm":
        return
    if len(shape) < 1:
        raise NkiSimError(f"{op}: an {buffer.name} tile needs a partition axis (shape {_fmt_shape(shape)})")
    if shape[0] > PMAX:
        raise NkiSimError(
            f"{op}: tile of {shape[0]} partitions exceeds nl.tile_size.pmax ({PMAX}): the first axis of an "
            f"{buffer.name} tile is the partition axis (shape {_fmt_shape(shape)}, buffer {buffer.name})"
        )
    fsize = free_size(shape)
    if buffer.kind == "psum":
        if dtype != dt.float32:
            raise NkiSimError(
                f"{op}: PSUM tile must be float32, got {dtype} (shape {_fmt_shape(shape)}); PSUM holds fp32 "
                "accumulators: allocate the tile as nl.float32 and convert with nisa.tensor_copy into SBUF"
            )
        if fsize * 4 > tg.PSUM_PARTITION_BYTES:
            raise NkiSimError(
                f"{op}: PSUM tile of {fsize * 4} bytes per partition exceeds a PSUM partition "
                f"({tg.PSUM_BANKS} banks x {tg.PSUM_BANK_BYTES} bytes) (shape {_fmt_shape(shape)})"
            )
    else:
        nbytes = fsize * dt.info(dtype).itemsize
        if nbytes > SBUF_PARTITION_BYTES:
            raise NkiSimError(
                f"{op}: SBUF tile needs {nbytes} bytes per partition, more than an SBUF partition holds "
                f"({SBUF_PARTITION_BYTES}) (shape {_fmt_shape(shape)}, dtype {dtype})"
            )


def _norm_shape(op: str, shape) -> tuple[int, ...]:
    if isinstance(shape, numbers.Integral):
        shape = (shape,)
    try:
        out = tuple(shape)
    except TypeError:
        raise NkiSimError(f"{op}: shape must be a tuple of ints, got {shape!r}") from None
    for s in out:
        if isinstance(s, NkiTensor) or not isinstance(s, numbers.Integral) or isinstance(s, bool):
            raise NkiSimError(f"{op}: shape must be a tuple of compile-time ints, got {shape!r}")
        if s <= 0:
            raise NkiSimError(f"{op}: shape dimensions must be positive, got {shape!r}")
    return tuple(int(s) for s in out)


def allocate(op: str, shape, dtype, buffer, name: str = "") -> NkiTensor:
    """A new uninitialised tensor (every element unwritten)."""
    shape = _norm_shape(op, shape)
    dtype = dt.normalize(dtype, op)
    if buffer is None or buffer is Ellipsis:
        buffer = sbuf
    if not isinstance(buffer, Buffer):
        raise NkiSimError(f"{op}: buffer must be nl.sbuf, nl.psum, nl.shared_hbm or nl.hbm, got {buffer!r}")
    _check_alloc(op, shape, dtype, buffer)
    ctx = current()
    if buffer is shared_hbm and ctx.grid:
        # SPMD: every program sees the same shared_hbm tensor (matched by allocation order).
        i = ctx.shared_i
        ctx.shared_i += 1
        if i < len(ctx.shared):
            st = ctx.shared[i]
            if st.data.shape != shape or st.dtype != dtype:
                raise NkiSimError(
                    f"{op}: shared_hbm allocation #{i} differs between SPMD programs "
                    f"({_fmt_shape(st.data.shape)} {st.dtype} vs {_fmt_shape(shape)} {dtype})"
                )
            return NkiTensor._whole(st)
    if not name:
        name = f"{buffer.name}_{next(ctx.names)}"
    st = Storage(name, buffer, dtype, np.zeros(shape, dtype=dt.storage_type(dtype)), written=False)
    if buffer is shared_hbm and ctx.grid:
        ctx.shared.append(st)
    if buffer.on_chip:
        _track(op, ctx.memory, st, free_size(shape) * dt.info(dtype).itemsize)
    return NkiTensor._whole(st)


def _track(op: str, mem: MemoryTracker, st: Storage, nbytes: int) -> None:
    """Count an on-chip tile as live until the simulator drops its last reference."""
    what = f"tile '{st.name}' {_fmt_shape(st.data.shape)} {st.dtype}"
    if st.buffer.kind == "sbuf":
        mem.alloc_sbuf(op, nbytes, what)
        weakref.finalize(st, mem.free_sbuf, nbytes)
    else:
        st.bank, st.nbanks = mem.alloc_psum(op, nbytes, what)
        weakref.finalize(st, mem.free_psum, id(st), st.bank, st.nbanks, nbytes)


def from_array(arr: np.ndarray, dtype: str, buffer: Buffer, name: str) -> NkiTensor:
    """A fully written tensor holding ``arr`` (already in the storage form of ``dtype``)."""
    st = Storage(name, buffer, dtype, arr, written=True)
    return NkiTensor._whole(st)


# --------------------------------------------------------------------------------------------- tensors


def _control_flow_error(t: NkiTensor, what: str):
    return NkiSimError(
        f"{what} on tensor '{t.name}' (shape {_fmt_shape(t.shape)}, {t.buffer.name}): NKI kernels cannot use "
        "tensor values in Python control flow or conversions; tensor values exist only on the device. Use "
        "nl.*/nisa.* operations (masks via comparisons such as nl.greater, selection via arithmetic)"
    )


class NkiTensor:
    """A simulated NKI tensor (or a view of one) in HBM, SBUF or PSUM."""

    __slots__ = ("_st", "_d", "_w", "_m", "_c", "_key", "_ro", "shape", "dtype", "buffer", "name")

    @classmethod
    def _whole(cls, st: Storage) -> NkiTensor:
        t = object.__new__(cls)
        t._st = st
        t._d, t._w, t._m, t._c = st.data, st.written, st.mm, st.consumed
        t._key = Ellipsis
        t._ro = False
        t.shape = Shape(st.data.shape)
        t.dtype = st.dtype
        t.buffer = st.buffer
        t.name = st.name
        return t

    def _derive(self, d, w, m, c, key, ro: bool, shape) -> NkiTensor:
        t = object.__new__(type(self))
        t._st = self._st
        t._d, t._w, t._m, t._c = d, w, m, c
        t._key = key
        t._ro = ro
        t.shape = Shape(int(s) for s in shape)
        t.dtype = self.dtype
        t.buffer = self.buffer
        t.name = self.name
        return t

    # ---- plain attributes

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def size(self) -> int:
        _since("NkiTensor.size", "multiply the shape's entries")
        return self._numel()

    @property
    def itemsize(self) -> int:
        return dt.info(self.dtype).itemsize

    def __repr__(self) -> str:
        return f"NkiTensor('{self.name}', shape={_fmt_shape(self.shape)}, dtype={self.dtype}, buffer={self.buffer})"

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    # ---- indexing

    def __getitem__(self, key) -> NkiTensor:
        if self._key is not Ellipsis:
            raise NkiSimError(
                f"indexing tensor '{self.name}' again after indexing it with index arrays (nl.arange/nl.mgrid) "
                "is not supported by the simulator; index once with the full expression"
            )
        if not isinstance(key, tuple):
            key = (key,)
        key = _normalize_key(self, key)
        if any(isinstance(k, np.ndarray) for k in key):
            idx = tuple(key)
            try:
                shape = self._d[idx].shape
            except IndexError as e:
                raise NkiSimError(f"index on tensor '{self.name}' {_fmt_shape(self.shape)}: {e}") from None
            if 0 in shape:
                raise NkiSimError(f"index on tensor '{self.name}' {_fmt_shape(self.shape)} selects no element")
            v = self._derive(self._d, self._w, self._m, self._c, idx, self._ro, shape)
        else:
            idx = tuple(key)
            d = self._d[idx]
            v = self._derive(
                d,
                self._w[idx],
                None if self._m is None else self._m[idx],
                None if self._c is None else self._c[idx],
                Ellipsis,
                self._ro,
                d.shape,
            )
        return v

    def __setitem__(self, key, value):
        raise NkiSimError(
            f"item assignment into tensor '{self.name}' is not an NKI operation in the simulator; write tiles "
            "with nisa.* instructions (nisa.tensor_copy, nisa.dma_copy) or nl.store"
        )

    # ---- views the real NkiTensor offers

    def reshape(self, *shape) -> NkiTensor:
        if len(shape) == 1 and not isinstance(shape[0], numbers.Integral):
            shape = tuple(shape[0])
        shape = tuple(int(s) for s in shape)
        if self._key is not Ellipsis:
            raise NkiSimError(f"reshape of tensor '{self.name}' indexed with index arrays is not supported")
        if int(np.prod(shape)) != self._numel():
            raise NkiSimError(f"reshape of tensor '{self.name}' {_fmt_shape(self.shape)} into {shape}: sizes differ")
        if self.buffer.on_chip and (not shape or shape[0] != self.shape[0]):
            raise NkiSimError(
                f"reshape of {self.buffer.name} tile '{self.name}' {_fmt_shape(self.shape)} into {shape} would change "
                "the partition axis (axis 0); only the free axes of an on-chip tile can be reshaped"
            )
        arrs = []
        for a in (self._d, self._w, self._m, self._c):
            if a is None:
                arrs.append(None)
                continue
            v = a.view()
            try:
                v.shape = shape
            except AttributeError:
                raise NkiSimError(
                    f"reshape of tensor '{self.name}' view {_fmt_shape(self.shape)} into {shape} needs a contiguous "
                    "view (it would copy); reshape the whole tensor, then slice"
                ) from None
            arrs.append(v)
        return self._derive(*arrs, Ellipsis, self._ro, shape)

    def expand_dim(self, dim: int) -> NkiTensor:
        if self._key is not Ellipsis:
            raise NkiSimError(f"expand_dim of tensor '{self.name}' indexed with index arrays is not supported")
        if self.buffer.on_chip and dim == 0:
            raise NkiSimError(f"expand_dim(0) on {self.buffer.name} tile '{self.name}' would move the partition axis")
        arrs = [None if a is None else np.expand_dims(a, dim) for a in (self._d, self._w, self._m, self._c)]
        return self._derive(*arrs, Ellipsis, self._ro, arrs[0].shape)

    def broadcast(self, dim: int, size: int) -> NkiTensor:
        _since("NkiTensor.broadcast", "a stride-0 access pattern, t.ap(pattern=[[0, n], [1, f]])")
        if self._key is not Ellipsis:
            raise NkiSimError(f"broadcast of tensor '{self.name}' indexed with index arrays is not supported")
        if self.buffer.on_chip and dim == 0:
            raise NkiSimError(
                f"broadcast along axis 0 of {self.buffer.name} tile '{self.name}': the partition axis cannot be "
                "broadcast by an access pattern"
            )
        if self.shape[dim] != 1:
            raise NkiSimError(
                f"broadcast of tensor '{self.name}' {_fmt_shape(self.shape)}: axis {dim} has size {self.shape[dim]}, "
                "only a size-1 axis can be broadcast"
            )
        shape = list(self.shape)
        shape[dim] = int(size)
        arrs = [None if a is None else np.broadcast_to(a, shape) for a in (self._d, self._w, self._m, self._c)]
        return self._derive(*arrs, Ellipsis, True, shape)

    def ap(self, pattern, offset=None) -> NkiTensor:
        """A view of this tensor's storage through an explicit access pattern: ``pattern`` lists ``[stride, count]``
        pairs in elements, outermost (the partition axis of an on-chip tensor) first; ``offset`` (elements) defaults
        to this view's own offset. A stride of 0 repeats (broadcasts) and makes the view read-only."""
        op = "NkiTensor.ap"
        if self._key is not Ellipsis:
            raise NkiSimError(f"{op} on tensor '{self.name}' indexed with index arrays is not supported")
        try:
            pairs = [(int(s), int(n)) for s, n in pattern]
        except (TypeError, ValueError):
            raise NkiSimError(f"{op}: pattern must be a list of [stride, count] pairs, got {pattern!r}") from None
        if not pairs or any(n < 1 or s < 0 for s, n in pairs):
            raise NkiSimError(f"{op}: pattern needs [stride >= 0, count >= 1] pairs, got {pattern!r}")
        st = self._st
        flat_size = st.data.size
        row = free_size(st.data.shape)
        if self.buffer.on_chip and pairs[0][0] != row:
            raise NkiSimError(
                f"{op}: the partition stride of an on-chip access pattern must be the storage's free size ({row}), "
                f"got {pairs[0][0]} (tensor '{self.name}' {_fmt_shape(st.data.shape)})"
            )
        base = st.data.__array_interface__["data"][0]
        here = self._d.__array_interface__["data"][0]
        item = st.data.itemsize
        off = (here - base) // item if offset is None else int(offset)
        last = off + sum((n - 1) * s for s, n in pairs)
        if off < 0 or last >= flat_size:
            raise NkiSimError(
                f"{op}: pattern {pattern!r} at offset {off} reaches element {last} of tensor '{self.name}', which "
                f"holds {flat_size}"
            )
        shape = tuple(n for _, n in pairs)
        strides = tuple(s * item for s, _ in pairs)
        arrs = []
        for a in (st.data, st.written, st.mm, st.consumed):
            if a is None:
                arrs.append(None)
                continue
            flat = a.reshape(-1)
            arrs.append(np.lib.stride_tricks.as_strided(flat[off:], shape=shape,
                                                        strides=tuple(s * a.itemsize for s, _ in pairs)))
        del strides
        ro = any(s == 0 for s, _ in pairs) or self._ro
        return self._derive(*arrs, Ellipsis, ro, shape)

    # ---- no Python control flow / conversions / operators on device values

    def __bool__(self):
        raise _control_flow_error(self, "Python truth test (if/while/and/or/not)")

    def __float__(self):
        raise _control_flow_error(self, "float() conversion")

    def __int__(self):
        raise _control_flow_error(self, "int() conversion")

    def __index__(self):
        raise _control_flow_error(self, "use as a Python index")

    def __complex__(self):
        raise _control_flow_error(self, "complex() conversion")

    def __iter__(self):
        raise _control_flow_error(self, "Python iteration")

    def __array__(self, *args, **kwargs):
        raise _control_flow_error(self, "conversion to a numpy array")

    def __eq__(self, other):
        raise _control_flow_error(self, "Python comparison ==")

    def __ne__(self, other):
        raise _control_flow_error(self, "Python comparison !=")

    def __lt__(self, other):
        raise _control_flow_error(self, "Python comparison <")

    def __le__(self, other):
        raise _control_flow_error(self, "Python comparison <=")

    def __gt__(self, other):
        raise _control_flow_error(self, "Python comparison >")

    def __ge__(self, other):
        raise _control_flow_error(self, "Python comparison >=")

    __hash__ = object.__hash__

    def _arith(self, *args):
        raise NkiSimError(
            f"Python arithmetic operators on tensor '{self.name}' are not simulated: use nl.add / nl.subtract / "
            "nl.multiply / nl.maximum ... or nisa.tensor_tensor / nisa.tensor_scalar (there is no division: "
            "multiply by nl.reciprocal)"
        )

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _arith
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _arith
    __pow__ = __rpow__ = __matmul__ = __rmatmul__ = __neg__ = __pos__ = __abs__ = _arith
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = __invert__ = _arith
    __lshift__ = __rlshift__ = __rshift__ = __rrshift__ = _arith

    # ---- internal access used by the ops

    def _values(self) -> np.ndarray:
        return self._d[self._key]

    def _written(self) -> np.ndarray:
        return self._w[self._key]

    def _store(self, values: np.ndarray, matmul: bool = False) -> None:
        if self._ro:
            raise NkiSimError(f"cannot write through a broadcast view of tensor '{self.name}'")
        k = self._key
        self._d[k] = values
        self._w[k] = True
        if self._m is not None:
            self._m[k] = matmul
            self._c[k] = False
        self._st.modified = True


def _since(api: str, instead: str) -> None:
    """Refuse API that the NKI version the kernels target (``target.NKI_API``) does not have yet."""
    since = tg.API_SINCE[api]
    if tg.NKI_API < since:
        raise NkiSimUnsupported(
            f"{api} arrived in {tg.version_name(since)}; mhcrun's kernels target {tg.NKI_API_NAME}: use {instead}"
        )


def _normalize_key(t: NkiTensor, key: tuple) -> list:
    """Bounds-checked index components: ints, slices (step >= 1) and integer index arrays."""
    out: list = []
    ax = 0
    n_ell = sum(1 for k in key if k is Ellipsis)
    if n_ell > 1:
        raise NkiSimError(f"index on tensor '{t.name}': more than one Ellipsis")
    n_used = sum(1 for k in key if k is not Ellipsis and k is not None)
    if n_used > t.ndim:
        raise NkiSimError(f"too many indices for tensor '{t.name}' of shape {_fmt_shape(t.shape)}: {len(key)}")
    for k in key:
        if k is Ellipsis:
            fill = t.ndim - n_used
            out.extend([slice(None)] * fill)
            ax += fill
            continue
        if k is None:
            raise NkiSimError(f"index on tensor '{t.name}': new axes (None) are not supported; use expand_dim")
        size = t.shape[ax]
        if isinstance(k, NkiTensor):
            raise NkiSimError(
                f"index on tensor '{t.name}' with tensor '{k.name}': dynamic (tensor-valued) indexing is not "
                "supported by the simulator"
            )
        if isinstance(k, slice):
            start, stop, step = k.start, k.stop, k.step
            for part in (start, stop, step):
                if part is not None and (isinstance(part, NkiTensor) or not isinstance(part, numbers.Integral)):
                    raise NkiSimError(f"index on tensor '{t.name}': slice bounds must be ints, got {k!r}")
            start = 0 if start is None else int(start)
            stop = size if stop is None else int(stop)
            step = 1 if step is None else int(step)
            if step < 1:
                raise NkiSimError(f"index on tensor '{t.name}': slice step must be >= 1, got {k!r}")
            if start < 0 or stop > size or start > stop:
                raise NkiSimError(
                    f"index out of bounds: slice {start}:{stop} on axis {ax} of size {size} "
                    f"(tensor '{t.name}' shape {_fmt_shape(t.shape)})"
                )
            if start == stop:
                raise NkiSimError(
                    f"empty slice {start}:{stop} on axis {ax} of tensor '{t.name}' (shape {_fmt_shape(t.shape)})"
                )
            out.append(slice(start, stop, step))
        elif isinstance(k, numbers.Integral) and not isinstance(k, bool):
            k = int(k)
            if k < 0 or k >= size:
                raise NkiSimError(
                    f"index out of bounds: {k} on axis {ax} of size {size} "
                    f"(tensor '{t.name}' shape {_fmt_shape(t.shape)})"
                )
            out.append(k)
        else:
            a = np.asarray(k)
            if a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
                raise NkiSimError(f"index on tensor '{t.name}': unsupported index {k!r}")
            if a.size and (a.min() < 0 or a.max() >= size):
                raise NkiSimError(
                    f"index out of bounds: index array with range [{a.min()}, {a.max()}] on axis {ax} of size "
                    f"{size} (tensor '{t.name}' shape {_fmt_shape(t.shape)})"
                )
            out.append(a)
        ax += 1
    return out


# --------------------------------------------------------------------------------------------- op helpers


def describe(t: NkiTensor) -> str:
    return f"'{t.name}' {_fmt_shape(t.shape)} {t.dtype} in {t.buffer.name}"


def require_tensor(op: str, arg: str, t) -> NkiTensor:
    if not isinstance(t, NkiTensor):
        raise NkiSimError(f"{op}: {arg} must be an NKI tensor, got {type(t).__name__}")
    return t


def require_on_chip(op: str, arg: str, t) -> NkiTensor:
    require_tensor(op, arg, t)
    if not t.buffer.on_chip:
        raise NkiSimError(
            f"{op}: compute on HBM: {arg} {describe(t)} is an HBM tensor; the engines only read and write SBUF/PSUM "
            "tiles: bring it into SBUF with nl.load or nisa.dma_copy first"
        )
    if t.ndim < 1 or t.shape[0] > PMAX:
        raise NkiSimError(
            f"{op}: {arg} {describe(t)} has {t.shape[0] if t.ndim else 0} partitions; the partition axis (axis 0) "
            f"of an engine operand must be 1..{PMAX}"
        )
    p0 = partition_start(t)
    starts = tg.allowed_partition_starts(t.shape[0])
    if p0 not in starts:
        raise NkiSimError(
            f"{op}: {arg} {describe(t)} starts at partition {p0}; an engine operand of {t.shape[0]} partitions may "
            f"start only at {', '.join(str(s) for s in starts)} on {tg.TARGET}"
        )
    return t


def _view_offset(t: NkiTensor) -> int:
    """Offset in bytes of the view's first element from its storage's start (numpy storage bytes)."""
    return t._d.__array_interface__["data"][0] - t._st.data.__array_interface__["data"][0]


def partition_start(t: NkiTensor) -> int:
    """The partition at which an on-chip view starts."""
    p0 = _view_offset(t) // t._st.data.strides[0] if t._st.data.ndim > 0 and t._st.data.strides[0] else 0
    if t._key is not Ellipsis:
        k0 = t._key[0]
        if isinstance(k0, np.ndarray):
            p0 += int(k0.min())
        elif isinstance(k0, slice):
            p0 += k0.start or 0
        else:
            p0 += int(k0)
    return int(p0)


def psum_banks(t: NkiTensor) -> range:
    """The PSUM banks a view of a PSUM tile touches."""
    st = t._st
    if st.nbanks <= 1:
        return range(st.bank, st.bank + 1)
    row = st.data.strides[0]
    first = _view_offset(t) % row
    last = first
    if t._key is Ellipsis:
        for n, s in zip(t._d.shape[1:], t._d.strides[1:], strict=True):
            last += (n - 1) * max(s, 0)
    else:
        last = row - 1
        first = 0
    bank = tg.PSUM_BANK_BYTES  # PSUM storage is fp32: numpy bytes are device bytes
    return range(st.bank + first // bank, st.bank + (last + 3) // bank + 1)


def read(op: str, arg: str, t: NkiTensor) -> np.ndarray:
    """The values of ``t`` for an engine read, after checking that every element was written."""
    w = t._written()
    if not w.all():
        missing = int(w.size - np.count_nonzero(w))
        raise NkiSimError(
            f"{op}: read of unwritten memory: {arg} {describe(t)} has {missing} of {w.size} elements never "
            "written (the hardware would read garbage; AWS's simulator fills new buffers with NaN)"
        )
    if t._c is not None and not t._ro:
        t._c[t._key] = True
        current().memory.close_groups(id(t._st), psum_banks(t))
    return t._values()


def engine_in(op: str, arg: str, t: NkiTensor) -> np.ndarray:
    """``read`` converted for engine math: float32 (every NKI engine computes arithmetic in fp32)."""
    v = read(op, arg, t)
    return v.astype(np.float32, copy=False)


def write(op: str, dst: NkiTensor, values: np.ndarray, src_dtype: str | None = None, matmul: bool = False) -> None:
    """Round ``values`` into ``dst``'s dtype and store them (``values`` reshaped to dst if sizes match)."""
    values = np.asarray(values)
    if tuple(values.shape) != tuple(dst.shape):
        if values.size != dst._numel():
            raise NkiSimError(f"{op}: result of shape {_fmt_shape(values.shape)} does not fit dst {describe(dst)}")
        values = values.reshape(dst.shape)
    dst._store(dt.round_to(values, dst.dtype, src_dtype), matmul=matmul)


def count_instr(engine: str, op: str, t: NkiTensor, *others: NkiTensor, contraction: int = 0) -> None:
    """Log one engine instruction over tile ``t`` (its partitions and elements per partition) for the cost model."""
    item = max([dt.info(t.dtype).itemsize] + [dt.info(o.dtype).itemsize for o in others])
    current().costs.instr(engine, op, t.shape[0] if t.ndim else 1, free_size(t.shape), item, contraction)


def count_dma(op: str, dst: NkiTensor, src: NkiTensor) -> None:
    """Log one DMA transfer: the destination's bytes, over the partitions of its on-chip side."""
    chip = dst if dst.buffer.on_chip else src
    parts = chip.shape[0] if chip.buffer.on_chip and chip.ndim else 1
    current().costs.dma(op, dst._numel() * dt.info(dst.dtype).itemsize, parts)


def same_layout(op: str, a_name: str, a: NkiTensor, b_name: str, b: NkiTensor) -> None:
    """The engine rule: same partition size and same number of elements per partition."""
    if a.shape[0] != b.shape[0] or free_size(a.shape) != free_size(b.shape):
        raise NkiSimError(
            f"{op}: {a_name} {describe(a)} and {b_name} {describe(b)} must have the same partition size and the "
            "same number of elements per partition"
        )
