"""tools/train_tiny.py: a short training run writes a checkpoint in the released layout (MTP tensors included)
that mhcrun loads, and mhcrun's eager logits (quant simulation off) equal the training forward's."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from mhcrun.checkpoint import load_checkpoint
from mhcrun.config import config_from_hf
from mhcrun.model import build_model
from mhcrun.weights import mtp_tensor_specs

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [1, 5, 17, 70]  # 70 crosses the window (16), 17 CSA groups (> index_topk 6) and 4 HCA groups (16)


def load_trainer():
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "tools" / "train_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint from two training steps on 150 docstrings (vocabulary 512)."""
    T = load_trainer()
    out = tmp_path_factory.mktemp("train") / "tiny"
    assert T.main(["--out", str(out), "--steps", "2", "--batch", "2", "--seq", "72", "--max-docs", "150"]) == 0
    return T, out


def mhcrun_last_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    ck = load_checkpoint(path)
    model = build_model(ck.config, ck.tensors, ck.quantized, torch.float32)
    model.opts.quant_sim = False
    model.setup_caches(ids.size(0), ids.size(1))
    with torch.inference_mode():
        return model(ids, torch.arange(ids.size(0)), 0)


def test_checkpoint_layout_and_mtp_tensors(trained):
    T, out = trained
    raw = json.loads((out / "config.json").read_text())
    cfg = config_from_hf(raw)
    assert cfg.n_mtp_layers == 1 and len(cfg.compress_ratios) == cfg.n_layers + 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2 and (out / "tokenizer.json").is_file()
    want = {s.name for s in mtp_tensor_specs(cfg)}
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.enorm.weight", "mtp.0.hnorm.weight",
            "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight", "mtp.0.ffn.gate.bias"} <= want
    assert want <= set(index["weight_map"])
    stored = T.load_params(out, cfg)
    assert all(tuple(stored[s.name].shape) == s.shape for s in mtp_tensor_specs(cfg))
    assert stored["mtp.0.e_proj.weight"].shape == (cfg.dim, cfg.dim)
    assert stored["mtp.0.hc_head_fn"].shape == (cfg.hc_mult, cfg.hc_mult * cfg.dim)
    ck = load_checkpoint(out)  # mhcrun loads it and leaves the MTP layer out
    assert not any(n.startswith("mtp.") for n in ck.tensors) and ck.unused == []


def test_mhcrun_logits_equal_the_training_forward(trained):
    T, out = trained
    cfg = config_from_hf(json.loads((out / "config.json").read_text()))
    P = T.load_params(out, cfg)
    ids = torch.randint(3, cfg.vocab_size, (2, max(LENGTHS)), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 0
    for n in LENGTHS:
        with torch.no_grad():
            mine = T.forward(P, ids[:, :n], T.make_ctx(cfg, n))[0][:, -1]
        ref = mhcrun_last_logits(out, ids[:, :n])
        diff = (mine - ref).abs().max().item()
        assert diff < 1e-4 * max(1.0, ref.abs().max().item()), f"{n} tokens: logits differ by {diff}"


def test_the_comparison_sees_a_wrong_layer_kind(trained):
    """The tolerance refuses a forward that runs the HCA layer as a window layer."""
    T, out = trained
    cfg = config_from_hf(json.loads((out / "config.json").read_text()))
    P = T.load_params(out, cfg)
    ratios = list(cfg.compress_ratios)
    ratios[ratios.index(16)] = 0
    wrong = dataclasses.replace(cfg, compress_ratios=tuple(ratios))
    ids = torch.randint(3, cfg.vocab_size, (1, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = T.forward(P, ids, T.make_ctx(wrong, 70))[0][:, -1]
    ref = mhcrun_last_logits(out, ids)
    assert (mine - ref).abs().max().item() > 1e-2


def test_mtp_forward_shapes_and_gradient(trained):
    """The MTP layer takes the un-collapsed streams and the next token, and its loss reaches its own tensors."""
    T, out = trained
    cfg = config_from_hf(json.loads((out / "config.json").read_text()))
    P = {k: (v.requires_grad_(True) if v.is_floating_point() and not k.endswith("gate.bias") else v)
         for k, v in T.load_params(out, cfg).items()}
    ids = torch.randint(3, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    main, mtp, index = T.losses(P, ids, T.make_ctx(cfg, 32))
    mtp.backward()
    assert P["mtp.0.h_proj.weight"].grad.abs().sum() > 0 and P["mtp.0.e_proj.weight"].grad.abs().sum() > 0
    assert P["layers.3.attn.wq_a.weight"].grad.abs().sum() > 0  # through the streams into the main model
    assert index.item() >= 0 and torch.isfinite(main)
