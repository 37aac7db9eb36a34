"""Linear layers as DeepSeek's reference computes them.

A weight stored FP8/FP4 in the checkpoint is kept dequantised (fp32) here; when the quant simulation is on,
the activation is rounded to FP8 (blocks of 128 along K, power-of-two scales) before the GEMM, as
DeepSeek's `act_quant` does ahead of every FP8/FP4 GEMM. The GEMM accumulates in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mhcrun.ops.quant import fp8_simulate

ACT_BLOCK = 128


def linear(x: torch.Tensor, weight: torch.Tensor, act_quant: bool = False) -> torch.Tensor:
    """y = x @ weight^T. A weight of another dtype than x (a dequantised one) runs in fp32."""
    if act_quant:
        x_q = fp8_simulate(x, ACT_BLOCK, pow2_scale=True)
        return F.linear(x_q.float(), weight.float()).to(x.dtype)
    if weight.dtype != x.dtype:
        return F.linear(x.float(), weight.float()).to(x.dtype)
    return F.linear(x, weight)
