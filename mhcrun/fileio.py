"""Atomic file writes: a file is either the old one or the whole new one, never half of each."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from mhcrun.errors import InputError, MhcrunError


def check_writable(path: str | Path, force: bool) -> Path:
    """Refuse to overwrite an existing file unless forced, or to write where a file cannot go."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{p}: is a directory (give a file path)")
    if p.exists() and not force:
        raise InputError(f"{p}: already exists (use --force to overwrite)")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(f"{p}: cannot write, {parent} is not a directory")
            break
    return p


def check_out_dir(out_dir: str | Path, force: bool) -> Path:
    """Refuse a file, or a non-empty directory unless forced: a directory a writer is about to fill."""
    out = Path(out_dir)
    if out.exists():
        if not out.is_dir():
            raise InputError(f"{out}: exists and is not a directory")
        if any(out.iterdir()) and not force:
            raise InputError(f"{out}: directory exists and is not empty (use --force to overwrite)")
    return out


def make_dirs(path: Path) -> None:
    """mkdir -p, with a failure as one user-facing line."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{path}: cannot create directory ({e.strerror or e})") from None


@contextlib.contextmanager
def open_atomic(path: str | Path, force: bool = False) -> Iterator[BinaryIO]:
    """A binary file handle on a temp file beside `path`; on a clean exit it is fsynced and renamed over
    `path`, on any error removed (so `path` is never half written)."""
    p = check_writable(path, force)
    make_dirs(p.parent)
    try:
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    except OSError as e:
        raise InputError(f"{p}: cannot write ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        os.replace(tmp, p)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise InputError(f"{p}: cannot write ({e.strerror or e})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, data: bytes | str, force: bool = False) -> Path:
    """Write to a temp file beside `path`, fsync, then rename over it."""
    with open_atomic(path, force) as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return Path(path)


def read_text(path: str | Path, error: type[MhcrunError], what: str = "file") -> str:
    """A UTF-8 text input (a file, or a pipe: /dev/stdin, <(...)); a missing, unreadable or undecodable one raises
    `error` naming the path and `what` it should have been."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{p}: {what} not found") from None
    except IsADirectoryError:
        raise error(f"{p}: is a directory, not a {what}") from None
    except UnicodeDecodeError as e:
        raise error(f"{p}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise error(f"{p}: cannot read ({e.strerror or e})") from None


def check_rereadable(path: Path, flag: str) -> None:
    """An input that each rank of --tp reads: a pipe (/dev/stdin, <(...)) gives its text to one reader only, so it
    is refused by name (a path that is not there, or not readable, is left to the reader to say so)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISSOCK(mode):
        raise InputError(f"{flag} {path}: a pipe is read once, and each rank of --tp reads it: give a file")


def read_json(path: str | Path, error: type[MhcrunError]) -> Any:
    """Parse a JSON file; a missing, unreadable or malformed one raises `error` naming the file."""
    p = Path(path)
    try:
        return json.loads(read_text(p, error))
    except json.JSONDecodeError as e:
        raise error(f"{p}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
