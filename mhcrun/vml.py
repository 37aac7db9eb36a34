"""MKL's vector math (VML), which torch's CPU float functions call: its kernels chosen before threads share them.

torch on x86 computes `exp`, `log`, `sqrt`, `tanh`, `erf` and the other functions below by MKL's VML, each of its
threads calling VML on its share of the tensor. The oneMKL that torch 2.13's wheels link (2024.2) chooses which of
its kernels a VML function runs (instruction set, accuracy) on the first call in the process; when that first call
runs on two threads at once, one of them may compute its whole share with a low-accuracy kernel although torch asks
for full accuracy: results off by ~1e-4 relative, thousands of ulps, in that one call only (later calls agree).
It is known upstream (pytorch/pytorch#188792; oneMKL 2025.0 on no longer shows it).

In mhcrun that first call is a prefill's attention (`torch.exp` of the scores: the CPU kernel takes decode rows
only), on two threads, right after an MKL GEMM. On a 2-core AMX VM, 9 of 120 fresh processes computing layer 0's
first prefill attention from saved inputs differed from the rest; with the FP8 activation simulation on, a near-tied
greedy token after a 1,024-token prompt of the mid-size config came out differently in 4 of 19 runs one day (none
of 36 the next). Calling each function once on one element, on one thread, before any model runs settles every
choice: 0 of 120 processes differed.
"""

from __future__ import annotations

import torch

# the float functions torch's CPU kernels hand to VML (ATen's vml.h), in both precisions VML has
FUNCTIONS = ("exp", "expm1", "log", "log1p", "log2", "log10", "sqrt", "sin", "cos", "tan", "tanh",
             "asin", "acos", "atan", "erf", "erfc")
DTYPES = (torch.float32, torch.float64)


def settle_vector_math() -> None:
    """Call each VML function once on one element, on this thread alone: VML's kernel choices are made now, not by
    the first call that several threads share."""
    for dtype in DTYPES:
        one = torch.full((1,), 0.5, dtype=dtype)
        for name in FUNCTIONS:
            getattr(torch, name)(one)
