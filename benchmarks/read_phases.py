"""The read stream over time: how long this machine's faster phases last, against which a decode's share is measured.

    python benchmarks/read_phases.py [--seconds 120] [--threads 2]

Reads a 512 MB buffer on 2 MB pages (where the kernel offers them, as a CPU run's weights are) with
benchmarks/read_stream.cpp's loop, again and again: each sample the best of 3 reads on `--threads` threads and of 2 on
one (after a read that warms each up), ~0.3 s apart, for `--seconds`. Prints every sample (seconds since the start:
GB/s on the threads / on one), then the median, the share of samples above 1.3x it and the lengths of those runs in
seconds. On a 2-vCPU Zen 4 VM the two threads read 29-36 GB/s and, in bursts of 1-4 s (~15% of the samples), 50-59
while one thread stayed at 24-33: bench_cpu_peer.py therefore measures the read stream just before each side's runs
and sets each round's decode against its own (BENCHMARKS.md, issue 20).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantized import _read_stream, best_time  # noqa: E402

from mhcrun.errors import InputError, run_script  # noqa: E402
from mhcrun.hugepages import place, why_not  # noqa: E402

FAST = 1.3  # a sample this many times the median is in a faster phase


def fast_runs(series: list[tuple[float, float]], limit: float) -> list[float]:
    """The lengths in seconds of the runs of consecutive samples (time s, rate) above `limit`: from a run's first
    sample to its last (a lone sample: 0)."""
    runs, start, last = [], None, None
    for t, rate in series:
        if rate > limit:
            start = t if start is None else start
            last = t
        elif start is not None:
            runs.append(last - start)
            start = None
    if start is not None:
        runs.append(last - start)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.seconds <= 0 or args.threads < 1:
        raise InputError(f"--seconds {args.seconds:g} --threads {args.threads}: both must be positive")
    native = _read_stream()
    if native is None:
        raise SystemExit("benchmarks/read_stream.cpp did not build here (it needs a C++ compiler and x86-64)")
    nbytes = 512 << 20
    buf = {"read": torch.empty(nbytes, dtype=torch.uint8).random_()}
    if why_not(2 * nbytes, True) is None:
        place(buf)
    src, lines = buf["read"], nbytes // 64

    def rate(threads: int, repeats: int) -> float:
        return nbytes / best_time(lambda: native(src.data_ptr(), lines, threads), repeats)

    series, start = [], time.monotonic()
    while time.monotonic() - start < args.seconds:
        series.append((time.monotonic() - start, rate(args.threads, 3), rate(1, 2)))
        time.sleep(0.3)
    print(" ".join(f"{t:.1f}:{a / 1e9:.0f}/{b / 1e9:.0f}" for t, a, b in series))
    median = statistics.median(a for _, a, _ in series)
    fast = [a for _, a, _ in series if a > FAST * median]
    runs = fast_runs([(t, a) for t, a, _ in series], FAST * median)
    print(f"{len(series)} samples; {args.threads} threads: median {median / 1e9:.1f} GB/s, {len(fast)} samples "
          f"({len(fast) / len(series):.0%}) above {FAST}x it"
          + (f" (up to {max(fast) / 1e9:.1f} GB/s), in {len(runs)} runs of {min(runs):.1f}-{max(runs):.1f} s"
             if fast else "")
          + f"; one thread: median {statistics.median(b for _, _, b in series) / 1e9:.1f}, "
          f"at most {max(b for _, _, b in series) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    run_script(main)
