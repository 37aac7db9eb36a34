"""State reuse across turns and prompt caches on disk: time to first token with and without, side by side.

    python benchmarks/bench_sessions.py                 # mid-size config, 4 layers (written to a temp dir)
    python benchmarks/bench_sessions.py --model DIR     # any checkpoint

Prints, measured in this run on this machine (each pair alternated, best of --repeats):
- a conversation's next turn: a history of --turn-tokens tokens and a reply of --reply-tokens, then a new user
  message of --new-tokens: time to first token when the session holds the state after the previous turn (only
  the new tokens are prefilled, `mhcrun.session`) against prefilling the whole conversation afresh, and the ratio;
- a --doc-tokens document's prompt cache: a fresh prefill of the document and a question (--new-tokens), the time
  to save the state after the document (`mhcrun.promptcache`), the file's size against `info`'s snapshot bytes,
  and loading the file, restoring it and prefilling only the question, and the ratio.
Token ids are random (a synthetic checkpoint has no tokenizer); what is timed does not depend on them.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from mhcrun.errors import run_script
from mhcrun.memory import format_bytes, snapshot_bytes
from mhcrun.promptcache import load_prompt_cache, run_settings, save_prompt_cache
from mhcrun.runner import load_runner
from mhcrun.session import Session
from mhcrun.synthetic import make_synthetic

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def ids(n: int, seed: int, vocab: int) -> list[int]:
    return [0] + torch.randint(3, vocab, (n - 1,), generator=torch.Generator().manual_seed(seed)).tolist()


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


@torch.inference_mode()
def next_turn(runner, chunk: int, history: list[int], reply: list[int], new: list[int], reuse: bool) -> float:
    """Seconds to the first token of the turn after `history` + `reply`, with or without the state kept."""
    model = runner.model
    model.setup_caches(1, len(history) + len(reply) + len(new) + 1)
    session = Session(model, chunk)
    if reuse:
        session.prefill(history)
        for t in reply:  # decode the reply, as the previous turn did
            model(torch.tensor([[t]]), torch.tensor([0]), torch.tensor([len(session.tokens)]))
            session.fed([t])
    secs, logits = timed(lambda: session.prefill(history + reply + new))
    assert session.prefilled == (len(new) if reuse else len(history) + len(reply) + len(new))
    return secs


@torch.inference_mode()
def document(runner, chunk: int, doc: list[int], question: list[int], path: Path) -> dict:
    model = runner.model
    settings = run_settings(runner)
    model.setup_caches(1, len(doc) + len(question) + 1)
    fresh, _ = timed(lambda: Session(model, chunk).prefill(doc + question))
    session = Session(model, chunk)
    session.prefill(doc)
    kept = session.kept[-1]
    path.unlink(missing_ok=True)
    save, _ = timed(lambda: save_prompt_cache(path, kept, runner.identity, settings))
    model.setup_caches(1, len(doc) + len(question) + 1)

    def load_and_ask() -> None:
        cache = load_prompt_cache(path, runner.identity, settings)
        s = Session(model, chunk)
        s.keep(cache)
        s.prefill(doc + question)
        assert s.prefilled == len(question)

    load, _ = timed(load_and_ask)
    return {"fresh": fresh, "save": save, "load": load, "size": path.stat().st_size,
            "planned": snapshot_bytes(runner.config, runner.n_layers, len(doc), model.dtype, runner.quant_sim)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the mid-size config, 4 layers, in a temp dir)")
    ap.add_argument("--turn-tokens", type=int, default=4000)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--doc-tokens", type=int, default=16000)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "mid")
            make_synthetic(CONFIGS / "v4-mid.json", Path(model), 4)
        runner = load_runner(model)
        vocab = runner.config.vocab_size
        history, reply, new = (ids(args.turn_tokens, 1, vocab), ids(args.reply_tokens, 2, vocab)[1:],
                               ids(args.new_tokens, 3, vocab)[1:])
        without = with_ = float("inf")
        for _ in range(args.repeats):
            without = min(without, next_turn(runner, args.chunk, history, reply, new, reuse=False))
            with_ = min(with_, next_turn(runner, args.chunk, history, reply, new, reuse=True))
        print(f"model {Path(model).name}, {runner.n_layers} layers, prefill chunk {args.chunk}, "
              f"{torch.get_num_threads()} threads")
        total = len(history) + len(reply) + len(new)
        print(f"next turn of a {total:,}-token conversation ({len(new)} new tokens): time to first token "
              f"{without:.2f} s prefilling it all, {with_:.3f} s reusing the state: {without / with_:.0f}x")
        doc, question = ids(args.doc_tokens, 4, vocab), ids(args.new_tokens, 5, vocab)[1:]
        best: dict = {}
        for _ in range(args.repeats):
            r = document(runner, args.chunk, doc, question, Path(tmp) / "doc.safetensors")
            best = r if not best else {k: min(best[k], v) for k, v in r.items()}
        print(f"a {len(doc):,}-token document's prompt cache: save {best['save']:.3f} s, file "
              f"{format_bytes(best['size'])} (snapshot planned {format_bytes(best['planned'])}); "
              f"first token after a {len(question)}-token question: {best['fresh']:.2f} s fresh, "
              f"{best['load']:.3f} s loading the cache: {best['fresh'] / best['load']:.0f}x")


if __name__ == "__main__":
    run_script(main)
