"""How the KV cache stores its entries.

With the quantisation simulation on, the reference rounds kv's non-rope channels to FP8 e4m3 (a scale per 64
values) and the indexer keys to FP4 e2m1 (a power-of-two scale per 32 values) before it uses them, so the
cache keeps exactly those codes and scales and decodes them on read: the values read back equal the
simulation's bit for bit, and the cache is ~3x smaller in an fp32 run. Without the simulation the cache holds
the activation dtype.

A cache is a dict of parts that share their leading dims (e.g. [B, n_entries, ...]): `{"values": values}` plain,
`{"fp8": codes, "scale": fp32, "rope": values}` for kv, `{"fp4": packed, "scale": fp32}` for indexer keys.
`encode` turns values into parts, `decode` parts (indexed alike) back into values; `simulate` is the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mhcrun.ops.quant import (
    INDEX_FP4_BLOCK,
    KV_FP8_BLOCK,
    dequantize_act,
    quantize_act_fp4,
    quantize_act_fp8,
    unpack_fp4,
)


@dataclass(frozen=True)
class CacheFormat:
    """kind: "plain" (activation dtype), "fp8" (kv: e4m3 non-rope channels, rope channels in the activation
    dtype) or "fp4" (indexer keys: e2m1 codes two per byte). dim: channels per entry."""

    kind: str
    dim: int
    rope_dim: int = 0
    pow2: bool = True

    def parts(self, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        """part name -> (last dim, dtype) of the tensors an entry is stored in."""
        if self.kind == "plain":
            return {"values": (self.dim, dtype)}
        if self.kind == "fp8":
            nope = self.dim - self.rope_dim
            return {"fp8": (nope, torch.float8_e4m3fn), "scale": (-(-nope // KV_FP8_BLOCK), torch.float32),
                    "rope": (self.rope_dim, dtype)}
        if self.kind == "fp4":
            return {"fp4": (self.dim // 2, torch.uint8), "scale": (-(-self.dim // INDEX_FP4_BLOCK), torch.float32)}
        raise ValueError(f"unknown cache format {self.kind!r}")

    def bytes_per_entry(self, dtype: torch.dtype) -> int:
        return sum(n * dt.itemsize for n, dt in self.parts(dtype).values())


def kv_format(head_dim: int, rope_dim: int, quant_sim: bool, pow2: bool) -> CacheFormat:
    return CacheFormat("fp8" if quant_sim else "plain", head_dim, rope_dim, pow2)


def index_format(index_head_dim: int, quant_sim: bool) -> CacheFormat:
    return CacheFormat("fp4" if quant_sim else "plain", index_head_dim)


def make_parts(fmt: CacheFormat, lead: tuple[int, ...], dtype: torch.dtype,
               device: torch.device | str) -> dict[str, torch.Tensor]:
    """Zeroed storage for entries of shape `lead`: one tensor per part, [*lead, part dim]."""
    return {name: torch.zeros(*lead, n, dtype=dt, device=device) for name, (n, dt) in fmt.parts(dtype).items()}


def encode(fmt: CacheFormat, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Values [..., dim] -> the parts that store them (rounding as the simulation does)."""
    if fmt.kind == "plain":
        return {"values": x}
    if fmt.kind == "fp8":
        nope, rope = x.split([fmt.dim - fmt.rope_dim, fmt.rope_dim], dim=-1)
        codes, scale = quantize_act_fp8(nope, KV_FP8_BLOCK, fmt.pow2)
        return {"fp8": codes, "scale": scale, "rope": rope}
    codes, scale = quantize_act_fp4(x, INDEX_FP4_BLOCK)
    return {"fp4": codes, "scale": scale}


def decode(fmt: CacheFormat, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Parts -> values [..., dim] in `dtype` (equal bit for bit to the simulation of what was encoded)."""
    if fmt.kind == "plain":
        return parts["values"].to(dtype)
    if fmt.kind == "fp8":
        nope = dequantize_act(parts["fp8"], parts["scale"], KV_FP8_BLOCK).to(dtype)
        return torch.cat([nope, parts["rope"].to(dtype)], dim=-1)
    return decode_fp4(parts["fp4"], parts["scale"]).to(dtype)


def decode_fp4(packed: torch.Tensor, scale: torch.Tensor, block: int = INDEX_FP4_BLOCK) -> torch.Tensor:
    """FP4 parts (e2m1 codes two a byte [..., dim / 2], a scale per `block` values [..., dim / block]) -> fp32
    values [..., dim]."""
    return dequantize_act(unpack_fp4(packed), scale, block)


def simulate(fmt: CacheFormat, x: torch.Tensor) -> torch.Tensor:
    """What the cache gives back for x: the reference's FP8/FP4 round trip (x itself when plain)."""
    return x if fmt.kind == "plain" else decode(fmt, encode(fmt, x), x.dtype)


def write(parts: dict[str, torch.Tensor], fmt: CacheFormat, index: tuple, x: torch.Tensor) -> None:
    """parts[index] = x, stored in the cache's format."""
    store(parts, index, encode(fmt, x))


def read(parts: dict[str, torch.Tensor], fmt: CacheFormat, index: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The values at parts[index], decoded (only the entries indexed are read and dequantised)."""
    return decode(fmt, {name: p[index] for name, p in parts.items()}, dtype)


def store(parts: dict[str, torch.Tensor], index: tuple, encoded: dict[str, torch.Tensor]) -> None:
    """parts[index] = encoded values (the output of `encode`, so a value is rounded exactly once)."""
    for name, value in encoded.items():
        parts[name][index] = value.to(parts[name].dtype)


def part_names(fmt: CacheFormat) -> tuple[str, ...]:
    return tuple(fmt.parts(torch.float32))
