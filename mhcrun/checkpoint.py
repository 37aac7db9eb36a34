"""Load and validate DeepSeek-layout V4 checkpoints lazily (safetensors only, never pickle).

A checkpoint directory holds `config.json`, `model.safetensors.index.json` and its shards (or one
`model.safetensors` without an index). Every shard's header is parsed and checked (length, JSON, data
offsets against the file size) and every required tensor's dtype and shape are checked from the headers
before any tensor data is read; then each shard is memory-mapped and its tensors are views of the
mapping (see `load_checkpoint`). Every problem is a one-line `CheckpointError` naming the tensor and/or the file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_save

from mhcrun.config import ModelConfig, load_config
from mhcrun.errors import CheckpointError, InputError
from mhcrun.fileio import check_out_dir, make_dirs, read_json, write_atomic
from mhcrun.ops.qlinear import dequantize_reference
from mhcrun.ops.qweight import QWeight
from mhcrun.parallel import SINGLE, Shard, check_divides
from mhcrun.weights import (
    TensorSpec,
    block_size,
    mtp_tensor_specs,
    scale_name,
    scale_shape,
    stored_format,
    tensor_specs,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Below this total shard size the weights hash covers every byte; above it only names, sizes and headers.
FULL_HASH_LIMIT = 1 << 30
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header

# safetensors dtype tag -> (torch dtype name, bytes per element)
_ST_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
_FP8_DTYPES = ("float8_e4m3fn",)
_FP4_DTYPES = ("int8", "uint8")
_SCALE_DTYPES = ("float8_e8m0fnu", "float32")
_INDEX_DTYPES = ("int32", "int64")


@dataclass
class LoadedCheckpoint:
    path: Path
    config: ModelConfig
    tensors: dict[str, torch.Tensor | QWeight]  # every spec'd name -> its tensor as stored (a view of the mapped
    # shard, or its copy on huge pages; int64 for 'index'), fp32 when loaded with dequantize; a weight stored fp8/fp4
    # and kept so: a QWeight
    quantized: set[str]  # names whose weights are stored fp8/fp4
    bytes_by_dtype: dict[str, int]  # on-disk bytes of the loaded tensors (scales included), by dtype
    unused: list[str]  # tensors in the checkpoint that the model does not use (mtp.* excluded)
    shard_files: list[Path]  # relative to path

    @functools.cached_property
    def weights_hash(self) -> str:
        """16 hex chars, see checkpoint_weights_hash; computed on first use (it may read every shard byte)."""
        return checkpoint_weights_hash(self.path, self.shard_files)


@dataclass(frozen=True)
class _HeaderEntry:
    dtype: str  # torch dtype name, or the raw safetensors tag when unknown
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0  # of the first data byte in the file


@dataclass
class _Shard:
    path: Path
    size: int
    header_len: int
    entries: dict[str, _HeaderEntry] = field(default_factory=dict)


@dataclass(frozen=True)
class TensorPlan:
    """How one stored tensor is read: its spec, the format it is stored in, its shard and its scales' shard."""

    spec: TensorSpec
    fmt: str
    shard: _Shard
    scale_shard: _Shard | None


def _fail(what: str) -> CheckpointError:
    return CheckpointError(" ".join(what.split("\n")))


def _read_shard_header(path: Path) -> _Shard:
    """Parse and check a safetensors header without reading any tensor data."""
    if not path.is_file():
        raise _fail(f"{path}: shard not found")
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _fail(f"{path}: shard truncated ({size} bytes, shorter than the 8-byte header length)")
            header_len = int.from_bytes(head, "little")
            if header_len > size - 8:
                raise _fail(f"{path}: shard truncated ({size} bytes, header alone needs {8 + header_len})")
            if header_len > _MAX_HEADER:
                raise _fail(f"{path}: corrupt safetensors header (header length {header_len} is too large)")
            blob = f.read(header_len)
    except OSError as e:
        raise _fail(f"{path}: cannot read shard ({e.strerror or e})") from None

    def corrupt(why: str) -> CheckpointError:
        return _fail(f"{path}: corrupt safetensors header ({why})")

    try:
        header = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise corrupt("not valid JSON") from None
    if not isinstance(header, dict):
        raise corrupt("not a JSON object")
    shard = _Shard(path, size, header_len)
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise corrupt(f"entry {name!r} is not an object")
        tag, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(tag, str):
            raise corrupt(f"entry {name!r} has no dtype")
        if not isinstance(shape, list) or not all(_is_nonneg_int(d) for d in shape):
            raise corrupt(f"entry {name!r} has a bad shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_nonneg_int(o) for o in offsets)
                or offsets[0] > offsets[1]):
            raise corrupt(f"entry {name!r} has bad data_offsets {offsets!r}")
        nbytes = offsets[1] - offsets[0]
        dtype_name, itemsize = _ST_DTYPES.get(tag, (tag, 0))
        if itemsize:
            numel = 1
            for d in shape:
                numel *= d
            if numel * itemsize != nbytes:
                raise corrupt(f"entry {name!r}: {nbytes} data bytes for shape {shape} of {dtype_name}")
        shard.entries[name] = _HeaderEntry(dtype_name, tuple(shape), nbytes, 8 + header_len + offsets[0])
        data_end = max(data_end, offsets[1])
    need = 8 + header_len + data_end
    if size < need:
        raise _fail(f"{path}: shard truncated ({size} bytes, header says at least {need})")
    return shard


def _is_nonneg_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _read_weight_map(root: Path) -> tuple[dict[str, str], Path]:
    """The name -> shard file map, and the file it came from (the index or the single shard)."""
    index = root / INDEX_FILE
    if index.exists():
        raw = read_json(index, CheckpointError)
        if not isinstance(raw, dict) or "weight_map" not in raw:
            raise _fail(f"{index}: no 'weight_map' object")
        wm = raw["weight_map"]
        if not isinstance(wm, dict):
            raise _fail(f"{index}: 'weight_map' is not a JSON object")
        for name, shard in wm.items():
            if not isinstance(shard, str) or not shard or Path(shard).name != shard or shard in (".", ".."):
                raise _fail(f"{index}: weight_map entry {name!r} names a bad shard file {shard!r}")
        return dict(wm), index
    single = root / SINGLE_FILE
    if single.exists():
        shard = _read_shard_header(single)
        return {name: SINGLE_FILE for name in shard.entries}, single
    raise _fail(f"{root}: no {INDEX_FILE} and no {SINGLE_FILE}")


def _check_entry(name: str, shard: _Shard, accepted: tuple[str, ...], shape: tuple[int, ...]) -> _HeaderEntry:
    entry = shard.entries.get(name)
    if entry is None:
        raise _fail(f"{name}: listed in the index for {shard.path} but absent from that shard")
    if entry.dtype not in accepted:
        raise _fail(f"{name} in {shard.path}: dtype {entry.dtype}, expected one of {', '.join(accepted)}")
    if entry.shape != shape:
        raise _fail(f"{name} in {shard.path}: shape {list(entry.shape)}, expected {list(shape)}")
    return entry


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _plan(cfg: ModelConfig, specs: list[TensorSpec], weight_map: dict[str, str], map_file: Path,
          shards: dict[str, _Shard], tp: Shard = SINGLE) -> tuple[list[TensorPlan], dict[str, int]]:
    """Check every required tensor (and scale) against the headers; no data is read here. Under --tp (`tp`) the
    bytes are this rank's share: 1/N of a split tensor, only its own routed experts."""
    plans: list[TensorPlan] = []
    bytes_by_dtype: dict[str, int] = {}
    share = 1

    def locate(name: str, what: str = "tensor") -> _Shard:
        if name not in weight_map:
            raise _fail(f"{name}: {what} missing from {map_file}{_truncation_hint(name, weight_map)}")
        return shards[weight_map[name]]

    def count(entry: _HeaderEntry) -> None:
        bytes_by_dtype[entry.dtype] = bytes_by_dtype.get(entry.dtype, 0) + entry.nbytes // share

    for spec in specs:  # an odd FP4 inner size is a config problem: report it before any tensor
        if stored_format(cfg, spec) == "fp4" and spec.shape[1] % 2:
            where = f" in {shards[weight_map[spec.name]].path}" if spec.name in weight_map else ""
            raise _fail(f"{spec.name}{where}: FP4 inner size {spec.shape[1]} is odd")
    owned = tp.experts(cfg.n_routed_experts)
    for spec in specs:
        if spec.expert is not None and spec.expert not in owned:
            continue
        fmt = stored_format(cfg, spec)
        share = tp.world if spec.split is not None else 1
        if fmt == "fp8" and share > 1 and (spec.shape[spec.split] // share) % cfg.weight_block_size:
            raise _fail(f"{spec.name}: --tp {share} would cut its FP8 scale blocks of {cfg.weight_block_size} "
                        f"(dimension {spec.split} of {spec.shape[spec.split]} into {share} parts)")
        shard = locate(spec.name)
        scale_shard = None
        if fmt == "float":
            count(_check_entry(spec.name, shard, _FLOAT_DTYPES, spec.shape))
        elif fmt == "index":
            count(_check_entry(spec.name, shard, _INDEX_DTYPES, spec.shape))
        elif fmt in ("fp8", "fp4"):
            out, inner = spec.shape
            if fmt == "fp8":
                count(_check_entry(spec.name, shard, _FP8_DTYPES, spec.shape))
            else:
                count(_check_entry(spec.name, shard, _FP4_DTYPES, (out, inner // 2)))
            sname = scale_name(spec.name)
            scale_shard = locate(sname, f"scale of {spec.name}")
            if fmt == "fp8":
                _check_block_size(cfg, spec, sname, scale_shard)
            count(_check_entry(sname, scale_shard, _SCALE_DTYPES, scale_shape(cfg, spec, fmt)))
        else:  # pragma: no cover - weights.stored_format only returns the four above
            raise _fail(f"{spec.name}: unknown stored format {fmt!r}")
        plans.append(TensorPlan(spec, fmt, shard, scale_shard))
    return plans, bytes_by_dtype


def _truncation_hint(name: str, weight_map: dict[str, str]) -> str:
    """For a missing `layers.K.*` tensor when the checkpoint holds no layer K at all: it holds the first K
    layers only (a truncated checkpoint), so say how to run it."""
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != "layers" or not parts[1].isdigit() or int(parts[1]) == 0:
        return ""
    k = int(parts[1])
    if any(n.startswith(f"layers.{k}.") for n in weight_map):
        return ""
    return f" (it holds no layer {k}: a checkpoint of the first {k} layers runs with --layers {k})"


def _check_block_size(cfg: ModelConfig, spec: TensorSpec, sname: str, shard: _Shard) -> None:
    """A scale whose shape fits another FP8 block size than the config's: say so (the config is wrong)."""
    entry = shard.entries.get(sname)
    if entry is None or len(entry.shape) != 2:
        return
    out, inner = spec.shape
    b = cfg.weight_block_size
    if entry.shape == (_ceil_div(out, b), _ceil_div(inner, b)):
        return
    fits = [k for k in (16, 32, 64, 128, 256, 512) if entry.shape == (_ceil_div(out, k), _ceil_div(inner, k))]
    if fits:
        raise _fail(f"{sname} in {shard.path}: scale shape {list(entry.shape)} fits FP8 block size {fits[0]}, but "
                    f"config.json's quantization_config.weight_block_size is {b}")


def _map_shard(shard: _Shard) -> mmap.mmap | None:
    """Map a shard copy-on-write: pages are read from the file on first touch and never written back."""
    if shard.size == 0:
        return None
    try:
        with shard.path.open("rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as e:
        raise _fail(f"{shard.path}: cannot map shard ({getattr(e, 'strerror', None) or e})") from None


def _view(mapped: mmap.mmap | None, shard: _Shard, name: str) -> torch.Tensor:
    """A tensor over the mapped bytes of `name` (no copy, unless its offset is misaligned for its dtype)."""
    entry = shard.entries[name]
    dtype = getattr(torch, entry.dtype)
    if entry.nbytes == 0 or mapped is None:
        return torch.empty(entry.shape, dtype=dtype)
    raw = torch.frombuffer(mapped, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset)
    if entry.offset % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).view(entry.shape)


def _check_index(t: torch.Tensor, plan: TensorPlan, cfg: ModelConfig) -> torch.Tensor:
    t = t.to(torch.int64)
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= cfg.n_routed_experts:
            raise _fail(f"{plan.spec.name} in {plan.shard.path}: expert ids must be in [0, {cfg.n_routed_experts}), "
                        f"found values from {lo} to {hi}")
    return t


def _checked(w: QWeight, what: str, scan: ctypes.CDLL | None) -> QWeight:
    try:
        return w.checked(what, scan)
    except ValueError as e:
        raise _fail(str(e)) from None


@dataclass
class CheckpointPlan:
    """A checked checkpoint before any tensor data is read: what loads from where, and its size."""

    root: Path
    config: ModelConfig
    plans: list[TensorPlan]
    shards: dict[str, _Shard]
    bytes_by_dtype: dict[str, int]  # of the tensors generation loads (scales included); under --tp this rank's share
    unused: list[str]
    tp: Shard = SINGLE


def plan_checkpoint(path: str | Path, n_layers: int | None = None, tp: Shard = SINGLE,
                    mtp: bool = False) -> CheckpointPlan:
    """Validate a checkpoint directory from its config, index and shard headers alone. `mtp`: the first MTP
    layer's tensors (`mtp.0.*`) as well, which must be V4's (`check_mtp`)."""
    root = Path(path)
    if not root.exists():
        raise _fail(f"{root}: checkpoint directory not found")
    if not root.is_dir():
        raise _fail(f"{root}: not a directory (expected a checkpoint directory)")
    cfg = load_config(root)
    if n_layers is not None:
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 1 <= n_layers <= cfg.n_layers:
            raise _fail(f"{root}: n_layers {n_layers!r} must be between 1 and {cfg.n_layers}")

    weight_map, map_file = _read_weight_map(root)
    shards: dict[str, _Shard] = {}
    for shard_file in sorted(set(weight_map.values())):
        shard_path = root / shard_file
        if not shard_path.is_file():
            raise _fail(f"{shard_path}: shard listed in {map_file.name} is missing")
        shards[shard_file] = _read_shard_header(shard_path)

    if tp.world > 1:
        check_divides(cfg, tp.world)
    specs = tensor_specs(cfg, n_layers)
    if mtp:
        specs += check_mtp(cfg, root, weight_map)
    plans, bytes_by_dtype = _plan(cfg, specs, weight_map, map_file, shards, tp)
    known: set[str] = set()
    for spec in tensor_specs(cfg):
        known.add(spec.name)
        if stored_format(cfg, spec) in ("fp8", "fp4"):
            known.add(scale_name(spec.name))
    unused = sorted(n for n in weight_map if n not in known and not n.startswith("mtp."))
    return CheckpointPlan(root, cfg, plans, shards, bytes_by_dtype, unused, tp)


def check_mtp(cfg: ModelConfig, root: Path, weight_map: dict[str, str]) -> list[TensorSpec]:
    """The first MTP layer's tensor specs, after checking the checkpoint has one: the config's
    num_nextn_predict_layers and its compress ratio, and `mtp.0.*` in the index (names and shapes are then
    checked against the headers like every tensor's: another drafter under `mtp.*` fails there, by name)."""
    if cfg.n_mtp_layers < 1:
        raise _fail(f"{root}: no MTP layer to draft with (num_nextn_predict_layers is 0 in config.json)")
    if len(cfg.compress_ratios) <= cfg.n_layers:
        raise _fail(f"{root}: config.json's compress_ratios has no entry for the MTP layer (layer "
                    f"{cfg.n_layers})")
    if not any(n.startswith("mtp.0.") for n in weight_map):
        raise _fail(f"{root}: no MTP layer to draft with (config.json says num_nextn_predict_layers "
                    f"{cfg.n_mtp_layers}, but no mtp.0.* tensor is in the index)")
    return [s for s in mtp_tensor_specs(cfg) if s.name.startswith("mtp.0.")]


def load_checkpoint(path: str | Path, n_layers: int | None = None,
                    progress: Callable[[int, int], None] | None = None, dequantize: bool = False,
                    tp: Shard = SINGLE, mtp: bool = False, scan: ctypes.CDLL | None = None,
                    place: Callable[[dict[str, torch.Tensor | QWeight]], None] | None = None) -> LoadedCheckpoint:
    """Validate a checkpoint directory and load the tensors of layers [0, n_layers) (all by default).

    All headers, dtypes and shapes are checked before any tensor data is read. Then each shard is
    memory-mapped in turn and its tensors become views of the mapping, in their stored dtypes: FP8/FP4
    weights stay quantised (a QWeight each: bytes, scale, block, checked here once), float tensors stay
    bf16/fp32; nothing is copied but `tid2eid` (int64, range-checked). Under --tp (`tp`) each is this rank's
    share (`Shard.take`, `QWeight.share`: a scale with its weight). With `dequantize`, every float tensor is fp32
    and every FP8/FP4 weight is dequantised to fp32 (the reference the quantised path is checked against).
    `progress(done_bytes, total_bytes)` is called after each tensor. `scan`: scan.cpp's library, which checks the
    quantised weights' scales (`QWeight.checked`; without it, torch's reference does). `place(tensors)`, where
    given, moves each shard's tensors off its mapping once they are loaded (`hugepages.place`: copies on huge
    pages), and the mapping is released before the next shard's.
    """
    plan = plan_checkpoint(path, n_layers, tp, mtp)
    cfg = plan.config
    by_shard: dict[Path, list[TensorPlan]] = {}
    for p in plan.plans:
        by_shard.setdefault(p.shard.path, []).append(p)
    shard_of = {s.path: s for s in plan.shards.values()}
    total = sum(plan.bytes_by_dtype.values())
    tensors: dict[str, torch.Tensor | QWeight] = {}
    mapped: dict[Path, mmap.mmap | None] = {}
    done = 0

    def view(shard: _Shard, name: str) -> torch.Tensor:
        if shard.path not in mapped:
            mapped[shard.path] = _map_shard(shard)
        return _view(mapped[shard.path], shard, name)

    for shard_path in sorted(by_shard):  # shard by shard, in file order
        loaded: dict[str, torch.Tensor | QWeight] = {}
        for p in by_shard[shard_path]:
            name = p.spec.name
            stored = view(shard_of[shard_path], name)
            done += p.shard.entries[name].nbytes
            if p.fmt in ("fp8", "fp4"):
                assert p.scale_shard is not None
                scale = view(p.scale_shard, scale_name(name))
                done += p.scale_shard.entries[scale_name(name)].nbytes
                w = _checked(QWeight(stored, scale, block_size(cfg, p.fmt)).share(p.spec.split, tp),
                             f"{name} in {p.shard.path}", scan)
                loaded[name] = dequantize_reference(w) if dequantize else w
            else:
                t = tp.take(stored, p.spec.split)
                if p.fmt == "index":
                    t = _check_index(t, p, cfg)
                loaded[name] = t.float() if dequantize and p.fmt == "float" else t
            if progress is not None:
                progress(done, total)
        if place is not None:
            place(loaded)
        tensors.update(loaded)
        if dequantize or place is not None:  # nothing refers to this shard's mapping any more: unmap it now
            mapped.pop(shard_path, None)
    tensors = {p.spec.name: tensors[p.spec.name] for p in plan.plans}  # spec order
    quantized = {p.spec.name for p in plan.plans if p.fmt in ("fp8", "fp4")}
    return LoadedCheckpoint(plan.root, cfg, tensors, quantized, plan.bytes_by_dtype, plan.unused,
                            [Path(name) for name in plan.shards])


def stored_tensors(plan: CheckpointPlan) -> Iterator[tuple[str, str, str, torch.Tensor]]:
    """Every tensor a run loads and every scale, as stored (views of the mapped shards, one shard at a time, in
    file order) -> (name, role, weight format, tensor): role "float", "codes" (FP8 e4m3 data), "packed" (FP4
    data: every code is a number), "scale" or "index"."""
    items: dict[Path, list[tuple[str, str, str, _Shard]]] = {}
    for p in plan.plans:
        role = {"fp8": "codes", "fp4": "packed"}.get(p.fmt, p.fmt)
        items.setdefault(p.shard.path, []).append((p.spec.name, role, p.fmt, p.shard))
        if p.scale_shard is not None:
            items.setdefault(p.scale_shard.path, []).append((scale_name(p.spec.name), "scale", p.fmt,
                                                             p.scale_shard))
    for path in sorted(items):
        mapped = None
        for name, role, fmt, shard in items[path]:
            if mapped is None:
                mapped = _map_shard(shard)
            yield name, role, fmt, _view(mapped, shard, name)


def inspect_checkpoint(path: str | Path, n_layers: int | None = None) -> dict[str, Any]:
    """What `mhcrun info` shows: path, config, layer kinds, parameters and on-disk bytes by dtype.

    Reads the config, the index and the shard headers only (no tensor data).
    """
    plan = plan_checkpoint(path, n_layers)
    cfg = plan.config
    params = 0
    for p in plan.plans:
        n = 1
        for d in p.spec.shape:
            n *= d
        params += n
    kinds = [{"layer": i, "attention": cfg.layer_kind(i), "ratio": cfg.compress_ratios[i], "moe": cfg.moe_kind(i)}
             for i in range(n_layers or cfg.n_layers)]
    return {
        "path": str(plan.root.resolve()),
        "config": cfg.to_dict(),
        "config_hash": cfg.fingerprint(),
        "layer_kinds": kinds,
        "params": params,
        "bytes_by_dtype": dict(sorted(plan.bytes_by_dtype.items())),
        "total_bytes": sum(plan.bytes_by_dtype.values()),
        "shards": len(plan.shards),
        "unused_tensors": plan.unused,
    }


def checkpoint_weights_hash(path: Path, shard_files: list[Path]) -> str:
    """16 hex chars of a sha256 identifying the weights.

    Shards are taken in sorted file-name order. When their total size is below 1 GiB (FULL_HASH_LIMIT)
    each shard contributes its file name and full bytes; above that, to keep start-up fast on real
    checkpoints, each contributes its file name, size and safetensors header bytes only (so a change in
    tensor data that keeps the header identical is not detected there). Relative shard paths are taken
    relative to `path`.
    """
    root = Path(path)
    files = sorted((f if Path(f).is_absolute() else root / f for f in map(Path, shard_files)),
                   key=lambda p: p.name)
    try:
        sizes = [f.stat().st_size for f in files]
        full = sum(sizes) < FULL_HASH_LIMIT
        h = hashlib.sha256()
        h.update(b"full\0" if full else b"headers\0")
        for f, size in zip(files, sizes, strict=True):
            h.update(f.name.encode() + b"\0")
            h.update(size.to_bytes(8, "little"))
            with f.open("rb") as fh:
                if full:
                    while chunk := fh.read(1 << 20):
                        h.update(chunk)
                else:
                    head = fh.read(8)
                    h.update(head)
                    if len(head) == 8:
                        h.update(fh.read(min(int.from_bytes(head, "little"), _MAX_HEADER)))
    except OSError as e:
        raise _fail(f"{root}: cannot read shard for hashing ({e})") from None
    return h.hexdigest()[:16]


def _check_file_name(name: str) -> None:
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise InputError(f"{name!r}: extra file names must be plain file names")


def _split_groups(sizes: list[int], n: int) -> list[tuple[int, int]]:
    """Split items (in order) into n contiguous non-empty groups of roughly equal total size."""
    total = sum(sizes)
    cum = [0]
    for s in sizes:
        cum.append(cum[-1] + s)
    groups = []
    start = 0
    for k in range(n):
        left = n - k  # groups still to make, this one included
        if left == 1:
            end = len(sizes)
        else:
            target = total * (k + 1) / n
            end = start + 1
            while end < len(sizes) - (left - 1) and cum[end] < target:
                end += 1
            # take the boundary on whichever side of the target is nearer
            if end - 1 > start and abs(cum[end - 1] - target) < abs(cum[end] - target):
                end -= 1
        groups.append((start, end))
        start = end
    return groups


def write_checkpoint(out_dir: str | Path, config_raw: dict, tensors: dict[str, torch.Tensor],
                     n_shards: int = 2, extra_files: dict[str, str] | None = None,
                     force: bool = False) -> Path:
    """Write a DeepSeek-layout checkpoint: config.json, `model-0000i-of-0000n.safetensors` shards (tensors
    in order, split into contiguous groups of roughly equal bytes), the index and `extra_files`.

    Refuses (InputError) a non-empty existing `out_dir` unless `force`. Returns the directory.
    """
    out = check_out_dir(out_dir, force)
    if isinstance(n_shards, bool) or not isinstance(n_shards, int) or n_shards < 1:
        raise InputError(f"n_shards must be a positive integer, got {n_shards!r}")
    extra = dict(extra_files or {})
    for name in extra:
        _check_file_name(name)

    items: list[tuple[str, torch.Tensor]] = []
    seen_storage: set[tuple[str, int]] = set()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name}: not a tensor ({type(t).__name__})")
        t = t.detach().to("cpu").contiguous()
        key = (str(t.device), t.untyped_storage().data_ptr())
        if t.numel() and key in seen_storage:  # safetensors refuses tensors sharing memory
            t = t.clone()
        seen_storage.add(key)
        items.append((name, t))

    n = max(1, min(n_shards, len(items)))
    groups = _split_groups([t.nbytes for _, t in items], n) if items else [(0, 0)]
    weight_map: dict[str, str] = {}
    total_size = 0
    make_dirs(out)
    write_atomic(out / "config.json", json.dumps(config_raw, indent=2), force=force)
    for i, (a, b) in enumerate(groups, 1):
        shard_name = f"model-{i:05d}-of-{n:05d}.safetensors"
        group = dict(items[a:b])
        write_atomic(out / shard_name, safetensors_save(group, metadata={"format": "pt"}), force=force)
        for name, t in group.items():
            weight_map[name] = shard_name
            total_size += t.nbytes
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    write_atomic(out / INDEX_FILE, json.dumps(index, indent=2), force=force)
    for name, text in extra.items():
        write_atomic(out / name, text, force=force)
    return out
