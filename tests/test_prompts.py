import json
import os
from pathlib import Path

import pytest

from mhcrun.errors import InputError
from mhcrun.prompts import Prompt, parse_prompt_ids, read_prompts_file


def write(tmp_path, lines, name="prompts.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def test_read_text_and_ids(tmp_path):
    p = write(tmp_path, [
        json.dumps({"prompt": "The river bends."}),
        "",
        json.dumps({"id": "ids", "prompt_ids": [0, 5, 7]}),
        "   ",
        json.dumps({"prompt": "naïve café", "extra": 1}),
    ])
    got = read_prompts_file(p)
    assert got == [
        Prompt(id="p0", text="The river bends.", ids=None),
        Prompt(id="ids", text=None, ids=[0, 5, 7]),
        Prompt(id="p2", text="naïve café", ids=None),
    ]


def one_line_error(tmp_path, line, **kw) -> str:
    p = write(tmp_path, [json.dumps({"prompt": "ok"}), line])
    with pytest.raises(InputError) as e:
        read_prompts_file(p, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{p}:2:" in msg
    return msg


@pytest.mark.parametrize("line, fragment", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"id": "x"}), "found neither"),
    (json.dumps({"prompt": "a", "prompt_ids": [1]}), "found both"),
    (json.dumps({"prompt": 5}), "'prompt' must be a string"),
    (json.dumps({"prompt_ids": "1,2"}), "must be a list"),
    (json.dumps({"prompt_ids": []}), "is empty"),
    (json.dumps({"prompt_ids": [1, -2]}), "'prompt_ids'[1] = -2"),
    (json.dumps({"prompt_ids": [1, 2.5]}), "'prompt_ids'[1] = 2.5"),
    (json.dumps({"prompt_ids": [True]}), "'prompt_ids'[0] = true"),
    (json.dumps({"prompt_ids": [1, "2"]}), "not a non-negative integer"),
    (json.dumps({"prompt": "a", "id": 3}), "'id' must be a non-empty string"),
    (json.dumps({"prompt": "a", "id": ""}), "'id' must be a non-empty string"),
    (json.dumps({"prompt": "a", "id": "p0"}), "duplicate id 'p0' (first used on line 1)"),
])
def test_line_errors(tmp_path, line, fragment):
    assert fragment in one_line_error(tmp_path, line)


def test_vocab_bound(tmp_path):
    msg = one_line_error(tmp_path, json.dumps({"prompt_ids": [1, 600]}), vocab_size=512)
    assert "outside the vocabulary" in msg


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(InputError, match="prompts file not found"):
        read_prompts_file(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(InputError, match=r"empty\.jsonl: no prompts"):
        read_prompts_file(empty)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(InputError, match="not UTF-8"):
        read_prompts_file(binary)


def test_parse_prompt_ids():
    assert parse_prompt_ids("1,2,3") == [1, 2, 3]
    assert parse_prompt_ids(" 0 , 15,27 ") == [0, 15, 27]
    assert parse_prompt_ids("7") == [7]


@pytest.mark.parametrize("s", ["", "  ", "1,,2", "1,2,", "a,b", "1,-2", "1.5", "+3", "1 2", "٣"])
def test_parse_prompt_ids_errors(s):
    with pytest.raises(InputError) as e:
        parse_prompt_ids(s)
    assert str(e.value).startswith("--prompt-ids:")
    assert "\n" not in str(e.value)


def test_parse_prompt_ids_vocab():
    with pytest.raises(InputError, match="outside the vocabulary"):
        parse_prompt_ids("1,512", vocab_size=512)


@pytest.mark.skipif(not Path("/dev/fd").is_dir(), reason="needs /dev/fd")
def test_a_prompts_file_may_be_a_pipe():
    """`--prompts-file /dev/stdin` or `<(...)`: a pipe is read as a file is (it used to be "not found")."""
    r, w = os.pipe()
    os.write(w, b'{"prompt": "hi"}\n{"prompt_ids": [0, 5]}\n')
    os.close(w)
    try:
        prompts = read_prompts_file(f"/dev/fd/{r}")
    finally:
        os.close(r)
    assert [(p.text, p.ids) for p in prompts] == [("hi", None), (None, [0, 5])]
