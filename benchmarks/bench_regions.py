"""Decode speed and compile time of compiled regions, measured side by side in one run.

    python benchmarks/bench_regions.py                 # everything (takes several minutes)
    python benchmarks/bench_regions.py --skip-compile  # decode speed only

Prints, on this machine and in this run:
- decode tokens/s of the eager model, compiled regions and one whole-step compile, on the bundled tiny model
  and on a wider random-weight config (batch 1, after a 16-token prompt), with their ratios;
- compile time for 4 vs 43 layers of the same width, regions vs whole-step, each compiled cold (a fresh
  inductor cache directory, in a subprocess);
- Hugging Face transformers' DeepseekV4ForCausalLM decoding greedily on the same tiny checkpoint, when
  transformers is installed (benchmarks/hf_baseline.py).
Each decode measurement is repeated, interleaved, and the best rate kept: these machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mhcrun.config import config_from_hf
from mhcrun.errors import run_script
from mhcrun.model import build_model
from mhcrun.regions.runner import RegionDecoder
from mhcrun.runner import load_runner
from mhcrun.tiny import init_tensors, tiny_config_raw

PROMPT = [0] + list(range(3, 18))  # 16 tokens
HERE = Path(__file__).resolve().parent


def wide_model(n_layers: int = 4, dim: int = 512):
    """A random-weight V4 config wider than the tiny model (same layer kinds)."""
    ratios = ([0, 4, 16, 4] * ((n_layers + 3) // 4))[:n_layers]
    raw = dict(tiny_config_raw(), hidden_size=dim, num_hidden_layers=n_layers, compress_ratios=ratios,
               num_attention_heads=8, q_lora_rank=256, o_groups=4, o_lora_rank=128, moe_intermediate_size=256,
               n_routed_experts=16, num_experts_per_tok=4, index_n_heads=16)
    cfg = config_from_hf(raw)
    return build_model(cfg, init_tensors(cfg, 0), set())


def layered_model(n_layers: int):
    """The tiny model's width with n_layers layers (V4-Flash's pattern of kinds, HCA at ratio 16)."""
    ratios = ([0, 0] + [4 if i % 2 == 0 else 16 for i in range(2, n_layers)])[:n_layers]
    raw = dict(tiny_config_raw(), num_hidden_layers=n_layers, compress_ratios=ratios)
    cfg = config_from_hf(raw)
    return build_model(cfg, init_tensors(cfg, 0), set())


def decode_rates(model, steps: int, repeats: int, hf_model=None) -> dict[str, float]:
    """Best tokens/s over `repeats` interleaved runs of `steps` decode steps, for each path (and for
    transformers' cached greedy decode when `hf_model` is given)."""
    max_seq = len(PROMPT) + steps + 1
    model.setup_caches(1, max_seq)
    decoders = {"regions": RegionDecoder(model, "regions"), "step": RegionDecoder(model, "step")}
    best = {"eager": 0.0, "regions": 0.0, "step": 0.0}
    if hf_model is not None:
        from hf_baseline import hf_greedy  # on sys.path via transformers_model

        best["transformers"] = 0.0
    with torch.inference_mode():
        for dec in decoders.values():  # compile outside the timed runs
            model(torch.tensor([PROMPT]), torch.tensor([0]))
            dec(torch.tensor([5]), torch.tensor([len(PROMPT)]))
        for _ in range(repeats):
            for path in best:
                if path == "transformers":
                    best[path] = max(best[path], hf_greedy(hf_model, PROMPT, steps + 1)["decode_tok_s"])
                    continue
                model(torch.tensor([PROMPT]), torch.tensor([0]))
                tok = torch.tensor([5])
                t0 = time.perf_counter()
                for i in range(steps):
                    pos = torch.tensor([len(PROMPT) + i])
                    if path == "eager":
                        logits = model(tok.view(1, 1), torch.tensor([0]), pos)
                    else:
                        logits = decoders[path](tok, pos)
                    tok = logits.argmax(-1)
                best[path] = max(best[path], steps / (time.perf_counter() - t0))
    return best


def compile_seconds(n_layers: int, mode: str, timeout: int) -> float | None:
    """Cold compile time of one decode step (fresh inductor cache, own process); None past the timeout."""
    code = (f"import sys, time, torch; sys.path.insert(0, {str(HERE)!r}); import bench_regions as b; "
            f"from mhcrun.regions.runner import RegionDecoder; m = b.layered_model({n_layers}); "
            f"m.setup_caches(1, 64); d = RegionDecoder(m, {mode!r}); t0 = time.perf_counter(); "
            "d(torch.tensor([5]), torch.tensor([0])); print(time.perf_counter() - t0)")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        try:
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                 timeout=timeout, check=True)
        except subprocess.TimeoutExpired:
            return None
    return float(out.stdout.strip().splitlines()[-1])


def transformers_model(runner):
    """transformers' DeepseekV4ForCausalLM on the same checkpoint (benchmarks/hf_baseline.py), or None."""
    try:
        sys.path.insert(0, str(HERE))
        from hf_baseline import build_hf_model
    except (ImportError, SystemExit):  # hf_baseline exits when transformers is not installed
        return None
    raw = json.loads((runner.path / "config.json").read_text())
    return build_hf_model(runner.ckpt, raw, torch.float32)


def show(seconds: float | None, timeout: int) -> str:
    return f"{seconds:7.1f}" if seconds is not None else f"> {timeout} (stopped)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--compile-timeout", type=int, default=900)
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args()
    torch.manual_seed(0)
    results: dict = {"threads": torch.get_num_threads()}

    print(f"decode tokens/s, batch 1, {args.steps} steps after a {len(PROMPT)}-token prompt "
          f"({torch.get_num_threads()} threads; best of {args.repeats})")
    # transformers has no FP8/FP4 simulation and takes fp32 tensors: compare like with like
    tiny = load_runner(None, quant_sim=False, dequantize=True)
    hf = transformers_model(tiny)
    for name, model, peer in (("tiny", tiny.model, hf), ("wide (d=512)", wide_model(), None)):
        r = decode_rates(model, args.steps, args.repeats, peer)
        results[name] = r
        print(f"  {name:13s} eager {r['eager']:8.1f}  regions {r['regions']:8.1f}  step {r['step']:8.1f}   "
              f"regions/eager {r['regions'] / r['eager']:.2f}x  step/eager {r['step'] / r['eager']:.2f}x")
        if "transformers" in r:
            print(f"  {'':13s} transformers DeepseekV4ForCausalLM (greedy, cached) {r['transformers']:8.1f}   "
                  f"regions/transformers {r['regions'] / r['transformers']:.2f}x  "
                  f"eager/transformers {r['eager'] / r['transformers']:.2f}x")
    if hf is None:
        print("  transformers baseline: not available (pip install transformers==5.24.0)")

    if not args.skip_compile:
        print("cold compile seconds of one decode step (tiny width; fresh inductor cache per run)")
        comp = {}
        for mode in ("regions", "step"):
            for n in (4, 43):
                comp[f"{mode}_{n}"] = compile_seconds(n, mode, args.compile_timeout)
            a, b = comp[f"{mode}_4"], comp[f"{mode}_43"]
            ratio = f"{b / a:.2f}x" if a and b else "n/a"
            print(f"  {mode:8s} 4 layers {show(a, args.compile_timeout)}  43 layers {show(b, args.compile_timeout)}"
                  f"   43/4 {ratio}")
        results["compile_s"] = comp
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    run_script(main)
