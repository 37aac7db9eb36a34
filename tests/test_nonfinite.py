"""Non-finite logits stop a run (exit 3, one line naming the prompt and the step) instead of becoming tokens."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mhcrun.cli import app
from mhcrun.config import config_from_hf
from mhcrun.errors import NonFiniteError
from mhcrun.generate import generate
from mhcrun.model import build_model
from mhcrun.runner import DEFAULT_MODEL
from mhcrun.tiny import init_tensors, tiny_config_raw

try:
    CLI = CliRunner(mix_stderr=False)
except TypeError:
    CLI = CliRunner()


def make_model():
    cfg = config_from_hf(tiny_config_raw())
    return build_model(cfg, init_tensors(cfg, 0), set())


@pytest.mark.parametrize("graph_mode", ["eager", "regions"])
def test_nan_weight_stops_generate_at_the_first_step(graph_mode):
    model = make_model()
    with torch.no_grad():
        model.layers[1].attn.wq_a.weight[3, 5] = float("nan")
    with pytest.raises(NonFiniteError, match=r"prompt 0: the logits of step 0 \(prefill\) hold NaN"):
        generate(model, [[0, 5, 9]], 4, eos_id=1, graph_mode=graph_mode, backend="aot_eager")


def test_inf_appearing_in_decode_names_the_decode_step_and_the_row():
    model = make_model()
    head = model.head.weight
    original = head.clone()

    def poison(row: int, token: int) -> None:  # once row 1 is prefilled, the head's weights turn Inf
        if row == 1:
            head.copy_(torch.full_like(head, float("inf")))

    with pytest.raises(NonFiniteError, match=r"prompt 0: the logits of step 1 \(decode step 1\)"):
        generate(model, [[0, 5, 9], [0, 7]], 3, eos_id=1, ignore_eos=True, on_token=poison)
    head.copy_(original)


def test_cli_generate_with_a_nan_weight_exits_3_with_one_line(tmp_path):
    ckpt = tmp_path / "nan"
    shutil.copytree(DEFAULT_MODEL, ckpt)
    name = "layers.1.attn.wq_a.weight"
    for shard in ckpt.glob("*.safetensors"):
        tensors = load_file(shard)
        if name in tensors:
            tensors[name][0, 0] = float("nan")
            save_file(tensors, shard, metadata={"format": "pt"})
    r = CLI.invoke(app, ["generate", "-m", str(ckpt), "-n", "4", "--json"])
    assert r.exit_code == 3, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: prompt 0: the logits of step 0") and "NaN" in lines[0]
    assert r.stdout == ""  # no tokens were printed


def test_golden_record_refuses_a_non_finite_run_and_writes_nothing(tmp_path):
    ckpt = tmp_path / "nan"
    shutil.copytree(DEFAULT_MODEL, ckpt)
    name = "layers.0.attn.wkv.weight"
    for shard in ckpt.glob("*.safetensors"):
        tensors = load_file(shard)
        if name in tensors:
            tensors[name][1, 2] = float("inf")
            save_file(tensors, shard, metadata={"format": "pt"})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [0, 5, 6]}\n')
    out = tmp_path / "g.json"
    r = CLI.invoke(app, ["golden-record", "-m", str(ckpt), "--prompts-file", str(prompts), "--out", str(out)])
    assert r.exit_code == 3 and not out.exists(), r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "the logits of step 0" in r.stderr
