"""The `mhcrun` command line as a user meets it: exit codes, stdout/stderr, files written or left alone.

Most cases run in-process through Typer's CliRunner (stdout and stderr kept apart); a few run the real
`mhcrun` console script in a subprocess to prove the exit code and the single `error:` line end to end.
Broken checkpoints are copies of the bundled tiny model edited in tmp_path.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import typer.main
from conftest import CLI, cpu_kernel
from safetensors.torch import load_file, save_file

from mhcrun.cli import DEFAULT_PROMPT, app, compile_note
from mhcrun.runner import DEFAULT_MODEL

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden" / "tiny.json"  # the bundled (trained) model's
GOLDEN_RANDOM = REPO / "tests" / "golden" / "tiny-random.json"  # the random model's (`make-tiny`, the fixture)
INDEX = "model.safetensors.index.json"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
LINEAR = "layers.0.attn.wq_a.weight"  # a bf16 [64, 128] linear of the tiny model
IDS = "0,5,6"
N = 4
STATS_KEYS = {"prefill_tok_s", "decode_tok_s", "compile_s", "peak_rss_mb", "kernels", "cpu_gemv_kernel", "tp",
              "peak_rss_mb_per_rank", "weight_pages", "heap_pages"}
STATS_LINE = re.compile(r"^prompt tokens \d+ \| prefill [\d.]+ tok/s \| decode [\d.]+ tok/s \| compile [\d.]+ s "
                        r"\| peak RSS \d+ MB( \| CPU GEMV kernel ((avx512bf16|avx512|avx2)( \+ amx)?|off.*) "
                        r"\| weights on (2 MB pages|4 KB pages \(.+\)))?$")



# ---------------------------------------------------------------------------------------------- helpers


def cli(*args: object, env: dict[str, str | None] | None = None):
    return CLI.invoke(app, [str(a) for a in args], env=env)


def ok(result) -> None:
    """Assert exit 0 and no traceback, showing the output when not."""
    assert result.exit_code == 0, f"exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stdout + result.stderr


def user_error(result, *needles: str, code: int = 2) -> str:
    """Assert the CLI's contract for bad input: exit `code`, stderr exactly one `error: ...` line naming
    every needle, no traceback anywhere, and no exception other than the exit. Returns the line."""
    out, err = result.stdout, result.stderr
    assert result.exit_code == code, f"exit {result.exit_code}, want {code}\nstdout:\n{out}\nstderr:\n{err}"
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1, f"want one stderr line, got {len(lines)}:\n{err}"
    line = lines[0]
    assert line.startswith("error: ") and line[len("error: "):].strip(), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    assert "internal error" not in line, line  # a user error is not reported as a bug
    return line


def json_lines(result) -> list[dict]:
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def gen_json(*args: object, env: dict[str, str | None] | None = None) -> list[dict]:
    r = cli("generate", *args, "--json", env=env)
    ok(r)
    return json_lines(r)


def snapshot(path: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under `path` (or of `path` itself)."""
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def copy_tiny(dst: Path) -> Path:
    shutil.copytree(DEFAULT_MODEL, dst)
    return dst


DELETE = object()


def edit_config(ckpt: Path, **changes: object) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    for key, value in changes.items():
        if value is DELETE:
            del cfg[key]
        else:
            cfg[key] = value
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=2))


def rewrite_tensor(ckpt: Path, name: str, tensor: torch.Tensor | None, fix_index: bool = True) -> Path:
    """Re-save the shard holding `name` with `tensor` in its place (None: without it; then also drop it
    from the index unless fix_index is False). Returns the shard path."""
    index = json.loads((ckpt / INDEX).read_text())
    shard = ckpt / index["weight_map"][name]
    tensors = load_file(shard)
    if tensor is None:
        del tensors[name]
        if fix_index:
            del index["weight_map"][name]
    else:
        tensors[name] = tensor
    save_file(tensors, shard, metadata={"format": "pt"})
    (ckpt / INDEX).write_text(json.dumps(index, indent=2))
    return shard


def load_golden_json(path: Path = GOLDEN) -> dict:
    return json.loads(path.read_text())


def write_json(path: Path, obj: dict) -> Path:
    path.write_text(json.dumps(obj))
    return path


def swap_top1(golden: dict, pid: str, step: int, margin: float | None = None) -> tuple[int, int, float]:
    """Make the recorded winner at (pid, step) the runner-up and vice versa, consistently: the generated
    token and top[0][0] change together (golden.load_golden requires it). Optionally set the margin.
    Returns (new expected token, the token the model really produces, the margin now recorded)."""
    p = next(p for p in golden["prompts"] if p["id"] == pid)
    s = p["steps"][step]
    real, other = s["top"][0][0], s["top"][1][0]
    s["top"][0][0], s["top"][1][0] = other, real
    p["tokens"][step] = other
    if margin is not None:
        s["margin"] = margin
    return other, real, s["margin"]


def subset(golden: dict, *pids: str) -> dict:
    """A copy keeping only the named prompts (a smaller, still valid, golden file: faster to check)."""
    g = copy.deepcopy(golden)
    g["prompts"] = [p for p in g["prompts"] if p["id"] in pids]
    assert [p["id"] for p in g["prompts"]] == [p for p in pids if p in {q["id"] for q in golden["prompts"]}]
    return g


def truncate(golden: dict, n: int) -> dict:
    """A copy whose prompts keep their first n tokens (and steps), with settings.max_new_tokens = n."""
    g = copy.deepcopy(golden)
    g["settings"]["max_new_tokens"] = n
    for p in g["prompts"]:
        p["tokens"], p["steps"] = p["tokens"][:n], p["steps"][:n]
    return g


def console_script() -> list[str]:
    exe = Path(sys.executable).parent / "mhcrun"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("mhcrun")
    return [found] if found else [sys.executable, "-m", "mhcrun.cli"]


def run_script(*args: object, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*console_script(), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"})


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def greedy_ref() -> dict:
    """The bundled model's greedy continuation of IDS (N tokens)."""
    (res,) = gen_json("--prompt-ids", IDS, "-n", N)
    return res


@pytest.fixture(scope="module")
def made_tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("make") / "tiny"
    r = cli("make-tiny", out)
    ok(r)
    assert str(out) in r.stdout
    return out


@pytest.fixture(scope="module")
def made_fp8(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("make") / "tiny-fp8"
    ok(cli("make-tiny", out, "--fp8"))
    return out


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A private, editable copy of the bundled tiny checkpoint."""
    return copy_tiny(tmp_path / "ckpt")


@pytest.fixture(scope="module")
def golden() -> dict:
    return load_golden_json()


# ---------------------------------------------------------------------------------------------- generate


def test_generate_default_prompt_streams_text_and_prints_stats():
    r = cli("generate", "-n", N)
    ok(r)
    assert r.stdout.startswith(DEFAULT_PROMPT)
    assert len(r.stdout.strip()) > len(DEFAULT_PROMPT)  # something was generated after the prompt
    err_lines = r.stderr.splitlines()
    assert len(err_lines) == 1 and STATS_LINE.match(err_lines[-1]), r.stderr


def test_generate_prompt_ids_json(greedy_ref):
    res = greedy_ref
    assert set(res) >= {"tokens", "prompt_tokens", "text", "stats"}
    assert len(res["tokens"]) == N and all(isinstance(t, int) and 0 <= t < 512 for t in res["tokens"])
    assert res["prompt_tokens"] == 3
    assert res["prompt_ids"] == [0, 5, 6]
    assert isinstance(res["text"], str)
    assert set(res["stats"]) == STATS_KEYS
    assert all(isinstance(v, (int, float)) and v >= 0 for k, v in res["stats"].items()
               if k not in ("kernels", "cpu_gemv_kernel", "peak_rss_mb_per_rank", "weight_pages",
                             "heap_pages"))
    assert res["stats"]["tp"] == 1 and res["stats"]["peak_rss_mb_per_rank"] == [res["stats"]["peak_rss_mb"]]
    assert res["stats"]["peak_rss_mb"] > 0
    kernels = res["stats"]["kernels"]  # without the simulator: the CPU kernel's C++ (decode rows), else torch
    assert {"hc_post_pre", "hc_post", "hc_head"} <= set(kernels)
    assert kernels["hc_post_pre"]["cpu"] + kernels["hc_post_pre"]["torch"] > 0
    assert kernels["hc_head"]["cpu"] + kernels["hc_head"]["torch"] == N  # once a forward: the prefill, N - 1 steps
    assert kernels["hc_post_pre"]["nki-sim"] == kernels["hc_head"]["nki-sim"] == 0


def test_generate_json_is_one_object_per_line():
    r = cli("generate", "--prompt-ids", IDS, "-n", N, "--json")
    ok(r)
    assert len(r.stdout.splitlines()) == 1
    assert "Traceback" not in r.stderr


def test_generate_prompt_ids_used_as_given_without_bos():
    (res,) = gen_json("--prompt-ids", "5, 6", "-n", 2)
    assert res["prompt_ids"] == [5, 6] and res["prompt_tokens"] == 2


def test_generate_text_prompt_gets_bos():
    (res,) = gen_json("--prompt", "The mill", "-n", 1)
    assert res["prompt_ids"][0] == 0  # config bos_token_id
    assert res["prompt_tokens"] == len(res["prompt_ids"]) > 1


def test_generate_prompts_file_batch(tmp_path, greedy_ref):
    pf = tmp_path / "prompts.jsonl"
    pf.write_text('{"id": "a", "prompt": "The river"}\n\n'
                  '{"id": "b", "prompt_ids": [0, 5, 6]}\n'
                  '{"prompt_ids": [7, 8, 9, 10]}\n')
    rows = gen_json("--prompts-file", pf, "-n", N)
    assert [r["id"] for r in rows] == ["a", "b", "p2"]
    assert all(len(r["tokens"]) == N and set(r["stats"]) == STATS_KEYS for r in rows)
    assert rows[0]["prompt_ids"][0] == 0
    assert rows[2]["prompt_ids"] == [7, 8, 9, 10]
    # a sequence's tokens do not depend on what it is batched with
    assert rows[1]["tokens"] == greedy_ref["tokens"]


def test_generate_prompts_file_plain_output(tmp_path):
    pf = tmp_path / "prompts.jsonl"
    pf.write_text('{"id": "first", "prompt": "The river"}\n{"id": "second", "prompt": "Rain"}\n')
    r = cli("generate", "--prompts-file", pf, "-n", 2)
    ok(r)
    lines = r.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["first", "second"]
    assert lines[0].startswith("first: The river") and lines[1].startswith("second: Rain")
    assert STATS_LINE.match(r.stderr.strip())


def test_generate_greedy_is_deterministic(greedy_ref):
    (again,) = gen_json("--prompt-ids", IDS, "-n", N)
    assert again["tokens"] == greedy_ref["tokens"]
    assert again["text"] == greedy_ref["text"]


def test_generate_warmup_leaves_the_run_as_it_was(tmp_path, greedy_ref):
    """--warmup prefills the first prompt and decodes a token after it once, untimed, and clears the rows: the tokens
    and log-probs are those of a run without it (a batch of two prompts too); it refuses what it cannot warm (a prompt
    cache, draft tokens)."""
    (warm,) = gen_json("--prompt-ids", IDS, "-n", N, "--warmup")
    assert warm["tokens"] == greedy_ref["tokens"] and warm["stats"]["prefill_tok_s"] > 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [0, 5, 6, 7]}\n{"prompt_ids": [9, 3]}\n')
    assert [r["tokens"] for r in gen_json("--prompts-file", prompts, "-n", N, "--warmup")] == \
        [r["tokens"] for r in gen_json("--prompts-file", prompts, "-n", N)]
    user_error(cli("generate", "--prompt-ids", IDS, "-n", N, "--warmup", "--prompt-cache", tmp_path / "c"),
               "--warmup", "--prompt-cache")


def test_generate_sampling_is_reproducible_per_seed():
    args = ("--prompt-ids", IDS, "-n", 8, "--temperature", 0.8)
    (a,) = gen_json(*args, "--seed", 1)
    (b,) = gen_json(*args, "--seed", 1)
    (c,) = gen_json(*args, "--seed", 2)
    (greedy,) = gen_json("--prompt-ids", IDS, "-n", 8)
    assert a["tokens"] == b["tokens"]
    assert len(a["tokens"]) == len(c["tokens"]) == 8
    # it really samples: 8 tokens at T=0.8 from two seeds all equal to greedy would be a broken sampler
    assert not (a["tokens"] == c["tokens"] == greedy["tokens"])


@pytest.mark.parametrize("flags", [("--dtype", "bf16"), ("--no-quant-sim",), ("--top-p", "0.5", "--temperature",
                                                                              "1.0")])
def test_generate_other_settings_run(flags):
    (res,) = gen_json("--prompt-ids", IDS, "-n", N, *flags)
    assert len(res["tokens"]) == N and all(0 <= t < 512 for t in res["tokens"])


def test_generate_graph_mode_env_and_flag(greedy_ref):
    (res,) = gen_json("--prompt-ids", IDS, "-n", N, env={"MHCRUN_GRAPH_MODE": "eager"})
    assert res["tokens"] == greedy_ref["tokens"]
    (res,) = gen_json("--prompt-ids", IDS, "-n", N, "--graph-mode", "eager")
    assert res["tokens"] == greedy_ref["tokens"]


def test_generate_zero_new_tokens():
    """-n 0 runs the prompt alone: prefilled and timed (with or without drafts), no token taken."""
    for drafts in ((), ("--draft-tokens", 2)):
        (res,) = gen_json("--prompt-ids", IDS, "-n", 0, *drafts)
        assert res["tokens"] == [] and res["prompt_ids"] == [0, 5, 6]
        assert res["stats"]["prefill_tok_s"] > 0 and res["stats"]["decode_tok_s"] == 0
        assert res["stats"]["tp"] == 1 and res["stats"]["peak_rss_mb_per_rank"] == [res["stats"]["peak_rss_mb"]]
    for n in (0, 1):  # the summary line gives no decode rate: no decode step ran (-n 1's token is the prefill's)
        r = cli("generate", "--prompt-ids", IDS, "-n", n)
        ok(r)
        assert "prefill " in r.stderr and "decode" not in r.stderr
    r = cli("generate", "--prompt-ids", IDS, "-n", 2)
    ok(r)
    assert re.search(r"prefill \d+\.\d tok/s \| decode \d+\.\d tok/s \| compile", r.stderr)


def test_generate_ids_without_tokenizer(ckpt, greedy_ref):
    (ckpt / "tokenizer.json").unlink()
    (res,) = gen_json("--model", ckpt, "--prompt-ids", IDS, "-n", N)
    assert res["tokens"] == greedy_ref["tokens"] and res["text"] == ""
    before = snapshot(ckpt)
    user_error(cli("generate", "--model", ckpt, "-n", 2), "tokenizer.json", "--prompt-ids")
    assert snapshot(ckpt) == before


# ---------------------------------------------------------------------------------------------- info


def test_info_json():
    r = cli("info", "--json")
    ok(r)
    desc = json.loads(r.stdout)
    assert set(desc) >= {"path", "config", "layer_kinds", "params", "bytes_by_dtype"}
    assert Path(desc["path"]) == DEFAULT_MODEL.resolve()
    assert desc["config"]["n_layers"] == len(desc["layer_kinds"]) == 4
    assert desc["params"] > 0
    assert {k["attention"] for k in desc["layer_kinds"]} == {"window", "csa", "hca"}
    assert {k["moe"] for k in desc["layer_kinds"]} == {"hash", "routed"}
    assert desc["bytes_by_dtype"] and all(v > 0 for v in desc["bytes_by_dtype"].values())
    assert "bfloat16" in desc["bytes_by_dtype"]
    # the bundled tensors are all counted: bytes on disk are at least the tensor bytes
    shards = sum((DEFAULT_MODEL / s).stat().st_size for s in (SHARD1, SHARD2))
    assert sum(desc["bytes_by_dtype"].values()) <= shards


def test_info_table():
    r = cli("info")
    ok(r)
    for word in ("layers", "window", "csa", "hca", "hash", "routed", "bfloat16", "parameters:"):
        assert word in r.stdout


@pytest.fixture
def entry_point_signals():
    """`main` answers SIGTERM and SIGHUP: the test process gets its own handlers back after a test that calls it."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_the_entry_point_reads_the_environment_once(monkeypatch, capsys, entry_point_signals):
    """`main` reads the environment (for the heap's restart) and hands that Env to the command."""
    import mhcrun.cli as cli_mod
    from mhcrun.settings import Env

    reads = []
    real = Env.read
    monkeypatch.setattr(Env, "read", staticmethod(lambda *a: reads.append(1) or real(*a)))
    monkeypatch.setenv("MHCRUN_HUGE_PAGES", "0")  # no restart: this process runs the command
    monkeypatch.setattr(sys, "argv", ["mhcrun", "info", "--json"])
    with pytest.raises(SystemExit) as done:
        cli_mod.main()
    assert done.value.code == 0 and json.loads(capsys.readouterr().out)["config"]["n_layers"] == 4
    assert len(reads) == 1


def test_the_heap_restart_is_for_commands_not_for_help(monkeypatch, capsys, entry_point_signals):
    """`main` starts itself again (the heap on huge pages) for a command, not for --help, --version or no
    arguments."""
    import mhcrun.cli as cli_mod

    started = []

    def execve(path, argv, env):
        started.append(argv)
        raise OSError("not here")  # main then runs as it is

    monkeypatch.setattr(cli_mod, "restart_env", lambda *a: {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    monkeypatch.setattr(cli_mod.os, "execve", execve)
    for argv, restarts in ((["mhcrun"], False), (["mhcrun", "--help"], False), (["mhcrun", "info", "--help"], False),
                           (["mhcrun", "--version"], False), (["mhcrun", "info", "--json"], True)):
        started.clear()
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit):
            cli_mod.main()
        assert bool(started) == restarts, argv
    capsys.readouterr()


# ---------------------------------------------------------------------------------------------- make-tiny


def test_make_tiny_writes_the_random_model(made_tiny, random_tiny):
    """make-tiny writes the random model whose golden file (checked against DeepSeek's reference) it still passes."""
    assert {p.name for p in made_tiny.iterdir()} >= {"config.json", INDEX, SHARD1, SHARD2, "tokenizer.json"}
    ok(cli("golden-check", GOLDEN_RANDOM, "--model", made_tiny))
    mine, fixture = (json.loads(cli("info", "--model", m, "--json").stdout) for m in (made_tiny, random_tiny))
    assert mine["config_hash"] == fixture["config_hash"] and mine["params"] == fixture["params"]


def test_make_tiny_fp8(made_fp8):
    r = cli("info", "--model", made_fp8, "--json")
    ok(r)
    by_dtype = json.loads(r.stdout)["bytes_by_dtype"]
    assert "float8_e4m3fn" in by_dtype and "int8" in by_dtype, by_dtype
    (res,) = gen_json("--model", made_fp8, "--prompt-ids", IDS, "-n", N)
    assert len(res["tokens"]) == N and all(0 <= t < 512 for t in res["tokens"])


def test_make_tiny_refuses_non_empty_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    user_error(cli("make-tiny", out), str(out), "--force")
    assert snapshot(out) == {"keep.txt": hashlib.sha256(b"mine").hexdigest()}
    ok(cli("make-tiny", out, "--force"))
    assert (out / "config.json").is_file() and (out / SHARD2).is_file()


def test_make_tiny_onto_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    user_error(cli("make-tiny", f), str(f))
    assert f.read_text() == "x"


# ---------------------------------------------------------------------------------------------- golden-check


def test_golden_check_bundled_passes(golden):
    r = cli("golden-check", GOLDEN)
    ok(r)
    n = len(golden["prompts"])
    assert f"OK: {n} prompts, {n} match, 0 near-tie, 0 mismatch" in r.stdout
    assert r.stderr == ""


def _largest_margin_step(prompt: dict) -> int:
    margins = [s["margin"] for s in prompt["steps"]]
    return margins.index(max(margins))


def test_golden_check_mismatch(tmp_path, golden):
    g = subset(golden, golden["prompts"][0]["id"], golden["prompts"][1]["id"])
    pid = g["prompts"][0]["id"]
    step = _largest_margin_step(g["prompts"][0])
    want, got, margin = swap_top1(g, pid, step)
    assert margin >= g["tolerance"]
    path = write_json(tmp_path / "bad.json", g)

    r = cli("golden-check", path)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr and r.stderr == ""
    row = next(line for line in r.stdout.splitlines() if f" {pid} " in line)
    assert "MISMATCH" in row
    cells = [c.strip() for c in re.split(r"[│|]", row)]
    assert str(step) in cells
    assert any(c.split(" ")[0] == str(want) for c in cells) and any(c.split(" ")[0] == str(got) for c in cells)
    assert "FAILED" in r.stdout

    r = cli("golden-check", path, "--json", "--free-running")
    assert r.exit_code == 1
    rep = json.loads(r.stdout)
    assert rep["ok"] is False and rep["counts"] == {"match": 1, "near-tie": 0, "mismatch": 1, "non-finite": 0}
    first = rep["prompts"][0]
    assert (first["id"], first["status"], first["step"]) == (pid, "mismatch", step)
    assert (first["expected"], first["got"], first["matched"]) == (want, got, step)
    assert first["margin"] == pytest.approx(margin)
    assert rep["prompts"][1]["status"] == "match"


def test_golden_check_natural_near_tie_passes(tmp_path, golden):
    """Change the token at the golden step with the smallest recorded margin: a near-tie, exit 0."""
    tol = golden["tolerance"]
    pid, step, margin = min(((p["id"], j, s["margin"]) for p in golden["prompts"] for j, s in enumerate(p["steps"])),
                            key=lambda x: x[2])
    assert margin < tol, "the bundled golden file has no step below its tolerance"
    g = subset(golden, pid)
    want, got, _ = swap_top1(g, pid, step)
    path = write_json(tmp_path / "tie.json", g)
    # the edit moves the golden log-probs of the two tokens by the margin: within a log-prob tolerance above it
    r = cli("golden-check", path, "--json", "--free-running", "--logprob-tol", str(tol))
    ok(r)
    rep = json.loads(r.stdout)
    assert rep["ok"] is True and rep["counts"]["near-tie"] == 1
    p = rep["prompts"][0]
    assert (p["status"], p["step"], p["expected"], p["got"]) == ("near-tie", step, want, got)


def test_golden_check_edited_margin_is_reported_but_log_probs_decide(tmp_path, golden):
    """A confident step whose token and margin are edited into a near-tie: the margin rule would accept it, but
    the log-probs of the two tokens are far apart, so free-running calls it a mismatch (naming the margin), and
    teacher forcing fails at that step."""
    g = subset(golden, golden["prompts"][0]["id"])
    pid = g["prompts"][0]["id"]
    step = _largest_margin_step(g["prompts"][0])
    swap_top1(g, pid, step, margin=g["tolerance"] / 2)
    path = write_json(tmp_path / "tie.json", g)
    r = cli("golden-check", path, "--free-running", "--json")
    assert r.exit_code == 1, r.stdout
    p = json.loads(r.stdout)["prompts"][0]
    assert p["status"] == "mismatch" and p["step"] == step and "golden margin 0.005 < tolerance 0.01" in p["note"]
    r = cli("golden-check", path, "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["prompts"][0]["step"] == step


def test_golden_check_other_model(tmp_path, golden):
    g = subset(golden, golden["prompts"][0]["id"])
    g["model"]["config_hash"] = "0123456789abcdef"
    path = write_json(tmp_path / "other.json", g)
    before = snapshot(path)
    user_error(cli("golden-check", path), str(path), "another model", "0123456789abcdef", "--force")
    assert snapshot(path) == before

    r = cli("golden-check", path, "--force", "--json")
    ok(r)
    assert json.loads(r.stdout)["ok"] is True
    assert r.stderr.startswith("warning: ") and "another model" in r.stderr

    g["model"]["config_hash"] = golden["model"]["config_hash"]
    g["model"]["weights_hash"] = "fedcba9876543210"
    user_error(cli("golden-check", write_json(path, g)), "weights", "fedcba9876543210")


def test_golden_check_forced_onto_a_smaller_vocabulary_is_one_line(tmp_path, golden):
    """--force onto a model whose vocabulary (512, make-tiny's) lacks the golden's ids: the warnings, then one error
    line naming the prompt and the id, exit 2 (it was an IndexError: exit 70)."""
    ok(cli("make-tiny", tmp_path / "small"))
    path = write_json(tmp_path / "g.json", golden)
    r = cli("golden-check", path, "-m", tmp_path / "small", "--force")
    assert r.exit_code == 2 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    *warnings, line = r.stderr.splitlines()
    assert all(w.startswith("warning: ") for w in warnings) and line.startswith(f"error: {path}: prompt ")
    assert "outside this model's vocabulary [0, 512)" in line


def test_golden_check_other_model_name_only_warns(tmp_path, golden):
    g = subset(golden, golden["prompts"][0]["id"])
    g["model"]["name"] = "renamed"
    r = cli("golden-check", write_json(tmp_path / "renamed.json", g))
    ok(r)
    assert r.stderr.startswith("warning: ") and "renamed" in r.stderr


@pytest.mark.parametrize("case", ["not-json", "wrong-format", "missing-key", "bad-margin", "inconsistent-top1",
                                  "missing-file", "directory"])
def test_golden_check_bad_file(tmp_path, golden, case):
    path = tmp_path / "g.json"
    g = copy.deepcopy(golden)
    needles: tuple[str, ...]
    if case == "not-json":
        path.write_text("{not json")
        needles = ("not valid JSON",)
    elif case == "wrong-format":
        write_json(path, {"format": "something-else", "version": 1})
        needles = ("format",)
    elif case == "missing-key":
        del g["tolerance"]
        write_json(path, g)
        needles = ("tolerance",)
    elif case == "bad-margin":
        g["prompts"][1]["steps"][2]["margin"] = "big"
        write_json(path, g)
        needles = ("prompts[1].steps[2].margin",)
    elif case == "inconsistent-top1":
        g["prompts"][0]["tokens"][3] = (g["prompts"][0]["tokens"][3] + 1) % 512
        write_json(path, g)
        needles = ("prompts[0].steps[3].top[0][0]",)
    elif case == "missing-file":
        needles = ("not found",)
    else:
        path.mkdir()
        needles = ()
    before = snapshot(path) if path.exists() else None
    user_error(cli("golden-check", path), str(path), *needles)
    user_error(cli("golden-check", path, "--json"), str(path), *needles)
    assert (snapshot(path) if path.exists() else None) == before


def test_golden_check_unknown_graph_mode():
    user_error(cli("golden-check", GOLDEN, "--graph-mode", "turbo"), "turbo", "eager")
    user_error(cli("golden-check", GOLDEN, env={"MHCRUN_GRAPH_MODE": "turbo"}), "turbo")


# ---------------------------------------------------------------------------------------------- golden-record


def test_golden_record_then_check_and_overwrite_rules(tmp_path):
    pf = tmp_path / "prompts.jsonl"
    pf.write_text('{"id": "t", "prompt": "The river"}\n{"id": "i", "prompt_ids": [0, 5, 6]}\n')
    out = tmp_path / "g.json"
    r = cli("golden-record", "--prompts-file", pf, "--out", out, "-n", N)
    ok(r)
    assert str(out) in r.stdout
    g = load_golden_json(out)
    assert [p["id"] for p in g["prompts"]] == ["t", "i"]
    assert all(len(p["tokens"]) == N for p in g["prompts"])
    assert g["settings"]["max_new_tokens"] == N and g["prompts"][1]["prompt_ids"] == [0, 5, 6]
    assert not list(tmp_path.glob(".g.json.*"))  # no temp files left behind

    r = cli("golden-check", out, "--json")
    ok(r)
    assert json.loads(r.stdout)["counts"]["match"] == 2

    before = out.read_bytes()
    user_error(cli("golden-record", "--prompts-file", pf, "--out", out, "-n", 3), str(out), "--force")
    assert out.read_bytes() == before

    ok(cli("golden-record", "--prompts-file", pf, "--out", out, "-n", 3, "--force"))
    g = load_golden_json(out)
    assert g["settings"]["max_new_tokens"] == 3 and all(len(p["tokens"]) == 3 for p in g["prompts"])
    ok(cli("golden-check", out))


@pytest.mark.parametrize("case", ["missing-prompts", "bad-prompts-line", "n-zero", "logprobs-one"])
def test_golden_record_bad_input(tmp_path, case):
    pf = tmp_path / "prompts.jsonl"
    pf.write_text('{"prompt_ids": [0, 5]}\n')
    out = tmp_path / "g.json"
    extra: tuple = ()
    if case == "missing-prompts":
        pf.unlink()
        needles = (str(pf), "not found")
    elif case == "bad-prompts-line":
        pf.write_text('{"prompt_ids": [0, 5]}\n{"prompt_ids": [0, 9999]}\n')
        needles = (f"{pf}:2", "9999")
    elif case == "n-zero":
        extra, needles = ("-n", 0), ("--max-new-tokens",)
    else:
        extra, needles = ("--logprobs", 1), ("--logprobs",)
    user_error(cli("golden-record", "--prompts-file", pf, "--out", out, *extra), *needles)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------- bad checkpoints


def _missing_shard(c: Path):
    (c / SHARD2).unlink()
    return (SHARD2, "missing")


def _truncated_shard(c: Path):
    data = (c / SHARD2).read_bytes()
    (c / SHARD2).write_bytes(data[: len(data) // 2])
    return (SHARD2, "truncated")


def _missing_tensor(c: Path):
    rewrite_tensor(c, LINEAR, None)
    return (LINEAR, "missing", INDEX)


def _tensor_absent_from_shard(c: Path):
    shard = rewrite_tensor(c, LINEAR, None, fix_index=False)
    return (LINEAR, shard.name)


def _wrong_shape(c: Path):
    shard = rewrite_tensor(c, LINEAR, torch.zeros(128, 64, dtype=torch.bfloat16))
    return (LINEAR, shard.name, "shape", "[128, 64]", "[64, 128]")


def _wrong_dtype(c: Path):
    shard = rewrite_tensor(c, LINEAR, torch.zeros(64, 128, dtype=torch.int32))
    return (LINEAR, shard.name, "int32")


def _index_not_json(c: Path):
    (c / INDEX).write_text("{ nope")
    return (INDEX, "not valid JSON")


def _config_not_json(c: Path):
    (c / "config.json").write_text('{"vocab_size": 512,,}')
    return ("config.json", "not valid JSON")


def _config_missing(c: Path):
    (c / "config.json").unlink()
    return ("config.json", "not found")


def _config_missing_key(c: Path):
    edit_config(c, vocab_size=DELETE)
    return ("config.json", "vocab_size")


def _config_short_ratios(c: Path):
    edit_config(c, compress_ratios=[0, 4, 16])
    return ("config.json", "compress_ratios", "3", "4")


def _config_head_dim(c: Path):
    edit_config(c, head_dim=160)
    return ("config.json", "head_dim", "96", "64")


def _config_wrong_type(c: Path):
    edit_config(c, hidden_size="128")
    return ("config.json", "hidden_size", "'128'")


BROKEN: dict[str, Callable[[Path], tuple[str, ...]]] = {
    "missing-shard": _missing_shard,
    "truncated-shard": _truncated_shard,
    "missing-tensor": _missing_tensor,
    "tensor-absent-from-shard": _tensor_absent_from_shard,
    "wrong-shape": _wrong_shape,
    "wrong-dtype": _wrong_dtype,
    "index-not-json": _index_not_json,
    "config-not-json": _config_not_json,
    "config-missing": _config_missing,
    "config-missing-key": _config_missing_key,
    "config-short-compress-ratios": _config_short_ratios,
    "config-head-dim": _config_head_dim,
    "config-wrong-type": _config_wrong_type,
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_checkpoint(ckpt, case):
    needles = BROKEN[case](ckpt)
    before = snapshot(ckpt)
    user_error(cli("generate", "--model", ckpt, "--prompt-ids", IDS, "-n", 2), *needles)
    user_error(cli("generate", "--model", ckpt, "-n", 2, "--json"), *needles)
    user_error(cli("info", "--model", ckpt), *needles)
    user_error(cli("info", "--model", ckpt, "--json"), *needles)
    user_error(cli("golden-check", GOLDEN, "--model", ckpt), *needles)
    assert snapshot(ckpt) == before


def test_model_not_found(tmp_path):
    missing = tmp_path / "nope"
    for args in (("generate", "-n", 1), ("info",), ("golden-check", GOLDEN)):
        user_error(cli(*args, "--model", missing), str(missing), "not found")
    assert not missing.exists()


def test_model_is_a_file(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"\0" * 16)
    for args in (("generate", "-n", 1), ("info",)):
        user_error(cli(*args, "--model", f), str(f), "not a directory")
    assert f.read_bytes() == b"\0" * 16


# ---------------------------------------------------------------------------------------------- bad flags


LONG = ",".join(["5"] * 600)
FITS_BUT_NOT_WITH_N = ",".join(["5"] * 510)


@pytest.mark.parametrize(("args", "needles"), [
    (("--prompt-ids", "0,9999"), ("9999", "vocabulary")),
    (("--prompt-ids", "0,-3"), ("-3",)),
    (("--prompt-ids", "0,,5"), ("--prompt-ids",)),
    (("--prompt-ids", ""), ("--prompt-ids", "empty")),
    (("--prompt-ids", LONG), ("600", "512")),
    (("--prompt-ids", FITS_BUT_NOT_WITH_N, "-n", 4), ("510", "512")),
    (("--prompt-ids", IDS, "-n", -1), ("--max-new-tokens", "-1")),
    (("--max-new-tokens", -5), ("--max-new-tokens", "-5")),
    (("--graph-mode", "turbo"), ("--graph-mode", "turbo", "eager")),
    (("--dtype", "fp64"), ("--dtype", "fp64", "fp32")),
    (("--device", "tpu"), ("--device", "tpu")),
    (("--temperature", -1), ("--temperature",)),
    (("--top-p", 0), ("--top-p",)),
    (("--top-p", 1.5), ("--top-p",)),
    (("--prompt", "x", "--prompt-ids", IDS), ("only one",)),
])
def test_generate_bad_flags(args, needles):
    user_error(cli("generate", *args), *needles)


def test_generate_bad_graph_mode_env():
    user_error(cli("generate", "-n", 1, env={"MHCRUN_GRAPH_MODE": "turbo"}), "turbo")


@pytest.mark.parametrize("content", ['{"prompt_ids": [0, 5]}\n{"prompt_ids": [0, 6000]}\n', "not json\n", "\n\n",
                                     '{"prompt": "a", "prompt_ids": [0]}\n', '{"prompt": "a", "id": "x"}\n'
                                     '{"prompt": "b", "id": "x"}\n'])
def test_generate_bad_prompts_file(tmp_path, content):
    pf = tmp_path / "p.jsonl"
    pf.write_text(content)
    user_error(cli("generate", "--prompts-file", pf), str(pf))
    assert pf.read_text() == content


def test_generate_missing_prompts_file(tmp_path):
    user_error(cli("generate", "--prompts-file", tmp_path / "none.jsonl"), "none.jsonl", "not found")


def test_long_prompt_in_prompts_file(tmp_path):
    pf = tmp_path / "p.jsonl"
    pf.write_text(json.dumps({"id": "huge", "prompt_ids": [5] * 600}) + "\n")
    user_error(cli("generate", "--prompts-file", pf, "-n", 1), "huge", "600", "512")


# ---------------------------------------------------------------------------------------------- end to end


def test_script_missing_model(tmp_path):
    missing = tmp_path / "nope"
    p = run_script("generate", "--model", missing, "-n", 1)
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(missing) in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_script_truncated_shard_and_debug(ckpt):
    needles = _truncated_shard(ckpt)
    before = snapshot(ckpt)
    p = run_script("generate", "--model", ckpt, "--prompt-ids", IDS, "-n", 1)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert all(n in lines[0] for n in needles) and "Traceback" not in p.stdout + p.stderr

    p = run_script("generate", "--model", ckpt, "--prompt-ids", IDS, "-n", 1, "--debug")
    assert p.returncode != 0
    assert "Traceback" in p.stderr and "CheckpointError" in p.stderr and SHARD2 in p.stderr
    assert snapshot(ckpt) == before


def test_script_golden_mismatch_exit_1(tmp_path, golden):
    g = truncate(subset(golden, golden["prompts"][0]["id"]), 4)
    pid = g["prompts"][0]["id"]
    step = _largest_margin_step(g["prompts"][0])
    swap_top1(g, pid, step)
    p = run_script("golden-check", write_json(tmp_path / "bad.json", g), "--json")
    assert p.returncode == 1, p.stderr
    rep = json.loads(p.stdout)
    assert rep["ok"] is False and rep["prompts"][0]["step"] == step


# ---------------------------------------------------------------------------------------------- regressions
# User errors that once surfaced as internal errors.


def test_generate_nan_temperature():
    user_error(cli("generate", "--prompt-ids", IDS, "-n", 2, "--temperature", "nan"), "--temperature")


def test_generate_seed_out_of_range():
    user_error(cli("generate", "--prompt-ids", IDS, "-n", 2, "--temperature", "0.5", "--seed", 2 ** 64), "--seed")


@pytest.mark.parametrize("key", ["vocab_size", "compress_ratios"])
def test_config_required_key_null(ckpt, key):
    edit_config(ckpt, **{key: None})
    user_error(cli("info", "--model", ckpt), "config.json", key)


def test_golden_record_out_is_a_directory(tmp_path):
    pf = tmp_path / "p.jsonl"
    pf.write_text('{"prompt_ids": [0, 5]}\n')
    out = tmp_path / "dir"
    out.mkdir()
    user_error(cli("golden-record", "--prompts-file", pf, "--out", out, "-n", 1, "--force"), str(out))


@pytest.mark.parametrize("command", ["make-tiny", "golden-record"])
def test_write_below_a_file(tmp_path, command):
    f = tmp_path / "file"
    f.write_text("x")
    if command == "make-tiny":
        r = cli("make-tiny", f / "sub")
    else:
        pf = tmp_path / "p.jsonl"
        pf.write_text('{"prompt_ids": [0, 5]}\n')
        r = cli("golden-record", "--prompts-file", pf, "--out", f / "g.json", "-n", 1)
    user_error(r, str(f))
    assert f.read_text() == "x"


def test_model_given_as_a_relative_path(monkeypatch):
    """A relative --model path once had its shards joined onto it twice when hashing the weights."""
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    r = cli("generate", "--model", "mhcrun/data/tiny", "--prompt-ids", "0,5,6", "-n", 2, "--json")
    assert r.exit_code == 0, r.stderr


# ---------------------------------------------------------------------------------------------- option names
def test_the_peers_option_names_and_the_old_ones_give_the_same_run():
    """--temp, --max-tokens (mlx-lm, llama.cpp, vLLM, OpenAI) and --temperature, --max-new-tokens: one option each."""
    old = cli("generate", "--prompt-ids", IDS, "--max-new-tokens", 4, "--temperature", 0.9, "--seed", 7, "--json")
    new = cli("generate", "--prompt-ids", IDS, "--max-tokens", 4, "--temp", 0.9, "--seed", 7, "--json")
    ok(old), ok(new)
    assert json.loads(old.stdout)["tokens"] == json.loads(new.stdout)["tokens"]
    assert len(json.loads(new.stdout)["tokens"]) == 4


def test_golden_record_logprobs_and_its_old_name_top_k(tmp_path):
    pf = tmp_path / "p.jsonl"
    pf.write_text('{"prompt_ids": [0, 5, 6]}\n')
    for flag, n in (("--logprobs", 3), ("--top-k", 4)):
        ok(cli("golden-record", "--prompts-file", pf, "--out", tmp_path / f"{flag}.json", "-n", 2, flag, n))
        golden = json.loads((tmp_path / f"{flag}.json").read_text())
        assert golden["settings"]["top_k"] == n and all(len(s["top"]) == n for s in golden["prompts"][0]["steps"])


def test_chat_takes_generates_sampling_and_quant_options(tmp_path):
    """chat's reply with --temp/--top-p/--seed/--no-quant-sim/--dequantize/--dtype is generate --messages' reply with
    the same options: the options reach the chat loop."""
    opts = ("--mode", "chat", "-n", 6, "--temp", 1.5, "--top-p", 0.9, "--seed", 3, "--no-quant-sim", "--dequantize",
            "--dtype", "bf16")
    messages = tmp_path / "m.json"
    messages.write_text('[{"role": "user", "content": "Hi"}]')
    want = cli("generate", "--messages", messages, "--json", *opts)
    ok(want)
    reply = json.loads(want.stdout)["message"]["content"]  # chat shows the reply without its end of sentence
    got = CLI.invoke(app, ["chat", *map(str, opts)], input="Hi\n/exit\n")
    ok(got)
    assert reply and reply in got.stdout, (reply, got.stdout)
    greedy = CLI.invoke(app, ["chat", *map(str, opts[:4]), *map(str, opts[10:])], input="Hi\n")
    ok(greedy)
    assert reply not in greedy.stdout  # sampling at 1.5 parts from greedy here: the comparison above can fail


@pytest.mark.parametrize("command", ["generate", "generate --json", "golden-check"])
def test_a_reader_gone_from_stdout_ends_the_command_quietly(command, tmp_path):
    """`mhcrun generate | head`: when stdout's reader has left, the command stops with the code a process SIGPIPE
    ends has (141), nothing on stderr: not an internal error, and not exit 1 (golden-check's mismatch)."""
    args = ["generate", "-p", "hi", "-n", "8", "--temp", "0", *command.split()[1:]]
    if command == "golden-check":
        golden, prompts = tmp_path / "g.json", tmp_path / "p.jsonl"
        prompts.write_text('{"prompt": "hi"}\n')
        ok(cli("golden-record", "--prompts-file", prompts, "--out", golden, "-n", 4))
        args = ["golden-check", str(golden)]
    proc = subprocess.Popen([*console_script(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    proc.stdout.close()  # the reader leaves before the first write
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 141, (proc.returncode, stderr.decode())
    assert stderr.decode().strip() == ""


def test_sigterm_removes_the_file_being_written_and_ends_with_one_line(tmp_path):
    """SIGTERM (a job's timeout) in the middle of a write: the half-written shard is removed, one line, exit 143."""
    out = tmp_path / "synth"
    p = subprocess.Popen([*console_script(), "make-synthetic", str(REPO / "configs" / "v4-mid.json"), str(out),
                          "--layers", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.time() + 60
    while not list(out.glob(".*.tmp")) and p.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert list(out.glob(".*.tmp")), "no shard was being written"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and err.strip().splitlines() == ["error: terminated (SIGTERM)"], err
    assert not list(out.glob(".*.tmp")) and not list(out.glob("*.safetensors"))


def test_exit_codes_tell_a_bug_and_a_refused_write_from_the_run_s_own_failures(monkeypatch, tmp_path):
    """A bug is one line and exit 70, an operating system's refusal (a full disk) one line naming it and exit 74:
    neither is golden-check's 1 (mismatch), 2 (bad input) or 3 (non-finite logits)."""
    import mhcrun.runner

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    with monkeypatch.context() as m:
        m.setattr(mhcrun.runner, "open_runner", boom)
        r = cli("generate", "--prompt-ids", IDS, "-n", 1)
    assert r.exit_code == 70 and r.stderr.strip().splitlines() == [
        "error: internal error: RuntimeError: boom (rerun with --debug for the traceback)"], r.stderr
    if Path("/dev/full").exists():
        full = subprocess.run(f"{shlex.join(console_script())} generate -p hi -n 2 --json > /dev/full", shell=True,
                              capture_output=True, text=True, cwd=REPO, timeout=120)
        assert full.returncode == 74, full.stderr
        assert full.stderr.strip().splitlines() == ["error: No space left on device (writing the output)"]


def test_command_list_shows_each_command_on_one_line_when_wide_enough():
    """`mhcrun --help` lists each command by its docstring's first paragraph as one line (rich would keep the
    docstring's own line breaks there)."""
    text = cli("--help", env={"COLUMNS": "400"}).stdout
    assert "<bool>" not in text  # --help takes no value
    lines = text.splitlines()
    commands = typer.main.get_command(app).commands
    assert len(commands) >= 9
    for name, command in commands.items():
        first = " ".join(inspect.cleandoc(command.help).split("\n\n")[0].split())
        assert any(name in line and first in line for line in lines), (name, first)


def test_help_groups_options_into_panels_with_developer_knobs_last():
    text = cli("generate", "--help", env={"COLUMNS": "200"}).stdout
    panels = [p for p in ("Input", "Sampling", "Path under test", "Memory", "Output", "Developer")
              if f"─ {p} ─" in text]
    assert len(panels) == 6 and sorted(panels, key=text.index) == panels
    assert text.index("--debug") > text.index("─ Developer ─") > text.index("--json")
    assert "<int>" in text and "<bool>" not in text  # flags take no value: no type beside them
    says = {"generate": "skips only that check", "golden-record": "Overwrite an existing --out file",
            "golden-check": "skips only that refusal", "make-tiny": "Write into a non-empty OUT directory",
            "make-synthetic": "Write into a non-empty OUT directory"}
    for command, what in says.items():  # each --force says what it overrides
        assert what in " ".join(cli(command, "--help", env={"COLUMNS": "400"}).stdout.split()), command


def test_a_command_line_click_refuses_is_one_line():
    """An unknown command or option, a value of the wrong type, a missing value or argument: one `error:` line naming
    it and the --help to read, exit 2 (click's own answer was usage, a hint and a framed message); no command at
    all still shows the help."""
    cases = {("generat",): ("No such command 'generat'", " --help)"),
             ("generate", "--context", "4"): ("No such option: --context", " generate --help)"),
             ("generate", "-n", "x"): ("'-n'", "valid integer"),
             ("generate", "--prompt"): ("'--prompt' requires an argument", " generate --help)"),
             ("golden-check",): ("Missing argument 'GOLDEN'", " golden-check --help)"),
             ("info", "--quant-sim=1"): ("'--quant-sim' does not take a value",)}
    for args, needles in cases.items():
        user_error(cli(*args), *needles)
    r = cli()
    assert r.exit_code == 2 and "Usage: " in r.stdout + r.stderr and "generate" in r.stdout + r.stderr


def test_version_names_mhcrun_torch_and_python():
    r = cli("--version")
    ok(r)
    import torch

    assert r.stdout.strip() == f"mhcrun 0.1.0, torch {torch.__version__}, Python {sys.version.split()[0]}"
    assert "--version" in cli("--help", env={"COLUMNS": "200"}).stdout


def test_generate_says_before_the_prompt_that_regions_compile_first(monkeypatch, tmp_path):
    """A regions run compiles its graphs before its prefill (20 s or more cold), or with a prompt cache at its
    first decode step: the run, its streamed prompt, would wait unexplained. The run itself goes eager here (the note
    is the CLI's; compiling is test_regions')."""
    import mhcrun.generate as gen

    real = gen.generate
    monkeypatch.setattr(gen, "generate", lambda *a, **k: real(*a, **{**k, "graph_mode": "eager"}))
    r = cli("generate", "--prompt", "The river", "-n", 2, "--graph-mode", "regions")
    ok(r)
    note = r.stderr.splitlines()[0]  # one row, its context rounded up (settings.regions_context)
    ahead = "before the prefill" if cpu_kernel().ops else "at the first decode step"  # C++ wrappers built aside
    assert note.startswith(f"compiling the regions' graphs {ahead}") and r.stderr.count(note) == 1
    assert note.endswith("(`mhcrun compile-regions --batch 1 --context 256` compiles them ahead)")
    cache = cli("generate", "--prompt", "The river", "-n", 2, "--graph-mode", "regions", "--prompt-cache",
                tmp_path / "river.safetensors")
    ok(cache)
    assert cache.stderr.splitlines()[0].startswith("compiling the regions' graphs at the first decode step")
    for quiet in (("-n", 1), ("-n", 2, "--json"), ("-n", 2, "--graph-mode", "eager")):  # no decode step, no prose
        r = cli("generate", "--prompt", "The river", "--graph-mode", "regions", *quiet)
        ok(r)
        assert "compiling the regions' graphs" not in r.stderr
    r = cli("generate", "--prompt", "The river", "-n", 2, "--graph-mode", "regions", "--draft-tokens", 2)
    ok(r)
    assert r.stderr.splitlines()[0].startswith("compiling the regions' graphs " + (
        "before the prefill" if cpu_kernel().ops else "at the first verify step"))
    assert r.stderr.splitlines()[0].endswith("(`mhcrun compile-regions --draft-tokens 2 --batch 1 --context 256` "
                                             "compiles them ahead)")


def test_every_option_and_argument_says_what_it_does():
    """`--help` of each command describes every parameter (make-tiny's and make-synthetic's --seed said nothing)."""
    import typer

    group = typer.main.get_command(app)
    bare = [f"{name} {p.opts[0]}" for name, command in group.commands.items() for p in command.params
            if not (getattr(p, "help", None) or "").strip()]
    assert not bare, f"parameters without a help text: {bare}"


def test_compile_note_names_the_compile_regions_command_of_the_runs_path():
    """The note a regions run prints names the compile-regions command that compiles its graphs: the checkpoint
    given, every path option that changes the graphs, the batch and the rounded context."""
    from types import SimpleNamespace

    def model(ops: str) -> SimpleNamespace:  # the kernel's C++ ops loaded (`wraps_in_cpp`), or not
        return SimpleNamespace(device=torch.device("cpu"), opts=SimpleNamespace(cpu=SimpleNamespace(ops=ops)))

    runner = SimpleNamespace(device="cpu", dtype="bf16", quant_sim=False, dequantize=True, layers=2,
                             tp=SimpleNamespace(world=2), model=model("ops.so"))
    assert compile_note(runner, "/ckpt", "split", 3, 512).endswith(
        "(`mhcrun compile-regions -m /ckpt --dtype bf16 --no-quant-sim --dequantize --layers 2 --stages split --tp 2 "
        "--batch 3 --context 512` compiles them ahead)")
    plain = SimpleNamespace(device="cpu", dtype="fp32", quant_sim=True, dequantize=False, layers=None,
                            tp=SimpleNamespace(world=1), model=model("ops.so"))
    assert compile_note(plain, None, "whole", 1, 256).endswith(
        "(`mhcrun compile-regions --batch 1 --context 256` compiles them ahead)")
    assert compile_note(plain, None, "whole", 1, 256, 2).endswith(
        "(`mhcrun compile-regions --draft-tokens 2 --batch 1 --context 256` compiles them ahead)")
    # when: before the prefill where the graphs' C++ wrappers build aside, else (a session's, or Python wrappers:
    # no kernel ops) at the first step
    assert compile_note(plain, None, "whole", 1, 256).startswith("compiling the regions' graphs before the prefill")
    assert compile_note(plain, None, "whole", 1, 256, 2, ahead=False).startswith(
        "compiling the regions' graphs at the first verify step")
    plain.model = model("")
    assert compile_note(plain, None, "whole", 1, 256).startswith(
        "compiling the regions' graphs at the first decode step")


def test_compile_regions_compiles_for_the_path_options_it_is_given(monkeypatch):
    """compile-regions opens the model as a run with the same --dtype, --quant-sim, --dequantize and --layers
    does (its graphs are that run's), and reports the context rounded as that run rounds its own."""
    import mhcrun.regions.runner as regions_runner

    seen = {}

    def fake_compile_all(model, batch, context, stages, on_progress=None, draft_tokens=0):
        seen.update(dtype=model.dtype, quant_sim=model.opts.quant_sim, layers=len(model.layers), batch=batch,
                    context=context, draft_tokens=draft_tokens, mtp=len(model.mtp))
        return {"backend": "inductor", "stages": stages, "graphs": 0, "layers": len(model.layers), "batch": batch,
                "context": context, "total_s": 0.0, "regions": []}

    monkeypatch.setattr(regions_runner, "compile_all", fake_compile_all)
    ok(cli("compile-regions", "--dtype", "bf16", "--no-quant-sim", "--layers", 2, "--batch", 2, "--context", 300))
    assert seen == {"dtype": torch.bfloat16, "quant_sim": False, "layers": 2, "batch": 2, "context": 300,
                    "draft_tokens": 0, "mtp": 0}
    r = cli("compile-regions", "--draft-tokens", 3)
    ok(r)
    assert seen["draft_tokens"] == 3 and seen["mtp"] == 1 and "a verify of 4 tokens a row" in " ".join(r.stdout.split())
    r = cli("compile-regions", "--draft-tokens", 9)
    assert r.exit_code == 2 and r.stderr.strip() == "error: --draft-tokens must be in [1, 8], got 9"
    r = cli("compile-regions", "--dtype", "fp16")
    assert r.exit_code == 2 and r.stderr.strip() == "error: unknown --dtype 'fp16' (choose from: fp32, bf16)"
