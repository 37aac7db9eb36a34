import copy
import json
import math

import pytest
from rich.console import Console

from mhcrun.errors import GoldenError, InputError
from mhcrun.generate import GenerationResult
from mhcrun.golden import (
    END,
    check_fits_model,
    check_model_identity,
    compare,
    dumps_golden,
    golden_from_results,
    golden_prompts,
    load_golden,
    render_report,
    report_to_json,
    write_golden,
)
from mhcrun.prompts import Prompt

VOCAB = 16
TOP_K = 4
MODEL = {"name": "tiny", "config_hash": "c0ffee0000000001", "weights_hash": "beef000000000002"}
SETTINGS = {"dtype": "fp32", "quant_sim": False, "graph_mode": "eager", "max_new_tokens": 6, "top_k": TOP_K,
            "ignore_eos": True}


def step(token: int, margin: float, runner_up: int | None = None) -> tuple[list[tuple[int, float]], float]:
    """A consistent (top-k, margin) pair: `token` leads the next best by exactly `margin` logits."""
    runner_up = (token + 1) % VOCAB if runner_up is None else runner_up
    logits = [-float(i % 5) - 3.0 for i in range(VOCAB)]
    logits[token] = 2.0 + margin
    logits[runner_up] = 2.0
    lse = math.log(sum(math.exp(x) for x in logits))
    order = sorted(range(VOCAB), key=lambda i: -logits[i])[:TOP_K]
    return [(i, logits[i] - lse) for i in order], margin


def result(prompt_ids, tokens, margins, runner_ups=None) -> GenerationResult:
    runner_ups = runner_ups or [None] * len(tokens)
    steps = [step(t, m, r) for t, m, r in zip(tokens, margins, runner_ups, strict=True)]
    return GenerationResult(prompt_ids=list(prompt_ids), tokens=list(tokens),
                            top_logprobs=[s[0] for s in steps], margins=[s[1] for s in steps])


PROMPTS = [Prompt("a", "The river", None), Prompt("b", None, [0, 4, 9]), Prompt("c", "naïve café", None)]


def make_results():
    return [
        result([0, 3, 5], [7, 8, 9, 10, 11, 12], [1.5, 2.0, 0.004, 3.0, 1.0, 0.5]),
        result([0, 4, 9], [1, 2, 3, 4, 5, 6], [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]),
        result([0, 13, 14], [3, 3, 3, 3, 3, 3], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]),
    ]


@pytest.fixture
def golden():
    return golden_from_results(MODEL, SETTINGS, PROMPTS, make_results(), tolerance=0.01)


def test_round_trip(tmp_path, golden):
    path = tmp_path / "g.json"
    write_golden(path, golden, force=False)
    loaded = load_golden(path)
    assert loaded == golden
    assert loaded["prompts"][0]["steps"][2]["margin"] == pytest.approx(0.004)
    assert loaded["prompts"][1]["text"] is None
    assert loaded["prompts"][2]["text"] == "naïve café"
    # layout: one line per step keeps files short and diffable
    text = path.read_text(encoding="utf-8")
    assert sum('"top"' in line for line in text.splitlines()) == 18
    assert json.loads(text) == json.loads(dumps_golden(golden))
    assert [p.ids for p in golden_prompts(loaded)] == [[0, 3, 5], [0, 4, 9], [0, 13, 14]]


def test_identical_results_pass(golden):
    report = compare(golden, make_results())
    assert report.ok
    assert [p.status for p in report.prompts] == ["match"] * 3
    assert all(p.matched == p.total == 6 and p.step is None for p in report.prompts)
    assert report_to_json(report)["counts"] == {"match": 3, "near-tie": 0, "mismatch": 0, "non-finite": 0}


def test_changed_token_fails(golden):
    results = make_results()
    results[1].tokens[3] = 9
    report = compare(golden, results)
    assert not report.ok
    p = report.prompts[1]
    assert (p.status, p.matched, p.total, p.step, p.expected, p.got) == ("mismatch", 3, 6, 3, 4, 9)
    assert p.margin == pytest.approx(0.6)
    assert [q.status for q in report.prompts] == ["match", "mismatch", "match"]
    j = report_to_json(report)
    assert j["ok"] is False and j["prompts"][1]["step"] == 3 and j["prompts"][1]["got"] == 9
    json.dumps(j)  # serializable


def test_near_tie_accepted(golden):
    results = make_results()
    # step 2 of prompt "a" has golden margin 0.004 < 0.01: the runner-up wins, and the run goes on differently
    results[0].tokens[2:] = [10, 1, 1, 1]
    report = compare(golden, results)
    assert report.ok
    p = report.prompts[0]
    assert (p.status, p.matched, p.step, p.expected, p.got) == ("near-tie", 2, 2, 9, 10)
    assert report.counts == {"match": 2, "near-tie": 1, "mismatch": 0, "non-finite": 0}
    assert "golden margin 0.004 < tolerance 0.01" in p.note


def test_free_running_divergence_follows_vllms_rule_not_the_margin(golden):
    """Each token must be in the other run's top-k with log-probs within logprob_tol; the margin only reports."""
    golden["tolerance"] = 0.001  # the golden margin 0.004 is no near-tie by the margin rule: reported, not decisive
    results = make_results()
    results[0].tokens[2] = 10
    p = compare(golden, results).prompts[0]
    assert p.status == "near-tie" and "golden margin 0.004 >= tolerance 0.001" in p.note
    moved = make_results()  # the same divergence, the run's log-probs 0.3 away from the golden ones
    moved[0].tokens[2] = 10
    moved[0].top_logprobs[2] = [(t, lp - 0.3 * (t == 10)) for t, lp in moved[0].top_logprobs[2]]
    p = compare(golden, moved, logprob_tol=0.05).prompts[0]
    assert p.status == "mismatch" and "differ by 0.3" in p.note
    assert compare(golden, moved, logprob_tol=0.5).prompts[0].status == "near-tie"
    outside = make_results()  # the run's token is not among the golden candidates
    outside[0].tokens[2] = 15
    p = compare(golden, outside).prompts[0]
    assert p.status == "mismatch" and "outside the other run's top-4" in p.note


def forced_steps(golden: dict, shift: dict | None = None, argmax: dict | None = None) -> list:
    """What teacher forcing observes if this run reproduces the golden log-probs, plus shift[(prompt, step)]
    on its first candidate and argmax[(prompt, step)] as its own choice."""
    shift, argmax = shift or {}, argmax or {}
    return [[([lp + (shift.get((i, t), 0.0) if k == 0 else 0.0) for k, (_, lp) in enumerate(s["top"])],
              argmax.get((i, t), p["tokens"][t])) for t, s in enumerate(p["steps"])]
            for i, p in enumerate(golden["prompts"])]


def test_teacher_forced_passes_within_the_tolerance_and_reports_the_largest_difference(golden):
    report = compare(golden, make_results(), 1e-3, forced_steps(golden, {(1, 4): 4e-4}))
    assert report.ok and report.teacher_forced
    p = report.prompts[1]
    assert p.status == "match" and p.max_logprob_diff == pytest.approx(4e-4) and p.max_logprob_diff_step == 4
    assert p.greedy_differs is False


def test_teacher_forced_fails_at_the_step_moved_by_0_3(golden):
    report = compare(golden, make_results(), 1e-3, forced_steps(golden, {(0, 3): 0.3}))
    assert not report.ok and report.exit_code == 1
    p = report.prompts[0]
    assert (p.status, p.step, p.matched) == ("mismatch", 3, 3)
    assert p.max_logprob_diff == pytest.approx(0.3) and p.max_logprob_diff_step == 3
    assert [q.status for q in report.prompts[1:]] == ["match", "match"]


def test_teacher_forced_near_tie_flip_passes_and_says_so(golden):
    """At prompt a's step 2 (golden margin 0.004) this run would pick 10, its log-probs 2e-4 away: a pass whose
    report names the flip and its size."""
    report = compare(golden, make_results(), 1e-3, forced_steps(golden, {(0, 2): 2e-4}, {(0, 2): 10}))
    p = report.prompts[0]
    assert report.ok and p.status == "match" and p.greedy_differs is True and p.max_logprob_diff_step == 2
    assert "greedy would differ at step 2 (golden margin 0.004)" in p.note
    assert report_to_json(report)["prompts"][0]["max_logprob_diff"] == pytest.approx(2e-4)


def test_non_finite_is_its_own_status(golden):
    results = make_results()
    results[1].tokens = results[1].tokens[:2]
    results[1].nonfinite = "prompt 1: the logits of step 2 (decode step 2) hold NaN; layer 1 attn:csa ..."
    report = compare(golden, results)
    assert [p.status for p in report.prompts] == ["match", "non-finite", "match"]
    assert report.exit_code == 3 and not report.ok and report.prompts[1].step == 2


def test_length_differences_are_mismatches(golden):
    short = make_results()
    short[2] = result([0, 13, 14], [3, 3, 3, 3], [2.0] * 4)
    p = compare(golden, short).prompts[2]
    assert (p.status, p.matched, p.step, p.expected, p.got) == ("mismatch", 4, 4, 3, END)

    g = copy.deepcopy(golden)
    g["prompts"][2]["tokens"] = g["prompts"][2]["tokens"][:5]
    g["prompts"][2]["steps"] = g["prompts"][2]["steps"][:5]
    p = compare(g, make_results()).prompts[2]
    assert (p.status, p.matched, p.total, p.step, p.expected, p.got) == ("mismatch", 5, 5, 5, END, 3)


def test_prompt_ids_differ(golden):
    results = make_results()
    results[0].prompt_ids = [0, 3, 6]
    p = compare(golden, results).prompts[0]
    assert p.status == "mismatch" and "prompt ids" in p.note


def test_result_count(golden):
    with pytest.raises(GoldenError, match="3 prompts but 2 results"):
        compare(golden, make_results()[:2])


def test_render_report(golden):
    results = make_results()
    results[1].tokens[3] = 9
    results[0].tokens[2:] = [10, 1, 1, 1]
    console = Console(record=True, width=140, color_system=None)
    render_report(compare(golden, results), console, decode=lambda ids: "".join(f"<t{i}>" for i in ids))
    out = console.export_text()
    assert "MISMATCH" in out and "near-tie" in out and "match" in out
    assert "3/6" in out and "'<t4>'" in out and "'<t9>'" in out
    assert "FAILED" in out and "1 mismatch" in out and "free-running" in out
    console = Console(record=True, width=140, color_system=None)
    render_report(compare(golden, make_results()), console)
    assert "OK: 3 prompts, 3 match" in console.export_text()


def test_tied_top_is_reordered_to_the_chosen_token():
    res = GenerationResult(prompt_ids=[0], tokens=[5], top_logprobs=[[(4, -0.5), (5, -0.5), (6, -2.0)]],
                           margins=[0.0])
    g = golden_from_results(MODEL, SETTINGS, [Prompt("t", "x", None)], [res])
    assert g["prompts"][0]["steps"][0]["top"][0] == [5, -0.5]


def test_inconsistent_results_refused():
    res = GenerationResult(prompt_ids=[0], tokens=[5, 6], top_logprobs=[[(5, -0.1)]], margins=[1.0])
    with pytest.raises(GoldenError, match="2 tokens but 1 top-k lists"):
        golden_from_results(MODEL, SETTINGS, [Prompt("t", "x", None)], [res])
    res = GenerationResult(prompt_ids=[0], tokens=[5], top_logprobs=[[(4, -0.1)]], margins=[1.0])
    with pytest.raises(GoldenError, match=r"prompts\[0\]\.steps\[0\]\.top\[0\]\[0\]"):
        golden_from_results(MODEL, SETTINGS, [Prompt("t", "x", None)], [res])
    res = GenerationResult(prompt_ids=[0], tokens=[5], top_logprobs=[[(5, float("nan"))]], margins=[1.0])
    with pytest.raises(GoldenError, match=r"top\[0\]\[1\]: expected a finite number"):
        golden_from_results(MODEL, SETTINGS, [Prompt("t", "x", None)], [res])


# ----------------------------------------------------------------------------------------- schema errors


def _set(doc, path, value):
    *head, last = path
    for k in head:
        doc = doc[k]
    if value is _DELETE:
        del doc[last]
    else:
        doc[last] = value


_DELETE = object()

SCHEMA_CASES = [
    (("format",), "other", "format: expected 'mhcrun-golden'"),
    (("version",), 2, "version: version 2 is not supported"),
    (("model",), _DELETE, "top level: missing key 'model'"),
    (("model",), [1], "model: expected an object"),
    (("model", "config_hash"), 5, "model.config_hash: expected a string"),
    (("model", "weights_hash"), _DELETE, "model: missing key 'weights_hash'"),
    (("settings", "dtype"), "fp16", "settings.dtype: expected one of fp32, bf16"),
    (("settings", "quant_sim"), 1, "settings.quant_sim: expected true or false"),
    (("settings", "graph_mode"), None, "settings.graph_mode: expected a string"),
    (("settings", "max_new_tokens"), 0, "settings.max_new_tokens: expected an integer >= 1"),
    (("settings", "max_new_tokens"), 3, "prompts[0].tokens: 6 tokens but settings.max_new_tokens is 3"),
    (("settings", "top_k"), 2.0, "settings.top_k: expected an integer"),
    (("settings", "top_k"), 2, "prompts[0].steps[0].top: expected 1 to 2 (settings.top_k) entries, got 4"),
    (("settings", "ignore_eos"), "yes", "settings.ignore_eos: expected true or false"),
    (("tolerance",), "0.1", "tolerance: expected a number"),
    (("tolerance",), -1, "tolerance: expected a number >= 0.0"),
    (("prompts",), {}, "prompts: expected a list"),
    (("prompts",), [], "prompts: expected at least one prompt"),
    (("prompts", 1), "x", "prompts[1]: expected an object"),
    (("prompts", 1, "id"), "a", "prompts[1].id: duplicate id 'a'"),
    (("prompts", 1, "id"), 7, "prompts[1].id: expected a string"),
    (("prompts", 1, "text"), 7, "prompts[1].text: expected a string"),
    (("prompts", 1, "text"), _DELETE, "prompts[1]: missing key 'text'"),
    (("prompts", 1, "prompt_ids"), [], "prompts[1].prompt_ids: expected a non-empty list"),
    (("prompts", 1, "prompt_ids", 1), -4, "prompts[1].prompt_ids[1]: expected an integer >= 0, got -4"),
    (("prompts", 2, "tokens", 5), "x", "prompts[2].tokens[5]: expected an integer"),
    (("prompts", 2, "tokens", 5), 4,
     "prompts[2].steps[5].top[0][0]: top-1 token 3 differs from the generated token "
     "prompts[2].tokens[5] = 4"),
    (("prompts", 2, "steps", 5), _DELETE, "prompts[2].steps: 5 steps but 6 tokens"),
    (("prompts", 2, "steps", 1, "margin"), "big", "prompts[2].steps[1].margin: expected a number"),
    (("prompts", 2, "steps", 1, "margin"), -0.5, "prompts[2].steps[1].margin: expected a number >= 0.0"),
    (("prompts", 2, "steps", 1, "margin"), _DELETE, "prompts[2].steps[1]: missing key 'margin'"),
    (("prompts", 2, "steps", 1, "top"), [], "prompts[2].steps[1].top: expected 1 to 4"),
    (("prompts", 2, "steps", 1, "top", 2), [1],
     "prompts[2].steps[1].top[2]: expected a [token_id, logprob] pair"),
    (("prompts", 2, "steps", 1, "top", 2, 1), None, "prompts[2].steps[1].top[2][1]: expected a number"),
    (("prompts", 2, "steps", 1, "top", 2, 0), 3, "prompts[2].steps[1].top[2][0]: token 3 appears twice"),
]


@pytest.mark.parametrize("path, value, message", SCHEMA_CASES,
                         ids=[".".join(map(str, c[0])) for c in SCHEMA_CASES])
def test_schema_violations(tmp_path, golden, path, value, message):
    doc = copy.deepcopy(golden)
    _set(doc, path, value)
    f = tmp_path / "g.json"
    f.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(GoldenError) as e:
        load_golden(f)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{f}: ")
    assert message in msg


def test_file_level_errors(tmp_path):
    with pytest.raises(GoldenError, match="golden file not found"):
        load_golden(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": ')
    with pytest.raises(GoldenError, match=r"not valid JSON \(.* line 1 column"):
        load_golden(bad)
    nan = tmp_path / "nan.json"
    nan.write_text('{"tolerance": NaN}')
    with pytest.raises(GoldenError, match="NaN is not allowed"):
        load_golden(nan)
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(GoldenError, match="top level: expected an object"):
        load_golden(arr)


# ----------------------------------------------------------------------------------------- identity, writing


def test_model_identity(golden):
    assert check_model_identity(golden, dict(MODEL), force=False) == []
    renamed = {**MODEL, "name": "tiny-copy"}
    (warning,) = check_model_identity(golden, renamed, force=False)
    assert "tiny-copy" in warning

    other_cfg = {**MODEL, "config_hash": "1111111111111111"}
    with pytest.raises(GoldenError, match=r"recorded for another model \(config c0ffee0000000001 vs 1111"):
        check_model_identity(golden, other_cfg, force=False)
    warnings = check_model_identity(golden, other_cfg, force=True)
    assert len(warnings) == 1 and "config" in warnings[0]

    other_w = {**MODEL, "weights_hash": "2222222222222222"}
    with pytest.raises(GoldenError, match=r"another model \(weights beef000000000002 vs 2222"):
        check_model_identity(golden, other_w, force=False)
    assert len(check_model_identity(golden, {**other_cfg, "weights_hash": "2"}, force=True)) == 2


def test_a_golden_that_does_not_fit_the_model_is_refused(golden):
    check_fits_model(golden, VOCAB, 64)
    with pytest.raises(GoldenError, match=r"prompt 'a': token 12 is outside this model's vocabulary \[0, 12\)"):
        check_fits_model(golden, 12, 64)  # prompt a's ids are below 12, its sixth token is 12
    other = copy.deepcopy(golden)
    other["prompts"][1]["prompt_ids"] = [0, 99, 9]
    with pytest.raises(GoldenError, match=r"prompt 'b': prompt id 99 is outside this model's vocabulary \[0, 16\)"):
        check_fits_model(other, VOCAB, 64)
    with pytest.raises(GoldenError, match=r"prompt 'a': 3 prompt tokens \+ 6 golden tokens exceed this model's "
                                          r"context of 8"):
        check_fits_model(golden, VOCAB, 8)


def test_write_refuses_existing_file(tmp_path, golden):
    path = tmp_path / "g.json"
    path.write_text("keep me")
    with pytest.raises(InputError, match="already exists"):
        write_golden(path, golden, force=False)
    assert path.read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["g.json"]  # no temp file left behind
    write_golden(path, golden, force=True)
    assert load_golden(path) == golden


def test_write_refuses_invalid_document(tmp_path, golden):
    golden["prompts"][0]["steps"][0]["margin"] = float("inf")
    with pytest.raises(GoldenError, match=r"prompts\[0\]\.steps\[0\]\.margin: expected a finite number"):
        write_golden(tmp_path / "g.json", golden, force=False)
    assert not (tmp_path / "g.json").exists()
