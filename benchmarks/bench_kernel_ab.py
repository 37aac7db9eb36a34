"""The CPU kernel of a git commit beside the working tree's, alternating in one process: eager decode, routed experts.

    python benchmarks/bench_kernel_ab.py --base REF [--model DIR] [--rounds 8] [--tokens 8] [--calls 200]

`--base` names a commit (or any git revision) whose `mhcrun/ops/qgemv.cpp` is built beside the working tree's, with
the same compiler and flags (`mhcrun.ops.native.build`, into a temp cache). One model is loaded once; the run's
`CpuKernel` is pointed at one library, then the other, round after round, so the machine's drift (these VMs move
between phases within minutes) falls on both alike. Prints, per library, the median and best of:
- eager decode ms a step (`--tokens` decoded a round after a 128-token prompt, `--rounds` rounds), the model at
  `--model` (default: the mid-size config's 4 layers, made in a temp dir);
- one routed-expert call (`CpuKernel.moe_routed`: a decode row through 6 of 64 experts, w1 / w3 [1,024 x 2,048] and
  w2 [2,048 x 1,024] in the model's expert format, random weights, 200 MB of them, so each call reads its experts
  out of DRAM), `--calls` calls a round, and its rate in GB/s of expert bytes;
and the ratios working tree / base. Both libraries must agree: each round's routed results are compared (within
the fp32 bound of summation order, since the two may sum in different orders).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mhcrun.errors import run_script  # noqa: E402
from mhcrun.generate import generate  # noqa: E402
from mhcrun.ops.native import build  # noqa: E402
from mhcrun.ops.qgemv import CpuKernel, ExpertSet, expert_set  # noqa: E402
from mhcrun.ops.quant import ACT_FP8_BLOCK  # noqa: E402
from mhcrun.ops.qweight import QWeight  # noqa: E402
from mhcrun.runner import load_runner  # noqa: E402
from mhcrun.synthetic import make_synthetic  # noqa: E402

SOURCE = "mhcrun/ops/qgemv.cpp"


def build_base(ref: str, cache: Path, cxx: str) -> str:
    """The kernel library of `ref`'s source, built into `cache`."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{SOURCE}"], capture_output=True, check=False)
    if src.returncode:
        raise SystemExit(f"git show {ref}:{SOURCE} failed: {src.stderr.decode().strip()}")
    path = cache / "qgemv.cpp"  # the same stem as the tree's: the build keys on the source's bytes
    path.write_bytes(src.stdout)
    return str(build(path, cache / "lib", cxx))


def routed_sets(fmt: str, g: torch.Generator, experts: int = 64) -> tuple[list[ExpertSet], list[QWeight]]:
    """w1, w3, w2 of `experts` random experts in `fmt` (fp4: e2m1 pairs, e8m0 scales a group of 32; fp8: e4m3 without
    NaN codes, fp32 tile scales), the mid-size config's shapes, and the weights, which the caller keeps alive while
    the sets are read (a set holds their addresses only)."""
    def weight(n: int, k: int) -> QWeight:
        if fmt == "fp4":
            data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g).view(torch.int8)
            scale = torch.randint(118, 124, (n, k // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
            return QWeight(data, scale, 32).checked()
        data = torch.randint(0, 0x7E, (n, k), dtype=torch.uint8, generator=g)
        data |= torch.randint(0, 2, (n, k), dtype=torch.uint8, generator=g) << 7
        scale = torch.full((n // 128, k // 128), 2.0**-8)
        return QWeight(data.view(torch.float8_e4m3fn), scale, 128).checked()

    shapes = {"w1": (1024, 2048), "w3": (1024, 2048), "w2": (2048, 1024)}
    weights = {name: [weight(*shapes[name]) for _ in range(experts)] for name in ("w1", "w3", "w2")}
    sets = [expert_set(ws) for ws in weights.values()]
    if any(s is None for s in sets):
        raise SystemExit("the CPU kernel does not take these experts where they lie")
    return sets, [w for ws in weights.values() for w in ws]


def time_routed(kernel: CpuKernel, sets: list[ExpertSet], routes: list[torch.Tensor], x: torch.Tensor) -> tuple:
    """Seconds a call, median over the routes, and the last call's result."""
    weights, ts, y = torch.full((1, 6), 0.25), [], None
    for idx in routes:
        t0 = time.perf_counter()
        y = kernel.moe_routed(x, weights, idx, *sets, 10.0, ACT_FP8_BLOCK)
        ts.append(time.perf_counter() - t0)
        if y is None:
            raise SystemExit(f"the kernel declined the routed call ({kernel.library})")
    return statistics.median(ts), y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision whose qgemv.cpp is the base")
    ap.add_argument("--model", type=Path, help="mhcrun checkpoint (default: the mid-size config's 4 layers)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8, help="tokens decoded a round")
    ap.add_argument("--calls", type=int, default=200, help="routed-expert calls a round")
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model_dir = args.model
        if model_dir is None:
            model_dir = tmp_path / "mid4"
            make_synthetic(ROOT / "configs" / "v4-mid.json", model_dir, 4)
        runner = load_runner(str(model_dir))
        model = runner.model
        opts = model.layers[0].attn.opts
        tree = opts.cpu
        if not tree.on:
            raise SystemExit(f"the CPU kernel is off here: {tree.status()}")
        base = dataclasses.replace(tree, library=build_base(args.base, tmp_path, os.environ.get("CXX", "g++")))
        kernels = {"base": base, "tree": tree}
        ids = [5 + (7919 * i) % (runner.config.vocab_size - 5) for i in range(128)]
        g = torch.Generator().manual_seed(1)
        fmt = model.layers[1].ffn.experts[0].w1.w.fmt
        sets, _held = routed_sets(fmt, g)
        routes = [torch.randperm(64, generator=g)[:6].view(1, 6) for _ in range(args.calls)]
        x = torch.randn(1, 2048, generator=g)
        step = {k: [] for k in kernels}
        call = {k: [] for k in kernels}
        for kernel in kernels.values():  # warm: the library loaded, the first-touch costs paid
            opts.cpu = kernel
            generate(model, [ids], 2, -1, ignore_eos=True)
            time_routed(kernel, sets, routes[:10], x)
        for _ in range(args.rounds):
            ys = {}
            for name, kernel in kernels.items():
                opts.cpu = kernel
                first = [0.0]

                def on_token(row: int, i: int, first: list[float] = first) -> None:
                    first[0] = first[0] or time.perf_counter()

                generate(model, [ids], args.tokens + 1, -1, ignore_eos=True, on_token=on_token)
                step[name].append((time.perf_counter() - first[0]) / args.tokens)
                secs, ys[name] = time_routed(kernel, sets, routes, x)
                call[name].append(secs)
            diff = float((ys["tree"] - ys["base"]).abs().max())
            if diff > 1e-4 * float(ys["base"].abs().max()):
                raise SystemExit(f"the two libraries' routed results differ by {diff:.3g}")
        mb = 6 * sum(s.out_features * s.in_features for s in sets) * (0.5 if fmt == "fp4" else 1) / 1e6
        print(f"model {model_dir}, experts {fmt}; {torch.get_num_threads()} threads; {args.rounds} alternating rounds")
        print(f"{'':28s}{'base ' + args.base:>22s}{'working tree':>22s}{'tree / base':>14s}")
        for label, data in (("eager decode ms a step", step), ("routed-expert call ms", call)):
            med = {k: statistics.median(v) * 1e3 for k, v in data.items()}
            best = {k: min(v) * 1e3 for k, v in data.items()}
            print(f"{label + ' (median)':28s}{med['base']:22.3f}{med['tree']:22.3f}{med['tree'] / med['base']:14.2f}")
            print(f"{label + ' (best)':28s}{best['base']:22.3f}{best['tree']:22.3f}{best['tree'] / best['base']:14.2f}")
        rate = {k: mb / 1e3 / statistics.median(v) for k, v in call.items()}
        print(f"{'routed call GB/s (median)':28s}{rate['base']:22.1f}{rate['tree']:22.1f}"
              f"{rate['tree'] / rate['base']:14.2f}")


if __name__ == "__main__":
    run_script(main)
