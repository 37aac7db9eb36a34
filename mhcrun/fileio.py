"""Atomic file writes: a file is either the old one or the whole new one, never half of each."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from mhcrun.errors import InputError, MhcrunError


def check_writable(path: str | Path, force: bool) -> Path:
    """Refuse to overwrite an existing file unless forced."""
    p = Path(path)
    if p.exists() and not force:
        raise InputError(f"{p}: already exists (use --force to overwrite)")
    return p


def write_atomic(path: str | Path, data: bytes | str, force: bool = False) -> Path:
    """Write to a temp file beside `path`, fsync, then rename over it."""
    p = check_writable(path, force)
    p.parent.mkdir(parents=True, exist_ok=True)
    blob = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def read_json(path: str | Path, error: type[MhcrunError]) -> Any:
    """Parse a JSON file; a missing, unreadable or malformed one raises `error` naming the file."""
    p = Path(path)
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise error(f"{p}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except FileNotFoundError:
        raise error(f"{p}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{p}: cannot read ({e})") from None
