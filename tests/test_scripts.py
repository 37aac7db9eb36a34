"""The benchmarks' and tools' scripts end bad input as the CLI does: one line `error: ...` and its exit code, not a
traceback (`mhcrun.errors.run_script`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mhcrun.errors import InputError, NonFiniteError, run_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("tools/*.py")]
                 if re.search(r"^from mhcrun\b", p.read_text(), re.M) and "__main__" in p.read_text())


def test_run_script_gives_the_errors_line_and_code(capsys):
    def bad():
        raise InputError("/nowhere/config.json: config file not found")

    def nan():
        raise NonFiniteError("step 3: NaN")

    cases = ((bad, 2, "error: /nowhere/config.json: config file not found"), (nan, 3, "error: step 3: NaN"),
             (lambda: 5, 5, ""), (lambda: None, None, ""))
    for main, code, line in cases:
        with pytest.raises(SystemExit) as e:
            run_script(main)
        assert e.value.code == code and capsys.readouterr().err.strip() == line


def test_every_script_that_uses_mhcrun_runs_its_main_so():
    assert len(SCRIPTS) > 10
    for path in SCRIPTS:
        ends = re.search(r'^if __name__ == "__main__":\n(    .*\n)*    run_script\(main\)\n\Z', path.read_text(), re.M)
        assert ends, f"{path.relative_to(ROOT)}: its main is not run by run_script"


def test_a_benchmark_given_no_checkpoint_says_so_in_one_line():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_step_gemvs.py"), "--model", "/nonexistent"],
                       capture_output=True, text=True, timeout=300)
    (line,) = r.stderr.splitlines()
    assert r.returncode == 2 and line.startswith("error: ") and "/nonexistent" in line, r.stderr


def test_every_script_imports():
    """Each script's module-level imports resolve (a name moved or renamed in mhcrun breaks a benchmark no test
    runs otherwise); a script that needs an optional package says so in its exit, naming the pip install."""
    code = ("import runpy, sys\n"
            "for path in sys.argv[1:]:\n"
            "    try:\n"
            "        runpy.run_path(path, run_name='imported')\n"
            "    except SystemExit as e:\n"
            "        assert 'pip install' in str(e), (path, e)\n")
    r = subprocess.run([sys.executable, "-c", code, *map(str, SCRIPTS)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_bench_sessions_runs_on_the_tiny_model():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_sessions.py"), "--model",
                        str(ROOT / "mhcrun" / "data" / "tiny"), "--turn-tokens", "16", "--reply-tokens", "4",
                        "--new-tokens", "4", "--doc-tokens", "16", "--repeats", "1", "--chunk", "8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "reusing the state" in r.stdout and "loading the cache" in r.stdout
