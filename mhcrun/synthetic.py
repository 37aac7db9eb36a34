"""Synthetic full-width checkpoints in DeepSeek's released layout, streamed to disk.

`make_synthetic` writes random weights for the first `n_layers` layers of a config: every tensor
`weights.tensor_specs` names, stored the way `weights.stored_format` says (bf16/fp32 floats, FP8 e4m3 linears
with e8m0 [B x B] block scales, FP4 e2m1 routed experts with e8m0 scales per 32 inputs, an int32 `tid2eid`).
The config.json is written back unchanged (num_hidden_layers included), so the directory reads as a truncated
release: run it with `--layers N`.

Values:
- small float tensors come from `tiny.init_tensor` (by role, so a forward pass stays finite and decisive);
  big ones (embed, head) are drawn in row chunks with the same statistics;
- FP8/FP4 weights are drawn as codes directly (no fp32 weight is ever made): FP8 codes from a pool of
  e4m3-quantised normal samples, FP4 codes uniformly at random; their power-of-two scales are drawn per block
  from two adjacent exponents, mixed so that the dequantised weight has RMS about 1/sqrt(in) (like
  `init_tensor`'s linears).

Shards are planned from the shapes first (so their `-of-N` names are known), then each is written by a small
streaming safetensors writer, chunk by chunk, through `fileio.open_atomic`; a writer thread does the disk
while the next chunk is drawn. Memory stays bounded by a few chunks (CHUNK_ELEMS elements; WRITE_DEPTH queued)
plus the 4 MB FP8 pool, whatever the checkpoint size. Same seed, same bytes.
"""

from __future__ import annotations

import functools
import json
import math
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from mhcrun.checkpoint import INDEX_FILE
from mhcrun.config import ModelConfig, check_layers, find_config_file, load_config
from mhcrun.errors import ConfigError, InputError
from mhcrun.fileio import check_out_dir, make_dirs, open_atomic, read_json, write_atomic
from mhcrun.ops.quant import FP4_BLOCK, FP8_MAX, unpack_fp4
from mhcrun.tiny import HEAD_GAIN, init_tensor
from mhcrun.weights import TensorSpec, scale_name, stored_format, tensor_specs

CHUNK_ELEMS = 8 << 20  # elements generated (and held) at a time
SMALL_FLOAT_ELEMS = 16 << 20  # float tensors up to this size come whole from tiny.init_tensor
FP8_POOL_WORDS = 1 << 19  # the FP8 pool: this many 8-code words (4M codes)
WRITE_DEPTH = 4  # chunks queued for the writer thread
FP8_POOL_STD = 64.0  # the pool holds e4m3(N(0, 64^2)): a bell over most of e4m3's range, +-448 at 7 sigma

_ST_TAGS = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.int8: "I8",
    torch.int32: "I32",
}
_FP32_SUFFIXES = ("attn_sink", "ape", "gate.bias")  # with the hc_* tensors, fp32 in the release


@dataclass(frozen=True)
class _Tensor:
    """One tensor to write: its header entry and a function yielding its data in order, chunk by chunk."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterator[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _Draw:
    """The random source: one seeded generator, used in the fixed order the tensors are written."""

    def __init__(self, cfg: ModelConfig, seed: int):
        self.cfg = cfg
        self.g = torch.Generator().manual_seed(seed)
        self._fp8_pool: torch.Tensor | None = None
        self._fp8_pool_ms = 0.0

    def fp8_pool(self) -> tuple[torch.Tensor, float]:
        """int64 [FP8_POOL_WORDS] words of 8 e4m3 codes each, and the codes' mean square value."""
        if self._fp8_pool is None:
            x = torch.randn(FP8_POOL_WORDS * 8, generator=self.g) * FP8_POOL_STD
            codes = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # clamped: never the NaN codes
            self._fp8_pool_ms = codes.double().square().mean().item()
            self._fp8_pool = codes.view(torch.int64)
        return self._fp8_pool, self._fp8_pool_ms


def make_synthetic(config: str | Path, out_dir: str | Path, n_layers: int, seed: int = 0, force: bool = False,
                   shard_bytes: int = 4 << 30, progress: Callable[[int, int], None] | None = None) -> Path:
    """Write a random checkpoint of `config`'s shapes, truncated to layers [0, n_layers), into `out_dir`.

    `config` is a config.json or a directory holding one; it is written back unchanged. Shards
    `model-0000i-of-0000n.safetensors` are filled in tensor order (each scale right after its weight) up to
    `shard_bytes` each (a bigger tensor gets a shard of its own), then `model.safetensors.index.json` and
    config.json are written. Refuses a non-empty `out_dir` unless `force` (InputError). `progress(done,
    total)` gets tensor-data bytes after each chunk is drawn and handed to the writer thread (at most
    WRITE_DEPTH chunks ahead of the file). Same seed, byte-identical files. Returns out_dir.
    """
    cfg_file = find_config_file(config)
    cfg = load_config(cfg_file)
    raw = read_json(cfg_file, ConfigError)  # written back unchanged
    check_arguments(cfg, cfg_file, n_layers, shard_bytes)
    out = check_out_dir(out_dir, force)

    tensors = plan_tensors(cfg, n_layers, _Draw(cfg, seed))
    shards = plan_shards(tensors, shard_bytes)
    total = sum(t.nbytes for t in tensors)
    done = 0

    def count(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    make_dirs(out)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        shard_file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_shard(out / shard_file, shard, force, count)
        weight_map.update({t.name: shard_file for t in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_atomic(out / INDEX_FILE, json.dumps(index, indent=2), force=force)
    write_atomic(out / "config.json", json.dumps(raw, indent=2) + "\n", force=force)  # last: a crash leaves none
    return out


def check_arguments(cfg: ModelConfig, cfg_file: Path, n_layers: int, shard_bytes: int) -> None:
    """One-line InputErrors for a layer count outside [1, num_hidden_layers] or a non-positive shard size."""
    if isinstance(n_layers, bool) or not isinstance(n_layers, int):
        raise InputError(f"n_layers must be an integer, got {n_layers!r}")
    check_layers(n_layers, cfg, cfg_file)
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise InputError(f"shard_bytes must be a positive integer, got {shard_bytes!r}")


# ---- planning ----------------------------------------------------------------------------------------------


def plan_tensors(cfg: ModelConfig, n_layers: int, draw: _Draw) -> list[_Tensor]:
    """Every tensor to write, in order: tensor_specs' order, each scale right after its weight."""
    out: list[_Tensor] = []
    for spec in tensor_specs(cfg, n_layers):
        fmt = stored_format(cfg, spec)
        if fmt == "fp8":
            out += plan_fp8(spec, cfg.weight_block_size, draw)
        elif fmt == "fp4":
            out += plan_fp4(spec, draw)
        elif fmt == "index":
            out.append(_Tensor(spec.name, torch.int32, spec.shape, functools.partial(draw_index, spec.shape, draw)))
        else:
            dtype = float_dtype(spec.name)
            out.append(_Tensor(spec.name, dtype, spec.shape, functools.partial(draw_float, spec, dtype, draw)))
    return out


def plan_fp8(spec: TensorSpec, block: int, draw: _Draw) -> list[_Tensor]:
    """An FP8 e4m3 weight [out, in] and its e8m0 scale [ceil(out/B), ceil(in/B)]."""
    out, inner = spec.shape
    scale_shape = (-(-out // block), -(-inner // block))

    def scales() -> Iterator[torch.Tensor]:
        _, code_ms = draw.fp8_pool()
        yield draw_e8m0(math.prod(scale_shape), 1.0 / inner / code_ms, draw)

    return [
        _Tensor(spec.name, torch.float8_e4m3fn, spec.shape, functools.partial(draw_fp8_codes, spec.shape, draw)),
        _Tensor(scale_name(spec.name), torch.float8_e8m0fnu, scale_shape, scales),
    ]


def plan_fp4(spec: TensorSpec, draw: _Draw) -> list[_Tensor]:
    """An FP4 weight [out, in] packed int8 [out, in/2] and its e8m0 scale [out, ceil(in/32)]."""
    out, inner = spec.shape
    packed_shape = (out, inner // 2)
    scale_shape = (out, -(-inner // FP4_BLOCK))
    if inner % 2:
        raise ConfigError(f"{spec.name}: FP4 inner size {inner} is odd")
    code_ms = unpack_fp4(torch.arange(256, dtype=torch.uint8)).square().mean().item()  # uniform random bytes

    def codes() -> Iterator[torch.Tensor]:
        for n in split(math.prod(packed_shape), CHUNK_ELEMS):
            yield random_bytes(n, draw.g)

    def scales() -> Iterator[torch.Tensor]:
        yield draw_e8m0(math.prod(scale_shape), 1.0 / inner / code_ms, draw)

    return [
        _Tensor(spec.name, torch.int8, packed_shape, codes),
        _Tensor(scale_name(spec.name), torch.float8_e8m0fnu, scale_shape, scales),
    ]


def plan_shards(tensors: list[_Tensor], shard_bytes: int) -> list[list[_Tensor]]:
    """Fill shards in order until the next tensor would pass shard_bytes; an oversized tensor goes alone."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def split(n: int, chunk: int) -> Iterator[int]:
    """Chunk sizes covering n: chunk, chunk, ..., the rest."""
    for start in range(0, n, chunk):
        yield min(chunk, n - start)


# ---- values ------------------------------------------------------------------------------------------------


def float_dtype(name: str) -> torch.dtype:
    """The release's dtype for an unquantised tensor (tiny.init_tensors' policy): fp32 for the hc_*,
    attn_sink, ape and gate bias tensors, bf16 otherwise."""
    if name.startswith("hc_") or ".hc_" in name or name.endswith(_FP32_SUFFIXES):
        return torch.float32
    return torch.bfloat16


def plain_std(name: str, shape: tuple[int, ...]) -> float | None:
    """For a 2-D tensor that tiny.init_tensor draws as plain randn * std, that std; else None."""
    if len(shape) != 2:
        return None
    if name == "embed.weight":
        return 1.0
    if name == "head.weight":
        return HEAD_GAIN / math.sqrt(shape[1])
    if name.endswith("_fn"):
        return 0.5 / math.sqrt(shape[1])
    if name.endswith(".weight") and not name.endswith("norm.weight"):
        return 1.0 / math.sqrt(shape[1])  # a linear [out, in]
    return None


def draw_float(spec: TensorSpec, dtype: torch.dtype, draw: _Draw) -> Iterator[torch.Tensor]:
    """A float tensor: whole from init_tensor when small, else randn * std in chunks of rows."""
    std = plain_std(spec.name, spec.shape)
    if std is None or math.prod(spec.shape) <= SMALL_FLOAT_ELEMS:
        yield init_tensor(spec.name, spec.shape, draw.cfg, draw.g).to(dtype)
        return
    rows, cols = spec.shape
    step = max(1, CHUNK_ELEMS // cols)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        x = torch.randn(n, cols, generator=draw.g)  # [n, cols]
        yield x.mul_(std).to(dtype)


def draw_index(shape: tuple[int, ...], draw: _Draw) -> Iterator[torch.Tensor]:
    """tid2eid [vocab, k] int32: each row k distinct expert ids (the top k of random scores)."""
    rows, k = shape
    n_experts = draw.cfg.n_routed_experts
    step = max(1, CHUNK_ELEMS // n_experts)
    for start in range(0, rows, step):
        scores = torch.rand(min(step, rows - start), n_experts, generator=draw.g)  # [n, n_experts]
        yield scores.topk(k, dim=1).indices.to(torch.int32)


def draw_fp8_codes(shape: tuple[int, ...], draw: _Draw) -> Iterator[torch.Tensor]:
    """e4m3 codes of a weight [out, in], drawn 8 at a time (a pool word) at random offsets into the pool."""
    pool, _ = draw.fp8_pool()
    n = math.prod(shape)
    words, tail = divmod(n, 8)
    for m in split(words, CHUNK_ELEMS // 8):
        idx = torch.randint(len(pool), (m,), generator=draw.g)
        yield pool[idx].view(torch.uint8)
    if tail:
        idx = torch.randint(len(pool), (1,), generator=draw.g)
        yield pool[idx].view(torch.uint8)[:tail]


def draw_e8m0(n: int, target_ms: float, draw: _Draw) -> torch.Tensor:
    """n e8m0 scales whose squares average target_ms: 2**e or 2**(e+1), the latter with probability p.

    With 4**e <= target_ms < 4**(e+1): p * 4**(e+1) + (1 - p) * 4**e = target_ms, p = (target_ms/4**e - 1)/3
    (p is drawn as a byte threshold, so to 1/256).
    """
    e = math.floor(math.log2(target_ms) / 2)
    while 4.0**e > target_ms:
        e -= 1
    while 4.0 ** (e + 1) <= target_ms:
        e += 1
    p = (target_ms / 4.0**e - 1.0) / 3.0
    threshold = min(256, round(p * 256))
    up = (random_bytes(n, draw.g).view(torch.uint8).to(torch.int32) < threshold).to(torch.int32)
    exponent = (up + (127 + e)).clamp(0, 254)  # byte 255 is NaN
    return exponent.to(torch.uint8).view(torch.float8_e8m0fnu)


def random_bytes(n: int, g: torch.Generator) -> torch.Tensor:
    """n uniformly random bytes as int8 (drawn as int64 words: far faster than byte by byte)."""
    words = torch.empty(-(-n // 8), dtype=torch.int64).random_(-(2**63), 2**63 - 1, generator=g)
    return words.view(torch.int8)[:n]


# ---- writing -----------------------------------------------------------------------------------------------


def shard_header(tensors: list[_Tensor]) -> bytes:
    """The safetensors header: 8-byte little-endian length, then the JSON, space-padded to a multiple of 8."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": _ST_TAGS[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 8)
    return len(blob).to_bytes(8, "little") + blob


def write_shard(path: Path, tensors: list[_Tensor], force: bool, count: Callable[[int], None]) -> None:
    """Write one shard atomically, each tensor's data as it is drawn (the disk works on a background thread
    while the next chunk is drawn)."""
    with open_atomic(path, force) as f:
        with _Writer(f) as w:
            w.put(shard_header(tensors))
            for t in tensors:
                write_tensor(w, t, count)


def write_tensor(w: _Writer, t: _Tensor, count: Callable[[int], None]) -> None:
    written = 0
    for chunk in t.chunks():
        data = chunk.contiguous().reshape(-1).view(torch.uint8).numpy()  # little-endian bytes (x86, arm)
        w.put(memoryview(data))
        written += data.nbytes
        count(data.nbytes)
    if written != t.nbytes:  # pragma: no cover - a bug in a drawing function, never a user error
        raise RuntimeError(f"{t.name}: wrote {written} bytes, header says {t.nbytes}")


class _Writer:
    """Writes buffers to a file in order on a background thread, at most WRITE_DEPTH buffers behind.

    A write error is raised by the next `put` or on exit; an error in the `with` body drops what is queued.
    """

    def __init__(self, f: BinaryIO):
        self._f = f
        self._queue: queue.Queue[memoryview | bytes | None] = queue.Queue(maxsize=WRITE_DEPTH)
        self._error: BaseException | None = None
        self._cancel = False
        self._thread = threading.Thread(target=self._run, name="synthetic-writer", daemon=True)

    def __enter__(self) -> _Writer:
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._cancel = exc_type is not None
        self._queue.put(None)
        self._thread.join()
        if self._error is not None and exc_type is None:
            raise self._error

    def put(self, data: memoryview | bytes) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(data)

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            if self._error is None and not self._cancel:
                try:
                    self._f.write(data)
                except BaseException as e:  # handed to the drawing thread
                    self._error = e
