"""DeepSeek V4's chat formats: OpenAI-style messages -> the prompt text an instruct checkpoint was trained on, and
a generated reply -> reasoning, content and tool calls.

Three layouts, chosen by name (`--chat-format`):
- `v4` (the default): the encoder published with the V4 checkpoints (`encoding/encoding_dsv4.py` in the model
  repository), mhcrun.chat_published;
- `recipe-v4` and `recipe-v41`: the V4 and V4.1 encodings of the `deepseek-recipe` package, mhcrun.chat_recipe.
docs/chat-format.md lists how they differ. Reading a messages file is mhcrun.chat_messages.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mhcrun import chat_published, chat_recipe
from mhcrun.chat_messages import Chat, Message, ToolCall, parse_chat, read_messages
from mhcrun.chat_text import (
    ASSISTANT,
    BOS,
    DSML,
    DSML_V4,
    DSML_V41,
    END_THINK,
    EOS,
    REMINDER,
    SYSTEM,
    TASK_TOKENS,
    THINK,
    USER,
    Dsml,
)
from mhcrun.errors import InputError

__all__ = ["Chat", "Message", "ToolCall", "parse_chat", "read_messages", "encode_chat", "parse_reply",
           "history_message", "reply_mode", "check_replyable", "resolve_format", "check_effort", "FORMATS", "MODES",
           "BOS", "EOS", "THINK", "END_THINK"]

MODES = ("chat", "thinking")
MARKERS = (BOS, EOS, USER, ASSISTANT, REMINDER, THINK, END_THINK, DSML)


@dataclass(frozen=True)
class ChatFormat:
    encode: Callable[[Chat, str, str], str]
    efforts: tuple[str, ...]  # what --reasoning-effort takes
    default_effort: str
    dsml: Dsml
    special_tokens: tuple[str, ...]  # markers the tokenizer must hold as single tokens


FORMATS = {
    "v4": ChatFormat(chat_published.encode_published, chat_published.EFFORTS, "none", DSML_V4,
                     MARKERS + tuple(TASK_TOKENS.values())),
    "recipe-v4": ChatFormat(lambda c, m, e: chat_recipe.encode_recipe(c, m, e, chat_recipe.RECIPE_V4, "recipe-v4"),
                            chat_recipe.EFFORTS, "high", DSML_V4, MARKERS),
    "recipe-v41": ChatFormat(lambda c, m, e: chat_recipe.encode_recipe(c, m, e, chat_recipe.RECIPE_V41,
                                                                       "recipe-v41"),
                             chat_recipe.EFFORTS, "high", DSML_V41, MARKERS + (SYSTEM,)),
}
DEFAULT_FORMAT = "v4"


def resolve_format(name: str | None, model_dir: Path | None = None) -> str:
    """--chat-format, else what the checkpoint's directory says (its encoding/ folder), else v4."""
    if name is not None:
        if name not in FORMATS:
            raise InputError(f"unknown --chat-format {name!r} (choose from: {', '.join(FORMATS)})")
        return name
    enc = model_dir / "encoding" if model_dir is not None else None
    if enc is not None and enc.is_dir():
        if (enc / "encoding_dsv4.py").is_file():
            return "v4"
        others = sorted(p.name for p in enc.glob("encoding_*.py"))
        if others:
            raise InputError(f"{enc}: the checkpoint ships {', '.join(others)}, an encoder mhcrun does not implement;"
                             f" choose a layout with --chat-format ({', '.join(FORMATS)})")
    return DEFAULT_FORMAT


def check_effort(fmt: str, effort: str | None) -> str:
    """--reasoning-effort for `fmt` (its default when not given)."""
    f = FORMATS[fmt]
    effort = f.default_effort if effort is None else effort
    if effort not in f.efforts:
        raise InputError(f"unknown --reasoning-effort {effort!r} for --chat-format {fmt} (choose from: "
                         f"{', '.join(f.efforts)})")
    return effort


def encode_chat(chat: Chat, mode: str = "thinking", effort: str | None = None, fmt: str = DEFAULT_FORMAT) -> str:
    """The prompt text for `chat` in layout `fmt`; ends ready for the assistant's reply."""
    if fmt not in FORMATS:
        raise InputError(f"unknown --chat-format {fmt!r} (choose from: {', '.join(FORMATS)})")
    if mode not in MODES:
        raise InputError(f"unknown --mode {mode!r} (choose from: {', '.join(MODES)})")
    return FORMATS[fmt].encode(chat, mode, check_effort(fmt, effort))


def check_replyable(chat: Chat, prompt: str) -> None:
    """A prompt to generate from must end where a reply begins: the v4 layout opens no reply after a trailing
    assistant, system or reminder message (chat-prompt still prints such a prompt)."""
    last = chat.messages[-1]
    if last.prefix or prompt.endswith((THINK, END_THINK, *TASK_TOKENS.values())):
        return
    raise chat.refuse(last.path, f"the conversation ends with a {last.role} message, after which this chat format "
                                 f"opens no reply (end with a user message, or mark a last assistant message "
                                 f"\"prefix\": true to continue it)")


def reply_mode(prompt: str) -> str:
    """How the reply to `prompt` starts: "thinking" when the prompt leaves the reasoning open (it ends in
    `<think>` or inside a continued reasoning), else "chat"."""
    if prompt.endswith(tuple(TASK_TOKENS.values())):
        return "chat"
    return "thinking" if prompt.rfind(THINK) > prompt.rfind(END_THINK) else "chat"


# ---------------------------------------------------------------------------------------------- replies


def parse_reply(text: str, mode: str = "thinking", fmt: str = DEFAULT_FORMAT) -> dict[str, Any]:
    """A generated reply (the text after the prompt, special tokens kept) -> {"role": "assistant",
    "reasoning_content", "content", "tool_calls": [{"name", "arguments"}]} and, when the reply is not well formed,
    "errors": what is wrong (the parts that could be read are still returned)."""
    d = FORMATS[fmt].dsml
    calls_open, calls_close = f"{d.open(d.calls)}>", d.close(d.calls)
    invoke = re.compile(rf'{re.escape(d.open(d.invoke))} name="([^"]*)">\n?(.*?){re.escape(d.close(d.invoke))}', re.S)
    param = re.compile(rf'{re.escape(d.open(d.parameter))} name="([^"]*)" string="(true|false)">(.*?)'
                       rf'{re.escape(d.close(d.parameter))}', re.S)
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
    if calls_open in text:
        text, block = text.split(calls_open, 1)
        if calls_close in block:
            block = block.split(calls_close, 1)[0]
        else:
            errors.append("the tool calls block was never closed")
        for name, body in invoke.findall(block):
            args: dict[str, Any] = {}
            for key, is_str, value in param.findall(body):
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
