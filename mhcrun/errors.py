"""User-facing errors: each one is printed as a single line by the CLI, with a non-zero exit."""

import signal
import sys
from collections.abc import Callable

# the CLI's exit codes beside the errors' own (MhcrunError 2, NonFiniteError 3; mhcrun.parallel.ECHO 4 between ranks)
OS_FAILED = 74  # the operating system refused a read or write that no check of mhcrun's covers: sysexits' EX_IOERR
INTERNAL = 70  # a bug: sysexits' EX_SOFTWARE


class MhcrunError(Exception):
    """An error caused by the user's input (a file, a flag, a checkpoint), not by a bug."""

    exit_code = 2


class ConfigError(MhcrunError):
    """A missing, malformed or inconsistent config.json."""


class CheckpointError(MhcrunError):
    """A missing, truncated or mis-shaped checkpoint tensor or shard."""


class InputError(MhcrunError):
    """A bad prompt, token id or command-line value."""


class GoldenError(MhcrunError):
    """A golden file that is missing, not JSON, of the wrong schema or of another model."""


class NonFiniteError(MhcrunError):
    """A run whose logits turned NaN or Inf: a failed run (exit 3), never turned into tokens."""

    exit_code = 3


class Terminated(BaseException):
    """SIGTERM or SIGHUP (a job's timeout, a closed terminal), raised where the process is (`raise_terminated`), so
    that a file being written is removed (`fileio.open_atomic`), a launcher's ranks are ended (`parallel.launch`) and
    the command ends with one line and 128 + the signal. A BaseException, as KeyboardInterrupt: no `except
    Exception` keeps the process going."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_terminated(signum: int, frame: object) -> None:
    """A signal handler: `Terminated`."""
    raise Terminated(signum)


def signal_exit(e: KeyboardInterrupt | Terminated) -> tuple[str, int]:
    """The one line and the exit code of a command a signal ended: Ctrl-C, or SIGTERM / SIGHUP (`Terminated`)."""
    if isinstance(e, Terminated):
        return f"error: terminated ({e})", 128 + e.signum
    return "error: interrupted", 128 + signal.SIGINT


def run_script(main: Callable[[], object]) -> None:
    """A benchmark's or tool's `main`, its bad input (a checkpoint not found, a malformed config) ended as the CLI
    ends it: one line `error: ...` and the error's exit code, not a traceback. Its return value is its exit code."""
    try:
        code = main()
    except MhcrunError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    sys.exit(code)
