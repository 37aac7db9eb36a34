"""The simulator's two numerics modes: "exact" (fp32 engine math, the kernel logic alone) and "device".

In "device" mode every Scalar-engine activation result of an approximated function (exp, sigmoid, rsqrt, silu,
...) carries a relative error of at most ``ACT_REL_ERR``. The Scalar engine evaluates these functions as
piecewise-polynomial approximations with valid input ranges (aws-neuron-sdk, ``nki.isa.activation``'s
activation-function table); AWS publishes no per-function error bound, only a whole-kernel comparison of its
simulator against hardware at rtol 1e-2 / atol 1e-5 (``nki/guides/nki_simulator.rst``). mhcrun's bound, 2^-9
(about 2e-3, half a bf16 ulp at 1), is a stand-in chosen so that a chain of up to five approximated activations
stays inside that documented 1e-2: large enough that a kernel whose result hangs on fp32-exact activations fails,
small enough that a kernel within the documented tolerance passes. It is a model, not a measurement; only a
device confirms the real error.

The error is a deterministic function of each input value (a hash of its fp32 bits mapped into
[-ACT_REL_ERR, ACT_REL_ERR]), like a real approximation's: the same input gives the same output in every call,
and no state is kept.
"""

from __future__ import annotations

import numpy as np

from .errors import NkiSimError

MODES = ("exact", "device")
ACT_REL_ERR = 2.0**-9

# Activation functions the Scalar engine approximates (the others, copy / square / relu / abs / sign ..., are
# exact in fp32).
APPROXIMATED = frozenset({
    "exp", "log", "sigmoid", "silu", "silu_dx", "gelu", "gelu_dx", "gelu_apprx_tanh", "tanh", "softplus", "mish",
    "erf", "erf_dx", "sin", "cos", "tan", "arctan", "sqrt", "rsqrt", "reciprocal",
})  # fmt: skip


def check_numerics(mode: str) -> None:
    if mode not in MODES:
        raise NkiSimError(f"numerics must be one of {', '.join(MODES)}, got {mode!r}")


def unit_hash(x: np.ndarray) -> np.ndarray:
    """A value in [-1, 1] for each fp32 element, a fixed function of its bits."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    h = (u * np.uint64(2654435761)) & np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(15)
    h = (h * np.uint64(2246822519)) & np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(13)
    return (h.astype(np.float64) / 2**31 - 1.0).astype(np.float32)


def activation_result(name: str, x: np.ndarray, y: np.ndarray, mode: str) -> np.ndarray:
    """``y = f(x)`` as the engine returns it: exact, or with the device mode's bounded relative error."""
    if mode == "exact" or name not in APPROXIMATED:
        return y
    return (y * (np.float32(1) + np.float32(ACT_REL_ERR) * unit_hash(x))).astype(np.float32)
