"""The NKI compiler's and Trainium2's rules in mhcrun's simulator: for each rule a kernel that breaks it is refused
(one error naming the rule, and for the language rules the file and line) and one that keeps it runs.

The rules and their documents are listed in mhcrun/nki/sim/lint.py (language), target.py (version, memory, fp8)
and numerics.py (device-like numerics).
"""

from __future__ import annotations

import textwrap
import types

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from mhcrun.nki.sim import NkiSimError, load_kernel_module
from mhcrun.nki.sim.lint import NkiLanguageError, find_problems
from mhcrun.nki.sim.nki import profile
from mhcrun.nki.sim.numerics import ACT_REL_ERR

HEADER = "import nki\nimport nki.language as nl\nimport nki.isa as nisa\n\n\n"
HEADER_LINES = HEADER.count("\n")


@pytest.fixture
def load(tmp_path):
    count = iter(range(1000))

    def _load(src: str, numerics: str = "exact") -> types.ModuleType:
        path = tmp_path / f"kernel_{next(count)}.py"
        path.write_text(HEADER + textwrap.dedent(src))
        return load_kernel_module(path, numerics=numerics)

    return _load


# ------------------------------------------------------------------------------------------ 1. the language

GOOD = """
def _double(dst, src):
    nisa.tensor_scalar(dst=dst, data=src, op0=nl.multiply, operand0=2.0)


def _apply(fn, dst, src):
    fn(dst, src)                       # a module-level function passed by name (Language Guide, composition)


@nki.jit
def k(x):
    P, F = x.shape
    out = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.shared_hbm)
    for c in nl.affine_range((F + 3) // 4):
        w = min(4, F - c * 4)
        t = nl.load(x[:, c * 4:c * 4 + w])
        r = nl.ndarray((P, w), dtype=x.dtype, buffer=nl.sbuf)
        _apply(_double, r, t)
        nl.store(out[:, c * 4:c * 4 + w], value=r)
    return out
"""

# (construct, kernel body line that breaks it, the error's words)
BROKEN = [
    ("lambda", "f = lambda v: v", "lambda"),
    ("list comprehension", "xs = [i for i in range(3)]", "list comprehension"),
    ("dict comprehension", "xs = {str(i): i for i in range(3)}", "dict comprehension"),
    ("set comprehension", "xs = {i for i in range(3)}", "set comprehension"),
    ("generator expression", "xs = tuple(i for i in range(3))", "generator expression"),
    ("inner function", "def inner(v):\n        return v\n    inner(1)", "function 'inner' defined inside a function"),
    ("inner class", "class C:\n        pass", "class 'C' defined inside a function"),
    ("is", "y = x is None", "'is' comparison"),
    ("is not", "y = x is not None", "'is not' comparison"),
    ("yield", "yield x", "yield"),
    ("global", "global G", "global statement"),
    ("try", "try:\n        pass\n    except ValueError:\n        pass", "try statement"),
    ("import inside", "import math", "import inside a function"),
    ("built-in outside the subset", "y = eval('1')", "call of the Python built-in 'eval'"),
]


@pytest.mark.parametrize(("construct", "line", "words"), BROKEN, ids=[b[0] for b in BROKEN])
def test_language_rule_refused_with_file_and_line(load, construct, line, words):
    src = f"@nki.jit\ndef k(x):\n    {line}\n    return x\n"
    with pytest.raises(NkiLanguageError) as ei:
        load(src)
    msg = str(ei.value)
    assert f".py:{HEADER_LINES + 3}: " in msg and words in msg
    assert "is not in the Python subset the NKI compiler accepts" in msg and "\n" not in msg


@pytest.mark.parametrize(("sig", "words"), [("x, *, scale", "keyword-only parameter 'scale'"),
                                            ("x, **kw", "'**kw' parameter"), ("x, *rest", "'*rest' parameter")],
                         ids=["keyword-only", "kwargs", "varargs"])
def test_signature_rules_refused(load, sig, words):
    with pytest.raises(NkiLanguageError, match=f":{HEADER_LINES + 2}: {words}".replace("*", r"\*")):
        load(f"@nki.jit\ndef k({sig}):\n    return x\n")


def test_other_modules_refused(tmp_path):
    src = HEADER + "import numpy as np\n\n\n@nki.jit\ndef k(x):\n    return np.zeros(3)\n"
    problems = find_problems(src, "k.py")
    assert problems[0] == (HEADER_LINES + 1, "import of module 'numpy' (a kernel file imports only nki, nki.language "
                                             "and nki.isa)")
    assert any(line == HEADER_LINES + 6 and "call into module 'np' (np.zeros)" in what for line, what in problems)
    assert find_problems(HEADER + "from os import path\n", "k.py")[0][1].startswith("import from module 'os'")
    path = tmp_path / "k.py"
    path.write_text(src)
    with pytest.raises(NkiLanguageError, match=r"k\.py:6: import of module 'numpy'.*\(and 1 more\)"):
        load_kernel_module(path)


def test_kernel_in_the_subset_runs(load):
    m = load(GOOD)
    x = torch.randn(8, 10)
    assert torch.equal(m.k(x), x * 2)
    assert find_problems(HEADER + textwrap.dedent(GOOD), "good.py") == []


def test_mhcrun_kernels_are_in_the_subset():
    from mhcrun.nki.ops import KERNEL_SOURCE

    assert find_problems(KERNEL_SOURCE.read_text(), str(KERNEL_SOURCE)) == []


# ------------------------------------------------------------------------------------------ 2. the NKI version


def test_broadcast_and_size_are_nki_0_5_and_refused(load):
    m = load("@nki.jit\ndef k(v):\n    t = nl.load(v[0:1, :].broadcast(0, 4))\n")
    with pytest.raises(NkiSimError, match=r"NkiTensor.broadcast arrived in NKI 0.5; mhcrun's kernels target NKI 0.3"):
        m.k(torch.randn(1, 8))
    m = load("@nki.jit\ndef k(v):\n    n = v.size\n")
    with pytest.raises(NkiSimError, match="NkiTensor.size arrived in NKI 0.5"):
        m.k(torch.randn(1, 8))


def test_ap_stride_zero_pattern_repeats_a_vector_over_partitions(load):
    m = load("""
    @nki.jit
    def k(v):
        out = nl.ndarray((5, 3), dtype=v.dtype, buffer=nl.shared_hbm)
        t = nl.load(v.ap(pattern=[[0, 5], [1, 3]], offset=2))
        nl.store(out, value=t)
        return out
    """)
    v = torch.arange(8, dtype=torch.float32)
    assert torch.equal(m.k(v), v[2:5].expand(5, 3))


def test_ap_refuses_a_pattern_past_the_storage_and_a_partition_stride_on_chip(load):
    m = load("@nki.jit\ndef k(v):\n    t = nl.load(v.ap(pattern=[[0, 5], [1, 3]], offset=6))\n")
    with pytest.raises(NkiSimError, match="reaches element 8 of tensor"):
        m.k(torch.arange(8, dtype=torch.float32))
    m = load("@nki.jit\ndef k(v):\n    t = nl.load(v)\n    u = t.ap(pattern=[[1, 4], [1, 8]])\n")
    with pytest.raises(NkiSimError, match="partition stride of an on-chip access pattern must be the storage's free"):
        m.k(torch.randn(4, 8))


def test_dma_copy_dst_rmw_op_was_removed_in_nki_0_3(load):
    m = load("@nki.jit\ndef k(x):\n    t = nl.load(x)\n    nisa.dma_copy(dst=t, src=x, dst_rmw_op=nl.add)\n")
    with pytest.raises(NkiSimError, match="dst_rmw_op was removed in NKI 0.3.*use nisa.dma_compute"):
        m.k(torch.randn(4, 8))


# ------------------------------------------------------------------------------------------ 3. memory


SBUF_TILES = """
@nki.jit
def k(x, n, kib):
    out = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    keep = []
    for i in range(n):
        t = nl.ndarray((128, kib * 256), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(t, 1.0)
        keep.append(t)
    nl.store(out, value=nl.load(x))
    return out


@nki.jit
def loop(x, n, kib):
    out = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    for i in range(n):
        t = nl.ndarray((128, kib * 256), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(t, 1.0)
    nl.store(out, value=nl.load(x))
    return out
"""


def test_live_sbuf_beyond_192_kib_refused_and_peaks_reported(load):
    m = load(SBUF_TILES)
    x = torch.randn(1, 4)
    with pytest.raises(NkiSimError, match=r"SBUF over capacity: .* needs 163840 bytes per partition with 163840 "
                                          r"already live; an SBUF partition holds 196608 on trn2"):
        m.k(x, 3, 160)  # 480 KiB live per partition
    _, rep = profile(m.k)(x, 1, 160)
    assert rep.peaks.sbuf_bytes == 160 * 1024 + 16  # the tile and the 4-float load
    _, rep = profile(m.loop)(x, 3, 96)  # each iteration's tile replaces the last: two live at most
    assert rep.peaks.sbuf_bytes == 2 * 96 * 1024  # exactly full while the second one is allocated


PSUM_TILES = """
@nki.jit
def k(x, n, free):
    out = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    keep = []
    for i in range(n):
        keep.append(nl.ndarray((128, free), dtype=nl.float32, buffer=nl.psum))
    nl.store(out, value=nl.load(x))
    return out
"""


def test_psum_beyond_8_banks_refused(load):
    m = load(PSUM_TILES)
    x = torch.randn(1, 4)
    with pytest.raises(NkiSimError, match=r"PSUM over capacity: .* needs 2048 bytes per partition; in use by bank: "
                                          r"\[2048, 2048, 2048, 2048, 2048, 2048, 2048, 2048\]"):
        m.k(x, 9, 512)
    _, rep = profile(m.k)(x, 8, 512)
    assert rep.peaks.psum_bytes == 16 * 1024 and rep.peaks.psum_bank_bytes == [2048] * 8
    _, rep = profile(m.k)(x, 16, 128)  # 512-byte tiles pack four to a bank
    assert rep.peaks.psum_bank_bytes == [2048, 2048, 2048, 2048, 0, 0, 0, 0]


MATMUL_INTO = """
@nki.jit
def k(x, lo, hi):
    a = nl.load(x)
    acc = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.psum)   # two banks
    nisa.nc_matmul(dst=acc[:, lo:hi], stationary=a[:, 0:128], moving=a[:, 0:hi - lo])
"""


def test_matmul_output_crossing_a_bank_refused(load):
    m = load(MATMUL_INTO)
    x = torch.randn(128, 512)
    with pytest.raises(NkiSimError, match=r"nc_matmul: output .* crosses PSUM banks 0..1; a Tensor-engine result must "
                                          r"lie in one bank"):
        m.k(x, 256, 768)
    m.k(x, 512, 1024)  # the second bank, whole


GROUPS = """
@nki.jit
def k(x, n, evict):
    a = nl.load(x)
    keep = []
    for i in range(n):
        acc = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.psum)   # 512 bytes: four to a bank
        nisa.nc_matmul(dst=acc, stationary=a, moving=a)
        if evict:
            r = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=r, src=acc)
        keep.append(acc)
"""


def test_more_than_8_open_accumulation_groups_refused(load):
    m = load(GROUPS)
    x = torch.randn(128, 128)
    with pytest.raises(NkiSimError, match=r"a 9th open matmul accumulation group .* at most 8 are open at once"):
        m.k(x, 9, False)
    _, rep = profile(m.k)(x, 8, False)
    assert rep.peaks.open_groups == 8
    _, rep = profile(m.k)(x, 12, True)  # each group read (evicted) before the next opens
    assert rep.peaks.open_groups == 1


PARTITIONS = """
@nki.jit
def k(x, p0, n):
    a = nl.load(x)
    r = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=r[p0:p0 + n, :], src=a[p0:p0 + n, :])
"""


@pytest.mark.parametrize(("p0", "n", "ok"), [(32, 32, True), (96, 32, True), (16, 16, False), (64, 64, True),
                                             (32, 64, False), (0, 128, True), (1, 100, False)])
def test_partition_start_rule(load, p0, n, ok):
    m = load(PARTITIONS)
    x = torch.randn(128, 8)
    if ok:
        m.k(x, p0, n)
    else:
        with pytest.raises(NkiSimError, match=f"starts at partition {p0}; an engine operand of {n} partitions may "
                                              "start only at"):
            m.k(x, p0, n)


# ------------------------------------------------------------------------------------------ 4. numerics


ACT = """
@nki.jit
def k(x):
    P, F = x.shape
    out = nl.ndarray((P, F), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    e = nl.ndarray((P, F), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=e, op=nl.exp, data=t)
    s = nl.ndarray((P, F), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=s, op=nl.square, data=e)
    nl.store(out, value=s)
    return out
"""


def test_device_numerics_bound_the_activation_error(load):
    x = torch.linspace(-4, 4, 128 * 64).reshape(128, 64)
    want = x.double().exp() ** 2
    exact = load(ACT).k(x)
    device = load(ACT, numerics="device").k(x)
    torch.testing.assert_close(exact.double(), want, rtol=1e-6, atol=0)
    rel = (device.double() / want - 1).abs()
    # exp carries at most ACT_REL_ERR; square (exact on the Scalar engine) doubles it
    assert rel.max() <= 2 * ACT_REL_ERR * 1.001 and rel.max() > ACT_REL_ERR
    assert (rel > 1e-5).float().mean() > 0.9  # nearly every element is off: the mode is not a no-op
    assert torch.equal(device, load(ACT, numerics="device").k(x))  # deterministic
    with pytest.raises(NkiSimError, match="numerics must be one of exact, device"):
        load(ACT, numerics="fast")


# ------------------------------------------------------------------------------------------ bad input at the CLI


def test_refused_kernel_stops_a_simulated_run_with_exit_2(tmp_path, monkeypatch):
    from mhcrun.cli import app
    from mhcrun.nki import ops

    src = ops.KERNEL_SOURCE.read_text().replace(
        "def n_tiles(total, size):", "def n_tiles(total, size):\n    f = lambda v: v  # noqa: E731")
    bad = tmp_path / "kernels.py"
    bad.write_text(src)
    line = src.splitlines().index("    f = lambda v: v  # noqa: E731") + 1
    monkeypatch.setattr(ops, "KERNEL_SOURCE", bad)
    args = ["generate", "--prompt-ids", "0,5,6,7", "-n", "2", "--json"]
    r = CliRunner().invoke(app, args, env={"MHCRUN_NKI_SIM": "1"})
    assert r.exit_code == 2, r.output
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: NKI simulator refused ")
    assert f"kernels.py:{line}: lambda" in err[0]
    r = CliRunner().invoke(app, args, env={"MHCRUN_NKI_SIM": "0"})  # the simulator off: the torch path runs
    assert r.exit_code == 0, r.output


def test_numpy_unit_hash_covers_the_interval():
    from mhcrun.nki.sim.numerics import unit_hash

    h = unit_hash(np.linspace(-10, 10, 100_000, dtype=np.float32))
    assert h.min() >= -1 and h.max() <= 1 and h.min() < -0.99 and h.max() > 0.99 and abs(h.mean()) < 0.01
