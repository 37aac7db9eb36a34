"""config.json parsing and validation: the shipped configs, and one ConfigError per rule, naming key and file."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from mhcrun.config import ModelConfig, config_from_hf, load_config
from mhcrun.errors import ConfigError, MhcrunError

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
TINY_DATA = ROOT / "mhcrun" / "data" / "tiny"


def tiny_raw() -> dict:
    return json.loads((CONFIGS / "tiny.json").read_text())


def flash_raw() -> dict:
    return json.loads((CONFIGS / "v4-flash.json").read_text())


def write(tmp_path: Path, raw, name: str = "config.json") -> Path:
    p = tmp_path / name
    p.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return p


def expect_error(path: Path, *needles: str) -> str:
    """load_config(path) raises ConfigError whose message names the file and every needle."""
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert str(path) in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert "\n" not in msg  # printed as one line by the CLI
    return msg


# ---------------------------------------------------------------------------------------------------------------
# shipped configs
# ---------------------------------------------------------------------------------------------------------------

def check_common_release(cfg: ModelConfig) -> None:
    assert cfg.head_dim == 512 and cfg.rope_head_dim == 64
    assert cfg.window_size == 128
    assert cfg.vocab_size == 129280
    assert cfg.quant_method == "fp8" and cfg.weight_block_size == 128 and cfg.scale_fmt == "ue8m0"
    assert cfg.expert_dtype == "fp4"
    assert cfg.rope_factor == 16.0 and cfg.original_seq_len == 65536
    assert cfg.beta_fast == 32 and cfg.beta_slow == 1
    assert cfg.rope_theta == 10000.0 and cfg.compress_rope_theta == 160000.0
    assert cfg.index_n_heads == 64 and cfg.index_head_dim == 128
    assert cfg.hc_mult == 4 and cfg.hc_sinkhorn_iters == 20 and cfg.hc_eps == 1e-6 and cfg.mix_hc == 24
    assert cfg.norm_eps == 1e-6
    assert cfg.score_func == "sqrtsoftplus" and cfg.swiglu_limit == 10.0
    assert cfg.n_shared_experts == 1 and cfg.n_hash_layers == 3
    assert cfg.n_activated_experts == 6
    assert cfg.n_mtp_layers == 1
    assert len(cfg.compress_ratios) == cfg.n_layers + 1  # every layer plus the MTP layer
    assert set(cfg.compress_ratios) == {0, 4, 128}
    assert cfg.bos_token_id == 0 and cfg.eos_token_id == 1


def test_v4_flash_released_values():
    cfg = load_config(CONFIGS / "v4-flash.json")
    check_common_release(cfg)
    assert cfg.n_layers == 43 and cfg.dim == 4096 and cfg.n_heads == 64
    assert cfg.n_routed_experts == 256 and cfg.moe_inter_dim == 2048
    assert cfg.q_lora_rank == 1024 and cfg.o_groups == 8 and cfg.o_lora_rank == 1024
    assert cfg.index_topk == 512
    assert cfg.route_scale == 1.5
    assert cfg.compress_ratios[:4] == (0, 0, 4, 128) and cfg.compress_ratios[-1] == 0
    assert [cfg.layer_kind(i) for i in range(4)] == ["window", "window", "csa", "hca"]
    assert cfg.layer_kind(42) == "csa"
    assert [cfg.moe_kind(i) for i in range(5)] == ["hash", "hash", "hash", "routed", "routed"]


def test_v4_pro_released_values():
    cfg = load_config(CONFIGS / "v4-pro.json")
    check_common_release(cfg)
    assert cfg.n_layers == 61 and cfg.dim == 7168 and cfg.n_heads == 128
    assert cfg.n_routed_experts == 384 and cfg.moe_inter_dim == 3072
    assert cfg.q_lora_rank == 1536 and cfg.o_groups == 16 and cfg.o_lora_rank == 1024
    assert cfg.index_topk == 1024
    assert cfg.route_scale == 2.5
    assert cfg.compress_ratios[:3] == (128, 128, 4)
    assert [cfg.layer_kind(i) for i in range(4)] == ["hca", "hca", "csa", "hca"]
    assert cfg.moe_kind(2) == "hash" and cfg.moe_kind(3) == "routed" and cfg.moe_kind(60) == "routed"


def test_tiny_values():
    cfg = load_config(CONFIGS / "tiny.json")
    assert cfg.n_layers == 4 and cfg.dim == 128 and cfg.vocab_size == 512
    assert cfg.compress_ratios == (0, 4, 16, 4)
    assert [cfg.layer_kind(i) for i in range(4)] == ["window", "csa", "hca", "csa"]
    assert [cfg.moe_kind(i) for i in range(4)] == ["hash", "routed", "routed", "routed"]
    assert cfg.window_size == 16 and cfg.index_topk == 6 and cfg.index_head_dim == 64
    assert cfg.rope_factor == 4.0 and cfg.original_seq_len == 64
    assert cfg.quant_method is None and cfg.expert_dtype is None
    assert cfg.route_scale == 1.5 and cfg.n_mtp_layers == 0
    assert isinstance(cfg.rope_theta, float) and isinstance(cfg.rope_factor, float)  # ints in JSON, floats here


def test_tiny_config_is_the_packaged_one():
    """configs/tiny.json is the random tiny model's (`make-tiny`); the bundled trained model adds a larger
    vocabulary and an MTP layer to it."""
    packaged = json.loads((TINY_DATA.parent / "tiny_random_config.json").read_text())
    assert json.loads((CONFIGS / "tiny.json").read_text()) == packaged
    bundled = json.loads((TINY_DATA / "config.json").read_text())
    assert {k for k in bundled if bundled[k] != packaged.get(k)} == {"vocab_size", "num_nextn_predict_layers",
                                                                     "compress_ratios"}


def test_load_config_accepts_a_checkpoint_directory():
    assert load_config(TINY_DATA) == load_config(TINY_DATA / "config.json")


def test_layer_kind_every_hca_ratio():
    raw = tiny_raw()
    raw["compress_ratios"] = [0, 4, 8, 128]
    cfg = config_from_hf(raw)
    assert [cfg.layer_kind(i) for i in range(4)] == ["window", "csa", "hca", "hca"]
    assert [cfg.layer_ratio(i) for i in range(4)] == [0, 4, 8, 128]


def test_fingerprint_stable_and_sensitive(tmp_path):
    a = load_config(CONFIGS / "tiny.json")
    b = load_config(CONFIGS / "tiny.json")
    fp = a.fingerprint()
    assert fp == b.fingerprint()
    assert len(fp) == 16 and all(c in "0123456789abcdef" for c in fp)
    # the key order of the file does not matter
    raw = tiny_raw()
    assert config_from_hf(dict(reversed(list(raw.items())))).fingerprint() == fp
    # keys outside the architecture (torch_dtype, architectures) do not matter
    raw.pop("torch_dtype")
    raw["architectures"] = ["Something"]
    assert config_from_hf(raw).fingerprint() == fp
    # a change does
    for key, value in [("index_topk", 7), ("num_hidden_layers", 3), ("routed_scaling_factor", 2.0)]:
        changed = tiny_raw()
        changed[key] = value
        assert config_from_hf(changed).fingerprint() != fp, key
    changed = tiny_raw()
    changed["rope_scaling"]["factor"] = 8
    assert config_from_hf(changed).fingerprint() != fp
    assert load_config(CONFIGS / "v4-flash.json").fingerprint() != load_config(CONFIGS / "v4-pro.json").fingerprint()


def test_to_dict_round_trip():
    cfg = load_config(CONFIGS / "v4-flash.json")
    d = cfg.to_dict()
    assert d["compress_ratios"] == list(cfg.compress_ratios)
    json.dumps(d)  # serialisable
    assert ModelConfig(**{**d, "compress_ratios": tuple(d["compress_ratios"])}) == cfg


# ---------------------------------------------------------------------------------------------------------------
# errors: every one is a ConfigError naming the key and the file
# ---------------------------------------------------------------------------------------------------------------

def test_config_error_is_user_facing():
    assert issubclass(ConfigError, MhcrunError)


def test_missing_file(tmp_path):
    expect_error(tmp_path / "nope.json")
    # a directory without config.json names the config.json it looked for
    msg = expect_error(tmp_path)
    assert str(tmp_path / "config.json") in msg


@pytest.mark.parametrize("text", ["{not json", "", '{"vocab_size": 512,}'])
def test_not_json(tmp_path, text):
    expect_error(write(tmp_path, text), "JSON")


def test_not_utf8(tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b"\xff\xfe{\x00")
    expect_error(p)


def test_top_level_not_an_object(tmp_path):
    expect_error(write(tmp_path, "[1, 2, 3]"), "object")


def test_wrong_model_type(tmp_path):
    raw = tiny_raw()
    raw["model_type"] = "llama"
    expect_error(write(tmp_path, raw), "model_type", "llama")


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "num_hidden_layers", "q_lora_rank", "compress_ratios",
                                 "num_experts_per_tok", "moe_intermediate_size", "sliding_window"])
def test_missing_required_key(tmp_path, key):
    raw = tiny_raw()
    del raw[key]
    expect_error(write(tmp_path, raw), key)


@pytest.mark.parametrize("key, value", [
    ("hidden_size", "128"),  # string where int
    ("num_hidden_layers", True),  # bool where int
    ("num_attention_heads", 4.0),  # float where int
    ("index_topk", [6]),
    ("num_hash_layers", "1"),
    ("hc_sinkhorn_iters", False),
])
def test_wrong_type_int(tmp_path, key, value):
    raw = tiny_raw()
    raw[key] = value
    expect_error(write(tmp_path, raw), key, "integer")


@pytest.mark.parametrize("key, value", [("rms_norm_eps", "1e-6"), ("routed_scaling_factor", True),
                                        ("hc_eps", [1e-6])])
def test_wrong_type_float(tmp_path, key, value):
    raw = tiny_raw()
    raw[key] = value
    expect_error(write(tmp_path, raw), key)


@pytest.mark.parametrize("key, value", [("factor", "4"), ("original_max_position_embeddings", 64.5),
                                        ("beta_fast", True)])
def test_wrong_type_rope_scaling(tmp_path, key, value):
    raw = tiny_raw()
    raw["rope_scaling"][key] = value
    expect_error(write(tmp_path, raw), f"rope_scaling.{key}")


@pytest.mark.parametrize("value", ["0,4,16,4", [0, 4, "16", 4], [0, 4, 16.0, 4], [0, True, 16, 4], {"0": 0}])
def test_compress_ratios_not_a_list_of_ints(tmp_path, value):
    raw = tiny_raw()
    raw["compress_ratios"] = value
    expect_error(write(tmp_path, raw), "compress_ratios")


def test_compress_ratios_too_short(tmp_path):
    raw = tiny_raw()
    raw["compress_ratios"] = [0, 4, 16]
    expect_error(write(tmp_path, raw), "compress_ratios", "3", "4")


@pytest.mark.parametrize("bad", [1, 2, 3, 5, 12, -4, 100])
def test_compress_ratios_bad_value(tmp_path, bad):
    raw = tiny_raw()
    raw["compress_ratios"] = [0, 4, bad, 4]
    expect_error(write(tmp_path, raw), "compress_ratios[2]", str(bad))


def test_compress_ratios_good_values():
    raw = tiny_raw()
    for ratios in ([0, 0, 0, 0], [4, 8, 16, 1024], [0, 4, 16, 4, 0, 128]):  # extra entries: MTP layers
        raw["compress_ratios"] = ratios
        assert config_from_hf(raw).compress_ratios == tuple(ratios)


@pytest.mark.parametrize("head_dim, rope", [(160, 64), (128, 32), (96, 64)])
def test_head_dim_minus_rope_multiple_of_64(tmp_path, head_dim, rope):
    raw = tiny_raw()
    raw["head_dim"], raw["qk_rope_head_dim"] = head_dim, rope
    raw["index_head_dim"] = 64
    expect_error(write(tmp_path, raw), "head_dim", "qk_rope_head_dim", "64")


def test_head_dim_plus_rope_good():
    raw = tiny_raw()
    raw["head_dim"], raw["qk_rope_head_dim"] = 192, 64
    assert config_from_hf(raw).head_dim == 192


@pytest.mark.parametrize("ihd", [96, 48, 32, 16])
def test_index_head_dim_power_of_two_at_least_rope(tmp_path, ihd):
    raw = tiny_raw()  # rope 64: 96 and 48 are not powers of two, 32 and 16 are < 64
    raw["index_head_dim"] = ihd
    expect_error(write(tmp_path, raw), "index_head_dim", str(ihd))


def test_experts_per_tok_exceeds_experts(tmp_path):
    raw = tiny_raw()
    raw["num_experts_per_tok"] = 9
    expect_error(write(tmp_path, raw), "num_experts_per_tok", "9", "8")
    raw["num_experts_per_tok"] = 8  # equal is fine
    assert config_from_hf(raw).n_activated_experts == 8


@pytest.mark.parametrize("method", ["awq", "gptq", None, 8])
def test_unsupported_quant_method(tmp_path, method):
    raw = flash_raw()
    raw["quantization_config"]["quant_method"] = method
    expect_error(write(tmp_path, raw), "quant_method")


def test_quantization_config_not_an_object(tmp_path):
    raw = flash_raw()
    raw["quantization_config"] = "fp8"
    expect_error(write(tmp_path, raw), "quantization_config")


def test_unsupported_fp8_format(tmp_path):
    raw = flash_raw()
    raw["quantization_config"]["fmt"] = "e5m2"
    expect_error(write(tmp_path, raw), "fmt", "e5m2")


@pytest.mark.parametrize("fmt", ["e4m3", "fp32", "ue4m3"])
def test_unsupported_scale_fmt(tmp_path, fmt):
    raw = flash_raw()
    raw["quantization_config"]["scale_fmt"] = fmt
    expect_error(write(tmp_path, raw), "scale_fmt", fmt)


@pytest.mark.parametrize("block", [[128, 64], [128], [128, 128, 128], "128", 128, [0, 0], [-128, -128],
                                   [128.0, 128.0]])
def test_bad_weight_block_size(tmp_path, block):
    raw = flash_raw()
    raw["quantization_config"]["weight_block_size"] = block
    expect_error(write(tmp_path, raw), "weight_block_size")


def test_weight_block_size_32_accepted():
    raw = flash_raw()
    raw["quantization_config"]["weight_block_size"] = [32, 32]
    assert config_from_hf(raw).weight_block_size == 32


@pytest.mark.parametrize("rs", [{"type": "linear", "factor": 4}, {"rope_type": "dynamic", "factor": 4}])
def test_unsupported_rope_scaling_type(tmp_path, rs):
    raw = tiny_raw()
    raw["rope_scaling"] = rs
    expect_error(write(tmp_path, raw), "rope_scaling")


def test_rope_scaling_not_an_object(tmp_path):
    raw = tiny_raw()
    raw["rope_scaling"] = "yarn"
    expect_error(write(tmp_path, raw), "rope_scaling")


def test_rope_scaling_absent_means_no_yarn():
    raw = tiny_raw()
    del raw["rope_scaling"]
    cfg = config_from_hf(raw)
    assert cfg.original_seq_len == 0 and cfg.rope_factor == 1.0


@pytest.mark.parametrize("key, value, needle", [
    ("scoring_func", "relu", "scoring_func"),
    ("expert_dtype", "int4", "expert_dtype"),
    ("n_shared_experts", 2, "n_shared_experts"),
    ("num_hash_layers", 5, "num_hash_layers"),
    ("qk_rope_head_dim", 63, "qk_rope_head_dim"),
    ("eos_token_id", 512, "eos_token_id"),
])
def test_other_validation_errors(tmp_path, key, value, needle):
    raw = tiny_raw()
    raw[key] = value
    expect_error(write(tmp_path, raw), needle)


def test_config_from_hf_default_where():
    raw = tiny_raw()
    raw["num_experts_per_tok"] = 9
    with pytest.raises(ConfigError, match="my/config.json"):
        config_from_hf(raw, "my/config.json")


def test_input_dict_not_modified():
    raw = flash_raw()
    before = copy.deepcopy(raw)
    config_from_hf(raw)
    assert raw == before


# ---------------------------------------------------------------------------------------------------------------
# regressions: errors that once crashed or named the internal field instead of the config.json key
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["compress_ratios", "hidden_size"])
def test_required_key_null_is_a_config_error(tmp_path, key):
    raw = tiny_raw()
    raw[key] = None
    expect_error(write(tmp_path, raw), key)


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "num_attention_heads", "sliding_window",
                                 "qk_rope_head_dim", "num_experts_per_tok", "moe_intermediate_size"])
def test_positivity_error_names_the_json_key(tmp_path, key):
    raw = tiny_raw()
    raw[key] = 0
    expect_error(write(tmp_path, raw), key)


@pytest.mark.parametrize("key", ["vocab_size", "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts",
                                 "index_n_heads", "index_topk", "hc_mult", "hc_sinkhorn_iters", "head_dim"])
def test_positivity_errors(tmp_path, key):
    raw = tiny_raw()
    raw[key] = 0
    expect_error(write(tmp_path, raw), key, "positive")
