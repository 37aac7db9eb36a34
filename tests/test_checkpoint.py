"""Loading, validating and writing DeepSeek-layout checkpoints (tiny random weights in a tmp dir)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import mhcrun.checkpoint as ckpt
from mhcrun.checkpoint import INDEX_FILE, checkpoint_weights_hash, load_checkpoint, write_checkpoint
from mhcrun.config import config_from_hf
from mhcrun.errors import CheckpointError, ConfigError, InputError
from mhcrun.ops.quant import dequantize_fp4, dequantize_fp8, quantize_weight_fp4, quantize_weight_fp8
from mhcrun.ops.qweight import QWeight
from mhcrun.weights import scale_name, stored_format, tensor_specs

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.json"
BLOCK = 32
N_EXPERTS = 4
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


def tiny_raw(quant: bool = False, **overrides) -> dict:
    raw = json.loads(TINY.read_text())
    raw.update(vocab_size=64, n_routed_experts=N_EXPERTS, num_experts_per_tok=2)
    if quant:
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                      "weight_block_size": [BLOCK, BLOCK]}
        raw["expert_dtype"] = "fp4"
    raw.update(overrides)
    return raw


def make_tensors(raw: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors of the right shapes, stored the way `stored_format` says (quantised when asked)."""
    cfg = config_from_hf(raw)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for k, spec in enumerate(tensor_specs(cfg)):
        fmt = stored_format(cfg, spec)
        if fmt == "index":
            ids = torch.randint(0, cfg.n_routed_experts, spec.shape, generator=gen, dtype=torch.int32)
            out[spec.name] = ids
            continue
        w = torch.randn(spec.shape, generator=gen) * 0.05
        if fmt == "float":
            # hc_*, attn_sink, ape and the gate bias are fp32 in the release; the rest bf16 (some fp16 too)
            short = spec.name.rsplit(".", 1)[-1]
            if short.startswith("hc_") or short in ("attn_sink", "ape", "bias"):
                out[spec.name] = w
            else:
                out[spec.name] = w.to(torch.float16 if k % 7 == 0 else torch.bfloat16)
        elif fmt == "fp8":
            q, s = quantize_weight_fp8(w, cfg.weight_block_size)
            out[spec.name] = q
            out[scale_name(spec.name)] = s if k % 2 else s.float()  # e8m0 and fp32 scales both accepted
        else:
            packed, s = quantize_weight_fp4(w)
            out[spec.name] = packed
            out[scale_name(spec.name)] = s
    return out


def expected_value(raw: dict, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    cfg = config_from_hf(raw)
    spec = next(s for s in tensor_specs(cfg) if s.name == name)
    fmt = stored_format(cfg, spec)
    t = tensors[name]
    if fmt == "fp8":
        return dequantize_fp8(t, tensors[scale_name(name)], cfg.weight_block_size)
    if fmt == "fp4":
        return dequantize_fp4(t, tensors[scale_name(name)])
    if fmt == "index":
        return t.long()
    return t.float()


@pytest.fixture(scope="module")
def plain() -> tuple[dict, dict[str, torch.Tensor]]:
    raw = tiny_raw()
    return raw, make_tensors(raw)


@pytest.fixture(scope="module")
def quant() -> tuple[dict, dict[str, torch.Tensor]]:
    raw = tiny_raw(quant=True)
    return raw, make_tensors(raw, seed=1)


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory, plain) -> Path:
    raw, tensors = plain
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "good", raw, tensors,
                            extra_files={"tokenizer.json": "{}"})


@pytest.fixture(scope="module")
def quant_dir(tmp_path_factory, quant) -> Path:
    raw, tensors = quant
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "quant", raw, tensors, n_shards=3)


# ---------------------------------------------------------------- good checkpoints


def test_good_checkpoint_loads(good_dir, plain):
    raw, tensors = plain
    calls: list[tuple[int, int]] = []
    ck = load_checkpoint(good_dir, progress=lambda d, t: calls.append((d, t)), dequantize=True)
    names = [s.name for s in tensor_specs(ck.config)]
    assert list(ck.tensors) == names
    assert ck.quantized == set() and ck.unused == []
    for name in names:
        t = ck.tensors[name]
        assert t.dtype == (torch.int64 if name.endswith("tid2eid") else torch.float32), name
        assert torch.equal(t, expected_value(raw, tensors, name)), name
    total = sum(t.nbytes for t in tensors.values())
    assert len(calls) == len(names) and calls[-1] == (total, total)
    assert all(a[0] < b[0] for a, b in zip(calls, calls[1:], strict=False))
    assert set(ck.bytes_by_dtype) == {"float32", "bfloat16", "float16", "int32"}
    assert sum(ck.bytes_by_dtype.values()) == sum(t.nbytes for t in tensors.values())
    assert len(ck.weights_hash) == 16 and int(ck.weights_hash, 16) >= 0
    assert ck.path == good_dir and ck.config.vocab_size == 64


def test_written_layout(good_dir, plain):
    raw, tensors = plain
    files = sorted(p.name for p in good_dir.iterdir())
    assert files == sorted(["config.json", INDEX_FILE, SHARD1, SHARD2, "tokenizer.json"])
    assert json.loads((good_dir / "config.json").read_text()) == raw
    index = json.loads((good_dir / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert list(index["weight_map"]) == list(tensors)
    # contiguous groups in order, of roughly equal bytes
    shards = [index["weight_map"][n] for n in tensors]
    assert shards == sorted(shards) and set(shards) == {SHARD1, SHARD2}
    s1 = sum(t.nbytes for n, t in tensors.items() if index["weight_map"][n] == SHARD1)
    assert 0.3 < s1 / index["metadata"]["total_size"] < 0.7


def test_checkpoint_maps_stored_tensors(good_dir, plain):
    """Without dequantize, every tensor is a view of the mapped shard in its stored dtype (no copy)."""
    raw, tensors = plain
    ck = load_checkpoint(good_dir)
    for name, t in ck.tensors.items():
        if name.endswith("tid2eid"):
            assert t.dtype == torch.int64
            continue
        assert t.dtype == tensors[name].dtype and torch.equal(t, tensors[name]), name
    embed = ck.tensors["embed.weight"]
    assert not embed.untyped_storage().resizable()  # an external (mapped) buffer, not a torch allocation


def test_quantized_checkpoint_kept_quantised(quant_dir, quant):
    raw, tensors = quant
    ck = load_checkpoint(quant_dir)
    assert {n for n, t in ck.tensors.items() if isinstance(t, QWeight)} == ck.quantized
    for name in ck.quantized:
        w = ck.tensors[name]
        assert w.data.dtype == tensors[name].dtype and torch.equal(w.data.view(torch.uint8),
                                                                   tensors[name].view(torch.uint8))
        scale = tensors[scale_name(name)]
        assert torch.equal(w.scale.view(torch.uint8), scale.view(torch.uint8)), name
        assert w.fmt == ("fp8" if w.data.dtype == torch.float8_e4m3fn else "fp4") and w.block in (32, 128), name


def test_quantized_checkpoint_loads(quant_dir, quant):
    raw, tensors = quant
    ck = load_checkpoint(quant_dir, dequantize=True)
    cfg = ck.config
    specs = tensor_specs(cfg)
    want_q = {s.name for s in specs if stored_format(cfg, s) in ("fp8", "fp4")}
    assert ck.quantized == want_q
    assert any(".experts." in n for n in want_q) and "layers.0.attn.wq_a.weight" in want_q
    for s in specs:
        assert torch.equal(ck.tensors[s.name], expected_value(raw, tensors, s.name)), s.name
        assert ck.tensors[s.name].dtype in (torch.float32, torch.int64)
    assert {"float8_e4m3fn", "int8", "float8_e8m0fnu", "float32", "bfloat16"} <= set(ck.bytes_by_dtype)
    assert sum(ck.bytes_by_dtype.values()) == sum(t.nbytes for t in tensors.values())
    assert ck.unused == []
    assert len({p.name for p in quant_dir.glob("*.safetensors")}) == 3


def test_n_layers(good_dir):
    ck = load_checkpoint(good_dir, n_layers=2)
    assert list(ck.tensors) == [s.name for s in tensor_specs(ck.config, 2)]
    assert not any(n.startswith("layers.2.") for n in ck.tensors)
    assert ck.unused == []  # layers beyond n_layers are known tensors, not unused ones


@pytest.mark.parametrize("n", [0, 5, -1])
def test_n_layers_out_of_range(good_dir, n):
    with pytest.raises(CheckpointError, match="n_layers"):
        load_checkpoint(good_dir, n_layers=n)


def test_mtp_and_extra_tensors(tmp_path, plain):
    raw, tensors = plain
    extra = dict(tensors)
    extra["mtp.0.attn.wq_a.weight"] = torch.zeros(3, 3)
    extra["mtp.0.ffn.experts.0.w1.scale"] = torch.zeros(2)
    extra["vision.proj.weight"] = torch.ones(2, 2)
    extra["norm.scale"] = torch.ones(1)  # a scale for an unquantised tensor is not used
    d = write_checkpoint(tmp_path / "ck", raw, extra, n_shards=3)
    ck = load_checkpoint(d)
    assert not any(n.startswith("mtp.") for n in ck.tensors)
    assert ck.unused == ["norm.scale", "vision.proj.weight"]


def test_single_file_checkpoint(tmp_path, plain):
    raw, tensors = plain
    d = write_checkpoint(tmp_path / "ck", raw, tensors, n_shards=1)
    (d / INDEX_FILE).unlink()
    (d / "model-00001-of-00001.safetensors").rename(d / "model.safetensors")
    ck = load_checkpoint(d)
    assert torch.equal(ck.tensors["embed.weight"], tensors["embed.weight"])


# ---------------------------------------------------------------- hash


def test_weights_hash(tmp_path, plain, good_dir):
    raw, tensors = plain
    h0 = load_checkpoint(good_dir, n_layers=1).weights_hash
    same = write_checkpoint(tmp_path / "same", raw, tensors, extra_files={"tokenizer.json": "[]"})
    shards = sorted(same.glob("*.safetensors"))
    assert checkpoint_weights_hash(same, shards) == h0  # tokenizer and location do not matter
    assert checkpoint_weights_hash(same, [p.name for p in reversed(shards)]) == h0
    changed = dict(tensors)
    changed["norm.weight"] = changed["norm.weight"] + 1
    other = write_checkpoint(tmp_path / "other", raw, changed)
    h_other = checkpoint_weights_hash(other, sorted(other.glob("*.safetensors")))
    assert h_other != h0


def test_weights_hash_header_only_above_limit(tmp_path, plain, monkeypatch):
    raw, tensors = plain
    a = write_checkpoint(tmp_path / "a", raw, tensors)
    changed = dict(tensors)
    changed["norm.weight"] = changed["norm.weight"] + 1  # same header, other data
    b = write_checkpoint(tmp_path / "b", raw, changed)
    full_a = checkpoint_weights_hash(a, sorted(a.glob("*.safetensors")))
    monkeypatch.setattr(ckpt, "FULL_HASH_LIMIT", 0)
    ha = checkpoint_weights_hash(a, sorted(a.glob("*.safetensors")))
    hb = checkpoint_weights_hash(b, sorted(b.glob("*.safetensors")))
    assert ha == hb != full_a


# ---------------------------------------------------------------- write_checkpoint


def test_write_refuses_non_empty_dir(tmp_path, plain):
    raw, tensors = plain
    small = {"norm.weight": tensors["norm.weight"], "embed.weight": tensors["embed.weight"]}
    d = tmp_path / "out"
    d.mkdir()
    write_checkpoint(d, raw, small)  # empty existing dir is fine
    with pytest.raises(InputError, match="out"):
        write_checkpoint(d, raw, small)
    write_checkpoint(d, raw, small, force=True)
    assert set(load_file(d / SHARD1)) | set(load_file(d / SHARD2)) == set(small)


def test_write_non_contiguous_and_shared(tmp_path, plain):
    raw, _ = plain
    base = torch.arange(12.0).reshape(3, 4)
    tensors = {"a": base.T, "b": base, "c": base}
    d = write_checkpoint(tmp_path / "nc", raw, tensors, n_shards=1)
    got = load_file(d / "model-00001-of-00001.safetensors")
    assert torch.equal(got["a"], base.T) and torch.equal(got["c"], base)


# ---------------------------------------------------------------- errors


def _rewrite(raw_or_tensors: Callable[[dict, dict], tuple[dict, dict]]):
    """A case that writes a fresh checkpoint from modified (raw config, tensors)."""

    def make(tmp: Path, plain, quant) -> Path:
        raw, tensors = raw_or_tensors(dict(plain[0]), dict(plain[1]))
        return write_checkpoint(tmp / "ck", raw, tensors)

    return make


def _rewrite_quant(fn: Callable[[dict, dict], tuple[dict, dict]]):
    def make(tmp: Path, plain, quant) -> Path:
        raw, tensors = fn(dict(quant[0]), dict(quant[1]))
        return write_checkpoint(tmp / "ck", raw, tensors)

    return make


def _copy(fn: Callable[[Path], Path | None]):
    """A case that damages a copy of the good checkpoint on disk."""

    def make(tmp: Path, plain, quant, good: Path) -> Path:
        d = tmp / "ck"
        shutil.copytree(good, d)
        return fn(d) or d

    make.needs_good = True  # type: ignore[attr-defined]
    return make


def _edit_index(fn: Callable[[dict], object]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        index = json.loads((d / INDEX_FILE).read_text())
        fn(index)
        (d / INDEX_FILE).write_text(json.dumps(index))

    return edit


def _set(tensors: dict, name: str, value: torch.Tensor) -> dict:
    tensors[name] = value
    return tensors


def _drop(tensors: dict, name: str) -> dict:
    del tensors[name]
    return tensors


def _write(name: str, data: str | bytes) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        (d / name).write_bytes(data.encode() if isinstance(data, str) else data)

    return edit


def _remove_all_shards(d: Path) -> None:
    for f in d.glob("*.safetensors*"):
        f.unlink()


def _a_file(tmp: Path, plain, quant) -> Path:
    p = tmp / "afile"
    p.write_text("x")
    return p


def _truncate(d: Path) -> None:
    p = d / SHARD2
    data = p.read_bytes()
    p.write_bytes(data[:-10])


def _corrupt_header(d: Path) -> None:
    p = d / SHARD1
    data = bytearray(p.read_bytes())
    data[8:12] = b"!@#$"
    p.write_bytes(bytes(data))


def _header_too_long(d: Path) -> None:
    p = d / SHARD1
    data = bytearray(p.read_bytes())
    data[:8] = (len(data) + 5).to_bytes(8, "little")
    p.write_bytes(bytes(data))


def _move_to_other_shard(index: dict) -> None:
    index["weight_map"]["norm.weight"] = SHARD2 if index["weight_map"]["norm.weight"] == SHARD1 else SHARD1


WQ = "layers.0.attn.wq_a.weight"
W2 = "layers.1.ffn.experts.0.w2.weight"
TID = "layers.0.ffn.gate.tid2eid"

ERROR_CASES = {
    "dir_missing": (lambda tmp, p, q: tmp / "nowhere", "nowhere"),
    "not_a_dir": (_a_file, "afile"),
    "no_index_no_single": (_copy(_remove_all_shards), "model.safetensors"),
    "index_not_json": (_copy(_write(INDEX_FILE, "{nope")), INDEX_FILE),
    "index_no_weight_map": (_copy(_write(INDEX_FILE, '{"metadata": {}}')), INDEX_FILE),
    "index_weight_map_not_object": (_copy(_write(INDEX_FILE, '{"weight_map": [1]}')), INDEX_FILE),
    "shard_missing": (_copy(lambda d: (d / SHARD2).unlink()), SHARD2),
    "shard_truncated": (_copy(_truncate), SHARD2),
    "header_longer_than_file": (_copy(_header_too_long), SHARD1),
    "header_corrupt": (_copy(_corrupt_header), SHARD1),
    "shard_tiny": (_copy(_write(SHARD1, b"abc")), SHARD1),
    "tensor_missing_from_index": (_copy(_edit_index(lambda i: i["weight_map"].pop("norm.weight"))),
                                  "norm.weight"),
    "tensor_absent_from_shard": (_copy(_edit_index(_move_to_other_shard)), "norm.weight"),
    "wrong_shape": (_rewrite(lambda r, t: (r, _set(t, WQ, torch.zeros(64, 100)))), WQ),
    "wrong_dtype": (_rewrite(lambda r, t: (r, _set(t, "norm.weight", torch.zeros(128, dtype=torch.float64)))),
                    "norm.weight"),
    "float_stored_as_fp8": (_rewrite(lambda r, t: (r, _set(t, WQ, t[WQ].to(torch.float8_e4m3fn)))), WQ),
    "index_wrong_dtype": (_rewrite(lambda r, t: (r, _set(t, TID, t[TID].float()))), TID),
    "tid2eid_out_of_range": (_rewrite(lambda r, t: (r, _set(t, TID, torch.full_like(t[TID], N_EXPERTS)))),
                             TID),
    "tid2eid_negative": (_rewrite(lambda r, t: (r, _set(t, TID, torch.full_like(t[TID], -1)))), TID),
    "fp8_not_quantised": (_rewrite_quant(lambda r, t: (r, _set(t, WQ, t[WQ].float()))), WQ),
    "scale_missing": (_rewrite_quant(lambda r, t: (r, _drop(t, scale_name(WQ)))), scale_name(WQ)),
    "scale_wrong_shape": (_rewrite_quant(lambda r, t: (r, _set(t, scale_name(WQ), torch.ones(2, 2)))),
                          scale_name(WQ)),
    "scale_wrong_dtype": (_rewrite_quant(lambda r, t: (r, _set(t, scale_name(WQ), torch.ones(2, 4).half()))),
                          scale_name(WQ)),
    "fp4_wrong_shape": (_rewrite_quant(lambda r, t: (r, _set(t, W2, torch.zeros(128, 64, dtype=torch.int8)))),
                        W2),
    "fp4_scale_wrong_shape": (_rewrite_quant(lambda r, t: (r, _set(t, scale_name(W2), torch.ones(128, 1)))),
                              scale_name(W2)),
    "fp4_odd_inner": (_rewrite_quant(lambda r, t: ({**r, "moe_intermediate_size": 63}, t)), "w2.weight"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors(case, tmp_path, plain, quant, good_dir):
    make, needle = ERROR_CASES[case]
    if getattr(make, "needs_good", False):
        d = make(tmp_path, plain, quant, good_dir)
    else:
        d = make(tmp_path, plain, quant)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(d)
    msg = str(info.value)
    assert needle in msg, msg
    assert "\n" not in msg


def test_wrong_dtype_message_names_dtypes(tmp_path, plain):
    raw, tensors = plain
    d = write_checkpoint(tmp_path / "ck", raw, _set(dict(tensors), "norm.weight", torch.zeros(128).double()))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(d)
    msg = str(info.value)
    assert "float64" in msg and "float32" in msg and "bfloat16" in msg and SHARD1 in msg


def test_wrong_shape_message(tmp_path, plain):
    raw, tensors = plain
    d = write_checkpoint(tmp_path / "ck", raw, _set(dict(tensors), WQ, torch.zeros(64, 100)))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(d)
    assert str(info.value) == f"{WQ} in {d / SHARD1}: shape [64, 100], expected [64, 128]"


def test_missing_config_is_config_error(tmp_path, good_dir):
    d = tmp_path / "ck"
    shutil.copytree(good_dir, d)
    (d / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        load_checkpoint(d)


def test_bad_shard_name_in_index(tmp_path, good_dir):
    d = tmp_path / "ck"
    shutil.copytree(good_dir, d)
    _edit_index(lambda i: i["weight_map"].__setitem__("norm.weight", "../evil.safetensors"))(d)
    with pytest.raises(CheckpointError, match="evil"):
        load_checkpoint(d)


def test_header_size_mismatch_is_corrupt(tmp_path):
    p = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(4)}, p)
    data = p.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["a"]["shape"] = [5]
    blob = json.dumps(header, separators=(",", ":")).encode()
    assert len(blob) <= n
    blob = blob.ljust(n)
    p.write_bytes(data[:8] + blob + data[8 + n:])
    with pytest.raises(CheckpointError, match="corrupt"):
        ckpt._read_shard_header(p)
