"""benchmarks/bench_quantized.read_bandwidth: the read stream the decode benchmarks measure shares against."""

from __future__ import annotations

import math
import platform
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_quantized  # noqa: E402

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86-64 loop")


def test_the_native_loop_reads_every_word(monkeypatch, tmp_path):
    """The loop's sum is the sum of every 64-bit word of the buffer (mod 2**64) on 1 and 2 threads: it reads all
    of it, not a part that would make the rate look higher."""
    monkeypatch.setenv("MHCRUN_KERNEL_CACHE", str(tmp_path))
    stream = bench_quantized._read_stream()
    assert stream is not None
    buf = torch.empty(64 * 1001, dtype=torch.uint8).random_()  # an odd number of lines: threads' shares differ
    want = int(buf.view(torch.int64).numpy().view(np.uint64).sum(dtype=np.uint64))
    for threads in (1, 2):
        assert stream(buf.data_ptr(), buf.numel() // 64, threads) == want
    assert stream(buf.data_ptr(), 1000, 2) != want  # one line short: the sum tells


def test_read_bandwidth_is_the_fastest_stream(monkeypatch, tmp_path):
    monkeypatch.setenv("MHCRUN_KERNEL_CACHE", str(tmp_path))
    rate = bench_quantized.read_bandwidth(8 << 20, repeats=2)
    assert math.isfinite(rate) and rate > 1e8
