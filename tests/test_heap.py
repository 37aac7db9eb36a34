"""mhcrun.heap: the heap on transparent huge pages by glibc's malloc tunable, the CLI starting itself again once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mhcrun.heap import TUNABLE, glibc_version, heap_pages, malloc_hugetlb, restart_env, thp_mode

GLIBC = (2, 36)


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert thp_mode(f) == "always"
    assert thp_mode(tmp_path / "absent") == ""


def test_glibc_version_reads_the_c_library(monkeypatch):
    monkeypatch.setattr(os, "confstr", lambda name: "glibc 2.36")
    assert glibc_version() == (2, 36)
    monkeypatch.setattr(os, "confstr", lambda name: "glibc 2.40.9000")
    assert glibc_version() == (2, 40)
    monkeypatch.setattr(os, "confstr", lambda name: None)  # not glibc (musl answers nothing)
    assert glibc_version() is None

    def absent(name):
        raise ValueError("unrecognized configuration name")

    monkeypatch.setattr(os, "confstr", absent)
    assert glibc_version() is None


def test_restart_adds_the_tunable_once_and_keeps_the_others():
    env = restart_env({"PATH": "/bin"}, True, "madvise", GLIBC)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": TUNABLE}
    assert restart_env(env, True, "madvise", GLIBC) is None  # the restarted process does not start again
    other = restart_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, True, "madvise", GLIBC)
    assert other == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TUNABLE}"}
    assert malloc_hugetlb(other["GLIBC_TUNABLES"]) == "1" and malloc_hugetlb("glibc.malloc.arena_max=2") is None
    # the user's own choice stands, off included
    assert restart_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, True, "madvise", GLIBC) is None


@pytest.mark.parametrize("huge, mode, glibc", [
    (False, "madvise", GLIBC),  # MHCRUN_HUGE_PAGES=0
    (True, "always", GLIBC),  # every anonymous mapping may take huge pages already
    (True, "never", GLIBC),
    (True, "", GLIBC),  # no transparent huge pages at all
    (True, "madvise", (2, 34)),  # a glibc without the tunable
    (True, "madvise", None),  # not glibc
])
def test_no_restart_where_it_changes_nothing(huge, mode, glibc):
    assert restart_env({}, huge, mode, glibc) is None


def test_heap_pages_says_where_the_heap_is():
    assert heap_pages(True, TUNABLE, "madvise") == "2 MB pages"
    assert heap_pages(True, "", "always") == "2 MB pages"
    assert heap_pages(True, "", "madvise") == "4 KB pages (glibc.malloc.hugetlb=unset)"
    assert heap_pages(True, "glibc.malloc.hugetlb=0", "madvise") == "4 KB pages (glibc.malloc.hugetlb=0)"
    assert heap_pages(True, "glibc.malloc.hugetlb=2", "madvise") == "as glibc.malloc.hugetlb=2 has them"
    assert heap_pages(True, TUNABLE, "never") == "4 KB pages (transparent huge pages: never)"
    assert heap_pages(True, "", "") == "4 KB pages (transparent huge pages: none)"
    assert heap_pages(False, TUNABLE, "madvise") == "4 KB pages (MHCRUN_HUGE_PAGES=0)"


def run_generate(**env: str) -> dict:
    """`mhcrun generate` as a user starts it (a fresh process without the tunable) -> its JSON stats."""
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MHCRUN_HUGE_PAGES")}
    out = subprocess.run([sys.executable, "-m", "mhcrun.cli", "generate", "--prompt-ids", "1,2", "-n", "2", "--json"],
                         capture_output=True, text=True, timeout=300, env={**base, **env}, check=True)
    return json.loads(out.stdout.splitlines()[0])["stats"]


def test_the_command_puts_its_heap_on_huge_pages_where_malloc_can_be_told():
    mode, glibc = thp_mode(), glibc_version()
    stats = run_generate()
    if restart_env({}, True, mode, glibc) is not None:  # this machine: madvise mode, glibc 2.35 on
        assert stats["heap_pages"] == "2 MB pages"  # started again with the tunable
    else:
        assert stats["heap_pages"] == heap_pages(True, "", mode)
    assert run_generate(MHCRUN_HUGE_PAGES="0")["heap_pages"] == "4 KB pages (MHCRUN_HUGE_PAGES=0)"
    off = "glibc.malloc.hugetlb=0"
    assert run_generate(GLIBC_TUNABLES=off)["heap_pages"] == heap_pages(True, off, mode)  # kept: no restart


HUGE_KB = """
import ctypes, re
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
p = libc.malloc(16 << 20)
ctypes.memset(p, 1, 16 << 20)
print(sum(int(kb) for kb in re.findall(r"AnonHugePages:\\s+(\\d+) kB", open("/proc/self/smaps").read())))
"""


@pytest.mark.skipif(restart_env({}, True, thp_mode(), glibc_version()) is None,
                    reason="the kernel's mode is not madvise, or the C library has no such tunable")
def test_the_tunable_puts_mallocs_memory_on_huge_pages():
    """What the restart is for, on this machine: 16 MB from malloc on huge pages with the tunable, not without."""
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}

    def huge_kb(env: dict[str, str]) -> int:
        return int(subprocess.run([sys.executable, "-c", HUGE_KB], capture_output=True, text=True, env=env,
                                  check=True, timeout=60).stdout)

    assert huge_kb(base) == 0
    assert huge_kb({**base, "GLIBC_TUNABLES": TUNABLE}) >= 2048
