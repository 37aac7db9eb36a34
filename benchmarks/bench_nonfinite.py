"""What the non-finite checks cost, measured side by side in one run.

    mhcrun make-synthetic configs/v4-mid.json DIR --layers 4
    python benchmarks/bench_nonfinite.py --model DIR

- `--check-weights`: the scan of every stored tensor (`mhcrun.weightcheck`, scan.cpp) in GB/s of the checkpoint's
  bytes, beside memcpy's bandwidth and beside a plain read of the same mapped bytes, each best of --repeats
  (the shards are read once first, so every pass reads from the page cache).
- The per-step logits check (`generate.nonfinite_rows`, one sum over [batch, vocab]) beside one
  eager decode step of the model, over --steps steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_quantized import best_time, memcpy_bandwidth, read_bandwidth  # noqa: E402

from mhcrun.checkpoint import stored_tensors  # noqa: E402
from mhcrun.errors import run_script  # noqa: E402
from mhcrun.generate import generate, nonfinite_rows  # noqa: E402
from mhcrun.runner import load_runner, open_runner  # noqa: E402
from mhcrun.settings import Env  # noqa: E402
from mhcrun.weightcheck import check_weights  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled tiny model)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()

    runner = open_runner(args.model, layers=args.layers, env=Env.read())
    nbytes = sum(runner.plan.bytes_by_dtype.values())

    def plain_read() -> None:  # every stored byte through a max-reduction, the scan's floor
        for _, _, _, t in stored_tensors(runner.plan):
            if t.numel():
                t.reshape(-1).view(torch.uint8).max()

    plain_read()  # page the shards in
    scan_s = best_time(lambda: check_weights(runner.plan, runner.scan), args.repeats)
    read_s = best_time(plain_read, args.repeats)
    memcpy = memcpy_bandwidth()
    read = read_bandwidth()
    print(f"checkpoint {runner.path}: {nbytes / 1e9:.2f} GB stored")
    print(f"check-weights: {nbytes / scan_s / 1e9:.2f} GB/s | plain read of the mapped bytes (uint8 max): "
          f"{nbytes / read_s / 1e9:.2f} GB/s | memcpy {memcpy / 1e9:.2f} GB/s | read stream {read / 1e9:.2f} GB/s")
    print(f"check-weights / memcpy: {nbytes / scan_s / memcpy:.2f}; / plain read of the same bytes: "
          f"{read_s / scan_s:.2f}")

    loaded = load_runner(args.model, layers=args.layers, env=Env.read())
    prompts = [[0, 5, 6, 7 + i] for i in range(args.batch)]
    res = generate(loaded.model, prompts, args.steps, eos_id=-1, ignore_eos=True)
    step_s = args.batch / res[0].stats["decode_tok_s"]  # one decode step of the whole batch
    logits = torch.randn(args.batch, loaded.config.vocab_size)
    check_s = best_time(lambda: [nonfinite_rows(logits) for _ in range(100)], args.repeats) / 100
    print(f"logits check: {check_s * 1e6:.1f} us per step over [{args.batch}, {loaded.config.vocab_size}] | eager "
          f"decode step {step_s * 1e3:.1f} ms | share {check_s / step_s:.2%}")


if __name__ == "__main__":
    run_script(main)
