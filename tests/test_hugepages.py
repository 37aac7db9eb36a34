"""Weights on transparent huge pages (mhcrun.hugepages): copies equal to what was loaded, on 2 MB pages where the
kernel offers them, the reasons they stay on 4 KB pages, and a run's tokens the same either way."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mhcrun.checkpoint import load_checkpoint
from mhcrun.errors import InputError
from mhcrun.generate import generate
from mhcrun.heap import malloc_hugetlb, thp_mode
from mhcrun.hugepages import ALIGN, HUGE_PAGE, place, why_not
from mhcrun.ops.qweight import QWeight
from mhcrun.runner import load_runner, resolve_model_path
from mhcrun.settings import Env

OFFERED = thp_mode() in ("always", "madvise")


def fp8_weight(n: int, k: int, g: torch.Generator) -> QWeight:
    data = torch.randint(0, 0x7E, (n, k), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    return QWeight(data, torch.rand(n // 128, k // 128, generator=g) + 0.5, 128).checked()


def huge_pages_at(address: int) -> int:
    """AnonHugePages (kB) of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("enabled, mode, available, why", [
    (True, "madvise", 10 << 30, None),
    (True, "always", None, None),  # no figure for the available memory: not a reason
    (False, "always", 10 << 30, "MHCRUN_HUGE_PAGES=0"),
    (True, "never", 10 << 30, "transparent huge pages: never"),
    (True, "", 10 << 30, "transparent huge pages: none"),
    (True, "madvise", 1 << 30, "1.00 GiB of weights, 1.00 GiB available"),
])
def test_why_not_names_each_reason_to_stay_on_small_pages(enabled, mode, available, why):
    assert why_not(1 << 30, enabled, mode, available) == why


def test_place_copies_every_tensor_exactly_onto_one_aligned_mapping():
    g = torch.Generator().manual_seed(0)
    w = replace(fp8_weight(256, 512, g), nan_free=True)
    bf = torch.randn(96, 80, generator=g).bfloat16()
    wide = torch.randn(40, 64, generator=g)
    tensors = {"w": w, "bf": bf, "cols": wide[:, 8:40], "idx": torch.arange(7, dtype=torch.int64),
               "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5)}
    before = {k: (v.data.clone(), v.scale.clone()) if isinstance(v, QWeight) else v.clone() for k, v in tensors.items()}
    place(tensors)
    assert list(tensors) == list(before)
    got = tensors["w"]
    assert isinstance(got, QWeight) and got.kernel == w.kernel and got.nan_free and got.block == 128
    assert torch.equal(got.data.view(torch.uint8), before["w"][0].view(torch.uint8))
    assert torch.equal(got.scale, before["w"][1]) and got.data.data_ptr() != w.data.data_ptr()
    for k in ("bf", "cols", "idx", "empty", "scalar"):
        t = tensors[k]
        assert t.dtype == before[k].dtype and t.shape == before[k].shape and torch.equal(t, before[k]), k
        assert t.is_contiguous()
    assert tensors["cols"].data_ptr() != wide.data_ptr() + 8 * 4  # a copy, not the strided view
    assert got.data.data_ptr() % HUGE_PAGE == 0  # the first tensor starts a huge page
    assert all(t.data_ptr() % ALIGN == 0 for t in (got.scale, tensors["bf"], tensors["cols"], tensors["idx"]))


@pytest.mark.skipif(not OFFERED, reason="the kernel offers no transparent huge pages here")
def test_placed_weights_are_on_huge_pages():
    big = {"w": torch.ones(4 * HUGE_PAGE, dtype=torch.uint8)}
    if thp_mode() == "madvise" and malloc_hugetlb(os.environ.get("GLIBC_TUNABLES", "")) in (None, "0"):
        # torch's own allocation: 4 KB pages, unless the kernel gives huge pages to all or malloc asks for them
        assert huge_pages_at(big["w"].data_ptr()) == 0
    place(big)
    assert huge_pages_at(big["w"].data_ptr()) >= 2048  # at least one whole 2 MB page
    assert int(big["w"].sum()) == 4 * HUGE_PAGE


def test_load_checkpoint_places_each_shard_then_releases_its_mapping():
    path = resolve_model_path(None)
    calls: list[list[str]] = []

    def record(tensors):
        calls.append(list(tensors))
        place(tensors)

    ref = load_checkpoint(path)
    got = load_checkpoint(path, place=record)
    assert len(calls) == len(ref.shard_files) == 2 and sorted(n for c in calls for n in c) == sorted(ref.tensors)
    for name, v in ref.tensors.items():
        a, b = (v.data, got.tensors[name].data) if isinstance(v, QWeight) else (v, got.tensors[name])
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name


@pytest.mark.parametrize("dequantize", [False, True])
def test_a_run_decodes_the_same_tokens_on_either_pages(dequantize):
    runs = {}
    for on in (True, False):
        r = load_runner(None, dequantize=dequantize, env=Env(huge_pages=on))
        runs[on] = (r.weight_pages, generate(r.model, [[0, 5, 6, 7]], 6, -1, ignore_eos=True)[0].tokens)
    assert runs[False][0] == "4 KB pages (MHCRUN_HUGE_PAGES=0)"
    small = f"4 KB pages (transparent huge pages: {thp_mode() or 'none'})"
    assert runs[True][0] == ("2 MB pages" if OFFERED else small)
    assert runs[True][1] == runs[False][1]


def test_env_refuses_other_values():
    assert Env.read({}).huge_pages and not Env.read({"MHCRUN_HUGE_PAGES": "0"}).huge_pages
    with pytest.raises(InputError, match="MHCRUN_HUGE_PAGES must be 0 or 1, got 'yes'"):
        Env.read({"MHCRUN_HUGE_PAGES": "yes"})
