"""What the mHC steps of V4-Flash cost on one Trainium2 NeuronCore-v3, estimated from mhcrun's NKI simulator.

    python benchmarks/bench_nki.py                # T = 1, 4, 16 (decode rows) and 1024 (prefill); a few minutes
    python benchmarks/bench_nki.py --tokens 1 4   # only these T
    python benchmarks/bench_nki.py --model-only   # only the model path: the bundled tiny model, counted and timed

Each kernel runs once in the simulator on V4-Flash's shapes (d = 4096, n = 4, fn 24 x 16,384, bf16
activations); the simulator counts its DMA transfers and engine instructions and mhcrun.nki.sim.costmodel turns
them into an estimated time (busiest engine, engines overlapping) plus 32 us per launch. Per layer: two mHC sites;
per token: 43 layers (the head's one launch a token left out), divided by the T rows of the step. The floor is
the bytes the kernels move at one core's share of HBM bandwidth; the fn floor is the fn bytes alone (hi + lo
bf16 = fp32 size).
An estimate from documented figures, not a measurement: see the cost model's docstring for what it rests on and
the sensitivity table for the constants no document gives.

The model path: the bundled tiny model generates with the hc steps in the simulator (MHCRUN_NKI_SIM=1) and on
the torch path (MHCRUN_NKI_HC=0); stats.kernels gives the launches per forward and per layer (all hc kernels of a
forward but the two outside the layers: the head's post step and collapse, or before the chained formulation
the expand and the head; a forward being one hc_head), and the run its CPU wall time.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from mhcrun.errors import run_script
from mhcrun.nki.ops import KERNEL_SOURCE, HcBackend
from mhcrun.nki.sim import load_kernel_module
from mhcrun.nki.sim.costmodel import FIGURES, SENSITIVITY, estimate, floor_us, with_figures
from mhcrun.nki.sim.costs import CostLog
from mhcrun.nki.sim.nki import profile

D, N, LAYERS, SITES = 4096, 4, 43, 2
MIX = (2 + N) * N
FN_BYTES = MIX * N * D * 4  # hi + lo bf16 = the fp32 fn's size


@dataclass
class Step:
    """One mHC site's kernels at T rows: their launches and merged cost log."""

    launches: int
    log: CostLog


def inputs(t: int, g: torch.Generator) -> dict:
    x = torch.randn(t, N * D, generator=g).to(torch.bfloat16)
    fn = torch.randn(MIX, N * D, generator=g) * (N * D) ** -0.5
    hi = fn.to(torch.bfloat16)
    lo = (fn - hi.float()).to(torch.bfloat16)
    return {
        "x": x, "hi": hi, "lo": lo, "scale": torch.rand(1, 3, generator=g) + 0.5,
        "base": torch.randn(MIX, generator=g) * 0.5, "pre": torch.rand(t, N, generator=g),
        "y": torch.randn(t, D, generator=g).to(torch.bfloat16), "post": torch.rand(t, N, generator=g) * 2,
        "comb": torch.rand(t, N * N, generator=g), "w": torch.randn(D, generator=g),
    }  # fmt: skip


def run(kernel, *args) -> CostLog:
    return profile(kernel)(*args)[1].costs


def today(k, a: dict) -> Step:
    """Today's site: mixes, collapse, post (three launches)."""
    log = CostLog()
    log.extend(run(k.hc_mixes_v4, a["x"], a["hi"], a["lo"], a["scale"], a["base"]))
    log.extend(run(k.hc_collapse, a["x"], a["pre"]))
    log.extend(run(k.hc_attn_out, a["y"], a["x"], a["post"], a["comb"]))
    return Step(3, log)


def fused(k, a: dict) -> Step:
    """The new site: hc_pre (mixes, collapse and the sublayer's RMSNorm, which today's three leave to torch) and
    hc_post, each in the layout its T asks for (two launches)."""
    log = CostLog()
    log.extend(run(k.hc_pre_v4, a["x"], a["hi"], a["lo"], a["scale"], a["base"], a["w"]))
    log.extend(run(k.hc_post, a["y"], a["x"], a["post"], a["comb"]))
    return Step(2, log)


def chained(k, a: dict) -> Step:
    """Decode rows only: hc_post of one site and hc_pre of the next in one launch (hc_post_pre), one launch a site;
    at T above DECODE_MAX_T the kernel does not exist and the site runs as "fused"."""
    if a["x"].shape[0] > k.DECODE_MAX_T:
        return fused(k, a)
    return Step(1, run(k.hc_post_pre_v4, a["y"], a["x"], a["post"], a["comb"], a["hi"], a["lo"], a["scale"],
                       a["base"], a["w"]))


VARIANTS = {"today": today, "fused": fused, "chained": chained}


def head(k, a: dict) -> Step:
    """The model's head a forward: the last layer half's post step (hc_post) and the head collapse (hc_head, fn
    [n, n*d]), two launches."""
    log = CostLog()
    log.extend(run(k.hc_post, a["y"], a["x"], a["post"], a["comb"]))
    log.extend(run(k.hc_head_v4, a["x"], a["hi"][:N], a["lo"][:N], a["scale"][:, :1], a["base"][:N]))
    return Step(2, log)


def model_token(chain: Step, top: Step, t: int, figures=FIGURES) -> tuple[int, float, float]:
    """The model's mHC steps for one decode token at T rows (a forward over T rows, per row): 43 layers x 2 sites
    of `chain` and the head's `top` -> (launches, est. ms, of which launches ms)."""
    site, end = estimate(chain.log, figures).overlapped_us, estimate(top.log, figures).overlapped_us
    launches = LAYERS * SITES * chain.launches + top.launches
    launch_ms = launches * figures.launch_s * 1e3
    return launches, (LAYERS * SITES * site + end) / 1e3 / t + launch_ms / t, launch_ms / t


def row(name: str, t: int, step: Step, figures=FIGURES) -> tuple:
    e = estimate(step.log, figures)
    site_us = e.overlapped_us + step.launches * figures.launch_s * 1e6
    layer_us, layer_nolaunch = SITES * site_us, SITES * e.overlapped_us
    token_ms = LAYERS * layer_us / t / 1e3
    floor = SITES * floor_us(e.dma_bytes, figures)
    fn_floor = SITES * floor_us(FN_BYTES, figures)
    return (name, t, SITES * step.launches, SITES * e.dmas, SITES * e.small_dmas, SITES * e.dma_bytes / 2**20,
            layer_nolaunch, layer_us, token_ms, floor, fn_floor, e)


MODEL_PROMPT = [0, 5, 6, 7, 11, 13, 17, 19]
MODEL_PATHS = {"nki-sim": HcBackend(sim="exact"), "torch": HcBackend(torch_only=True)}  # MHCRUN_NKI_SIM=1, _HC=0


def model_launches(kernels: dict[str, dict[str, int]], backend: str, layers: int) -> tuple[float, float, int]:
    """stats.kernels of a run -> (hc launches per forward, per layer and forward, forwards) on `backend`: per
    layer, every hc kernel of a forward but the two outside the layers, over layers x forwards."""
    forwards = kernels["hc_head"][backend]
    total = sum(v[backend] for name, v in kernels.items() if name not in ("rmsnorm", "swiglu"))
    return total / forwards, (total - 2 * forwards) / (layers * forwards), forwards


def model_path(new_tokens: int, repeats: int) -> None:
    """The bundled tiny model's generate on each hc path: hc calls per layer (stats.kernels; on a kernel path one
    launch each) and the best wall time of `repeats` runs, the paths taking turns."""
    from mhcrun.generate import generate
    from mhcrun.runner import load_runner

    runner = load_runner(None)
    layers = len(runner.model.layers)
    print(f"\nmodel path: bundled tiny model ({layers} layers), prompt of {len(MODEL_PROMPT)} tokens + {new_tokens} "
          f"decoded, eager, CPU, best of {repeats}")
    best: dict[str, tuple[float, object]] = {}
    for _ in range(repeats):
        for path, hc in MODEL_PATHS.items():
            hc.reset()
            runner.model.opts.hc = hc
            t0 = time.perf_counter()
            res = generate(runner.model, [MODEL_PROMPT], new_tokens, runner.config.eos_token_id, ignore_eos=True)[0]
            wall = time.perf_counter() - t0
            if path not in best or wall < best[path][0]:
                best[path] = (wall, res)
    print(f"{'hc path':<8} {'calls/forward':>13} {'calls/layer':>11} {'forwards':>8} {'wall s':>7} "
          f"{'decode tok/s':>12}  kernels run")
    for path, (wall, res) in best.items():
        kernels = res.stats["kernels"]
        per_forward, per_layer, forwards = model_launches(kernels, path, layers)
        ran = ", ".join(f"{name} {v[path]}" for name, v in kernels.items() if v[path])
        print(f"{path:<8} {per_forward:>13g} {per_layer:>11g} {forwards:>8} {wall:>7.2f} "
              f"{res.stats['decode_tok_s']:>12.2f}  {ran}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 1024])
    ap.add_argument("--model-only", action="store_true", help="only the model path's launches and wall time")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens the model path decodes")
    ap.add_argument("--repeats", type=int, default=3, help="model path runs per hc path (the best is kept)")
    args = ap.parse_args()
    if not args.model_only:
        kernel_level(args.tokens)
    model_path(args.new_tokens, args.repeats)


def kernel_level(tokens: list[int]) -> None:
    """The kernels at V4-Flash's shapes, each variant at each T, and the sensitivity to undocumented constants."""
    k = load_kernel_module(KERNEL_SOURCE)
    g = torch.Generator().manual_seed(0)
    print("per layer = 2 mHC sites; per token = 43 layers / T rows; times in us unless marked; estimates")
    print(f"{'kernels':<8} {'T':>5} {'launch':>6} {'DMAs':>6} {'<2KiB':>6} {'MiB':>7} {'layer(no launch)':>16} "
          f"{'layer':>9} {'token ms':>9} {'floor':>8} {'fn floor':>8}  busiest engine")
    steps = {}
    for t in tokens:
        a = inputs(t, g)
        for name, build in VARIANTS.items():
            step = build(k, a)
            steps[name, t] = step
            r = row(name, t, step)
            e = r[-1]
            busiest = max([("dma", e.dma_us), *e.engine_us.items()], key=lambda kv: kv[1])
            print(f"{r[0]:<8} {r[1]:>5} {r[2]:>6} {r[3]:>6} {r[4]:>6} {r[5]:>7.2f} {r[6]:>16.1f} {r[7]:>9.1f} "
                  f"{r[8]:>9.3f} {r[9]:>8.1f} {r[10]:>8.1f}  {busiest[0]} {busiest[1] * SITES:.1f}")
        steps["head", t] = head(k, a)
    print("\nthe model's mHC steps a decode token (V4-Flash, 43 layers, batch 1: a forward over T rows, per row): "
          "every layer half one hc_post_pre ('chained'), the head hc_post + hc_head; goal 1.5 ms with launches")
    for t in tokens:
        if t <= k.DECODE_MAX_T:
            launches, ms, launch_ms = model_token(steps["chained", t], steps["head", t], t)
            print(f"  T={t:<4} launches {launches}  est. {ms:.2f} ms a token, {launch_ms:.2f} ms of it launch "
                  f"boundaries, {ms - launch_ms:.2f} ms the work")
    print("\nsensitivity: per layer without launches (us) as the undocumented constants move")
    for const, values in SENSITIVITY.items():
        for (name, t), step in steps.items():
            if name == "head":
                continue
            cells = [f"{v:g}: {SITES * estimate(step.log, with_figures(**{const: v})).overlapped_us:.1f}"
                     for v in values]
            print(f"  {const:<20} {name:<8} T={t:<5} " + "  ".join(cells))


if __name__ == "__main__":
    run_script(main)
