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

from mhcrun.checkpoint import CheckpointPlan, TensorPlan
from mhcrun.config import ModelConfig
from mhcrun.errors import InputError
from mhcrun.model import Attention, RunOptions, cache_formats
from mhcrun.ops.attention import ATTN_WORKSPACE
from mhcrun.ops.index import INDEX_WORKSPACE
from mhcrun.ops.qgemv import route_bytes
from mhcrun.snapshot import state_extents
from mhcrun.weights import dequantized_dtype, scale_name

PREFILL_BUDGET = 512 << 20  # what a prefill chunk's activations may grow to (chooses the default chunk)
RUNTIME_BYTES = 400 << 20  # python, torch and the tokenizer, measured ~0.3 GB; rounded up
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}


@dataclass
class MemoryPlan:
    layers: int
    batch: int
    context: int
    prompt_len: int
    prefill_chunk: int  # tokens a prefill chunk holds: the activations are planned for one chunk
    dtype: str
    dequantize: bool
    quant_sim: bool
    disk_by_dtype: dict[str, int]  # on-disk bytes of the tensors that load, by stored dtype (scales included)
    weights: int  # bytes the weights take in memory: mapped shard bytes plus cast copies (or fp32 dequantised)
    state: dict[str, int] = field(default_factory=dict)  # KV cache, compressor and indexer state, rope tables
    kv_bytes_per_token: float = 0.0  # KV and indexer cache bytes one more token of context adds (these layers)
    kv_bytes_per_token_model: float = 0.0  # the same for every layer of the model (when --layers runs fewer)
    snapshot_bytes: int = 0  # a state snapshot (prompt cache) of one sequence after `context` tokens (these layers)
    activations: int = 0  # the largest transient: one prefill chunk's activations and score workspaces
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
                "prefill_chunk": self.prefill_chunk, "dtype": self.dtype, "dequantize": self.dequantize,
                "quant_sim": self.quant_sim, "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_bytes_per_token_model": self.kv_bytes_per_token_model, "snapshot_bytes": self.snapshot_bytes,
                "disk_by_dtype": dict(sorted(
                    self.disk_by_dtype.items())), "disk_bytes": sum(self.disk_by_dtype.values()),
                "weights_bytes": self.weights, "state_bytes": self.state, "activation_bytes": self.activations,
                "runtime_bytes": self.runtime, "total_bytes": self.total, "available_bytes": self.available,
                "fits": self.fits}


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def weight_bytes(plan: CheckpointPlan, dtype: torch.dtype, dequantize: bool) -> int:
    """Bytes of the weights once built (see `mhcrun.model.build_model`).

    Kept quantised: every shard byte that loads stays mapped (it is touched when used) or, on a CPU where the kernel
    offers huge pages, is copied onto them (`mhcrun.hugepages`: the same bytes), plus the copies of the float tensors
    cast to their run-time dtype. Dequantised: every tensor as its fp32 (or run dtype) copy.
    Under --tp, one rank's: its share of the split tensors and its own experts (`plan.tp`).
    """
    total = 0 if dequantize else sum(plan.bytes_by_dtype.values())
    for p in plan.plans:
        n = numel(p.spec.shape) // (plan.tp.world if p.spec.split is not None else 1)
        if p.fmt == "index":
            total += 8 * n
        elif p.fmt in ("fp8", "fp4"):
            if dequantize:
                total += n * dequantized_dtype(p.spec, dtype).itemsize
        elif dequantize or p.spec.run != "stored":  # dequantised, the "stored" tensors are fp32 too
            total += n * (4 if p.spec.run in ("fp32", "stored") else dtype.itemsize)
    return total


def decode_bytes_per_token(plan: CheckpointPlan, dtype: torch.dtype = torch.float32,
                           dequantize: bool = False) -> int:
    """Bytes of weights one decoded token reads: every tensor of every layer as it sits in memory, except
    that of the routed experts only `n_activated` of `n_routed` are read (on average, their share), and of the
    embedding and `tid2eid` one row. The physical floor of a memory-bound decode step."""
    total = 0.0
    for p in plan.plans:
        name, n = p.spec.name, numel(p.spec.shape)
        if p.fmt == "index":
            size = 8 * n
        elif name == "embed.weight":
            size = 4 * n if dequantize else p.shard.entries[name].nbytes
        elif p.fmt in ("fp8", "fp4") and not dequantize:
            size = p.shard.entries[name].nbytes + p.scale_shard.entries[scale_name(name)].nbytes
        elif p.fmt in ("fp8", "fp4"):
            size = n * dequantized_dtype(p.spec, dtype).itemsize
        elif p.spec.run == "stored" and not dequantize:
            size = p.shard.entries[name].nbytes
        else:
            size = n * (4 if p.spec.run in ("fp32", "stored") else dtype.itemsize)
        total += size * token_share(p, plan.config)
    return int(total)


def token_share(p: TensorPlan, cfg: ModelConfig) -> float:
    """The share of a stored tensor one decoded token reads: one row of the embedding and of `tid2eid`, a routed
    expert's n_activated / n_routed (on average), all of anything else."""
    if p.fmt == "index" or p.spec.name == "embed.weight":
        return 1 / p.spec.shape[0]
    return cfg.n_activated_experts / cfg.n_routed_experts if p.spec.expert is not None else 1.0


def decode_macs_per_token(plan: CheckpointPlan) -> int:
    """Multiply-adds of the weight GEMMs of one token (every 2-D `*.weight` and hc `*_fn` but the embedding,
    routed experts at their share; attention over the context not counted): a prefill's work per prompt token."""
    return int(sum(numel(p.spec.shape) * token_share(p, plan.config) for p in plan.plans
                   if len(p.spec.shape) == 2 and p.spec.name.endswith((".weight", "_fn"))
                   and p.spec.name != "embed.weight"))


def state_bytes(cfg: ModelConfig, layers: int, batch: int, context: int, dtype: torch.dtype,
                quant_sim: bool = True, mtp: bool = False) -> dict[str, int]:
    """Bytes of the per-sequence state `Transformer.setup_caches` allocates, by kind: the layers' own state
    buffers (with `mtp`, the MTP layer's too: layer id n_layers), made on the meta device."""
    out = {"kv_cache": 0, "compressor_state": 0, "indexer_cache": 0}
    formats = cache_formats(cfg, quant_sim)
    for i in state_layers(cfg, layers, mtp):
        attn = Attention(i, cfg, RunOptions())
        attn.allocate(batch, context, dtype, "meta", formats, (None, None))
        for name, t in attn.named_buffers():
            kind = ("indexer_cache" if name.startswith("indexer.compressor.cache.") else
                    "compressor_state" if name.endswith("_state") else "kv_cache")
            out[kind] += t.nbytes
    out["rope_tables"] = 2 * 2 * context * (cfg.rope_head_dim // 2) * 4  # cos and sin of two tables, fp32
    return out


def chunk_activation_bytes(cfg: ModelConfig, chunk: int) -> int:
    """The activations that grow with a prefill chunk of `chunk` tokens: the mHC streams and their copies through
    a layer, the attention's queries and outputs, the MoE's intermediates (measured on the mid-size config:
    ~0.3 MB a token there), or where more, the CPU kernel's routed call's transients (`qgemv.route_bytes` a route,
    k routes a token: a call takes at most the chunk's)."""
    streams = 8 * cfg.hc_mult * cfg.dim * 4
    attn = 4 * cfg.n_heads * cfg.head_dim * 4 + 4 * cfg.q_lora_rank * 4
    k = cfg.n_activated_experts
    moe = max(4 * (k + 1) * cfg.moe_inter_dim * 4, k * route_bytes(cfg.dim, cfg.moe_inter_dim))
    return chunk * (streams + attn + moe)


def activation_bytes(cfg: ModelConfig, chunk: int) -> int:
    """A prefill chunk's largest transients: what grows with the chunk, the attention's and the indexer's score
    workspaces (fixed caps: queries and entries are taken in slices), and the logits."""
    return chunk_activation_bytes(cfg, chunk) + ATTN_WORKSPACE + INDEX_WORKSPACE + 4 * cfg.vocab_size


def default_prefill_chunk(cfg: ModelConfig) -> int:
    """The prefill chunk (tokens) when none is given: the largest power of two up to 2048 whose activations stay
    within PREFILL_BUDGET."""
    chunk = 2048
    while chunk > 16 and chunk_activation_bytes(cfg, chunk) > PREFILL_BUDGET:
        chunk //= 2
    return chunk


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


def stored_bytes_per_rank(cfg: ModelConfig, world: int = 1) -> int:
    """Bytes of a released checkpoint's tensors one rank of --tp `world` maps, from the config alone (no
    checkpoint needed): FP8 e4m3 bytes plus an e8m0 byte per block, packed FP4 plus an e8m0 byte per 32, fp32
    for the parameters the release keeps in fp32, bf16 for the other float tensors, int32 tables; 1/world of
    the split tensors and 1/world of the routed experts."""
    from mhcrun.weights import scale_shape, stored_format, tensor_specs

    total = 0
    for spec in tensor_specs(cfg):
        n = math.prod(spec.shape)
        fmt = stored_format(cfg, spec)
        if fmt in ("fp8", "fp4"):  # codes (two e2m1 per byte) and an e8m0 byte per scale
            size = (n if fmt == "fp8" else n // 2) + math.prod(scale_shape(cfg, spec, fmt))
        elif fmt == "index":
            size = 4 * n
        else:
            size = n * (4 if spec.run == "fp32" else 2)
        if spec.split is not None or spec.expert is not None:
            size //= world
        total += size
    return total


def kv_bytes_per_token(cfg: ModelConfig, layers: int, dtype: torch.dtype, quant_sim: bool = True) -> float:
    """KV and indexer cache bytes per token of context, summed over the first `layers` layers: a compressed
    layer stores one entry per `ratio` tokens (a CSA layer also one indexer key per 4); the window's ring is a
    fixed cost, not counted here."""
    formats = cache_formats(cfg, quant_sim)
    total = 0.0
    for i in range(layers):
        ratio = cfg.compress_ratios[i]
        if ratio:
            total += formats["kv"].bytes_per_entry(dtype) / ratio
        if ratio == 4:
            total += formats["idx_kv"].bytes_per_entry(dtype) / 4
    return total


def state_layers(cfg: ModelConfig, layers: int, mtp: bool) -> list[int]:
    """The layer ids whose attention keeps state: the first `layers`, and with `mtp` the MTP layer (n_layers)."""
    return [*range(layers), *([cfg.n_layers] if mtp else [])]


def snapshot_bytes(cfg: ModelConfig, layers: int, n_tokens: int, dtype: torch.dtype, quant_sim: bool = True,
                   mtp: bool = False) -> int:
    """Bytes of a state snapshot after `n_tokens` tokens (`mhcrun.snapshot`: the rings, the closed compressed
    entries and indexer keys, the compressors' state), over the first `layers` layers (with `mtp`, the MTP layer's
    too, and its pending input: the last position's streams, `mhcrun.session`), from the layers' state buffers
    made on the meta device: no more than the state it copies."""
    formats = cache_formats(cfg, quant_sim)
    total = cfg.hc_mult * cfg.dim * dtype.itemsize if mtp else 0
    for i in state_layers(cfg, layers, mtp):
        attn = Attention(i, cfg, RunOptions())
        attn.allocate(1, max(n_tokens, 1), dtype, "meta", formats, (None, None))
        extents = state_extents(attn, n_tokens)
        for name, t in attn.named_buffers():
            total += t.nbytes // max(t.size(1), 1) * extents.get(name, t.size(1))
    return total


def plan_memory(plan: CheckpointPlan, layers: int, batch: int, context: int, prompt_len: int | None = None,
                dtype: torch.dtype = torch.float32, dequantize: bool = False, available: int | None = None,
                prefill_chunk: int | None = None, quant_sim: bool = True, mtp: bool = False) -> MemoryPlan:
    """The memory plan of running the first `layers` layers of a checked checkpoint: prefill activations for
    one chunk of `prefill_chunk` tokens (default `default_prefill_chunk`; never more than the prompt). `mtp`: the
    MTP layer's state as well (its weights are in `plan` when it was planned with them). `available` defaults to
    what this machine has free now (`available_bytes`)."""
    cfg = plan.config
    prompt_len = context if prompt_len is None else prompt_len
    chunk = max(1, min(prefill_chunk or default_prefill_chunk(cfg), prompt_len))
    return MemoryPlan(
        layers=layers, batch=batch, context=context, prompt_len=prompt_len, prefill_chunk=chunk,
        dtype=str(dtype).removeprefix("torch."), dequantize=dequantize, quant_sim=quant_sim,
        disk_by_dtype=dict(plan.bytes_by_dtype), weights=weight_bytes(plan, dtype, dequantize),
        state=state_bytes(cfg, layers, batch, context, dtype, quant_sim, mtp),
        kv_bytes_per_token=kv_bytes_per_token(cfg, layers, dtype, quant_sim),
        kv_bytes_per_token_model=kv_bytes_per_token(cfg, cfg.n_layers, dtype, quant_sim),
        snapshot_bytes=snapshot_bytes(cfg, layers, context, dtype, quant_sim, mtp),
        activations=activation_bytes(cfg, chunk), available=available if available is not None else available_bytes())


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
