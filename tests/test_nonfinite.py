"""Non-finite logits stop a run (exit 3, one line naming the prompt and the step) instead of becoming tokens."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import CLI
from safetensors.torch import load_file, save_file

from mhcrun.cli import app
from mhcrun.config import config_from_hf
from mhcrun.errors import NonFiniteError
from mhcrun.generate import generate, nonfinite_rows, raise_nonfinite
from mhcrun.model import build_model
from mhcrun.runner import DEFAULT_MODEL
from mhcrun.tiny import init_tensors, tiny_config_raw


def make_model():
    cfg = config_from_hf(tiny_config_raw())
    return build_model(cfg, init_tensors(cfg, 0), set())


@pytest.mark.parametrize("graph_mode", ["eager", "regions"])
def test_nan_weight_stops_generate_at_the_first_step(graph_mode):
    model = make_model()
    with torch.no_grad():
        model.layers[1].attn.wq_a.weight[3, 5] = float("nan")
    with pytest.raises(NonFiniteError, match=r"prompt 0: the logits of step 0 \(prefill\) hold NaN"):
        raise_nonfinite(generate(model, [[0, 5, 9]], 4, eos_id=1, graph_mode=graph_mode, backend="aot_eager"))


def test_nonfinite_rows_finds_each_kind_and_passes_sums_that_overflow():
    """The sum's quick pass lets no non-finite row through: NaN, +-Inf, both infinities in one row (their sum is
    NaN), and a row whose finite values overflow the sum (checked value by value: finite)."""
    logits = torch.randn(6, 300)
    logits[1, 7] = float("nan")
    logits[2, 299] = float("inf")
    logits[3, 0] = float("-inf")
    logits[4, 3], logits[4, 9] = float("inf"), float("-inf")
    logits[5, :2] = 3e38  # finite, but their sum is inf
    assert nonfinite_rows(logits) == [(1, "NaN"), (2, "Inf"), (3, "Inf"), (4, "Inf")]
    assert nonfinite_rows(logits[[0, 5]]) == []
    assert nonfinite_rows(logits[1]) == [(0, "NaN")]  # one row as a 1-D tensor (speculate's)
    assert nonfinite_rows(logits[0]) == []


def test_inf_appearing_in_decode_names_the_decode_step_and_the_row():
    model = make_model()
    head = model.head.weight
    original = head.clone()

    def poison(row: int, token: int) -> None:  # once row 1 is prefilled, the head's weights turn Inf
        if row == 1:
            head.copy_(torch.full_like(head, float("inf")))

    with pytest.raises(NonFiniteError, match=r"prompt 0: the logits of step 1 \(decode step 1\)"):
        raise_nonfinite(generate(model, [[0, 5, 9], [0, 7]], 3, eos_id=1, ignore_eos=True, on_token=poison))
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
    for n in ("4", "0"):  # -n 0: the prompt alone, its logits checked all the same
        r = CLI.invoke(app, ["generate", "-m", str(ckpt), "-n", n, "--json"])
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


# ------------------------------------------------------------------ planted bad values: each kind of tensor

def plant(src, dst, name: str, index: tuple, value: float | int):
    """Copy checkpoint src to dst with one element of tensor `name` set to `value` (a float, or a raw byte for
    one-byte formats)."""
    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(shard)
        if name in tensors:
            t = tensors[name]
            if t.element_size() == 1:
                t.view(torch.uint8)[index] = value
            else:
                t[index] = value
            save_file(tensors, shard, metadata={"format": "pt"})
            return dst
    raise AssertionError(f"{name} not in {src}")


@pytest.fixture(scope="module")
def fp8_tiny(tmp_path_factory):
    from mhcrun.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("fp8") / "tiny-fp8", 0, True, False)


# (checkpoint, tensor, index, value, what check-weights says, the layer half generate names or None when the
# prompt's routes do not reach it)
PLANTED = [
    ("tiny", "layers.1.attn.wq_a.weight", (3, 5), float("nan"), "NaN/Inf (nan)", "layer 1 attn:csa"),
    ("tiny", "layers.2.attn.wkv.weight", (0, 1), float("inf"), "NaN/Inf (inf)", "layer 2 attn:hca"),
    ("tiny", "layers.0.ffn_norm.weight", (7,), float("nan"), "NaN/Inf (nan)", "layer 0 moe:hash"),
    ("tiny", "layers.2.attn.kv_norm.weight", (3,), float("inf"), "NaN/Inf (inf)", None),
    ("tiny", "layers.3.hc_ffn_fn", (2, 9), float("nan"), "NaN/Inf (nan)", "layer 3 moe:routed"),
    ("tiny", "layers.3.hc_attn_base", (5,), float("inf"), "NaN/Inf (inf)", None),  # saturates a sigmoid: finite
    ("fp8", "layers.1.attn.wq_b.weight", (4, 4), 0x7F, "an e4m3 NaN code (0x7f)", "layer 1 attn:csa"),
    ("fp8", "layers.2.attn.wo_b.weight", (1, 2), 0xFF, "an e4m3 NaN code (0xff)", "layer 2 attn:hca"),
    ("fp8", "layers.3.ffn.experts.5.w2.scale", (0, 1), 0xFF, "a NaN/Inf scale", None),
    ("fp8", "layers.1.ffn.experts.2.w1.scale", (3, 0), 0xFE, "overflows fp32", None),
]


@pytest.mark.parametrize("kind,name,index,value,what,half", PLANTED, ids=[p[1] for p in PLANTED])
def test_check_weights_names_each_planted_tensor(tmp_path, fp8_tiny, kind, name, index, value, what, half):
    ckpt = plant(DEFAULT_MODEL if kind == "tiny" else fp8_tiny, tmp_path / "bad", name, index, value)
    r = CLI.invoke(app, ["info", "-m", str(ckpt), "--check-weights"])
    assert r.exit_code == 3, r.stdout + r.stderr
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and f"{name}: " in line and what in line and str(list(index)) in line
    assert f"bad weight: {name}: " in r.stdout
    g = CLI.invoke(app, ["generate", "-m", str(ckpt), "--check-weights", "-n", "2", "--json"])
    assert g.exit_code == 3 and g.stdout == "" and name in g.stderr, g.stdout + g.stderr


@pytest.mark.parametrize("kind,name,index,value,what,half", [p for p in PLANTED if p[5]],
                         ids=[p[1] for p in PLANTED if p[5]])
def test_generate_names_the_layer_half_of_each_planted_value(tmp_path, fp8_tiny, kind, name, index, value, what,
                                                              half):
    ckpt = plant(DEFAULT_MODEL if kind == "tiny" else fp8_tiny, tmp_path / "bad", name, index, value)
    r = CLI.invoke(app, ["generate", "-m", str(ckpt), "-n", "3", "--json"])
    assert r.exit_code == 3 and r.stdout == "", r.stdout + r.stderr
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "the logits of step 0 (prefill)" in line, line
    assert f"; {half} produced " in line and "from finite inputs" in line, line


def test_an_expert_reached_by_one_route_only(tmp_path, random_tiny):
    """Layer 0 routes by token id (tid2eid): a NaN in one of its experts stays unseen by prompts whose tokens
    never route there, the weights check finds it anyway, and a prompt holding such a token names the half."""
    tid2eid = make_model().layers[0].ffn.gate.tid2eid
    token = 7
    expert = int(tid2eid[token, 0])
    clean = [t for t in range(2, 200) if expert not in tid2eid[t].tolist()][:4]
    ckpt = plant(random_tiny, tmp_path / "bad", f"layers.0.ffn.experts.{expert}.w1.weight", (1, 1), float("nan"))
    ok = CLI.invoke(app, ["generate", "-m", str(ckpt), "--prompt-ids", ",".join(map(str, [0] + clean)), "-n", "1"])
    assert ok.exit_code == 0, ok.stdout + ok.stderr
    found = CLI.invoke(app, ["info", "-m", str(ckpt), "--check-weights"])
    assert found.exit_code == 3 and f"layers.0.ffn.experts.{expert}.w1.weight" in found.stderr
    hit = CLI.invoke(app, ["generate", "-m", str(ckpt), "--prompt-ids", f"0,{clean[0]},{token}", "-n", "1"])
    assert hit.exit_code == 3 and "layer 0 moe:hash produced NaN from finite inputs" in hit.stderr, hit.stderr
    assert f"layers.0.ffn.experts.{expert}.w1" in hit.stderr


def test_clean_checkpoints_pass_the_weights_check(fp8_tiny):
    for ckpt in (DEFAULT_MODEL, fp8_tiny):
        r = CLI.invoke(app, ["info", "-m", str(ckpt), "--check-weights"])
        assert r.exit_code == 0, r.stdout + r.stderr
        assert "every tensor is finite, every scale in range" in r.stdout


def test_scan_kernel_equals_the_torch_reference():
    import shutil

    from mhcrun.ops import scan
    from mhcrun.settings import Env

    env = Env.read()
    lib = scan.open_scan(env)
    assert lib is not None or shutil.which(env.cxx) is None  # a broken build must not hide
    assert scan.open_scan(Env.read({"MHCRUN_CPU_KERNEL": "0"})) is None  # the torch reference only
    g = torch.Generator().manual_seed(0)
    cases = []
    for n in (1, 7, 65535, 65536, 65537, 200_003):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            t = torch.randn(n, generator=g).to(dtype)
            cases.append((t.clone(), "float", None))
            for i, v in ((n - 1, float("nan")), (n // 2, float("inf")), (0, float("-inf"))):
                bad = t.clone()
                bad[i] = v
                cases.append((bad, "float", None))
        codes = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0
        cases.append((codes.clone().view(torch.float8_e4m3fn), "codes", None))
        codes[n - 1] = 0xFF
        cases.append((codes.clone().view(torch.float8_e4m3fn), "codes", None))
        for fmt in ("fp8", "fp4"):
            top = scan.e8m0_top(fmt)
            s = torch.randint(100, top + 1, (n,), generator=g, dtype=torch.uint8)
            cases.append((s.clone().view(torch.float8_e8m0fnu), "scale", fmt))
            s[n // 3] = top + 1
            cases.append((s.clone().view(torch.float8_e8m0fnu), "scale", fmt))
    for t, role, fmt in cases:
        got = scan.first_bad(t, role, fmt, lib=lib)
        assert got == scan.first_bad_reference(t, role, fmt), (t.dtype, t.numel(), role)
    assert scan.e8m0_top("fp8") == 246 and scan.e8m0_top("fp4") == 252  # 448 * 2**119 and 6 * 2**125 are finite
    f = torch.tensor([1.0, 2.0 ** 120, float("nan")])
    assert scan.first_bad_reference(f, "scale", "fp8") == 1 and scan.first_bad_reference(f[:1], "scale", "fp8") == -1


def test_a_compiled_region_that_turns_non_finite_is_named(monkeypatch):
    """Eager prefill stays finite; the compiled decode of layer 2's MoE half puts out a NaN: the decode step and
    that region are named."""
    from mhcrun.regions import runner

    original = runner.RegionDecoder.run

    def poisoned(self, kind, fn, module, *args):
        out = original(self, kind, fn, module, *args)
        if module is self.model.layers[2] and kind.startswith("moe"):  # layer 2's MoE half, compiled path only
            y = out.y.clone()  # its output: the MoE's, handed on with the post step to do
            y[..., 0] = float("nan")
            out = out._replace(y=y)
        return out

    monkeypatch.setattr(runner.RegionDecoder, "run", poisoned)
    with pytest.raises(NonFiniteError) as e:
        raise_nonfinite(generate(make_model(), [[0, 5, 9]], 4, eos_id=1, graph_mode="regions", backend="aot_eager"))
    assert str(e.value).startswith("prompt 0: the logits of step 1 (decode step 1) hold NaN; "
                                   "layer 2 moe:routed produced NaN from finite inputs;"), str(e.value)


def test_golden_check_reports_non_finite_as_its_own_status(tmp_path):
    ckpt = plant(DEFAULT_MODEL, tmp_path / "bad", "layers.3.attn.wq_a.weight", (0, 0), float("nan"))
    r = CLI.invoke(app, ["golden-check", "tests/golden/tiny.json", "-m", str(ckpt), "--force", "--json"])
    assert r.exit_code == 3, r.stdout + r.stderr
    import json

    report = json.loads(r.stdout)
    assert {p["status"] for p in report["prompts"]} == {"non-finite"} and not report["ok"]
    assert "layer 3 attn:csa produced NaN" in report["prompts"][0]["note"]
    t = CLI.invoke(app, ["golden-check", "tests/golden/tiny.json", "-m", str(ckpt), "--force"])
    assert t.exit_code == 3 and "non-finite" in t.stdout, t.stdout
