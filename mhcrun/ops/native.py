"""Building mhcrun's C++ sources (the fused GEMV kernel, the weight scan, the kernel's torch ops) into shared
libraries, on first use.

The caller names the compiler and the cache directory (a run's `Env`: `$CXX`, `$MHCRUN_KERNEL_CACHE`, read at the
entry point). One file per source, compiler and flags, written atomically, so concurrent builders never see a
partial library.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

# -ffp-contract=off: a product and a sum stay two roundings unless the source asks for an FMA (an FMA intrinsic), so
# the kernels that claim to equal torch's ops bitwise do not depend on what the compiler chooses to contract.
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off")


@functools.cache  # asked once a process per compiler: every build (the kernel, its torch ops, the scan) keys on it
def compiler_id(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=True)
    return out.stdout


def torch_flags() -> tuple[str, ...]:
    """The flags that build a library of torch ops against the torch this process runs: its headers, its C++ ABI,
    its libraries (already loaded when torch.ops.load_library opens the result)."""
    import torch

    root = Path(torch.__file__).parent  # torch.utils.cpp_extension's paths for CPU, without importing setuptools
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ("-O2", "-std=c++20", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}",
            f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", f"-L{root / 'lib'}", "-lc10",
            "-ltorch_cpu", f"-DMHCRUN_TORCH={torch.__version__}")


def build(source: Path, cache: Path, cxx: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """Compile `source` with `cxx` and `flags` (default: with OpenMP) into `cache` (once per source, compiler and
    flags) and return the shared library's path. A failed compile raises RuntimeError with the compiler's first
    line."""
    src = source.read_bytes()
    key = hashlib.sha256(src + cxx.encode() + " ".join(flags).encode() + compiler_id(cxx).encode())
    path = cache / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{source.stem}-", suffix=".so", dir=cache)
    os.close(fd)
    try:
        res = subprocess.run([cxx, str(source), *flags, "-o", tmp], capture_output=True, text=True, timeout=300)
        if res.returncode:
            err = (res.stderr.strip().splitlines() or ["no output"])[0]
            raise RuntimeError(f"{cxx} failed on {source.name}: {err}")
        os.replace(tmp, path)  # atomic: concurrent builders each write their own temp file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
