"""The `mhcrun` command line (Typer + Rich).

Every user error prints one line `error: ...` on stderr and exits non-zero (2 for bad input); a bug
prints one line too unless `--debug` asks for the traceback.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import json
import math
import os
import signal
import sys
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import typer
import typer.core
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mhcrun.errors import INTERNAL, OS_FAILED, InputError, MhcrunError, Terminated, raise_terminated, signal_exit
from mhcrun.heap import glibc_version, restart_env, thp_mode
from mhcrun.settings import (
    REGIONS_CONTEXT_STEP,
    REGIONS_MIN_CONTEXT,
    Env,
    cache_length,
    check_range,
    regions_context,
)

# --help panels, in the order they are shown (PanelledCommand); developer knobs last
INPUT, CHECK, SAMPLING, PATH, MEMORY, OUTPUT, DEVELOPER = ("Input", "Check", "Sampling", "Path under test",
                                                           "Memory", "Output", "Developer")
PANELS = (INPUT, CHECK, SAMPLING, PATH, MEMORY, OUTPUT, DEVELOPER)


class OneLineUsage:
    """A command or group whose own command line, refused by click, is said in one line (`one_line_usage_errors`)."""

    def make_context(self, info_name, args, parent=None, **extra):
        with one_line_usage_errors(f"{parent.command_path} {info_name}" if parent else info_name):
            return super().make_context(info_name, args, parent, **extra)


class PanelledCommand(OneLineUsage, typer.core.TyperCommand):
    """A command whose --help shows its options panel by panel in PANELS' order, whatever their order in code, its
    flags without a type (they take no value), and whose line in `mhcrun --help` is its docstring's first paragraph
    as one line (rich keeps the docstring's line breaks there, ragged against the terminal's width)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.short_help is None and self.help:
            self.short_help = " ".join(inspect.cleandoc(self.help).split("\n\n")[0].split())

    def get_params(self, ctx):
        def rank(param) -> int:
            panel = getattr(param, "rich_help_panel", None)
            return PANELS.index(panel) if panel in PANELS else -1

        return untyped_flags(sorted(super().get_params(ctx), key=rank))


class Group(OneLineUsage, typer.core.TyperGroup):
    """mhcrun's command group: its --help flag without a type, as the commands' flags, and a command line click
    refuses (an unknown command or option, a value of the wrong type, a missing argument) said in one line."""

    def get_params(self, ctx):
        return untyped_flags(super().get_params(ctx))

    def resolve_command(self, ctx, args):
        with one_line_usage_errors():
            return super().resolve_command(ctx, args)


# click's UsageError, whichever click typer runs on (typer 0.2x carries its own copy, earlier ones click's)
UsageError = typer.BadParameter.__bases__[0]


@contextlib.contextmanager
def one_line_usage_errors(command: str | None = None):
    """click's usage error as the one line `error: ...` and exit 2 that bad input gets everywhere else (click
    shows usage, a hint and a framed message), naming the command's --help (`command`, where click's error has no
    context yet); `mhcrun` alone still shows the help."""
    try:
        yield
    except UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # no command given: the help, as click shows it
            raise
        path = e.ctx.command_path if e.ctx is not None else command
        where = f" (see {path} --help)" if path else ""
        say_error(f"error: {' '.join(e.format_message().split()).rstrip('.')}{where}")
        sys.exit(e.exit_code)


def untyped_flags(params: list) -> list:
    """params, each flag's help shown without a type ("<bool>" beside a flag reads as if it wanted a value)."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


app = typer.Typer(cls=Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)


def show_version(asked: bool) -> None:
    """--version: mhcrun's version and the torch and Python it runs on (what a bug report needs), then exit 0."""
    if not asked:
        return
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        mine = version("mhcrun")
    except PackageNotFoundError:  # run from a source tree that pip did not install
        mine = "(not installed)"
    print(f"mhcrun {mine}, torch {torch.__version__}, Python {sys.version.split()[0]}")
    raise typer.Exit()


@app.callback()
def main_options(version: bool = typer.Option(False, "--version", callback=show_version, is_eager=True,
                                              help="Show mhcrun's version (and torch's, Python's) and exit.")) -> None:
    """Run DeepSeek V4-family (mHC) checkpoints token-exactly, and check them against goldens."""  # `mhcrun --help`


class Output(Console):
    """stdout's console. A reader gone (`| head`) raises BrokenPipeError, for `run_guarded` to end the command by as
    it ends one whose print() found the pipe closed; rich's own answer, exit 1, is golden-check's mismatch."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError(errno.EPIPE, "stdout's reader left")


out = Output(highlight=False)
err = Console(stderr=True, highlight=False)

DEFAULT_PROMPT = "The river runs past the mill"

ModelOpt = typer.Option(None, "--model", "-m", help="Checkpoint directory (default: the bundled tiny model).",
                        rich_help_panel=INPUT)
DebugOpt = typer.Option(False, "--debug", help="Show tracebacks.", rich_help_panel=DEVELOPER)
JsonOpt = typer.Option(False, "--json", help="Machine-readable output.", rich_help_panel=OUTPUT)
GraphModeOpt = typer.Option(None, "--graph-mode", help="eager or regions (compiled decode; env MHCRUN_GRAPH_MODE; "
                            "default regions on cuda/neuron, eager on cpu).", rich_help_panel=PATH)
LayersOpt = typer.Option(None, "--layers", help="Run only the first N layers (then the head), to bring a big "
                         "model up piece by piece.", rich_help_panel=DEVELOPER)
DequantizeOpt = typer.Option(False, "--dequantize", help="Dequantise FP8/FP4 weights to fp32 at load (the reference "
                             "the quantised GEMMs are checked against) instead of keeping them quantised.",
                             rich_help_panel=PATH)
MemoryLimitOpt = typer.Option(None, "--memory-limit", help="Memory the plan must fit in (e.g. 24G, 512MiB); "
                              "default: what this machine has available.",
                              rich_help_panel=MEMORY)
StagesOpt = typer.Option("whole", "--stages", help="Compiled graphs per region: whole, or split at its stages.",
                         rich_help_panel=DEVELOPER)
PrefillChunkOpt = typer.Option(None, "--prefill-chunk", help="Prefill prompts this many tokens at a time (default: "
                               "chosen so that a chunk's activations stay within a fixed budget; `info` says which).",
                               rich_help_panel=MEMORY)


TempOpt = typer.Option(0.0, "--temperature", "--temp", help="0 = greedy.", rich_help_panel=SAMPLING)
TopPOpt = typer.Option(1.0, "--top-p", help="Nucleus sampling: keep the fewest tokens whose probability reaches P.",
                       rich_help_panel=SAMPLING)
SeedOpt = typer.Option(0, "--seed", help="Sampling seed.", rich_help_panel=SAMPLING)
DtypeOpt = typer.Option("fp32", "--dtype", help="fp32 or bf16 activations.", rich_help_panel=PATH)
QuantSimOpt = typer.Option(True, "--quant-sim/--no-quant-sim", rich_help_panel=PATH,
                           help="Simulate DeepSeek's FP8/FP4 rounding (kv, indexer, GEMM activations).")
DeviceOpt = typer.Option("cpu", "--device", help="cpu, cuda or neuron.", rich_help_panel=PATH)


def max_tokens_option(default: int, help: str = "Most new tokens per prompt."):
    """--max-new-tokens, also spelled --max-tokens (as in vLLM and the OpenAI API) and -n."""
    return typer.Option(default, "--max-new-tokens", "--max-tokens", "-n", help=help, rich_help_panel=SAMPLING)


TpOpt = typer.Option(1, "--tp", help="Run across N ranks of torch.distributed (gloo on cpu, nccl on cuda), sharded "
                     "as DeepSeek's reference shards V4; mhcrun starts the ranks itself (or run under torchrun).",
                     rich_help_panel=PATH)


def start_tp(tp: int, model: str | None, device: str, env: Env, inputs: dict[str, Path | None] | None = None):
    """--tp: in the user's process, check that N divides what it splits and that every rank can read the `inputs`
    (flag -> path) again, start the N ranks and return (None, their exit code); in a rank (started so, or by
    torchrun) join the group and return (its shard, None). Only rank 0 prints."""
    from mhcrun.parallel import SINGLE, check_divides, env_shard, follow_launcher, init_workers, launch

    shard = env_shard(env)
    if shard is None:
        if tp == 1:
            return SINGLE, None
        from mhcrun.fileio import check_rereadable

        for flag, path in (inputs or {}).items():
            if path is not None:
                check_rereadable(path, flag)
        from mhcrun.config import load_config
        from mhcrun.runner import DEVICES, check_choice, resolve_model_path

        check_choice("--device", device, DEVICES)
        check_divides(load_config(resolve_model_path(model)), tp)
        if device == "cuda":
            import torch

            if torch.cuda.device_count() < tp:
                raise InputError(f"--tp {tp}: this machine has {torch.cuda.device_count()} CUDA devices")
        if device == "neuron":
            from mhcrun.runner import check_device

            check_device(device)  # the Neuron SDK must be there before any worker starts
        return None, launch(tp, sys.argv[1:], os.environ)
    if tp not in (1, shard.world):
        raise InputError(f"--tp {tp} but this process is one of WORLD_SIZE={shard.world} ranks")
    if env.launcher is not None:
        follow_launcher(env.launcher)
    init_workers(shard, device, env.local_rank)
    if shard.rank:  # only rank 0 prints; an error line still goes out (say_error)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
        err.quiet = True
    return shard, None


def say_error(line: str) -> None:
    """The one error line, on stderr, whatever the rank (`err` is quiet on ranks other than 0); where stderr is gone
    too (a closed terminal's SIGHUP), none."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)


def leave(code: int) -> NoReturn:
    """End the command with `code`. A rank of a process group leaves at once, its output flushed, without the
    interpreter's teardown: gloo's threads, torn down at exit after a peer has closed its connections, can abort
    the process ("terminate called without an active exception"; seen on success and on failure). On success
    the ranks first meet at a barrier, so that none leaves while a peer still reads from it."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        if code == 0:
            with contextlib.suppress(Exception):  # a peer that left with another code: nothing to wait for
                dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise typer.Exit(code)


# an OSError of these kinds without a file name came from writing the output (stdout): the files the CLI writes
# name themselves in theirs
WRITE_ERRNOS = (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG)


def run_guarded(debug: bool, fn: Callable[[], int | None]) -> None:
    """Run a command body; turn errors into one line and an exit code."""
    try:
        code = fn() or 0
        sys.stdout.flush()  # what is left to write, written here: a reader gone is then seen below
    except MhcrunError as e:
        if debug:
            raise
        say_error(f"error: {e}")
        leave(e.exit_code)
    except (KeyboardInterrupt, Terminated) as e:  # Ctrl-C, SIGTERM, SIGHUP: what was being written is removed by now
        line, code = signal_exit(e)
        say_error(line)
        leave(code)
    except BrokenPipeError:  # stdout's reader left (`| head`): stop quietly, as a process SIGPIPE ends does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        leave(128 + signal.SIGPIPE)
    except Exception as e:  # a bug, or the OS refusing a read or write: still one line unless --debug
        if debug:
            raise
        from mhcrun.parallel import ECHO, peer_lost

        # another rank failed first: mhcrun's launcher shows that rank's line, not this echo (MHCRUN_TP_LAUNCHED is
        # read here, where the error arrives: the command's Env may not exist yet, or may be what failed)
        if peer_lost(e, os.environ.get("MHCRUN_TP_LAUNCHED") == "1"):
            leave(ECHO)
        if isinstance(e, OSError):  # a full disk, a device gone (the files mhcrun checks say so themselves: exit 2)
            where = f": {e.filename}" if e.filename else " (writing the output)" if e.errno in WRITE_ERRNOS else ""
            say_error(f"error: {e.strerror or e}{where}")
            leave(OS_FAILED)
        say_error(f"error: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)")
        leave(INTERNAL)
    leave(code)


def run_settings(ctx: typer.Context, device: str = "cpu", graph_mode: str | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, memory_limit: str | None = None, **fields):
    """-> (the run's settings, every option checked once: `mhcrun.settings`; the environment, as `main` read it)."""
    from mhcrun.memory import parse_size
    from mhcrun.settings import RunSettings, SamplingOptions, default_graph_mode

    # read here only where main did not hand it on: the app run without main (tests), or a bad value, said now
    env = ctx.obj if isinstance(ctx.obj, Env) else Env.read()
    limit = None if memory_limit is None else parse_size(memory_limit)
    return RunSettings(sampling=SamplingOptions(temperature, top_p, seed), memory_limit=limit,
                       graph_mode=graph_mode or default_graph_mode(device, env), **fields), env


@contextlib.contextmanager
def bytes_progress(label: str, quiet: bool = False):
    """A progress bar of bytes on stderr (only on a terminal), as a callback(done_bytes, total_bytes)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn(label), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True, disable=quiet or not err.is_terminal) as progress:
        task = progress.add_task(label, total=None)
        yield lambda done, total: progress.update(task, completed=done, total=total)


def load_weights(runner, quiet: bool = False) -> None:
    """Map the shards and build the model, with a progress bar (bytes) on stderr."""
    with bytes_progress(f"loading {runner.path.name}", quiet) as progress:
        runner.load(progress)


def scan_weights(runner, quiet: bool = False) -> tuple[list, int, float]:
    """`--check-weights`: scan every stored tensor (`mhcrun.weightcheck`), with a progress bar on stderr.
    -> (bad tensors, bytes read, seconds)."""
    import time

    from mhcrun.weightcheck import check_weights

    t0 = time.perf_counter()
    with bytes_progress(f"checking {runner.path.name}", quiet) as progress:
        bad = check_weights(runner.plan, runner.scan, progress)
    return bad, sum(runner.plan.bytes_by_dtype.values()), time.perf_counter() - t0


CheckWeightsOpt = typer.Option(False, "--check-weights", help="Scan every stored tensor first: NaN/Inf floats, FP8 "
                               "NaN codes, NaN/Inf or overflowing scales (exit 3 naming each bad tensor).",
                               rich_help_panel=INPUT)


ModeOpt = typer.Option("thinking", "--mode", help="Chat format mode: thinking (<think> opens the reply) or chat.",
                       rich_help_panel=INPUT)
EffortOpt = typer.Option(None, "--reasoning-effort", help="Thinking mode's reasoning effort, as the chat format "
                         "takes it: v4 none|high|max (default none; only max adds a preamble), recipe-v4 and "
                         "recipe-v41 low|high|xhigh|max (default high).", rich_help_panel=INPUT)
FormatOpt = typer.Option(None, "--chat-format", help="Prompt layout: v4 (the encoder published with DeepSeek V4), "
                         "recipe-v4 or recipe-v41 (the deepseek-recipe package's); default: what the checkpoint's "
                         "encoding/ folder says, else v4 (docs/chat-format.md).", rich_help_panel=INPUT)


def compile_note(runner, model: str | None, stages: str, batch: int, context: int,
                 draft_tokens: int | None = None, ahead: bool = True) -> str:
    """What a regions run of `batch` rows and a cache of `context` positions (`settings.cache_length`) says before
    it compiles: when (`ahead`: before its prefill, as a run on fresh caches does where its graphs' wrappers are
    C++, `RegionDecoder.compiles_ahead`; else at its first step, as a session's), and the compile-regions command
    that compiles the same graphs ahead of the run (the same checkpoint, path and shapes; with `draft_tokens`, a
    speculative verify's graphs)."""
    from mhcrun.regions.runner import default_backend, wraps_in_cpp

    given = [("-m", model), ("--device", runner.device if runner.device != "cpu" else None),
             ("--dtype", runner.dtype if runner.dtype != "fp32" else None),
             ("--no-quant-sim", "" if not runner.quant_sim else None),
             ("--dequantize", "" if runner.dequantize else None), ("--layers", runner.layers),
             ("--stages", stages if stages != "whole" else None),
             ("--tp", runner.tp.world if runner.tp.world > 1 else None), ("--draft-tokens", draft_tokens),
             ("--batch", batch), ("--context", context)]
    args = "".join(f" {opt}" + (f" {value}" if value != "" else "") for opt, value in given if value is not None)
    ahead = ahead and wraps_in_cpp(runner.model, default_backend(runner.device))
    when = "before the prefill" if ahead else f"at the first {'verify' if draft_tokens else 'decode'} step"
    return (f"compiling the regions' graphs {when}: 20 s or more the first time, seconds once torch's "
            f"compile cache holds them (`mhcrun compile-regions{args}` compiles them ahead)")


def say_compiling(mode: str, decodes: bool, quiet: bool, note: str) -> None:
    """A regions run compiles its graphs before its prefill (or a session's at its first decode step): say so on
    stderr first (else the run, its streamed prompt, or a golden check's table, waits 20 s or more unexplained), and
    how to compile them ahead (`compile_note`); not for a run without a decode step, nor for --json."""
    if mode == "regions" and decodes and not quiet:
        err.print(f"[dim]{escape(note)}[/]", soft_wrap=True)


CHAT_PARAMS = ("chat_mode", "reasoning_effort", "chat_format")  # generate's options that only --messages takes


def given_option(ctx: typer.Context, name: str) -> bool:
    """Whether the command line gave parameter `name` (not its default). By the source's name: typer carries its
    own click, whose ParameterSource is not click's."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def chat_ids(runner, text: str, fmt: str) -> list[int]:
    """A chat prompt's token ids from the model's tokenizer (BOS is in the text). A tokenizer without the chat
    format's tokens (the bundled tiny one) encodes their spellings as plain text: said once on stderr."""
    from mhcrun.chat import FORMATS

    tok = runner.require_tokenizer()
    if not tok.has_tokens(FORMATS[fmt].special_tokens) and not runner.warned_chat_tokens:
        runner.warned_chat_tokens = True
        err.print(f"warning: {runner.path}'s tokenizer has no DeepSeek V4 chat tokens ({fmt}): the chat markers are "
                  f"encoded as plain text (a released V4 checkpoint's tokenizer.json has them)", markup=False,
                  soft_wrap=True)
    return tok.encode(text, add_bos=False)


def collect_prompts(runner, prompt: str | None, prompt_ids: str | None, prompts_file: Path | None):
    """-> (names, texts or None, token id lists) from exactly one prompt source."""
    from mhcrun.prompts import parse_prompt_ids, read_prompts_file

    given = [x is not None for x in (prompt, prompt_ids, prompts_file)]
    if sum(given) > 1:
        raise InputError("give only one of --prompt, --prompt-ids and --prompts-file")
    vocab = runner.config.vocab_size
    if prompt_ids is not None:
        return ["prompt"], [None], [parse_prompt_ids(prompt_ids, vocab)]
    if prompts_file is not None:
        items = read_prompts_file(prompts_file, vocab)
    else:
        from mhcrun.prompts import Prompt

        items = [Prompt(id="prompt", text=DEFAULT_PROMPT if prompt is None else prompt, ids=None)]
    ids = [p.ids if p.ids is not None else runner.require_tokenizer().encode(p.text) for p in items]
    return [p.id for p in items], [p.text for p in items], ids


PromptCacheOpt = typer.Option(None, "--prompt-cache", help="A prompt cache file (safetensors): loaded when it exists "
                              "and this prompt starts with its tokens (only the rest is prefilled); else written "
                              "with the state after this prompt. Never overwritten.", rich_help_panel=INPUT)

DraftOpt = typer.Option(None, "--draft-tokens", help="Speculative decoding: draft K tokens per step (1 to 8) with the "
                        "checkpoint's MTP layer, verified by the model in one step.", rich_help_panel=SAMPLING)


class LockstepConsole:
    """`chat --tp`: the console every rank's chat loop reads from. Rank 0 reads each line from the terminal and
    broadcasts it (None for end of input), so that all ranks run each turn in lockstep; printing is the console's
    (stdout is /dev/null on the other ranks)."""

    def __init__(self, console: Console, shard):
        self.console, self.shard = console, shard

    def __getattr__(self, name: str):
        return getattr(self.console, name)

    def input(self, prompt: str = "") -> str:
        from mhcrun.parallel import broadcast_text

        line = None
        if self.shard.rank == 0:
            try:
                line = self.console.input(prompt)
            except EOFError:
                line = None
            except KeyboardInterrupt:
                line = ""  # an empty line: the loop asks again
        line = broadcast_text(line, self.shard)
        if line is None:
            raise EOFError
        return line


@app.command(cls=PanelledCommand)
def generate(
    ctx: typer.Context,
    model: str = ModelOpt,
    prompt: str = typer.Option(None, "--prompt", "-p", help="Prompt text (BOS is added).", rich_help_panel=INPUT),
    prompt_ids: str = typer.Option(None, "--prompt-ids", help="Comma-separated token ids, used as given.",
                                   rich_help_panel=INPUT),
    prompts_file: Path = typer.Option(None, "--prompts-file", help="JSON Lines: {\"prompt\": ...} or "
                                      "{\"prompt_ids\": [...]} per line; run as one batch.", rich_help_panel=INPUT),
    messages: Path = typer.Option(None, "--messages", help="A conversation (OpenAI-style JSON) in DeepSeek V4's chat "
                                  "format: generates the assistant's reply (--json adds it parsed as `message`).",
                                  rich_help_panel=INPUT),
    chat_mode: str = ModeOpt,
    reasoning_effort: str = EffortOpt,
    chat_format: str = FormatOpt,
    max_new_tokens: int = max_tokens_option(32),
    temperature: float = TempOpt,
    top_p: float = TopPOpt,
    seed: int = SeedOpt,
    dtype: str = DtypeOpt,
    quant_sim: bool = QuantSimOpt,
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating past eos.", rich_help_panel=SAMPLING),
    graph_mode: str = GraphModeOpt,
    stages: str = StagesOpt,
    device: str = DeviceOpt,
    layers: int = LayersOpt,
    dequantize: bool = DequantizeOpt,
    memory_limit: str = MemoryLimitOpt,
    prefill_chunk: int = PrefillChunkOpt,
    force: bool = typer.Option(False, "--force", help="Run even when the memory plan exceeds the available memory "
                               "(or --memory-limit): skips only that check.", rich_help_panel=MEMORY),
    check_weights: bool = CheckWeightsOpt,
    prompt_cache: Path = PromptCacheOpt,
    tp: int = TpOpt,
    draft_tokens: int = DraftOpt,
    warmup: bool = typer.Option(False, "--warmup", help="Prefill the first prompt and decode a token after it "
                                "once, untimed, before the timed run (as llama-bench warms up): the speeds then leave "
                                "out first-touch costs (the weights' pages mapped in, kernels loaded, threads "
                                "started).", rich_help_panel=OUTPUT),
    as_json: bool = JsonOpt,
    debug: bool = DebugOpt,
) -> None:
    """Generate text: eager prefill in chunks, then decode; reports tokens/s, compile time and peak memory."""

    def body() -> int | None:
        from mhcrun.generate import check_prompts, raise_nonfinite
        from mhcrun.generate import generate as run_generate
        from mhcrun.memory import check_fits
        from mhcrun.runner import open_runner

        st, env = run_settings(ctx, device, graph_mode, temperature, top_p, seed, memory_limit,
                             max_new_tokens=max_new_tokens, stages=stages, prefill_chunk=prefill_chunk, tp=tp,
                             draft_tokens=draft_tokens)
        mode, plan, limit, chunk = st.graph_mode, st.stages, st.memory_limit, st.prefill_chunk
        if messages is None:
            given = [p.opts[0] for p in ctx.command.params if p.name in CHAT_PARAMS and given_option(ctx, p.name)]
            if given:
                raise InputError(f"{given[0]} shapes a --messages conversation in the chat format; a prompt from "
                                 "--prompt, --prompt-ids or --prompts-file is used as given")
        shard, code = start_tp(tp, model, device, env, {"--prompts-file": prompts_file, "--messages": messages})
        if code is not None:
            return code
        runner = open_runner(model, dtype, quant_sim, device, layers, dequantize, shard, env,
                             mtp=draft_tokens is not None)
        if messages is not None:
            from mhcrun.chat import check_replyable, encode_chat, read_messages, resolve_format

            if any(x is not None for x in (prompt, prompt_ids, prompts_file)):
                raise InputError("give --messages alone, not together with --prompt, --prompt-ids or --prompts-file")
            fmt = resolve_format(chat_format, runner.path)
            conversation = read_messages(messages)
            chat_text = encode_chat(conversation, chat_mode, reasoning_effort, fmt)
            check_replyable(conversation, chat_text)
            names, texts, ids = ["messages"], [""], [chat_ids(runner, chat_text, fmt)]
        else:
            names, texts, ids = collect_prompts(runner, prompt, prompt_ids, prompts_file)
        cfg = runner.config
        check_prompts(ids, max_new_tokens, cfg.vocab_size, cfg.max_position_embeddings, names)
        longest = max(len(i) for i in ids)
        # a speculative step verifies up to K tokens past the last one (`speculate.speculate`)
        context = cache_length(longest + max_new_tokens + (draft_tokens or 0), mode, cfg.max_position_embeddings)
        if not force:
            check_fits(runner.memory_plan(len(ids), context, longest, limit, chunk), str(runner.path))
        if prompt_cache is not None and len(ids) != 1:
            raise InputError("--prompt-cache takes one prompt (not a --prompts-file batch)")
        if prompt_cache is not None:
            from mhcrun.promptcache import open_prompt_cache, save_new_prompt_cache
            from mhcrun.session import Session

            cache = open_prompt_cache(runner, prompt_cache, ids[0])
        if check_weights:
            from mhcrun.weightcheck import raise_if_bad

            raise_if_bad(scan_weights(runner, quiet=as_json)[0], str(runner.path))
        load_weights(runner, quiet=as_json)
        tok = runner.tokenizer
        eos = tok.eos_id if tok else cfg.eos_token_id
        stream = tok.stream(keep_special=messages is not None) if tok and len(ids) == 1 and not as_json else None
        say_compiling(mode, max_new_tokens > 1, as_json, compile_note(runner, model, plan, len(ids), context,
                                                                      draft_tokens, ahead=prompt_cache is None))
        if stream is not None:
            out.print(texts[0] if texts[0] is not None else "", end="", markup=False)

        def on_token(row: int, token: int) -> None:
            if stream is not None:
                out.print(stream.push(token), end="", markup=False)

        session = cache_note = None
        if prompt_cache is not None:
            runner.model.setup_caches(1, context)
            session = Session(runner.model, chunk=1)  # generate gives it the prefill chunk
            if cache is not None:
                session.keep(cache)
        try:
            results = raise_nonfinite(run_generate(runner.model, ids, max_new_tokens, eos,
                                                   st.sampling, ignore_eos,
                                                   on_token=on_token, graph_mode=mode, stages=plan,
                                                   prefill_chunk=chunk, session=session,
                                                   draft_tokens=draft_tokens or 0, warmup=warmup))
        finally:
            if stream is not None:  # end the streamed line, also when the run fails
                out.print(stream.flush(), markup=False)
        if session is not None:
            cache_note = {"file": str(prompt_cache), "loaded": cache is not None,
                          "saved": save_new_prompt_cache(runner, prompt_cache, session, ids[0]),
                          "reused_tokens": session.reused, "prefilled_tokens": session.prefilled}
            results[0].stats["prompt_cache"] = cache_note
        kernel = None
        if runner.device == "cpu":  # whether decode GEMVs took the fused kernel (mhcrun.ops.qgemv), or why not; and
            kernel = runner.model.opts.cpu.status()  # the pages the weights are on (mhcrun.hugepages)
            for res in results:
                res.stats["cpu_gemv_kernel"], res.stats["weight_pages"] = kernel, runner.weight_pages
                res.stats["heap_pages"] = runner.heap_pages
        for name, text, res in zip(names, texts, results, strict=True):
            res.text = tok.decode(res.tokens, keep_special=messages is not None) if tok else ""
            if as_json:
                row = {"id": name, "tokens": res.tokens, "prompt_tokens": len(res.prompt_ids),
                       "prompt_ids": res.prompt_ids, "text": res.text, "stats": res.stats}
                if messages is not None:
                    from mhcrun.chat import parse_reply, reply_mode

                    row["message"] = parse_reply(res.text, reply_mode(chat_text), fmt)
                print(json.dumps(row, ensure_ascii=False))
                continue
            if stream is None:
                out.print(f"[bold]{name}[/]: ", end="")
                out.print((text or "") + res.text if tok else " ".join(map(str, res.tokens)), markup=False)
        if not as_json:
            from mhcrun.speculate import stats_note

            s = results[0].stats if results else {}
            # a rate only where something was timed: no prefill for a prompt the cache held whole, no decode for
            # --max-tokens 0 or 1 (the first token comes from the prefill)
            rates = [f"{what} {s[key]:.1f} tok/s" for what, key in (("prefill", "prefill_tok_s"),
                                                                    ("decode", "decode_tok_s")) if s.get(key)]
            err.print(f"[dim]prompt tokens {sum(len(i) for i in ids)} | " + "".join(f"{r} | " for r in rates)
                      + f"compile {s.get('compile_s', 0):.2f} s | peak RSS {s.get('peak_rss_mb', 0):.0f} MB"
                      + (f" | CPU GEMV kernel {escape(kernel)} | weights on {escape(runner.weight_pages)}"
                         if kernel else "")
                      + (f" | {stats_note(s['speculative'])}" if "speculative" in s else "")
                      + (f" | prompt cache: {cache_note['reused_tokens']} tokens reused, "
                         f"{cache_note['prefilled_tokens']} prefilled" + (", saved" if cache_note["saved"] else "")
                         if cache_note else "") + "[/]", soft_wrap=True)

    run_guarded(debug, body)


@app.command("golden-record", cls=PanelledCommand)
def golden_record(
    ctx: typer.Context,
    prompts_file: Path = typer.Option(..., "--prompts-file", help="JSON Lines prompts.", rich_help_panel=INPUT),
    out_path: Path = typer.Option(..., "--out", help="Golden JSON to write.", rich_help_panel=OUTPUT),
    model: str = ModelOpt,
    max_new_tokens: int = max_tokens_option(32),
    dtype: str = DtypeOpt,
    quant_sim: bool = QuantSimOpt,
    top_k: int = typer.Option(5, "--logprobs", "--top-k", help="Log-probs kept per step: the N most likely tokens' "
                              "(as vLLM's and OpenAI's `logprobs`; old name --top-k).", rich_help_panel=OUTPUT),
    tolerance: float = typer.Option(0.01, "--tolerance", help="Near-tie tolerance on the logit margin.",
                                    rich_help_panel=OUTPUT),
    prefill_chunk: int = PrefillChunkOpt,
    tp: int = TpOpt,
    force: bool = typer.Option(False, "--force", help="Overwrite an existing --out file (atomically).",
                               rich_help_panel=OUTPUT),
    debug: bool = DebugOpt,
) -> None:
    """Record greedy tokens (eager path) and per-step top-k log-probs into a golden file."""

    def body() -> int | None:
        from mhcrun.fileio import check_writable
        from mhcrun.generate import generate as run_generate
        from mhcrun.generate import raise_nonfinite
        from mhcrun.golden import golden_from_results, write_golden
        from mhcrun.runner import open_runner

        st, env = run_settings(ctx, max_new_tokens=max_new_tokens, min_new_tokens=1, prefill_chunk=prefill_chunk,
                               tp=tp)
        chunk = st.prefill_chunk
        check_range("--logprobs", top_k, 2)
        check_writable(out_path, force)  # fail before the work, and again atomically at the write
        shard, code = start_tp(tp, model, "cpu", env, {"--prompts-file": prompts_file})
        if code is not None:
            return code
        runner = open_runner(model, dtype, quant_sim, tp=shard, env=env)
        from mhcrun.prompts import read_prompts_file

        items = read_prompts_file(prompts_file, runner.config.vocab_size)
        ids = [p.ids if p.ids is not None else runner.require_tokenizer().encode(p.text) for p in items]
        load_weights(runner)
        eos = runner.tokenizer.eos_id if runner.tokenizer else runner.config.eos_token_id
        from mhcrun.generate import check_prompts

        check_prompts(ids, max_new_tokens, runner.config.vocab_size, runner.config.max_position_embeddings,
                      [p.id for p in items])
        results = raise_nonfinite(run_generate(runner.model, ids, max_new_tokens, eos, ignore_eos=True,
                                               record_topk=top_k, prefill_chunk=chunk))
        settings = {"dtype": dtype, "quant_sim": quant_sim, "graph_mode": "eager",
                    "max_new_tokens": max_new_tokens, "top_k": top_k, "ignore_eos": True}
        golden = golden_from_results(runner.identity, settings, items, results, tolerance)
        if shard.rank:
            return None  # rank 0 writes the file
        write_golden(out_path, golden, force)
        margins = sorted(m for r in results for m in r.margins)
        out.print(f"wrote {out_path}: {len(items)} prompts x {max_new_tokens} tokens "
                  f"(median margin {margins[len(margins) // 2]:.3f}, min {margins[0]:.4f})")

    run_guarded(debug, body)


@app.command("golden-check", cls=PanelledCommand)
def golden_check(
    ctx: typer.Context,
    golden_path: Path = typer.Argument(..., metavar="GOLDEN", help="Golden JSON file."),
    model: str = ModelOpt,
    teacher_forced: bool = typer.Option(True, "--teacher-forced/--free-running", help="Feed the golden tokens and "
                                        "compare every step's log-probs (default), or generate freely and compare "
                                        "tokens.", rich_help_panel=CHECK),
    logprob_tol: float = typer.Option(None, "--logprob-tol", help="Largest |log-prob difference| that passes "
                                      "(default: by path, see docs/golden.md).", rich_help_panel=CHECK),
    locate: bool = typer.Option(False, "--locate", help="For each failing prompt, run its first failing step on "
                                "the eager fp32 reference and on this path and name the first region that differs.",
                                rich_help_panel=CHECK),
    dtype: str = typer.Option(None, "--dtype", help="Activations of the path under test (default: the golden's).",
                              rich_help_panel=PATH),
    dequantize: bool = DequantizeOpt,
    device: str = DeviceOpt,
    graph_mode: str = GraphModeOpt,
    stages: str = StagesOpt,
    prefill_chunk: int = PrefillChunkOpt,
    tp: int = TpOpt,
    force: bool = typer.Option(False, "--force", help="Check a golden file recorded for another model (its config "
                               "or weights hash differ): skips only that refusal, with a warning naming what differs.",
                               rich_help_panel=CHECK),
    as_json: bool = JsonOpt,
    debug: bool = DebugOpt,
) -> None:
    """Re-run a golden file's prompts and compare. Exit 0 pass, 1 mismatch, 2 bad input, 3 non-finite logits."""

    def body() -> int:
        from mhcrun.generate import generate as run_generate
        from mhcrun.generate import teacher_force
        from mhcrun.golden import (
            TOLERANCES,
            check_fits_model,
            check_model_identity,
            compare,
            load_golden,
            path_kind,
            render_report,
            report_to_json,
        )
        from mhcrun.runner import open_runner

        golden = load_golden(golden_path)
        st, env = run_settings(ctx, device, graph_mode, stages=stages, prefill_chunk=prefill_chunk, tp=tp)
        mode, plan, chunk = st.graph_mode, st.stages, st.prefill_chunk
        if logprob_tol is not None and not (math.isfinite(logprob_tol) and logprob_tol >= 0):
            raise InputError(f"--logprob-tol must be a finite number >= 0, got {logprob_tol}")
        s = golden["settings"]
        shard, code = start_tp(tp, model, device, env, {"GOLDEN": golden_path})
        if code is not None:
            return code
        runner = open_runner(model, dtype or s["dtype"], s["quant_sim"], device, dequantize=dequantize, tp=shard,
                             env=env)
        for w in check_model_identity(golden, runner.identity, force, str(golden_path)):
            err.print(f"warning: {w}", markup=False, soft_wrap=True)
        check_fits_model(golden, runner.config.vocab_size, runner.config.max_position_embeddings, str(golden_path))
        entries = golden["prompts"]
        ids = [p["prompt_ids"] for p in entries]
        load_weights(runner, quiet=as_json)
        kind = path_kind(runner.dtype, s["dtype"], s["quant_sim"], bool(runner.ckpt.quantized), env.nki_sim)
        tol = logprob_tol if logprob_tol is not None else TOLERANCES[kind][0]
        eos = runner.tokenizer.eos_id if runner.tokenizer else runner.config.eos_token_id
        forced = [[] for _ in entries]  # per prompt, per step: (log-probs of the golden candidates, argmax)

        def observe(row: int, step: int, logits) -> None:
            logp = logits.float().log_softmax(dim=-1)
            cands = [t for t, _ in entries[row]["steps"][step]["top"]]
            forced[row].append((logp[cands].tolist(), int(logits.argmax())))

        common = dict(graph_mode=mode, stages=plan, prefill_chunk=chunk)
        needed = max(len(e["prompt_ids"]) + (len(e["tokens"]) if teacher_forced else s["max_new_tokens"])
                     for e in entries)  # the context teacher_force or generate sets up, below
        context = cache_length(needed, mode, runner.config.max_position_embeddings)
        say_compiling(mode, any(len(e["tokens"]) > 1 for e in entries), as_json,
                      compile_note(runner, model, plan, len(entries), context))
        if teacher_forced:
            results = teacher_force(runner.model, ids, [e["tokens"] for e in entries], observe, **common)
        else:
            results = run_generate(runner.model, ids, s["max_new_tokens"], eos, ignore_eos=s["ignore_eos"],
                                   record_topk=s["top_k"], **common)
        report = compare(golden, results, tol, forced if teacher_forced else None)
        if locate:
            locate_failures(report, golden, runner, mode, plan, chunk, TOLERANCES[kind][1], quiet=as_json)
        if as_json:
            print(json.dumps({"golden": str(golden_path), "graph_mode": mode, **report_to_json(report)}))
        else:
            decode = runner.tokenizer.decode if runner.tokenizer else None
            render_report(report, out if out.is_terminal else Output(highlight=False, width=160), decode)
        return report.exit_code

    run_guarded(debug, body)


def locate_failures(report, golden: dict, runner, mode: str, plan: str, chunk: int | None, tol: float,
                    quiet: bool) -> None:
    """--locate: each failing prompt's first failing step again, on the eager fp32 reference (dequantised
    weights, on cpu) and on the path under test, every region captured; the first region beyond the tolerance
    goes into the report. Under --tp every rank takes part (the same prompts fail on each: the logits are
    gathered), the reference sharded like the path; the regions compared are the replicated residual streams."""
    from mhcrun.generate import capture_step
    from mhcrun.memory import default_prefill_chunk
    from mhcrun.probes import first_difference, region_diffs
    from mhcrun.runner import open_runner

    failing = [(i, p) for i, p in enumerate(report.prompts) if p.status == "mismatch" and p.step is not None]
    if not failing:
        return
    s = golden["settings"]
    # the reference's hc steps in plain torch, also under MHCRUN_NKI_SIM=1
    ref = open_runner(str(runner.path), "fp32", s["quant_sim"], "cpu", runner.layers, dequantize=True, tp=runner.tp,
                      env=replace(runner.env, hc_torch=True))
    load_weights(ref, quiet=quiet)
    max_seq = max(len(p["prompt_ids"]) for p in golden["prompts"]) + s["max_new_tokens"]
    chunk = chunk or default_prefill_chunk(runner.config)
    for i, check in failing:
        entry = golden["prompts"][i]
        tokens = entry["tokens"][:check.step]
        want = capture_step(ref.model, entry["prompt_ids"], tokens, max_seq, chunk)
        got = capture_step(runner.model, entry["prompt_ids"], tokens, max_seq, chunk, mode, stages=plan)
        first, before = first_difference(region_diffs(want, got), tol)
        if first is None:
            check.first_region = f"no region beyond {tol:g} at step {check.step} (largest {before:.1e})"
        else:
            check.first_region = (f"{first.region}: max |diff| {first.max_abs:.1e} (relative {first.rel:.1e}; the "
                                  f"regions before it within {before:.0e}) at step {check.step}")


@app.command("chat-prompt", cls=PanelledCommand)
def chat_prompt(
    messages: Path = typer.Argument(..., metavar="MESSAGES", help="OpenAI-style JSON: a list of messages, or "
                                    "{\"messages\": [...], \"tools\": [...]}."),
    mode: str = ModeOpt,
    reasoning_effort: str = EffortOpt,
    chat_format: str = FormatOpt,
    ids: bool = typer.Option(False, "--ids", help="Print the token ids (from the model's tokenizer) instead.",
                             rich_help_panel=OUTPUT),
    model: str = ModelOpt,
    debug: bool = DebugOpt,
) -> None:
    """Print the exact prompt a conversation becomes in DeepSeek V4's chat format (nothing else on stdout)."""

    def body() -> None:
        from mhcrun.chat import encode_chat, read_messages, resolve_format
        from mhcrun.runner import resolve_model_path

        fmt = resolve_format(chat_format, resolve_model_path(model))
        text = encode_chat(read_messages(messages), mode, reasoning_effort, fmt)
        if not ids:
            sys.stdout.write(text)
            return
        from mhcrun.runner import open_runner

        print(",".join(map(str, chat_ids(open_runner(model), text, fmt))))

    run_guarded(debug, body)


@app.command(cls=PanelledCommand)
def chat(
    ctx: typer.Context,
    model: str = ModelOpt,
    mode: str = ModeOpt,
    reasoning_effort: str = EffortOpt,
    chat_format: str = FormatOpt,
    system: str = typer.Option(None, "--system", help="A system message to start the conversation with.",
                               rich_help_panel=INPUT),
    hide_thinking: bool = typer.Option(False, "--hide-thinking", help="Do not show the reasoning, only the answer.",
                                       rich_help_panel=OUTPUT),
    max_new_tokens: int = max_tokens_option(1024, "Longest reply."),
    temperature: float = TempOpt,
    top_p: float = TopPOpt,
    seed: int = SeedOpt,
    dtype: str = DtypeOpt,
    quant_sim: bool = QuantSimOpt,
    dequantize: bool = DequantizeOpt,
    device: str = DeviceOpt,
    graph_mode: str = GraphModeOpt,
    tp: int = TpOpt,
    layers: int = LayersOpt,
    prompt_cache: Path = typer.Option(None, "--prompt-cache", help="A prompt cache file (safetensors): its state is "
                                      "reused when a prompt starts with its tokens; when it does not exist, the "
                                      "state after the first prompt is written to it. Never overwritten.",
                                      rich_help_panel=INPUT),
    draft_tokens: int = DraftOpt,
    debug: bool = DebugOpt,
) -> None:
    """Talk to a checkpoint in DeepSeek V4's chat format: streamed replies (thinking dimmed), history across turns,
    each turn prefilling only its new tokens; /reset, /mode chat|thinking, /effort LEVEL, /exit; Ctrl-C stops a
    reply."""

    def body() -> int | None:
        from mhcrun.chatloop import run_chat
        from mhcrun.runner import open_runner

        st, env = run_settings(ctx, device, graph_mode, temperature, top_p, seed, max_new_tokens=max_new_tokens,
                               min_new_tokens=1, tp=tp, draft_tokens=draft_tokens)
        shard, code = start_tp(tp, model, device, env)
        if code is not None:
            return code
        runner = open_runner(model, dtype, quant_sim, device, layers, dequantize, shard, env,
                             mtp=draft_tokens is not None)
        runner.require_tokenizer()
        from mhcrun.chat import resolve_format

        fmt = resolve_format(chat_format, runner.path)
        if prompt_cache is not None:  # a bad file fails before the weights load
            from mhcrun.promptcache import open_prompt_cache

            open_prompt_cache(runner, prompt_cache)
        load_weights(runner)
        if draft_tokens is not None:  # K against the model's window, before a turn
            from mhcrun.speculate import check_draft_tokens

            check_draft_tokens(runner.model, draft_tokens)
        console = out if shard.world == 1 else LockstepConsole(out, shard)
        # the conversation's cache holds the model's whole context (`run_chat`): the graphs are compiled for it
        say_compiling(st.graph_mode, True, False, compile_note(runner, model, "whole", 1,
                                                               runner.config.max_position_embeddings, draft_tokens,
                                                               ahead=False))
        run_chat(runner, console, err, mode, reasoning_effort, fmt, system, hide_thinking, max_new_tokens,
                 temperature, lambda text: chat_ids(runner, text, fmt), top_p=top_p, seed=seed,
                 prompt_cache=prompt_cache, draft_tokens=draft_tokens or 0, graph_mode=st.graph_mode)

    run_guarded(debug, body)


@app.command(cls=PanelledCommand)
def info(
    ctx: typer.Context,
    model: str = ModelOpt,
    layers: int = LayersOpt,
    context: int = typer.Option(None, "--context", help="Context (tokens per sequence) the memory plan is for "
                                "(default: 4096, or the model's maximum when smaller).", rich_help_panel=MEMORY),
    batch: int = typer.Option(1, "--batch", help="Sequences decoded together.", rich_help_panel=MEMORY),
    dtype: str = DtypeOpt,
    dequantize: bool = DequantizeOpt,
    quant_sim: bool = typer.Option(True, "--quant-sim/--no-quant-sim", help="Plan the KV cache stored as the "
                                   "simulation rounds it (FP8 kv, FP4 indexer keys), or in the activation dtype.",
                                   rich_help_panel=PATH),
    prefill_chunk: int = PrefillChunkOpt,
    memory_limit: str = MemoryLimitOpt,
    check_weights: bool = CheckWeightsOpt,
    tp: int = typer.Option(1, "--tp", help="Plan the memory of one rank of N (each maps its share).",
                           rich_help_panel=PATH),
    draft_tokens: int = typer.Option(None, "--draft-tokens", help="Plan for speculative decoding with K drafts a "
                                     "step: the MTP layer's weights and state, K more tokens of context.",
                                     rich_help_panel=MEMORY),
    as_json: bool = JsonOpt,
    debug: bool = DebugOpt,
) -> None:
    """Describe a checkpoint and plan its memory: config, layer kinds, parameters, bytes by dtype, and the
    weights, KV and state bytes for a context and batch (reads headers only; `--check-weights` reads every
    tensor once)."""

    def body() -> int:
        from mhcrun.checkpoint import inspect_checkpoint
        from mhcrun.memory import format_bytes
        from mhcrun.parallel import Shard
        from mhcrun.runner import open_runner

        st, env = run_settings(ctx, prefill_chunk=prefill_chunk, tp=tp, memory_limit=memory_limit,
                               draft_tokens=draft_tokens)
        chunk = st.prefill_chunk
        check_range("--batch", batch, 1)
        runner = open_runner(model, dtype, quant_sim, layers=layers, dequantize=dequantize, tp=Shard(0, tp), env=env,
                             mtp=draft_tokens is not None)
        longest = runner.config.max_position_embeddings
        tokens = min(4096, longest) if context is None else context
        check_range("--context", tokens, 1, longest, " (the model's maximum)")
        desc = inspect_checkpoint(runner.path, layers)
        mp = runner.memory_plan(batch, tokens + (draft_tokens or 0), tokens, st.memory_limit, chunk)
        desc["memory_plan"] = mp.to_dict()
        bad = None
        if check_weights:
            bad, nbytes, secs = scan_weights(runner, quiet=as_json)
            desc["weights_check"] = {"bad": [{"tensor": b.name, "index": b.index, "what": b.what} for b in bad],
                                     "bytes": nbytes, "seconds": secs}
        if as_json:
            print(json.dumps(desc))
            return weights_verdict(bad, runner)
        c = desc["config"]
        out.print(f"[bold]{desc['path']}[/]")
        out.print(f"dim {c['dim']}, {c['n_layers']} layers, {c['n_heads']} heads x {c['head_dim']}, "
                  f"vocab {c['vocab_size']}, {c['n_routed_experts']} experts ({c['n_activated_experts']} active), "
                  f"window {c['window_size']}, hc_mult {c['hc_mult']}", markup=False, soft_wrap=True)
        kinds = Table("layer", "attention", "ratio", "moe")
        for k in desc["layer_kinds"]:
            kinds.add_row(str(k["layer"]), k["attention"], str(k["ratio"]), k["moe"])
        out.print(kinds)
        out.print(f"parameters: {desc['params']:,}")
        per_rank = f"one rank of --tp {tp}, " if tp > 1 else ""
        out.print(f"memory plan: {per_rank}{mp.layers} layers, batch {mp.batch}, context {mp.context}, {mp.dtype}, "
                  f"weights {'dequantised' if mp.dequantize else 'kept quantised'}, KV cache "
                  f"{'FP8 (kv) / FP4 (indexer keys)' if mp.quant_sim else mp.dtype}", markup=False, soft_wrap=True)
        plan = Table("memory plan", "bytes", "")
        for name, n in mp.disk_by_dtype.items():
            plan.add_row(f"read from disk: {name}", f"{n:,}", format_bytes(n))
        rows = [("weights in memory", mp.weights)] + [(k.replace("_", " "), v) for k, v in mp.state.items()]
        rows += [(f"activations (a prefill chunk of {mp.prefill_chunk} tokens)", mp.activations),
                 ("runtime", mp.runtime), ("total", mp.total), ("available", mp.available)]
        for name, n in rows:
            plan.add_row(name, "" if n is None else f"{n:,}", format_bytes(n))
        out.print(plan)
        for what, per_token in ((f"these {mp.layers} layers", mp.kv_bytes_per_token),
                                (f"all {runner.config.n_layers} layers", mp.kv_bytes_per_token_model)):
            total = format_bytes(int(per_token * mp.context * mp.batch))
            out.print(f"KV bytes per token, {what}: {per_token:,.1f} ({total} for {mp.context:,} tokens x batch "
                      f"{mp.batch}, plus the windows' rings)", markup=False, soft_wrap=True)
            if mp.layers == runner.config.n_layers:
                break
        out.print(f"a snapshot of one sequence's state after {mp.context:,} tokens (a prompt cache, a chat turn): "
                  f"{format_bytes(mp.snapshot_bytes)} ({mp.kv_bytes_per_token:,.1f} bytes per token plus the rings and "
                  f"the compressors' open groups)", markup=False, soft_wrap=True)
        verdict = "fits" if mp.fits else "does NOT fit"
        out.print(f"{verdict}: needs {format_bytes(mp.total)} of {format_bytes(mp.available)}")
        if bad is not None:
            for b in bad:
                out.print(f"bad weight: {b.line()}", markup=False, soft_wrap=True)
            rate = f"{nbytes / secs / 1e9:.1f} GB/s" if secs > 0 else "-"
            out.print(f"weights check: {format_bytes(nbytes)} read in {secs:.2f} s ({rate}): "
                      + (f"{len(bad)} bad tensor(s)" if bad else "every tensor is finite, every scale in range"),
                      markup=False, soft_wrap=True)
        return weights_verdict(bad, runner)

    run_guarded(debug, body)


def weights_verdict(bad: list | None, runner) -> int:
    from mhcrun.weightcheck import raise_if_bad

    raise_if_bad(bad or [], str(runner.path))
    return 0


@app.command("compile-regions", cls=PanelledCommand)
def compile_regions(
    ctx: typer.Context,
    model: str = ModelOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    quant_sim: bool = QuantSimOpt,
    dequantize: bool = DequantizeOpt,
    layers: int = LayersOpt,
    stages: str = StagesOpt,
    batch: int = typer.Option(1, "--batch", help="Decode batch the graphs are compiled for.", rich_help_panel=PATH),
    context: int = typer.Option(REGIONS_MIN_CONTEXT, "--context", help="Context (cache length) the graphs are "
                                "compiled for, rounded up as generate and golden-check round theirs: to a power of "
                                f"two, at least {REGIONS_MIN_CONTEXT} (a multiple of {REGIONS_CONTEXT_STEP:,} beyond "
                                "it). Runs of this batch whose prompt and new tokens round to the same length use "
                                "the graphs.", rich_help_panel=PATH),
    tp: int = TpOpt,
    draft_tokens: int = typer.Option(None, "--draft-tokens", help="Compile the graphs of a speculative verify of K + 1 "
                                     "tokens a row (what generate --draft-tokens K runs in regions) instead of a "
                                     "decode step's.", rich_help_panel=PATH),
    as_json: bool = JsonOpt,
    debug: bool = DebugOpt,
) -> None:
    """Compile every region kind of a model once and report the graphs (torch's compile cache makes a
    second run faster): for the path a later run takes (--dtype, --quant-sim, --dequantize, --layers, --stages, --tp,
    --draft-tokens as it gives them) and its batch and context."""

    def body() -> int | None:
        from rich.progress import Progress

        from mhcrun.regions.runner import compile_all
        from mhcrun.runner import open_runner

        st, env = run_settings(ctx, device, "regions", stages=stages, tp=tp, draft_tokens=draft_tokens)
        plan = st.stages
        check_range("--batch", batch, 1)
        check_range("--context", context, 2)  # here, before any rank starts; its maximum once the model is open
        shard, code = start_tp(tp, model, device, env)
        if code is not None:
            return code
        runner = open_runner(model, dtype, quant_sim, device, layers, dequantize, tp=shard, env=env,
                             mtp=draft_tokens is not None)
        check_range("--context", context, 2, runner.config.max_position_embeddings, " (the model's maximum)")
        load_weights(runner, quiet=as_json)
        if draft_tokens is not None:  # K against the model's window
            from mhcrun.speculate import check_draft_tokens

            check_draft_tokens(runner.model, draft_tokens)
        with Progress(console=err, transient=True, disable=as_json) as progress:
            task = progress.add_task("compiling regions", total=None)

            def tick(done: int, total: int, name: str) -> None:
                progress.update(task, total=total, completed=done, description=f"compiling {name}")

            report = compile_all(runner.model, batch, context, plan, on_progress=tick, draft_tokens=draft_tokens or 0)
        if as_json:
            print(json.dumps(report))
            return
        table = Table("region kind", "layers", "stages", "compile s", "graph breaks", "cache hit")
        for r in report["regions"]:
            table.add_row(r["region"], ",".join(map(str, r["layers"])), r["stages"], f"{r['compile_s']:.2f}",
                          str(r["graph_breaks"]), "yes" if r["cache_hit"] else "no")
        out.print(table)
        out.print(f"{report['graphs']} graphs for {report['layers']} layers in {report['total_s']:.1f} s "
                  f"(backend {report['backend']}) for batch {report['batch']}"
                  + (f", a verify of {draft_tokens + 1} tokens a row" if draft_tokens else "")
                  + f" and a cache of {report['context']} positions: {served(report['context'])} use them",
                  highlight=False)

    run_guarded(debug, body)


def served(context: int) -> str:
    """Which runs a cache of `context` positions (`settings.regions_context`) serves, in words."""
    least = 1 + bisect_left(range(1, context + 1), context, key=lambda n: regions_context(n, context))
    return f"runs of {least:,} to {context:,} prompt and new tokens" if least > 1 else \
        f"runs of up to {context:,} prompt and new tokens"


WeightSeedOpt = typer.Option(0, "--seed", help="Seed of the random weights: the same seed writes the same bytes.")
WriteIntoOpt = typer.Option(False, "--force", help="Write into a non-empty OUT directory, replacing the files of the "
                            "same names (atomically).", rich_help_panel=OUTPUT)


@app.command("make-tiny", cls=PanelledCommand)
def make_tiny_cmd(
    out_dir: Path = typer.Argument(..., metavar="OUT", help="Directory to write."),
    seed: int = WeightSeedOpt,
    fp8: bool = typer.Option(False, "--fp8", help="FP8 e4m3 linears (e8m0 block scales) and FP4 experts."),
    force: bool = WriteIntoOpt,
    debug: bool = DebugOpt,
) -> None:
    """Write the tiny model's checkpoint (or its FP8/FP4 variant)."""

    def body() -> None:
        from mhcrun.tiny import make_tiny

        path = make_tiny(out_dir, seed, fp8, force)
        out.print(f"wrote {path}")

    run_guarded(debug, body)


@app.command("make-synthetic", cls=PanelledCommand)
def make_synthetic_cmd(
    config: Path = typer.Argument(..., metavar="CONFIG", help="A config.json (e.g. configs/v4-flash.json) or a "
                                  "directory holding one."),
    out_dir: Path = typer.Argument(..., metavar="OUT", help="Directory to write."),
    layers: int = typer.Option(..., "--layers", help="Layers to write (the first N; the config keeps its count, "
                               "so run the result with --layers N)."),
    seed: int = WeightSeedOpt,
    shard_size: str = typer.Option("4GiB", "--shard-size", help="Largest shard (e.g. 4GiB, 512MB)."),
    force: bool = WriteIntoOpt,
    debug: bool = DebugOpt,
) -> None:
    """Write a synthetic checkpoint at full width in the released layout (FP8 linears with e8m0 block scales,
    FP4 experts), truncated to the first N layers: random weights, real shapes and bytes."""

    def body() -> None:
        from mhcrun.memory import format_bytes, parse_size
        from mhcrun.synthetic import make_synthetic

        shard_bytes = parse_size(shard_size, "--shard-size")
        with bytes_progress("writing") as progress:
            path = make_synthetic(config, out_dir, layers, seed, force, shard_bytes, progress)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        out.print(f"wrote {path}: {layers} layers, {format_bytes(size)} of shards")

    run_guarded(debug, body)


def main() -> None:
    """The `mhcrun` command. Where the heap would go on huge pages only if glibc's malloc were told so at the
    process's start (`mhcrun.heap`), it first starts itself again, once, with that told. SIGTERM and SIGHUP then
    raise `Terminated` (outside a rank of a launch), for the command to end as Ctrl-C ends it."""
    try:
        env = Env.read()
    except InputError:  # the command says what is wrong
        env = None
    helps = len(sys.argv) < 2 or {"--help", "--version"} & set(sys.argv[1:])  # nothing worth starting again for
    again = None if env is None or helps else restart_env(os.environ, env.huge_pages, thp_mode(), glibc_version())
    if again is not None:
        try:
            os.execve(sys.executable, [sys.executable, "-m", "mhcrun.cli", *sys.argv[1:]], again)
        except OSError:  # run as it is
            pass
    if env is None or env.rank is None:  # a rank keeps the default: it ends at once, a collective waiting or not
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, raise_terminated)
    app(prog_name="mhcrun", obj=env)  # each command's run_settings takes this Env


if __name__ == "__main__":
    sys.exit(main())
