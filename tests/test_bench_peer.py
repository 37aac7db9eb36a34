"""benchmarks/bench_cpu_peer.py: a decode's share of the read bandwidth, against the read stream beside it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_cpu_peer  # noqa: E402


def test_a_decode_share_pairs_each_round_with_its_own_read_stream():
    """Round 2's read stream ran in a fast phase (63 GB/s) that its decode did not: each round's share is its own
    decode against its own read stream, the best round's kept, and the read stream returned is that round's. Taking
    the best rate and the best read stream from different rounds would have given 358 MB x 62 / 63 GB/s = 35%."""
    runs = [{"decode@128": 60.0, "read_bw": 35e9}, {"decode@128": 62.0, "read_bw": 63e9},
            {"decode@128": 50.0, "read_bw": 34e9}]
    share, bw = bench_cpu_peer.paired_share(runs, "decode@128", 358e6)
    assert share == pytest.approx(358e6 * 60 / 35e9) and bw == 35e9
    assert bench_cpu_peer.paired_share(runs[1:2], "decode@128", 358e6) == (pytest.approx(358e6 * 62 / 63e9), 63e9)


def test_fast_runs_measure_each_burst_from_its_first_sample_to_its_last():
    """benchmarks/read_phases.py: runs of samples above the limit, a lone one 0 s, one still open at the end."""
    import read_phases

    series = [(0.0, 34), (0.4, 58), (0.8, 57), (1.2, 59), (1.6, 33), (2.0, 56), (2.4, 34), (2.8, 55), (3.2, 57)]
    assert read_phases.fast_runs(series, 45) == [pytest.approx(0.8), 0.0, pytest.approx(0.4)]
    assert read_phases.fast_runs(series, 60) == []


def test_the_report_judges_each_side_by_its_paired_rounds(capsys):
    """report() on two rounds of one mode, the second's read stream a burst: the goal is judged on the first round's
    pair, each round's share is printed, and a miss returns the read stream of the round it was judged on."""
    from argparse import Namespace

    from mhcrun.checkpoint import plan_checkpoint
    from mhcrun.memory import decode_bytes_per_token
    from mhcrun.runner import DEFAULT_MODEL

    plan = plan_checkpoint(DEFAULT_MODEL)
    read = decode_bytes_per_token(plan)
    args = Namespace(threads=2, rounds=2, gen=32, gguf=None, peer_huge_pages=False)

    def rounds(rate: float) -> list[dict[str, float]]:  # decodes of `rate` tok/s: 70% and 35% of their read streams
        return [{"decode@128": rate, "decode@1024": rate, "prefill@128": 1.0, "prefill@1024": 1.0,
                 "read_bw": read * rate / 0.7},
                {"decode@128": rate, "decode@1024": rate, "prefill@128": 1.0, "prefill@1024": 1.0,
                 "read_bw": 2 * read * rate / 0.7}]

    assert bench_cpu_peer.report(plan, args, {"eager": rounds(50.0)}, None, [], {"2 MB pages"}, 1e9) is None
    out = capsys.readouterr().out
    assert "by round: eager 70% / 35%" in out and "decode >= 60% of the read bandwidth: met (70% at worst)" in out
    slow = rounds(50.0)
    slow[0]["read_bw"] = read * 50.0 / 0.5  # now the better round gives 50%
    assert bench_cpu_peer.report(plan, args, {"eager": slow}, None, [], {"2 MB pages"}, 1e9) == (read, read * 100.0)
    assert "MISSED (50% at worst)" in capsys.readouterr().out


@pytest.mark.parametrize("script, args", [("read_phases.py", ["--seconds", "0"]),
                                          ("bench_cpu_peer.py", ["--rounds", "0"])])
def test_a_count_that_measures_nothing_is_refused_in_one_line(script, args):
    """No samples or no rounds would leave nothing to report: one line naming the options, exit 2."""
    import subprocess

    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "benchmarks" / script), *args],
                       capture_output=True, text=True, timeout=300)
    (line,) = r.stderr.splitlines()
    assert r.returncode == 2 and line.startswith("error: ") and args[0] in line, r.stderr
