"""Speculative decoding with the MTP layer (`generate --draft-tokens K`): speed ratios and acceptance, one run.

    python benchmarks/bench_mtp.py                          # everything (regions compile: several minutes)
    python benchmarks/bench_mtp.py --modes eager --skip-mid  # the bundled model, eager only (about a minute)

Prints, on this machine and in this run:
- on the bundled (trained) model: decode tokens/s at K = 0 (plain decode), 1, 2, 3 draft tokens, eager and with
  compiled regions (the verify at a static K + 1), each as a ratio to K = 0 of the same mode, with the
  acceptance (drafts accepted per position, mean accepted length) and whether the tokens equal K = 0's;
- on the mid-size config (`mhcrun make-synthetic configs/v4-mid.json DIR --layers 4`: random weights, so the
  cost counts, not the acceptance), kept quantised: the time of one verify forward of K + 1 tokens against one
  decode step of 1 token at the same position (median of repeats), and of the span snapshot and restore a
  rejection costs.
Each measurement is repeated and the best (or median) kept: these machines are noisy.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mhcrun.errors import run_script
from mhcrun.generate import generate
from mhcrun.runner import load_runner
from mhcrun.snapshot import restore_span, take_span

HERE = Path(__file__).resolve().parent
TEXTS = ["The module defines", "Return the number of items in the"]


def bundled(ks: list[int], modes: list[str], tokens: int, repeats: int) -> None:
    runner = load_runner(None, mtp=True)
    model = runner.model
    prompts = [runner.tokenizer.encode(TEXTS[0])]
    print(f"bundled model, batch 1, {tokens} new tokens (ignore eos), best of {repeats}")
    for mode in modes:
        base_rate, base_tokens = None, None
        for k in ks:
            best, res = 0.0, None
            for _ in range(repeats):
                res = generate(model, prompts, tokens, 1, ignore_eos=True, graph_mode=mode, draft_tokens=k)
                best = max(best, res[0].stats["decode_tok_s"])
            if k == 0:
                base_rate, base_tokens = best, res[0].tokens
            line = f"  {mode:7s} K={k}: {best:7.1f} tok/s  x{best / base_rate:.2f}"
            spec = res[0].stats.get("speculative")
            if spec:
                per = " ".join(f"{a / p:.2f}" for a, p in zip(spec["drafts_accepted"], spec["drafts_proposed"],
                                                              strict=True))
                line += (f"  accepted per position {per}  mean accepted length {spec['mean_accepted_length']:.2f}"
                         f"  tokens equal K=0: {res[0].tokens == base_tokens}")
            print(line, flush=True)


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def experts_read(model, step, s: int) -> str:
    """The distinct routed experts a step of s tokens runs, per score-routed layer (the hash layers' are fixed
    by the token ids): the weights a bandwidth-bound decode reads grow with them."""
    seen: list[int] = []
    hooks = [layer.ffn.gate.register_forward_hook(lambda m, i, out: seen.append(int(out[1].unique().numel())))
             for layer in model.layers if not layer.ffn.gate.hash]
    try:
        step(s)
    finally:
        for h in hooks:
            h.remove()
    return "/".join(map(str, seen)) + f" of {model.cfg.n_routed_experts}"


def mid(ks: list[int], repeats: int, path: Path | None) -> None:
    from mhcrun.synthetic import make_synthetic

    with tempfile.TemporaryDirectory() as tmp:
        if path is None:
            t0 = time.perf_counter()
            path = make_synthetic(HERE.parent / "configs" / "v4-mid.json", Path(tmp) / "mid", 4)
            print(f"mid-size config, 4 layers: made in {time.perf_counter() - t0:.0f} s")
        model = load_runner(str(path)).model  # kept quantised (FP8 linears, FP4 experts)
        model.setup_caches(1, 128)
        rows, n = torch.tensor([0]), 64
        with torch.inference_mode():
            model(torch.arange(3, 3 + n).view(1, -1), rows, 0)  # a 64-token prompt
            at = torch.tensor([n])

            def step(s: int):
                snap = take_span(model.layers, rows, at, s)
                model(torch.arange(5, 5 + s).view(1, -1), rows, at, every=s > 1, streams=True)
                restore_span(model.layers, snap)  # back to the same position for the next repeat

            one = timed(lambda: step(1), repeats)
            print(f"mid-size config, kept quantised, at position {n}: decode step (1 token) {1e3 * one:.1f} ms "
                  f"(median of {repeats}), routed experts read per routed layer {experts_read(model, step, 1)}")
            for k in ks:
                if k == 0:
                    continue
                cost = timed(lambda k=k: step(k + 1), repeats)
                span = timed(lambda k=k: restore_span(model.layers, take_span(model.layers, rows, at, k + 1)),
                             repeats)
                print(f"  verify K={k} ({k + 1} tokens): {1e3 * cost:.1f} ms = x{cost / one:.2f} a decode step; "
                      f"routed experts read {experts_read(model, step, k + 1)}; span snapshot + restore "
                      f"{1e3 * span:.2f} ms; break-even mean accepted length {cost / one:.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="0,1,2,3")
    ap.add_argument("--modes", default="eager,regions")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-mid", action="store_true")
    ap.add_argument("--skip-bundled", action="store_true")
    ap.add_argument("--mid", type=Path, default=None, help="an existing mid-size checkpoint (else made here)")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not args.skip_bundled:
        bundled(ks, args.modes.split(","), args.tokens, args.repeats)
    if not args.skip_mid:
        mid(ks, max(5, args.repeats), args.mid)


if __name__ == "__main__":
    run_script(main)
