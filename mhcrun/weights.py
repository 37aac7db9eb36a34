"""The tensors a V4 checkpoint must hold for a config: names (DeepSeek's inference names), shapes, kinds, splits.

This table is the one description of the weights: checkpoint checking and loading, the memory plan, `--tp`
sharing and `model.build_model` (which places each tensor where its name says, in the dtype it runs in)
are derived from it.

Kinds:
- "float":  an unquantised float tensor (bf16 or fp32 in the release; any float dtype accepted).
- "linear": a linear weight [out, in]; FP8 e4m3 with a block `.scale` when the config is quantised.
- "expert": a routed-expert weight [out, in]; FP4 (int8-packed) or FP8 per `expert_dtype`, else as "linear".
- "index":  an integer table (`tid2eid`).
`run` says which dtype the model runs it in. `act_quant` says whether DeepSeek's reference quantises the
activation to FP8 before this GEMM when the weight is quantised (wo_a is dequantised to bf16 by the reference's
converter, so it is not). `split` and `expert` say how `--tp` shares it out, as DeepSeek's reference does
(`mhcrun.parallel`): attention heads (wq_b rows, attn_sink), o_groups (wo_a rows, wo_b columns), index heads
(wq_b, weights_proj), vocabulary rows (embed, head), routed experts in contiguous blocks; everything else replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from mhcrun.config import ModelConfig


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str = "float"
    act_quant: bool = True
    split: int | None = None  # under --tp: the dimension split across ranks (0 rows, 1 columns), else replicated
    expert: int | None = None  # a routed expert's weight: the expert (each rank holds a contiguous block)
    run: str = "act"  # its dtype at run time: "act" (the activation dtype), "fp32" (DeepSeek's reference keeps
    # it in fp32 whatever the activation dtype), "stored" (GEMM operands kept as stored, bf16 in the release, and
    # multiplied in fp32: the vocabulary-sized tensors and the compressors' projections, which DeepSeek's reference
    # keeps in fp32, exactly the bf16 values; fp32 when converted), "int64" (index tables); a weight dequantised at
    # load takes `dequantized_dtype`


def layer_tensor_specs(cfg: ModelConfig, i: int, prefix: str | None = None) -> list[TensorSpec]:
    """Layer i's tensors, named `layers.{i}.*` (or `prefix` + the same leaves: an MTP layer)."""
    d, n = cfg.dim, cfg.hc_mult
    hd, H, G = cfg.head_dim, cfg.n_heads, cfg.o_groups
    p = f"layers.{i}." if prefix is None else prefix
    specs = [
        TensorSpec(p + "attn_norm.weight", (d,), run="fp32"),
        TensorSpec(p + "ffn_norm.weight", (d,), run="fp32"),
    ]
    for site in ("attn", "ffn"):
        specs += [
            TensorSpec(p + f"hc_{site}_fn", (cfg.mix_hc, n * d), run="fp32"),
            TensorSpec(p + f"hc_{site}_base", (cfg.mix_hc,), run="fp32"),
            TensorSpec(p + f"hc_{site}_scale", (3,), run="fp32"),
        ]
    a = p + "attn."
    specs += [
        TensorSpec(a + "wq_a.weight", (cfg.q_lora_rank, d), "linear"),
        TensorSpec(a + "q_norm.weight", (cfg.q_lora_rank,), run="fp32"),
        TensorSpec(a + "wq_b.weight", (H * hd, cfg.q_lora_rank), "linear", split=0),  # heads
        TensorSpec(a + "wkv.weight", (hd, d), "linear"),
        TensorSpec(a + "kv_norm.weight", (hd,), run="fp32"),
        TensorSpec(a + "wo_a.weight", (G * cfg.o_lora_rank, H * hd // G), "linear", act_quant=False,
                   split=0),  # o_groups
        TensorSpec(a + "wo_b.weight", (d, G * cfg.o_lora_rank), "linear", split=1),  # o_groups, then all-reduce
        TensorSpec(a + "attn_sink", (H,), split=0, run="fp32"),
    ]
    ratio = cfg.compress_ratios[i]
    if ratio:
        specs += compressor_specs(a + "compressor.", d, ratio, hd)
    if ratio == 4:
        ihd = cfg.index_head_dim
        specs += [
            TensorSpec(a + "indexer.wq_b.weight", (cfg.index_n_heads * ihd, cfg.q_lora_rank), "linear", split=0),
            TensorSpec(a + "indexer.weights_proj.weight", (cfg.index_n_heads, d), split=0),  # index heads
        ]
        specs += compressor_specs(a + "indexer.compressor.", d, ratio, ihd)
    f = p + "ffn."
    specs.append(TensorSpec(f + "gate.weight", (cfg.n_routed_experts, d), run="fp32"))
    if i < cfg.n_hash_layers:
        specs.append(TensorSpec(f + "gate.tid2eid", (cfg.vocab_size, cfg.n_activated_experts), "index",
                                run="int64"))
    else:
        specs.append(TensorSpec(f + "gate.bias", (cfg.n_routed_experts,), run="fp32"))
    for e in range(cfg.n_routed_experts):
        specs += expert_specs(f + f"experts.{e}.", d, cfg.moe_inter_dim, "expert", e)
    specs += expert_specs(f + "shared_experts.", d, cfg.moe_inter_dim, "linear")
    return specs


def compressor_specs(prefix: str, dim: int, ratio: int, head_dim: int) -> list[TensorSpec]:
    c = 2 if ratio == 4 else 1  # the 4:1 compressor overlaps two groups
    return [
        TensorSpec(prefix + "ape", (ratio, c * head_dim), run="fp32"),
        TensorSpec(prefix + "wkv.weight", (c * head_dim, dim), run="stored"),  # fp32 math on the stored values
        TensorSpec(prefix + "wgate.weight", (c * head_dim, dim), run="stored"),
        TensorSpec(prefix + "norm.weight", (head_dim,), run="fp32"),
    ]


def expert_specs(prefix: str, dim: int, inter: int, kind: str, expert: int | None = None) -> list[TensorSpec]:
    return [
        TensorSpec(prefix + "w1.weight", (inter, dim), kind, expert=expert),
        TensorSpec(prefix + "w2.weight", (dim, inter), kind, expert=expert),
        TensorSpec(prefix + "w3.weight", (inter, dim), kind, expert=expert),
    ]


def tensor_specs(cfg: ModelConfig, n_layers: int | None = None) -> list[TensorSpec]:
    """Every tensor generation needs, in a stable order (model-level first, then layer by layer)."""
    d, n = cfg.dim, cfg.hc_mult
    specs = [
        TensorSpec("embed.weight", (cfg.vocab_size, d), split=0, run="stored"),  # vocabulary rows, then all-reduce
        TensorSpec("head.weight", (cfg.vocab_size, d), split=0, run="stored"),  # vocabulary rows, then gathered
        TensorSpec("norm.weight", (d,), run="fp32"),
        TensorSpec("hc_head_fn", (n, n * d), run="fp32"),
        TensorSpec("hc_head_base", (n,), run="fp32"),
        TensorSpec("hc_head_scale", (1,), run="fp32"),
    ]
    for i in range(cfg.n_layers if n_layers is None else n_layers):
        specs += layer_tensor_specs(cfg, i)
    return specs


def mtp_tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """The MTP layers' tensors (`num_nextn_predict_layers`; loaded for speculative decoding only), as
    DeepSeek's reference lays them out (`MTPBlock` in `inference/model.py`): MTP layer k is a V4 block of layer
    id n_layers + k (its attention kind `compress_ratios[n_layers + k]`, routed MoE) named `mtp.{k}.*`, plus
    `e_proj` and `h_proj` (linears [d, d]: the next token's normed embedding and the normed hc streams), their
    norms `enorm` and `hnorm`, and its own head collapse (`hc_head_*`) and final `norm`; the embedding and the
    head are the model's."""
    d, n = cfg.dim, cfg.hc_mult
    specs = []
    for k in range(cfg.n_mtp_layers):
        p = f"mtp.{k}."
        specs += layer_tensor_specs(cfg, cfg.n_layers + k, p)
        specs += [
            TensorSpec(p + "e_proj.weight", (d, d), "linear"),
            TensorSpec(p + "h_proj.weight", (d, d), "linear"),
            TensorSpec(p + "enorm.weight", (d,), run="fp32"),
            TensorSpec(p + "hnorm.weight", (d,), run="fp32"),
            TensorSpec(p + "norm.weight", (d,), run="fp32"),
            TensorSpec(p + "hc_head_fn", (n, n * d), run="fp32"),
            TensorSpec(p + "hc_head_base", (n,), run="fp32"),
            TensorSpec(p + "hc_head_scale", (1,), run="fp32"),
        ]
    return specs


def block_size(cfg: ModelConfig, fmt: str) -> int:
    """A quantised weight's block: the config's square FP8 tile, or FP4_BLOCK inputs of a row (FP4)."""
    from mhcrun.ops.quant import FP4_BLOCK

    return cfg.weight_block_size if fmt == "fp8" else FP4_BLOCK


def scale_shape(cfg: ModelConfig, spec: TensorSpec, fmt: str) -> tuple[int, int]:
    """The stored scale of a quantised weight [out, in]: one per block x block tile (FP8), or per FP4_BLOCK
    inputs of a row (FP4)."""
    out, inner = spec.shape
    b = block_size(cfg, fmt)
    return (-(-out // b), -(-inner // b)) if fmt == "fp8" else (out, -(-inner // b))


def spec_table(cfg: ModelConfig, n_layers: int | None = None) -> dict[str, TensorSpec]:
    """tensor_specs by name."""
    return {s.name: s for s in tensor_specs(cfg, n_layers)}


def dequantized_dtype(spec: TensorSpec, dtype):
    """The dtype a quantised weight takes when dequantised at load: fp32, except the one DeepSeek's converter
    dequantises to the activation dtype (act_quant False: wo_a), which keeps `dtype`."""
    import torch

    return torch.float32 if spec.act_quant else dtype


def scale_name(weight_name: str) -> str:
    """`layers.0.attn.wq_a.weight` -> `layers.0.attn.wq_a.scale` (DeepSeek's naming)."""
    return weight_name[: -len("weight")] + "scale"


def stored_format(cfg: ModelConfig, spec: TensorSpec) -> str:
    """How the tensor is stored for this config: 'float', 'fp8', 'fp4' or 'index'."""
    if spec.kind == "linear":
        return "fp8" if cfg.quant_method == "fp8" else "float"
    if spec.kind == "expert":
        if cfg.expert_dtype in ("fp4", "fp8"):
            return cfg.expert_dtype
        return "fp8" if cfg.quant_method == "fp8" else "float"
    return spec.kind
