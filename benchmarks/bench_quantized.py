"""Quantised weights kept quantised vs dequantised: peak memory, decode speed and memory bandwidth, side by side.

    python benchmarks/bench_quantized.py            # tiny FP8/FP4 variant and the mid-size config (~3 min)
    python benchmarks/bench_quantized.py --flash    # also 2 layers of V4-Flash's shape (~9 GB written to a temp dir)

Prints, on this machine and in this run:
- memcpy bandwidth (bytes copied per second, torch's copy_ of 512 MB, best of 5), the issue's yardstick for a
  memory-bound decode, and read bandwidth (the fastest of a native read loop and torch's reductions over 512 MB):
  a decode only reads its weights, and a read-only stream moves about twice memcpy's bytes per second here;
- for the tiny FP8 variant and the mid-size config (`configs/v4-mid.json`, full width, all 4 layers, written by
  `mhcrun make-synthetic` to a temp dir), each `mhcrun generate` in its own process: kept quantised (decode
  GEMVs through the fused kernel `mhcrun/ops/qgemv.cpp`, eager: the default), kept quantised through the torch
  chunk decoders (`MHCRUN_CPU_KERNEL=0`), kept quantised in compiled regions (`--graph-mode regions`) and
  dequantised: bytes on disk, peak RSS against the goal 1.1 x disk + 300 MB, decode tokens/s, the weight bytes
  one decoded token reads (`mhcrun.memory.decode_bytes_per_token`) and the bandwidth that makes as a fraction
  of memcpy's and of the read bandwidth, the kernel's speed-up over the torch decoders, and whether the runs
  produce the same greedy tokens, with the FP8 activation simulation on (the default) and off;
- with --flash: the same for `mhcrun generate --layers 2` on a 2-layer V4-Flash-shape checkpoint, kept quantised
  only (dequantised it would need ~70 GB).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mhcrun.checkpoint import plan_checkpoint
from mhcrun.errors import run_script
from mhcrun.memory import decode_bytes_per_token
from mhcrun.synthetic import make_synthetic
from mhcrun.tiny import make_tiny

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PROMPT = "0,5,6,7,8,9,10,11"
MB = 1e6


def memcpy_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes copied per second by torch's copy_ (all threads), best of `repeats`."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    return nbytes / best_time(lambda: dst.copy_(src), repeats)


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes read per second by the fastest of three read-only streams over `nbytes` (all of torch's threads, best
    of `repeats` each): a native loop (benchmarks/read_stream.cpp: sums with the lines asked for ahead, as the GEMV
    loops do), torch's fp32 sum and its int64 max-reduction; each over a buffer on 4 KB pages and, where the kernel
    offers them, over its copy on 2 MB pages (`mhcrun.hugepages.place`, as a CPU run's weights are). A decode only
    reads its weights; torch's reductions alone can be compute-bound (on a 2-core AVX-512 VM the int64 max read
    13 GB/s where the native loop reads 23-26), and 4 KB pages cost a stream a page walk every 64 lines (on a
    2-core AMX VM the native loop read 24.7 GB/s on them, 30.4 on 2 MB pages): either would flatter every share of
    it."""
    from mhcrun.hugepages import place, why_not

    buffers = {"4 KB": torch.empty(nbytes, dtype=torch.uint8).random_()}
    if why_not(2 * nbytes, True) is None:  # room for the copy beside the original
        huge = {"2 MB": buffers["4 KB"]}
        place(huge)
        buffers.update(huge)
    native, lines, threads = _read_stream(), nbytes // 64, torch.get_num_threads()  # both buffers 64-byte aligned
    streams = []
    for src in buffers.values():
        streams += [lambda src=src: src.view(torch.float32).sum(), lambda src=src: src.view(torch.int64).max()]
        if native is not None:
            streams.append(lambda src=src: native(src.data_ptr(), lines, threads))
    return max(nbytes / best_time(fn, repeats) for fn in streams)


def _read_stream():
    """benchmarks/read_stream.cpp built and loaded (mhcrun's kernel cache and compiler), or None without one."""
    from mhcrun.ops.native import build
    from mhcrun.settings import Env

    env = Env.read()
    try:
        lib = ctypes.CDLL(str(build(Path(__file__).with_name("read_stream.cpp"), env.kernel_cache, env.cxx)))
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None
    fn = lib.mhc_read_stream
    fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return fn


def best_time(fn, repeats: int) -> float:
    """The shortest of `repeats` calls of fn, after one call that warms it up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run_generate(path: Path, tokens: int, *extra: str, env: dict[str, str] | None = None) -> dict:
    """`mhcrun generate --json` in a fresh process (its peak RSS is its own)."""
    cmd = [sys.executable, "-m", "mhcrun.cli", "generate", "-m", str(path), "--prompt-ids", PROMPT, "-n", str(tokens),
           "--ignore-eos", "--json", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=os.environ | (env or {}))
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr}")
    return json.loads(res.stdout.splitlines()[-1])


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


Variant = tuple[tuple[str, ...], dict[str, str]]  # extra generate arguments, extra environment


def best_runs(path: Path, tokens: int, variants: dict[str, Variant], repeats: int) -> dict[str, dict]:
    """Each variant `repeats` times, interleaved; per variant the run with the best decode rate (the machine
    is noisy: its two cores are shared) and the highest peak RSS seen."""
    best: dict[str, dict] = {}
    for _ in range(repeats):
        for label, (extra, env) in variants.items():
            res = run_generate(path, tokens, *extra, env=env)
            old = best.get(label)
            if old is None or res["stats"]["decode_tok_s"] > old["stats"]["decode_tok_s"]:
                rss = max(res["stats"]["peak_rss_mb"], old["stats"]["peak_rss_mb"] if old else 0.0)
                best[label] = res
                res["stats"]["peak_rss_mb"] = rss
            else:
                old["stats"]["peak_rss_mb"] = max(old["stats"]["peak_rss_mb"], res["stats"]["peak_rss_mb"])
    return best


def agreement(a: list[int], b: list[int]) -> str:
    if a == b:
        return f"yes ({len(a)} tokens)"
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"NO (the first {first} of {len(a)} tokens agree)"


def measure(name: str, path: Path, tokens: int, bandwidth: float, reads: float, repeats: int,
            layers: int | None = None, dequantized: bool = True) -> None:
    """Kept quantised through the fused kernel (eager decode, the CPU default), through the torch decoders
    (MHCRUN_CPU_KERNEL=0) and in compiled regions (the kernel as graph ops), and dequantised at load (the
    reference), side by side."""
    extra = ("--layers", str(layers)) if layers else ()
    plan = plan_checkpoint(path, layers)
    disk = disk_bytes(path)
    goal = 1.1 * disk + 300 * MB
    variants: dict[str, Variant] = {"kept quantised": (extra, {}),
                                    "kept, torch": (extra, {"MHCRUN_CPU_KERNEL": "0"}),
                                    "kept, regions": ((*extra, "--graph-mode", "regions"), {})}
    if dequantized:
        variants["dequantised"] = ((*extra, "--dequantize"), {})
    runs = best_runs(path, tokens, variants, repeats)
    print(f"\n{name}: {disk / MB:,.0f} MB on disk, goal for peak RSS kept quantised <= 1.1 x disk + 300 MB "
          f"= {goal / MB:,.0f} MB")
    for label, res in runs.items():
        s = res["stats"]
        per_token = decode_bytes_per_token(plan, dequantize=label == "dequantised")
        rss = s["peak_rss_mb"] * 1024 * 1024  # generate reports MiB (VmHWM)
        rate = s["decode_tok_s"] * per_token
        verdict = "" if label != "kept quantised" else ", goal met" if rss <= goal else ", OVER GOAL"
        print(f"  {label:15s} peak RSS {rss / MB:8,.0f} MB ({rss / disk:5.2f}x disk{verdict})  "
              f"decode {s['decode_tok_s']:7.2f} tok/s  reads {per_token / MB:8.1f} MB/token = {rate / 1e9:5.2f} GB/s = "
              f"{100 * rate / bandwidth:5.1f}% of memcpy, {100 * rate / reads:4.1f}% of reads")
    kept = runs["kept quantised"]["tokens"]
    speedup = runs["kept quantised"]["stats"]["decode_tok_s"] / runs["kept, torch"]["stats"]["decode_tok_s"]
    print(f"  fused kernel vs torch decoders: {speedup:.2f}x decode; same greedy tokens: "
          f"{agreement(kept, runs['kept, torch']['tokens'])}; regions vs eager: "
          f"{agreement(kept, runs['kept, regions']['tokens'])} (regions compile "
          f"{runs['kept, regions']['stats']['compile_s']:.0f} s, not in their rate)")
    if dequantized:
        print(f"  same greedy tokens kept quantised and dequantised: {agreement(kept, runs['dequantised']['tokens'])}")
        off = [run_generate(path, tokens, *extra, *more, "--no-quant-sim")["tokens"]
               for more in ((), ("--dequantize",))]
        print(f"  ... with the FP8 activation simulation off (--no-quant-sim): {agreement(*off)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flash", action="store_true", help="also run 2 layers of V4-Flash's shape (~9 GB on disk)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens decoded per run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per variant (best decode rate kept)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    args = ap.parse_args()
    bandwidth, reads = memcpy_bandwidth(), read_bandwidth()
    print(f"memcpy bandwidth {bandwidth / 1e9:.2f} GB/s (bytes copied per second, best of 5; "
          f"{torch.get_num_threads()} threads), read bandwidth {reads / 1e9:.2f} GB/s (read stream); "
          f"decode rates are the best of {args.repeats} runs")
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        tiny = make_tiny(root / "tiny-fp8", fp8=True)
        measure("tiny FP8/FP4 variant", tiny, args.tokens, bandwidth, reads, args.repeats)
        mid = make_synthetic(CONFIGS / "v4-mid.json", root / "mid", 4)
        measure("mid-size (configs/v4-mid.json, 4 layers)", mid, args.tokens, bandwidth, reads, args.repeats)
        if args.flash:
            t0 = time.perf_counter()
            flash = make_synthetic(CONFIGS / "v4-flash.json", root / "flash", 2)
            print(f"\nwrote the 2-layer V4-Flash-shape checkpoint in {time.perf_counter() - t0:.0f} s")
            measure("V4-Flash shape, --layers 2", flash, min(args.tokens, 8), bandwidth, reads, 1, layers=2,
                    dequantized=False)


if __name__ == "__main__":
    run_script(main)
