"""The chat layouts of the `deepseek-recipe` package (0.2.0): its V4 encoding (`recipe-v4`) and its V4.1 encoding
(`recipe-v41`), written anew here from their behaviour and checked against the package on tests/data/chat/*.

How a conversation is laid out (what differs from the published V4 layout: docs/chat-format.md):
  BOS, then the system part: in thinking mode the reasoning-effort preamble, the system text and, with tools,
  the "## Tools" block; recipe-v4 gathers every system (and developer) message's text there, joined by blank
  lines, while recipe-v41 opens the part with `<｜System｜>` and writes a later system message where it stands,
  after `<｜System｜>`;
  then the turns: `<｜User｜>` + the user's text (consecutive user messages, and tool results as
  `<tool_result>...</tool_result>` in the order of the calls they answer, merged into one turn, joined by blank
  lines); `<｜latest_reminder｜>` + a reminder's text where it stands; `<｜Assistant｜>` + its thinking part +
  content + its tool calls + EOS;
  and, unless the last message is an assistant message marked `prefix` (continued as it is), the generation
  prefix `<｜Assistant｜>` + `<think>` (thinking mode) or `</think>` (chat mode).
An assistant turn's thinking part is `<think>reasoning</think>` in thinking mode with tools declared and
`</think>` otherwise: earlier turns' reasoning is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mhcrun.chat_messages import Chat
from mhcrun.chat_published import render_calls, render_tools
from mhcrun.chat_text import (
    ASSISTANT,
    BOS,
    DSML_V4,
    DSML_V41,
    EFFORT_ABSOLUTE,
    EFFORT_BEYOND,
    END_THINK,
    EOS,
    REMINDER,
    SYSTEM,
    THINK,
    USER,
    Dsml,
    effort_budget,
)


@dataclass(frozen=True)
class Layout:
    dsml: Dsml
    efforts: dict[str, str]  # --reasoning-effort -> the thinking-mode preamble
    system_token: str  # "" (recipe-v4) or <｜System｜> (recipe-v41: system messages written where they stand)
    blank_when_empty: bool  # a call without arguments has an empty line inside its invoke


RECIPE_V4 = Layout(DSML_V4, {"low": "", "high": EFFORT_ABSOLUTE, "xhigh": EFFORT_ABSOLUTE, "max": EFFORT_BEYOND},
                   "", False)
RECIPE_V41 = Layout(DSML_V41, {"low": effort_budget(50), "high": effort_budget(75), "xhigh": effort_budget(75),
                               "max": effort_budget(100)}, SYSTEM, True)
EFFORTS = ("low", "high", "xhigh", "max")


def recipe_tool(fn: dict[str, Any]) -> dict[str, Any]:
    """A tool function as the recipe writes its schema: name, description ("" when absent), parameters."""
    return {"name": fn["name"], "description": fn.get("description") or "", "parameters": fn.get("parameters", {})}


def check_recipe_chat(chat: Chat, name: str) -> None:
    """What the recipe's request conversion refuses or has no place for."""
    for m in chat.messages:
        for key, given in (("task", m.task), ("tools", m.tools), ("response_format", m.response_format)):
            if given:
                raise chat.refuse(f"{m.path}.{key}", f"the {name} chat format has no place for it (use --chat-format "
                                                      f"v4)")
        if m.role == "tool" and not m.tool_call_id:
            raise chat.refuse(f"{m.path}.tool_call_id", f"the {name} chat format needs the tool_call_id of the call "
                                                         f"a tool message answers")
    for i, fn in enumerate(chat.tools):
        if fn.get("strict"):
            raise chat.refuse(f"$.tools[{i}].function.strict",
                              f"the {name} chat format rewrites a strict tool's schema; mhcrun does not (use "
                              f"--chat-format v4)")
    if chat.messages[-1].prefix and chat.tools:
        raise chat.refuse(f"{chat.messages[-1].path}.prefix", "a continued (prefix) assistant message cannot be "
                                                               "used with tools")


def encode_recipe(chat: Chat, mode: str, effort: str, layout: Layout, name: str) -> str:
    """The prompt text for `chat` in a deepseek-recipe layout (see the module docstring)."""
    check_recipe_chat(chat, name)
    thinking = mode == "thinking"
    in_place = bool(layout.system_token)
    msgs = chat.messages
    lead = 1 if in_place and msgs[0].role in ("system", "developer") else 0
    system = [m.content for m in (msgs[:lead] if in_place else msgs) if m.role in ("system", "developer")]
    out = [BOS, layout.system_token if (thinking or any(system) or chat.tools) else "",
           layout.efforts[effort] if thinking else "", "\n\n".join(system)]
    if chat.tools:
        out += ["\n\n", render_tools([recipe_tool(t) for t in chat.tools], layout.dsml)]
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
    for m in msgs[lead:]:
        if m.role == "user":
            flush_results()
            user.append(m.content)
        elif m.role == "tool":
            results[order.get(m.tool_call_id, len(order) + len(results))] = f"<tool_result>{m.content}</tool_result>"
        elif m.role in ("system", "developer"):
            if in_place:
                close_user()
                out.extend([layout.system_token, m.content])
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
                out.extend(["\n\n", render_calls(m.tool_calls, layout.dsml, layout.blank_when_empty)])
            continued = m.prefix
            if not m.prefix:
                out.append(EOS)
    close_user()
    if not continued:
        out.extend([ASSISTANT, THINK if thinking else END_THINK])
    return "".join(out)
