"""The math of the simulated engines: activation functions, ALU operators and reductions, in float32.

Each ``nl.*`` math function carries an ``OpSpec`` (attribute ``_nki_op``) saying what the ISA instructions may
use it for: as an activation function (``nisa.activation``), as a binary or unary ALU operator
(``nisa.tensor_tensor`` / ``nisa.tensor_scalar``) and as a reduction (``nisa.tensor_reduce``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .errors import NkiSimError

_F = np.float32


def _erf(x: np.ndarray) -> np.ndarray:
    return torch.special.erf(torch.from_numpy(np.ascontiguousarray(x, dtype=_F))).numpy()


def _sigmoid(x):
    return _F(1) / (_F(1) + np.exp(-x))


def _gelu(x):
    return _F(0.5) * x * (_F(1) + _erf(x * _F(0.7071067811865476)))


def _gelu_dx(x):
    cdf = _F(0.5) * (_F(1) + _erf(x * _F(0.7071067811865476)))
    pdf = np.exp(_F(-0.5) * x * x) * _F(0.3989422804014327)
    return cdf + x * pdf


def _gelu_tanh(x):
    return _F(0.5) * x * (_F(1) + np.tanh(_F(0.7978845608028654) * (x + _F(0.044715) * x * x * x)))


def _silu_dx(x):
    s = _sigmoid(x)
    return s * (_F(1) + x * (_F(1) - s))


def _softplus(x):
    return np.logaddexp(_F(0), x).astype(_F, copy=False)


UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "copy": lambda x: x,
    "square": lambda x: x * x,
    "sigmoid": _sigmoid,
    "relu": lambda x: np.maximum(x, _F(0)),
    "gelu": _gelu,
    "gelu_dx": _gelu_dx,
    "gelu_apprx_tanh": _gelu_tanh,
    "silu": lambda x: x * _sigmoid(x),
    "silu_dx": _silu_dx,
    "tanh": np.tanh,
    "softplus": _softplus,
    "mish": lambda x: x * np.tanh(_softplus(x)),
    "erf": _erf,
    "erf_dx": lambda x: _F(1.1283791670955126) * np.exp(-x * x),
    "exp": np.exp,
    "log": np.log,
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "arctan": np.arctan,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: _F(1) / np.sqrt(x),
    "reciprocal": lambda x: _F(1) / x,
    "sign": np.sign,
    "abs": np.abs,
    "negative": np.negative,
    "floor": np.floor,
    "ceil": np.ceil,
    "trunc": np.trunc,
    "logical_not": lambda x: (x == 0).astype(_F),
}


def _cmp(f):
    return lambda a, b: f(a, b).astype(_F)


def _logic(f):
    return lambda a, b: f(a != 0, b != 0).astype(_F)


BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "power": np.power,
    "equal": _cmp(np.equal),
    "not_equal": _cmp(np.not_equal),
    "greater": _cmp(np.greater),
    "greater_equal": _cmp(np.greater_equal),
    "less": _cmp(np.less),
    "less_equal": _cmp(np.less_equal),
    "logical_and": _logic(np.logical_and),
    "logical_or": _logic(np.logical_or),
    "logical_xor": _logic(np.logical_xor),
}

# Bit-pattern operators on integer tiles (computed on int64, no float cast).
BITVEC: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "bitwise_and": np.bitwise_and,
    "bitwise_or": np.bitwise_or,
    "bitwise_xor": np.bitwise_xor,
    "left_shift": np.left_shift,
    "right_shift": np.right_shift,
}

# Reductions along axes: name -> numpy reducer (float32 math, or int64 for bitvec).
REDUCE: dict[str, Callable[..., np.ndarray]] = {
    "add": np.add.reduce,
    "multiply": np.multiply.reduce,
    "maximum": np.maximum.reduce,
    "minimum": np.minimum.reduce,
    "logical_and": lambda a, axis, keepdims: np.logical_and.reduce(a != 0, axis=axis, keepdims=keepdims).astype(_F),
    "logical_or": lambda a, axis, keepdims: np.logical_or.reduce(a != 0, axis=axis, keepdims=keepdims).astype(_F),
    "logical_xor": lambda a, axis, keepdims: np.logical_xor.reduce(a != 0, axis=axis, keepdims=keepdims).astype(_F),
    "bitwise_and": np.bitwise_and.reduce,
    "bitwise_or": np.bitwise_or.reduce,
    "bitwise_xor": np.bitwise_xor.reduce,
}

# Activation functions the Scalar Engine accepts in nisa.activation (AWS's activation-function table).
ACTIVATIONS = frozenset(
    {
        "copy", "square", "sigmoid", "relu", "gelu", "gelu_dx", "gelu_apprx_tanh", "silu", "silu_dx", "tanh",
        "softplus", "mish", "erf", "erf_dx", "exp", "log", "sin", "arctan", "sqrt", "rsqrt", "reciprocal", "sign",
        "abs",
    }
)  # fmt: skip

# Unary operators of the ALU table (tensor_scalar with operand None/0).
ALU_UNARY = frozenset({"rsqrt", "reciprocal", "abs", "logical_not"})


@dataclass(frozen=True)
class OpSpec:
    """What an nl.* math function means to the ISA instructions."""

    name: str

    @property
    def is_activation(self) -> bool:
        return self.name in ACTIVATIONS

    @property
    def is_alu_binary(self) -> bool:
        return self.name in BINARY or self.name in BITVEC

    @property
    def is_bitvec(self) -> bool:
        return self.name in BITVEC or self.name == "invert"

    @property
    def is_alu_unary(self) -> bool:
        return self.name in ALU_UNARY or self.name == "invert"

    @property
    def is_reduction(self) -> bool:
        return self.name in REDUCE


def spec_of(op, where: str) -> OpSpec:
    """The OpSpec of an ``op=`` argument (an nl.* function, or numpy's copy/exp/... as AWS also accepts)."""
    s = getattr(op, "_nki_op", None)
    if isinstance(s, OpSpec):
        return s
    np_alias = {
        np.copy: "copy", np.square: "square", np.tanh: "tanh", np.exp: "exp", np.log: "log", np.sin: "sin",
        np.arctan: "arctan", np.sqrt: "sqrt", np.reciprocal: "reciprocal", np.sign: "sign", np.abs: "abs",
        np.add: "add", np.subtract: "subtract", np.multiply: "multiply", np.maximum: "maximum",
        np.minimum: "minimum",
    }  # fmt: skip
    try:
        name = np_alias.get(op)
    except TypeError:
        name = None
    if name is not None:
        return OpSpec(name)
    raise NkiSimError(f"{where}: {op!r} is not an NKI operator (pass an nl.* function such as nl.add or nl.exp)")


def apply_unary(name: str, x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(UNARY[name](x), dtype=_F)


def apply_binary(name: str, a, b) -> np.ndarray:
    """Engine math of a binary operator: float32 (bitvec operators: int64 bit patterns)."""
    if name in BITVEC:
        return BITVEC[name](np.asarray(a).astype(np.int64), np.asarray(b).astype(np.int64))
    with np.errstate(all="ignore"):
        return np.asarray(BINARY[name](a, b), dtype=_F)


def apply_reduce(name: str, x: np.ndarray, axis, keepdims: bool) -> np.ndarray:
    f = REDUCE[name]
    if name.startswith("bitwise"):
        return f(x.astype(np.int64), axis=axis, keepdims=keepdims)
    with np.errstate(all="ignore"):
        return np.asarray(f(x, axis=axis, keepdims=keepdims), dtype=_F)
