"""--tp on this machine: per-rank peak RSS and decode speed at --tp 1 and 2, the bytes each rank puts into
all-reduces per decoded token, greedy tokens equal, and from the configs alone what V4-Flash and V4-Pro need per
device at TP 8 and 16.

    mhcrun make-synthetic configs/v4-mid.json DIR --layers 4
    python benchmarks/bench_tp.py --model DIR --layers 4

Each run is its own `mhcrun generate --json` (quant simulation off, so tokens must be equal). Goal (the
several-devices issue): each rank's peak RSS at --tp 2 <= 0.75x the single rank's. This machine has 2 cores: the
speed of 2 ranks here says nothing about TP on accelerators; memory per rank and exact tokens are the point.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from mhcrun.config import load_config
from mhcrun.errors import InputError, run_script
from mhcrun.memory import format_bytes, kv_bytes_per_token, stored_bytes_per_rank
from mhcrun.parallel import check_divides

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def run(model: str | None, layers: int | None, tp: int, tokens: int) -> dict:
    cmd = [sys.executable, "-m", "mhcrun.cli", "generate", "--prompt-ids", "0,5,6,7,8,9,10,11", "-n", str(tokens),
           "--ignore-eos", "--no-quant-sim", "--json", "--tp", str(tp)]
    cmd += ["-m", model] if model else []
    cmd += ["--layers", str(layers)] if layers else []
    res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if res.returncode:
        sys.exit(f"--tp {tp} failed: {res.stderr.strip()}")
    return json.loads(res.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()

    one, two = run(args.model, args.layers, 1, args.tokens), run(args.model, args.layers, 2, args.tokens)
    single = one["stats"]["peak_rss_mb"]
    ranks = two["stats"]["peak_rss_mb_per_rank"]
    print(f"--tp 1: peak RSS {single:.0f} MB, decode {one['stats']['decode_tok_s']:.2f} tok/s")
    print(f"--tp 2: peak RSS per rank {', '.join(f'{r:.0f}' for r in ranks)} MB (ratio to one rank "
          f"{max(ranks) / single:.2f}; goal <= 0.75), decode {two['stats']['decode_tok_s']:.2f} tok/s")
    print(f"all-reduce bytes per decoded token, one rank: {two['stats']['collective_bytes_per_token']:,.0f}")
    print(f"greedy tokens equal: {one['tokens'] == two['tokens']}")
    print("runtime share of a rank's peak: python + torch + tokenizers, measured as the tiny model's peak RSS: "
          f"{run(None, None, 1, 1)['stats']['peak_rss_mb']:.0f} MB")

    print("\nper device, from the configs (weights kept quantised as released; the KV cache is replicated):")
    for name in ("v4-flash", "v4-pro"):
        cfg = load_config(CONFIGS / f"{name}.json")
        kv = kv_bytes_per_token(cfg, cfg.n_layers, torch.bfloat16)
        for world in (1, 8, 16):
            try:
                check_divides(cfg, world)
            except InputError as e:
                print(f"  {name} TP {world}: {e}")
                continue
            w = stored_bytes_per_rank(cfg, world)
            print(f"  {name} TP {world}: weights {format_bytes(w)} per device; KV {kv:,.0f} B per token "
                  f"(bf16), {format_bytes(int(kv * 131072))} at 128k tokens, {format_bytes(int(kv * 1048576))} at 1M")


if __name__ == "__main__":
    run_script(main)
