"""This tree's decode speed and compile time beside another commit's, measured side by side in one run.

    python benchmarks/bench_versions.py --before 7127625 --mid /tmp/mid4
    (make /tmp/mid4 first: mhcrun make-synthetic configs/v4-mid.json /tmp/mid4 --layers 4)

Each measurement is one `mhcrun generate --json` run in a subprocess with PYTHONPATH on one tree (this one, or a
git worktree of `--before` made in a temporary directory), so both run the same command line through their own
code. The trees alternate run by run and each keeps its best decode rate of `--repeats` (these machines are
noisy). Measured, on the bundled tiny model (a 16-token prompt) and on `--mid` (kept quantised):
- decode tok/s, eager and through compiled regions (warm: the region graphs' inductor cache filled by the cold
  run), and their ratio;
- the cold compile: the first compiled step with a fresh inductor cache directory (`compile_s` of the stats).
Prints a table and the ratios this tree / before; `--json` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
PROMPT = ",".join(map(str, [0] + list(range(3, 18))))  # 16 tokens


def run_generate(tree: Path, model: str, mode: str, tokens: int, cache: Path) -> dict:
    """One `mhcrun generate --json` on `tree`'s code -> its stats (the same checkpoint for every tree)."""
    args = [sys.executable, "-m", "mhcrun.cli", "generate", "-m", model, "--prompt-ids", PROMPT, "-n", str(tokens),
            "--ignore-eos", "--json", "--graph-mode", mode]
    env = dict(os.environ, PYTHONPATH=str(tree), TORCHINDUCTOR_CACHE_DIR=str(cache))
    r = subprocess.run(args, capture_output=True, text=True, cwd=tree, env=env, timeout=1800)
    if r.returncode:
        raise SystemExit(f"{tree}: generate failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.splitlines()[-1])["stats"]


def worktree(rev: str, where: Path) -> Path:
    path = where / f"before-{rev}"
    subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)
    return path


def measure(trees: dict[str, Path], models: dict[str, str], tokens: int, repeats: int,
            tmp: Path) -> dict:
    """Per tree, model and mode: best decode tok/s of `repeats` runs, alternating trees; the cold compile time."""
    out: dict = {}
    for label, model in models.items():
        for mode in ("eager", "regions"):
            for i in range(repeats):
                for name, tree in trees.items():
                    cache = tmp / f"inductor-{name}-{label}"  # fresh for a tree's first regions run: cold
                    stats = run_generate(tree, model, mode, tokens, cache)
                    row = out.setdefault(name, {}).setdefault(label, {}).setdefault(mode, {"decode_tok_s": 0.0})
                    row["decode_tok_s"] = max(row["decode_tok_s"], stats["decode_tok_s"])
                    if mode == "regions" and i == 0:
                        row["cold_compile_s"] = stats["compile_s"]
                    print(f"  {name:>6} {label:<5} {mode:<7} run {i + 1}: {stats['decode_tok_s']:7.2f} tok/s"
                          + (f", compile {stats['compile_s']:.1f} s" if mode == "regions" else ""), flush=True)
    return out


def report(res: dict, before: str) -> None:
    print(f"\n| model | path | this tree | before ({before}) | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for label in res["this"]:
        for mode in ("eager", "regions"):
            a, b = res["this"][label][mode]["decode_tok_s"], res["before"][label][mode]["decode_tok_s"]
            print(f"| {label} | {mode} decode tok/s | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
        a, b = res["this"][label]["regions"]["cold_compile_s"], res["before"][label]["regions"]["cold_compile_s"]
        print(f"| {label} | cold compile s | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
        for name in ("this", "before"):
            r = res[name][label]
            ratio = r["regions"]["decode_tok_s"] / r["eager"]["decode_tok_s"]
            print(f"| {label} | regions / eager ({name}) | | | {ratio:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the commit to compare with (e.g. 7127625)")
    ap.add_argument("--mid", help="a mid-size checkpoint (make-synthetic configs/v4-mid.json DIR --layers 4)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args()
    models = {"tiny": str(HERE / "mhcrun" / "data" / "tiny")} | ({"mid": args.mid} if args.mid else {})
    with tempfile.TemporaryDirectory() as tmp:
        old = worktree(args.before, Path(tmp))
        try:
            res = measure({"this": HERE, "before": old}, models, args.tokens, args.repeats, Path(tmp))
        finally:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(old)], capture_output=True)
    report(res, args.before)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
