"""The process's own memory: glibc's malloc policy, and its heap on transparent huge pages.

Where the kernel gives huge pages only to memory advised MADV_HUGEPAGE (its `transparent_hugepage` mode "madvise"),
glibc's malloc advises its own memory when the process starts with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc 2.35
on; a tunable is read once, at start). A decode step's work between its weight GEMVs (activations, the kernel's
buffers, torch's and the interpreter's small objects, all out of cache after the weights stream past) then walks
fewer page table entries: on a 2-core AMX VM a step of the mid-size config took 0.96-0.97x the time, eager and
compiled regions alike (BENCHMARKS.md, issue 20). So the command line's entry point starts itself again, once, with
the tunable added (`restart_env`); MHCRUN_HUGE_PAGES=0 leaves the heap, as the weights, on 4 KB pages, and a
glibc.malloc.hugetlb the user sets is kept (=0: the heap alone on 4 KB pages). This module imports nothing heavy:
the entry point asks it before torch is loaded.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from pathlib import Path

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
TUNABLE = "glibc.malloc.hugetlb=1"
GLIBC_SINCE = (2, 35)  # the first glibc with the tunable


def thp_mode(path: Path = THP_MODE) -> str:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"; "" where it has none)."""
    try:
        words = path.read_text().split()
    except OSError:
        return ""
    return next((w[1:-1] for w in words if w.startswith("[")), "")


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library's glibc, None where it is not glibc."""
    try:
        name, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").split()
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (ValueError, OSError):
        return None


def malloc_hugetlb(tunables: str) -> str | None:
    """glibc.malloc.hugetlb's value in GLIBC_TUNABLES's value `tunables` (None where it is not set)."""
    name = TUNABLE.split("=")[0]
    values = [t.split("=", 1)[1] for t in tunables.split(":") if t.startswith(name + "=")]
    return values[-1] if values else None


def pages(why: str | None) -> str:
    """What a run reports memory to be on: "2 MB pages", or "4 KB pages (why)" where `why` says why not."""
    return "2 MB pages" if why is None else f"4 KB pages ({why})"


def heap_pages(huge_pages: bool, tunables: str, mode: str) -> str:
    """The pages the heap is on (`pages`) with MHCRUN_HUGE_PAGES's `huge_pages`, GLIBC_TUNABLES's `tunables` and the
    kernel's mode (`thp_mode`)."""
    setting = malloc_hugetlb(tunables)
    if not huge_pages:
        return pages("MHCRUN_HUGE_PAGES=0")
    if setting not in (None, "0", "1"):
        return f"as glibc.malloc.hugetlb={setting} has them"
    if mode == "always" or (mode == "madvise" and setting == "1"):
        return pages(None)
    if mode != "madvise":
        return pages(f"transparent huge pages: {mode or 'none'}")
    return pages(f"glibc.malloc.hugetlb={setting or 'unset'}")


def restart_env(environ: Mapping[str, str], huge_pages: bool, mode: str,
                glibc: tuple[int, int] | None) -> dict[str, str] | None:
    """The environment to start this process again with, its heap on huge pages, or None where that would change
    nothing or is not ours to decide: huge pages off (MHCRUN_HUGE_PAGES=0), the kernel's mode (`thp_mode`) not
    "madvise" ("always" gives the heap huge pages already), a C library (`glibc_version`) without the tunable, or
    glibc.malloc.hugetlb set already (by this restart, or by the user, to any value)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if not huge_pages or mode != "madvise" or glibc is None or glibc < GLIBC_SINCE or malloc_hugetlb(tunables):
        return None
    return dict(environ, GLIBC_TUNABLES=f"{tunables}:{TUNABLE}" if tunables else TUNABLE)


def set_heap_policy(mmap_above: int, keep_free: int = 128 << 10) -> None:
    """glibc: serve blocks of `mmap_above` bytes and more by mmap (returned to the OS when freed), smaller
    ones from the heap, and keep up to `keep_free` bytes free at the heap's top. Setting the threshold also
    stops glibc raising it by itself.

    Loading keeps tensors and frees bigger transients between them: with glibc's own moving threshold those
    land in the heap and leave holes that are never returned (the dequantised mid-size model peaked at 1.9x
    its weights). A decode step allocates and frees the same megabyte-sized buffers every step: from fresh
    mmaps each one costs a page fault per page (slow on virtual machines), from the heap nothing.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    libc.mallopt(-3, mmap_above)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, keep_free)  # M_TRIM_THRESHOLD
    libc.mallopt(-2, min(keep_free, 16 << 20))  # M_TOP_PAD: grow the heap this much at a time
