"""The examples in README.md and docs/*.md run: every fenced ```bash block that calls `mhcrun` runs as one script (so a
block may write the file its next command reads, as golden-record then golden-check do) in an empty directory, on
the bundled model, and must exit 0; a ```text block right after it (the output shown) must be what it printed, line
by line in order, up to what varies from run to run and machine to machine (`shown_output_mismatch`). The Quick
start block installs mhcrun and is run by .ci/run instead. Commands in running text (`mhcrun generate --device
neuron ...`, which need hardware or big checkpoints) are not run, but each option they name must be one of that
command's options: a renamed option or a changed output leaves no stale example behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from mhcrun.cli import app

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
CALLS_MHCRUN = re.compile(r"(^|[|&;(]\s*)mhcrun\s", re.M)
INLINE = re.compile(r"`mhcrun ([a-z][a-z-]*)([^`]*)`")  # a command (`mhcrun --version` is none)
# what differs between runs and machines in shown output, each replaced by "#" on both sides before they are compared:
# timings, margins and sizes (any number with a fraction), peak memory, the CPU kernel and the pages the weights are on
VARIES = re.compile(r"\d+\.\d+|(?<=peak RSS )\d+|(?<=CPU GEMV kernel )[^|]*[^|\s]|(?<=weights on )[^|]*[^|\s]")
ELIDED = "..."  # in a shown line: output left out (any text)


def label(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def collect_blocks(pages: list[Path]) -> list[tuple[str, str, str | None]]:
    """-> (page:line, script, shown output or None) for each bash block that runs mhcrun, the install blocks left
    out; the shown output is the text block that follows it with nothing between."""
    blocks = []
    for page in pages:
        text = page.read_text()
        fences = list(FENCE.finditer(text))
        for i, m in enumerate(fences):
            after = fences[i + 1] if i + 1 < len(fences) else None
            lang, body = m.groups()
            if lang in ("bash", "sh") and CALLS_MHCRUN.search(body) and "pip install" not in body:
                shown = after.group(2) if after and after.group(1) == "text" \
                    and not text[m.end():after.start()].strip() else None
                blocks.append((f"{label(page)}:{text.count(chr(10), 0, m.start()) + 1}", body, shown))
    return blocks


def normalise(text: str) -> str:
    """Whitespace runs (line breaks, a table's padding, a wrapped line) as one space, what varies as "#"."""
    return " ".join(VARIES.sub("#", text).split())


def shown_output_mismatch(shown: str, output: str) -> str | None:
    """The first line of `shown` that the output does not hold, after the lines before it (each line's pieces
    between "..." in order), or None when all of them are there."""
    out, at = normalise(output), 0
    for line in shown.splitlines():
        for piece in (normalise(p) for p in line.split(ELIDED)):
            found = out.find(piece, at)
            if found < 0:
                return line
            at = found + len(piece)
    return None


def collect_inline(pages: list[Path]) -> list[tuple[str, str, list[str]]]:
    """-> (page, command, options) for each `mhcrun COMMAND ...` in running text (outside fenced blocks)."""
    found = []
    for page in pages:
        text = FENCE.sub("", page.read_text())
        for m in INLINE.finditer(text):
            found.append((label(page), m.group(1), re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", m.group(2))))
    return found


def stale_options(command: str, options: list[str]) -> list[str] | None:
    """The options `command` does not have (None: no such command)."""
    group = typer.main.get_command(app)
    if command not in group.commands:
        return None
    known = {o for p in group.commands[command].params for o in (*p.opts, *p.secondary_opts)}
    return [o for o in options if o not in known]


def run_block(script: str, cwd: Path) -> subprocess.CompletedProcess:
    """A block as a bash script (-e, pipefail) in `cwd`, with this environment's mhcrun first on PATH."""
    (cwd / "configs").symlink_to(ROOT / "configs")  # examples name the repository's configs
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               COLUMNS="100")
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=600, stdin=subprocess.DEVNULL)


BLOCKS = collect_blocks(PAGES)


def test_the_pages_hold_an_example_of_every_command():
    shown = {m.group(1) for _, body, _ in BLOCKS for m in re.finditer(r"mhcrun ([a-z-]+)", body)}
    commands = {c.name for c in typer.main.get_command(app).commands.values()}
    assert shown >= commands, f"commands without an example: {commands - shown}"


@pytest.mark.parametrize("where,script,shown", BLOCKS, ids=[w for w, _, _ in BLOCKS])
def test_example_runs(where, script, shown, tmp_path):
    r = run_block(script, tmp_path)
    assert r.returncode == 0, f"{where}: exit {r.returncode}\n{script}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    missing = shown_output_mismatch(shown, r.stdout + r.stderr) if shown is not None else None
    assert missing is None, f"{where}: the output shown holds a line the example did not print: {missing!r}\n" \
                            f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"


def test_shown_output_is_compared():
    """A shown line the run did not print is refused (a changed count, a line out of order, a changed word); timings,
    the kernel, the pages, line breaks and padding, and what "..." leaves out are not compared."""
    output = ("dim 128, vocab 1024, window 16\n│ kv cache    │ 115,020   │ 112.32 KiB │\nprompt tokens 13 | prefill "
              "166.8 tok/s | decode 158.6 tok/s | peak RSS 282 MB | CPU GEMV kernel avx512bf16 + amx | weights on "
              "4 KB pages (MHCRUN_HUGE_PAGES=0)\n")
    shown = ("dim 128, vocab 1024, ...\n│ kv cache │ 115,020 │ 111.38 KiB │\nprompt tokens 13 | prefill 98.4 tok/s | "
             "decode 39.8 tok/s | peak RSS 270 MB | CPU GEMV kernel avx2 | weights on 2 MB pages")
    assert shown_output_mismatch(shown, output) is None
    assert shown_output_mismatch("dim 128, vocab 512, ...", output) == "dim 128, vocab 512, ..."
    assert shown_output_mismatch("│ kv cache │ 114,048 │", output) == "│ kv cache │ 114,048 │"
    assert shown_output_mismatch("prompt tokens 13 ...\ndim 128", output) == "dim 128"
    assert shown_output_mismatch("prompt tokens 13 | prefill 98.4 tok/s | compile", output) is not None


def test_commands_in_running_text_name_real_options():
    found = collect_inline(PAGES)
    for page, command, options in found:
        stale = stale_options(command, options)
        assert stale == [], f"{page}: `mhcrun {command}`: " + ("no such command" if stale is None else f"no {stale}")
    assert len(found) > 5


def test_a_stale_option_is_refused(tmp_path):
    """Both checks fail on a renamed option: the block exits non-zero, the running text's option is unknown."""
    page = tmp_path / "page.md"
    page.write_text("Run `mhcrun generate --max-new-tokenz 3`.\n\n```bash\nmhcrun generate --max-new-tokenz 3\n```\n")
    ((_, script, _),) = collect_blocks([page])
    r = run_block(script, tmp_path)
    assert r.returncode == 2 and "--max-new-tokenz" in r.stderr
    ((_, command, options),) = collect_inline([page])
    assert stale_options(command, options) == ["--max-new-tokenz"]
    assert stale_options("generat", []) is None
