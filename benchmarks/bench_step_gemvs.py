"""A decode step's GEMVs against a plain read of the same bytes: where an eager step's time goes.

    python benchmarks/bench_step_gemvs.py [--model DIR] [--steps 4] [--rounds 5] [--regions] [--perf]

Loads the model (kept quantised, its weights placed as a run places them), prefills 128 tokens, then decodes
`--steps` eager steps with every GEMV call of the CPU kernel recorded (`CpuKernel.linear`, `qgemv`, `moe_routed`:
their arguments, results and wall time in the step; the modules' own calls, which the layer steps in one call make
too) and `--steps` more unrecorded for the step's time. Then,
alternating `--rounds` rounds, it replays the recorded calls back to back (each result checked against the step's)
and reads the bytes each call reads (its weight and scales; a routed call's experts, those its routes chose) with
benchmarks/read_stream.cpp's loop on the same threads, a call at a time. Prints, per call kind and weight format:
calls and MB a step, ms a step in the step, replayed and read (medians over the rounds), the rates, and replayed /
read; then the step's time and what is left of it outside the GEMV calls. With `--regions`, also a compiled-regions
step (the same prompt, inductor's cache as TORCHINDUCTOR_CACHE_DIR says: a cold one compiles first) under torch's
profiler: its GEMV ops, the other mhcrun kernels, the graphs' own code, dynamo's and AOT's wrappers, torch's ops and
the rest (Python), by the ops' self time on the calling thread. With `--perf`, the last step measured (regions, or
eager) is also sampled per thread by Linux's `perf` (`perf record -F 1000` on this process): each thread's samples by
library (mhcrun's kernels, inductor's graphs, Python, torch, the C libraries, OpenMP's waits), the main thread beside
the OpenMP workers, so that the runtime between kernels shows apart from the kernels. BENCHMARKS.md (issue 20) has
runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_quantized import _read_stream, read_bandwidth  # noqa: E402

from mhcrun.errors import run_script  # noqa: E402
from mhcrun.generate import Stepper  # noqa: E402
from mhcrun.ops.qgemv import CpuKernel, ExpertSet  # noqa: E402
from mhcrun.ops.qweight import QWeight  # noqa: E402
from mhcrun.runner import load_runner  # noqa: E402
from mhcrun.synthetic import make_synthetic  # noqa: E402

GEMV_CALLS = ("linear", "qgemv", "moe_routed")  # the CpuKernel methods by which an eager decode step reads its weights
GEMV_OPS = ("mhcrun::qgemv_native", "mhcrun::qgemv_expert_set_native")  # the ops by which a regions step reads them
# a regions step's profiled ops by what they are (the first that matches a name's start; the rest is "torch ops")
PROFILE_GROUPS = (("GEMV ops", GEMV_OPS), ("other mhcrun kernels", ("mhcrun::",)),
                  ("the graphs' own code", ("## Call CompiledFxGraph", "Torch-Compiled Region")),
                  ("dynamo and AOT wrappers", ("TorchDynamo", "Pregraph bytecode", "AOTDispatcher")))
LINE = 64
PERF_STEPS = 100  # decode steps sampled by perf (--perf): some 4,000 samples at 1 kHz on two threads
# a perf sample's library by what it is (the first whose file name starts with one of the names, or whose path holds
# one of the folders; the rest is "other"): where a thread's time goes, kernels apart from the runtime between them
PERF_GROUPS = (("mhcrun's kernels", ("qgemv-", "torch_ops-", "scan-"), ()),
               ("inductor's graphs", (), ("torchinductor",)),
               ("Python", ("libpython", "_ctypes"), ()),
               ("torch (dispatch, wrappers, its own ops)", ("libtorch", "libc10"), ()),
               ("the C and C++ libraries (malloc, copies)", ("libc.so", "libc-", "libm.so", "libstdc++"), ()),
               ("OpenMP (waiting for work or at a join)", ("libgomp", "libiomp"), ()),
               ("the operating system", ("[kernel",), ()))


@dataclass
class Call:
    """One recorded kernel call: the method, its arguments, its result and its wall time in the step."""

    method: str
    args: tuple
    result: torch.Tensor
    seconds: float
    regions: list[tuple[int, int]] = field(default_factory=list)  # (address, bytes) of the weights it reads

    @property
    def group(self) -> str:
        w = self.args[1] if self.method != "moe_routed" else self.args[3]
        fmt = ("bf16" if w.fmt == "float" else w.fmt) if isinstance(w, QWeight) else {0: "fp8", 1: "fp4"}[w.fmt]
        return f"{self.method} {fmt}"


def weight_regions(w: QWeight) -> list[tuple[int, int]]:
    """The (address, bytes) a GEMV of w reads: its data and its scales."""
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in w.parts]


def weights_by_address(model: torch.nn.Module) -> dict[int, QWeight]:
    """Each of the model's weights (a module's `w`) by the address of its bytes: where a routed call's experts are
    found from their set's addresses."""
    return {m.w.data.data_ptr(): m.w for m in model.modules() if isinstance(getattr(m, "w", None), QWeight)}


def expert_regions(s: ExpertSet, experts: list[int], weights: dict[int, QWeight]) -> list[tuple[int, int]]:
    """The (address, bytes) of the experts `experts` of a set: each one's data and scales, as its weight (found in
    `weights` by its address) holds them."""
    return [r for e in experts for r in weight_regions(weights[int(s.ptrs[e][0])])]


def call_regions(c: Call, weights: dict[int, QWeight]) -> list[tuple[int, int]]:
    if c.method == "moe_routed":
        experts = sorted(set(c.args[2].flatten().tolist()))
        return [r for s in c.args[3:6] for r in expert_regions(s, experts, weights)]
    return weight_regions(c.args[1])


def record(kernel: CpuKernel, stepper: Stepper, tokens: list[int]) -> list[Call]:
    """Decode `tokens` (one a step, row 0) with the kernel's GEMV methods recorded. The steps take the modules' own
    calls (a hook watches every module: `first_nonfinite_op`), so that the layer steps that make several calls in one
    (`CpuKernel.attn_project`, `moe_step`, ...) show their GEMVs one by one: the same calls."""
    from mhcrun.probes import first_nonfinite_op

    weights = weights_by_address(stepper.model)
    calls: list[Call] = []
    originals = {name: getattr(CpuKernel, name) for name in GEMV_CALLS}

    def recorded(name: str):
        def call(self, *args):
            t0 = time.perf_counter()
            y = originals[name](self, *args)
            seconds = time.perf_counter() - t0
            if y is not None:
                kept = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
                calls.append(Call(name, kept, y.clone(), seconds))
            return y
        return call

    try:
        for name in GEMV_CALLS:
            setattr(CpuKernel, name, recorded(name))
        with first_nonfinite_op(stepper.model):
            for t in tokens:
                stepper.decode([0], [t])
    finally:
        for name, fn in originals.items():
            setattr(CpuKernel, name, fn)
    for c in calls:
        c.regions = call_regions(c, weights)
    return calls


def replay(kernel: CpuKernel, calls: list[Call]) -> list[float]:
    """Each recorded call made again, back to back -> its seconds; a result unlike the step's stops the run."""
    out = []
    for c in calls:
        t0 = time.perf_counter()
        y = getattr(kernel, c.method)(*c.args)
        out.append(time.perf_counter() - t0)
        if y is None or not torch.equal(y, c.result):
            raise SystemExit(f"replaying a {c.group} call did not give the step's result")
    return out


def read(stream, calls: list[Call], threads: int) -> list[float]:
    """Each call's bytes read by the read stream's loop (whole 64-byte lines from the first aligned one) -> seconds."""
    out = []
    for c in calls:
        t0 = time.perf_counter()
        for addr, size in c.regions:
            start = -(-addr // LINE) * LINE
            stream(start, (addr + size - start) // LINE, threads)
        out.append(time.perf_counter() - t0)
    return out


def step_time(stepper: Stepper, tokens: list[int]) -> float:
    """Seconds an eager decode step, unrecorded."""
    t0 = time.perf_counter()
    for t in tokens:
        stepper.decode([0], [t])
    return (time.perf_counter() - t0) / len(tokens)


def report(calls: list[Call], replays: list[list[float]], reads: list[list[float]], steps: int, step_s: float,
           bandwidth: float | None) -> list[str]:
    """The table: per group (call kind, format) and in all, a step's share of the recorded steps."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(calls):
        groups[c.group].append(i)
    groups["all"] = list(range(len(calls)))

    def ms(rounds: list[list[float]], idx: list[int]) -> float:
        return statistics.median(sum(r[i] for i in idx) for r in rounds) / steps * 1e3

    head = f"{'':20s}{'calls':>7s}{'MB':>9s}{'in step ms':>12s}{'replayed ms':>13s}{'read ms':>9s}" \
           f"{'replayed GB/s':>15s}{'read GB/s':>11s}{'replayed/read':>15s}"
    lines = [head]
    for name, idx in groups.items():
        mb = sum(size for i in idx for _, size in calls[i].regions) / steps / 1e6
        in_step = sum(calls[i].seconds for i in idx) / steps * 1e3
        rep, rd = ms(replays, idx), ms(reads, idx)
        lines.append(f"{name:20s}{len(idx) / steps:7.1f}{mb:9.1f}{in_step:12.2f}{rep:13.2f}{rd:9.2f}"
                     f"{mb / rep:15.1f}{mb / rd:11.1f}{rep / rd:15.2f}")
    gemv_ms = sum(c.seconds for c in calls) / steps * 1e3
    lines.append(f"eager decode step {step_s * 1e3:.2f} ms (unrecorded steps); its GEMV calls {gemv_ms:.2f} ms "
                 f"(recorded steps); the rest {step_s * 1e3 - gemv_ms:.2f} ms")
    if bandwidth:
        mb = sum(size for c in calls for _, size in c.regions) / steps / 1e6
        lines.append(f"read bandwidth {bandwidth / 1e9:.1f} GB/s: the GEMVs' "
                     f"{mb:.1f} MB a step would take {mb * 1e9 / bandwidth:.2f} ms")
    return lines


def group_profile(self_us: dict[str, float]) -> dict[str, float]:
    """Profiled self times (op name -> us) summed by PROFILE_GROUPS, "torch ops" for the rest, in order."""
    out = dict.fromkeys([g for g, _ in PROFILE_GROUPS] + ["torch ops"], 0.0)
    for name, us in self_us.items():
        out[next((g for g, starts in PROFILE_GROUPS if name.startswith(starts)), "torch ops")] += us
    return out


def profile_regions(model, ids: list[int], steps: int, perf: bool = False) -> list[str]:
    """A compiled-regions decode step after the prompt `ids`: its time unprofiled, then `steps` steps under torch's
    profiler by PROFILE_GROUPS (ms a step), the rest of the profiled step outside any op (Python) last; with `perf`,
    PERF_STEPS more sampled per thread (`perf_threads`)."""
    from torch.profiler import ProfilerActivity, profile

    from mhcrun.generate import start_batch

    _, stepper = start_batch(model, [ids], len(ids) + 4 * steps + 8 + PERF_STEPS * perf, None, "regions", None,
                             "whole")
    token = int(stepper.prefill(0, ids).argmax())
    for _ in range(3):  # the first compiles (or loads the compiled graphs), the next settle
        token = int(stepper.decode([0], [token])[0].argmax())

    def decode(n: int) -> float:
        nonlocal token
        t0 = time.perf_counter()
        for _ in range(n):
            token = int(stepper.decode([0], [token])[0].argmax())
        return (time.perf_counter() - t0) / n * 1e3

    plain = min(decode(steps) for _ in range(2))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = decode(steps)
    groups = group_profile({e.key: e.self_cpu_time_total for e in prof.key_averages()})
    parts = [f"{name} {us / steps / 1e3:.2f}" for name, us in groups.items()]
    rest = profiled - sum(groups.values()) / steps / 1e3
    return [f"regions decode step {plain:.2f} ms (unprofiled); profiled {profiled:.2f} ms a step: " + ", ".join(parts)
            + f", the rest (Python) {rest:.2f} ms"] + (perf_threads(decode, PERF_STEPS) if perf else [])


def perf_group(dso: str) -> str:
    """PERF_GROUPS' name for a sample's library (its path, as `perf script` prints it)."""
    name = Path(dso.strip("()")).name
    for group, starts, folders in PERF_GROUPS:
        if name.startswith(starts) if starts else any(f in dso for f in folders):
            return group
    return "other"


def group_perf_samples(lines: Iterable[str], main_tid: int) -> dict[str, dict[str, float]]:
    """`perf script -F tid,ip,dso` lines -> {"main thread": {group: share}, "other threads": {...}}: each side's
    samples by `perf_group`, as shares of that side's samples (a side without samples is left out)."""
    counts: dict[str, dict[str, int]] = {"main thread": defaultdict(int), "other threads": defaultdict(int)}
    for line in lines:
        parts = line.split()
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        side = "main thread" if int(parts[0]) == main_tid else "other threads"
        counts[side][perf_group(" ".join(parts[2:]))] += 1
    return {side: {g: n / sum(c.values()) for g, n in c.items()} for side, c in counts.items() if c}


def perf_threads(decode: Callable[[int], float], steps: int) -> list[str]:
    """`steps` decode steps (`decode(n)` -> ms a step) sampled by `perf record` on this process: the report's lines,
    each group's share of the main thread's samples and of the other threads' (`group_perf_samples`); one line
    saying why not where perf cannot run here."""
    if shutil.which("perf") is None:
        return ["per thread: perf not found (Linux's perf, for --perf)"]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        rec = subprocess.Popen(["perf", "record", "-F", "1000", "-p", str(os.getpid()), "-o", str(data)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)  # attached
        if rec.poll() is not None:
            said = rec.stderr.read().strip().splitlines()
            return [f"per thread: perf record failed ({said[-1] if said else f'exit {rec.returncode}'})"]
        step_ms = decode(steps)
        rec.send_signal(signal.SIGINT)
        rec.communicate(timeout=60)
        script = subprocess.run(["perf", "script", "-F", "tid,ip,dso", "-i", str(data)], capture_output=True,
                                text=True, check=False)
    shares = group_perf_samples(script.stdout.splitlines(), threading.get_native_id())
    if "main thread" not in shares:
        return [f"per thread: perf recorded no samples of this process ({script.stderr.strip()[-200:]})"]
    sides = list(shares)
    lines = [f"per thread, sampled by perf ({step_ms:.2f} ms a step while sampled; share of each side's samples):",
             f"  {'':42}" + "".join(f"{side:>15}" for side in sides)]
    for group in [g for g, _, _ in PERF_GROUPS] + ["other"]:
        if any(group in shares[side] for side in sides):
            lines.append(f"  {group:42}" + "".join(f"{shares[side].get(group, 0.0):15.1%}" for side in sides))
    return lines


def run(model_dir: Path, steps: int, rounds: int, bandwidth: bool | float = True, regions: bool = False,
        perf: bool = False) -> list[str]:
    """The report's lines; `bandwidth` the read bandwidth in bytes/s to set the GEMVs' bytes against, True to
    measure it (`read_bandwidth`), False for none; `regions`: a compiled-regions step profiled too, last
    (`profile_regions`); `perf`: the last step measured (regions, or eager) sampled per thread (`perf_threads`)."""
    runner = load_runner(str(model_dir))
    model = runner.model
    kernel = model.layers[0].attn.opts.cpu
    stream = _read_stream()
    if not kernel.on or stream is None:
        raise SystemExit(f"needs the CPU kernel and a C++ compiler (kernel: {kernel.status()})")
    vocab = runner.config.vocab_size
    ids = [5 + (7919 * i) % (vocab - 5) for i in range(128)]
    tokens = [5 + (104729 * i) % (vocab - 5) for i in range(3 * steps + PERF_STEPS * (perf and not regions))]
    model.setup_caches(1, len(ids) + len(tokens) + 1)
    stepper = Stepper(model, 512)
    with torch.inference_mode():
        stepper.prefill(0, ids)
        step_time(stepper, tokens[:steps])  # warm: first-touch costs paid
        calls = record(kernel, stepper, tokens[steps:2 * steps])
        step_s = step_time(stepper, tokens[2 * steps:3 * steps])
        threads = torch.get_num_threads()
        replays, reads = [], []
        for _ in range(rounds):
            replays.append(replay(kernel, calls))
            reads.append(read(stream, calls, threads))
        if regions:
            lines = profile_regions(model, ids, 4 * steps, perf)
        elif perf:
            lines = perf_threads(lambda n: step_time(stepper, tokens[3 * steps:3 * steps + n]) * 1e3, PERF_STEPS)
        else:
            lines = []
    bytes_s = read_bandwidth() if bandwidth is True else float(bandwidth) or None
    return report(calls, replays, reads, steps, step_s, bytes_s) + lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="mhcrun checkpoint (default: the mid-size config's 4 layers)")
    ap.add_argument("--steps", type=int, default=4, help="decode steps recorded (and as many timed unrecorded)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--regions", action="store_true", help="also profile a compiled-regions step")
    ap.add_argument("--perf", action="store_true", help="sample the last step measured per thread by Linux's perf")
    ap.add_argument("--bandwidth", type=float, help="the read bandwidth in GB/s to set the GEMVs' bytes against "
                    "(default: measured, bench_quantized.read_bandwidth)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = Path(tmp) / "mid4"
            make_synthetic(ROOT / "configs" / "v4-mid.json", model_dir, 4)
        print(f"model {model_dir}; {torch.get_num_threads()} threads; {args.steps} steps recorded, "
              f"{args.rounds} rounds")
        bandwidth = True if args.bandwidth is None else args.bandwidth * 1e9
        print("\n".join(run(model_dir, args.steps, args.rounds, bandwidth, args.regions, args.perf)))


if __name__ == "__main__":
    run_script(main)
