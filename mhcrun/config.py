"""Model configuration: a checkpoint's HF-style config.json parsed into one validated dataclass.

Field names follow DeepSeek's inference `ModelArgs`; `from_hf` maps the released config.json keys
(`hidden_size`, `num_hidden_layers`, `rope_scaling`, `quantization_config`, ...) onto them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from mhcrun.errors import ConfigError, InputError
from mhcrun.fileio import read_json


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    q_lora_rank: int
    head_dim: int
    rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]  # one per layer, then one per MTP layer
    n_routed_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    n_hash_layers: int = 0
    n_shared_experts: int = 1
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.0
    swiglu_limit: float = 0.0
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 1.0
    original_seq_len: int = 0  # > 0 enables YaRN on compressed layers
    beta_fast: int = 32
    beta_slow: int = 1
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    weight_block_size: int = 128  # FP8 block (both axes) when the checkpoint is quantised
    scale_fmt: str | None = "ue8m0"  # power-of-two scales in the FP8 simulation
    quant_method: str | None = None  # "fp8" when linear weights are stored as float8_e4m3fn
    expert_dtype: str | None = None  # "fp4" or "fp8" for routed experts, None = like the linears
    n_mtp_layers: int = 0
    bos_token_id: int = 0
    eos_token_id: int = 1
    max_position_embeddings: int = 4096

    @property
    def mix_hc(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    def layer_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def layer_kind(self, layer: int) -> str:
        """'window', 'csa' or 'hca' for the attention half, by compress ratio."""
        r = self.compress_ratios[layer]
        return "window" if r == 0 else ("csa" if r == 4 else "hca")

    def moe_kind(self, layer: int) -> str:
        return "hash" if layer < self.n_hash_layers else "routed"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        return d

    def fingerprint(self) -> str:
        """A stable hash of the architecture (identifies the model a golden file belongs to)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# released config.json key -> ModelConfig field
HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "q_lora_rank": "q_lora_rank",
    "head_dim": "head_dim",
    "qk_rope_head_dim": "rope_head_dim",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "sliding_window": "window_size",
    "compress_ratios": "compress_ratios",
    "n_routed_experts": "n_routed_experts",
    "num_experts_per_tok": "n_activated_experts",
    "moe_intermediate_size": "moe_inter_dim",
    "num_hash_layers": "n_hash_layers",
    "n_shared_experts": "n_shared_experts",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "swiglu_limit": "swiglu_limit",
    "rms_norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "expert_dtype": "expert_dtype",
    "num_nextn_predict_layers": "n_mtp_layers",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "max_position_embeddings": "max_position_embeddings",
}
_REQUIRED = [
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "head_dim",
    "qk_rope_head_dim", "o_groups", "o_lora_rank", "sliding_window", "compress_ratios", "n_routed_experts",
    "num_experts_per_tok", "moe_intermediate_size",
]
_INT_FIELDS = {f.name for f in fields(ModelConfig) if f.type in ("int",)}
_FLOAT_FIELDS = {f.name for f in fields(ModelConfig) if f.type in ("float",)}


def hf_key(field_name: str) -> str:
    """The config.json key of a ModelConfig field (for error messages)."""
    if field_name == "rope_factor":
        return "rope_scaling.factor"
    if field_name == "original_seq_len":
        return "rope_scaling.original_max_position_embeddings"
    if field_name == "weight_block_size":
        return "quantization_config.weight_block_size"
    return next((k for k, v in HF_KEYS.items() if v == field_name), field_name)


def _check_type(where: str, key: str, value: Any, kind: type) -> Any:
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: '{key}' must be an integer, got {value!r}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: '{key}' must be a number, got {value!r}")
        value = float(value)
    return value


def config_from_hf(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Map and validate a released-style config dict; raise ConfigError naming the key and file."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object at the top level")
    if raw.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise ConfigError(f"{where}: model_type is {raw['model_type']!r}, mhcrun runs 'deepseek_v4'")
    missing = [k for k in _REQUIRED if raw.get(k) is None]
    if missing:
        raise ConfigError(f"{where}: missing required key(s): {', '.join(missing)}")
    kw: dict[str, Any] = {}
    for key, name in HF_KEYS.items():
        if key not in raw or (raw[key] is None and name != "expert_dtype"):
            continue
        value = raw[key]
        if name in _INT_FIELDS:
            value = _check_type(where, key, value, int)
        elif name in _FLOAT_FIELDS:
            value = _check_type(where, key, value, float)
        kw[name] = value

    ratios = kw["compress_ratios"]
    if not isinstance(ratios, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ratios):
        raise ConfigError(f"{where}: 'compress_ratios' must be a list of integers")
    kw["compress_ratios"] = tuple(ratios)

    rs = raw.get("rope_scaling")
    if rs is not None:
        if not isinstance(rs, dict):
            raise ConfigError(f"{where}: 'rope_scaling' must be an object")
        if rs.get("type", rs.get("rope_type", "yarn")) != "yarn":
            raise ConfigError(f"{where}: rope_scaling type {rs.get('type')!r} is not supported (only 'yarn')")
        for key, name, kind in [("factor", "rope_factor", float), ("beta_fast", "beta_fast", int),
                                ("beta_slow", "beta_slow", int),
                                ("original_max_position_embeddings", "original_seq_len", int)]:
            if key in rs:
                kw[name] = _check_type(where, f"rope_scaling.{key}", rs[key], kind)

    qc = raw.get("quantization_config")
    if qc is not None:
        if not isinstance(qc, dict):
            raise ConfigError(f"{where}: 'quantization_config' must be an object")
        method = qc.get("quant_method")
        if method != "fp8":
            raise ConfigError(f"{where}: quantization_config.quant_method {method!r} is not supported (only 'fp8')")
        kw["quant_method"] = "fp8"
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"{where}: quantization_config.fmt {qc.get('fmt')!r} is not supported (only 'e4m3')")
        block = qc.get("weight_block_size", [128, 128])
        if (not isinstance(block, list) or len(block) != 2 or block[0] != block[1]
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ConfigError(f"{where}: quantization_config.weight_block_size must be [B, B], got {block!r}")
        kw["weight_block_size"] = block[0]
        kw["scale_fmt"] = qc.get("scale_fmt")

    cfg = ModelConfig(**kw)
    validate_config(cfg, where)
    return cfg


def validate_config(cfg: ModelConfig, where: str = "config.json") -> None:
    """The reference's shape rules and the consistency checks a run depends on."""

    def bad(msg: str) -> None:
        raise ConfigError(f"{where}: {msg}")

    for name in ["vocab_size", "dim", "n_layers", "n_heads", "q_lora_rank", "head_dim", "rope_head_dim",
                 "o_groups", "o_lora_rank", "window_size", "n_routed_experts", "n_activated_experts",
                 "moe_inter_dim", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
                 "hc_sinkhorn_iters", "max_position_embeddings", "weight_block_size"]:
        if getattr(cfg, name) <= 0:
            bad(f"'{hf_key(name)}' must be positive, got {getattr(cfg, name)}")
    for name in ["n_hash_layers", "n_mtp_layers", "bos_token_id", "eos_token_id", "original_seq_len"]:
        if getattr(cfg, name) < 0:
            bad(f"'{hf_key(name)}' must be >= 0, got {getattr(cfg, name)}")
    for name in ["rope_factor", "rope_theta", "compress_rope_theta", "norm_eps", "hc_eps"]:
        if not getattr(cfg, name) > 0:
            bad(f"'{hf_key(name)}' must be positive, got {getattr(cfg, name)}")
    if len(cfg.compress_ratios) < cfg.n_layers:
        bad(f"'compress_ratios' has {len(cfg.compress_ratios)} entries but there are {cfg.n_layers} layers")
    for i, r in enumerate(cfg.compress_ratios):
        if r not in (0, 4) and (r < 8 or r & (r - 1)):
            bad(f"compress_ratios[{i}] = {r}: must be 0 (window), 4 (CSA) or a power of two >= 8 (HCA)")
    if cfg.rope_head_dim % 2 or cfg.rope_head_dim >= cfg.head_dim:
        bad(f"qk_rope_head_dim {cfg.rope_head_dim} must be even and smaller than head_dim {cfg.head_dim}")
    if (cfg.head_dim - cfg.rope_head_dim) % 64:
        bad(f"head_dim - qk_rope_head_dim = {cfg.head_dim - cfg.rope_head_dim} must be a multiple of 64")
    ihd = cfg.index_head_dim
    if ihd & (ihd - 1) or ihd < cfg.rope_head_dim:
        bad(f"index_head_dim {ihd} must be a power of two >= qk_rope_head_dim {cfg.rope_head_dim}")
    if ihd % 32:
        bad(f"index_head_dim {ihd} must be a multiple of 32 (the FP4 block)")
    if (cfg.n_heads * cfg.head_dim) % cfg.o_groups:
        bad(f"num_attention_heads * head_dim must divide into o_groups ({cfg.o_groups})")
    if cfg.n_activated_experts > cfg.n_routed_experts:
        bad(f"num_experts_per_tok {cfg.n_activated_experts} exceeds n_routed_experts {cfg.n_routed_experts}")
    if cfg.n_hash_layers > cfg.n_layers:
        bad(f"num_hash_layers {cfg.n_hash_layers} exceeds num_hidden_layers {cfg.n_layers}")
    if cfg.n_shared_experts != 1:
        bad(f"n_shared_experts must be 1, got {cfg.n_shared_experts}")
    if cfg.score_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        bad(f"scoring_func {cfg.score_func!r} is not one of sqrtsoftplus, sigmoid, softmax")
    if cfg.expert_dtype not in (None, "fp4", "fp8"):
        bad(f"expert_dtype {cfg.expert_dtype!r} is not one of fp4, fp8")
    if cfg.expert_dtype == "fp4" and cfg.dim % 32:
        bad(f"hidden_size {cfg.dim} must be a multiple of 32 for FP4 experts")
    if cfg.scale_fmt not in (None, "ue8m0"):
        bad(f"quantization_config.scale_fmt {cfg.scale_fmt!r} is not supported (only 'ue8m0')")
    if cfg.bos_token_id >= cfg.vocab_size or cfg.eos_token_id >= cfg.vocab_size:
        bad("bos_token_id / eos_token_id must be inside the vocabulary")


def find_config_file(path: str | Path) -> Path:
    p = Path(path)
    return p / "config.json" if p.is_dir() else p


def load_config(path: str | Path) -> ModelConfig:
    """Read a config.json (or a checkpoint directory holding one)."""
    file = find_config_file(path)
    if not file.exists():
        raise ConfigError(f"{file}: config file not found")
    raw = read_json(file, ConfigError)
    return config_from_hf(raw, str(file))


def check_layers(layers: int | None, cfg: ModelConfig, path: Path) -> None:
    """--layers N (None: all of them): one line naming the flag and the file where N is not a layer count of cfg."""
    if layers is not None and not 1 <= layers <= cfg.n_layers:
        raise InputError(f"--layers {layers}: {path} has {cfg.n_layers} layers (give 1 to {cfg.n_layers})")
