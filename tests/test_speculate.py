"""Speculative decoding with the MTP layer (`generate --draft-tokens K`, `mhcrun.speculate`): greedy tokens equal
plain greedy decoding's on every path, the span rollback restores exactly what a chunk wrote, the sampling rule
gives the target distribution, and bad input is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CLI, chat_with_and_without
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mhcrun.cli import app
from mhcrun.generate import SamplingOptions, generate
from mhcrun.runner import load_runner
from mhcrun.snapshot import (
    keep_chunks,
    restore_snapshot,
    restore_span,
    rewind_span,
    state_extents,
    take_snapshot,
    take_span,
)
from mhcrun.speculate import accept_drafts
from mhcrun.tiny import make_tiny

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[0, 5, 9], list(range(3, 12)), list(range(20, 37))]  # rows at different positions


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory) -> Path:
    """The random tiny model with a random MTP layer (a CSA layer): decisive margins, drafts mostly rejected."""
    return make_tiny(tmp_path_factory.mktemp("mtp") / "tiny-mtp", mtp=True)


def plain_and_drafted(model, k: int, n: int = 20, **kw) -> tuple[list, list]:
    base = generate(model, PROMPTS, n, 1, ignore_eos=True)
    return base, generate(model, PROMPTS, n, 1, ignore_eos=True, draft_tokens=k, **kw)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_drafts_equals_greedy_random_batch(random_mtp, k):
    model = load_runner(str(random_mtp), mtp=True).model
    base, got = plain_and_drafted(model, k)
    assert [r.tokens for r in got] == [r.tokens for r in base]
    spec = got[0].stats["speculative"]
    assert spec["drafts_proposed"] == [spec["verify_steps"]] * k


def test_greedy_with_drafts_equals_greedy_kept_quantised(tmp_path):
    path = make_tiny(tmp_path / "fp8-mtp", fp8=True, mtp=True)
    model = load_runner(str(path), mtp=True).model
    base, got = plain_and_drafted(model, 2, n=12)
    assert [r.tokens for r in got] == [r.tokens for r in base]


def test_greedy_with_drafts_equals_greedy_compiled_regions():
    """The verify through the region graphs at a static chunk of K + 1 for every cache row (aot_eager: the
    graphs without codegen), on the bundled model: drafts are accepted, so rows finish at different steps (a
    finished row's verify results are dropped, its kept chunks cut out before the rewind)."""
    model = load_runner(None, mtp=True).model
    base, got = plain_and_drafted(model, 2, n=10, graph_mode="regions", backend="aot_eager")
    assert [r.tokens for r in got] == [r.tokens for r in base]
    assert got[0].stats["speculative"]["mean_accepted_length"] > 1.0


def test_trained_model_drafts_are_accepted_and_tokens_equal_greedy():
    """The bundled (trained) model: its MTP layer drafts tokens the model accepts (so it reads the pre-head
    streams as it was trained to), and the tokens equal plain greedy decoding's."""
    runner = load_runner(None, mtp=True)
    prompts = [runner.tokenizer.encode(t) for t in ("The module defines", "Return the number of items in the")]
    base = generate(runner.model, prompts, 40, 1, ignore_eos=True)
    got = generate(runner.model, prompts, 40, 1, ignore_eos=True, draft_tokens=2)
    assert [r.tokens for r in got] == [r.tokens for r in base]
    assert got[0].stats["speculative"]["mean_accepted_length"] > 1.3


def test_span_restore_puts_back_what_a_chunk_wrote(random_mtp):
    """take_span / restore_span against the whole-row snapshot: after a chunk of K + 1 tokens and the span's
    restore, every state buffer of the row (the MTP layer's included) holds what the full snapshot holds."""
    model = load_runner(str(random_mtp), mtp=True).model
    model.setup_caches(2, 64)
    rows = torch.tensor([1])
    for start in (13, 15, 16):  # the chunk closes no group / one CSA group / an HCA group too
        ids = list(range(4, 4 + start))
        model(torch.tensor([ids]), rows, 0)
        model.mtp[0](model, torch.randn(1, start, 4, model.cfg.dim), torch.tensor([ids]), rows, torch.tensor([0]))
        full = take_snapshot(model, 1, start)
        span = take_span(model.layers, rows, torch.tensor([start]), 4)
        mtp_span = take_span(model.mtp, rows, torch.tensor([start]), 4)
        model(torch.tensor([[7, 8, 9, 10]]), rows, start)
        model.mtp[0](model, torch.randn(1, 4, 4, model.cfg.dim), torch.tensor([[7, 8, 9, 10]]), rows,
                     torch.tensor([start]))
        restore_span(model.layers, span)
        restore_span(model.mtp, mtp_span)
        for path, t in model.state().items():
            want = full.tensors[path]
            assert torch.equal(t[1, :want.size(0)], want), (start, path)


def test_rewind_equals_running_only_the_kept_tokens(random_mtp):
    """rewind_span (the eager path's rollback, no rerun) against restoring the row and running only the kept
    tokens: every state buffer within the kept extent equal, up to the last bits a chunk of other length moves
    (quantisation simulation off, so that no FP8 rounding step can amplify them)."""
    model = load_runner(str(random_mtp)).model
    model.opts.quant_sim = False
    model.setup_caches(2, 64)
    rows, chunk = torch.tensor([0, 1]), torch.tensor([[7, 8, 9, 10, 11], [12, 13, 14, 15, 16]])
    for starts, kept in (((13, 14), (2, 4)), ((12, 30), (4, 1)), ((15, 3), (5, 3))):
        for r, st in enumerate(starts):
            model(torch.tensor([list(range(4, 4 + st))]), torch.tensor([r]), 0)
        snaps = [take_snapshot(model, r, st) for r, st in enumerate(starts)]
        start, keep = torch.tensor(starts), torch.tensor(kept)
        span = take_span(model.layers, rows, start, 5)
        keep_chunks(model.layers, True)
        model(chunk, rows, start)
        rewind_span(model.layers, span, start, keep, torch.tensor([True, True]))
        keep_chunks(model.layers, False)
        rewound = {p: t.clone() for p, t in model.state().items()}
        for r, st in enumerate(starts):
            restore_snapshot(model, snaps[r], r)
            model(chunk[r:r + 1, :kept[r]], torch.tensor([r]), st)
            extents = state_extents(model, st + kept[r])
            for path, t in model.state().items():
                n = extents.get(path, t.size(1))
                a, b = rewound[path][r, :n], t[r, :n]
                assert torch.allclose(a.nan_to_num(neginf=0.0), b.nan_to_num(neginf=0.0), atol=1e-5), (starts, path)
                assert torch.equal(a.isneginf(), b.isneginf()), (starts, path)


def test_speculative_sampling_gives_the_target_distribution():
    """accept_drafts on fixed p and q: the first token it yields is distributed as p[0] (total variation within
    sampling noise of 10,000 draws), and drafts are accepted at the rate sum min(p, q)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.6, 0.1, 0.1]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3]], dtype=torch.float64)
    n, counts, accepted = 10000, torch.zeros(5), 0
    for _ in range(n):
        draft = torch.multinomial(q[0], 1, generator=gen)
        a, nxt = accept_drafts(p, q, draft, gen)
        accepted += a
        counts[int(draft) if a else nxt] += 1
    assert (counts / n - p[0].float()).abs().sum() / 2 < 0.02
    assert abs(accepted / n - float(torch.minimum(p[0], q[0]).sum())) < 0.02


def test_sampling_with_drafts_runs_to_the_end(random_mtp):
    model = load_runner(str(random_mtp), mtp=True).model
    got = generate(model, PROMPTS, 10, 1, SamplingOptions(0.8, 0.9, 3), ignore_eos=True, draft_tokens=2)
    assert [len(r.tokens) for r in got] == [10, 10, 10]


def test_nonfinite_logits_end_the_row_with_its_line(random_mtp):
    """A NaN in a weight: the row ends before a token is taken from non-finite logits, its result says so."""
    model = load_runner(str(random_mtp), mtp=True).model
    model.head.w.data[:] = float("nan")
    got = generate(model, PROMPTS[:1], 6, 1, ignore_eos=True, draft_tokens=2)
    assert got[0].tokens == [] and "hold NaN" in got[0].nonfinite and "step 0 (prefill)" in got[0].nonfinite


def run_cli(*args: str):
    return CLI.invoke(app, list(args))


def test_cli_stats_report_drafts_in_line_and_json():
    r = run_cli("generate", "-n", "12", "--draft-tokens", "2")
    assert r.exit_code == 0 and "mean accepted length" in r.stderr and "drafts 2: accepted" in r.stderr
    row = json.loads(run_cli("generate", "-n", "12", "--draft-tokens", "2", "--json").stdout)
    spec = row["stats"]["speculative"]
    assert len(spec["drafts_proposed"]) == len(spec["drafts_accepted"]) == 2 and row["stats"]["decode_tok_s"] > 0


@pytest.mark.parametrize("k", [-1, 0, 9])
def test_cli_draft_tokens_out_of_range_is_one_line(k):
    r = run_cli("generate", "-n", "4", "--draft-tokens", str(k))
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [f"error: --draft-tokens must be in [1, 8], "
                                                                   f"got {k}"]


def test_draft_tokens_past_the_sliding_window_name_it():
    """K + 1 tokens must fit the sliding window: a model of window 4 takes K up to 3, and says why not 4."""
    from types import SimpleNamespace

    from mhcrun.errors import InputError
    from mhcrun.speculate import check_draft_tokens

    model = SimpleNamespace(cfg=SimpleNamespace(window_size=4), mtp=[None])
    check_draft_tokens(model, 3)
    with pytest.raises(InputError, match=r"^--draft-tokens must be in \[1, 3\] \(K \+ 1 within the sliding window\), "
                                         r"got 4$"):
        check_draft_tokens(model, 4)


def test_cli_draft_tokens_without_an_mtp_layer_is_one_line(random_tiny):
    r = run_cli("generate", "-m", str(random_tiny), "-n", "4", "--draft-tokens", "2")
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "no MTP layer" in r.stderr and "num_nextn_predict_layers is 0" in r.stderr


def edit_mtp(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint `src` whose shard holding mtp.0.* is rewritten by edit(tensors) (and the index)."""
    import shutil

    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = dst / index["weight_map"]["mtp.0.e_proj.weight"]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard)
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != shard.name or n in tensors}
    index["weight_map"].update({n: shard.name for n in tensors})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def test_cli_mtp_tensors_that_are_not_v4s_mtp_layer_are_named(random_mtp, tmp_path):
    def wrong_shape(t):
        t["mtp.0.e_proj.weight"] = t["mtp.0.e_proj.weight"][:, :32].contiguous()

    def another_drafter(t):  # an EAGLE-style drafter under mtp.*: no e_proj
        t["mtp.0.fc.weight"] = t.pop("mtp.0.e_proj.weight")

    for name, edit, words in (("shape", wrong_shape, ["mtp.0.e_proj.weight", "shape [128, 32], expected [128, 128]"]),
                              ("names", another_drafter, ["mtp.0.e_proj.weight", "missing"])):
        path = edit_mtp(random_mtp, tmp_path / name, edit)
        r = run_cli("generate", "-m", str(path), "-n", "4", "--draft-tokens", "1")
        assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert all(w in r.stderr for w in words), r.stderr


def test_tp2_with_drafts_equals_one_rank_greedy():
    def mhcrun(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mhcrun.cli", *args], capture_output=True, text=True,
                              cwd=ROOT, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))

    one = json.loads(mhcrun("generate", "-n", "16", "--ignore-eos", "--json").stdout)
    two = mhcrun("generate", "-n", "16", "--ignore-eos", "--json", "--tp", "2", "--draft-tokens", "2")
    assert two.returncode == 0, two.stderr
    row = json.loads(two.stdout.splitlines()[0])
    assert row["tokens"] == one["tokens"] and row["stats"]["speculative"]["verify_steps"] > 0


def test_memory_plan_counts_the_mtp_layer_and_k_more_tokens(random_mtp):
    """`info --draft-tokens K` (and generate's memory check with drafts) plans the MTP layer's weights and the state
    setup_caches makes for it, at K more tokens of context: the plan's difference is the MTP layer's own."""
    from mhcrun.checkpoint import plan_checkpoint
    from mhcrun.memory import state_bytes, weight_bytes

    runner = load_runner(str(random_mtp), mtp=True)
    cfg, context = runner.config, 40
    runner.model.setup_caches(1, context)
    mtp_state = sum(b.nbytes for b in runner.model.mtp[0].attn.buffers())
    with_mtp = state_bytes(cfg, cfg.n_layers, 1, context, torch.float32, mtp=True)
    without = state_bytes(cfg, cfg.n_layers, 1, context, torch.float32)
    assert mtp_state > 0 and sum(with_mtp.values()) - sum(without.values()) == mtp_state

    def plan(*extra: str) -> dict:
        r = CliRunner().invoke(app, ["info", "-m", str(random_mtp), "--context", "64", "--json", *extra])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["memory_plan"]

    plain, drafted = plan(), plan("--draft-tokens", "3")
    assert drafted["context"] == 67 and drafted["prompt_len"] == plain["prompt_len"] == 64
    stored = sum(t.nbytes for shard in random_mtp.glob("*.safetensors") for name, t in load_file(shard).items()
                 if name.startswith("mtp.0."))
    in_memory = weight_bytes(plan_checkpoint(random_mtp, mtp=True), torch.float32, False) - \
        weight_bytes(plan_checkpoint(random_mtp), torch.float32, False)
    assert drafted["weights_bytes"] - plain["weights_bytes"] == in_memory >= stored > 0  # bf16 stored, run in fp32
    r = CliRunner().invoke(app, ["info", "--draft-tokens", "0"])
    assert r.exit_code == 2 and "--draft-tokens must be in [1, 8], got 0" in r.stderr


# ---------------------------------------------------------------------------------------------- with a session


@torch.inference_mode()
def test_session_with_drafts_keeps_the_mtp_state_across_turns(random_mtp):
    """Speculative decoding in a session (chat, --prompt-cache): each turn's greedy tokens equal plain greedy
    decoding's; a turn that extends the live state runs only its new tokens, one that parts from it at a mark
    restores the mark's snapshot; and the MTP layer's state and pending input the row holds after two turns give
    the same draft distribution as a fresh prefill of the same tokens (quantisation simulation off: exact state
    up to the chunks' last bits). Zeroing that state changes the distribution: the comparison sees it."""
    from mhcrun.session import Pending, Session
    from mhcrun.speculate import draft, prefill_row

    model = load_runner(str(random_mtp), mtp=True, quant_sim=False).model
    a = list(range(3, 16))
    first = generate(model, [a], 9, 1, ignore_eos=True)[0].tokens
    b = a + first + [40, 41, 42]
    second = generate(model, [b], 9, 1, ignore_eos=True)[0].tokens
    parted = generate(model, [a[:8] + [50, 51]], 5, 1, ignore_eos=True)[0].tokens

    model.setup_caches(2, 200)
    s = Session(model, chunk=5)
    got = generate(model, [a], 9, 1, ignore_eos=True, session=s, marks=(8,), draft_tokens=3)[0]
    assert got.tokens == first and (s.reused, s.prefilled) == (0, len(a))
    got = generate(model, [b], 9, 1, ignore_eos=True, session=s, draft_tokens=3)[0]
    assert got.tokens == second and (s.reused, s.prefilled) == (len(a) + len(first) - 1, 4)
    assert s.tokens == b + second[:-1] and s.pending.start + s.pending.streams.size(0) == len(s.tokens)

    n, last = len(s.tokens), second[-1]
    _, fresh = prefill_row(model, s.tokens, 1, 7)
    before = {k: t.clone() for k, t in model.state().items()}
    mine = Pending(s.pending.start, s.pending.streams, [*s.tokens[s.pending.start + 1:], last])
    fresh.tokens.append(last)

    def drafted() -> torch.Tensor:  # the draft distributions [2, V] of both rows, which are then put back
        q = draft(model, [mine, fresh], torch.tensor([0, 1]), 1, SamplingOptions(1.0), torch.Generator())[1]
        for k, t in model.state().items():
            t.copy_(before[k])
        return q[:, 0]

    q = drafted().log()  # log-probabilities [2, V]
    assert float((q[0] - q[1]).abs().max()) < 1e-4
    for k, t in model.state().items():
        if k.startswith("mtp."):
            t[0].zero_()
    q = drafted().log()
    assert float((q[0] - q[1]).abs().max()) > 0.1
    assert n == len(s.tokens)

    got = generate(model, [a[:8] + [50, 51]], 5, 1, ignore_eos=True, session=s, draft_tokens=3)[0]
    assert got.tokens == parted and (s.reused, s.prefilled) == (8, 2)


def test_cli_prompt_cache_with_drafts(tmp_path):
    """`generate --prompt-cache F --draft-tokens K`: the file holds the MTP layer's state too; a longer prompt
    reuses it and decodes the plain greedy tokens; a run without drafts uses the same file (its MTP part left
    out); a file saved without the MTP layer is refused by a run that drafts, in one line."""
    path, plain_file = tmp_path / "c.safetensors", tmp_path / "plain.safetensors"
    a, b = "3,4,5,6,7,8,9,10,11", "3,4,5,6,7,8,9,10,11,12,13,14"

    def tokens(*args: str) -> dict:
        r = run_cli("generate", "--prompt-ids", *args, "-n", "8", "--ignore-eos", "--json")
        assert r.exit_code == 0, r.stdout + r.stderr
        return json.loads(r.stdout)

    first = tokens(a, "--prompt-cache", str(path), "--draft-tokens", "2")
    assert first["stats"]["prompt_cache"]["saved"] and first["tokens"] == tokens(a)["tokens"]
    assert "speculative" in first["stats"]
    want = tokens(b)["tokens"]
    again = tokens(b, "--prompt-cache", str(path), "--draft-tokens", "2")
    assert again["tokens"] == want and again["stats"]["prompt_cache"]["reused_tokens"] == 9
    assert again["stats"]["speculative"]["verify_steps"] > 0
    undrafted = tokens(b, "--prompt-cache", str(path))
    assert undrafted["tokens"] == want and undrafted["stats"]["prompt_cache"]["reused_tokens"] == 9
    tokens(a, "--prompt-cache", str(plain_file))
    r = run_cli("generate", "--prompt-ids", b, "-n", "4", "--prompt-cache", str(plain_file), "--draft-tokens", "2")
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [
        f"error: prompt cache {plain_file}: saved without the MTP layer's state, which --draft-tokens needs (give "
        f"another file, or run without --draft-tokens)"]


def test_chat_with_drafts_gives_the_replies_of_chat_without():
    """`chat --draft-tokens 2`: the same replies turn after turn (the bundled model, greedy), each turn's line
    reporting its drafts; the second turn reuses the first's state."""
    plain, drafted = chat_with_and_without("Hi\nAnd then?\n/exit\n", 12, "--draft-tokens", "2")
    assert drafted.stdout.count("drafts 2: accepted") == 2 and "drafts" not in plain.stdout
    second = [line for line in drafted.stdout.splitlines() if "prompt tokens (" in line][1]
    assert " 0 reused" not in second


def test_session_with_drafts_through_compiled_regions():
    """A session's turns with drafts verified through the region graphs (aot_eager) give plain greedy tokens, the
    second turn reusing the first's live state."""
    from mhcrun.session import Session

    runner = load_runner(None, mtp=True)
    model, a = runner.model, runner.tokenizer.encode("The module defines")
    first = generate(model, [a], 10, 1, ignore_eos=True)[0].tokens
    b = a + first + [5, 6]
    second = generate(model, [b], 10, 1, ignore_eos=True)[0].tokens
    model.setup_caches(1, 200)
    s = Session(model, 16)
    kw = dict(ignore_eos=True, session=s, draft_tokens=2, graph_mode="regions", backend="aot_eager")
    assert generate(model, [a], 10, 1, **kw)[0].tokens == first
    got = generate(model, [b], 10, 1, **kw)[0]
    assert got.tokens == second and (s.reused, s.prefilled) == (len(a) + 9, 3)
    assert got.stats["speculative"]["mean_accepted_length"] > 1.0


def test_a_reply_that_ends_inside_accepted_drafts_leaves_the_row_at_its_last_token():
    """A reply that reaches its length part way through a verify step's accepted drafts: the row is rewound to
    the tokens emitted (the prompt and the reply but its last token), so the next turn, which extends that, gives
    plain greedy tokens. Every reply length 2..7 on the bundled model (drafts accepted ~2 a step: most lengths end
    inside a step)."""
    from mhcrun.session import Session

    runner = load_runner(None, mtp=True)
    model, a = runner.model, runner.tokenizer.encode("Return the number of items in the")
    inside = 0
    for n in range(2, 8):
        first = generate(model, [a], n, 1, ignore_eos=True)[0].tokens
        b = a + first + [5, 6]
        second = generate(model, [b], 4, 1, ignore_eos=True)[0].tokens
        model.setup_caches(1, 100)
        s = Session(model, 16)
        got = generate(model, [a], n, 1, ignore_eos=True, session=s, draft_tokens=3)[0]
        spec = got.stats["speculative"]
        inside += spec["verify_steps"] + sum(spec["drafts_accepted"]) > n - 1  # the steps made more than emitted
        assert got.tokens == first and s.tokens == a + first[:-1]
        assert s.pending.start + s.pending.streams.size(0) == len(s.tokens)
        assert generate(model, [b], 4, 1, ignore_eos=True, session=s, draft_tokens=3)[0].tokens == second
        assert s.reused == len(a) + n - 1
    assert inside >= 2
