"""Long context: chunked prefill equals a single-chunk prefill (any chunk size, every layer kind, batch > 1),
decode after a chunked prefill equals a full recompute, the sliced indexer equals the whole one, the top-k tie rule
holds on every path (eager, compiled regions, chunk sizes) on a model whose indexer has exact ties, and the FP8/FP4
KV cache stores exactly what the quantisation simulation rounds to."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CLI

from mhcrun import model as model_mod
from mhcrun.cli import app
from mhcrun.config import config_from_hf
from mhcrun.generate import generate, prefill
from mhcrun.memory import kv_bytes_per_token, state_bytes
from mhcrun.model import Cache, build_model, cache_formats
from mhcrun.ops import kvcache
from mhcrun.ops.quant import fp4_simulate, fp8_simulate
from mhcrun.regions.runner import RegionDecoder
from mhcrun.tiny import init_tensors, tiny_config_raw

CHUNKS = [1, 3, 4, 5, 16, 17, 128]  # across the window (16), CSA groups (4) and HCA groups (16)
KINDS = {"window": [0, 0], "csa": [4, 4], "hca": [16, 16], "mixed": [0, 4, 16, 4]}



def make_model(ratios: list[int], quant_sim: bool = True, seed: int = 0, max_pos: int = 512, **overrides):
    raw = dict(tiny_config_raw(), compress_ratios=ratios, num_hidden_layers=len(ratios),
               max_position_embeddings=max_pos, **overrides)
    cfg = config_from_hf(raw)
    model = build_model(cfg, init_tensors(cfg, seed), set())
    model.opts.quant_sim = quant_sim
    return model


def prompt(n: int, seed: int = 1) -> list[int]:
    return [0] + torch.randint(3, 512, (n - 1,), generator=torch.Generator().manual_seed(seed)).tolist()


def cache_values(model) -> dict[str, torch.Tensor]:
    """Every state buffer as values (caches decoded), for comparing two runs' state."""
    out = {k: t.clone() for k, t in model.state().items() if k.endswith("_state")}
    for name, m in model.named_modules():
        if isinstance(m, Cache):
            out[name] = kvcache.decode(m.fmt, m.parts(), torch.float32)
    return out


@torch.inference_mode()
def prefill_state(model, ids: list[int], chunk: int, context: int) -> tuple[torch.Tensor, dict]:
    model.setup_caches(1, context)
    logits = prefill(model, ids, 0, chunk)
    return logits[0], cache_values(model)


def assert_same_state(got: torch.Tensor, want: torch.Tensor, atol: float, quant_sim: bool, what: str = "") -> None:
    """Cache state equal within atol; with the quant simulation, a GEMM of another shape (another chunk or slice
    size, another CPU's kernels) may round its last bit the other way, and the FP8/FP4 rounding after it then
    lands on the neighbouring code now and then: such flips are allowed on at most 0.5% of the elements, each
    within half the value's magnitude (an e4m3 step is at most 1/8 of it, an e2m1 step at most 1/2). A bug in the
    carried state moves far more elements than that."""
    diff = (got.float() - want.float()).abs()
    off = diff > atol
    if not quant_sim or not off.any():
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")
        return
    scale = torch.maximum(got.float().abs(), want.float().abs())
    assert int(off.sum()) <= max(2, off.numel() // 200), f"{what}: {int(off.sum())} of {off.numel()} differ"
    assert bool((diff[off] <= scale[off] / 2).all()), f"{what}: a difference beyond one FP8/FP4 step"


@pytest.mark.parametrize("quant_sim", [True, False], ids=["quant-sim", "no-quant-sim"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_chunked_prefill_equals_single_chunk(kind, quant_sim):
    model = make_model(KINDS[kind], quant_sim)
    ids = prompt(150)
    want, want_state = prefill_state(model, ids, len(ids), 160)
    # the FP8/FP4 simulation turns last-bit GEMM differences (other chunk shapes) into whole quanta now and then
    bound = 2e-2 if quant_sim else 1e-4
    for chunk in CHUNKS:
        got, state = prefill_state(model, ids, chunk, 160)
        assert (got - want).abs().max() < bound, (chunk, (got - want).abs().max())
        assert got.argmax() == want.argmax()
        for key, t in want_state.items():
            assert_same_state(state[key], t, bound, quant_sim, f"chunk {chunk} {key}")


@pytest.mark.parametrize("chunk", [1, 5, 17])
def test_greedy_tokens_equal_for_every_chunk_size_on_the_golden_file(chunk):
    """The bundled golden file (recorded with single-chunk prefills) passes
    with every prefill chunk size."""
    r = CLI.invoke(app, ["golden-check", "tests/golden/tiny.json", "--prefill-chunk", str(chunk), "--json"])
    assert r.exit_code == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] and all(p["status"] == "match" for p in report["prompts"])


@pytest.mark.parametrize("chunk", [None, 1, 17])
def test_long_prompts_give_the_reference_golden_at_every_chunk_size(long_fp8, chunk):
    """tests/golden/tiny-fp8-long.json: prompts of 1,500, 1,536, 1,601 and 2,000 tokens, 32 greedy tokens each,
    kept-quantised weights, the quant simulation off; recorded with the default chunk and checked against DeepSeek's
    reference (docs/parity.md: every top-k log-prob within 1e-5 with its top-k ties broken as mhcrun breaks them).
    Every chunk size gives the same tokens and log-probs within the fp32 tolerance, teacher-forced."""
    extra = [] if chunk is None else ["--prefill-chunk", str(chunk)]
    r = CLI.invoke(app, ["golden-check", "tests/golden/tiny-fp8-long.json", "-m", str(long_fp8), "--json", *extra])
    assert r.exit_code == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert [p["status"] for p in report["prompts"]] == ["match"] * 4
    assert max(p["max_logprob_diff"] for p in report["prompts"]) < 1e-4


def test_batch_of_different_lengths_chunked_equals_each_alone_single_chunk():
    model = make_model(KINDS["mixed"], quant_sim=False)
    prompts = [prompt(n, seed=n) for n in (1, 6, 37, 70)]
    batched = generate(model, prompts, 20, eos_id=1, ignore_eos=True, record_topk=2, prefill_chunk=5)
    for p, b in zip(prompts, batched, strict=True):
        alone = generate(model, [p], 20, eos_id=1, ignore_eos=True, record_topk=2, prefill_chunk=len(p))[0]
        assert alone.tokens == b.tokens
        for m1, m2 in zip(alone.margins, b.margins, strict=True):
            assert abs(m1 - m2) < 1e-4


@pytest.mark.parametrize("kind", ["window", "mixed"])
def test_chunk_of_rows_at_different_starts_equals_each_alone(kind):
    """One chunk for two rows, one beginning its sequence (an empty ring) and one at position 40 (a ring of the
    window before it): each row's logits are those of the row's chunk alone. The chunk spans several query slices
    (half a window each), so the first slices read the ring for the second row and the later ones leave it out."""
    ids1, chunk = prompt(40, seed=3), prompt(30, seed=5)
    model = make_model(KINDS[kind], quant_sim=False)
    model.setup_caches(2, 160)
    prefill(model, ids1, 1, len(ids1))
    both = model(torch.tensor([chunk, chunk]), torch.tensor([0, 1]), torch.tensor([0, len(ids1)]))
    model.setup_caches(1, 160)
    alone0 = prefill(model, chunk, 0, len(chunk))
    model.setup_caches(1, 160)
    prefill(model, ids1, 0, len(ids1))
    alone1 = model(torch.tensor([chunk]), torch.tensor([0]), len(ids1))
    torch.testing.assert_close(both[0], alone0[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(both[1], alone1[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("quant_sim", [True, False], ids=["quant-sim", "no-quant-sim"])
def test_decode_after_chunked_prefill_equals_full_recompute(quant_sim):
    model = make_model(KINDS["mixed"], quant_sim)
    ref = make_model(KINDS["mixed"], quant_sim)
    ids = prompt(60, seed=4)
    start = 23
    bound = 2e-2 if quant_sim else 1e-4
    with torch.inference_mode():
        model.setup_caches(1, 64)
        prefill(model, ids[:start], 0, 5)
        for p in range(start, len(ids)):
            logits = model(torch.tensor([[ids[p]]]), torch.tensor([0]), torch.tensor([p]))[0]
            want, _ = prefill_state(ref, ids[:p + 1], p + 1, 64)
            assert (logits - want).abs().max() < bound, p


def test_long_prompt_chunked_equals_single_chunk():
    """A 1,600-token prompt (100 HCA groups, 400 CSA entries against index_topk 6) prefilled in chunks of 128 and
    of 1,000 gives the single-chunk prefill's logits and caches."""
    model = make_model(KINDS["mixed"], quant_sim=False, max_pos=2048)
    ids = prompt(1600, seed=5)
    want, want_state = prefill_state(model, ids, len(ids), 1610)
    for chunk in (128, 1000):
        got, state = prefill_state(model, ids, chunk, 1610)
        assert (got - want).abs().max() < 1e-4
        for key, t in want_state.items():
            torch.testing.assert_close(state[key], t, atol=1e-4, rtol=0)


def test_sliced_indexer_and_attention_equal_whole(monkeypatch):
    """Slices of one entry (indexer) and of one query (attention) give what one slice of everything gives."""
    model = make_model(KINDS["mixed"], quant_sim=True)
    ids = prompt(90, seed=6)
    want, want_state = prefill_state(model, ids, len(ids), 96)
    monkeypatch.setattr(model_mod, "entry_step", lambda s, heads: 1)
    monkeypatch.setattr(model_mod, "query_slices", lambda s, per, max_len=None: [slice(i, i + 1) for i in range(s)])
    got, state = prefill_state(model, ids, len(ids), 96)
    assert (got - want).abs().max() < 2e-2
    for key, t in want_state.items():
        assert_same_state(state[key], t, 2e-2, True, key)


# ---------------------------------------------------------------------------------------------- exact ties


TIES = {"index_n_heads": 2, "index_topk": 3}  # ReLU'd scores of 2 heads are exactly 0 often: ties at the boundary


def count_boundary_ties(monkeypatch, k: int) -> list[int]:
    """Count, in every eager indexer scoring that follows, the queries whose k-th and (k+1)-th best scores are equal
    (compiled graphs trace the same module code: they skip the count, a Python side effect)."""
    ties = [0]
    inner = model_mod.index_scores

    def spy(q, keys, w):
        scores = inner(q, keys, w)
        if scores.size(-1) > k and not torch.compiler.is_compiling():
            top = scores.float().topk(k + 1, dim=-1).values
            ties[0] += int((top[..., k - 1] == top[..., k]).sum())
        return scores

    monkeypatch.setattr(model_mod, "index_scores", spy)
    return ties


def test_tie_rule_regions_equal_eager_on_a_model_with_exact_ties(monkeypatch):
    """2 index heads and index_topk 3: exact ties at the top-k boundary occur while decoding; the compiled regions
    path (scoring every entry slot) keeps the same tied entries as eager (scoring the closed ones in slices), so
    the tokens and logits agree at every step."""
    model = make_model([4, 4, 0], quant_sim=False, seed=3, **TIES)
    ids = prompt(9, seed=7)
    steps = 64
    ties = count_boundary_ties(monkeypatch, 3)
    eager = generate(model, [ids], steps, eos_id=1, ignore_eos=True, record_topk=5)[0]
    assert ties[0] > 0, "the model has no exact ties at the top-k boundary: the test would prove nothing"
    regions = generate(model, [ids], steps, eos_id=1, ignore_eos=True, record_topk=5, graph_mode="regions",
                       backend="aot_eager")[0]
    assert regions.tokens == eager.tokens
    for i, (a, b) in enumerate(zip(eager.top_logprobs, regions.top_logprobs, strict=True)):
        assert [t for t, _ in a] == [t for t, _ in b], i
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) < 1e-4, i
    for chunk in (1, 4, 5):  # and every chunk size keeps them too
        assert generate(model, [ids], steps, eos_id=1, ignore_eos=True, prefill_chunk=chunk)[0].tokens == eager.tokens


def test_uncompiled_region_stages_choose_eager_entries_under_ties():
    """Step by step with ties: the region stages' CSA attention reads the same entries as eager (same logits)."""
    model = make_model([4], quant_sim=True, seed=3, **TIES)
    ids = prompt(30, seed=8)
    with torch.inference_mode():
        model.setup_caches(1, 80)
        prefill(model, ids, 0, 7)
        snap = {k: v.clone() for k, v in model.state().items()}
        tokens = torch.tensor([5])
        eager = [model(torch.tensor([[5]]), torch.tensor([0]), torch.tensor([30 + i]))[0].clone() for i in range(40)]
        for k, v in snap.items():
            model.state()[k].copy_(v)
        dec = RegionDecoder(model, "eager", None)
        for i in range(40):
            got = dec(tokens, torch.tensor([30 + i]))[0]
            assert (got - eager[i]).abs().max() < 2e-2, i


# ---------------------------------------------------------------------------------------------- FP8 / FP4 cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_kv_cache_stores_the_simulation_bit_for_bit(dtype, pow2):
    hd, rd = 512, 64
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(3, 17, hd, generator=g) * torch.logspace(-6, 3, 17).view(1, -1, 1)).to(dtype)
    x[0, 0] = 0.0  # an all-zero entry
    x[0, 1, :64] = 448.0 * 2**20  # a block at the top of e4m3's range
    fmt = kvcache.kv_format(hd, rd, True, pow2)
    parts = kvcache.encode(fmt, x)
    assert parts["fp8"].dtype == torch.float8_e4m3fn and parts["fp8"].shape == (3, 17, hd - rd)
    want = torch.cat([fp8_simulate(x[..., :hd - rd], 64, pow2), x[..., hd - rd:]], dim=-1)
    got = kvcache.decode(fmt, parts, dtype)
    assert got.dtype == dtype and torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                              want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    # stored in a cache and read back by index: the same bits
    cache = kvcache.make_parts(fmt, (3, 20), dtype, "cpu")
    kvcache.write(cache, fmt, (slice(None), slice(2, 19)), x)
    back = kvcache.read(cache, fmt, (slice(None), slice(2, 19)), dtype)
    assert torch.equal(back, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_index_cache_stores_the_simulation_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(10)
    x = (torch.randn(2, 33, 128, generator=g) * torch.logspace(-5, 4, 33).view(1, -1, 1)).to(dtype)
    x[1, 3] = 0.0
    x[1, 4, :32] = -0.0
    fmt = kvcache.index_format(128, True)
    parts = kvcache.encode(fmt, x)
    assert parts["fp4"].dtype == torch.uint8 and parts["fp4"].shape == (2, 33, 64)
    assert parts["scale"].shape == (2, 33, 4)
    want = fp4_simulate(x, 32)
    got = kvcache.decode(fmt, parts, dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits), want.view(bits))


def test_model_cache_is_stored_quantised_and_about_3x_smaller():
    model = make_model(KINDS["mixed"], quant_sim=True)
    model.setup_caches(2, 256)
    attn = model.layers[KINDS["mixed"].index(4)].attn
    assert attn.compressor.cache.fp8.dtype == torch.float8_e4m3fn and attn.ring.fp8.dtype == torch.float8_e4m3fn
    assert attn.indexer.compressor.cache.fp4.dtype == torch.uint8
    assert "values" not in dict(attn.ring.named_buffers())
    model.opts.quant_sim = False
    model.setup_caches(2, 256)
    assert attn.compressor.cache.values.dtype == torch.float32 and model.formats == cache_formats(model.cfg, False)
    # at the released head size (512, 64 of them rope) an fp32 entry is 2048 bytes, an FP8 one 448 + 28 + 256
    from mhcrun.config import load_config

    cfg = load_config("configs/v4-mid.json")
    fp8 = state_bytes(cfg, 4, 2, 65536, torch.float32)
    plain = state_bytes(cfg, 4, 2, 65536, torch.float32, quant_sim=False)
    assert plain["kv_cache"] / fp8["kv_cache"] == pytest.approx(2048 / 732)
    assert plain["indexer_cache"] / fp8["indexer_cache"] == pytest.approx(512 / 80)


def test_switching_the_simulation_after_setup_caches_is_an_error():
    model = make_model(KINDS["csa"], quant_sim=True)
    model.setup_caches(1, 32)
    model.opts.quant_sim = False
    with pytest.raises(RuntimeError, match="setup_caches"):
        model(torch.tensor([[0, 5]]), torch.tensor([0]))


def test_kv_bytes_per_token_of_v4_flash():
    """V4-Flash (43 layers: 2 window, then CSA and HCA alternating; FP8 cache in bf16): per token 604 / 4 bytes and
    an 80-byte indexer key / 4 per CSA layer, 604 / 128 per HCA layer."""
    from mhcrun.config import load_config

    cfg = load_config("configs/v4-flash.json")
    ratios = cfg.compress_ratios[:43]
    csa, hca = ratios.count(4), ratios.count(128)
    assert csa + hca + ratios.count(0) == 43
    want = csa * (604 / 4 + 80 / 4) + hca * 604 / 128
    assert kv_bytes_per_token(cfg, 43, torch.bfloat16) == pytest.approx(want)
    plain = kv_bytes_per_token(cfg, 43, torch.bfloat16, quant_sim=False)
    assert plain == pytest.approx(csa * (1024 / 4 + 256 / 4) + hca * 1024 / 128)


# ---------------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("cmd", [["generate", "-n", "2"], ["golden-check", "tests/golden/tiny.json"],
                                 ["info"]])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_bad_prefill_chunk_is_one_line_exit_2(cmd, value):
    r = CLI.invoke(app, [*cmd, "--prefill-chunk", value])
    assert r.exit_code == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--prefill-chunk must be >= 1" in lines[0]


def test_golden_record_bad_prefill_chunk_writes_nothing(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [0, 5, 6]}\n')
    out = tmp_path / "g.json"
    r = CLI.invoke(app, ["golden-record", "--prompts-file", str(prompts), "--out", str(out), "--prefill-chunk", "0"])
    assert r.exit_code == 2 and not out.exists()


def test_generate_with_prefill_chunk_gives_the_same_tokens():
    base = ["generate", "--prompt-ids", ",".join(map(str, prompt(40, seed=11))), "-n", "8", "--json"]
    runs = [CLI.invoke(app, base + extra) for extra in ([], ["--prefill-chunk", "1"], ["--prefill-chunk", "7"])]
    assert all(r.exit_code == 0 for r in runs), [r.stderr for r in runs]
    tokens = [json.loads(r.stdout)["tokens"] for r in runs]
    assert tokens[0] == tokens[1] == tokens[2]


def test_info_reports_kv_bytes_per_token_and_the_chunk():
    r = CLI.invoke(app, ["info", "--json", "--context", "512", "--prefill-chunk", "64"])
    assert r.exit_code == 0, r.stderr
    mp = json.loads(r.stdout)["memory_plan"]
    assert mp["prefill_chunk"] == 64 and mp["kv_bytes_per_token"] > 0 and mp["quant_sim"]
    r = CLI.invoke(app, ["info", "--context", "512"])
    assert "KV bytes per token" in r.stdout and "a prefill chunk of" in r.stdout
