import json

import pytest

from mhcrun.errors import InputError
from mhcrun.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    Tokenizer,
    build_tiny_tokenizer,
    tiny_corpus_text,
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.tiny()


def corpus_sentences() -> list[str]:
    text = tiny_corpus_text()
    return [s.strip() + "." for s in text.replace("\n", " ").split(".") if s.strip()]


def test_corpus_size():
    n = len(tiny_corpus_text().encode("utf-8"))
    assert 6_000 <= n <= 10_000


def test_vocab_exactly_512(tok):
    assert tok.vocab_size == 512
    assert tok.bos_id == 0 and tok.eos_id == 1
    assert tok.backend.token_to_id(BOS_TOKEN) == 0
    assert tok.backend.token_to_id(EOS_TOKEN) == 1
    assert tok.backend.token_to_id(PAD_TOKEN) == 2


def test_build_is_deterministic():
    text = tiny_corpus_text()
    a = build_tiny_tokenizer(text).to_str()
    b = build_tiny_tokenizer(text).to_str()
    assert a == b


def test_too_small_text_raises():
    with pytest.raises(ValueError, match="only supports"):
        build_tiny_tokenizer("a tiny text", vocab_size=512)
    with pytest.raises(ValueError, match="too small"):
        build_tiny_tokenizer(tiny_corpus_text(), vocab_size=200)


def test_round_trip_corpus(tok):
    sentences = corpus_sentences()
    assert len(sentences) > 50
    for s in sentences:
        assert tok.decode(tok.encode(s)) == s
    whole = tiny_corpus_text()
    assert tok.decode(tok.encode(whole, add_bos=False)) == whole


UNICODE = ["naïve café – ok", "日本語のテキスト", "emoji 🙂 and 𝔘nicode", "  two  spaces\n\ttab", ""]


@pytest.mark.parametrize("text", UNICODE)
def test_round_trip_unicode(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_bos_handling(tok):
    ids = tok.encode("The river")
    assert ids[0] == tok.bos_id
    assert ids[1:] == tok.encode("The river", add_bos=False)
    assert tok.bos_id not in ids[1:]
    assert tok.encode("", add_bos=True) == [tok.bos_id]
    assert tok.encode("", add_bos=False) == []
    # special tokens are skipped on decode
    assert tok.decode([tok.bos_id, *tok.encode("hi", add_bos=False), tok.eos_id, 2]) == "hi"


def test_merges_compress(tok):
    text = "The river begins as a thin line of water"
    assert len(tok.encode(text, add_bos=False)) < len(text.encode()) // 2


@pytest.mark.parametrize("text", ["naïve café – ok", "The town stands where the river bends.", "🙂🙂 x 日本"])
def test_stream_equals_full_decode(tok, text):
    ids = [tok.bos_id, *tok.encode(text, add_bos=False), tok.eos_id]
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stream_holds_split_character(tok):
    # a single 4-byte character encodes to several byte tokens
    ids = tok.encode("🙂", add_bos=False)
    assert len(ids) > 1
    stream = tok.stream()
    outs = [stream.push(i) for i in ids]
    assert outs[:-1] == [""] * (len(ids) - 1)
    assert outs[-1] == "🙂"


def test_stream_flush_incomplete(tok):
    ids = tok.encode("a🙂", add_bos=False)
    stream = tok.stream()
    out = "".join(stream.push(i) for i in ids[:-1])
    assert out == "a"
    assert stream.flush() == tok.decode(ids[:-1])[1:]


def test_from_file(tmp_path, tok):
    p = tmp_path / "tokenizer.json"
    p.write_text(tok.backend.to_str())
    t2 = Tokenizer.from_file(p)
    assert t2.vocab_size == 512
    assert t2.encode("naïve café") == tok.encode("naïve café")
    assert Tokenizer.from_file(tmp_path).vocab_size == 512  # a directory holding tokenizer.json


def test_from_file_errors(tmp_path):
    with pytest.raises(InputError, match="not found"):
        Tokenizer.from_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError) as e:
        Tokenizer.from_file(bad)
    assert "\n" not in str(e.value) and "bad.json" in str(e.value)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"hello": 1}))
    with pytest.raises(InputError, match="not a valid tokenizer.json"):
        Tokenizer.from_file(wrong)


def test_fallback_special_ids():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    t = Tokenizer(HFTokenizer(models.BPE()))
    assert (t.bos_id, t.eos_id) == (0, 1)


def test_build_is_deterministic_across_processes():
    # hash-map seeds differ per process; the trained merges must not depend on them
    import hashlib
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import hashlib; from mhcrun.tokenizer import build_tiny_tokenizer, tiny_corpus_text; "
            "print(hashlib.sha256(build_tiny_tokenizer(tiny_corpus_text()).to_str().encode()).hexdigest())")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    here = hashlib.sha256(build_tiny_tokenizer(tiny_corpus_text()).to_str().encode()).hexdigest()
    assert out.stdout.strip() == here
