"""Stand-in for ``nki.isa`` (``import nki.isa as nisa``) in mhcrun's NKI simulator.

NKI 0.3+ signatures: the destination tile comes first. Every instruction checks its hardware rules (buffers,
partition and free sizes, dtypes, shapes, no broadcasting where the engine has none, no read of unwritten
memory) and raises ``NkiSimError`` naming the instruction, the rule and the operands. Engine math is float32;
results are rounded into the destination's dtype on write.
"""

from __future__ import annotations

import enum
import numbers

import numpy as np

from . import alu
from . import dtypes as dt
from . import target as tg
from .errors import NkiSimError, NkiSimUnsupported
from .language import check_copy_shapes, reduce_axes
from .numerics import activation_result
from .tensor import (
    GEMM_MOVING_FMAX,
    GEMM_STATIONARY_FMAX,
    PMAX,
    NkiTensor,
    count_dma,
    count_instr,
    current,
    describe,
    engine_in,
    free_size,
    psum_banks,
    read,
    require_on_chip,
    require_tensor,
    same_layout,
    write,
)


def _engine_name(engine, default: str) -> str:
    return {1: "tensor", 2: "vector", 3: "scalar", 4: "gpsimd"}.get(getattr(engine, "value", 0), default)


def _tensor_engine_output(op: str, dst: NkiTensor) -> None:
    """A Tensor-engine result lies in one PSUM bank and opens (or continues) an accumulation group there."""
    banks = psum_banks(dst)
    if len(banks) > 1:
        raise NkiSimError(
            f"{op}: output {describe(dst)} crosses PSUM banks {banks.start}..{banks.stop - 1}; a Tensor-engine "
            f"result must lie in one bank ({tg.PSUM_BANK_BYTES} bytes = {tg.PSUM_BANK_FP32} fp32 per partition)"
        )
    current().memory.open_group(op, id(dst._st), banks.start, dst.name)


class engine(enum.Enum):  # noqa: N801
    unknown = 0
    tensor = 1
    vector = 2
    scalar = 3
    gpsimd = 4
    sync = 5


unknown_engine = engine.unknown
tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd


class reduce_cmd(enum.Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(enum.Enum):  # noqa: N801
    unknown = 0
    none = 1
    swdge = 2
    hwdge = 3


class oob_mode(enum.Enum):  # noqa: N801
    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):  # noqa: N801
    none = 0
    double_row = 1


class nc_version(enum.Enum):  # noqa: N801
    gen2 = 2
    gen3 = 3
    gen4 = 4


def get_nc_version():
    return nc_version.gen3


_MATMUL_DTYPES = frozenset({dt.float8_e4m3, dt.float8_e4m3fn, dt.float8_e5m2, dt.bfloat16, dt.float16,
                            dt.tfloat32, dt.float32})  # fmt: skip
_FP32ISH = frozenset({dt.float32, dt.tfloat32})


def _op_name(spec) -> str:
    return f"nl.{spec.name}"


def _scalar(v) -> bool:
    return isinstance(v, numbers.Number) and not isinstance(v, NkiTensor)


def _vector_operand(op: str, arg: str, v, data: NkiTensor, fp32_only: bool = True, allow_scalar: bool = True):
    """A compile-time scalar or a [P, 1] tile, as values broadcastable against ``data`` in engine math."""
    P = data.shape[0]
    if _scalar(v):
        if not allow_scalar:
            raise NkiSimError(f"{op}: {arg} must be a [{P}, 1] tile, got the scalar {v!r}")
        return np.float32(v)
    if not isinstance(v, NkiTensor):
        raise NkiSimError(f"{op}: {arg} must be a scalar or a [{P}, 1] tile, got {type(v).__name__}")
    require_on_chip(op, arg, v)
    if v.shape[0] != P or free_size(v.shape) != 1:
        raise NkiSimError(
            f"{op}: {arg} must be a compile-time scalar or a [P, 1] tile with P = data.shape[0] = {P} "
            f"(one value per partition, broadcast along the free axis); got {describe(v)}"
        )
    if fp32_only and v.dtype != dt.float32:
        raise NkiSimError(f"{op}: {arg} tile must be float32, got {describe(v)}")
    vals = engine_in(op, arg, v).reshape((P,) + (1,) * (data.ndim - 1))
    return vals


# ------------------------------------------------------------------------------------------- Tensor Engine


def nc_matmul(
    dst,
    stationary,
    moving,
    is_stationary_onezero=False,
    is_moving_onezero=False,
    is_transpose=False,
    accumulate=None,
    tile_position=(),
    tile_size=(),
    perf_mode=None,
    name=None,
):
    """``dst[M, N] (+)= stationary[K, M].T @ moving[K, N]`` on the Tensor Engine, fp32 accumulation in PSUM.

    ``accumulate=False`` overwrites, ``True`` adds onto PSUM written by an earlier nc_matmul, ``None`` (default)
    overwrites where no matmul wrote yet and accumulates where one did.
    """
    op = "nc_matmul"
    require_on_chip(op, "stationary", stationary)
    require_on_chip(op, "moving", moving)
    require_tensor(op, "dst", dst)
    for nm, t in (("stationary", stationary), ("moving", moving)):
        if t.buffer.kind != "sbuf":
            raise NkiSimError(f"{op}: {nm} must be an SBUF tile (the Tensor Engine reads SBUF only), got {describe(t)}")
    if dst.buffer.kind != "psum":
        raise NkiSimError(f"{op}: dst must be a PSUM tile (the Tensor Engine writes PSUM only), got {describe(dst)}")
    if stationary.ndim != 2:
        raise NkiSimError(f"{op}: stationary must be a 2-D [K, M] tile, got {describe(stationary)}")
    K, M = stationary.shape
    Km = moving.shape[0]
    N = free_size(moving.shape)
    if K > PMAX:
        raise NkiSimError(f"{op}: contraction size K={K} exceeds {PMAX} (stationary {describe(stationary)})")
    if Km > PMAX:
        raise NkiSimError(f"{op}: contraction size K={Km} exceeds {PMAX} (partition axis of moving {describe(moving)})")
    if K != Km:
        raise NkiSimError(
            f"{op}: contraction (partition) sizes differ: stationary K={K} ({describe(stationary)}) vs "
            f"moving K={Km} ({describe(moving)})"
        )
    if M > GEMM_STATIONARY_FMAX:
        raise NkiSimError(
            f"{op}: stationary free size {M} exceeds {GEMM_STATIONARY_FMAX} "
            f"(stationary shape {tuple(stationary.shape)})"
        )
    if N > GEMM_MOVING_FMAX:
        raise NkiSimError(f"{op}: moving free size {N} exceeds {GEMM_MOVING_FMAX} (moving shape {tuple(moving.shape)})")
    if dst.shape[0] != M or free_size(dst.shape) != N:
        raise NkiSimError(
            f"{op}: dst {describe(dst)} does not match the result [M={M}, N={N}] of stationary.T @ moving "
            f"(stationary {tuple(stationary.shape)}, moving {tuple(moving.shape)})"
        )
    for nm, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype not in _MATMUL_DTYPES:
            raise NkiSimError(
                f"{op}: {nm} dtype {t.dtype} is not a Tensor Engine input type "
                f"(fp8 / bfloat16 / float16 / tfloat32 / float32) ({describe(t)})"
            )
    if (stationary.dtype in _FP32ISH) != (moving.dtype in _FP32ISH):
        raise NkiSimError(
            f"{op}: if one operand is float32/tfloat32 the other must be too: stationary {stationary.dtype}, "
            f"moving {moving.dtype}"
        )
    _tensor_engine_output(op, dst)
    count_instr("tensor", op, moving, stationary, contraction=K)
    s = engine_in(op, "stationary", stationary)
    m = engine_in(op, "moving", moving).reshape(K, N)
    res = (s.T @ m).reshape(dst.shape)
    k = dst._key
    if accumulate is None:
        mm = dst._m[k]
        if mm.any():
            stale = mm & dst._c[k]
            if stale.any():
                raise NkiSimError(
                    f"{op}: accumulate=None on PSUM tile {describe(dst)} whose earlier matmul result was already "
                    "read: the compiler's first-write inference is ambiguous here; pass accumulate=False to start "
                    "a new accumulation (or allocate a fresh PSUM tile)"
                )
            res = np.where(mm, dst._values() + res, res)
    elif accumulate:
        w = dst._written()
        if not w.all():
            raise NkiSimError(
                f"{op}: accumulate=True into unwritten PSUM: dst {describe(dst)} has "
                f"{int(w.size - np.count_nonzero(w))} of {w.size} elements never written; start the "
                "accumulation with accumulate=False (or the default accumulate=None)"
            )
        if not dst._m[k].all():
            raise NkiSimError(
                f"{op}: accumulate=True onto PSUM {describe(dst)} that was not written by nc_matmul (memset / "
                "tensor_copy initialisation is not a valid accumulation start on NeuronCore-v2/v3)"
            )
        res = dst._values() + res
    dst._store(res.astype(np.float32, copy=False), matmul=True)


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """``dst[F, P] = data[P, F].T``: Tensor Engine (SBUF -> PSUM, up to [128, 128]) or Vector Engine ([32, 32])."""
    op = "nc_transpose"
    require_on_chip(op, "data", data)
    require_on_chip(op, "dst", dst)
    P, F = data.shape[0], free_size(data.shape)
    use_pe = engine == engine_tensor_ or (engine == engine_unknown_ and dst.buffer.kind == "psum")
    if use_pe:
        if data.buffer.kind != "sbuf" or dst.buffer.kind != "psum":
            raise NkiSimError(
                f"{op}: a Tensor Engine transpose reads SBUF and writes PSUM: data {describe(data)}, "
                f"dst {describe(dst)}"
            )
        if F > 128:
            raise NkiSimError(f"{op}: Tensor Engine transpose input is at most [128, 128], got {describe(data)}")
        _tensor_engine_output(op, dst)
    else:
        if P > 32 or F > 32:
            raise NkiSimError(
                f"{op}: a Vector Engine transpose (dst in {dst.buffer.name}) is at most [32, 32], "
                f"got {describe(data)}; "
                "for larger tiles transpose on the Tensor Engine into a PSUM tile"
            )
    if dst.dtype != data.dtype:
        raise NkiSimError(
            f"{op}: dst dtype must equal data dtype: data {describe(data)}, dst {describe(dst)} (PSUM holds fp32, so "
            "copy bf16/fp8 data to a float32 SBUF tile before a Tensor Engine transpose)"
        )
    if dst.shape[0] != F or free_size(dst.shape) != P:
        raise NkiSimError(f"{op}: dst {describe(dst)} must be [{F}, {P}] for data {describe(data)}")
    count_instr("tensor" if use_pe else "vector", op, data, contraction=P)
    v = read(op, "data", data).reshape(P, F).T
    write(op, dst, v, src_dtype=data.dtype)


engine_tensor_ = engine.tensor
engine_unknown_ = engine.unknown


# ------------------------------------------------------------------------------------------- Vector / Scalar / GpSimd


def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """Copy an on-chip tile into another (SBUF/PSUM), converting to ``dst``'s dtype."""
    op = "tensor_copy"
    require_tensor(op, "dst", dst)
    require_tensor(op, "src", src)
    if not dst.buffer.on_chip:
        raise NkiSimError(f"{op}: dst {describe(dst)} is in HBM; write HBM with nl.store or nisa.dma_copy")
    require_on_chip(op, "src", src)
    require_on_chip(op, "dst", dst)
    same_layout(op, "dst", dst, "src", src)
    count_instr(_engine_name(engine, "vector"), op, src, dst)
    write(op, dst, read(op, "src", src), src_dtype=src.dtype)


def dma_copy(dst, src, dst_rmw_op=None, oob_mode=None, dge_mode=None, name=None, **kwargs):
    """DMA between HBM and SBUF (either direction, or HBM->HBM / SBUF->SBUF), casting to ``dst``'s dtype."""
    op = "dma_copy"
    require_tensor(op, "dst", dst)
    require_tensor(op, "src", src)
    if src.buffer.kind == "psum":
        raise NkiSimError(
            f"{op}: DMA from PSUM (src {describe(src)}): store from PSUM: copy it to SBUF with nisa.tensor_copy first"
        )
    if dst.buffer.kind == "psum":
        raise NkiSimError(f"{op}: DMA into PSUM (dst {describe(dst)}) is not supported; DMA into SBUF instead")
    if dst_rmw_op is not None:
        (removed, instead), = [tg.API_REMOVED["nisa.dma_copy(dst_rmw_op=...)"]]
        raise NkiSimUnsupported(
            f"{op}: dst_rmw_op was removed in {tg.version_name(removed)} (mhcrun's kernels target {tg.NKI_API_NAME}); "
            f"use {instead}"
        )
    check_copy_shapes(op, "dst", dst, "src", src)
    count_dma(op, dst, src)
    write(op, dst, read(op, "src", src), src_dtype=src.dtype)


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill an on-chip tile with a constant."""
    op = "memset"
    require_on_chip(op, "dst", dst)
    if not _scalar(value):
        raise NkiSimError(f"{op}: value must be a compile-time scalar, got {value!r}")
    count_instr(_engine_name(engine, "vector"), op, dst)
    write(op, dst, np.full(dst.shape, value, dtype=np.float64))


def _check_int_only(op: str, spec, tensors) -> None:
    if spec.is_bitvec and any(dt.is_float(t.dtype) for t in tensors):
        raise NkiSimError(f"{op}: bitvec operator {_op_name(spec)} needs integer tiles, got " +
                          ", ".join(describe(t) for t in tensors))  # fmt: skip


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """``dst = data1 <op> data2`` elementwise (Vector / GpSimd Engine); no broadcasting."""
    opn = "tensor_tensor"
    require_on_chip(opn, "data1", data1)
    require_on_chip(opn, "data2", data2)
    require_on_chip(opn, "dst", dst)
    spec = alu.spec_of(op, opn)
    if not spec.is_alu_binary:
        raise NkiSimError(f"{opn}: op {_op_name(spec)} is not a binary ALU operator (e.g. nl.add, nl.multiply)")
    if tuple(data1.shape) != tuple(data2.shape):
        if data1.shape[0] != data2.shape[0] or free_size(data1.shape) != free_size(data2.shape):
            raise NkiSimError(
                f"{opn}: broadcasting is not supported by tensor_tensor: shapes {tuple(data1.shape)} and "
                f"{tuple(data2.shape)} (data1 {describe(data1)}, data2 {describe(data2)}); use nisa.tensor_scalar "
                "for a [P, 1] operand"
            )
    same_layout(opn, "dst", dst, "data1", data1)
    if data1.buffer.kind == "psum" and data2.buffer.kind == "psum":
        raise NkiSimError(f"{opn}: data1 and data2 cannot both be in PSUM ({describe(data1)}, {describe(data2)})")
    if spec.name == "power" and any(t.buffer.kind == "psum" for t in (data1, data2, dst)):
        raise NkiSimError(f"{opn}: nl.power runs on GpSimd, which cannot access PSUM")
    _check_int_only(opn, spec, (data1, data2, dst))
    count_instr(_engine_name(engine, "vector"), opn, data1, data2, dst)
    ints = not any(dt.is_float(t.dtype) for t in (data1, data2, dst))
    if ints and spec.name in ("add", "subtract", "multiply", "maximum", "minimum"):
        a = read(opn, "data1", data1).astype(np.int64)
        b = read(opn, "data2", data2).astype(np.int64).reshape(a.shape)
        res = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
               "minimum": np.minimum}[spec.name](a, b)  # fmt: skip
        write(opn, dst, res)
        return
    a = engine_in(opn, "data1", data1)
    b = engine_in(opn, "data2", data2).reshape(a.shape)
    write(opn, dst, alu.apply_binary(spec.name, a, b))


def _alu_step(opn: str, which: str, spec, x, operand, reverse: bool):
    if spec.is_alu_unary:
        if operand is not None and not (_scalar(operand) and operand == 0):
            raise NkiSimError(f"{opn}: {which} {_op_name(spec)} is unary; its operand must be None or 0")
        return alu.apply_unary(spec.name, x) if spec.name != "invert" else ~x.astype(np.int64)
    if not spec.is_alu_binary:
        raise NkiSimError(
            f"{opn}: {which} {_op_name(spec)} is not a Vector Engine ALU operator (activation functions such as "
            "nl.exp run in nisa.activation)"
        )
    if operand is None:
        raise NkiSimError(f"{opn}: {which} {_op_name(spec)} needs an operand")
    return alu.apply_binary(spec.name, operand, x) if reverse else alu.apply_binary(spec.name, x, operand)


def tensor_scalar(
    dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False, engine=engine.unknown, name=None
):
    """``dst = (data <op0> operand0) <op1> operand1``; each operand a scalar or a [P, 1] fp32 tile."""
    opn = "tensor_scalar"
    require_on_chip(opn, "data", data)
    require_on_chip(opn, "dst", dst)
    same_layout(opn, "dst", dst, "data", data)
    s0 = alu.spec_of(op0, opn)
    o0 = None if operand0 is None else _vector_operand(opn, "operand0", operand0, data)
    if op1 is None and operand1 is not None:
        raise NkiSimError(f"{opn}: operand1 given without op1")
    s1 = None if op1 is None else alu.spec_of(op1, opn)
    o1 = None if operand1 is None else _vector_operand(opn, "operand1", operand1, data)
    if s1 is not None and s0.is_bitvec != s1.is_bitvec:
        raise NkiSimError(f"{opn}: op0 and op1 must both be bitvec or both arithmetic operators")
    _check_int_only(opn, s0, (data, dst))
    count_instr(_engine_name(engine, "vector"), opn, data, dst)
    x = read(opn, "data", data).astype(np.int64) if s0.is_bitvec else engine_in(opn, "data", data)
    x = _alu_step(opn, "op0", s0, x, o0, reverse0)
    if s1 is not None:
        x = _alu_step(opn, "op1", s1, x, o1, reverse1)
    write(opn, dst, x)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    """``dst = (data <op0> operand0) <op1> operand1`` with operand0 a scalar / [P, 1] tile and operand1 a tile."""
    opn = "scalar_tensor_tensor"
    require_on_chip(opn, "data", data)
    require_on_chip(opn, "operand1", operand1)
    require_on_chip(opn, "dst", dst)
    same_layout(opn, "dst", dst, "data", data)
    if tuple(operand1.shape) != tuple(data.shape) and free_size(operand1.shape) != free_size(data.shape):
        raise NkiSimError(
            f"{opn}: broadcasting is not supported for operand1: shapes {tuple(data.shape)} and {tuple(operand1.shape)}"
        )
    same_layout(opn, "operand1", operand1, "data", data)
    if data.buffer.kind == "psum" and operand1.buffer.kind == "psum":
        raise NkiSimError(f"{opn}: data and operand1 cannot both be in PSUM")
    s0, s1 = alu.spec_of(op0, opn), alu.spec_of(op1, opn)
    for which, s in (("op0", s0), ("op1", s1)):
        if not s.is_alu_binary or s.is_bitvec:
            raise NkiSimError(f"{opn}: {which} {_op_name(s)} must be an arithmetic binary operator")
    o0 = _vector_operand(opn, "operand0", operand0, data)
    count_instr("vector", opn, data, operand1, dst)
    x = _alu_step(opn, "op0", s0, engine_in(opn, "data", data), o0, reverse0)
    b = engine_in(opn, "operand1", operand1).reshape(x.shape)
    x = alu.apply_binary(s1.name, b, x) if reverse1 else alu.apply_binary(s1.name, x, b)
    write(opn, dst, x)


def activation(
    dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle, name=None
):
    """``dst = op(data * scale + bias)`` on the Scalar Engine, with optional free-axis sum into its registers.

    ``reduce_cmd``: ``reset`` zeroes the per-partition reduce registers, ``reduce`` adds the row sums of the
    result onto them, ``reset_reduce`` does both, ``idle`` (default) leaves them. ``reduce_res`` ([P, 1])
    receives the registers after the instruction.
    """
    opn = "activation"
    require_on_chip(opn, "data", data)
    require_on_chip(opn, "dst", dst)
    same_layout(opn, "dst", dst, "data", data)
    spec = alu.spec_of(op, opn)
    if not spec.is_activation:
        raise NkiSimError(
            f"{opn}: op {_op_name(spec)} is not a Scalar Engine activation function (use e.g. nl.exp, nl.copy, "
            "nl.sigmoid, nl.rsqrt; ALU operators go to nisa.tensor_scalar / tensor_tensor)"
        )
    sc = _vector_operand(opn, "scale", scale, data)
    if bias is None:
        bi = None
    else:
        if isinstance(bias, NkiTensor) and bias.dtype == dt.tfloat32:
            raise NkiSimError(f"{opn}: bias may not be tfloat32 ({describe(bias)})")
        bi = _vector_operand(opn, "bias", bias, data, fp32_only=False)
    x = engine_in(opn, "data", data)
    if not (isinstance(sc, np.float32) and sc == 1.0):
        x = x * sc
    if bi is not None:
        x = x + bi
    count_instr("scalar", opn, data, dst)
    y = activation_result(spec.name, x, alu.apply_unary(spec.name, x), current().numerics)
    _scalar_engine_reduce(opn, data.shape[0], y, reduce_op, reduce_res, reduce_cmd)
    write(opn, dst, y)


def _scalar_engine_reduce(opn: str, P: int, y: np.ndarray, reduce_op, reduce_res, cmd) -> None:
    ctx = current()
    if reduce_op is not None:
        rs = alu.spec_of(reduce_op, opn)
        if rs.name != "add":
            raise NkiSimError(f"{opn}: reduce_op must be nl.add (Scalar Engine registers only sum), got {_op_name(rs)}")
    if cmd not in (reduce_cmd.idle, reduce_cmd.reset, reduce_cmd.reduce, reduce_cmd.reset_reduce):
        raise NkiSimError(f"{opn}: unsupported reduce_cmd {cmd!r}")
    if cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce):
        ctx.act_regs[:P] = 0.0
        ctx.act_valid[:P] = True
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce):
        if reduce_op is None:
            raise NkiSimError(f"{opn}: reduce_cmd={cmd.name} needs reduce_op=nl.add")
        if not ctx.act_valid[:P].all():
            raise NkiSimError(
                f"{opn}: reduce_cmd=reduce onto Scalar Engine reduce registers that were never reset; use "
                "reduce_cmd=nisa.reduce_cmd.reset_reduce for the first instruction"
            )
        ctx.act_regs[:P] += y.reshape(P, -1).sum(axis=1, dtype=np.float32)
    if reduce_res is not None:
        require_on_chip(opn, "reduce_res", reduce_res)
        if reduce_res.shape[0] != P or free_size(reduce_res.shape) != 1:
            raise NkiSimError(f"{opn}: reduce_res must be a [{P}, 1] tile, got {describe(reduce_res)}")
        if not ctx.act_valid[:P].all():
            raise NkiSimError(
                f"{opn}: reduce_res reads the Scalar Engine reduce registers, which hold no value yet (reduce_cmd "
                f"is {cmd.name}); pass reduce_cmd=nisa.reduce_cmd.reset_reduce (or use nisa.activation_reduce) to "
                "sum this instruction's result into reduce_res"
            )
        write(opn, reduce_res, ctx.act_regs[:P].copy())
    elif reduce_op is not None and cmd == reduce_cmd.idle:
        raise NkiSimError(
            f"{opn}: reduce_op given with reduce_cmd=idle and no reduce_res: the reduction would be dropped; pass "
            "reduce_cmd=nisa.reduce_cmd.reset_reduce and a reduce_res tile"
        )


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """``nisa.activation`` with ``reduce_cmd=reset_reduce``: the row sums of the result land in ``reduce_res``."""
    activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
               reduce_cmd=reduce_cmd.reset_reduce)  # fmt: skip


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce ``data`` over its trailing free axes (never the partition axis) into ``dst``."""
    opn = "tensor_reduce"
    require_on_chip(opn, "data", data)
    require_on_chip(opn, "dst", dst)
    spec = alu.spec_of(op, opn)
    if not spec.is_reduction:
        raise NkiSimError(f"{opn}: {_op_name(spec)} is not a legal reduction operator (nl.add, nl.maximum, ...)")
    axes = reduce_axes(opn, data.shape, axis)
    count_instr("vector", opn, data)
    if spec.is_bitvec or spec.name.startswith("bitwise"):
        _check_int_only(opn, spec, (data, dst))
        x = read(opn, "data", data)
    else:
        x = engine_in(opn, "data", data)
    r = alu.apply_reduce(spec.name, x, axes, keepdims=True)
    if dst.shape[0] != data.shape[0] or free_size(dst.shape) != free_size(r.shape):
        raise NkiSimError(
            f"{opn}: dst {describe(dst)} does not fit the reduction of {describe(data)} over axis {axes} "
            f"(expected {data.shape[0]} partitions x {free_size(r.shape)} elements)"
        )
    if negate:
        r = -r
    write(opn, dst, r)


def tensor_scalar_reduce(
    dst, data, op0, operand0, reduce_op, reduce_res, reverse0=False, reduce_cmd=reduce_cmd.reset_reduce,
    reduce_init=None, name=None,
):  # fmt: skip
    """``dst = data <op0> operand0`` plus a free-axis ``reduce_op`` of the result into ``reduce_res``."""
    opn = "tensor_scalar_reduce"
    require_on_chip(opn, "data", data)
    require_on_chip(opn, "dst", dst)
    same_layout(opn, "dst", dst, "data", data)
    s0 = alu.spec_of(op0, opn)
    if s0.is_bitvec:
        raise NkiSimError(f"{opn}: op0 must be an arithmetic operator, got {_op_name(s0)}")
    o0 = None if operand0 is None else _vector_operand(opn, "operand0", operand0, data)
    rs = alu.spec_of(reduce_op, opn)
    if rs.name not in ("add", "multiply", "maximum", "minimum"):
        raise NkiSimError(f"{opn}: reduce_op must be nl.add, nl.multiply, nl.max or nl.min, got {_op_name(rs)}")
    count_instr("vector", opn, data, dst)
    x = _alu_step(opn, "op0", s0, engine_in(opn, "data", data), o0, reverse0)
    P = data.shape[0]
    row = alu.apply_reduce(rs.name, x.reshape(P, -1), 1, keepdims=False)
    ctx = current()
    if reduce_cmd == reduce_cmd_.reset_reduce:
        ctx.vec_regs[:P] = row
    elif reduce_cmd == reduce_cmd_.load_reduce:
        if reduce_init is None:
            raise NkiSimError(f"{opn}: reduce_cmd=load_reduce needs reduce_init")
        init = _vector_operand(opn, "reduce_init", reduce_init, data).reshape(-1)
        ctx.vec_regs[:P] = alu.apply_binary(rs.name, np.broadcast_to(init, (P,)), row)
    elif reduce_cmd == reduce_cmd_.reduce:
        if not ctx.vec_valid[:P].all():
            raise NkiSimError(f"{opn}: reduce_cmd=reduce onto Vector Engine registers that were never reset")
        ctx.vec_regs[:P] = alu.apply_binary(rs.name, ctx.vec_regs[:P], row)
    else:
        raise NkiSimError(f"{opn}: unsupported reduce_cmd {reduce_cmd!r}")
    ctx.vec_valid[:P] = True
    write(opn, dst, x)
    if reduce_res is not None:
        require_on_chip(opn, "reduce_res", reduce_res)
        if reduce_res.shape[0] != P or free_size(reduce_res.shape) != 1:
            raise NkiSimError(f"{opn}: reduce_res must be a [{P}, 1] tile, got {describe(reduce_res)}")
        write(opn, reduce_res, ctx.vec_regs[:P].copy())


reduce_cmd_ = reduce_cmd


def reciprocal(dst, data, name=None):
    """``dst = 1 / data`` on the Vector Engine."""
    opn = "reciprocal"
    require_on_chip(opn, "data", data)
    require_on_chip(opn, "dst", dst)
    same_layout(opn, "dst", dst, "data", data)
    count_instr("vector", opn, data, dst)
    write(opn, dst, alu.apply_unary("reciprocal", engine_in(opn, "data", data)))


def iota(dst, pattern, offset, channel_multiplier=0, name=None):
    """``dst[p, w, z, y, x] = offset + p * channel_multiplier + w*step_w + z*step_z + y*step_y + x*step_x``.

    ``pattern`` is ``[[step, num], ...]`` (up to 4 levels, outermost first); ``dst`` must be an SBUF tile with
    ``prod(num)`` elements per partition. Values are computed in int32 math and cast to ``dst.dtype``.
    """
    opn = "iota"
    require_on_chip(opn, "dst", dst)
    if dst.buffer.kind != "sbuf":
        raise NkiSimError(f"{opn}: dst must be an SBUF tile (GpSimd writes SBUF only), got {describe(dst)}")
    try:
        levels = [(int(s), int(n)) for s, n in pattern]
    except (TypeError, ValueError):
        raise NkiSimError(f"{opn}: pattern must be a list of [step, num] pairs, got {pattern!r}") from None
    if not 1 <= len(levels) <= 4:
        raise NkiSimError(f"{opn}: pattern must have 1 to 4 [step, num] levels, got {len(levels)}")
    total = 1
    for _, n in levels:
        total *= n
    P = dst.shape[0]
    if total != free_size(dst.shape):
        raise NkiSimError(
            f"{opn}: pattern generates {total} elements per partition but dst {describe(dst)} has "
            f"{free_size(dst.shape)}"
        )
    count_instr("gpsimd", opn, dst)
    v = np.full((P, 1), int(offset), dtype=np.int64) + np.arange(P, dtype=np.int64)[:, None] * int(channel_multiplier)
    free = np.zeros(1, dtype=np.int64)
    for s, n in levels:
        free = (free[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
    vals = (v + free[None, :]).astype(np.int32).astype(np.int64)
    write(opn, dst, vals if not dt.is_float(dst.dtype) else vals.astype(np.float32))


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NkiSimUnsupported(
        f"nki.isa.{name} is not implemented by mhcrun's NKI simulator (it simulates the subset listed in "
        "shared/spec/nki.md)"
    )
