"""golden-check as a bring-up engineer uses it: teacher-forced log-probs on every path within the documented
tolerances (compiled regions on a model with exact indexer ties, kept-quantised against dequantised weights),
and --locate naming the layer half a deliberate one-layer perturbation of the compiled path sits in."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CLI

from mhcrun.checkpoint import write_checkpoint
from mhcrun.cli import app
from mhcrun.config import config_from_hf
from mhcrun.golden import TOLERANCES, load_golden, write_golden
from mhcrun.regions import runner as regions_runner
from mhcrun.tiny import init_tensors, make_tiny, tiny_config_raw

GOLDEN = "tests/golden/tiny.json"


@pytest.fixture
def fast_compile(monkeypatch):
    """Compiled regions through torch's aot_eager backend: the same traced graphs, seconds instead of minutes."""
    monkeypatch.setattr(regions_runner, "default_backend", lambda device: "aot_eager")


def small_golden(tmp_path, n_prompts: int = 3, n_tokens: int = 12) -> str:
    g = load_golden(GOLDEN)
    g["prompts"] = [dict(p, tokens=p["tokens"][:n_tokens], steps=p["steps"][:n_tokens])
                    for p in g["prompts"][:n_prompts]]
    g["settings"]["max_new_tokens"] = n_tokens
    path = tmp_path / "small.json"
    write_golden(path, g, force=False)
    return str(path)


def run_json(*args: str) -> tuple[int, dict]:
    r = CLI.invoke(app, ["golden-check", *args, "--json"])
    assert r.exit_code in (0, 1), r.stdout + r.stderr
    return r.exit_code, json.loads(r.stdout)


def test_regions_pass_teacher_forced_within_the_fp32_tolerance(tmp_path, fast_compile):
    code, rep = run_json(small_golden(tmp_path), "--graph-mode", "regions")
    assert code == 0 and rep["teacher_forced"] and rep["logprob_tol"] == TOLERANCES["fp32"][0]
    assert all(p["max_logprob_diff"] <= TOLERANCES["fp32"][0] for p in rep["prompts"])


def test_regions_say_on_stderr_that_they_compile_first(tmp_path, fast_compile):
    """A regions check compiles its graphs before its table (20 s or more cold): it says so
    first, as generate does; not with --json (one object on stdout, nothing else) nor for an eager check."""
    golden = small_golden(tmp_path, 1, 4)
    r = CLI.invoke(app, ["golden-check", golden, "--graph-mode", "regions"])
    assert r.exit_code == 0, r.stdout + r.stderr
    note = r.stderr.splitlines()[0]  # the golden file's one prompt, its context rounded up
    # aot_eager (`fast_compile`) has no C++ wrappers to build aside: its graphs compile at the first decode step
    assert note.startswith("compiling the regions' graphs at the first decode step") and r.stderr.count(note) == 1
    assert note.endswith("(`mhcrun compile-regions --batch 1 --context 256` compiles them ahead)")
    for quiet in (["--graph-mode", "regions", "--json"], ["--graph-mode", "eager"]):
        r = CLI.invoke(app, ["golden-check", golden, *quiet])
        assert r.exit_code == 0 and "compiling the regions' graphs" not in r.stderr, r.stdout + r.stderr


def test_locate_names_the_perturbed_layer_half_of_the_compiled_path(tmp_path, fast_compile, monkeypatch):
    """A test-only perturbation of layer 2's MoE half's output in the compiled regions alone: teacher forcing fails
    from the first decode step, and --locate names layer 2 moe:routed, the regions before it within rounding."""
    original = regions_runner.RegionDecoder.run

    def perturbed(self, kind, fn, module, *args):
        out = original(self, kind, fn, module, *args)
        if module is self.model.layers[2] and kind.startswith("moe"):  # layer 2's MoE half, compiled path only
            g = torch.Generator().manual_seed(0)  # its output: the MoE's, handed on with the post step to do
            out = out._replace(y=out.y + 0.05 * torch.randn(out.y.shape, generator=g))
        return out

    monkeypatch.setattr(regions_runner.RegionDecoder, "run", perturbed)
    r = CLI.invoke(app, ["golden-check", small_golden(tmp_path, 1, 4), "--graph-mode", "regions", "--locate",
                         "--json"])
    assert r.exit_code == 1, r.stdout + r.stderr
    p = json.loads(r.stdout)["prompts"][0]
    assert p["status"] == "mismatch" and p["step"] == 1, p
    assert p["first_region"].startswith("layer 2 moe:routed: max |diff| "), p["first_region"]
    assert "at step 1" in p["first_region"]


def test_locate_without_a_difference_says_so(tmp_path):
    """An edited golden log-prob fails the check, but no region of the run differs from the reference."""
    g = load_golden(small_golden(tmp_path, 1, 4))
    g["prompts"][0]["steps"][2]["top"][1][1] -= 0.3  # a recorded candidate's log-prob moved by 0.3
    path = tmp_path / "moved.json"
    write_golden(path, g, force=False)
    code, rep = run_json(str(path), "--locate")
    p = rep["prompts"][0]
    assert code == 1 and (p["status"], p["step"]) == ("mismatch", 2)
    assert p["max_logprob_diff"] == pytest.approx(0.3, abs=2e-3) and p["max_logprob_diff_step"] == 2
    assert p["first_region"].startswith("no region beyond")


TIES = {"index_n_heads": 2, "index_topk": 3, "compress_ratios": [4, 4, 0], "num_hidden_layers": 3}


def test_exact_indexer_ties_pass_teacher_forced_through_regions(tmp_path, fast_compile):
    """The tie model of the long-context tests as a checkpoint: a golden recorded eagerly (quant simulation off)
    passes teacher-forced through compiled regions within the fp32 tolerance, at every step."""
    raw = dict(tiny_config_raw(), **TIES)
    ckpt = write_checkpoint(tmp_path / "ties", raw, init_tensors(config_from_hf(raw), 3))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt_ids": ids}) + "\n"
                               for i, ids in enumerate([[0, 17, 99, 5, 230, 41, 8, 77, 301], [0, 5, 9]])))
    golden = tmp_path / "ties.json"
    r = CLI.invoke(app, ["golden-record", "-m", str(ckpt), "--prompts-file", str(prompts), "--out", str(golden),
                         "-n", "40", "--no-quant-sim"])
    assert r.exit_code == 0, r.stdout + r.stderr
    code, rep = run_json(str(golden), "-m", str(ckpt), "--graph-mode", "regions")
    assert code == 0, rep
    assert all(p["max_logprob_diff"] <= TOLERANCES["fp32"][0] for p in rep["prompts"])


def test_kept_quantised_passes_against_dequantised_within_its_tolerance(tmp_path):
    """A golden recorded on the tiny FP8/FP4 variant kept quantised; the dequantised reference checks against it
    within the fp32-kernel tolerance (the FP8 activation simulation in another summation order)."""
    ckpt = make_tiny(tmp_path / "fp8", 0, True)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt_ids": [0, 293, 456]}\n{"id": "b", "prompt_ids": [0, 5, 9, 11]}\n')
    golden = tmp_path / "fp8.json"
    r = CLI.invoke(app, ["golden-record", "-m", str(ckpt), "--prompts-file", str(prompts), "--out", str(golden),
                         "-n", "12"])
    assert r.exit_code == 0, r.stdout + r.stderr
    code, rep = run_json(str(golden), "-m", str(ckpt), "--dequantize")
    assert code == 0 and rep["logprob_tol"] == TOLERANCES["fp32-kernel"][0], rep
