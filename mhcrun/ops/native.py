"""Building mhcrun's C++ sources (the fused GEMV kernel, the weight scan) into shared libraries, on first use.

`$CXX` (default g++) with OpenMP, into `$MHCRUN_KERNEL_CACHE` (default ~/.cache/mhcrun/kernels): one file per
source, compiler and flags, written atomically, so concurrent builders never see a partial library.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp")


def cache_dir() -> Path:
    root = os.environ.get("MHCRUN_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mhcrun" / "kernels"


def compiler_id(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=True)
    return out.stdout


def build(source: Path, cache: Path | None = None) -> Path:
    """Compile `source` (once per source, compiler and flags) and return the shared library's path. A failed
    compile raises RuntimeError with the compiler's first line."""
    cxx = os.environ.get("CXX", "g++")
    src = source.read_bytes()
    key = hashlib.sha256(src + cxx.encode() + " ".join(FLAGS).encode() + compiler_id(cxx).encode())
    cache = cache or cache_dir()
    path = cache / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=cache)
    os.close(fd)
    try:
        res = subprocess.run([cxx, *FLAGS, str(source), "-o", tmp], capture_output=True, text=True, timeout=300)
        if res.returncode:
            err = (res.stderr.strip().splitlines() or ["no output"])[0]
            raise RuntimeError(f"{cxx} failed on {source.name}: {err}")
        os.replace(tmp, path)  # atomic: concurrent builders each write their own temp file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
