"""Write an mhcrun checkpoint as a GGUF for ik_llama.cpp's DeepSeek V4 loader (`deepseek4`), holding the same values.

    python benchmarks/export_gguf.py CHECKPOINT OUT.gguf [--force]     # needs `pip install gguf`
    python benchmarks/export_gguf.py CHECKPOINT OUT.gguf --check       # read it back: every value equal

For the side-by-side benchmark (benchmarks/bench_cpu_peer.py, docs/cpu-peer.md): the peer must compute with the
same weights. So nothing is rounded on the way:
- FP8 weights (e4m3, one power-of-two scale per 128 x 128 tile) become bf16: e4m3 times a power of two has at most
  4 significant bits and an exponent inside bf16's range, so the bf16 value is the dequantised value exactly
  (checked per tensor);
- FP4 routed experts (e2m1 codes, one e8m0 scale per 32 inputs) become MXFP4, ggml's block of the same 32 codes
  and the same scale byte (`[e, 16 bytes]`: element j in byte j's low nibble, element j + 16 in its high one);
  the experts of a layer are stacked into one `[experts, out, in]` tensor as ggml's MoE wants;
- bf16 and fp32 tensors keep their type, except 1-D ones (norms, biases, sinks, mixes), which become fp32
  (exact); the hash layers' token -> expert table stays int32.

Tensor and key names are those ik_llama.cpp's DeepSeek V4 loader reads (`create_deepseek4_tensors`, `deepseek4`
hyper-parameters); the vocabulary is placeholder tokens (`<t{id}>`: token ids are what the benchmark feeds, the
text does not matter). Layers only: the MTP layer is not exported (the peer's benchmark does not draft).
`--check` reads the file back with the `gguf` package, dequantises every tensor and compares it bit for bit with
mhcrun's own dequantised reference of the checkpoint (`load_checkpoint(..., dequantize=True)`).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from mhcrun.checkpoint import load_checkpoint
from mhcrun.config import ModelConfig
from mhcrun.errors import InputError, run_script
from mhcrun.fileio import check_writable
from mhcrun.ops.quant import dequantize_fp8
from mhcrun.ops.qweight import QWeight

ARCH = "deepseek4"
SQRT_SOFTPLUS = 4  # ik_llama.cpp's LLM_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS, the only scoring its V4 loader takes

# mhcrun tensor name (after `layers.N.`) -> GGUF name (after `blk.N.`); `{w}` stands for an expert's w1/w2/w3
LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "hc_attn_fn": "hc_attn_fn.weight",
    "hc_attn_base": "hc_attn_base.weight",
    "hc_attn_scale": "hc_attn_scale.weight",
    "hc_ffn_fn": "hc_ffn_fn.weight",
    "hc_ffn_base": "hc_ffn_base.weight",
    "hc_ffn_scale": "hc_ffn_scale.weight",
    "attn.attn_sink": "attn_sinks.weight",
    "attn.wq_a.weight": "attn_q_a.weight",
    "attn.q_norm.weight": "attn_q_a_norm.weight",
    "attn.wq_b.weight": "attn_q_b.weight",
    "attn.wkv.weight": "attn_kv.weight",
    "attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "attn.wo_a.weight": "attn_output_a.weight",
    "attn.wo_b.weight": "attn_output_b.weight",
    "attn.compressor.wkv.weight": "attn_compressor_kv.weight",
    "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
    "attn.compressor.ape": "attn_compressor_ape.weight",
    "attn.compressor.norm.weight": "attn_compressor_norm.weight",
    "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv.weight",
    "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate.weight",
    "attn.indexer.compressor.ape": "indexer_compressor_ape.weight",
    "attn.indexer.compressor.norm.weight": "indexer_compressor_norm.weight",
    "ffn.gate.weight": "ffn_gate_inp.weight",
    "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight",
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight",
    "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
    "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
}
EXPERT_NAMES = {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight", "w3": "ffn_up_exps.weight"}
ROOT_NAMES = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "head.weight": "output.weight",
    "hc_head_fn": "output_hc_fn.weight",
    "hc_head_base": "output_hc_base.weight",
    "hc_head_scale": "output_hc_scale.weight",
}
_EXPERT = re.compile(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)$")


def gguf_name(name: str) -> str:
    """The GGUF name of a (non-expert) mhcrun tensor; InputError naming it if the loader has none."""
    if name in ROOT_NAMES:
        return ROOT_NAMES[name]
    m = _LAYER.match(name)
    if m is None or m.group(2) not in LAYER_NAMES:
        raise InputError(f"{name}: no GGUF name for this tensor in ik_llama.cpp's DeepSeek V4 layout")
    return f"blk.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"


def mxfp4_blocks(w: QWeight) -> np.ndarray:
    """An FP4 weight (packed e2m1 [out, in/2], low nibble first; e8m0 scale [out, in/32]) -> ggml MXFP4 bytes
    [out, in/32 * 17]: per 32 inputs the scale byte, then 16 bytes holding element j (low) and j + 16 (high)."""
    packed = w.data.view(torch.uint8)
    out = packed.shape[0]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(out, -1, 32)  # [out, in/32, 32]
    qs = codes[..., :16] | (codes[..., 16:] << 4)  # [out, in/32, 16]
    e = w.scale.view(torch.uint8).reshape(out, -1, 1)
    if e.shape[1] != qs.shape[1]:
        raise InputError(f"FP4 scale shape {list(w.scale.shape)} does not give one scale per 32 inputs")
    return torch.cat([e, qs], dim=-1).reshape(out, -1).numpy()


def as_bf16(t: torch.Tensor, name: str) -> np.ndarray:
    """fp32/bf16 -> bf16 bytes as uint16, refusing any value bf16 cannot hold exactly."""
    b = t.to(torch.bfloat16)
    if not torch.equal(b.float(), t.float()):
        raise InputError(f"{name}: a value is not exact in bf16")
    return b.view(torch.uint16).numpy()


def split_experts(tensors: dict) -> tuple[dict, dict[tuple[int, str], list]]:
    """A checkpoint's tensors -> (the others by name, the routed experts' (name, tensor) by (layer, w1/w2/w3), in
    expert order)."""
    others, experts = {}, {}
    for name, t in tensors.items():
        if (m := _EXPERT.match(name)) is not None:
            experts.setdefault((int(m.group(1)), m.group(3)), []).append((name, t))
        else:
            others[name] = t
    return others, experts


def exported(cfg: ModelConfig, tensors: dict[str, torch.Tensor | QWeight]) -> Iterator[tuple[str, np.ndarray, str]]:
    """(GGUF name, array, GGML type name) for every tensor, experts stacked per layer and projection."""
    others, experts = split_experts(tensors)
    for name, t in (pair for stack in experts.values() for pair in stack):
        if not isinstance(t, QWeight) or t.fmt != "fp4":
            raise InputError(f"{name}: routed experts must be FP4 to export as MXFP4")
    for name, t in others.items():
        out = gguf_name(name)
        if isinstance(t, QWeight):
            if t.fmt != "fp8":
                raise InputError(f"{name}: only FP8 projections and FP4 experts are exported, not {t.fmt}")
            yield out, as_bf16(dequantize_fp8(t.data, t.scale, t.block), name), "BF16"
        elif t.dtype in (torch.int32, torch.int64):
            yield out, t.to(torch.int32).numpy(), "I32"
        elif t.dim() == 1 or t.dtype == torch.float32:
            yield out, t.float().numpy(), "F32"
        else:
            yield out, as_bf16(t, name), "BF16"
    for (layer, w), stack in sorted(experts.items()):
        if len(stack) != cfg.n_routed_experts:
            raise InputError(f"layers.{layer}: {len(stack)} {w} experts, expected {cfg.n_routed_experts}")
        yield f"blk.{layer}.{EXPERT_NAMES[w]}", np.stack([mxfp4_blocks(q) for _, q in stack]), "MXFP4"


def add_metadata(writer, cfg: ModelConfig) -> None:  # noqa: ANN001 (gguf.GGUFWriter, imported late)
    """The hyper-parameters ik_llama.cpp's `deepseek4` loader reads, and a placeholder vocabulary."""
    k = f"{ARCH}."
    n = cfg.n_layers
    u32 = {
        "block_count": n, "context_length": cfg.max_position_embeddings, "embedding_length": cfg.dim,
        "feed_forward_length": cfg.moe_inter_dim, "attention.head_count": cfg.n_heads,
        "attention.head_count_kv": 1, "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        "attention.q_lora_rank": cfg.q_lora_rank, "attention.kv_lora_rank": cfg.head_dim,
        "attention.output_group_count": cfg.o_groups, "attention.output_lora_rank": cfg.o_lora_rank,
        "attention.sliding_window": cfg.window_size, "attention.indexer.head_count": cfg.index_n_heads,
        "attention.indexer.key_length": cfg.index_head_dim, "attention.indexer.top_k": cfg.index_topk,
        "rope.dimension_count": cfg.rope_head_dim, "expert_count": cfg.n_routed_experts,
        "expert_used_count": cfg.n_activated_experts, "expert_shared_count": cfg.n_shared_experts,
        "expert_feed_forward_length": cfg.moe_inter_dim, "leading_dense_block_count": 0,
        "expert_gating_func": SQRT_SOFTPLUS, "hash_layer_count": cfg.n_hash_layers, "nextn_predict_layers": 0,
        "hyper_connection.count": cfg.hc_mult, "hyper_connection.sinkhorn_iterations": cfg.hc_sinkhorn_iters,
        "vocab_size": cfg.vocab_size,
    }
    for key, v in u32.items():
        writer.add_uint32(k + key, int(v))
    f32 = {
        "attention.layer_norm_rms_epsilon": cfg.norm_eps, "rope.freq_base": cfg.rope_theta,
        "attention.compress_rope_freq_base": cfg.compress_rope_theta, "expert_weights_scale": cfg.route_scale,
        "hyper_connection.epsilon": cfg.hc_eps,
    }
    for key, v in f32.items():
        writer.add_float32(k + key, float(v))
    writer.add_bool(k + "expert_weights_norm", True)
    writer.add_array(k + "attention.compress_ratios", [int(r) for r in cfg.compress_ratios[:n]])
    writer.add_array(k + "swiglu_clamp_exp", [float(cfg.swiglu_limit)] * n)
    writer.add_array(k + "swiglu_clamp_shexp", [float(cfg.swiglu_limit)] * n)
    if cfg.original_seq_len > 0:  # YaRN on the compressed layers
        writer.add_string(k + "rope.scaling.type", "yarn")
        writer.add_float32(k + "rope.scaling.factor", float(cfg.rope_factor))
        writer.add_uint32(k + "rope.scaling.original_context_length", cfg.original_seq_len)
        writer.add_float32(k + "rope.scaling.yarn_beta_fast", float(cfg.beta_fast))
        writer.add_float32(k + "rope.scaling.yarn_beta_slow", float(cfg.beta_slow))
    # placeholder vocabulary: control tokens for BOS/EOS, the 256 byte tokens a SentencePiece vocabulary expects,
    # then one token per remaining id
    special = {cfg.bos_token_id: "<s>", cfg.eos_token_id: "</s>"}
    tokens, types = [], []
    byte = 0
    for i in range(cfg.vocab_size):
        if i in special:
            tokens.append(special[i])
            types.append(3)  # control
        elif byte < 256:
            tokens.append(f"<0x{byte:02X}>")
            types.append(6)  # byte
            byte += 1
        else:
            tokens.append(f"<t{i}>")
            types.append(1)  # normal
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.scores", [0.0] * cfg.vocab_size)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_uint32("tokenizer.ggml.bos_token_id", cfg.bos_token_id)
    writer.add_uint32("tokenizer.ggml.eos_token_id", cfg.eos_token_id)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)


def import_gguf():  # noqa: ANN201
    try:
        import gguf
    except ImportError:
        raise InputError("writing or reading a GGUF needs the gguf package: pip install gguf") from None
    return gguf


def export(checkpoint: Path, out: Path, force: bool = False) -> int:
    """Write `checkpoint`'s layers to `out` (atomically: a temp file renamed); returns the tensor count."""
    gguf = import_gguf()
    check_writable(out, force)
    ck = load_checkpoint(checkpoint)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, ARCH)
    try:
        add_metadata(writer, ck.config)
        count = 0
        for name, array, kind in exported(ck.config, ck.tensors):
            writer.add_tensor(name, array, raw_dtype=gguf.GGMLQuantizationType[kind])
            count += 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return count


def check(checkpoint: Path, out: Path) -> int:
    """Read `out` back and compare every tensor, dequantised, with mhcrun's fp32 reference of `checkpoint`;
    InputError naming the first tensor that differs. Returns the number of tensors compared."""
    gguf = import_gguf()
    from gguf.quants import dequantize

    ref = load_checkpoint(checkpoint, dequantize=True)
    reader = gguf.GGUFReader(str(out))
    stored = {t.name: t for t in reader.tensors}
    others, experts = split_experts(ref.tensors)
    want = {gguf_name(name): t for name, t in others.items()}
    for (layer, w), stack in experts.items():
        want[f"blk.{layer}.{EXPERT_NAMES[w]}"] = torch.stack([t for _, t in stack])
    if set(stored) != set(want):
        raise InputError(f"{out}: tensors differ from the checkpoint's: {sorted(set(stored) ^ set(want))[:5]}")
    for name, t in want.items():
        g = stored[name]
        shape = tuple(int(d) for d in reversed(g.shape.tolist()))  # GGUF lists dims innermost first
        if g.tensor_type == gguf.GGMLQuantizationType.I32:
            same = torch.equal(torch.from_numpy(g.data.view(np.int32).reshape(shape).astype(np.int64)), t)
        else:
            values = np.asarray(dequantize(g.data, g.tensor_type), dtype=np.float32).reshape(shape)
            same = torch.equal(torch.from_numpy(values.copy()), t.float())
        if not same:
            raise InputError(f"{out}: {name} differs from the checkpoint's values")
    return len(want)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path, help="an mhcrun checkpoint directory (FP8 weights, FP4 experts)")
    ap.add_argument("out", type=Path, help="the GGUF file to write (or, with --check, to read back)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing OUT")
    ap.add_argument("--check", action="store_true", help="compare OUT's values with the checkpoint's; write nothing")
    args = ap.parse_args()
    if args.check:
        print(f"{args.out}: all {check(args.checkpoint, args.out)} tensors equal the checkpoint's values")
    else:
        print(f"{args.out}: {export(args.checkpoint, args.out, args.force)} tensors written")


if __name__ == "__main__":
    run_script(main)
