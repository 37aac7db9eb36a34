"""The memory plan of a run, from a checkpoint's headers alone: weights as they will sit in memory, the
KV and compressor state for a batch and context, the largest transient activation, and what this machine
has available. `mhcrun info` prints it; `mhcrun generate` refuses to start when it does not fit.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mhcrun.checkpoint import CheckpointPlan
from mhcrun.config import ModelConfig
from mhcrun.errors import InputError
from mhcrun.model import STORED_DTYPE, fp32_param, make_state_roots
from mhcrun.weights import scale_name

RUNTIME_BYTES = 400 << 20  # python, torch and the tokenizer, measured ~0.3 GB; rounded up
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}


@dataclass
class MemoryPlan:
    layers: int
    batch: int
    context: int
    prompt_len: int
    dtype: str
    dequantize: bool
    disk_by_dtype: dict[str, int]  # on-disk bytes of the tensors that load, by stored dtype (scales included)
    weights: int  # bytes the weights take in memory: mapped shard bytes plus cast copies (or fp32 dequantised)
    state: dict[str, int] = field(default_factory=dict)  # KV cache, compressor and indexer state, rope tables
    activations: int = 0  # the largest transient: prefill attention and indexer scores of the longest prompt
    runtime: int = RUNTIME_BYTES
    available: int | None = None  # bytes this machine (or the given limit) allows

    @property
    def total(self) -> int:
        return self.weights + sum(self.state.values()) + self.activations + self.runtime

    @property
    def fits(self) -> bool:
        return self.available is None or self.total <= self.available

    def to_dict(self) -> dict:
        return {"layers": self.layers, "batch": self.batch, "context": self.context, "prompt_len": self.prompt_len,
                "dtype": self.dtype, "dequantize": self.dequantize, "disk_by_dtype": dict(sorted(
                    self.disk_by_dtype.items())), "disk_bytes": sum(self.disk_by_dtype.values()),
                "weights_bytes": self.weights, "state_bytes": self.state, "activation_bytes": self.activations,
                "runtime_bytes": self.runtime, "total_bytes": self.total, "available_bytes": self.available,
                "fits": self.fits}


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def weight_bytes(plan: CheckpointPlan, dtype: torch.dtype, dequantize: bool) -> int:
    """Bytes of the weights once built (see `mhcrun.model.build_model`).

    Kept quantised: every shard byte that loads stays mapped (it is touched when used), plus the copies of
    the float tensors cast to their run-time dtype. Dequantised: every tensor as its fp32 (or run dtype) copy.
    """
    total = 0 if dequantize else sum(plan.bytes_by_dtype.values())
    for p in plan.plans:
        name, n = p.spec.name, numel(p.spec.shape)
        if p.fmt == "index":
            total += 8 * n
        elif p.fmt in ("fp8", "fp4"):
            if dequantize:
                total += n * (dtype.itemsize if name.endswith("wo_a.weight") else 4)
        elif dequantize or name not in STORED_DTYPE:  # dequantised, the vocabulary tensors are fp32 too
            total += n * (4 if fp32_param(name) or name in STORED_DTYPE else dtype.itemsize)
    return total


def decode_bytes_per_token(plan: CheckpointPlan, dtype: torch.dtype = torch.float32,
                           dequantize: bool = False) -> int:
    """Bytes of weights one decoded token reads: every tensor of every layer as it sits in memory, except
    that of the routed experts only `n_activated` of `n_routed` are read (on average, their share), and of the
    embedding and `tid2eid` one row. The physical floor of a memory-bound decode step."""
    cfg = plan.config
    total = 0.0
    for p in plan.plans:
        name, n = p.spec.name, numel(p.spec.shape)
        if p.fmt == "index":
            total += 8 * n / p.spec.shape[0]
            continue
        if name == "embed.weight":
            total += (4 * n if dequantize else p.shard.entries[name].nbytes) / p.spec.shape[0]
            continue
        if p.fmt in ("fp8", "fp4") and not dequantize:
            size = p.shard.entries[name].nbytes + p.scale_shard.entries[scale_name(name)].nbytes
        elif p.fmt in ("fp8", "fp4"):
            size = n * (dtype.itemsize if name.endswith("wo_a.weight") else 4)
        elif name in STORED_DTYPE and not dequantize:
            size = p.shard.entries[name].nbytes
        else:
            size = n * (4 if fp32_param(name) else dtype.itemsize)
        total += size * (cfg.n_activated_experts / cfg.n_routed_experts if ".experts." in name else 1)
    return int(total)


def state_bytes(cfg: ModelConfig, layers: int, batch: int, context: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of the per-sequence state `Transformer.setup_caches` allocates, by kind."""
    ratios = [cfg.compress_ratios[i] for i in range(layers)]
    out = {"kv_cache": 0, "compressor_state": 0, "indexer_cache": 0}
    for ratio in sorted(set(ratios)):
        roots = make_state_roots(cfg, ratio, ratios.count(ratio), batch, context, dtype, "meta")
        for key, t in roots.items():
            kind = "kv_cache" if key == "kv" else "indexer_cache" if key == "idx_kv" else "compressor_state"
            out[kind] += t.nbytes
    out["rope_tables"] = 2 * context * (cfg.rope_head_dim // 2) * 8  # two complex64 tables
    return out


def activation_bytes(cfg: ModelConfig, prompt_len: int, dtype: torch.dtype) -> int:
    """The prefill's largest transients: attention scores and probabilities [s, heads, s + s/4] (fp32, ~4
    live at once), the indexer's [s, index_heads, s/4] scores, and the logits."""
    s = prompt_len
    keys = s + s // 4
    attn = 4 * 4 * cfg.n_heads * s * keys
    index = 2 * 4 * cfg.index_n_heads * s * (s // 4)
    hidden = 8 * s * cfg.hc_mult * max(cfg.dim, cfg.n_heads * cfg.head_dim) * 4
    return attn + index + hidden + 4 * cfg.vocab_size


def available_bytes() -> int | None:
    """MemAvailable, capped by a cgroup (v2 or v1) limit minus its usage; None when neither can be read."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:
                found.append(int(limit) - int(Path(usage_file).read_text().strip()))
            break
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def parse_size(text: str, what: str = "--memory-limit") -> int:
    """'24G', '512MiB', '1.5GB', '100000' -> bytes (k/M/G/T are powers of 10, KiB/MiB/GiB/TiB of 2)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text or "")
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise InputError(f"{what}: {text!r} is not a size (examples: 24G, 512MiB, 1.5GB)")
    value = float(m.group(1)) * _UNITS[unit]
    if value < 1:
        raise InputError(f"{what}: {text!r} must be at least one byte")
    return int(value)


def plan_memory(plan: CheckpointPlan, layers: int, batch: int, context: int, prompt_len: int | None = None,
                dtype: torch.dtype = torch.float32, dequantize: bool = False,
                available: int | None = None) -> MemoryPlan:
    """The memory plan of running the first `layers` layers of a checked checkpoint. `available` defaults
    to what this machine has free now (`available_bytes`)."""
    cfg = plan.config
    prompt_len = context if prompt_len is None else prompt_len
    return MemoryPlan(
        layers=layers, batch=batch, context=context, prompt_len=prompt_len, dtype=str(dtype).removeprefix("torch."),
        dequantize=dequantize, disk_by_dtype=dict(plan.bytes_by_dtype),
        weights=weight_bytes(plan, dtype, dequantize), state=state_bytes(cfg, layers, batch, context, dtype),
        activations=activation_bytes(cfg, prompt_len, dtype),
        available=available if available is not None else available_bytes())


def format_bytes(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def check_fits(mp: MemoryPlan, where: str) -> None:
    """InputError, one line, when the plan needs more than is available."""
    if mp.fits:
        return
    raise InputError(
        f"{where}: the memory plan needs {format_bytes(mp.total)} (weights {format_bytes(mp.weights)}, KV and "
        f"state {format_bytes(sum(mp.state.values()))}, activations {format_bytes(mp.activations)}, runtime "
        f"{format_bytes(mp.runtime)}) but {format_bytes(mp.available)} is available; run fewer layers "
        f"(--layers), a shorter context, or pass --force to try anyway")
