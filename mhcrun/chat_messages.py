"""A conversation as mhcrun reads it: OpenAI-style JSON messages -> Chat, every malformed part refused with the
file and the JSON path. The layouts that turn a Chat into a prompt: mhcrun.chat."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mhcrun.chat_text import TASK_TOKENS
from mhcrun.errors import InputError
from mhcrun.fileio import read_json

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")


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
    tool_call_id: str = ""  # a tool message: the call it answers ("" when not given)
    tools: list[dict[str, Any]] = field(default_factory=list)  # a system/developer message's own tool functions
    response_format: dict[str, Any] | None = None  # a system/developer message's reply schema
    task: str | None = None  # a quick-instruction task (TASK_TOKENS)
    path: str = ""  # where it stands in the file ("$.messages[3]")


@dataclass
class Chat:
    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)  # the file's "tools": OpenAI "function" objects
    where: str = "messages"  # the file, for errors

    def refuse(self, path: str, msg: str) -> InputError:
        """An error about the part of the file at `path`."""
        return InputError(f"{self.where}: {path}: {msg}")


def read_messages(path: str | Path) -> Chat:
    """A messages file: a JSON list of messages, or {"messages": [...], "tools": [...]}. Anything malformed is an
    InputError naming the file and the JSON path."""
    p = Path(path)
    raw = read_json(p, InputError)
    return parse_chat(raw, str(p))


def parse_chat(raw: Any, where: str = "messages") -> Chat:
    """OpenAI-style JSON (a list of messages, or {"messages": [...], "tools": [...]}) -> Chat."""
    bad = Chat([], where=where).refuse
    if isinstance(raw, list):
        items, base, tools_raw = raw, "$", []
    elif isinstance(raw, dict):
        if "messages" not in raw:
            raise bad("$", "expected a list of messages or an object with 'messages'")
        items, base, tools_raw = raw["messages"], "$.messages", raw.get("tools") or []
        if not isinstance(items, list):
            raise bad(base, "expected a list of messages")
    else:
        raise bad("$", "expected a list of messages or an object with 'messages'")
    if not items:
        raise bad(base, "no messages")
    tools = parse_tools(tools_raw, "$.tools", bad)
    messages = [parse_message(m, f"{base}[{i}]", bad) for i, m in enumerate(items)]
    for m in messages[:-1]:
        if m.prefix:
            raise bad(f"{m.path}.prefix", "only the last message can be a prefix to continue")
    if tools and messages[0].tools:
        raise bad(f"{messages[0].path}.tools", "tools are given twice: here and in $.tools")
    check_tool_results(messages, bad)
    return Chat(messages, tools, where)


def check_tool_results(messages: list[Message], bad) -> None:
    """Tool messages answer the calls of the assistant message before them; a tool_call_id, when given, names one
    of those calls."""
    calls: list[str] | None = None
    for m in messages:
        if m.role == "assistant":
            calls = [c.id for c in m.tool_calls] if m.tool_calls else None
        elif m.role == "tool":
            if calls is None:
                raise bad(m.path, "a tool message must answer the tool_calls of the assistant message before it")
            if m.tool_call_id and m.tool_call_id not in calls:
                named = ", ".join(c for c in calls if c) or "its calls have no ids"
                raise bad(f"{m.path}.tool_call_id", f"{json.dumps(m.tool_call_id)} is not the id of a call of the "
                                                     f"assistant message before it ({named})")
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
    msg = Message(role, path=path)
    task = m.get("task")
    if task is not None and task not in TASK_TOKENS:
        raise bad(f"{path}.task", f"unknown task {json.dumps(task)} (choose from: {', '.join(TASK_TOKENS)})")
    msg.task = task
    for key in ("tools", "response_format"):
        if m.get(key) and role not in ("system", "developer"):
            raise bad(f"{path}.{key}", "only a system or developer message can carry it")
    msg.tools = parse_tools(m.get("tools") or [], f"{path}.tools", bad)
    if m.get("response_format") is not None:
        if not isinstance(m["response_format"], dict):
            raise bad(f"{path}.response_format", "expected a JSON object")
        msg.response_format = m["response_format"] or None
    content = m.get("content")
    if role == "assistant":
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            raise bad(f"{path}.tool_calls", "expected a list of tool calls")
        msg.tool_calls = [parse_call(c, f"{path}.tool_calls[{i}]", bad) for i, c in enumerate(calls)]
        if content is None and not msg.tool_calls:
            raise bad(f"{path}.content", "an assistant message needs content or tool_calls")
        msg.reasoning_content = m.get("reasoning_content")
        if msg.reasoning_content is not None and not isinstance(msg.reasoning_content, str):
            raise bad(f"{path}.reasoning_content", "expected a string")
        msg.prefix = m.get("prefix", False)
        if not isinstance(msg.prefix, bool):
            raise bad(f"{path}.prefix", "expected true or false")
        msg.content = "" if content is None else text_of(content, f"{path}.content", bad)
        return msg
    if content is None:
        raise bad(f"{path}.content" if "content" in m else path, f"a {role} message needs content")
    msg.content = text_of(content, f"{path}.content", bad)
    if role == "tool":
        msg.tool_call_id = m.get("tool_call_id") or ""
        if not isinstance(msg.tool_call_id, str):
            raise bad(f"{path}.tool_call_id", "expected a string")
    return msg


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
    call_id = c.get("id") or ""
    if not isinstance(call_id, str):
        raise bad(f"{path}.id", "expected a string")
    return ToolCall(fn["name"], args, call_id)


def parse_tools(raw: Any, path: str, bad) -> list[dict[str, Any]]:
    """OpenAI tools ([{"type": "function", "function": {...}}]) -> their function objects, as given."""
    if not isinstance(raw, list):
        raise bad(path, "expected a list of tools")
    out = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{path}[{i}]", "expected {\"type\": \"function\", \"function\": {\"name\": ..., ...}}")
        if not isinstance(fn.get("description") or "", str):
            raise bad(f"{path}[{i}].function.description", "expected a string")
        if not isinstance(fn.get("parameters", {}), dict):
            raise bad(f"{path}[{i}].function.parameters", "expected a JSON schema object")
        out.append(fn)
    return out
