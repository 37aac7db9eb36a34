"""mhcrun's NKI simulator: the NKI 0.3+ language subset of shared/spec/nki.md, executed on CPU with numpy.

Kernel source written for the real package (``import nki``, ``import nki.language as nl``,
``import nki.isa as nisa``, ``@nki.jit``) runs unchanged through ``load_kernel_module``; hardware rules
(partition <= 128, PSUM fp32 and <= 512 per partition, matmul operand limits, no broadcasting where the
engines have none, no compute on HBM, no store from PSUM, no read of unwritten memory) raise ``NkiSimError``.
It is a test harness for kernel logic, not a performance model.

The simulator modules are also importable directly: ``from mhcrun.nki.sim import nki, nl, nisa``.
"""

from __future__ import annotations

from . import isa, language, nki
from . import isa as nisa
from . import language as nl
from .errors import NkiSimError, NkiSimUnsupported
from .loader import load_kernel_module
from .nki import jit, simulate
from .tensor import NkiTensor

__all__ = [
    "NkiSimError",
    "NkiSimUnsupported",
    "NkiTensor",
    "isa",
    "jit",
    "language",
    "load_kernel_module",
    "nisa",
    "nki",
    "nl",
    "simulate",
]
