"""Synthetic full-width checkpoints (`mhcrun.synthetic`), on a V4-mid config shrunk to test size."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import mhcrun.synthetic as synthetic
from mhcrun.checkpoint import INDEX_FILE, plan_checkpoint
from mhcrun.config import ModelConfig, load_config
from mhcrun.errors import InputError
from mhcrun.ops.quant import dequantize_fp4, dequantize_fp8, e8m0_to_float
from mhcrun.synthetic import make_synthetic
from mhcrun.tiny import HEAD_GAIN
from mhcrun.weights import scale_name, stored_format, tensor_specs

MID = Path(__file__).resolve().parent.parent / "configs" / "v4-mid.json"
SMALL = dict(hidden_size=256, n_routed_experts=8, moe_intermediate_size=128, vocab_size=1024, q_lora_rank=128,
             o_lora_rank=64, num_attention_heads=4, head_dim=128, qk_rope_head_dim=64, index_n_heads=4,
             index_head_dim=64)
N_LAYERS = 4  # all of V4-mid's layers: window, CSA, HCA; hash-routed layer 0, then score-routed


def small_raw(quantised: bool = True) -> dict:
    raw = json.loads(MID.read_text())
    raw.update(SMALL)
    if not quantised:
        del raw["quantization_config"], raw["expert_dtype"]
    return raw


def write_config(directory: Path, raw: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps(raw, indent=2))
    return path


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(tmp_path_factory.mktemp("config"), small_raw())


@pytest.fixture(scope="module")
def cfg(config_file: Path) -> ModelConfig:
    return load_config(config_file)


@pytest.fixture(scope="module")
def ckpt(config_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_synthetic(config_file, tmp_path_factory.mktemp("synth") / "ckpt", N_LAYERS, seed=0)


def read_all(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, read with safetensors itself."""
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(root.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                out[name] = f.get_tensor(name)
    return out


def dir_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def rms(t: torch.Tensor) -> float:
    return t.double().square().mean().sqrt().item()


def test_small_config_is_a_valid_quantised_v4(cfg: ModelConfig):
    assert cfg.quant_method == "fp8" and cfg.expert_dtype == "fp4" and cfg.weight_block_size == 128
    assert cfg.n_layers == N_LAYERS and cfg.dim == 256 and cfg.n_routed_experts == 8


def test_checkpoint_passes_the_repo_checker(ckpt: Path):
    plan = plan_checkpoint(ckpt, N_LAYERS)
    assert plan.unused == []
    assert {p.spec.name for p in plan.plans} == {s.name for s in tensor_specs(plan.config, N_LAYERS)}


def test_every_tensor_is_stored_in_the_release_format(ckpt: Path, cfg: ModelConfig):
    tensors = read_all(ckpt)
    expected: set[str] = set()
    b = cfg.weight_block_size
    for spec in tensor_specs(cfg, N_LAYERS):
        t = tensors[spec.name]
        expected.add(spec.name)
        fmt = stored_format(cfg, spec)
        if fmt in ("fp8", "fp4"):
            expected.add(scale_name(spec.name))
            scale = tensors[scale_name(spec.name)]
            assert scale.dtype == torch.float8_e8m0fnu, spec.name
            out, inner = spec.shape
        if fmt == "fp8":
            assert t.dtype == torch.float8_e4m3fn and t.shape == spec.shape, spec.name
            assert scale.shape == (math.ceil(out / b), math.ceil(inner / b)), spec.name
        elif fmt == "fp4":
            assert t.dtype == torch.int8 and t.shape == (out, inner // 2), spec.name
            assert scale.shape == (out, math.ceil(inner / 32)), spec.name
        elif fmt == "index":
            assert t.dtype == torch.int32 and t.shape == spec.shape
        else:
            fp32 = spec.name.startswith("hc_") or ".hc_" in spec.name or spec.name.endswith(
                ("attn_sink", "ape", "gate.bias"))
            assert t.dtype == (torch.float32 if fp32 else torch.bfloat16), spec.name
            assert t.shape == spec.shape and bool(torch.isfinite(t).all()), spec.name
    assert set(tensors) == expected


def test_dequantised_weights_are_finite_with_linear_rms(ckpt: Path, cfg: ModelConfig):
    tensors = read_all(ckpt)
    n_checked = 0
    for spec in tensor_specs(cfg, N_LAYERS):
        fmt = stored_format(cfg, spec)
        if fmt not in ("fp8", "fp4"):
            continue
        w, scale = tensors[spec.name], tensors[scale_name(spec.name)]
        if fmt == "fp8":
            codes = w.view(torch.uint8)
            assert not bool(((codes == 0x7F) | (codes == 0xFF)).any()), f"{spec.name}: NaN codes"
            x = dequantize_fp8(w, scale, cfg.weight_block_size)
        else:
            x = dequantize_fp4(w, scale)
        assert bool(torch.isfinite(x).all()), spec.name
        ratio = rms(x) * math.sqrt(spec.shape[1])
        assert 0.5 < ratio < 2.0, f"{spec.name}: rms {ratio:.3f} / sqrt(in)"
        n_checked += 1
    assert n_checked > 3 * cfg.n_routed_experts * N_LAYERS


def test_tid2eid_rows_are_distinct_experts(ckpt: Path, cfg: ModelConfig):
    ids = read_all(ckpt)["layers.0.ffn.gate.tid2eid"].long()  # [vocab, k]
    assert ids.shape == (cfg.vocab_size, cfg.n_activated_experts)
    assert int(ids.min()) >= 0 and int(ids.max()) < cfg.n_routed_experts
    assert bool((ids.sort(dim=1).values.diff(dim=1) > 0).all())
    assert len(torch.unique(ids)) == cfg.n_routed_experts  # every expert is used somewhere


def test_written_config_is_the_source_config(ckpt: Path, config_file: Path):
    assert json.loads((ckpt / "config.json").read_text()) == json.loads(config_file.read_text())


def test_same_seed_same_bytes_other_seed_other_bytes(ckpt: Path, config_file: Path, tmp_path: Path):
    again = make_synthetic(config_file, tmp_path / "again", N_LAYERS, seed=0)
    assert dir_bytes(again) == dir_bytes(ckpt)
    other = make_synthetic(config_file, tmp_path / "other", N_LAYERS, seed=1)
    a, b = dir_bytes(other), dir_bytes(ckpt)
    assert a.keys() == b.keys() and a["config.json"] == b["config.json"]
    assert all(a[k] != b[k] for k in a if k.endswith(".safetensors"))


def test_small_shard_size_splits_in_order_with_a_consistent_index(config_file: Path, tmp_path: Path):
    calls: list[tuple[int, int]] = []
    limit = 1 << 20
    out = make_synthetic(config_file, tmp_path / "ck", 2, shard_bytes=limit,
                         progress=lambda done, total: calls.append((done, total)))
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(out.glob("*.safetensors"))
    n = len(shards)
    assert n > 2 and [p.name for p in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    total = 0
    for p in shards:
        with safe_open(str(p), framework="pt") as f:
            keys = list(f.keys())
            sizes = [f.get_tensor(k).nbytes for k in keys]
        assert all(index["weight_map"][k] == p.name for k in keys)
        assert sum(sizes) <= limit or len(keys) == 1, p.name  # only a lone tensor may pass the limit
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    # shards are filled in tensor order: model-level first, each scale right after its weight
    names = list(index["weight_map"])
    assert [index["weight_map"][k] for k in names] == sorted(index["weight_map"][k] for k in names)
    assert names[0] == "embed.weight"
    assert names[names.index("layers.0.attn.wq_a.weight") + 1] == "layers.0.attn.wq_a.scale"
    dones = [d for d, _ in calls]
    assert dones == sorted(dones) and calls[-1] == (total, total)
    plan_checkpoint(out, 2)


def test_big_floats_are_drawn_in_chunks_with_init_tensor_statistics(config_file: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch):
    # shrink the chunk sizes so embed/head (and every other tensor) take the chunked paths
    monkeypatch.setattr(synthetic, "SMALL_FLOAT_ELEMS", 10_000)
    monkeypatch.setattr(synthetic, "CHUNK_ELEMS", 8_000)
    out = make_synthetic(config_file, tmp_path / "ck", 1)
    plan_checkpoint(out, 1)
    tensors = read_all(out)
    d = SMALL["hidden_size"]
    assert tensors["embed.weight"].dtype == torch.bfloat16
    assert abs(rms(tensors["embed.weight"]) - 1.0) < 0.02
    assert abs(rms(tensors["head.weight"]) * math.sqrt(d) / HEAD_GAIN - 1.0) < 0.02
    ids = tensors["layers.0.ffn.gate.tid2eid"]
    assert bool((ids.sort(dim=1).values.diff(dim=1) > 0).all())


def test_fp8_codes_of_any_length():
    cfg = load_config(MID)
    draw = synthetic._Draw(cfg, 0)
    codes = torch.cat(list(synthetic.draw_fp8_codes((3, 5), draw)))
    assert codes.shape == (15,) and codes.dtype == torch.uint8


def test_e8m0_scales_mix_two_exponents_to_the_target():
    draw = synthetic._Draw(load_config(MID), 0)
    target = 1 / 3000
    scales = synthetic.draw_e8m0(100_000, target, draw)
    values = e8m0_to_float(scales)
    assert len(torch.unique(values)) == 2
    assert abs(values.double().square().mean().item() / target - 1) < 0.02


def test_unquantised_config_gives_bf16_linears(tmp_path: Path):
    config = write_config(tmp_path / "config", small_raw(quantised=False))
    out = make_synthetic(config, tmp_path / "ck", 1)
    plan = plan_checkpoint(out, 1)
    assert {p.fmt for p in plan.plans} == {"float", "index"}
    tensors = read_all(out)
    assert tensors["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert tensors["layers.0.ffn.experts.0.w1.weight"].dtype == torch.bfloat16
    assert not any(name.endswith(".scale") for name in tensors)


def test_refuses_a_non_empty_dir_unless_forced(ckpt: Path, config_file: Path, tmp_path: Path):
    out = tmp_path / "ck"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(InputError, match="directory exists and is not empty"):
        make_synthetic(config_file, out, N_LAYERS)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    make_synthetic(config_file, out, N_LAYERS, force=True)
    plan_checkpoint(out, N_LAYERS)
    assert dir_bytes(out).items() >= dir_bytes(ckpt).items()
    with pytest.raises(InputError, match="is not a directory"):
        make_synthetic(config_file, out / "keep.txt", 1)


def test_an_error_midway_leaves_no_half_written_shard(config_file: Path, tmp_path: Path):
    def stop(done: int, total: int) -> None:
        if done > total // 2:
            raise KeyboardInterrupt

    out = tmp_path / "ck"
    with pytest.raises(KeyboardInterrupt):
        make_synthetic(config_file, out, N_LAYERS, shard_bytes=1 << 20, progress=stop)
    names = [p.name for p in out.iterdir()]
    assert names and all(n.endswith(".safetensors") and not n.startswith(".") for n in names)
    assert "config.json" not in names and INDEX_FILE not in names


def test_a_write_error_is_one_input_error(config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    class Full(io.BytesIO):
        def write(self, data) -> int:  # the disk fills up after a few writes
            if self.tell() > 100_000:
                raise OSError(28, "No space left on device")
            return super().write(data)

    real_open_atomic = synthetic.open_atomic

    @contextlib.contextmanager
    def open_full(path, force=False):
        with real_open_atomic(path, force) as f:
            yield Full()
            f.write(b"")

    monkeypatch.setattr(synthetic, "open_atomic", open_full)
    with pytest.raises(InputError, match="No space left on device"):
        make_synthetic(config_file, tmp_path / "ck", 1)


@pytest.mark.parametrize("n_layers", [0, N_LAYERS + 1, -1])
def test_n_layers_out_of_range(config_file: Path, tmp_path: Path, n_layers):
    """Named as the command's flag, with the config's own count (as generate's --layers is)."""
    want = f"--layers {n_layers}: {config_file} has {N_LAYERS} layers (give 1 to {N_LAYERS})"
    with pytest.raises(InputError, match=re.escape(want)):
        make_synthetic(config_file, tmp_path / "ck", n_layers)


@pytest.mark.parametrize("n_layers", [True, 1.0])
def test_n_layers_not_an_integer(config_file: Path, tmp_path: Path, n_layers):
    with pytest.raises(InputError, match="n_layers must be an integer"):
        make_synthetic(config_file, tmp_path / "ck", n_layers)
    assert not (tmp_path / "ck").exists()


def test_config_directory_is_accepted(config_file: Path, tmp_path: Path):
    out = make_synthetic(config_file.parent, tmp_path / "ck", 1, shard_bytes=1 << 40)
    assert len(list(out.glob("*.safetensors"))) == 1
    plan_checkpoint(out, 1)


def test_forward_pass_on_the_synthetic_checkpoint_is_finite(ckpt: Path):
    from mhcrun.checkpoint import load_checkpoint
    from mhcrun.model import build_model

    loaded = load_checkpoint(ckpt, N_LAYERS)
    model = build_model(loaded.config, loaded.tensors, loaded.quantized, n_layers=N_LAYERS)
    model.setup_caches(1, 16)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]]), torch.tensor([0]))
    assert logits.shape == (1, SMALL["vocab_size"])
    assert bool(torch.isfinite(logits).all())
