"""Tokenizers: a thin wrapper over a HF `tokenizer.json`, a streaming decoder, and the tiny test tokenizer.

The tiny tokenizer is a byte-level BPE trained on `mhcrun/data/tiny_corpus.txt`; the tiny test model's
vocabulary is sized to it (512 ids). Special tokens use DeepSeek's spellings so that code which looks them
up by name works the same on the tiny model and on a released checkpoint.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from mhcrun.errors import InputError

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]  # ids 0, 1, 2 in the tiny tokenizer

_BYTE_ALPHABET = 256
_REPLACEMENT = "\ufffd"


def tiny_corpus_text() -> str:
    """The shipped training text of the tiny tokenizer."""
    return resources.files("mhcrun").joinpath("data/tiny_corpus.txt").read_text(encoding="utf-8")


def build_tiny_tokenizer(text: str, vocab_size: int = 512) -> tokenizers.Tokenizer:
    """Train a byte-level BPE on `text` with exactly `vocab_size` ids (3 special, 256 bytes, the rest merges).

    Training is deterministic: the same text and size give byte-identical `to_str()` output.
    """
    floor = len(SPECIAL_TOKENS) + _BYTE_ALPHABET
    if vocab_size <= floor:
        raise ValueError(f"vocab_size {vocab_size} is too small: the special tokens and the byte alphabet "
                         f"already take {floor} ids")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise ValueError(f"the training text ({len(text)} characters) only supports {got} tokens, not "
                         f"{vocab_size}: use a longer text or a smaller vocab_size")
    for want_id, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == want_id, f"{name} got id {tok.token_to_id(name)}, expected {want_id}"
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


class Tokenizer:
    """Encode/decode with the ids a model expects; BOS is prepended by `encode`, never by the tokenizer."""

    def __init__(self, tok: tokenizers.Tokenizer, source: str = "<memory>"):
        self._tok = tok
        self.source = source
        bos = tok.token_to_id(BOS_TOKEN)
        eos = tok.token_to_id(EOS_TOKEN)
        self.bos_id: int = 0 if bos is None else bos
        self.eos_id: int = 1 if eos is None else eos

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load a `tokenizer.json` (or a directory holding one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise InputError(f"{p}: tokenizer file not found")
        try:
            tok = tokenizers.Tokenizer.from_file(str(p))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad JSON or schema
            msg = " ".join(str(e).split()) or type(e).__name__
            raise InputError(f"{p}: not a valid tokenizer.json ({msg})") from None
        return cls(tok, str(p))

    @classmethod
    def tiny(cls) -> Tokenizer:
        """The tiny tokenizer, trained on the shipped corpus (takes well under a second)."""
        return cls(build_tiny_tokenizer(tiny_corpus_text()), "<tiny>")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else list(ids)

    def decode(self, ids: list[int], keep_special: bool = False) -> str:
        """Decode, leaving out special tokens (BOS, EOS, padding) unless `keep_special` (a chat reply's
        `</think>` and DSML markers are special tokens)."""
        return self._tok.decode(list(ids), skip_special_tokens=not keep_special)

    def has_tokens(self, spellings: tuple[str, ...]) -> bool:
        """Whether every one of `spellings` is a single token of this vocabulary (a chat format's markers)."""
        return all(self._tok.token_to_id(s) is not None for s in spellings)

    def token_text(self, token_id: int) -> str:
        """One token as text for display: its decoded form, or its name when it is a special token."""
        text = self.decode([token_id])
        if text == "":
            name = self._tok.id_to_token(token_id)
            return name if name is not None else ""
        return text

    def stream(self, keep_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, keep_special)


class StreamDecoder:
    """Incremental detokenization: `push(id)` returns only the text completed by that token.

    Byte-level tokens can split a multi-byte UTF-8 character; the decoder then yields U+FFFD for the
    incomplete tail. Such a tail is held back until later tokens complete it, so the concatenation of all
    `push` results plus `flush()` equals `decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, keep_special: bool = False):
        self._tokenizer = tokenizer
        self._keep = keep_special
        self._pending: list[int] = []  # ids since the last point where the text was complete
        self._emitted = 0  # characters of decode(_pending) already returned

    def push(self, token_id: int) -> str:
        self._pending.append(int(token_id))
        text = self._tokenizer.decode(self._pending, self._keep)
        if text.endswith(_REPLACEMENT):
            # only the final U+FFFD can still change; anything before it is settled
            ready = text[:-1]
            out = ready[self._emitted:]
            self._emitted = max(self._emitted, len(ready))
            return out
        out = text[self._emitted:]
        self._pending = []
        self._emitted = 0
        return out

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character decodes as U+FFFD)."""
        text = self._tokenizer.decode(self._pending, self._keep)
        out = text[self._emitted:]
        self._pending = []
        self._emitted = 0
        return out
