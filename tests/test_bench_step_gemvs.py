"""benchmarks/bench_step_gemvs.py: a decode step's GEMV calls recorded, replayed and their bytes read."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_step_gemvs as bench  # noqa: E402
from conftest import cpu_kernel  # noqa: E402

from mhcrun.ops.qgemv import expert_set  # noqa: E402
from mhcrun.ops.qweight import QWeight  # noqa: E402
from mhcrun.tiny import make_tiny  # noqa: E402

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the read stream's x86-64 loop")


def fp4_weight(n: int, k: int, g: torch.Generator) -> QWeight:
    data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g).view(torch.int8)
    scale = torch.randint(118, 124, (n, k // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    return QWeight(data, scale, 32).checked()


def fp8_weight(n: int, k: int, g: torch.Generator, e8m0: bool) -> QWeight:
    data = torch.randint(0, 0x7E, (n, k), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    tiles = (-(-n // 128), -(-k // 128))
    scale = torch.full(tiles, 2.0**-8)
    return QWeight(data, scale.to(torch.float8_e8m0fnu) if e8m0 else scale, 128).checked()


@pytest.mark.parametrize("make", [fp4_weight, lambda n, k, g: fp8_weight(n, k, g, False),
                                  lambda n, k, g: fp8_weight(n, k, g, True)], ids=["fp4", "fp8-fp32", "fp8-e8m0"])
@pytest.mark.parametrize("n, k", [(256, 512), (200, 384)])  # the second: partial tiles
def test_expert_regions_are_each_experts_bytes(make, n, k):
    """The bytes the benchmark reads for a routed call's experts are each chosen expert's data and scales, where
    they lie and no more: each expert's weight, found by the address its set holds."""
    g = torch.Generator().manual_seed(n + k)
    ws = [make(n, k, g) for _ in range(4)]
    s = expert_set(ws)
    if s is None:
        pytest.skip("the kernel does not read these experts in place")
    want = [(t.data_ptr(), t.numel() * t.element_size()) for e in (3, 1) for t in (ws[e].data, ws[e].scale)]
    assert bench.expert_regions(s, [3, 1], {w.data.data_ptr(): w for w in ws}) == want


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("bench") / "tiny-fp8", fp8=True)


def test_a_step_is_recorded_replayed_and_read(tiny_fp8, monkeypatch, tmp_path):
    """On the tiny FP8 model: the recorded steps make each kind of GEMV call, each reads its weight's bytes; the
    report has a row a call kind and format and one for all; a replayed call that does not give the step's result
    stops the run."""
    if not cpu_kernel().on:
        pytest.skip(f"CPU kernel {cpu_kernel().status()}")
    monkeypatch.setenv("MHCRUN_KERNEL_CACHE", str(tmp_path))
    lines = bench.run(tiny_fp8, steps=2, rounds=1, bandwidth=False)
    rows = {line.split()[0] + " " + line.split()[1] for line in lines[1:-1]}
    assert {"linear fp8", "moe_routed fp8"} <= rows, lines
    assert lines[-2].startswith("all ") and float(lines[-2].split()[1]) > 0
    assert lines[-1].startswith("eager decode step")
    # a bandwidth given (bench_cpu_peer passes its own): the GEMVs' bytes set against it, not one measured here
    lines = bench.run(tiny_fp8, steps=2, rounds=1, bandwidth=2e10)
    mb, ms = float(lines[-3].split()[2]), float(lines[-1].split()[-2])
    assert lines[-1].startswith("read bandwidth 20.0 GB/s: the GEMVs' ") and ms == pytest.approx(mb / 20, abs=0.01)

    runner = bench.load_runner(str(tiny_fp8))
    model = runner.model
    kernel = model.layers[0].attn.opts.cpu
    model.setup_caches(1, 16)
    stepper = bench.Stepper(model, 8)
    with torch.inference_mode():
        stepper.prefill(0, [5, 6, 7])
        calls = bench.record(kernel, stepper, [8, 9])
        for c in calls:
            if c.method != "moe_routed":
                w = c.args[1]
                assert sum(size for _, size in c.regions) == w.data.nbytes + (0 if w.scale is None else w.scale.nbytes)
            else:  # each chosen expert's w1, w3 and w2: data and scales, each read once
                chosen = set(c.args[2].flatten().tolist())
                assert len(c.regions) == 3 * 2 * len(chosen) == len({a for a, _ in c.regions})
        bench.replay(kernel, calls)  # the same results
        calls[-1].result = calls[-1].result + 1
        with pytest.raises(SystemExit, match="did not give the step's result"):
            bench.replay(kernel, calls)


def test_a_regions_profile_is_grouped_by_what_the_ops_are():
    """Each profiled op's self time goes to the first group its name starts with; the rest are torch's ops."""
    groups = bench.group_profile({"mhcrun::qgemv_native": 10.0, "mhcrun::qgemv_expert_set_native": 5.0,
                                  "mhcrun::hc_post_pre_native": 2.0, "## Call CompiledFxGraph fabc": 3.0,
                                  "Torch-Compiled Region: 0/0": 1.0, "TorchDynamo Cache Lookup": 0.5,
                                  "AOTDispatcher Runtime Wrapper Prologue": 0.25, "aten::empty": 0.125})
    assert groups == {"GEMV ops": 15.0, "other mhcrun kernels": 2.0, "the graphs' own code": 4.0,
                      "dynamo and AOT wrappers": 0.75, "torch ops": 0.125}


def test_perf_samples_are_grouped_by_library_per_side_of_the_main_thread():
    """`perf script -F tid,ip,dso` lines: each library in its group (mhcrun's kernels by their file names, inductor's
    graphs by their cache folder, Python, torch, the C libraries, OpenMP), the main thread's samples apart from the
    other threads', as shares of each side's; lines that are no sample are passed over."""
    lines = ["  100  7ff8 (/root/.cache/mhcrun/kernels/qgemv-3c106f9fc3fa655e.so)",
             "  100  7ff8 (/root/.cache/mhcrun/kernels/qgemv-3c106f9fc3fa655e.so)",
             "  100  7ff9 (/usr/lib/libpython3.11.so.1.0)",
             "  100  7ffa (/tmp/torchinductor_root/7h/c7hacf53q.main.so)",
             "  101  7ffb (/venv/torch/lib/libgomp.so.1)",
             "  101  7ffc (/root/.cache/mhcrun/kernels/torch_ops-741268d63f239e4e.so)",
             "  101  7ffd (/venv/torch/lib/libtorch_cpu.so)",
             "  101  7ffe (/usr/lib/x86_64-linux-gnu/libc.so.6)",
             "  101  7fff (/somewhere/libunknown.so)",
             "", "not a sample line"]
    shares = bench.group_perf_samples(lines, main_tid=100)
    assert shares["main thread"] == {"mhcrun's kernels": 0.5, "Python": 0.25, "inductor's graphs": 0.25}
    other = shares["other threads"]
    assert other["OpenMP (waiting for work or at a join)"] == other["mhcrun's kernels"] == 0.2
    assert other["torch (dispatch, wrappers, its own ops)"] == other["other"] == 0.2
    assert other["the C and C++ libraries (malloc, copies)"] == 0.2
    assert bench.group_perf_samples(lines[:4], main_tid=100).keys() == {"main thread"}
