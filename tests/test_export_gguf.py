"""benchmarks/export_gguf.py: an mhcrun checkpoint as a GGUF for ik_llama.cpp, with the same values."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mhcrun.errors import InputError
from mhcrun.ops.quant import dequantize_fp4
from mhcrun.synthetic import make_synthetic

gguf = pytest.importorskip("gguf")  # a test dependency (pyproject's [test] extra); absent only outside CI
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import export_gguf  # noqa: E402

MID = Path(__file__).resolve().parent.parent / "configs" / "v4-mid.json"
SMALL = dict(hidden_size=256, n_routed_experts=8, moe_intermediate_size=128, vocab_size=1024, q_lora_rank=128,
             o_lora_rank=64, num_attention_heads=4, head_dim=128, qk_rope_head_dim=64, index_n_heads=4,
             index_head_dim=64)
# the head's 6, 24 a layer (norms, mixes, attention, router, shared and routed experts), the compressor's 4 on
# layers 1-3 and the indexer's 6 on the CSA layers 1 and 3
N_TENSORS = 6 + 4 * 24 + 3 * 4 + 2 * 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """V4-mid's 4 layers (window, CSA, HCA, CSA; layer 0 hash-routed) at test width: FP8 projections, FP4
    experts."""
    d = tmp_path_factory.mktemp("config")
    (d / "config.json").write_text(json.dumps(json.loads(MID.read_text()) | SMALL))
    return make_synthetic(d, tmp_path_factory.mktemp("synth") / "ckpt", 4, seed=3)


@pytest.fixture(scope="module")
def exported(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "small.gguf"
    export_gguf.export(ckpt, out)
    return out


def test_values_equal_the_checkpoint(ckpt: Path, exported: Path) -> None:
    """Every tensor read back and dequantised equals mhcrun's fp32 reference of the checkpoint, bit for bit."""
    assert export_gguf.check(ckpt, exported) == len(gguf.GGUFReader(str(exported)).tensors) == N_TENSORS


def test_layout_is_the_peers(ckpt: Path, exported: Path) -> None:
    reader = gguf.GGUFReader(str(exported))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    q = gguf.GGMLQuantizationType
    for layer in range(4):
        for w in ("gate", "up", "down"):
            assert types[f"blk.{layer}.ffn_{w}_exps.weight"] == q.MXFP4.name
        assert types[f"blk.{layer}.attn_q_a.weight"] == q.BF16.name  # FP8 -> bf16
        assert types[f"blk.{layer}.attn_norm.weight"] == q.F32.name
    # GGUF dims innermost first: experts [in, out, experts]; compressor kv on layers 1-3, the indexer on CSA ones
    assert shapes["blk.1.ffn_gate_exps.weight"] == [256, 128, 8]
    assert shapes["blk.1.ffn_down_exps.weight"] == [128, 256, 8]
    assert "blk.0.attn_compressor_kv.weight" not in types
    assert {"blk.1.indexer.attn_q_b.weight", "blk.3.indexer.attn_q_b.weight"} <= types.keys()
    assert "blk.2.indexer.attn_q_b.weight" not in types and "blk.2.attn_compressor_kv.weight" in types
    assert types["blk.0.ffn_gate_tid2eid.weight"] == q.I32.name and "blk.0.exp_probs_b.bias" not in types
    assert "blk.1.exp_probs_b.bias" in types
    kv = {f.name: f for f in reader.fields.values()}
    assert kv["general.architecture"].contents() == "deepseek4"
    assert kv["deepseek4.attention.compress_ratios"].contents() == [0, 4, 128, 4]
    assert kv["deepseek4.expert_gating_func"].contents() == export_gguf.SQRT_SOFTPLUS
    assert kv["deepseek4.hash_layer_count"].contents() == 1
    assert len(kv["tokenizer.ggml.tokens"].contents()) == 1024


def test_mxfp4_blocks_are_ggmls() -> None:
    """Element j of a 32-block in byte j's low nibble and j + 16 in its high one, the scale byte first: gguf's own
    MXFP4 decoder reads the weight mhcrun's FP4 reference does, over every code and a range of scales."""
    from gguf.quants import dequantize

    codes = torch.arange(64, dtype=torch.uint8).reshape(2, 32) % 16  # every code, twice, in two rows
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)  # mhcrun: low nibble = element 2j
    packed = torch.cat([packed, packed.flip(-1)], dim=-1)  # [2, 32]: two 32-blocks a row
    scale = torch.tensor([[120, 127], [131, 1]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w = export_gguf.QWeight(packed, scale, 32)
    blocks = export_gguf.mxfp4_blocks(w)
    got = dequantize(blocks, gguf.GGMLQuantizationType.MXFP4).reshape(2, 64)
    assert torch.equal(torch.from_numpy(np.ascontiguousarray(got)), dequantize_fp4(packed, scale, 32))


def test_check_refuses_a_swapped_block(ckpt: Path, exported: Path, tmp_path: Path) -> None:
    """A GGUF whose MXFP4 halves are swapped (what a converter with the other nibble order writes) is refused,
    naming the tensor."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(exported.read_bytes())
    t = next(t for t in gguf.GGUFReader(str(bad)).tensors if t.name == "blk.2.ffn_up_exps.weight")
    with open(bad, "r+b") as f:
        f.seek(t.data_offset + 1)  # the first block's 16 code bytes, after its scale byte
        qs = np.frombuffer(f.read(16), dtype=np.uint8)
        f.seek(t.data_offset + 1)
        f.write(((qs >> 4) | (qs << 4)).astype(np.uint8).tobytes())
    with pytest.raises(InputError, match="blk.2.ffn_up_exps.weight differs"):
        export_gguf.check(ckpt, bad)


def test_refuses_to_overwrite(ckpt: Path, exported: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.gguf"
    out.write_bytes(b"keep")
    with pytest.raises(InputError, match="already exists"):
        export_gguf.export(ckpt, out)
    assert out.read_bytes() == b"keep"
    export_gguf.export(ckpt, out, force=True)
    assert out.read_bytes() == exported.read_bytes()  # same checkpoint, same bytes
    assert not list(tmp_path.glob(".*partial*"))


def test_names_a_tensor_it_cannot_place() -> None:
    with pytest.raises(InputError, match="layers.0.attn.wx.weight: no GGUF name"):
        export_gguf.gguf_name("layers.0.attn.wx.weight")
