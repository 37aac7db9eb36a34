"""How far GEMM summation order moves a greedy decode when the FP8 activation simulation is on.

    python benchmarks/quant_sim_sensitivity.py                  # mid-size config, 4 layers (~2 min)
    python benchmarks/quant_sim_sensitivity.py --model DIR --layers 2 --tokens 16

DeepSeek's act_quant rounds every GEMM input to FP8 with a power-of-two scale per 128 values. A last-bit
difference in an activation can move it across an FP8 rounding boundary (or move its block's amax across a
power of two), so two correct GEMMs that only sum in another order can give visibly different log-probs a
few layers on, and eventually another greedy token. This script decodes one prompt four ways on the same
checkpoint, in one process:
- kept quantised, decode GEMVs through the fused kernel (mhcrun/ops/qgemv.cpp, the CPU default);
- kept quantised through the torch chunk decoders (the kernel off), whose F.linear calls sum like the
  dequantised model's;
- dequantised to fp32 at load, fp32 GEMMs by torch (the --dequantize reference);
- dequantised, every fp32 GEMM summed in float64 and rounded once (the exactly rounded product: no summation
  order at all).
It prints how many greedy tokens each agrees with the others on, and the largest difference of the chosen
tokens' log-probs over the steps before the first disagreement.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from mhcrun.checkpoint import load_checkpoint
from mhcrun.errors import run_script
from mhcrun.generate import generate
from mhcrun.model import build_model
from mhcrun.ops.qgemv import KERNEL_OFF, CpuKernel, open_cpu_kernel
from mhcrun.settings import Env
from mhcrun.synthetic import make_synthetic

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PROMPT = [0, 5, 6, 7, 8, 9, 10, 11]


def linear_f64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for fp32 operands, summed in float64 and rounded to fp32 once."""
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return LINEAR(x.double(), w.double(), None if b is None else b.double()).float()
    return LINEAR(x, w, b)


LINEAR = F.linear


def decode(path: Path, layers: int | None, tokens: int, dequantize: bool, cpu: CpuKernel, f64: bool):
    ck = load_checkpoint(path, layers, dequantize=dequantize)
    model = build_model(ck.config, ck.tensors, ck.quantized, n_layers=layers)
    model.opts.cpu = cpu
    F.linear = linear_f64 if f64 else LINEAR
    try:
        return generate(model, [PROMPT], tokens, eos_id=-1, ignore_eos=True, record_topk=1)[0]
    finally:
        F.linear = LINEAR


def compare(a, b) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=True)) if x != y), len(a.tokens))
    diff = max((abs(pa[0][1] - pb[0][1]) for pa, pb in zip(a.top_logprobs[:n], b.top_logprobs[:n], strict=True)),
               default=0.0)
    return f"{n:3d} of {len(a.tokens)} tokens agree, chosen log-probs within {diff:.1e} before that"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="checkpoint (default: the mid-size config written to a temp dir)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    kernel = open_cpu_kernel(Env.read())
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or make_synthetic(CONFIGS / "v4-mid.json", Path(tmp) / "mid", args.layers or 4)
        runs = {
            f"kept, fused kernel ({kernel.status()})": decode(path, args.layers, args.tokens, False, kernel, False),
            "kept, torch decoders": decode(path, args.layers, args.tokens, False, KERNEL_OFF, False),
            "dequantised, fp32 GEMMs": decode(path, args.layers, args.tokens, True, KERNEL_OFF, False),
            "dequantised, exactly rounded GEMMs": decode(path, args.layers, args.tokens, True, KERNEL_OFF, True),
        }
    names = list(runs)
    print(f"{path.name if args.model else 'mid-size (configs/v4-mid.json)'}: greedy decode of {args.tokens} tokens "
          f"after {len(PROMPT)}, FP8 activation simulation on")
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            print(f"  {a:34s} vs {b:34s} {compare(runs[a], runs[b])}")


if __name__ == "__main__":
    run_script(main)
