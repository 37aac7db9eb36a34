"""Long context on one checkpoint: prefill tok/s and peak RSS for prompts of 1k to 64k tokens, decode tok/s at
those contexts, and prefill GFLOP/s against this machine's fp32 matmul GFLOP/s measured in the same run.

    mhcrun make-synthetic configs/v4-mid.json DIR --layers 4
    python benchmarks/bench_long_context.py --model DIR
    python benchmarks/bench_long_context.py --model DIR --lengths 1024,4096 --decode-tokens 8

Each prompt runs in its own process (peak RSS is per process; a 64-token warm-up first touches the weights, so
prefill is timed warm); the matmul rate is
measured here, between the runs, with torch's threads as the runs use them. Goals (the long-context issue):
peak RSS at 64k <= weights + KV + 1 GiB; prefill tok/s at 32k >= 0.5x that at 1k; decode tok/s at 64k >= 0.6x
that at 1k; prefill >= 50% of the measured matmul GFLOP/s at 4k.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from mhcrun.config import ModelConfig
from mhcrun.errors import run_script
from mhcrun.memory import format_bytes
from mhcrun.runner import open_runner

GiB = 1 << 30


def matmul_gflops(n: int = 2048, seconds: float = 5.0) -> float:
    """fp32 GEMM rate of this machine (square n x n matmuls, best of the repeats after a warm-up)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t0) / 1e9)
    return best


def prefill_macs_per_token(cfg: ModelConfig, layers: int, context: int) -> float:
    """Multiply-adds one prompt token costs on average over a prompt of `context` tokens: every GEMM it goes
    through (the routed experts it picks and the shared one), its attention (window + top-k for CSA, the closed
    entries for HCA) and the indexer's scoring of the closed entries (their number grows along the prompt)."""
    d, H, hd, ql = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank
    total = 0.0
    for i in range(layers):
        r = cfg.compress_ratios[i]
        attn = d * ql + ql * H * hd + d * hd + H * hd * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d
        keys = cfg.window_size
        if r:
            c = 2 if r == 4 else 1
            attn += 2 * d * c * hd
            keys += cfg.index_topk if r == 4 else context / r / 2
        if r == 4:
            ih, ihd = cfg.index_n_heads, cfg.index_head_dim
            attn += ql * ih * ihd + d * ih + 2 * d * 2 * ihd + ih * ihd * context / 4 / 2
        attn += 2 * H * hd * keys  # scores and the weighted sum
        moe = d * cfg.n_routed_experts + (cfg.n_activated_experts + 1) * 3 * d * cfg.moe_inter_dim
        mhc = 2 * cfg.mix_hc * cfg.hc_mult * d
        total += attn + moe + mhc
    return total


def worker(model: str, n: int, decode_tokens: int, chunk: int | None, seed: int) -> None:
    """One run in this process: load, warm up on a 64-token prompt (first touches of the mapped weights, the
    GEMV kernel), then prefill n tokens and decode; print the stats as JSON."""
    from mhcrun.generate import generate
    from mhcrun.runner import load_runner

    rng = random.Random(seed)
    ids = [0] + [rng.randrange(3, 30000) for _ in range(n - 1)]
    model_ = load_runner(model).model
    generate(model_, [ids[:64]], 2, eos_id=1, ignore_eos=True, prefill_chunk=chunk)
    res = generate(model_, [ids], decode_tokens, eos_id=1, ignore_eos=True, prefill_chunk=chunk)[0]
    print(json.dumps(res.stats))


def run_one(model: str, n: int, decode_tokens: int, chunk: int | None, seed: int) -> dict:
    cmd = [sys.executable, __file__, "--model", model, "--worker", str(n), "--decode-tokens", str(decode_tokens)]
    if chunk:
        cmd += ["--prefill-chunk", str(chunk)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"{n} tokens: exit {out.returncode}: {out.stderr.strip()[-2000:]}")
    return {"tokens": n, "wall_s": wall, **json.loads(out.stdout.splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (e.g. the 4-layer mid-size synthetic one)")
    ap.add_argument("--lengths", default="1024,4096,16384,32768,65000")
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=None)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.model, args.worker, args.decode_tokens, args.prefill_chunk, seed=args.worker)
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    runner = open_runner(args.model)
    cfg, layers = runner.config, runner.n_layers
    print(f"model {args.model}: {layers} layers, dim {cfg.dim}, threads {torch.get_num_threads()}, "
          f"CPU GEMV kernel as generate reports it", flush=True)
    rows = []
    rates = []
    for n in lengths:
        rates.append(matmul_gflops())
        res = run_one(args.model, n, args.decode_tokens, args.prefill_chunk, seed=n)
        plan = runner.memory_plan(1, n + args.decode_tokens, n, prefill_chunk=args.prefill_chunk)
        kv = sum(plan.state.values())
        res["weights_bytes"], res["state_bytes"], res["prefill_chunk"] = plan.weights, kv, plan.prefill_chunk
        res["budget_mb"] = (plan.weights + kv + GiB) / 2**20
        res["gflops"] = 2 * prefill_macs_per_token(cfg, layers, n) * res["prefill_tok_s"] / 1e9
        res["matmul_gflops"] = rates[-1]
        rows.append(res)
        print(f"  {n:>6} tokens: prefill {res['prefill_tok_s']:6.1f} tok/s ({res['gflops']:.1f} GFLOP/s, matmul "
              f"{rates[-1]:.0f}), decode {res['decode_tok_s']:5.2f} tok/s, peak RSS {res['peak_rss_mb']:,.0f} MB "
              f"(weights + state + 1 GiB = {res['budget_mb']:,.0f} MB), wall {res['wall_s']:.0f} s", flush=True)
    print()
    print("| prompt tokens | chunk | prefill tok/s | prefill GFLOP/s (matmul) | decode tok/s | peak RSS MB | "
          "weights + KV + 1 GiB MB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']:,} | {r['prefill_chunk']} | {r['prefill_tok_s']:.1f} | {r['gflops']:.1f} "
              f"({r['matmul_gflops']:.0f}) | {r['decode_tok_s']:.2f} | {r['peak_rss_mb']:,.0f} | "
              f"{r['budget_mb']:,.0f} |")
    by = {r["tokens"]: r for r in rows}
    print()
    if max(by) >= 60000:
        r = by[max(by)]
        print(f"goal RSS at {r['tokens']:,}: {r['peak_rss_mb']:,.0f} MB <= {r['budget_mb']:,.0f} MB: "
              f"{'met' if r['peak_rss_mb'] <= r['budget_mb'] else 'MISSED'}")
    if 1024 in by and 32768 in by:
        ratio = by[32768]["prefill_tok_s"] / by[1024]["prefill_tok_s"]
        print(f"goal prefill 32k / 1k >= 0.5: {ratio:.2f}: {'met' if ratio >= 0.5 else 'MISSED'}")
    if 1024 in by and max(by) > 1024:
        ratio = by[max(by)]["decode_tok_s"] / by[1024]["decode_tok_s"]
        print(f"goal decode {max(by):,} / 1k >= 0.6: {ratio:.2f}: {'met' if ratio >= 0.6 else 'MISSED'}")
    if 4096 in by:
        frac = by[4096]["gflops"] / by[4096]["matmul_gflops"]
        print(f"goal prefill GFLOP/s at 4k >= 50% of matmul: {100 * frac:.0f}%: {'met' if frac >= 0.5 else 'MISSED'}")
    print(f"memory plan of the weights: {format_bytes(rows[0]['weights_bytes'])}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    run_script(main)
