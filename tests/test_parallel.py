"""--tp N on torch.distributed (gloo, 2 processes): shares reassemble to the stored tensors, every region of the
sharded model equals the single-rank one, tokens equal one rank's, and a failing rank ends every rank with one
line."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from mhcrun.checkpoint import load_checkpoint, plan_checkpoint
from mhcrun.cli import app
from mhcrun.ops.qweight import QWeight
from mhcrun.parallel import SINGLE, Shard, free_port
from mhcrun.runner import DEFAULT_MODEL
from mhcrun.tiny import make_tiny
from mhcrun.weights import tensor_specs

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fp8_tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("fp8") / "tiny-fp8", 0, True, False)


@pytest.mark.parametrize("kind", ["tiny", "fp8"])
def test_shares_reassemble_to_the_stored_tensors(kind, fp8_tiny):
    path = DEFAULT_MODEL if kind == "tiny" else fp8_tiny
    whole = load_checkpoint(path)
    parts = [load_checkpoint(path, tp=Shard(r, 2)) for r in range(2)]
    split = {s.name: s.split for s in tensor_specs(whole.config)}
    def stored(t):  # -> (data, scale) as their bytes
        if isinstance(t, QWeight):
            return t.data.view(torch.uint8), t.scale.view(torch.uint8)
        return t.view(torch.uint8), None

    for name, t in whole.tensors.items():
        data, scale = stored(t)
        if ".experts." in name and ".shared_experts." not in name:  # each expert on exactly one rank
            owners = [p for p in parts if name in p.tensors]
            assert len(owners) == 1 and torch.equal(stored(owners[0].tensors[name])[0], data), name
            continue
        shares = [stored(p.tensors[name]) for p in parts]
        if split[name] is None:
            assert all(torch.equal(d, data) for d, _ in shares), name
            continue
        assert torch.equal(torch.cat([d for d, _ in shares], dim=split[name]), data), name
        if scale is not None:  # a scale splits with its weight
            assert torch.equal(torch.cat([s for _, s in shares], dim=split[name]), scale), name
    owned = [sorted(int(n.split(".")[4]) for n in p.tensors if ".ffn.experts." in n and n.startswith("layers.1."))
             for p in parts]
    assert owned == [[0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3], [4, 4, 4, 5, 5, 5, 6, 6, 6, 7, 7, 7]]
    t = torch.arange(12).view(3, 4)
    assert torch.equal(Shard(1, 2).take(t, 1), t[:, 2:]) and Shard(1, 2).take(t, None) is t


def test_a_split_that_cuts_a_scale_block_names_the_tensor_the_block_and_n(fp8_tiny, monkeypatch):
    """--tp 4 on the fp8 tiny model: its o_groups (2) already refuse it; past that check, wo_a's 64 rows in 4 parts
    would cut its 32-row FP8 scale blocks."""
    import mhcrun.checkpoint as ck
    from mhcrun.errors import CheckpointError, InputError

    with pytest.raises(InputError, match=r"--tp 4 does not divide o_groups \(2\)"):
        plan_checkpoint(fp8_tiny, tp=Shard(0, 4))
    monkeypatch.setattr(ck, "check_divides", lambda cfg, n: None)
    with pytest.raises(CheckpointError, match=r"layers.0.attn.wo_a.weight: --tp 4 would cut its FP8 scale blocks "
                                              r"of 32 \(dimension 0 of 64 into 4 parts\)"):
        plan_checkpoint(fp8_tiny, tp=Shard(0, 4))


def _regions_worker(rank: int, world: int, port: int, path: str, quant_sim: bool, compiled: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from mhcrun.generate import capture_step, generate
    from mhcrun.runner import load_runner

    dist.init_process_group("gloo", rank=rank, world_size=world)
    runner = load_runner(path, quant_sim=quant_sim, tp=Shard(rank, world))
    prompts = [[0, 5, 9, 11, 7, 300, 41, 2, 19, 23, 88, 5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 17]]
    res = generate(runner.model, prompts, 12, 1, ignore_eos=True, record_topk=3)
    caps = {step: capture_step(runner.model, prompts[0], res[0].tokens[:step], 40, 7) for step in (0, 3)}
    regions, graphs = res, None
    if compiled:
        regions = generate(runner.model, prompts, 12, 1, ignore_eos=True, record_topk=3, graph_mode="regions",
                           backend="aot_eager")
        from mhcrun.regions.runner import compile_all

        graphs = compile_all(runner.model, 2, 64, backend="aot_eager")["graphs"]
    if rank == 0:
        torch.save({"tokens": [r.tokens for r in res], "top": [r.top_logprobs for r in res], "caps": caps,
                    "stats": res[0].stats, "regions": [r.tokens for r in regions],
                    "regions_top": [r.top_logprobs for r in regions], "graphs": graphs}, out)
    dist.destroy_process_group()


@pytest.mark.parametrize("kind,quant_sim,compiled", [("tiny", False, False), ("tiny", True, False),
                                                     ("fp8", False, True)])
def test_two_ranks_equal_one_region_by_region(tmp_path, fp8_tiny, random_tiny, kind, quant_sim, compiled):
    """Every region of the sharded model (embedding, each attention half with its indexer, each MoE half, the
    head) equals the single-rank model's, prefill and decode; greedy tokens are the same, eager and (on the
    FP8 checkpoint) through compiled regions (their collectives traced), which compile as many graphs as on one
    rank."""
    from mhcrun.generate import capture_step, generate
    from mhcrun.probes import region_diffs
    from mhcrun.runner import load_runner

    path = str(random_tiny if kind == "tiny" else fp8_tiny)  # greedy tokens compared: decisive margins
    out = tmp_path / "rank0.pt"
    mp.start_processes(_regions_worker, args=(2, free_port(), path, quant_sim, compiled, str(out)), nprocs=2,
                       join=True, start_method="spawn")
    got = torch.load(out)
    one = load_runner(path, quant_sim=quant_sim)
    prompts = [[0, 5, 9, 11, 7, 300, 41, 2, 19, 23, 88, 5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 17]]
    res = generate(one.model, prompts, 12, 1, ignore_eos=True, record_topk=3)
    assert got["tokens"] == [r.tokens for r in res] == got["regions"]  # eager and compiled regions under --tp
    if compiled:  # one graph per region kind, as on one rank (test_regions: graph_count == the kinds)
        assert got["graphs"] == len({k for kinds in one.model.region_kinds for k in kinds} | {"head"})
    for a, b in zip(got["top"] + got["regions_top"], [r.top_logprobs for r in res] * 2, strict=True):
        for x, y in zip(a, b, strict=True):
            assert [t for t, _ in x] == [t for t, _ in y]
            assert max(abs(p - q) for (_, p), (_, q) in zip(x, y, strict=True)) < 1e-4
    for step in (0, 3):
        want = capture_step(one.model, prompts[0], res[0].tokens[:step], 40, 7)
        diffs = region_diffs(want, got["caps"][step])
        assert len(diffs) == 1 + 2 * 4 + 1 and all(d.rel < 1e-5 for d in diffs), diffs
    assert got["stats"]["tp"] == 2 and len(got["stats"]["peak_rss_mb_per_rank"]) == 2


def mhcrun(*args: str, timeout: float = 300, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mhcrun.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"), input=stdin)


def test_generate_tp2_prints_the_single_rank_format_and_tokens(fp8_tiny):
    one = json.loads(mhcrun("generate", "-m", str(fp8_tiny), "-n", "12", "--json", "--no-quant-sim").stdout)
    two = mhcrun("generate", "-m", str(fp8_tiny), "-n", "12", "--json", "--no-quant-sim", "--tp", "2")
    assert two.returncode == 0, two.stderr
    rows = [json.loads(line) for line in two.stdout.splitlines()]
    assert len(rows) == 1 and rows[0]["tokens"] == one["tokens"] and rows[0]["text"] == one["text"]
    assert set(rows[0]) == set(one) and set(rows[0]["stats"]) == set(one["stats"]) | {"collective_bytes_per_token"}
    assert rows[0]["stats"]["collective_bytes_per_token"] > 0
    assert rows[0]["stats"]["tp"] == 2 and len(rows[0]["stats"]["peak_rss_mb_per_rank"]) == 2
    text = mhcrun("generate", "--tp", "2", "-n", "6")
    assert text.returncode == 0 and text.stdout == mhcrun("generate", "-n", "6").stdout


def test_golden_check_tp2_passes_the_long_prompts(long_fp8):
    """Two ranks give the long prompts' golden (1,500-2,000 tokens, checked against DeepSeek's reference) within the
    fp32 tolerance, teacher-forced."""
    r = mhcrun("golden-check", "tests/golden/tiny-fp8-long.json", "-m", str(long_fp8), "--tp", "2", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["ok"] and rep["counts"]["match"] == 4
    assert max(p["max_logprob_diff"] for p in rep["prompts"]) < 1e-4


def test_golden_check_tp2_passes(tmp_path):
    from mhcrun.golden import load_golden, write_golden

    g = load_golden(ROOT / "tests/golden/tiny.json")
    g["prompts"] = [dict(p, tokens=p["tokens"][:12], steps=p["steps"][:12]) for p in g["prompts"][:4]]
    g["settings"]["max_new_tokens"] = 12
    small = tmp_path / "small.json"
    write_golden(small, g, force=False)
    r = mhcrun("golden-check", str(small), "--tp", "2", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["ok"] and rep["counts"]["match"] == 4 and r.stdout.count("\n") == 1
    g["prompts"][1]["steps"][3]["top"][1][1] -= 0.3  # a recorded log-prob moved: --locate on both ranks
    write_golden(small, g, force=True)
    r = mhcrun("golden-check", str(small), "--tp", "2", "--locate", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    p = json.loads(r.stdout)["prompts"][1]
    assert (p["status"], p["step"]) == ("mismatch", 3) and p["first_region"].startswith("no region beyond"), p


def test_a_nan_in_another_ranks_share_is_named_where_it_is(tmp_path):
    """A NaN in wq_b's rows of rank 1: rank 0 sees it only after the attention's all-reduce, rank 1 in wq_b
    itself; the line names wq_b, as one rank does."""
    from safetensors.torch import load_file, save_file

    name = "layers.1.attn.wq_b.weight"
    ckpt = tmp_path / "nan"
    shutil.copytree(DEFAULT_MODEL, ckpt)
    for shard in ckpt.glob("*.safetensors"):
        tensors = load_file(shard)
        if name in tensors:
            tensors[name][tensors[name].shape[0] - 12, 3] = float("nan")  # a row of rank 1's half
            save_file(tensors, shard, metadata={"format": "pt"})
    want = ("error: prompt 0: the logits of step 0 (prefill) hold NaN; layer 1 attn:csa produced NaN from finite "
            "inputs, first in layers.1.attn.wq_b (Linear); no token was emitted from them")
    for tp in ("1", "2"):
        r = mhcrun("generate", "-m", str(ckpt), "--prompt-ids", "0,5,6", "-n", "3", "--tp", tp)
        assert r.returncode == 3 and r.stderr.strip() == want, (tp, r.stderr)


def test_tp_that_does_not_divide_is_one_line_before_any_worker(cli):
    for n, what in (("3", "attention heads (4)"), ("4", "o_groups (2)")):
        r = cli.invoke(app, ["generate", "--tp", n])
        assert r.exit_code == 2 and r.stderr.strip() == f"error: --tp {n} does not divide {what}", r.stderr


def test_a_launch_environment_that_is_not_a_number_is_one_line(cli):
    """RANK / WORLD_SIZE / LOCAL_RANK are read once with the rest of the environment (`Env.read`): a value that is
    not an integer is refused there, by name, before any process group is joined; so is a bad MHCRUN_NKI_SIM or
    MHCRUN_GRAPH_MODE, and a MHCRUN_CPU_KERNEL that names no cap or a flag that is not 0 or 1 (they used to take a
    default silently)."""
    for env, line in (({"RANK": "x", "WORLD_SIZE": "2"}, "error: RANK must be an integer, got 'x'"),
                      ({"RANK": "0", "WORLD_SIZE": "two"}, "error: WORLD_SIZE must be an integer, got 'two'"),
                      ({"MHCRUN_NKI_SIM": "2"}, "error: MHCRUN_NKI_SIM must be one of 0, 1, device, got '2'"),
                      ({"MHCRUN_CPU_KERNEL": "avx51"}, "error: MHCRUN_CPU_KERNEL must be 0 (off), 1 (this CPU's "
                       "default) or a cap (amx, avx512bf16, avx512, avx2), got 'avx51'"),
                      ({"MHCRUN_NKI_HC": "false"}, "error: MHCRUN_NKI_HC must be 0 or 1, got 'false'"),
                      ({"MHCRUN_GRAPH_MODE": "graphs"},  # named as the variable, not as --graph-mode
                       "error: MHCRUN_GRAPH_MODE must be one of eager, regions, got 'graphs'"),
                      ({"MHCRUN_SCALED_MM": "yes"}, "error: MHCRUN_SCALED_MM must be 0 or 1, got 'yes'")):
        r = cli.invoke(app, ["generate", "-n", "1"], env=env)
        assert r.exit_code == 2 and r.stderr.strip() == line, (env, r.stderr)


def test_an_input_from_a_pipe_is_refused_by_name_before_any_rank_starts(tmp_path):
    """A pipe (`--prompts-file /dev/stdin`) gives its text to one reader; every rank of --tp reads its inputs, so
    it is one line naming the flag, before a rank starts (it was rank 1's "no prompts"); a file still runs."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [0, 5, 6]}\n')
    r = mhcrun("generate", "--prompts-file", "/dev/stdin", "-n", "1", "--tp", "2", stdin=prompts.read_text())
    assert r.returncode == 2 and r.stderr.strip() == ("error: --prompts-file /dev/stdin: a pipe is read once, and "
                                                      "each rank of --tp reads it: give a file"), r.stderr
    assert mhcrun("generate", "--prompts-file", "/dev/stdin", "-n", "1", stdin=prompts.read_text()).returncode == 0


def checkpoint_missing_an_expert_of_rank_1(tmp_path: Path) -> Path:
    ckpt = tmp_path / "half"
    shutil.copytree(DEFAULT_MODEL, ckpt)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"]["layers.2.ffn.experts.6.w1.weight"]  # rank 1 of 2 holds experts 4..7
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    return ckpt


def test_a_failing_rank_ends_every_rank_with_its_one_line(tmp_path):
    """Rank 1 needs an expert the index does not list; rank 0 does not and would wait for it in a collective:
    both end within seconds, the user sees rank 1's error, exit 2, and no rank is left running."""
    ckpt = checkpoint_missing_an_expert_of_rank_1(tmp_path)
    t0 = time.time()
    r = mhcrun("generate", "-m", str(ckpt), "--tp", "2", "-n", "4", timeout=120)
    assert r.returncode == 2 and time.time() - t0 < 60, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [f"error: rank 1: layers.2.ffn.experts.6.w1.weight: tensor missing from {ckpt}/"
                     f"model.safetensors.index.json"], lines
    assert r.stdout == ""  # rank 0 waited for every rank's share before it printed the prompt
    assert not _ranks_alive(str(ckpt))


def test_a_killed_rank_ends_the_others(tmp_path):
    """A rank that dies (here: SIGKILL, as the OOM killer does) ends the run: no hang, exit non-zero."""
    p = subprocess.Popen([sys.executable, "-m", "mhcrun.cli", "generate", "--tp", "2", "-n", "400", "--ignore-eos",
                          "--no-quant-sim"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    rank1 = None
    while rank1 is None and time.time() < deadline:
        rank1 = next((pid for pid in _children(p.pid) if _env(pid).get("RANK") == "1"), None)
        time.sleep(0.2)
    assert rank1 is not None
    time.sleep(3)  # let it load and join the group
    os.kill(rank1, 9)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + 9 and err.strip().splitlines()[-1] == "error: rank 1: killed by SIGKILL", err
    assert not _children(p.pid)


def _start_two_ranks() -> tuple[subprocess.Popen, list[int]]:
    """A --tp 2 run long enough to be ended from outside, once both ranks have loaded and joined."""
    p = subprocess.Popen([sys.executable, "-m", "mhcrun.cli", "generate", "--tp", "2", "-n", "400", "--ignore-eos",
                          "--no-quant-sim"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    ranks: list[int] = []
    while len(ranks) < 2 and time.time() < deadline:
        ranks = _children(p.pid)
        time.sleep(0.2)
    assert len(ranks) == 2
    time.sleep(3)
    return p, ranks


def _gone(pids: list[int], within: float) -> bool:
    deadline = time.time() + within
    while time.time() < deadline:
        if not any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in pids):
            return True
        time.sleep(0.2)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ending_the_launcher_ends_its_ranks():
    """SIGTERM to the process the user started (a job's timeout): its ranks end too, one line, exit 143. SIGKILL
    to it, which it cannot answer: the ranks end all the same (they follow it: PR_SET_PDEATHSIG), none is left."""
    p, ranks = _start_two_ranks()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and err.strip().splitlines()[-1] == "error: terminated (SIGTERM)", err
    assert _gone(ranks, 10)
    p, ranks = _start_two_ranks()
    p.kill()
    p.communicate(timeout=60)
    assert _gone(ranks, 10), [_state(r) for r in ranks]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except OSError:
        return []


def _env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _ranks_alive(marker: str) -> bool:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    return True
            except OSError:
                pass
    return False


def test_info_plans_one_rank(fp8_tiny, cli):
    one = json.loads(cli.invoke(app, ["info", "-m", str(fp8_tiny), "--json"]).stdout)["memory_plan"]
    two = json.loads(cli.invoke(app, ["info", "-m", str(fp8_tiny), "--json", "--tp", "2"]).stdout)["memory_plan"]
    assert two["weights_bytes"] < one["weights_bytes"] and SINGLE.world == 1


def _replies(stdout: str) -> str:
    """The transcript without its speeds, its line breaks folded (a speed's width moves Rich's wrapping)."""
    return " ".join(re.sub(r"[\d.]+ tok/s", "", stdout).split())


def test_chat_tp2_runs_each_turn_on_every_rank_and_prints_once():
    """Rank 0 reads the lines and sends them to rank 1: both run each turn; the transcript is one rank's."""
    lines = "Hi\n/mode chat\nAnd now?\n/exit\n"
    one = mhcrun("chat", "-n", "5", "--no-quant-sim", stdin=lines)
    two = mhcrun("chat", "-n", "5", "--no-quant-sim", "--tp", "2", stdin=lines)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout.count(" prefilled), prefill") == 2 and _replies(two.stdout) == _replies(one.stdout)
    eof = mhcrun("chat", "-n", "2", "--tp", "2", stdin="Hi\n")  # end of input ends every rank
    assert eof.returncode == 0 and eof.stdout.count(" prefilled), prefill") == 1, eof.stderr


def test_chat_tp2_a_failing_rank_ends_every_rank_with_its_one_line(tmp_path):
    ckpt = checkpoint_missing_an_expert_of_rank_1(tmp_path)
    t0 = time.time()
    r = mhcrun("chat", "-m", str(ckpt), "--tp", "2", "-n", "4", timeout=240, stdin="Hi\n")
    assert r.returncode == 2 and time.time() - t0 < 180, r.stderr  # ~30 s: rank 0 does not wait for its input
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1:] == [f"error: rank 1: layers.2.ffn.experts.6.w1.weight: tensor missing from {ckpt}/"
                          f"model.safetensors.index.json"], lines
    assert not _ranks_alive(str(ckpt))

