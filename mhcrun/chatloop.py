"""`mhcrun chat`: an interactive conversation with a checkpoint in DeepSeek V4's chat format.

Each turn encodes the whole history (`mhcrun.chat`; earlier turns' reasoning dropped as the format says) and
generates the reply, streamed: in thinking mode the reasoning is shown dimmed (or hidden) until `</think>`, then
the answer. Ctrl-C stops a reply and keeps what was generated; /reset, /mode chat|thinking, /effort (what the chat
format takes) and /exit (or Ctrl-D) are the commands.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from mhcrun.chat import (
    END_THINK,
    EOS,
    FORMATS,
    MODES,
    THINK,
    Chat,
    Message,
    check_effort,
    encode_chat,
    history_message,
    parse_reply,
)
from mhcrun.generate import SamplingOptions, generate, make_decoder, raise_nonfinite
from mhcrun.memory import default_prefill_chunk
from mhcrun.promptcache import open_prompt_cache, save_new_prompt_cache, shared_prefix
from mhcrun.session import Session
from mhcrun.speculate import stats_note

HELP = ("commands: /reset (forget the conversation), /mode chat|thinking, /effort {efforts}, /exit (or Ctrl-D); "
        "Ctrl-C stops a reply")


class ReplyView:
    """Streams a reply's text: reasoning dimmed (or hidden) until </think>, then the answer; EOS not shown."""

    def __init__(self, out: Console, thinking: bool, hide_thinking: bool, stream):
        self.out, self.hide, self.stream = out, hide_thinking, stream
        self.reasoning = thinking  # a thinking-mode prompt ends with <think>: the reply starts in its reasoning
        self.tokens: list[int] = []
        self.t0, self.first, self.last = time.perf_counter(), 0.0, 0.0
        if thinking and not hide_thinking:
            out.print("thinking: ", style="dim italic", end="")

    def push(self, row: int, token: int) -> None:
        """generate's on_token: one more token of the reply."""
        self.last = time.perf_counter()
        self.first = self.first or self.last
        self.tokens.append(token)
        self.show(self.stream.push(token))

    def finish(self) -> None:
        self.show(self.stream.flush())
        self.out.print()

    def prefill_rate(self, prompt_tokens: int) -> float:
        return prompt_tokens / (self.first - self.t0) if self.first > self.t0 else 0.0

    def decode_rate(self) -> float:
        return (len(self.tokens) - 1) / (self.last - self.first) if self.last > self.first else 0.0

    def show(self, text: str) -> None:
        text = text.replace(EOS, "")
        if self.reasoning and END_THINK in text:
            before, text = text.split(END_THINK, 1)
            self.emit(before.removeprefix(THINK))
            self.reasoning = False
            if not self.hide:
                self.out.print()
        self.emit(text)

    def emit(self, text: str) -> None:
        if not text:
            return
        if self.reasoning:
            if not self.hide:
                self.out.print(text, style="dim", end="", markup=False, highlight=False)
        else:
            self.out.print(text, end="", markup=False, highlight=False)


def run_chat(runner, out: Console, err: Console, mode: str, effort: str | None, fmt: str, system: str | None,
             hide_thinking: bool, max_new_tokens: int, temperature: float, to_ids: Callable[[str], list[int]],
             top_p: float = 1.0, seed: int = 0, prompt_cache: Path | None = None, draft_tokens: int = 0,
             graph_mode: str = "eager") -> None:
    """The conversation's state stays in one cache row across turns (`mhcrun.session`): each turn prefills only
    what the row does not hold. With `prompt_cache`, a saved state is reused when a prompt starts with its tokens,
    and when the file does not exist the state after the first prompt is written to it. `draft_tokens` K > 0:
    each reply is decoded speculatively with the model's MTP layer (`mhcrun.speculate`), whose state the row
    keeps too. `graph_mode` "regions": replies decode through the compiled regions (compiled at the first reply,
    for a cache of the model's whole context, the row's)."""
    tok = runner.require_tokenizer()
    effort = check_effort(fmt, effort)
    encode_chat(Chat([Message("user", "")]), mode, effort, fmt)  # a bad --mode fails now
    efforts = FORMATS[fmt].efforts
    help_line = HELP.format(efforts="|".join(efforts))
    start = [Message("system", system)] if system else []
    history = list(start)
    context = runner.config.max_position_embeddings
    runner.model.setup_caches(1, context)
    session = Session(runner.model, default_prefill_chunk(runner.config))
    decoder = make_decoder(runner.model) if graph_mode == "regions" else None  # compiled at the first reply, kept
    cached = open_prompt_cache(runner, prompt_cache) if prompt_cache is not None else None
    if cached is not None:
        session.keep(cached)
    out.print(f"[bold]mhcrun chat[/] on {runner.path.name} ({fmt} format, {mode} mode). {help_line}", highlight=False)
    while True:
        try:
            line = out.input("[bold green]you>[/] ")
        except EOFError:
            out.print()
            return
        except KeyboardInterrupt:
            out.print()
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            if cmd == "/exit":
                return
            if cmd == "/reset":
                history = list(start)
                session.reset()
                if cached is not None:  # the prompt cache file stays usable
                    session.keep(cached)
                out.print("[dim](conversation reset)[/]")
            elif cmd in ("/mode", "/effort"):
                value, choices = arg.strip(), MODES if cmd == "/mode" else efforts
                if value not in choices:
                    out.print(f"[dim]{cmd} takes {', '.join(choices[:-1])} or {choices[-1]}, got {value!r}[/]",
                              highlight=False)
                elif cmd == "/mode":
                    mode = value
                    out.print(f"[dim](mode {mode})[/]")
                else:
                    effort = value
                    out.print(f"[dim](reasoning effort {effort})[/]")
            else:
                out.print(f"[dim]unknown command {line!r}; {help_line}[/]", highlight=False)
            continue
        history.append(Message("user", line))
        ids = to_ids(encode_chat(Chat(history), mode, effort, fmt))
        budget = min(max_new_tokens, context - len(ids) - draft_tokens)  # a verify runs up to K past the reply
        if budget < 1:
            history.pop()
            err.print(f"error: the conversation ({len(ids)} tokens) no longer fits the context of {context}: /reset",
                      markup=False)
            continue
        # where the next turn's rendering of this conversation will part from this prompt (e.g. before the
        # thinking opener, whose reasoning the history drops): a snapshot is taken there
        following = encode_chat(Chat(history + [Message("assistant", "x"), Message("user", "x")]), mode, effort, fmt)
        mark = shared_prefix(ids, to_ids(following))
        view = ReplyView(out, mode == "thinking", hide_thinking, tok.stream(keep_special=True))
        stopped, drafts = False, ""
        try:
            res = raise_nonfinite(generate(runner.model, [ids], budget, tok.eos_id,
                                           SamplingOptions(temperature, top_p, seed), on_token=view.push,
                                           session=session, marks=(mark,), draft_tokens=draft_tokens,
                                           graph_mode=graph_mode, decoder=decoder))
            drafts = f" | {stats_note(res[0].stats['speculative'])}" if "speculative" in res[0].stats else ""
        except KeyboardInterrupt:
            stopped = True
            session.lose_live_state()  # a step may have stopped half way through the row's state
        if prompt_cache is not None:
            save_new_prompt_cache(runner, prompt_cache, session, ids)
        view.finish()
        reply = parse_reply(tok.decode(view.tokens, keep_special=True), mode, fmt)
        history.append(history_message(reply))
        # a rate only where there was something to time: none for a prompt the kept state held whole, or one token
        prefill = f", prefill {view.prefill_rate(session.prefilled):.1f} tok/s" if session.prefilled else ""
        decode = f", decode {view.decode_rate():.1f} tok/s" if len(view.tokens) > 1 else ""
        out.print(f"[dim]{'(stopped) ' if stopped else ''}{len(ids)} prompt tokens ({session.reused} reused, "
                  f"{session.prefilled} prefilled){prefill} | {len(view.tokens)} tokens{decode}{drafts}[/]",
                  highlight=False)

