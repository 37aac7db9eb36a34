"""The bundled model's golden tokens with the hc steps run by the NKI kernels in mhcrun's simulator
(eager and compiled regions), and with the NKI path switched off."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mhcrun.cli import app

GOLDEN = "tests/golden/tiny-random.json"  # the random model's (random_tiny): see BENCHMARKS.md, bundled trained model
HC_KERNELS = ("hc_expand", "hc_mixes", "hc_collapse", "hc_post", "hc_head")


def run(*args: str, env: dict[str, str]):
    return CliRunner().invoke(app, list(args), env=env)


def test_generate_reports_the_hc_kernels_running_in_the_simulator():
    r = run("generate", "--prompt-ids", "0,5,6,7", "-n", "3", "--json", env={"MHCRUN_NKI_SIM": "1"})
    assert r.exit_code == 0, r.stderr
    kernels = json.loads(r.stdout)["stats"]["kernels"]
    for name in HC_KERNELS:
        assert kernels[name]["nki-sim"] > 0 and kernels[name]["torch"] == 0, (name, kernels[name])
    plain = run("generate", "--prompt-ids", "0,5,6,7", "-n", "3", "--json", env={"MHCRUN_NKI_SIM": "0"})
    assert json.loads(plain.stdout)["tokens"] == json.loads(r.stdout)["tokens"]


@pytest.mark.parametrize("env, mode", [({"MHCRUN_NKI_SIM": "1"}, "eager"), ({"MHCRUN_NKI_SIM": "1"}, "regions"),
                                       ({"MHCRUN_NKI_HC": "0"}, "eager")],
                         ids=["nki-sim-eager", "nki-sim-regions", "nki-off"])
def test_golden_check_passes(env, mode, random_tiny):
    r = run("golden-check", GOLDEN, "-m", str(random_tiny), "--graph-mode", mode, "--json", env=env)
    assert r.exit_code == 0, r.stdout[-2000:] + r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] and report["counts"]["mismatch"] == 0


def test_golden_check_in_device_like_numerics_within_the_nki_device_tolerance(random_tiny):
    """MHCRUN_NKI_SIM=device: golden-check takes TOLERANCES["nki-device"] by itself and the goldens pass at it, and
    the device-like error is visible (it would fail the fp32 paths' tolerance)."""
    from mhcrun.golden import TOLERANCES

    tol = TOLERANCES["nki-device"][0]
    r = run("golden-check", GOLDEN, "-m", str(random_tiny), "--json", env={"MHCRUN_NKI_SIM": "device"})
    assert r.exit_code == 0, r.stdout[-2000:] + r.stderr
    report = json.loads(r.stdout)
    worst = max(p["max_logprob_diff"] for p in report["prompts"])
    assert report["ok"] and TOLERANCES["fp32"][0] < worst <= tol
