"""The random tiny model (`make-tiny`): random weights of the V4 architecture, scaled so greedy decoding is
decisive (the bundled model in `data/tiny` is a trained one, written by `tools/train_tiny.py`).

`make_tiny` writes a DeepSeek-layout checkpoint (config.json, index, >= 2 shards, tokenizer.json);
with `fp8=True` the linears are stored FP8 e4m3 with e8m0 block scales and the routed experts FP4.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

import torch

from mhcrun.config import ModelConfig, config_from_hf
from mhcrun.ops.quant import quantize_weight_fp4, quantize_weight_fp8
from mhcrun.weights import mtp_tensor_specs, scale_name, stored_format, tensor_specs

HEAD_GAIN = 4.0  # logit scale of the head; sets the greedy top-1/top-2 margins
FP8_BLOCK = 32  # the tiny model's widths (64, 128) are below DeepSeek's 128, so its FP8 blocks are 32


def tiny_config_raw() -> dict:
    """The random tiny model's config (`data/tiny_random_config.json`)."""
    return json.loads(resources.files("mhcrun").joinpath("data/tiny_random_config.json").read_text())


def init_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    """A random value for one checkpoint tensor, by its role."""

    def randn(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    n = cfg.hc_mult
    if name == "embed.weight":
        return randn(1.0)
    if name == "head.weight":
        return randn(HEAD_GAIN / math.sqrt(shape[1]))
    if name.endswith("norm.weight"):
        return 1.0 + randn(0.1)
    if name.endswith("_fn"):  # mHC mixes: small, so the base dominates
        return randn(0.5 / math.sqrt(shape[1]))
    if name.endswith("hc_head_base"):
        return randn(0.5)
    if name.endswith("_base"):
        base = randn(0.5)
        base[2 * n:] += 2.0 * torch.eye(n).flatten()  # comb leans to identity: streams mostly keep
        return base
    if name.endswith("_scale"):
        return 1.0 + randn(0.1).abs()
    if name.endswith("attn_sink"):
        return randn(1.0)
    if name.endswith("ape"):
        return randn(0.5)
    if name.endswith("gate.bias"):
        return randn(0.1)
    if name.endswith("gate.tid2eid"):
        rows = [torch.randperm(cfg.n_routed_experts, generator=g)[: shape[1]] for _ in range(shape[0])]
        return torch.stack(rows).to(torch.int32)
    return randn(1.0 / math.sqrt(shape[-1]))  # a linear [out, in]


def init_tensors(cfg: ModelConfig, seed: int = 0, fp8: bool = False) -> dict[str, torch.Tensor]:
    """All checkpoint tensors for `cfg` (its MTP layers' last): bf16 weights (fp32 for the tensors the release
    keeps in fp32); with fp8, the FP8 linears / FP4 experts (plus scales) that `cfg` asks for."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for spec in tensor_specs(cfg) + mtp_tensor_specs(cfg):
        t = init_tensor(spec.name, spec.shape, cfg, g)
        fmt = stored_format(cfg, spec) if fp8 else spec.kind
        if fmt == "fp8":
            out[spec.name], out[scale_name(spec.name)] = quantize_weight_fp8(t, cfg.weight_block_size)
        elif fmt == "fp4":
            out[spec.name], out[scale_name(spec.name)] = quantize_weight_fp4(t, 32)
        else:
            out[spec.name] = release_tensor(spec.name, t)
    return out


def release_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    """An unquantised tensor in the release's dtype: int32 tables as they are, fp32 for the mHC parameters,
    sinks, ape and gate bias, bf16 otherwise."""
    if t.dtype in (torch.int32, torch.int64):
        return t.to(torch.int32)
    if name.startswith("hc_") or ".hc_" in name or name.endswith(("attn_sink", "ape", "gate.bias")):
        return t.float()
    return t.to(torch.bfloat16)


def fp8_variant(raw: dict) -> dict:
    """The config of the FP8-linear / FP4-expert variant."""
    raw = dict(raw)
    raw["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "scale_fmt": "ue8m0", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    raw["expert_dtype"] = "fp4"
    return raw


def make_tiny(out_dir: str | Path, seed: int = 0, fp8: bool = False, force: bool = False, mtp: bool = False,
              max_positions: int | None = None) -> Path:
    """Write the tiny checkpoint (2 shards + index + tokenizer.json) to out_dir. `mtp`: with a random MTP layer
    (`mtp.0.*`, a CSA layer: its compressor and indexer state are rolled back too), for speculative decoding.
    `max_positions`: its config's max_position_embeddings instead of 512 (the same weights: for long prompts)."""
    from mhcrun.checkpoint import write_checkpoint
    from mhcrun.tokenizer import build_tiny_tokenizer

    raw = tiny_config_raw()
    if max_positions is not None:
        raw["max_position_embeddings"] = max_positions
    if mtp:
        raw["num_nextn_predict_layers"] = 1
        raw["compress_ratios"] = [*raw["compress_ratios"], 4]
    if fp8:
        raw = fp8_variant(raw)
    cfg = config_from_hf(raw)
    corpus = resources.files("mhcrun").joinpath("data/tiny_corpus.txt").read_text()
    tok = build_tiny_tokenizer(corpus, cfg.vocab_size)
    tensors = init_tensors(cfg, seed, fp8)
    return write_checkpoint(out_dir, raw, tensors, n_shards=2, extra_files={"tokenizer.json": tok.to_str()},
                            force=force)
