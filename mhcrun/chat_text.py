"""The fixed texts of DeepSeek V4's chat formats: marker tokens, reasoning-effort preambles and the tools block.

The released checkpoints were trained on these texts, so they must match byte for byte. Three layouts use them
(`mhcrun.chat`): the encoder published with V4 (`v4`), and the V4 and V4.1 encodings of the
`deepseek-recipe` package (`recipe-v4`, `recipe-v41`).
"""

from __future__ import annotations

from dataclasses import dataclass

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, REMINDER, SYSTEM = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>", "<｜System｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
# quick-instruction tasks of the published encoder: a message's "task" -> the token that asks for it
TASK_TOKENS = {"action": "<｜action｜>", "query": "<｜query｜>", "authority": "<｜authority｜>",
               "domain": "<｜domain｜>", "title": "<｜title｜>", "read_url": "<｜read_url｜>"}

EFFORT_ABSOLUTE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
EFFORT_BEYOND = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n")


def effort_budget(value: int) -> str:
    """recipe-v41's numeric reasoning-effort line."""
    return f"Reasoning Effort: {value} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


RESPONSE_FORMAT_HEAD = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


@dataclass(frozen=True)
class Dsml:
    """The tag names of a format's tool-call markup: `<｜DSML｜{calls}>`, `<｜DSML｜{invoke} name=...>`,
    `<｜DSML｜{parameter} name=... string=...>`."""
    calls: str
    invoke: str
    parameter: str

    def open(self, tag: str) -> str:
        return f"<{DSML}{tag}"

    def close(self, tag: str) -> str:
        return f"</{DSML}{tag}>"

    def tools_header(self) -> str:
        """The "## Tools" block up to the schemas (one JSON object a line follows, then TOOLS_FOOTER)."""
        o, c, calls, inv, par = self.open, self.close, self.calls, self.invoke, self.parameter
        return ("## Tools\n\n"
                "You have access to a set of tools to help answer the user's question. You can invoke tools by "
                f'writing a "{o(calls)}>" block like the following:\n\n'
                f"{o(calls)}>\n"
                f'{o(inv)} name="$TOOL_NAME">\n'
                f'{o(par)} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{c(par)}\n'
                "...\n"
                f"{c(inv)}\n"
                f'{o(inv)} name="$TOOL_NAME2">\n'
                "...\n"
                f"{c(inv)}\n"
                f"{c(calls)}\n\n"
                'String parameters should be specified as is and set `string="true"`. For all other types '
                '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
                f"If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside "
                f"{THINK}...{END_THINK} BEFORE any tool calls or final response.\n\n"
                f"Otherwise, output directly after {END_THINK} with tool calls or final response.\n\n"
                "### Available Tool Schemas\n\n")


TOOLS_FOOTER = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
DSML_V4 = Dsml("tool_calls", "invoke", "parameter")
DSML_V41 = Dsml(" calls", " invoke", " parameter")
