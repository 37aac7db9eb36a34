"""State snapshots: a row restored from the snapshot taken after N tokens continues bit for bit as the row that ran
on, for N on every edge (0, 1, the window, the ratio-4 and ratio-16 groups, prefill chunk boundaries), with the
quantisation simulation on and off, in another row of a batch whose other row runs something else, and under
compiled regions; a snapshot costs the bytes of the state it copies."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import CLI
from safetensors.torch import save as save_bytes

from mhcrun.cli import app
from mhcrun.config import config_from_hf
from mhcrun.errors import InputError
from mhcrun.memory import kv_bytes_per_token, snapshot_bytes
from mhcrun.model import build_model
from mhcrun.promptcache import load_prompt_cache, save_prompt_cache
from mhcrun.regions.runner import RegionDecoder
from mhcrun.session import Kept, Pending, Session
from mhcrun.snapshot import Snapshot, restore_snapshot, take_snapshot
from mhcrun.tiny import init_tensors, tiny_config_raw

RATIOS = [0, 4, 16, 4]  # window-only, CSA (overlapping ratio 4, indexer) and HCA (ratio 16) layers; window 16
EDGES = [0, 1, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 47, 48, 49]  # group edges of 4 and 16, the window of 16
CONTEXT = 96



def make_model(quant_sim: bool, seed: int = 0):
    cfg = config_from_hf(dict(tiny_config_raw(), compress_ratios=RATIOS, num_hidden_layers=len(RATIOS)))
    model = build_model(cfg, init_tensors(cfg, seed), set())
    model.opts.quant_sim = quant_sim
    return model


def sequence(n: int, seed: int) -> list[int]:
    return [0] + torch.randint(3, 512, (n - 1,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, row: int, ids: list[int], start: int, chunk: int) -> torch.Tensor:
    """Feed ids (positions start + [0, len)) into cache row `row`, `chunk` tokens at a time -> last logits [V]."""
    logits = None
    for c0 in range(0, len(ids), chunk):
        part = ids[c0:c0 + chunk]
        logits = model(torch.tensor([part]), torch.tensor([row]), torch.tensor([start + c0]))[0]
    return logits


def fill_row(model, row: int, ids: list[int], chunk: int, restore: Snapshot | None, last: torch.Tensor):
    """Prefill `ids` into `row` -> its last logits; or, with a snapshot of them, fill the row with another
    sequence and restore the snapshot over it -> `last` (the logits that went with the snapshot)."""
    if restore is None:
        return run(model, row, ids, 0, chunk)
    run(model, row, sequence(len(ids) + 7, seed=99), 0, chunk)
    restore_snapshot(model, restore, row)
    return last


def continue_greedy(model, row: int, logits: torch.Tensor, start: int, steps: int) -> list[torch.Tensor]:
    """Decode `steps` greedy tokens in `row` after a sequence of `start` tokens whose last logits are `logits`."""
    out = []
    for i in range(steps):
        tok = int(logits.argmax())
        logits = model(torch.tensor([[tok]]), torch.tensor([row]), torch.tensor([start + i]))[0]
        out.append(logits)
    return out


@torch.inference_mode()
@pytest.mark.parametrize("quant_sim", [True, False], ids=["quant-sim", "no-quant-sim"])
@pytest.mark.parametrize("n", EDGES)
def test_restore_then_run_on_equals_running_on(n, quant_sim):
    chunk = 5  # prefill chunks end off the groups' edges too
    model = make_model(quant_sim)
    ids = sequence(n + 7, seed=n)
    model.setup_caches(2, CONTEXT)
    run(model, 0, ids[:n], 0, chunk)
    snap = take_snapshot(model, 0, n)
    want_prefill = run(model, 0, ids[n:], n, chunk)
    want = continue_greedy(model, 0, want_prefill, len(ids), 20)

    model.setup_caches(2, CONTEXT)
    run(model, 1, sequence(60, seed=99), 0, 7)  # row 1 full of another sequence: restore must not read it
    restore_snapshot(model, snap, 1)
    got_prefill = run(model, 1, ids[n:], n, chunk)
    got = continue_greedy(model, 1, got_prefill, len(ids), 20)
    assert torch.equal(got_prefill, want_prefill)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"decode step {step} after restoring at {n}"


@torch.inference_mode()
def test_restored_row_decodes_in_a_batch_beside_another_row():
    """Row 0 restored after 33 tokens, row 1 in the middle of another sequence: decoding both together (rows at
    different positions) gives the logits of the batch that never snapshotted."""
    model = make_model(True)
    a, b = sequence(33, seed=1), sequence(50, seed=2)

    def batch_steps(restore: Snapshot | None) -> list[torch.Tensor]:
        model.setup_caches(2, CONTEXT)
        la = fill_row(model, 0, a, 8, restore, ref_last)
        lb = run(model, 1, b, 0, 8)
        toks, out = [int(la.argmax()), int(lb.argmax())], []
        for i in range(12):
            logits = model(torch.tensor([[toks[0]], [toks[1]]]), torch.tensor([0, 1]),
                           torch.tensor([len(a) + i, len(b) + i]))
            out.append(logits)
            toks = logits.argmax(-1).tolist()
        return out

    model.setup_caches(2, CONTEXT)
    ref_last = run(model, 0, a, 0, 8)
    snap = take_snapshot(model, 0, len(a))
    want = batch_steps(None)
    got = batch_steps(snap)
    for a_, b_ in zip(got, want, strict=True):
        assert torch.equal(a_, b_)


@torch.inference_mode()
def test_restore_then_compiled_regions_decode_equals_running_on():
    """After 16, 17 and 32 tokens (a group's edge, one past it, two groups): one decoder for every run (its graphs
    take the caches as inputs, so they compile once)."""
    model = make_model(True)
    model.setup_caches(1, CONTEXT)
    decoder = RegionDecoder(model, "regions", "aot_eager")
    for n in (16, 17, 32):
        ids = sequence(n, seed=5)
        model.setup_caches(1, CONTEXT)
        ref_last = run(model, 0, ids, 0, 6)
        snap = take_snapshot(model, 0, n)

        def decode(restore: Snapshot | None, n: int = n, ids: list[int] = ids,
                   ref_last: torch.Tensor = ref_last) -> list[torch.Tensor]:
            model.setup_caches(1, CONTEXT)
            last = fill_row(model, 0, ids, 6, restore, ref_last)
            out = []
            for i in range(8):
                last = decoder(last.argmax().view(1), torch.tensor([n + i]))[0]
                out.append(last)
            return out

        want = decode(None)
        got = decode(snap)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), n
        assert decoder.graph_count() <= len(decoder.stats), "a graph compiled again for new caches"


def test_snapshot_bytes_with_the_mtp_layer_count_its_state_and_pending_input(tmp_path):
    """A session's snapshot of a model with its MTP layer: the main layers' state, the MTP layer's and the pending
    input, as the memory plan (`snapshot_bytes(mtp=True)`) counts them."""
    from mhcrun.runner import load_runner
    from mhcrun.tiny import make_tiny

    model = load_runner(str(make_tiny(tmp_path / "mtp", mtp=True)), mtp=True).model
    model.setup_caches(1, 64)
    session = Session(model, chunk=8)
    for n in (1, 17, 40):
        session.prefill(sequence(n, seed=n))
        kept = session.kept[-1]
        got = kept.snapshot.nbytes + kept.pending.streams.nbytes
        assert got == snapshot_bytes(model.cfg, model.cfg.n_layers, n, model.dtype, True, mtp=True)
        assert kept.snapshot.nbytes == snapshot_bytes(model.cfg, model.cfg.n_layers, n, model.dtype, True) + \
            sum(t.nbytes for k, t in kept.snapshot.tensors.items() if k.startswith("mtp."))


@torch.inference_mode()
@pytest.mark.parametrize("quant_sim", [True, False], ids=["quant-sim", "no-quant-sim"])
def test_snapshot_bytes_are_the_state_it_copies(quant_sim):
    model = make_model(quant_sim)
    model.setup_caches(2, CONTEXT)
    run(model, 0, sequence(40, seed=4), 0, 16)
    for n in (0, 1, 17, 40):
        snap = take_snapshot(model, 0, n)
        assert snap.nbytes == snapshot_bytes(model.cfg, len(RATIOS), n, model.dtype, quant_sim)
        one_row = sum(t[0].nbytes for t in model.state().values())
        assert snap.nbytes <= one_row
    per_token = kv_bytes_per_token(model.cfg, len(RATIOS), model.dtype, quant_sim)
    grow = snapshot_bytes(model.cfg, len(RATIOS), 64 + 16 * 4, model.dtype, quant_sim) - \
        snapshot_bytes(model.cfg, len(RATIOS), 64, model.dtype, quant_sim)
    assert grow == per_token * 64


@torch.inference_mode()
def test_restore_refuses_a_snapshot_of_another_model():
    snap_model, other = make_model(True), make_model(False)
    snap_model.setup_caches(1, CONTEXT)
    other.setup_caches(1, CONTEXT)
    snap = take_snapshot(snap_model, 0, 10)
    with pytest.raises(ValueError, match="does not match this model's"):
        restore_snapshot(other, snap, 0)  # the FP8 cache's parts against a plain one
    bf16 = make_model(True)
    bf16.dtype = torch.bfloat16
    bf16.setup_caches(1, CONTEXT)
    with pytest.raises(ValueError, match="snapshot tensor layers.0.attn.ring.rope"):
        restore_snapshot(bf16, snap, 0)  # the rope channels are stored in the activation dtype
    with pytest.raises(ValueError, match="cache row 3"):
        restore_snapshot(snap_model, snap, 3)
    small = make_model(True)
    small.setup_caches(1, 8)
    with pytest.raises(ValueError, match="does not fit"):
        restore_snapshot(small, snap, 0)


# ---------------------------------------------------------------------------------------------- prompt cache files

IDENTITY = {"name": "tiny", "config_hash": "c1", "weights_hash": "w1"}
SETTINGS = {"dtype": "fp32", "quant_sim": True, "layers": None, "tp": 1}


@torch.inference_mode()
def saved_cache(tmp_path, n: int = 21):
    model = make_model(True)
    model.setup_caches(1, CONTEXT)
    ids = sequence(n, seed=8)
    logits = run(model, 0, ids, 0, 8)
    cache = Kept(ids, take_snapshot(model, 0, n), logits)
    path = save_prompt_cache(tmp_path / "p.safetensors", cache, IDENTITY, SETTINGS)
    return model, cache, path


def test_prompt_cache_round_trips_bit_for_bit(tmp_path):
    model, cache, path = saved_cache(tmp_path)
    back = load_prompt_cache(path, IDENTITY, SETTINGS)
    assert back.tokens == cache.tokens and back.snapshot.n_tokens == cache.snapshot.n_tokens
    assert torch.equal(back.logits, cache.logits)
    assert set(back.snapshot.tensors) == set(cache.snapshot.tensors)
    for k, t in cache.snapshot.tensors.items():
        assert back.snapshot.tensors[k].dtype == t.dtype
        assert torch.equal(back.snapshot.tensors[k].view(torch.uint8), t.view(torch.uint8)), k
    assert path.stat().st_size < cache.snapshot.nbytes + 4 * 512 + 8192  # the state, the logits, a header


def test_prompt_cache_with_the_mtp_layer_round_trips_and_serves_runs_without_it(tmp_path):
    """A cache saved from a model with its MTP layer holds that layer's state and pending input (bit for bit back);
    a run without the layer gets the file without them; a run with it refuses a file without them, and a file
    whose pending input does not end at its last token is corrupt."""
    _, cache, _ = saved_cache(tmp_path)
    n = len(cache.tokens)
    mtp_state = {"mtp.0.attn.ring.fp8": torch.arange(24, dtype=torch.uint8).view(4, 6)}
    pending = Pending(n - 2, torch.randn(2, 4, 8))
    kept = Kept(cache.tokens, Snapshot(n, cache.snapshot.tensors | mtp_state), cache.logits, pending)
    path = save_prompt_cache(tmp_path / "mtp.safetensors", kept, IDENTITY, SETTINGS)
    back = load_prompt_cache(path, IDENTITY, SETTINGS, mtp=True)
    assert back.pending.start == n - 2 and torch.equal(back.pending.streams, pending.streams)
    assert torch.equal(back.snapshot.tensors["mtp.0.attn.ring.fp8"], mtp_state["mtp.0.attn.ring.fp8"])
    plain = load_prompt_cache(path, IDENTITY, SETTINGS)
    assert plain.pending is None and set(plain.snapshot.tensors) == set(cache.snapshot.tensors)
    with pytest.raises(InputError, match="saved without the MTP layer's state, which --draft-tokens needs"):
        load_prompt_cache(tmp_path / "p.safetensors", IDENTITY, SETTINGS, mtp=True)
    bad = Kept(cache.tokens, kept.snapshot, cache.logits, Pending(n - 3, pending.streams))
    path = save_prompt_cache(tmp_path / "bad.safetensors", bad, IDENTITY, SETTINGS)
    with pytest.raises(InputError, match=f"corrupt \\(the MTP layer's input at {n - 3} does not end at token {n}\\)"):
        load_prompt_cache(path, IDENTITY, SETTINGS, mtp=True)


@pytest.mark.parametrize("change, what", [
    ({"identity": {"weights_hash": "w2"}}, "weights_hash w1"),
    ({"identity": {"config_hash": "c2"}}, "config_hash c1"),
    ({"settings": {"quant_sim": False}}, "quant_sim True"),
    ({"settings": {"dtype": "bf16"}}, "dtype fp32"),
    ({"settings": {"layers": 2}}, "layers None"),
    ({"settings": {"tp": 2}}, "tp 1"),
])
def test_prompt_cache_of_another_model_or_settings_is_refused(tmp_path, change, what):
    _, _, path = saved_cache(tmp_path)
    identity = IDENTITY | change.get("identity", {})
    settings = SETTINGS | change.get("settings", {})
    with pytest.raises(InputError, match=f"prompt cache {path}: saved with {what}"):
        load_prompt_cache(path, identity, settings)


def test_truncated_corrupt_or_foreign_files_are_refused(tmp_path):
    _, _, path = saved_cache(tmp_path)
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-100])
    with pytest.raises(InputError, match="truncated"):
        load_prompt_cache(cut, IDENTITY, SETTINGS)
    text = tmp_path / "notes.txt"
    text.write_text("hello, this is not a prompt cache at all")
    with pytest.raises(InputError, match="not a safetensors file"):
        load_prompt_cache(text, IDENTITY, SETTINGS)
    other = tmp_path / "other.safetensors"
    other.write_bytes(save_bytes({"x": torch.zeros(3)}, {"format": "something"}))
    with pytest.raises(InputError, match="not an mhcrun prompt cache"):
        load_prompt_cache(other, IDENTITY, SETTINGS)
    with pytest.raises(InputError, match="already exists"):
        save_prompt_cache(path, load_prompt_cache(path, IDENTITY, SETTINGS), IDENTITY, SETTINGS)
    assert path.read_bytes() == data  # nothing overwritten


@torch.inference_mode()
def test_loaded_cache_continues_bit_for_bit(tmp_path):
    model, cache, path = saved_cache(tmp_path)
    want = continue_greedy(model, 0, cache.logits, len(cache.tokens), 6)
    back = load_prompt_cache(path, IDENTITY, SETTINGS)
    model.setup_caches(1, CONTEXT)
    restore_snapshot(model, back.snapshot, 0)
    got = continue_greedy(model, 0, back.logits, len(back.tokens), 6)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- sessions


@torch.inference_mode()
def test_session_reuses_live_state_and_falls_back_to_snapshots():
    """A session runs only what it does not hold: the rest of a prompt that extends its live state; from the
    snapshot at a mark when the new prompt parts from the live state after it; nothing for a prompt it holds a
    snapshot of with its logits. Each gives the logits of running on from that point."""
    model = make_model(True)
    model.setup_caches(1, CONTEXT)
    session = Session(model, chunk=5)
    first = sequence(30, seed=11)
    want_first = run(model, 0, first, 0, 5)  # the same chunks a session runs from 0
    got_first = session.prefill(first, marks=(20,))
    assert (session.reused, session.prefilled) == (0, 30)
    session.fed(first[-3:])  # as if decode had run three tokens
    live = first + first[-3:]

    longer = live + [7, 8, 9]
    got = session.prefill(longer)
    assert (session.reused, session.prefilled) == (33, 3)

    model.clear_row(0)
    run(model, 0, first[:20], 0, 5)
    want = run(model, 0, [5, 6, 7, 8], 20, 5)
    got = session.prefill(first[:20] + [5, 6, 7, 8])  # parts from the live state at 20: the mark's snapshot
    assert (session.reused, session.prefilled) == (20, 4)
    assert torch.equal(got[0], want)

    got = session.prefill(first)  # the first prompt whole: its snapshot carries its logits
    assert (session.reused, session.prefilled) == (30, 0)
    assert torch.equal(got[0], want_first) and torch.equal(got_first[0], want_first)

    session.reset()
    session.prefill(first[:4])
    assert (session.reused, session.prefilled) == (0, 4)


def generate_json(tmp_path, *args: str) -> dict:
    res = CLI.invoke(app, ["generate", "--json", "-n", "6", "--ignore-eos", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.splitlines()[-1])


def test_generate_prompt_cache_saves_then_prefills_only_the_rest(tmp_path):
    path = tmp_path / "doc.safetensors"
    base = "The river runs past the mill"
    plain = generate_json(tmp_path, "--prompt", base + " and the town")
    first = generate_json(tmp_path, "--prompt", base, "--prompt-cache", str(path))
    assert first["stats"]["prompt_cache"] == {"file": str(path), "loaded": False, "saved": True,
                                                   "reused_tokens": 0, "prefilled_tokens": first["prompt_tokens"]}
    assert first["tokens"] == generate_json(tmp_path, "--prompt", base)["tokens"]
    data = path.read_bytes()
    again = generate_json(tmp_path, "--prompt", base + " and the town", "--prompt-cache", str(path))
    note = again["stats"]["prompt_cache"]
    assert note["loaded"] and not note["saved"] and note["reused_tokens"] == first["prompt_tokens"]
    assert note["prefilled_tokens"] == again["prompt_tokens"] - first["prompt_tokens"]
    assert again["tokens"] == plain["tokens"]
    assert path.read_bytes() == data  # never overwritten


@pytest.mark.parametrize("args, message", [
    (["--prompt", "Something else entirely"], "this prompt does not start with its"),
    (["--no-quant-sim"], "saved with quant_sim True"),
    (["--layers", "2"], "saved with layers 4"),
    (["--dtype", "bf16"], "saved with dtype fp32"),
])
def test_generate_prompt_cache_that_does_not_fit_is_one_line_exit_2(tmp_path, args, message):
    path = tmp_path / "p.safetensors"
    generate_json(tmp_path, "--prompt-cache", str(path))
    data = path.read_bytes()
    res = CLI.invoke(app, ["generate", "-n", "2", "--prompt-cache", str(path), *args])
    assert res.exit_code == 2
    assert res.stderr.startswith(f"error: prompt cache {path}: ") and message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert path.read_bytes() == data


def test_generate_prompt_cache_refuses_a_batch_and_a_foreign_file(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_text("not safetensors")
    res = CLI.invoke(app, ["generate", "-n", "2", "--prompt-cache", str(junk)])
    assert res.exit_code == 2 and "not a safetensors file" in res.stderr
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    res = CLI.invoke(app, ["generate", "-n", "2", "--prompts-file", str(prompts), "--prompt-cache",
                           str(tmp_path / "x.safetensors")])
    assert res.exit_code == 2 and "takes one prompt" in res.stderr
    assert not (tmp_path / "x.safetensors").exists()


# ---------------------------------------------------------------------------------------------- chat turns

STATS = re.compile(r"(\d+) prompt tokens \((\d+) reused, (\d+) prefilled\)")


def chat_turns(model, mode: str, lines: list[str], *extra: str) -> tuple[list[tuple[int, int, int]], str]:
    c = CLI.invoke(app, ["chat", "-m", str(model), "-n", "4", "--mode", mode, *extra],
                   input="\n".join(lines + ["/exit"]) + "\n")
    assert c.exit_code == 0, c.stdout + c.stderr
    return [tuple(map(int, m)) for m in STATS.findall(c.stdout.replace("\n", " "))], c.stdout


def reply_to(model, messages: list[dict], mode: str, tmp_path) -> dict:
    path = tmp_path / "m.json"
    path.write_text(json.dumps(messages))
    r = CLI.invoke(app, ["generate", "-m", str(model), "--messages", str(path), "--mode", mode, "-n", "4", "--json"])
    assert r.exit_code == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("mode", ["chat", "thinking"])
def test_chat_turns_prefill_only_their_new_tokens(v4_checkpoint, mode, tmp_path):
    """Turn 2 reuses the state of turn 1 (in chat mode its prompt and reply; in thinking mode, whose history drops
    the reasoning, the snapshot taken where the next rendering parts from the prompt) and prefills only the rest;
    its reply is the reply `generate --messages` gives for the whole conversation. /reset prefills afresh."""
    turns, _ = chat_turns(v4_checkpoint, mode, ["Hello", "More please", "/reset", "Hello"])
    (n1, r1, p1), (n2, r2, p2), (n3, r3, p3) = turns
    assert (r1, p1) == (0, n1) and (r3, p3) == (0, n3) and n3 == n1
    first = reply_to(v4_checkpoint, [{"role": "user", "content": "Hello"}], mode, tmp_path)
    assert r2 + p2 == n2 and r2 >= n1 - 1
    if mode == "chat":  # the whole live state: prompt 1 and the reply's tokens but its last (end of sentence)
        assert r2 == n1 + len(first["tokens"]) - 1
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", **first["message"]},
               {"role": "user", "content": "More please"}]
    second = reply_to(v4_checkpoint, history, mode, tmp_path)
    assert second["prompt_tokens"] == n2
    _, out = chat_turns(v4_checkpoint, mode, ["Hello", "More please"])
    assert second["text"].split("<｜end▁of▁sentence｜>")[0].removeprefix("<think>").split("</think>")[-1] in out


def test_chat_prompt_cache_is_written_once_then_reused(v4_checkpoint, tmp_path):
    cache = tmp_path / "chat.safetensors"
    turns, _ = chat_turns(v4_checkpoint, "chat", ["A long document about rivers. Summarise it."],
                          "--prompt-cache", str(cache))
    assert cache.exists() and turns[0][1] == 0
    data = cache.read_bytes()
    turns, out = chat_turns(v4_checkpoint, "chat", ["A long document about rivers. Summarise it."],
                            "--prompt-cache", str(cache))
    assert turns[0][1:] == (turns[0][0], 0)  # the whole prompt from the file: nothing prefilled, no prefill rate
    assert "0 prefilled) | 4 tokens, decode " in " ".join(out.split()) and "prefill 0.0" not in out
    assert cache.read_bytes() == data
    res = CLI.invoke(app, ["chat", "-m", str(v4_checkpoint), "--prompt-cache", str(cache), "--layers", "2"],
                     input="/exit\n")
    assert res.exit_code == 2 and res.stderr.startswith(f"error: prompt cache {cache}: saved with layers 4")


def test_generate_zero_tokens_only_caches_the_prompt(tmp_path):
    path = tmp_path / "only.safetensors"
    res = CLI.invoke(app, ["generate", "--json", "-n", "0", "--prompt-cache", str(path)])
    assert res.exit_code == 0, res.stderr
    row = json.loads(res.stdout.splitlines()[-1])
    assert row["tokens"] == [] and row["stats"]["prompt_cache"]["saved"] and path.exists()
    again = generate_json(tmp_path, "--prompt-cache", str(path))
    assert again["stats"]["prompt_cache"]["prefilled_tokens"] == 0
    assert again["stats"]["prefill_tok_s"] == 0  # nothing prefilled: no rate (it was 13 tokens over a restore)
    assert again["tokens"] == generate_json(tmp_path)["tokens"]
