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
