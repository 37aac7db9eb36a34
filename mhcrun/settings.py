"""A run's settings, validated once where a command builds them, and the environment, read once at the entry point.

`RunSettings` holds what a command was asked to do (new tokens, sampling, the decode path, the prefill chunk,
`--tp`, the memory limit); building it checks every field and names the bad option in one line, so nothing
downstream checks them again. `Env` holds the environment variables mhcrun reads, read by `Env.read()` in the
command (the entry point) and passed down; nothing else in the package reads `os.environ` for a setting.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mhcrun.errors import InputError

GRAPH_MODES = ("eager", "regions")
STAGE_PLANS = ("whole", "split")
DEVICES = ("cpu", "cuda", "neuron")
NKI_SIM_MODES = {"0": None, "1": "exact", "device": "device"}  # MHCRUN_NKI_SIM -> the simulator's numerics
CPU_KERNEL_CAPS = ("amx", "avx512bf16", "avx512", "avx2")  # MHCRUN_CPU_KERNEL's caps, best first (qgemv.CAPS)
MAX_DRAFT_TOKENS = 8  # --draft-tokens' limit (a model's sliding window may lower it: `speculate.draft_limit`)
REGIONS_MIN_CONTEXT = 256  # the least cache length compiled regions run with (`regions_context`)
REGIONS_CONTEXT_STEP = 8192  # beyond it, regions' cache lengths are multiples of it, not powers of two


def regions_context(needed: int, most: int) -> int:
    """The cache length a compiled-regions run sets up for `needed` positions: rounded up to a power of two (at
    least REGIONS_MIN_CONTEXT) up to REGIONS_CONTEXT_STEP, to a multiple of it beyond (a cache at most that much
    larger than needed), and at most `most` (the model's context). The graphs' shapes hold the cache length, so
    each length compiles its own: rounded, one compile (`compile-regions --context N`) serves every run whose
    prompt and new tokens round to the same length, from torch's compile cache."""
    if needed > REGIONS_CONTEXT_STEP:
        return min(most, -(-needed // REGIONS_CONTEXT_STEP) * REGIONS_CONTEXT_STEP)
    return min(most, max(REGIONS_MIN_CONTEXT, 1 << max(needed - 1, 0).bit_length()))


def cache_length(needed: int, graph_mode: str, most: int) -> int:
    """The cache length a run of `needed` positions sets up: `needed` eager, `regions_context` compiled."""
    return regions_context(needed, most) if graph_mode == "regions" else needed


def check_choice(what: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InputError(f"unknown {what} {value!r} (choose from: {', '.join(choices)})")
    return value


def check_range(what: str, value: int, least: int, most: int | None = None, why: str = "") -> int:
    """`value` of option `what`, or one line naming the option and its bounds: at least `least`, and at most `most`
    where given (`why`: where that bound comes from)."""
    if value < least or (most is not None and value > most):
        bound = f">= {least}" if most is None else f"in [{least}, {most}]{why}"
        raise InputError(f"{what} must be {bound}, got {value}")
    return value


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InputError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also false for nan
            raise InputError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**63:
            raise InputError(f"--seed must be in [0, 2**63), got {self.seed}")


@dataclass(frozen=True)
class Env:
    """The environment variables mhcrun reads (defaults: as if none were set)."""

    graph_mode: str | None = None  # MHCRUN_GRAPH_MODE: --graph-mode's default
    hc_torch: bool = False  # MHCRUN_NKI_HC=0: the hc steps take the torch reference
    nki_sim: str | None = None  # MHCRUN_NKI_SIM: 1|exact or device runs the NKI kernels in the simulator
    cpu_kernel: str = "1"  # MHCRUN_CPU_KERNEL: 0 off, 1 its default, a name of CPU_KERNEL_CAPS caps the kernel
    huge_pages: bool = True  # MHCRUN_HUGE_PAGES=0: a CPU run's weights stay on the shards' 4 KB pages (`hugepages`),
    # and the heap on 4 KB pages (`heap`)
    glibc_tunables: str = ""  # GLIBC_TUNABLES: whether malloc puts the heap on huge pages (`heap.heap_pages`)
    scaled_mm: bool = False  # MHCRUN_SCALED_MM=1: cuBLASLt's FP8 GEMM on cuda
    kernel_cache: Path = field(default_factory=lambda: Path.home() / ".cache" / "mhcrun" / "kernels")
    cxx: str = "g++"  # CXX: the compiler of the C++ kernels
    rank: int | None = None  # RANK and WORLD_SIZE: this process is one rank of a launch (torchrun's or --tp's)
    world: int | None = None
    local_rank: int | None = None  # LOCAL_RANK: the rank's CUDA device
    launcher: int | None = None  # MHCRUN_TP_PARENT: the process id of the mhcrun that started this rank (--tp)
    threads_sleep: bool = False  # OMP_WAIT_POLICY=passive: idle OpenMP threads sleep; no worker spins through a step
    # reading weights ahead (`qgemv.StepScope`)

    @staticmethod
    def read(environ: Mapping[str, str] = os.environ) -> Env:
        """The settings of `environ`; a value mhcrun cannot take is one line naming the variable."""
        sim = environ.get("MHCRUN_NKI_SIM", "0")
        if sim not in NKI_SIM_MODES:
            raise InputError(f"MHCRUN_NKI_SIM must be one of {', '.join(NKI_SIM_MODES)}, got {sim!r}")
        kernel = environ.get("MHCRUN_CPU_KERNEL", "1")
        if kernel not in ("0", "1", *CPU_KERNEL_CAPS):
            raise InputError(f"MHCRUN_CPU_KERNEL must be 0 (off), 1 (this CPU's default) or a cap "
                             f"({', '.join(CPU_KERNEL_CAPS)}), got {kernel!r}")
        mode = environ.get("MHCRUN_GRAPH_MODE") or None
        if mode is not None and mode not in GRAPH_MODES:
            raise InputError(f"MHCRUN_GRAPH_MODE must be one of {', '.join(GRAPH_MODES)}, got {mode!r}")
        launch = {k: _read_int(environ, k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MHCRUN_TP_PARENT")}
        cache = environ.get("MHCRUN_KERNEL_CACHE")
        if not cache:
            cache = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mhcrun" / "kernels"
        return Env(graph_mode=mode,
                   hc_torch=not _read_flag(environ, "MHCRUN_NKI_HC", True), nki_sim=NKI_SIM_MODES[sim],
                   cpu_kernel=kernel, huge_pages=_read_flag(environ, "MHCRUN_HUGE_PAGES", True),
                   glibc_tunables=environ.get("GLIBC_TUNABLES", ""),
                   scaled_mm=_read_flag(environ, "MHCRUN_SCALED_MM", False), kernel_cache=Path(cache),
                   cxx=environ.get("CXX", "g++"), rank=launch["RANK"], world=launch["WORLD_SIZE"],
                   local_rank=launch["LOCAL_RANK"], launcher=launch["MHCRUN_TP_PARENT"],
                   threads_sleep=environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive")


def _read_flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """A variable that is 0 or 1 (unset or empty: `default`)."""
    value = environ.get(name) or ("1" if default else "0")
    if value not in ("0", "1"):
        raise InputError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def _read_int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise InputError(f"{name} must be an integer, got {value!r}") from None


@dataclass(frozen=True)
class RunSettings:
    """What a run was asked for, every field checked once here."""

    max_new_tokens: int = 32
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    graph_mode: str = "eager"
    stages: str = "whole"
    prefill_chunk: int | None = None
    tp: int = 1
    memory_limit: int | None = None
    min_new_tokens: int = 0  # the least --max-new-tokens the command takes
    draft_tokens: int | None = None  # speculative decoding: K drafts per step from the MTP layer (None: off)

    def __post_init__(self) -> None:
        check_range("--max-new-tokens", self.max_new_tokens, self.min_new_tokens)
        check_choice("--graph-mode", self.graph_mode, GRAPH_MODES)
        check_choice("--stages", self.stages, STAGE_PLANS)
        if self.stages != "whole" and self.graph_mode != "regions":
            raise InputError(f"--stages {self.stages} cuts compiled regions, and this run is {self.graph_mode} "
                             "(--graph-mode regions compiles them)")
        if self.prefill_chunk is not None:
            check_range("--prefill-chunk", self.prefill_chunk, 1)
        check_range("--tp", self.tp, 1)
        if self.draft_tokens is not None:
            check_range("--draft-tokens", self.draft_tokens, 1, MAX_DRAFT_TOKENS)


def default_graph_mode(device: str, env: Env) -> str:
    """--graph-mode's default: MHCRUN_GRAPH_MODE, else regions on an accelerator (launch-bound decode) and eager
    on a CPU (a short run there never earns back the compile)."""
    return env.graph_mode or ("eager" if device == "cpu" else "regions")
