"""The chat layout published with DeepSeek V4 (the model repository's encoding/encoding_dsv4.py), written anew
here from its behaviour and checked against it on the published test vectors and on tests/data/chat/*.

How a conversation is laid out:
- tool results join the user turn they follow, or open one, as `<tool_result>...</tool_result>`; consecutive user
  messages join into one turn (unless the earlier one carries a task); the parts are joined by blank lines, tool
  results in the order of the calls they answer (by id);
- the file's `tools` go on the conversation's first message when it is a system message, else on an empty system
  message put first; a system or developer message renders its tools (and response format) after its text;
- thinking mode without any tools drops earlier turns' reasoning, and the developer messages before the last user
  turn; with tools every turn keeps its reasoning;
- each message is written where it stands: system as its text, developer and user after `<｜User｜>`, a reminder
  after `<｜latest_reminder｜>`, an assistant turn as [reasoning `</think>`] content [tool calls] EOS;
- after a user or developer turn followed by an assistant turn, a reminder or nothing: `<｜Assistant｜>` and
  `<think>` (thinking: the last user turn, or every turn when reasoning is kept) or `</think>`; a task on such a
  message puts its task token there instead (action: after `<｜Assistant｜>` and the think token);
- in thinking mode with reasoning effort max, the effort preamble comes before the first message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from mhcrun.chat_messages import Chat, Message, ToolCall
from mhcrun.chat_text import (
    ASSISTANT,
    BOS,
    DSML_V4,
    EFFORT_ABSOLUTE,
    END_THINK,
    EOS,
    REMINDER,
    RESPONSE_FORMAT_HEAD,
    TASK_TOKENS,
    THINK,
    TOOLS_FOOTER,
    USER,
    Dsml,
)

EFFORTS = ("none", "high", "max")  # "none" and "high" lay out the same prompt


@dataclass
class Turn:
    """One rendered unit: a message, or a user turn gathered from user and tool messages."""
    role: str
    message: Message
    parts: list[tuple[str, str]] = field(default_factory=list)  # a user turn: (tool_call_id or None, text)
    task: str | None = None


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(functions: list[dict[str, Any]], dsml: Dsml) -> str:
    return dsml.tools_header() + "\n".join(to_json(f) for f in functions) + TOOLS_FOOTER


def render_calls(calls: list[ToolCall], dsml: Dsml, blank_when_empty: bool = True) -> str:
    """An assistant turn's tool calls: strings as they are (string="true"), other values as JSON; a call without
    arguments has an empty line inside its invoke (not in recipe-v4: `blank_when_empty`)."""
    invokes = []
    for call in calls:
        params = []
        for k, v in call.arguments.items():
            kind, value = ("true", v) if isinstance(v, str) else ("false", to_json(v))
            params.append(f'{dsml.open(dsml.parameter)} name="{k}" string="{kind}">{value}{dsml.close(dsml.parameter)}')
        body = "\n".join(params) + "\n" if params or blank_when_empty else ""
        invokes.append(f'{dsml.open(dsml.invoke)} name="{call.name}">\n{body}{dsml.close(dsml.invoke)}')
    return f"{dsml.open(dsml.calls)}>\n" + "\n".join(invokes) + f"\n{dsml.close(dsml.calls)}"


def gather_turns(chat: Chat) -> list[Turn]:
    """Messages -> turns: tool results and user messages joined into user turns, results in call order."""
    turns: list[Turn] = []
    if chat.tools:
        first = chat.messages[0]
        if first.role == "system":
            turns.append(Turn("system", replace(first, tools=chat.tools), task=first.task))
        else:
            turns.append(Turn("system", Message("system", tools=chat.tools)))
    for m in chat.messages[1:] if turns and chat.messages[0].role == "system" else chat.messages:
        last = turns[-1] if turns else None
        if m.role == "tool":
            if last is not None and last.role == "user":
                last.parts.append((m.tool_call_id, f"<tool_result>{m.content}</tool_result>"))
            else:
                turns.append(Turn("user", m, [(m.tool_call_id, f"<tool_result>{m.content}</tool_result>")]))
        elif m.role == "user":
            if last is not None and last.role == "user" and last.task is None:
                last.parts.append((None, m.content))
            else:
                turns.append(Turn("user", m, [(None, m.content)], m.task))
        else:
            turns.append(Turn(m.role, m, task=m.task))
    order: dict[str, int] = {}
    for t in turns:
        if t.role == "assistant" and t.message.tool_calls:
            order = {c.id: j for j, c in enumerate(t.message.tool_calls) if c.id}
        elif t.role == "user" and order:
            slots = [i for i, (cid, _) in enumerate(t.parts) if cid is not None]
            ranked = sorted((t.parts[i] for i in slots), key=lambda p: order.get(p[0], 0))
            for i, part in zip(slots, ranked, strict=True):
                t.parts[i] = part
    return turns


def last_user_turn(turns: list[Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def render_turn(t: Turn, prev: Turn | None, thinking: bool, keep: bool, after_last_user: bool) -> str:
    m = t.message
    if t.role in ("system", "developer"):
        out = m.content
        if m.tools:
            out += "\n\n" + render_tools(m.tools, DSML_V4)
        if m.response_format:
            out += "\n\n" + RESPONSE_FORMAT_HEAD + to_json(m.response_format)
        return out if t.role == "system" else USER + out
    if t.role == "user":
        return USER + "\n\n".join(text for _, text in t.parts)
    if t.role == "latest_reminder":
        return REMINDER + m.content
    think = ""
    if thinking and (prev is None or prev.task is None) and (keep or after_last_user):
        think = (m.reasoning_content or "") + END_THINK
    calls = "\n\n" + render_calls(m.tool_calls, DSML_V4) if m.tool_calls else ""
    return think + m.content + calls + ("" if m.prefix else EOS)


def render_transition(t: Turn, thinking: bool, opens_reasoning: bool) -> str:
    """What follows a turn that is the last one or is followed by an assistant turn or a reminder."""
    if t.task is not None:
        if t.task != "action":
            return TASK_TOKENS[t.task]
        return ASSISTANT + (THINK if thinking else END_THINK) + TASK_TOKENS["action"]
    if t.role in ("user", "developer"):
        return ASSISTANT + (THINK if thinking and opens_reasoning else END_THINK)
    return ""


def encode_published(chat: Chat, mode: str, effort: str) -> str:
    """The prompt text for `chat` in the published V4 layout (see the module docstring)."""
    thinking = mode == "thinking"
    for m in chat.messages:
        if m.role == "developer" and not m.content:
            raise chat.refuse(f"{m.path}.content", "a developer message needs non-empty content")
    turns = gather_turns(chat)
    keep = not thinking or any(t.message.tools for t in turns)  # earlier reasoning kept (with tools)
    if not keep:
        last = last_user_turn(turns)
        turns = [t for i, t in enumerate(turns) if i >= last or t.role in ("user", "system", "latest_reminder",
                                                                             "assistant")]
    last = last_user_turn(turns)
    out = [BOS, EFFORT_ABSOLUTE if thinking and effort == "max" else ""]
    for i, t in enumerate(turns):
        out.append(render_turn(t, turns[i - 1] if i else None, thinking, keep, i > last))
        following = turns[i + 1].role if i + 1 < len(turns) else None
        if following in (None, "assistant", "latest_reminder"):
            out.append(render_transition(t, thinking, keep or i >= last))
    return "".join(out)
