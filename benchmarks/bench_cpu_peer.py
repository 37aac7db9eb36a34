"""mhcrun beside ik_llama.cpp on the same checkpoint and CPU: decode and prefill speed, bytes read, ratios.

    python benchmarks/bench_cpu_peer.py --llama-bench PATH --gguf FILE [--model DIR] [--threads 2] [--rounds 3]
        [--peer-huge-pages]
    python benchmarks/bench_cpu_peer.py [--model DIR]     # mhcrun alone: its rates against the machine's

`--llama-bench` is an ik_llama.cpp `llama-bench` you built and `--gguf` the same checkpoint converted for it
(docs/cpu-peer.md says how: benchmarks/export_gguf.py converts; nothing here builds the peer). `--model` is the mhcrun
checkpoint (default: the mid-size config's 4 layers, `mhcrun make-synthetic configs/v4-mid.json DIR --layers 4`,
written to a temp dir; the GGUF must be made from the same directory). Each round runs, one after the other,
mhcrun eager, mhcrun in compiled regions and llama-bench, with the same thread count (OMP_NUM_THREADS / -t); the
best of the rounds is kept per measurement (the machine is shared and noisy; alternating keeps its drift out of
the ratios).

Prints, in one run:
- the read bandwidth (the fastest of a native read loop and torch's reductions over 512 MB, the threads given, on
  4 KB pages and on 2 MB ones: `bench_quantized.read_bandwidth`), measured just before each side's runs in every
  round, and torch's fp32 matmul rate at 4,096, measured in every round and the best kept, as for the rates. These
  VMs' read stream moves between phases within minutes (~30-38 GB/s; on a Zen 4 VM 33-35, in bursts of 1-4 s 50-64:
  benchmarks/read_phases.py):
  a decode's share is its rate against the read stream measured beside it, in the same round (`paired_share`),
  the best round's kept as for the rates; one read stream for the whole run made every share rise or fall with the
  phase that one met, not with the phase its decode ran in;
- the pages each side's weights are on (mhcrun's `weight_pages`; ik_llama.cpp's mmap of the GGUF is on 4 KB pages,
  and with `--peer-huge-pages` it reads the model into 2 MB hugetlbfs pages: its `-thp 1`, for which pages must be
  reserved, `echo N > /proc/sys/vm/nr_hugepages` as root, N at least the GGUF's size / 2 MB);
- decode tok/s (batch 1) after 128 and after 1,024 prompt tokens (mhcrun: `generate --prompt-ids` of that length
  then `--gen` tokens, its `decode_tok_s`; ik: `llama-bench -gp N,G`), prefill tok/s at 128 and 1,024 (mhcrun's
  `prefill_tok_s`, ik's `-p N`); both warmed up: llama-bench runs a prompt token and a generated token untimed
  before each test (its default), and mhcrun `generate --warmup` the prompt and a decode step after it (the
  first-touch costs of a fresh process, the weights' pages mapped in above all, would otherwise count in mhcrun's
  prefill and its first decode step alone);
- weight bytes one decoded token reads (mhcrun: `mhcrun.memory.decode_bytes_per_token` of the checkpoint kept
  quantised; ik: the GGUF's tensors, routed experts at their active share, one embedding row) and the share of
  the read bandwidth that makes at each decode rate; prefill's rate of weight multiply-adds against the matmul
  rate;
- regions' compile time: as a first run on a machine (its first process: torch's caches, its inductor cache and
  the precompiled headers, in an empty folder), cold (the next prompt length's first run: its context makes graphs of
  its own, the headers built) and warm (the later rounds');
- the ratios mhcrun / ik and which of issue 20's goals are met;
- where a goal of decode's share of the read bandwidth is missed, what a decode step's time goes to:
  benchmarks/bench_step_gemvs.py run on the same checkpoint and threads (an eager step's GEMV calls per kind and
  format against a plain read of their bytes, and the rest of the step; a compiled-regions step under torch's
  profiler, its GEMV ops, the other kernels, the graphs' code, the wrappers and Python; the last step sampled per
  thread by Linux's perf where it is installed), beside the step the goal would take (`--no-breakdown` skips it).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantized import read_bandwidth  # noqa: E402

from mhcrun.checkpoint import plan_checkpoint  # noqa: E402
from mhcrun.errors import InputError, run_script  # noqa: E402
from mhcrun.memory import decode_bytes_per_token, decode_macs_per_token  # noqa: E402
from mhcrun.synthetic import make_synthetic  # noqa: E402

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PROMPTS = (128, 1024)
# issue 20's goals: decode at >= 60% of the read bandwidth, prefill of 1,024 at >= 50% of the matmul rate, compiled
# regions compiled cold in <= 30 s
GOAL_SHARE, GOAL_MATMUL, GOAL_COMPILE_S = 0.6, 0.5, 30.0
MODES = ("eager", "regions")


def matmul_rate(n: int = 4096, repeats: int = 3) -> float:
    """fp32 multiply-adds per second of torch's [n, n] x [n, n] on this process's threads, best of `repeats`."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return n**3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def prompt_ids(n: int, vocab: int) -> str:
    """n prompt token ids spread over the vocabulary (what they are does not matter to the speed)."""
    return ",".join(str(5 + (7919 * i) % (vocab - 5)) for i in range(n))


def run_mhcrun(model: Path, mode: str, n_prompt: int, n_gen: int, vocab: int, threads: int,
               torch_caches: Path) -> dict:
    """One `mhcrun generate --json` in its own process, torch's on-disk caches in `torch_caches`: its stats."""
    cmd = [sys.executable, "-m", "mhcrun.cli", "generate", "-m", str(model), "--prompt-ids",
           prompt_ids(n_prompt, vocab), "-n", str(n_gen), "--ignore-eos", "--json", "--graph-mode", mode, "--warmup"]
    env = os.environ | {"OMP_NUM_THREADS": str(threads)} | torch_caches_env(torch_caches)
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if res.returncode:
        raise SystemExit(f"mhcrun generate ({mode}, {n_prompt} prompt tokens) failed: {res.stderr.strip()[-500:]}")
    return json.loads(res.stdout.splitlines()[-1])["stats"]


def torch_caches_env(folder: Path) -> dict[str, str]:
    """The environment that puts torch's on-disk caches in `folder`: inductor's cache and, through the temporary
    folder torch's default cache lies in, the headers it precompiles (outside the inductor cache), so that a first
    compile there is a first run on a machine."""
    folder.mkdir(exist_ok=True)
    return {"TMPDIR": str(folder), "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}


def run_llama_bench(exe: Path, gguf: Path, n_gen: int, threads: int, huge_pages: bool = False) -> list[dict]:
    """One llama-bench run of every test (prefill 128 and 1,024; decode of n_gen after each), one repetition; with
    `huge_pages`, the model read into 2 MB pages (its `-thp 1`: hugetlbfs pages, which must be reserved)."""
    cmd = [str(exe), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", "-p", ",".join(map(str, PROMPTS)),
           "-n", "0", *[a for n in PROMPTS for a in ("-gp", f"{n},{n_gen}")], *(["-thp", "1"] if huge_pages else [])]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(f"llama-bench failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")
    if huge_pages and "using THP" not in res.stdout:  # it falls back to 4 KB pages, saying so on stderr only
        raise SystemExit("llama-bench -thp 1 did not get huge pages: reserve hugetlbfs pages first (as root: echo N > "
                         "/proc/sys/vm/nr_hugepages, N at least the GGUF's size / 2 MB)")
    # -thp prints its own line ("impl: using THP ...") inside the JSON, at each model load
    return json.loads("\n".join(line for line in res.stdout.splitlines() if not line.startswith("impl: ")))


def ik_rates(rows: list[dict]) -> dict[str, float]:
    """llama-bench's JSON -> {"prefill@N": tok/s, "decode@N": tok/s}: a -p test has n_gen 0, a -gp test both."""
    out = {}
    for r in rows:
        kind = "prefill" if r["n_gen"] == 0 else "decode"
        out[f"{kind}@{r['n_prompt']}"] = float(r["avg_ts"])
    return out


def gguf_bytes_per_token(gguf: Path) -> int:
    """Weight bytes one decoded token reads from a GGUF: every tensor, the routed experts' stacks (`*_exps`) at
    expert_used_count / expert_count, one row of the token embedding."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise SystemExit("reading the GGUF's tensor sizes needs the gguf package: pip install gguf") from None
    reader = GGUFReader(str(gguf))
    meta = {k: v.contents() for k, v in reader.fields.items() if k.endswith((".expert_used_count", ".expert_count"))}
    used = next(v for k, v in meta.items() if k.endswith(".expert_used_count"))
    experts = next(v for k, v in meta.items() if k.endswith(".expert_count"))
    total = 0.0
    for t in reader.tensors:
        share = used / experts if "_exps" in t.name else 1.0
        if t.name == "token_embd.weight":
            share = 1 / int(t.shape[-1])  # GGUF lists dims innermost first: the vocabulary is the last
        total += int(t.n_bytes) * share
    return int(total)


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: max(r[k] for r in runs) for k in runs[0]}


def round_shares(runs: list[dict[str, float]], key: str, read_bytes: float) -> list[tuple[float, float]]:
    """A side's decode share of the read bandwidth in each round: `read_bytes` a token times its rate `key` against
    the read stream measured just before its runs in that round (the round's "read_bw") -> [(share, read stream)]."""
    return [(read_bytes * r[key] / r["read_bw"], r["read_bw"]) for r in runs]


def paired_share(runs: list[dict[str, float]], key: str, read_bytes: float) -> tuple[float, float]:
    """The best round's `round_shares` -> (share, that round's read stream, bytes/s)."""
    return max(round_shares(runs, key, read_bytes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", type=Path, help="ik_llama.cpp's llama-bench, built by you")
    ap.add_argument("--gguf", type=Path, help="the same checkpoint converted to GGUF")
    ap.add_argument("--model", type=Path, help="the mhcrun checkpoint (default: mid-size config, 4 layers)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=32, help="tokens decoded after each prompt")
    ap.add_argument("--modes", default=",".join(MODES), help="mhcrun's graph modes to run (eager,regions)")
    ap.add_argument("--no-breakdown", action="store_true",
                    help="skip the decode step's breakdown printed when the read-bandwidth goal is missed")
    ap.add_argument("--peer-huge-pages", action="store_true",
                    help="run llama-bench with -thp 1 (its weights on 2 MB hugetlbfs pages, which must be reserved), "
                         "as mhcrun's are on transparent huge pages where the kernel offers them")
    args = ap.parse_args()
    if args.rounds < 1 or args.threads < 1 or args.gen < 1:
        raise InputError(f"--rounds {args.rounds} --threads {args.threads} --gen {args.gen}: each must be at least 1")
    if (args.llama_bench is None) != (args.gguf is None):
        raise SystemExit("--llama-bench and --gguf go together")
    if args.gguf is not None and args.model is None:
        raise SystemExit("--gguf needs --model, the checkpoint it was made from (benchmarks/export_gguf.py)")
    for what, path in (("--llama-bench", args.llama_bench), ("--gguf", args.gguf)):
        if path is not None and not path.is_file():
            raise SystemExit(f"{what} {path}: no such file")
    modes = [m for m in args.modes.split(",") if m]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_synthetic(CONFIGS / "v4-mid.json", Path(tmp) / "mid4", 4, seed=1)
        plan = plan_checkpoint(model)
        vocab = plan.config.vocab_size
        ours, theirs, compile_s, pages, matmul = {m: [] for m in modes}, [], [], set(), []
        for r in range(args.rounds):
            matmul.append(matmul_rate())
            for m in modes:
                bw = read_bandwidth()  # beside this side's runs: the phase they run in
                # the first regions process compiles into empty caches (cold), the rest reuse them
                stats = {n: run_mhcrun(model, m, n, args.gen, vocab, args.threads, Path(tmp) / "torch")
                         for n in PROMPTS}
                pages.add(stats[PROMPTS[0]].get("weight_pages", "?"))
                ours[m].append({f"{k}@{n}": stats[n][f"{k}_tok_s"] for n in PROMPTS for k in ("prefill", "decode")}
                               | {"read_bw": bw})
                if m == "regions":
                    compile_s += [stats[n]["compile_s"] for n in PROMPTS]
            if args.llama_bench:
                bw = read_bandwidth()
                theirs.append(ik_rates(run_llama_bench(args.llama_bench, args.gguf, args.gen, args.threads,
                                                       args.peer_huge_pages)) | {"read_bw": bw})
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        missed = report(plan, args, ours, theirs or None, compile_s, pages, max(matmul))
        if missed and not args.no_breakdown:
            print_breakdown(model, args.threads, *missed, Path(tmp) / "torch" if "regions" in modes else None)


def report(plan, args, our_runs: dict[str, list[dict[str, float]]], ik_runs: list[dict[str, float]] | None,
           compile_s: list[float], pages: set[str], mm: float) -> tuple[float, float] | None:
    """Prints the table and the goals (each side's rounds' rates, with the read stream measured beside them, and
    matmul rate `mm`) -> (bytes a decoded token reads, read bandwidth) where a mode's decode misses GOAL_SHARE of the
    read bandwidth, else None."""
    runs = dict(our_runs) | ({"ik": ik_runs} if ik_runs is not None else {})
    ours, ik = {m: best(v) for m, v in our_runs.items()}, best(ik_runs) if ik_runs is not None else None
    reads = dict.fromkeys(ours, decode_bytes_per_token(plan))
    rates = dict(ours)
    if ik is not None:
        reads["ik"], rates["ik"] = gguf_bytes_per_token(args.gguf), ik
    macs = decode_macs_per_token(plan)
    shares = {c: {n: paired_share(runs[c], f"decode@{n}", reads[c]) for n in PROMPTS} for c in rates}
    print("read stream before each side's runs, GB/s by round: "
          + "; ".join(f"{c} " + " / ".join(f"{r['read_bw'] / 1e9:.1f}" for r in runs[c]) for c in rates)
          + f"; fp32 matmul {mm / 1e9:.1f} G multiply-adds/s at 4096 (the best of the rounds'); "
          f"{args.threads} threads; best of {args.rounds} alternating rounds; {args.gen} tokens decoded")
    print(f"weights: mhcrun on {', '.join(sorted(pages))}"
          + (f"; ik_llama.cpp on {'2 MB (hugetlbfs) pages' if args.peer_huge_pages else '4 KB pages (its mmap)'}"
             if ik is not None else ""))
    cols, ratios = list(rates), list(ours) if ik is not None else []
    print(f"{'':28}" + "".join(f"{'mhcrun ' + c if c != 'ik' else 'ik_llama.cpp':>18}" for c in cols)
          + "".join(f"{c + '/ik':>14}" for c in ratios))
    for key in [f"decode@{n}" for n in PROMPTS] + [f"prefill@{n}" for n in PROMPTS]:
        kind, n = key.split("@")
        label = f"{kind} tok/s " + (f"after {n}" if kind == "decode" else f"of {n}")
        print(f"{label:28}" + "".join(f"{rates[c][key]:18.1f}" for c in cols)
              + "".join(f"{rates[c][key] / ik[key]:14.2f}" for c in ratios))
    print(f"{'bytes read / decoded token':28}" + "".join(f"{reads[c] / 1e6:15.1f} MB" for c in cols))
    for n in PROMPTS:  # each round's decode against the read stream beside it, the best round's (`paired_share`)
        print(f"{f'share of read bw after {n}':28}" + "".join(f"{shares[c][n][0]:17.0%} " for c in cols)
              + "  by round: " + "; ".join(f"{c} " + " / ".join(
                  f"{share:.0%}" for share, _ in round_shares(runs[c], f"decode@{n}", reads[c])) for c in cols))
    for n in PROMPTS:  # the GGUF's multiply-adds are the checkpoint's: the same weights
        print(f"{f'prefill of {n}: matmul rate':28}"
              + "".join(f"{macs * rates[c][f'prefill@{n}'] / mm:17.0%} " for c in cols))
    if compile_s:
        # cold: the first regions process's (a first run: torch's caches empty), then the next prompt length's (its
        # context makes its own graphs, compiled cold with the wrappers' header built); warm: a later round's
        warm = min(compile_s[len(PROMPTS):], default=None)
        print(f"{'regions compile s':28}{compile_s[0]:18.1f} a first run on a machine (empty caches), "
              + (f"{compile_s[1]:.1f} cold (new shapes), " if len(compile_s) > 1 else "")
              + (f"{warm:.1f} warm" if warm is not None else "warm: needs a second round"))
    print("goals (issue 20):")
    missed = None
    for m in ours:
        share, bw = min(shares[m].values())
        if share < GOAL_SHARE:
            missed = (reads[m], bw)
        mm_share = macs * ours[m][f"prefill@{PROMPTS[-1]}"] / mm
        line = (f"  {m}: decode >= {GOAL_SHARE:.0%} of the read bandwidth: {_met(share >= GOAL_SHARE)} "
                f"({share:.0%} at worst); "
                f"prefill of {PROMPTS[-1]} >= {GOAL_MATMUL:.0%} of the matmul rate: {_met(mm_share >= GOAL_MATMUL)} "
                f"({mm_share:.0%})")
        if ik is not None:
            dec = min(ours[m][f"decode@{n}"] / ik[f"decode@{n}"] for n in PROMPTS)
            pre = min(ours[m][f"prefill@{n}"] / ik[f"prefill@{n}"] for n in PROMPTS)
            line += (f"; decode >= ik: {_met(dec >= 1)} ({dec:.2f}x at worst); prefill >= ik: {_met(pre >= 1)} "
                     f"({pre:.2f}x at worst)")
        print(line)
    if compile_s:
        cold = compile_s[1] if len(compile_s) > 1 else None
        first = compile_s[0] <= GOAL_COMPILE_S
        print(f"  regions: compile <= {GOAL_COMPILE_S:.0f} s cold: "
              + (f"{_met(cold <= GOAL_COMPILE_S)} ({cold:.0f} s); " if cold is not None else "")
              + f"as a first run on a machine: {_met(first)} ({compile_s[0]:.0f} s"
              + ("; the README (compile-regions) says why and what a first run costs)" if not first else ")"))
    return missed


def print_breakdown(model: Path, threads: int, read_bytes: float, bandwidth: float,
                    torch_caches: Path | None) -> None:
    """Where a decode step's time goes (benchmarks/bench_step_gemvs.py in its own process, on `threads` threads:
    an eager step, and a compiled-regions one profiled where `torch_caches`, the regions runs' warm caches, is
    given; the last of them sampled per thread by Linux's perf, where it is here), after the step time GOAL_SHARE of the
    read bandwidth would take."""
    goal_ms = read_bytes / (GOAL_SHARE * bandwidth) * 1e3
    print(f"where a decode step's time goes (the read-bandwidth goal missed: {GOAL_SHARE:.0%} would be a step of "
          f"{goal_ms:.2f} ms; benchmarks/bench_step_gemvs.py, steps after 128 prompt tokens):", flush=True)
    cmd = [sys.executable, str(Path(__file__).with_name("bench_step_gemvs.py")), "--model", str(model),
           "--steps", "4", "--rounds", "3", "--bandwidth", str(bandwidth / 1e9)]
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    if torch_caches is not None:
        cmd.append("--regions")
        env |= torch_caches_env(torch_caches)
    cmd.append("--perf")  # the step per thread (or a line saying why not): the runtime between kernels apart
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if res.returncode:
        print(f"  (bench_step_gemvs.py failed: {(res.stderr.strip() or res.stdout.strip())[-300:]})")
        return
    print("\n".join("  " + line for line in res.stdout.splitlines()[1:]))


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


if __name__ == "__main__":
    run_script(main)
