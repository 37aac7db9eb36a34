"""Hugging Face transformers' DeepSeek V4 as a baseline for mhcrun: same checkpoint, same prompts, same process.

For each prompt (run alone, batch 1) this script
- builds a `transformers.DeepseekV4ForCausalLM` from a DeepSeek-layout checkpoint: the tensors are read and
  dequantised once by `mhcrun.checkpoint.load_checkpoint` (through `load_runner`, so both models share them) and
  renamed by the explicit tables below; every transformers parameter and state-dict buffer must get a tensor and
  every mhcrun tensor must be used, or the script fails,
- decodes greedily with transformers' `generate` (do_sample=False, its DeepSeek V4 cache), timing prefill
  and decode apart,
- decodes greedily with mhcrun's eager path (`load_runner(..., quant_sim=False)` + `generate`),
- reports whether the greedy tokens agree (first divergence step, mhcrun's top-1/top-2 margin there), and
  the largest logit difference when both models are fed mhcrun's tokens (teacher forcing; transformers'
  cached path, and its no-cache full recompute for reference).

EOS is ignored on both sides so every prompt yields exactly --max-new-tokens tokens. Timing: transformers'
prefill runs from the `generate` call to the first step's logits (its input preparation and cache set-up
included), its decode from there to the return; mhcrun's are its own `generate` stats. Each side runs
--repeat times, interleaved, and keeps its fastest rates; decode tok/s counts decode forwards only.

    python benchmarks/hf_baseline.py --both                 # the bundled tiny model, with and without YaRN
    python benchmarks/hf_baseline.py --no-yarn --localise    # also per layer prefix: where a difference starts
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from mhcrun.checkpoint import LoadedCheckpoint
from mhcrun.config import HF_KEYS, ModelConfig
from mhcrun.errors import ConfigError, MhcrunError, run_script
from mhcrun.fileio import read_json
from mhcrun.generate import SamplingOptions, check_prompts
from mhcrun.generate import generate as mhc_generate
from mhcrun.model import build_model
from mhcrun.runner import DEFAULT_MODEL, DTYPES, load_runner
from mhcrun.weights import tensor_specs

try:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, GenerationConfig, LogitsProcessor
    from transformers.cache_utils import DynamicCache
except ImportError as e:  # pragma: no cover - an environment problem, reported plainly
    sys.exit(f"error: transformers with DeepSeek V4 is needed (pip install transformers==5.24.0): {e}")

# Prompt lengths cross the tiny model's window (16) and its compression groups (4 and 16).
DEFAULT_PROMPT_LENGTHS = (1, 5, 16, 29, 40)

# ---------------------------------------------------------------------------------------------------------------
# config.json -> DeepseekV4Config
# ---------------------------------------------------------------------------------------------------------------

# config.json keys translated into another transformers form (see hf_config)
TRANSLATED_KEYS = {"qk_rope_head_dim", "compress_ratios", "num_hash_layers", "rope_scaling"}
# config.json keys the transformers config takes under the same name (values from mhcrun's validated ModelConfig)
SAME_NAME_KEYS = {k: v for k, v in HF_KEYS.items() if k not in TRANSLATED_KEYS and k != "expert_dtype"}
# config.json keys with no effect here: identification, storage dtype, and quantisation (the tensors arrive
# dequantised to fp32 from load_checkpoint, so transformers must not see a quantization_config)
IGNORED_KEYS = {"architectures", "model_type", "torch_dtype", "dtype", "quantization_config", "expert_dtype",
                "transformers_version", "tie_word_embeddings", "use_cache", "initializer_range"}

LAYER_TYPE_BY_RATIO = {0: "sliding_attention", 4: "compressed_sparse_attention"}  # any other ratio: HCA


class BaselineError(MhcrunError):
    """A checkpoint or config that this comparison cannot express faithfully (one line and exit 2: run_script)."""


def hf_config(raw: dict, cfg: ModelConfig, n_layers: int | None = None) -> DeepseekV4Config:
    """The transformers config of a checkpoint's config.json (raw: its keys; cfg: mhcrun's parse of it)."""
    unknown = sorted(set(raw) - set(SAME_NAME_KEYS) - TRANSLATED_KEYS - IGNORED_KEYS)
    if unknown:
        raise BaselineError(f"config.json key(s) with no transformers mapping: {', '.join(unknown)}")
    if cfg.n_shared_experts != 1:
        raise BaselineError(f"transformers builds exactly one shared expert, config has {cfg.n_shared_experts}")
    if cfg.score_func == "softmax":
        raise BaselineError("scoring_func 'softmax': mhcrun does not renormalise the top-k weights, transformers "
                            "always does (norm_topk_prob)")
    n = cfg.n_layers if n_layers is None else n_layers
    ratios = list(cfg.compress_ratios[:n])
    hca_rates = sorted({r for r in ratios if r not in LAYER_TYPE_BY_RATIO})
    if len(hca_rates) > 1:
        raise BaselineError(f"transformers has one HCA compress rate per model, config has {hca_rates}")
    kw = {key: getattr(cfg, field) for key, field in SAME_NAME_KEYS.items()}
    kw["num_hidden_layers"] = n
    kw["partial_rotary_factor"] = cfg.rope_head_dim / cfg.head_dim  # transformers' form of qk_rope_head_dim
    # Explicit layer types and rates: transformers' legacy `compress_ratios` path only knows 0, 4 and 128.
    kw["layer_types"] = [LAYER_TYPE_BY_RATIO.get(r, "heavily_compressed_attention") for r in ratios]
    kw["compress_rates"] = {"compressed_sparse_attention": 4,
                            "heavily_compressed_attention": hca_rates[0] if hca_rates else 128}
    kw["mlp_layer_types"] = ["hash_moe" if i < cfg.n_hash_layers else "moe" for i in range(n)]
    kw["norm_topk_prob"] = True
    kw["tie_word_embeddings"] = False
    if raw.get("rope_scaling") is not None:  # YaRN, on the compressed layers' rope only (as mhcrun)
        kw["rope_parameters"] = {"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.beta_fast,
                                 "beta_slow": cfg.beta_slow,
                                 "original_max_position_embeddings": cfg.original_seq_len}
    hf = DeepseekV4Config(**kw)
    hf._attn_implementation = "eager"  # the only attention DeepSeek V4 supports in transformers
    return hf


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek tensor names -> transformers names
# ---------------------------------------------------------------------------------------------------------------

TOP_LEVEL_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
# "layers.{i}." + key  ->  "model.layers.{i}." + value
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",  # a buffer in transformers
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",  # a buffer in transformers
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
# routed experts are packed: gate_up_proj[e] = cat(w1[e], w3[e]) (gate rows first), down_proj[e] = w2[e]
EXPERT_PACKED = {"w1": ("mlp.experts.gate_up_proj", 0), "w3": ("mlp.experts.gate_up_proj", 1),
                 "w2": ("mlp.experts.down_proj", 0)}


def hf_name(name: str) -> tuple[str, int | None, int]:
    """DeepSeek name -> (transformers name, expert index or None, part of a packed tensor)."""
    if name in TOP_LEVEL_NAMES:
        return TOP_LEVEL_NAMES[name], None, 0
    parts = name.split(".")
    if parts[0] != "layers" or len(parts) < 3 or not parts[1].isdigit():
        raise BaselineError(f"no transformers name for {name!r}")
    prefix, rest = f"model.layers.{parts[1]}.", ".".join(parts[2:])
    if rest in LAYER_NAMES:
        return prefix + LAYER_NAMES[rest], None, 0
    if len(parts) == 7 and parts[2:4] == ["ffn", "experts"] and parts[4].isdigit() and parts[6] == "weight":
        if parts[5] in EXPERT_PACKED:
            target, part = EXPERT_PACKED[parts[5]]
            return prefix + target, int(parts[4]), part
    raise BaselineError(f"no transformers name for {name!r}")


def hf_state_dict(model: torch.nn.Module, tensors: dict[str, torch.Tensor],
                  expected: list[str]) -> dict[str, torch.Tensor]:
    """Rename and pack mhcrun's tensors into `model`'s state dict; fail unless the two sets match exactly."""
    target = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, set[tuple[int, int]]] = {}  # packed name -> {(expert, part)}
    for name in expected:
        if name not in tensors:
            raise BaselineError(f"mhcrun tensor {name!r} was not loaded")
        key, expert, part = hf_name(name)
        if key not in target:
            raise BaselineError(f"{name!r} maps to {key!r}, which the transformers model does not have")
        want, t = target[key], tensors[name]
        if expert is None:
            if tuple(t.shape) != tuple(want.shape):
                raise BaselineError(f"{name!r} {tuple(t.shape)} does not fit {key!r} {tuple(want.shape)}")
            out[key] = t.to(want.dtype)
            continue
        dest = out.setdefault(key, torch.full(want.shape, float("nan"), dtype=want.dtype))
        rows = t.shape[0]
        if tuple(t.shape) != (want.shape[1] // (2 if key.endswith("gate_up_proj") else 1), want.shape[2]):
            raise BaselineError(f"{name!r} {tuple(t.shape)} does not fit a slice of {key!r} {tuple(want.shape)}")
        dest[expert, part * rows:(part + 1) * rows] = t
        filled.setdefault(key, set()).add((expert, part))
    for key, got in filled.items():
        parts = 2 if key.endswith("gate_up_proj") else 1
        missing = {(e, p) for e in range(target[key].shape[0]) for p in range(parts)} - got
        if missing:
            raise BaselineError(f"{key!r}: no tensor for (expert, part) {sorted(missing)[:4]}")
    missing = sorted(set(target) - set(out))
    extra = sorted(set(out) - set(target))
    if missing or extra:
        raise BaselineError(f"transformers state dict mismatch: missing {missing[:6]}, unexpected {extra[:6]}")
    return out


KEEP_FP32 = set(DeepseekV4ForCausalLM._keep_in_fp32_modules_strict)


def build_hf_model(ckpt: LoadedCheckpoint, raw: dict, dtype: torch.dtype,
                   n_layers: int | None = None) -> DeepseekV4ForCausalLM:
    config = hf_config(raw, ckpt.config, n_layers)
    model = DeepseekV4ForCausalLM(config).float().eval()
    expected = [s.name for s in tensor_specs(ckpt.config, n_layers)]
    model.load_state_dict(hf_state_dict(model, ckpt.tensors, expected), strict=True)
    unused = sorted(set(ckpt.tensors) - set(expected))
    if n_layers is None and unused:
        raise BaselineError(f"mhcrun tensors not used by the transformers model: {unused[:6]}")
    if dtype != torch.float32:  # as from_pretrained(dtype=...): all but the strict keep-in-fp32 modules
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and not KEEP_FP32 & set(name.split(".")) and "inv_freq" not in name:
                t.data = t.data.to(dtype)
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                                               bos_token_id=raw.get("bos_token_id", 0))
    return model


# ---------------------------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------------------------

class StepClock(LogitsProcessor):
    """Records when each step's logits reach the processors (step 0 = after prefill)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.times.append(time.perf_counter())
        return scores


def margin(logits: torch.Tensor) -> float:
    top2 = logits.float().topk(2).values
    return float(top2[0] - top2[1])


@torch.inference_mode()
def hf_greedy(model: DeepseekV4ForCausalLM, prompt: list[int], max_new_tokens: int) -> dict:
    clock = StepClock()
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, logits_processor=[clock],
                         return_dict_in_generate=True, output_logits=True)
    t1 = time.perf_counter()
    tokens = out.sequences[0, len(prompt):].tolist()
    if len(tokens) != max_new_tokens:
        raise BaselineError(f"transformers generated {len(tokens)} tokens, not {max_new_tokens}")
    prefill_s, decode_s = clock.times[0] - t0, t1 - clock.times[0]
    return {"tokens": tokens, "margins": [margin(lg[0]) for lg in out.logits],
            "prefill_tok_s": len(prompt) / prefill_s,
            "decode_tok_s": (max_new_tokens - 1) / decode_s if max_new_tokens > 1 else 0.0}


def mhc_greedy(runner, prompt: list[int], max_new_tokens: int) -> dict:
    res = mhc_generate(runner.model, [prompt], max_new_tokens, runner.ckpt.config.eos_token_id,
                       SamplingOptions(), ignore_eos=True, record_topk=2)[0]
    return {"tokens": res.tokens, "margins": res.margins, "prefill_tok_s": res.stats["prefill_tok_s"],
            "decode_tok_s": res.stats["decode_tok_s"]}


@torch.inference_mode()
def hf_forced_logits(model: DeepseekV4ForCausalLM, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """[len(forced), V]: the cached path fed `forced` one token at a time (logits before each forced token)."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
    rows = [out.logits[0, -1].float()]
    for t in forced[:-1]:
        out = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True, logits_to_keep=1)
        rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


@torch.inference_mode()
def hf_nocache_logits(model: DeepseekV4ForCausalLM, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """The same logits from one full forward without a cache (transformers' recompute path)."""
    out = model(input_ids=torch.tensor([prompt + forced[:-1]]), use_cache=False)
    return out.logits[0, len(prompt) - 1:].float()


@torch.inference_mode()
def mhc_forced_logits(net, prompt: list[int], forced: list[int]) -> torch.Tensor:
    net.setup_caches(1, len(prompt) + len(forced))
    row = torch.tensor([0])
    rows = [net(torch.tensor([prompt]), row)[0]]
    for i, t in enumerate(forced[:-1]):
        rows.append(net(torch.tensor([[t]]), row, torch.tensor([len(prompt) + i]))[0])
    return torch.stack(rows).float()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def keep_fastest(best: dict, again: dict) -> None:
    """Fold a repeated run into `best`: the tokens must not change; the fastest rates are kept."""
    if again["tokens"] != best["tokens"]:
        raise BaselineError("a repeated greedy run produced different tokens")
    for key in ("prefill_tok_s", "decode_tok_s"):
        best[key] = max(best[key], again[key])


def compare_prompt(hf_model, runner, prompt: list[int], max_new_tokens: int, repeat: int = 1) -> dict:
    hf = hf_greedy(hf_model, prompt, max_new_tokens)
    mh = mhc_greedy(runner, prompt, max_new_tokens)
    for _ in range(repeat - 1):  # interleaved, so both sides see the same background load
        keep_fastest(hf, hf_greedy(hf_model, prompt, max_new_tokens))
        keep_fastest(mh, mhc_greedy(runner, prompt, max_new_tokens))
    div = first_divergence(hf["tokens"], mh["tokens"])
    forced_mhc = mhc_forced_logits(runner.model, prompt, mh["tokens"])
    forced_hf = hf_forced_logits(hf_model, prompt, mh["tokens"])
    nocache_hf = hf_nocache_logits(hf_model, prompt, mh["tokens"])
    own = first_divergence(forced_hf.argmax(-1).tolist(), hf["tokens"]) if div is None else None
    return {
        "prompt_len": len(prompt),
        "agree": div is None,
        "first_divergence": div,
        "mhcrun_margin_at_divergence": None if div is None else mh["margins"][div],
        "hf_margin_at_divergence": None if div is None else hf["margins"][div],
        "min_mhcrun_margin": min(mh["margins"]),
        "forced_max_abs_logit_diff": max_abs(forced_mhc, forced_hf),
        "prefill_max_abs_logit_diff": max_abs(forced_mhc[0], forced_hf[0]),
        "nocache_max_abs_logit_diff": max_abs(forced_mhc, nocache_hf),
        "nocache_greedy_agree": forced_mhc.argmax(-1).tolist() == nocache_hf.argmax(-1).tolist(),
        "hf_loop_matches_generate": (own is None) if div is None else None,  # checked when tokens agree
        "hf": hf,
        "mhcrun": mh,
    }


def localise(ckpt: LoadedCheckpoint, raw: dict, dtype: torch.dtype, prompts: list[list[int]],
             forced: list[list[int]]) -> list[dict]:
    """Per layer prefix [0, k): the largest teacher-forced logit difference, cached and no-cache."""
    rows = []
    cfg = ckpt.config
    for k in range(1, cfg.n_layers + 1):
        hf_model = build_hf_model(ckpt, raw, dtype, n_layers=k)
        net = build_model(cfg, ckpt.tensors, ckpt.quantized, dtype, n_layers=k)
        net.opts.quant_sim = False
        cached = nocache = 0.0
        for p, f in zip(prompts, forced, strict=True):
            ref = mhc_forced_logits(net, p, f)
            cached = max(cached, max_abs(ref, hf_forced_logits(hf_model, p, f)))
            nocache = max(nocache, max_abs(ref, hf_nocache_logits(hf_model, p, f)))
        rows.append({"layers": k, "last_layer": k - 1, "kind": cfg.layer_kind(k - 1), "moe": cfg.moe_kind(k - 1),
                     "cached_max_abs_logit_diff": cached, "nocache_max_abs_logit_diff": nocache})
    return rows


@contextmanager
def checkpoint_variant(path: Path, yarn: bool):
    """The checkpoint as is, or a temp directory of links to it whose config.json has no rope_scaling."""
    if yarn:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="hf_baseline_") as tmp:
        for f in path.iterdir():
            if f.name != "config.json":
                os.symlink(f.resolve(), Path(tmp) / f.name)
        raw = json.loads((path / "config.json").read_text())
        raw.pop("rope_scaling", None)
        (Path(tmp) / "config.json").write_text(json.dumps(raw, indent=2))
        yield Path(tmp)


def run_variant(path: Path, yarn: bool, args, prompts: list[list[int]]) -> dict:
    dtype = DTYPES[args.dtype]
    with checkpoint_variant(path, yarn) as root:
        raw = json.loads((root / "config.json").read_text())
        has_yarn = raw.get("rope_scaling") is not None
        runner = load_runner(str(root), args.dtype, quant_sim=False, dequantize=True)
        ckpt = runner.ckpt
        hf_model = build_hf_model(ckpt, raw, dtype)
        for _ in range(args.warmup):  # first-call costs (allocator, lazy init) out of the timings
            hf_greedy(hf_model, prompts[0], 2)
            mhc_greedy(runner, prompts[0], 2)
        results = [compare_prompt(hf_model, runner, p, args.max_new_tokens, args.repeat) for p in prompts]
        loc = None
        if args.localise:
            loc = localise(ckpt, raw, dtype, prompts, [r["mhcrun"]["tokens"] for r in results])
    return {"rope": "yarn" if has_yarn else "no-yarn", "results": results, "localise": loc}


def summary(values: list[float]) -> float:
    """Geometric mean (tokens/s over prompts of different lengths)."""
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else 0.0


def print_variant(v: dict) -> None:
    print(f"== rope: {v['rope']}")
    print(f"{'len':>4} {'agree':>5} {'div@':>5} {'mhc margin':>10} {'min margin':>10} {'forced dlogit':>13} "
          f"{'nocache dlogit':>14} {'hf prefill':>10} {'hf decode':>9} {'mhc prefill':>11} {'mhc decode':>10}")
    for r in v["results"]:
        div = "-" if r["first_divergence"] is None else str(r["first_divergence"])
        m = "-" if r["mhcrun_margin_at_divergence"] is None else f"{r['mhcrun_margin_at_divergence']:.4f}"
        print(f"{r['prompt_len']:>4} {'yes' if r['agree'] else 'NO':>5} {div:>5} {m:>10} "
              f"{r['min_mhcrun_margin']:>10.4f} {r['forced_max_abs_logit_diff']:>13.3e} "
              f"{r['nocache_max_abs_logit_diff']:>14.3e} {r['hf']['prefill_tok_s']:>10.1f} "
              f"{r['hf']['decode_tok_s']:>9.1f} {r['mhcrun']['prefill_tok_s']:>11.1f} "
              f"{r['mhcrun']['decode_tok_s']:>10.1f}")
    res = v["results"]
    print(f"agree: {sum(r['agree'] for r in res)}/{len(res)} prompts | decode tok/s (geo-mean): "
          f"transformers {summary([r['hf']['decode_tok_s'] for r in res]):.1f}, "
          f"mhcrun {summary([r['mhcrun']['decode_tok_s'] for r in res]):.1f} | prefill tok/s (geo-mean): "
          f"transformers {summary([r['hf']['prefill_tok_s'] for r in res]):.1f}, "
          f"mhcrun {summary([r['mhcrun']['prefill_tok_s'] for r in res]):.1f}")
    if any(r["hf_loop_matches_generate"] is False for r in res):
        print("note: transformers' manual cached loop and generate() disagree on some prompt")
    if v["localise"]:
        print("per layer prefix (teacher-forced on mhcrun's tokens, max |logit diff|):")
        for row in v["localise"]:
            print(f"  layers 0..{row['last_layer']} (last: {row['kind']}, {row['moe']} MoE): "
                  f"cached {row['cached_max_abs_logit_diff']:.3e}  no-cache {row['nocache_max_abs_logit_diff']:.3e}")


def default_prompts(vocab_size: int, bos: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[bos] + torch.randint(2, vocab_size, (n - 1,), generator=g).tolist() for n in DEFAULT_PROMPT_LENGTHS]


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="DeepSeek-layout checkpoint dir (default: tiny)")
    ap.add_argument("--prompt-ids", type=parse_ids, action="append",
                    help="a prompt as comma-separated ids (repeatable); default: 5 seeded prompts of lengths "
                         + ", ".join(map(str, DEFAULT_PROMPT_LENGTHS)))
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    rope = ap.add_mutually_exclusive_group()
    rope.add_argument("--no-yarn", action="store_true",
                      help="drop rope_scaling (a temp copy of the checkpoint, used by both runs)")
    rope.add_argument("--both", action="store_true", help="run without YaRN, then with the config as is")
    ap.add_argument("--localise", action="store_true", help="also compare per layer prefix")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up generations before timing")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per prompt and side; the fastest is kept")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1 or args.repeat < 1 or args.warmup < 0:
        ap.error("--max-new-tokens and --repeat must be >= 1, --warmup >= 0")

    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.model).resolve()  # absolute: mhcrun hashes shards relative to a relative root twice
    raw = read_json(path / "config.json", ConfigError)
    prompts = args.prompt_ids or default_prompts(raw["vocab_size"], raw.get("bos_token_id", 0))
    yarn_in_config = raw.get("rope_scaling") is not None
    variants = [False, True] if args.both else [not args.no_yarn]
    variants = [y for y in variants if not y or yarn_in_config] or [False]
    check_prompts(prompts, args.max_new_tokens, raw["vocab_size"], raw.get("max_position_embeddings", 4096))
    out = [run_variant(path, yarn, args, prompts) for yarn in variants]
    meta = {"model": str(path), "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "prompts": prompts}
    if args.json:
        print(json.dumps({**meta, "variants": out}))
    else:
        print(f"model {meta['model']} | {args.dtype} | {args.max_new_tokens} new tokens | "
              f"{meta['threads']} threads | torch {meta['torch']} | transformers {meta['transformers']}")
        for v in out:
            print_variant(v)
    return 0 if all(r["agree"] for v in out for r in v["results"]) else 1


if __name__ == "__main__":
    run_script(main)
