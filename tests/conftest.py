"""Fixtures shared by the GEMM tests: which CPU GEMV path qlinear takes."""

from __future__ import annotations

import pytest

from mhcrun.ops import qgemv


@pytest.fixture(params=["kernel", "torch"])
def gemv_path(request, monkeypatch) -> str:
    """Runs a test twice: decode GEMVs through the fused C++ kernel, then through the torch chunk decoders."""
    if request.param == "kernel" and not qgemv.available():
        pytest.skip(f"CPU kernel {qgemv.status()}")
    monkeypatch.setenv("MHCRUN_CPU_KERNEL", "1" if request.param == "kernel" else "0")
    return request.param


@pytest.fixture
def torch_gemv(monkeypatch) -> None:
    """The torch chunk decoders only (tests of their chunking and scale folding)."""
    monkeypatch.setenv("MHCRUN_CPU_KERNEL", "0")
