"""The compatibility matrix on a torch release that tests/expected.py has not measured (2.16 and later).

Standard library and pytest only (no torch, nothing installed or downloaded): the runner's argument
parsing, the per-release expectations, the registry verdict and the report, fed with a recorded
registry probe of torch "2.16.0" (``data/registry_probe_2.16.0.json``: ``scripts/matrix.py``'s
``REGISTRY_PROBE`` run on the 2.13 wheel with ``torch.__version__`` set to "2.16.0" before the FSDP2
import, so every reason says "outside the measured releases") and with pip's recorded words for
``torch==2.16.*`` before that release exists.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

import _matrix_report as report  # noqa: E402
import _matrix_verdict as verdict  # noqa: E402
import expected as ex  # noqa: E402
import matrix  # noqa: E402

PROBE_2_16 = json.loads((Path(__file__).parent / "data" / "registry_probe_2.16.0.json").read_text())
# pip 24 on this machine, `pip install torch==2.16.*` before 2.16 is on PyPI (from versions: shortened)
PIP_NO_2_16 = """\
$ /tmp/fsdp-matrix-x/venv-2.16/bin/python -m pip install -q torch==2.16.* fsdp_autopatch-0.2.0-py3-none-any.whl
WARNING: Location 'file:///opt/pypi/simple/torch/' is ignored: it is neither a file nor a directory.
ERROR: Could not find a version that satisfies the requirement torch==2.16.* (from versions: 1.13.0, 2.14.1, 2.15.0)
ERROR: No matching distribution found for torch==2.16.*
"""
LATER = [(2, 16), (2, 17), (2, 30), (3, 0)]
META = {"date": "2026-12-22", "machine": "x86_64 Linux, 2 CPUs, no GPU", "plugin": "0.2.0", "commit": "abc1234",
        "python": "3.11.7", "wall_minutes": 5.0, "max_venv_mb": 900}


def _recorded_later(name: str) -> dict:
    """A record for a patch added after the probe was recorded: what its structural check gives on
    the 2.13 wheel (every entry applies there, tests/expected.py), worded as the recording words it."""
    return {
        "name": name, "status": "applied", "decided_by": "structural check", "variable": None, "value": None,
        "reason": "torch 2.16.0: (added after this recording) (outside the measured releases >=2.6, <2.16) -> patched",
        "env": f"FSDP_AUTOPATCH_{name.upper()}_ENABLED", "fired": 0, "provider": None,
    }


def probe(torch_version: str = "2.16.0", **statuses: str) -> dict:
    data = copy.deepcopy(PROBE_2_16)
    recorded = {record["name"] for record in data["report"]["patches"]}
    data["report"]["patches"] += [_recorded_later(name) for name in ex.PATCHES if name not in recorded]
    data["torch"] = data["report"]["torch"] = torch_version
    for record in data["report"]["patches"]:
        record["status"] = statuses.get(record["name"], record["status"])
    return data


def result_of(data: dict, tests: dict | None = None, release: str = "2.16") -> dict:
    """One release's result as matrix.test_release builds it, from a probe record."""
    result = {"release": release, "mode": "full", "python": "3.11.7",
              "install": {"ok": True, "seconds": 60, "venv_mb": 900},
              "first_measurement": verdict.is_first_measurement(release),
              "registry": {"seconds": 9, **verdict.judge_registry(data)}}
    if tests is not None:
        result["tests"] = tests
    result["ok"] = verdict.release_ok(result)
    return result


def passing_tests(bugs: dict | None = None) -> dict:
    return {"exit": 0, "seconds": 200, "passed": 470, "failed": 0, "skipped": 3, "failures": [], "bugs": bugs or {}}


# --- tests/expected.py --------------------------------------------------------------------------


@pytest.mark.parametrize("release", LATER + [(2, 5)])
def test_an_unmeasured_release_has_no_invented_expectation(release):
    assert not ex.is_measured(release)
    assert ex.expected_status(release) == dict.fromkeys(ex.PATCHES, ex.NOT_MEASURED)
    assert ex.unpatched_outcome(release) == dict.fromkeys(ex.BUG_OF.values(), ex.NOT_MEASURED)
    assert ex.NOT_MEASURED == "not measured: the structural check decides"


@pytest.mark.parametrize("release", ex.MEASURED)
def test_a_measured_release_keeps_its_measured_expectations(release):
    assert ex.is_measured(release)
    statuses = ex.expected_status(release)
    assert ex.NOT_MEASURED not in statuses.values()
    # an outcome is left unjudged only where its patch is unsupported there (it claims nothing)
    unjudged = {bug for bug, outcome in ex.unpatched_outcome(release).items() if outcome == ex.NOT_MEASURED}
    assert all(statuses[name] == "unsupported" for name, bug in ex.BUG_OF.items() if bug in unjudged)


def test_the_measured_releases_are_the_plugins():
    """tests/expected.py knows exactly the releases _compat.MEASURED_RELEASES calls measured."""
    compat = pytest.importorskip("fsdp_autopatch._compat")  # packaging; no torch
    known = {f"{major}.{minor}.0" for major, minor in ex.MEASURED}
    assert {f"2.{minor}.0" for minor in range(0, 40) if f"2.{minor}.0" in compat.MEASURED_RELEASES} == known


@pytest.mark.parametrize("release", [r for r in ex.MEASURED if r >= ex.OLDEST_RUNNABLE])
def test_on_every_runnable_measured_release_a_status_claims_the_measured_outcome(release):
    """What lets the tests check a first measurement: "applied" has always meant the bug
    reproduces without the patch, "not_needed" that torch is right without it (2.8 - 2.15)."""
    status, outcome = ex.claimed_by(ex.expected_status(release))
    assert status == ex.expected_status(release)
    assert outcome == ex.unpatched_outcome(release)


def test_claimed_by_on_a_first_measurement():
    statuses = {p["name"]: p["status"] for p in PROBE_2_16["report"]["patches"]}
    statuses.update(post_forward_mesh_cache="unsupported", keep_param_attributes="failed")
    del statuses["clip_grad_norm_multi_mesh"]
    status, outcome = ex.claimed_by(statuses)
    assert status["accumulated_grad_guard"] == "applied" and outcome["a"] == ex.REPRODUCES
    assert status["unused_param_reduction"] == "not_needed" and outcome["b"] == ex.FIXED
    assert status["post_forward_mesh_cache"] == "unsupported" and outcome["e"] == ex.NOT_MEASURED
    assert status["keep_param_attributes"] == ex.NOT_MEASURED and outcome["g"] == ex.NOT_MEASURED
    assert status["clip_grad_norm_multi_mesh"] == ex.NOT_MEASURED and outcome["h"] == ex.NOT_MEASURED


def test_agreement_with_not_measured():
    assert all(ex.status_agrees(ex.NOT_MEASURED, s) for s in ("applied", "not_needed", "unsupported", "disabled"))
    assert not any(ex.status_agrees(ex.NOT_MEASURED, s) for s in ("failed", "pending", None))
    assert ex.status_agrees("applied", "applied") and not ex.status_agrees("applied", "not_needed")
    assert ex.outcome_agrees(ex.NOT_MEASURED, "reproduces: anything")
    assert ex.outcome_agrees(ex.REPRODUCES, "reproduces: x") and not ex.outcome_agrees(ex.FIXED, "reproduces: x")


# --- the runner's arguments ---------------------------------------------------------------------


def test_the_default_releases_are_the_measured_ones():
    assert matrix.parse_args([]).releases == [f"2.{minor}" for minor in range(6, 16)]


@pytest.mark.parametrize("given", [["2.16"], ["2.16", "2.17"], ["2.15", "2.16.0"], ["2.30"]])
def test_any_later_release_is_accepted(given):
    args = matrix.parse_args(["--releases", *given])
    assert args.releases == given
    assert all(verdict.is_first_measurement(r) for r in given if r != "2.15")
    assert verdict.requirement("2.16") == "torch==2.16.*" and verdict.requirement("2.16.0") == "torch==2.16.0"


@pytest.mark.parametrize("bad", ["2,16", "216", "2.16.*", "latest"])
def test_a_malformed_release_is_refused_by_argparse(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        matrix.parse_args(["--releases", bad])
    assert exit_info.value.code == 2
    assert "is not a torch release such as 2.15 or 2.16" in capsys.readouterr().err


# --- a release that does not install (2.16 before it is on PyPI) ---------------------------------


def test_pips_words_for_an_absent_release():
    assert verdict.install_error(PIP_NO_2_16) == (
        "No matching distribution found for torch==2.16.*; newest on the index: 2.15.0"
    )
    assert verdict.install_error("$ python -m venv x\nError: [Errno 28] No space left\n") == (
        "Error: [Errno 28] No space left"
    )


def test_a_failed_install_is_reported_and_fails_the_run(tmp_path, monkeypatch, capsys):
    """The whole runner, with venv creation and pip replaced by a recorded failure: exit 1, pip's
    words in the log and the report, docs untouched, no traceback."""
    def install(release, venv, wheel, logs, python):
        (logs / f"{release}-install.log").write_text(PIP_NO_2_16)
        return {"ok": False, "seconds": 1, "venv_mb": 0}

    def update_docs(*_, **__):
        raise AssertionError("docs/compatibility.md must not get a row that measured nothing")

    wheel = tmp_path / "fsdp_autopatch-0.2.0-py3-none-any.whl"
    monkeypatch.setattr(matrix, "install", install)
    monkeypatch.setattr(matrix, "build_wheel", lambda dest, log_file: wheel)
    monkeypatch.setattr(matrix, "update_docs", update_docs)
    monkeypatch.setattr(matrix, "python_version", lambda python: "3.11.7")
    out = tmp_path / "out"
    code = matrix.main(["--releases", "2.16", "--out", str(out), "--workdir", str(tmp_path / "work"), "--update-docs"])
    assert code == 1
    printed = capsys.readouterr().out
    assert "2.16: FAILED: torch==2.16.* did not install: No matching distribution found for torch==2.16.*" in printed
    assert "docs/compatibility.md left as it is: torch 2.16 did not install" in printed
    table = (out / "matrix.md").read_text()
    assert "| 2.16 (install failed) |" in table and "not run (install failed)" in table
    assert "**Problem on torch 2.16**" in table and "Releases that do NOT pass: 2.16" in table
    (result,) = json.loads((out / "matrix.json").read_text())["results"]
    assert result["ok"] is False and result["first_measurement"] is True
    assert "| 2.16 | install failed | — |" in (out / "python.md").read_text()


# --- the registry verdict -----------------------------------------------------------------------


def test_the_recorded_2_16_probe_is_a_first_measurement_without_a_problem():
    judged = verdict.judge_registry(probe())
    assert judged["first_measurement"] and judged["ok"], judged
    assert judged["expected"] == dict.fromkeys(ex.PATCHES, ex.NOT_MEASURED)
    assert judged["mismatches"] == {} and judged["problems"] == []
    assert judged["patches"]["accumulated_grad_guard"]["decided_by"] == "structural check"
    assert "outside the measured releases" in judged["patches"]["accumulated_grad_guard"]["reason"]


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"keep_param_attributes": "failed"}, "keep_param_attributes: failed"),
        ({"uniform_reduce_dtype": "pending"}, "uniform_reduce_dtype: pending"),
    ],
)
def test_what_is_always_wrong_fails_a_first_measurement(change, problem):
    judged = verdict.judge_registry(probe(**change))
    assert not judged["ok"] and judged["mismatches"] == {}
    assert any(p.startswith(problem) for p in judged["problems"]), judged["problems"]


def test_a_missing_patch_or_a_bootstrap_other_than_pth_fails_too():
    data = probe()
    data["report"]["patches"] = [p for p in data["report"]["patches"] if p["name"] != "grouped_module_reuse"]
    data["report"]["bootstrap"] = "not_run"
    problems = verdict.judge_registry(data)["problems"]
    assert "grouped_module_reuse: missing from the registry" in problems
    assert any(p.startswith("bootstrap 'not_run'") for p in problems)


def test_unsupported_is_no_problem_but_is_named():
    judged = verdict.judge_registry(probe(post_forward_mesh_cache="unsupported"))
    assert judged["ok"] and judged["unsupported"] == ["post_forward_mesh_cache"]


def test_a_measured_release_is_still_compared_with_its_expectations():
    # the recorded probe ran on the 2.13 wheel: as 2.13 it matches, as 2.15 it does not
    assert verdict.judge_registry(probe("2.13.0+cpu"))["ok"]
    judged = verdict.judge_registry(probe("2.15.0"))
    assert not judged["ok"] and not judged["first_measurement"]
    assert judged["mismatches"]["accumulated_grad_guard"] == {"expected": "not_needed", "got": "applied"}


def test_the_probe_json_is_its_last_line():
    text = "torch warns about something\n" + json.dumps(PROBE_2_16) + "\n\n"
    assert verdict.parse_probe(text)["torch"] == "2.16.0"
    for bad in ("", "not json\n", '{"other": 1}\n'):
        with pytest.raises(ValueError):
            verdict.parse_probe(bad)


# --- the report ---------------------------------------------------------------------------------


def test_the_report_marks_the_first_measurement_and_judges_nothing_against_a_guess():
    bugs = {
        "a": {"off": ["reproduces: AttributeError '_unsharded_param' on every rank"], "on": ["correct"],
              "expected_off": ex.NOT_MEASURED},
        "d": {"off": ["reproduces: zero grad"], "on": ["correct"], "expected_off": ex.REPRODUCES},  # claimed
    }
    result = result_of(probe(), passing_tests(bugs))
    assert result["ok"]
    table = report.markdown([result], META)
    row = next(line for line in table.splitlines() if line.startswith("| 2.16.0"))
    assert row.startswith("| 2.16.0 (first measurement) | 3.11.7 | full | applied | not needed | applied |")
    assert "expected" not in row and "**" not in row and "470 / 0 / 3" in row
    assert "off: reproduces: AttributeError '_unsharded_param' on every rank<br>on: correct" in table  # no ✓ / ✗
    assert "off: reproduces: zero grad ✓<br>" in table  # what the patch's own status claimed
    assert "torch 2.16.0: first measurement. tests/expected.py has no expectations" in table
    assert "(on a first measurement: as the patch's own status claims)" in table
    assert "All releases match" not in table and "NOT pass" not in table
    assert "| 3.11.7 | 2.16.0 | first measurement | 470 / 0 / 3 |" in report.python_markdown([result])
    assert "first measurement" in verdict.summary(result) and "no problem" in verdict.summary(result)


def test_the_report_fails_a_first_measurement_on_a_failed_patch_or_test():
    failing = {**passing_tests(), "exit": 1, "failed": 1, "failures": ["tests/distributed/test_x.py::test_y: boom"]}
    result = result_of(probe(keep_param_attributes="failed"), failing)
    assert not result["ok"]
    table = report.markdown([result], META)
    assert "| **FAILED** |" in table
    assert "**Problem on torch 2.16.0** (not in tests/expected.py): keep_param_attributes: failed" in table
    assert "test failed: tests/distributed/test_x.py::test_y: boom" in table
    assert "Releases that do NOT pass: 2.16" in table
    assert "**first measurement: problem**" in report.python_markdown([result])
    assert "PROBLEM" in verdict.summary(result)


def test_a_test_failure_alone_fails_a_first_measurement():
    failing = {**passing_tests(), "exit": 1, "failed": 2, "failures": ["a", "b"]}
    assert not result_of(probe(), failing)["ok"]
    assert result_of(probe(), passing_tests())["ok"]


def test_merging_a_first_measurement_with_the_committed_matrix(tmp_path):
    """--report-only: 2.16 sorts after 2.15, the measured rows keep their verdicts."""
    first = tmp_path / "m216.json"
    first.write_text(json.dumps({"meta": META, "results": [result_of(probe(), passing_tests())]}))
    code = report.report_only([ROOT / "docs" / "compatibility-matrix.json", first], tmp_path / "out", False)
    assert code == 0
    rows = [line for line in (tmp_path / "out" / "matrix.md").read_text().splitlines() if line.startswith("| 2.")]
    assert rows[9].startswith("| 2.15.0+cu132 | 3.11.7 | full |") and "(first measurement)" not in rows[9]
    assert rows[10].startswith("| 2.16.0 (first measurement) |")


def test_docs_refuse_only_rows_that_did_not_install():
    installed = result_of(probe(), passing_tests())
    failed = {"release": "2.16", "install": {"ok": False}, "ok": False}
    assert report.docs_refusal([installed]) is None
    assert report.docs_refusal([installed, failed]) == "torch 2.16 did not install (no row measured)"


def test_the_measured_rows_still_render_as_committed(tmp_path):
    """The first-measurement changes leave the report of measured releases as it was: the committed
    run gives, byte for byte, the table in docs/compatibility.md."""
    assert report.report_only([ROOT / "docs" / "compatibility-matrix.json"], tmp_path, False) == 0
    doc = (ROOT / "docs" / "compatibility.md").read_text()
    committed = doc.split(report.BEGIN + "\n", 1)[1].split(report.END, 1)[0]
    assert (tmp_path / "matrix.md").read_text() == committed


def test_updating_the_docs_writes_the_table_and_the_json_it_renders_from(tmp_path, monkeypatch):
    """``--update-docs`` rewrites the table and docs/compatibility-matrix.json together: the table
    once went in without its JSON, and the test above failed on every interpreter in CI."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "compatibility.md").write_text(f"head\n{report.BEGIN}\nold table\n{report.END}\ntail\n")
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "MATRIX_JSON", docs / "compatibility-matrix.json")
    later = tmp_path / "later.json"
    later.write_text(json.dumps({"meta": META, "results": [result_of(probe(), passing_tests())]}))
    report.report_only([ROOT / "docs" / "compatibility-matrix.json", later], tmp_path / "out", True)
    assert json.loads((docs / "compatibility-matrix.json").read_text()) == json.loads(
        (tmp_path / "out" / "matrix.json").read_text())
    assert report.report_only([docs / "compatibility-matrix.json"], tmp_path / "again", False) == 0
    doc = (docs / "compatibility.md").read_text()
    assert doc.startswith("head\n") and doc.endswith("tail\n")
    table = doc.split(report.BEGIN + "\n", 1)[1].split(report.END, 1)[0]
    assert table == (tmp_path / "again" / "matrix.md").read_text()
