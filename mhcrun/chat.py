"""DeepSeek V4's chat encoding: OpenAI-style messages -> the prompt text an instruct checkpoint was trained on,
and a generated reply -> reasoning, content and tool calls.

The prompt, as DeepSeek's V4 encoding lays it out:
  BOS, then the system part: in thinking mode the reasoning-effort preamble, every system (and developer)
  message's text joined by blank lines, and with tools the "## Tools" block (the DSML call syntax and one JSON
  schema per tool);
  then the turns: `<｜User｜>` + the user's text (consecutive user messages, and tool results as
  `<tool_result>...</tool_result>`, merged into one turn, joined by blank lines); `<｜latest_reminder｜>` + a
  reminder's text where it stands; `<｜Assistant｜>` + its thinking part + content + its tool calls as a DSML
  block + EOS;
  and, unless the last message is an assistant message marked `prefix` (continued as it is), the generation
  prefix `<｜Assistant｜>` + `<think>` (thinking mode) or `</think>` (chat mode).
An assistant turn's thinking part is `<think>reasoning</think>` in thinking mode with tools declared (the format
keeps the reasoning of tool-using turns) and `</think>` otherwise: earlier turns' reasoning is dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mhcrun.errors import InputError
from mhcrun.fileio import read_json

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, REMINDER = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
CALLS_OPEN, CALLS_CLOSE = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, REMINDER, THINK, END_THINK, DSML)
MODES = ("chat", "thinking")
EFFORTS = ("high", "max")
ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")

# The format's fixed texts (what the released checkpoints were trained on, so they must match byte for byte).
EFFORT_PREAMBLE = {
    "high": "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
            "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
            "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
            "scenarios.\n"
            "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
            "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n",
    "max": "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
           "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
           "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
           "resolve the underlying cause rather than any surface symptom.\n"
           "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
           "certain that no assumption remains unchecked and no error remains undiscovered.\n\n",
}
TOOLS_HEADER = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    f'"{CALLS_OPEN}" block like the following:\n\n'
    f"{CALLS_OPEN}\n"
    f'<{DSML}invoke name="$TOOL_NAME">\n'
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{DSML}invoke>\n"
    f"{CALLS_CLOSE}\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, '
    'arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside "
    f"{THINK}...{END_THINK} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {END_THINK} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_FOOTER = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]  # parsed JSON
    id: str = ""


@dataclass
class Message:
    role: str
    content: str = ""
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    prefix: bool = False  # an assistant message continued as it is (no EOS, no new prefix)
    tool_call_id: str = ""  # a tool message: the call it answers


@dataclass
class Chat:
    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)  # {"name", "description", "parameters"}


# ---------------------------------------------------------------------------------------------- reading


def read_messages(path: str | Path) -> Chat:
    """A messages file: a JSON list of messages, or {"messages": [...], "tools": [...]}. Anything malformed is an
    InputError naming the file and the JSON path."""
    p = Path(path)
    raw = read_json(p, InputError)
    return parse_chat(raw, str(p))


def parse_chat(raw: Any, where: str = "messages") -> Chat:
    """OpenAI-style JSON (a list of messages, or {"messages": [...], "tools": [...]}) -> Chat."""

    def bad(path: str, msg: str) -> InputError:
        return InputError(f"{where}: {path}: {msg}")

    if isinstance(raw, list):
        items, base, tools_raw = raw, "$", []
    elif isinstance(raw, dict):
        if "messages" not in raw:
            raise bad("$", "expected a list of messages or an object with 'messages'")
        items, base, tools_raw = raw["messages"], "$.messages", raw.get("tools") or []
        if not isinstance(items, list):
            raise bad(base, "expected a list of messages")
        if not isinstance(tools_raw, list):
            raise bad("$.tools", "expected a list of tools")
    else:
        raise bad("$", "expected a list of messages or an object with 'messages'")
    if not items:
        raise bad(base, "no messages")
    tools = [parse_tool(t, f"$.tools[{i}]", bad) for i, t in enumerate(tools_raw)]
    messages = [parse_message(m, f"{base}[{i}]", bad) for i, m in enumerate(items)]
    for i, m in enumerate(messages[:-1]):
        if m.prefix:
            raise bad(f"{base}[{i}].prefix", "only the last message can be a prefix to continue")
    if messages[-1].prefix and tools:
        raise bad(f"{base}[{len(messages) - 1}].prefix", "a continued (prefix) assistant message cannot be used "
                                                         "with tools")
    check_tool_results(messages, base, bad)
    return Chat(messages, tools)


def check_tool_results(messages: list[Message], base: str, bad) -> None:
    """Tool messages answer the calls of the assistant message before them, by tool_call_id."""
    calls: dict[str, int] | None = None
    for i, m in enumerate(messages):
        if m.role == "assistant":
            calls = {c.id: j for j, c in enumerate(m.tool_calls)} if m.tool_calls else None
        elif m.role == "tool":
            if calls is None:
                raise bad(f"{base}[{i}]", "a tool message must answer the tool_calls of the assistant message "
                                          "before it")
            if m.tool_call_id not in calls:
                raise bad(f"{base}[{i}].tool_call_id", f"{json.dumps(m.tool_call_id)} is not the id of a call of the "
                                                        f"assistant message before it ({', '.join(calls)})")
        elif m.role in ("user", "latest_reminder"):
            calls = None


def text_of(content: Any, path: str, bad) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...}) joined by blank
    lines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"{path}[{i}]", "expected a text part {\"type\": \"text\", \"text\": ...}")
            parts.append(part["text"])
        return "\n\n".join(parts)
    raise bad(path, "expected a string or a list of text parts")


def parse_message(m: Any, path: str, bad) -> Message:
    if not isinstance(m, dict):
        raise bad(path, "expected a message object")
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{path}.role", f"unknown role {json.dumps(role)} (choose from: {', '.join(ROLES)})")
    content = m.get("content")
    if role == "assistant":
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            raise bad(f"{path}.tool_calls", "expected a list of tool calls")
        parsed = [parse_call(c, f"{path}.tool_calls[{i}]", bad) for i, c in enumerate(calls)]
        if content is None and not parsed:
            raise bad(f"{path}.content", "an assistant message needs content or tool_calls")
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise bad(f"{path}.reasoning_content", "expected a string")
        prefix = m.get("prefix", False)
        if not isinstance(prefix, bool):
            raise bad(f"{path}.prefix", "expected true or false")
        return Message(role, "" if content is None else text_of(content, f"{path}.content", bad), reasoning, parsed,
                       prefix)
    if content is None:
        raise bad(f"{path}.content" if "content" in m else path, f"a {role} message needs content")
    call_id = m.get("tool_call_id", "")
    if role == "tool" and (not isinstance(call_id, str) or not call_id):
        raise bad(f"{path}.tool_call_id", "a tool message needs the tool_call_id of the call it answers")
    return Message(role, text_of(content, f"{path}.content", bad), tool_call_id=call_id if role == "tool" else "")


def parse_call(c: Any, path: str, bad) -> ToolCall:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad(path, "expected {\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": ...}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise bad(f"{path}.function.arguments",
                      f"the arguments are not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(args, dict):
        raise bad(f"{path}.function.arguments", "expected a JSON object of arguments")
    call_id = c.get("id", "")
    if not isinstance(call_id, str):
        raise bad(f"{path}.id", "expected a string")
    return ToolCall(fn["name"], args, call_id)


def parse_tool(t: Any, path: str, bad) -> dict[str, Any]:
    fn = t.get("function") if isinstance(t, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad(path, "expected {\"type\": \"function\", \"function\": {\"name\": ..., ...}}")
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise bad(f"{path}.function.description", "expected a string")
    params = fn.get("parameters", {})
    if not isinstance(params, dict):
        raise bad(f"{path}.function.parameters", "expected a JSON schema object")
    return {"name": fn["name"], "description": desc, "parameters": params}


# ---------------------------------------------------------------------------------------------- encoding


def encode_chat(chat: Chat, mode: str = "thinking", effort: str = "high") -> str:
    """The prompt text for `chat` (see the module docstring); ends ready for the assistant's reply."""
    if mode not in MODES:
        raise InputError(f"unknown --mode {mode!r} (choose from: {', '.join(MODES)})")
    if effort not in EFFORTS:
        raise InputError(f"unknown --reasoning-effort {effort!r} (choose from: {', '.join(EFFORTS)})")
    thinking = mode == "thinking"
    system = [m.content for m in chat.messages if m.role in ("system", "developer")]
    out = [BOS, EFFORT_PREAMBLE[effort] if thinking else "", "\n\n".join(system)]
    if chat.tools:
        out += ["\n\n", TOOLS_HEADER, "\n".join(json.dumps(t, ensure_ascii=False) for t in chat.tools), TOOLS_FOOTER]
    user: list[str] = []  # the parts of the user turn being gathered
    results: dict[int, str] = {}  # tool results by the index of the call they answer, in call order
    order: dict[str, int] = {}

    def flush_results() -> None:
        user.extend(results[k] for k in sorted(results))
        results.clear()

    def close_user() -> None:
        flush_results()
        if user:
            out.extend([USER, "\n\n".join(user)])
            user.clear()

    continued = False
    for m in chat.messages:
        if m.role == "user":
            flush_results()
            user.append(m.content)
        elif m.role == "tool":
            results[order.get(m.tool_call_id, len(order) + len(results))] = f"<tool_result>{m.content}</tool_result>"
        elif m.role == "latest_reminder":
            close_user()
            out.extend([REMINDER, m.content])
        elif m.role == "assistant":
            close_user()
            order = {c.id: j for j, c in enumerate(m.tool_calls)}
            # the reasoning of tool-using turns stays, and that of the reply being continued; elsewhere it is dropped
            keep = thinking and (bool(chat.tools) or m.prefix)
            think = f"{THINK}{m.reasoning_content or ''}{END_THINK}" if keep else END_THINK
            if keep and m.prefix and not m.content and not m.tool_calls:
                think = f"{THINK}{m.reasoning_content or ''}"  # continue inside the reasoning
            out.extend([ASSISTANT, think, m.content])
            if m.tool_calls:
                out.extend(["\n\n", render_calls(m.tool_calls)])
            continued = m.prefix
            if not m.prefix:
                out.append(EOS)
    close_user()
    if not continued:
        out.extend([ASSISTANT, THINK if thinking else END_THINK])
    return "".join(out)


def render_calls(calls: list[ToolCall]) -> str:
    """Tool calls as the DSML block: strings as they are (string="true"), other values as JSON."""
    lines = [CALLS_OPEN]
    for call in calls:
        lines.append(f'<{DSML}invoke name="{call.name}">')
        for k, v in call.arguments.items():
            kind, value = ("true", v) if isinstance(v, str) else ("false", json.dumps(v, ensure_ascii=False))
            lines.append(f'<{DSML}parameter name="{k}" string="{kind}">{value}</{DSML}parameter>')
        lines.append(f"</{DSML}invoke>")
    lines.append(CALLS_CLOSE)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- replies

_INVOKE = re.compile(rf'<{DSML}invoke name="([^"]*)">\n?(.*?)</{DSML}invoke>', re.S)
_PARAM = re.compile(rf'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.S)


def parse_reply(text: str, mode: str = "thinking") -> dict[str, Any]:
    """A generated reply (the text after the prompt, special tokens kept) -> {"role": "assistant",
    "reasoning_content", "content", "tool_calls": [{"name", "arguments"}]} and, when the reply is not well formed,
    "errors": what is wrong (the parts that could be read are still returned)."""
    errors: list[str] = []
    text = text.split(EOS, 1)[0]
    reasoning = None
    if mode == "thinking":
        if END_THINK in text:
            reasoning, text = text.split(END_THINK, 1)
            reasoning = reasoning.removeprefix(THINK)
        else:
            reasoning, text = text.removeprefix(THINK), ""
            errors.append("the reasoning was never closed with </think>")
    calls: list[dict[str, Any]] = []
    if CALLS_OPEN in text:
        text, block = text.split(CALLS_OPEN, 1)
        if CALLS_CLOSE in block:
            block = block.split(CALLS_CLOSE, 1)[0]
        else:
            errors.append("the tool calls block was never closed")
        for name, body in _INVOKE.findall(block):
            args: dict[str, Any] = {}
            for key, is_str, value in _PARAM.findall(body):
                if is_str == "true":
                    args[key] = value
                    continue
                try:
                    args[key] = json.loads(value)
                except json.JSONDecodeError:
                    args[key] = value
                    errors.append(f"tool call {name!r}: parameter {key!r} is not JSON: {value[:40]!r}")
            calls.append({"name": name, "arguments": args})
        if not calls:
            errors.append("a tool calls block without a well-formed invoke")
        text = text.removesuffix("\n\n")
    reply: dict[str, Any] = {"role": "assistant", "reasoning_content": reasoning, "content": text,
                             "tool_calls": calls}
    if errors:
        reply["errors"] = errors
    return reply


def history_message(reply: dict[str, Any]) -> Message:
    """A parsed reply as the assistant message of the conversation's history."""
    return Message("assistant", reply["content"], reply["reasoning_content"],
                   [ToolCall(c["name"], c["arguments"]) for c in reply["tool_calls"]])
