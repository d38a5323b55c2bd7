"""``fsdp-autopatch status``: one line per patch within 100 columns, ``-v`` the whole detail, ``NAME``.

The real registry (FSDP2 imported in this process, torch 2.13: every patch decided) and a report
with another distribution's long-named patch. Fast: FSDP2 is imported once for the module.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from fsdp_autopatch import _catalogue, _cli
from fsdp_autopatch._columns import WIDTH, shorten, table
from fsdp_autopatch._registry import PatchRecord, PatchStatus, PolicyRecord, StatusReport

LONG_NAME = "acme_training_framework_keep_expert_parallel_tags_on_reshard"  # 60 characters
TOGGLE = "FSDP_AUTOPATCH_COMPILED_AUTOGRAD_GUARD_ENABLED"
LONG_REASON = "torch 2.13.0: " + "a long reason with many words in it; " * 12


def _report(*extra: PatchRecord) -> StatusReport:
    patches = (
        PatchRecord("accumulated_grad_guard", PatchStatus.APPLIED, "torch 2.13.0: reads it; the version range agrees",
                    "FSDP_AUTOPATCH_ACCUMULATED_GRAD_GUARD_ENABLED", "version range and structural check"),
        PatchRecord("compiled_autograd_guard", PatchStatus.DISABLED, f"disabled by {TOGGLE}=0", TOGGLE,
                    variable=TOGGLE, value="0", fired=3),
        *extra,
    )
    policy = PolicyRecord("cross_rank_check", PatchStatus.APPLIED, "once per process group at the root's first forward")
    return StatusReport("0.2.0", "2.13.0+cpu", "pth", patches, {policy.name: policy.description}, (policy,))


THIRD_PARTY = PatchRecord(LONG_NAME, PatchStatus.FAILED, LONG_REASON, f"FSDP_AUTOPATCH_{LONG_NAME.upper()}_ENABLED",
                          provider="acme-training-framework 1.4.0")


def _width(text: str) -> int:
    return max(len(line) for line in text.splitlines())


def _too_wide(text: str, columns: int) -> list[str]:
    """The lines wider than ``columns``, except a line that is one word after its indent: a path
    or a module name is never split, so a long one (a venv deep in a CI checkout) stays whole."""
    return [line for line in text.splitlines() if len(line) > columns and len(line.split()) > 1]


@pytest.fixture(scope="module")
def real_output():
    """``status``, ``status -v`` and ``status uniform_reduce_dtype`` on the real registry."""
    import contextlib
    import io

    outputs = {}
    for argv in (["status"], ["status", "-v"], ["status", "uniform_reduce_dtype"], ["status", "--json"]):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            code = _cli.main(argv)
        outputs[argv[-1]] = (code, buffer.getvalue())
    return outputs


def test_default_status_fits_100_columns_with_the_real_registry(real_output):
    code, text = real_output["status"]
    report = json.loads(real_output["--json"][1])
    assert code == 0 and report["torch"]  # any torch: the table's width does not depend on it
    assert _width(text) <= WIDTH, text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line and line.split()[0] in
            {p["name"] for p in report["patches"]}}
    assert list(rows) == [p["name"] for p in report["patches"]]  # one line each, every name whole
    for patch in report["patches"]:
        name, kind, status, fired = rows[patch["name"]][:4]
        assert (kind, status, fired) == (_catalogue.BY_NAME[name].kind, patch["status"], str(patch["fired"]))
    assert "policy cross_rank_check: " in text and "status -v" in text and "toggle: " not in text


def test_verbose_status_is_the_whole_detail(real_output):
    code, text = real_output["-v"]
    report = _cli.REGISTRY.snapshot()
    assert code == 0 and text == _cli.format_table(report) + "\n"
    flowed = " ".join(text.split())  # wrapped at the terminal's width: every word of it, in order
    for record in report.patches:
        assert " ".join(record.reason.split()) in flowed and f"toggle: {record.env}=0|1" in flowed


def test_one_entry_shows_its_whole_reason(real_output):
    code, text = real_output["uniform_reduce_dtype"]
    record = _cli.REGISTRY.snapshot()["uniform_reduce_dtype"]
    assert code == 0 and _width(text) <= WIDTH, text
    lines = text.splitlines()
    assert lines[2] == f"uniform_reduce_dtype: fix, {record.status.value}, fired {record.fired} times"
    why = " ".join(line.strip() for line in lines[3:] if not line.lstrip().startswith(("decided by:", "toggle:")))
    assert why == f"why: {record.reason}"
    assert f"  toggle: {record.env}=0|1" in lines


def test_unknown_name_is_a_usage_error_with_a_suggestion(capsys):
    with pytest.raises(SystemExit) as stopped:
        _cli.main(["status", "uniform_reduce_dtyp"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "usage: fsdp-autopatch status" in err
    assert "no fix, guard or policy named 'uniform_reduce_dtyp'; did you mean 'uniform_reduce_dtype'?" in err


def test_verbose_format_wraps_under_the_reason_column():
    """``-v`` on a wide terminal: the reason beside its row, continued under the REASON column."""
    assert _cli.format_table(_report(), width=120).splitlines() == [
        "fsdp-autopatch 0.2.0   torch 2.13.0+cpu   bootstrap: pth",
        "",
        "PATCH                    STATUS       FIRED  REASON",
        "accumulated_grad_guard   applied          0  torch 2.13.0: reads it; the version range agrees",
        "                                             toggle: FSDP_AUTOPATCH_ACCUMULATED_GRAD_GUARD_ENABLED=0|1",
        "compiled_autograd_guard  disabled         3  disabled by FSDP_AUTOPATCH_COMPILED_AUTOGRAD_GUARD_ENABLED=0",
        "                                             toggle: FSDP_AUTOPATCH_COMPILED_AUTOGRAD_GUARD_ENABLED=0|1",
        "policy cross_rank_check: once per process group at the root's first forward",
        # as in ``status``: the policies that are off, each with how to switch it on
        "policy reduce_scatter_unused_params_default_on: off "
        "(FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS=1 switches it on)",
        "policy pending_grads_warning: off (FSDP_AUTOPATCH_PENDING_GRADS_WARNING=1 switches it on)",
        "policy zero_grad_discards_pending_grads: off (FSDP_AUTOPATCH_ZERO_GRAD_DISCARDS_PENDING=1 switches it on)",
    ]


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_verbose_status_and_doctor_fit_the_terminal(monkeypatch, tmp_path, columns):
    """``status -v`` and ``doctor`` wrap at the terminal's width (``COLUMNS``, as ``shutil`` reads
    it), continuation lines indented, every word kept; ``--json`` is not wrapped."""
    from fsdp_autopatch import _doctor, _process

    monkeypatch.setenv("COLUMNS", str(columns))
    # site-packages as deep as a CI checkout's throwaway venv: its path, wider than 80 columns, stays whole
    site = tmp_path / "work/main/.artifacts/matrix-ci/venv-2.15/lib/python3.11/site-packages"
    site.mkdir(parents=True)
    (site / _doctor.PTH_NAME).write_text(_process.BOOTSTRAP, encoding="utf-8")
    monkeypatch.setattr(_doctor, "site_directories", lambda: [str(site)])
    report = _cli.REGISTRY.snapshot()
    verbose = _cli.format_table(report)
    findings = _doctor.diagnose()
    doctor = _doctor.format_findings(findings, protected=True)
    for text in (verbose, doctor, _cli.format_summary(report)):
        assert not _too_wide(text, columns), text
    for finding in findings:  # wrapping drops no word
        assert " ".join(finding.message.split()) in " ".join(doctor.split())
    for line in verbose.splitlines()[3:]:  # every continuation line starts with spaces
        assert line.startswith(" ") or line.split()[0] in {r.name for r in report.patches} or line.startswith(
            "policy ")
    assert "\n" not in json.dumps(report.to_dict())


def test_width_is_100_when_not_a_terminal(monkeypatch):
    from fsdp_autopatch._columns import terminal_width

    monkeypatch.delenv("COLUMNS", raising=False)
    assert terminal_width() == WIDTH  # pytest captures stdout: not a terminal
    monkeypatch.setenv("COLUMNS", "10")
    assert terminal_width() == 40  # too narrow to read: wrapped as if 40 wide


def test_doctor_with_the_kill_switch_gives_its_advice_once(monkeypatch):
    from fsdp_autopatch import _doctor

    monkeypatch.setattr(_doctor._process, "disabled_at_start", lambda: "0")
    stopped = [dataclasses.replace(r, status=PatchStatus.DISABLED, variable="FSDP_AUTOPATCH_ENABLED", value="0",
                          reason="disabled by FSDP_AUTOPATCH_ENABLED=0 at interpreter start (nothing armed)")
               for r in _report().patches]
    findings = [_doctor._bootstrap_ran()] + [_doctor._patch_finding(r) for r in stopped]
    assert len(findings) == 3 and findings[1].action == findings[2].action
    text = _doctor.format_findings(findings, protected=False, width=100)
    assert text.count("unset FSDP_AUTOPATCH_ENABLED") == 1, text
    assert "[warning] all 2 fixes and guards: disabled by FSDP_AUTOPATCH_ENABLED=0 at interpreter start" in text


def test_a_long_third_party_name_stays_whole_and_its_reason_goes_below():
    text = _cli.format_summary(_report(THIRD_PARTY))
    assert _width(text) <= WIDTH, text
    lines = text.splitlines()
    (row,) = [i for i, line in enumerate(lines) if line.startswith(LONG_NAME + " ")]
    assert lines[row].split() == [LONG_NAME, "fix", "failed", "0"]
    assert lines[row + 1] == "    a long reason with many words in it"  # below its row, up to its first "; "
    assert "third-party patches from: acme-training-framework 1.4.0 (1)" in text
    entry = _cli._entry_lines(THIRD_PARTY)
    assert max(map(len, entry)) <= WIDTH and "  from: acme-training-framework 1.4.0" in entry


def test_the_summary_columns_line_up():
    lines = _cli.format_summary(_report()).splitlines()
    header = lines[2]
    assert header.split() == ["PATCH", "KIND", "STATUS", "FIRED", "WHY"]
    assert lines[3].index("applied") == lines[4].index("disabled") == header.index("STATUS")
    assert lines[4].endswith("  by its own toggle, set to 0")


def test_shorten_and_table():
    assert shorten("one two three four", 11) == "one two..."
    assert shorten("x" * 30, 10) == "x" * 7 + "..."
    assert shorten("short", 10) == "short"
    assert table([("a", "1", "text"), ("long name", "22", "more text")], right=frozenset({1})) == [
        "a           1  text", "long name  22  more text"]


def test_a_policy_off_by_the_kill_switch_is_not_told_to_set_its_own_variable(monkeypatch):
    """Its own variable would change nothing: the footer and ``status NAME`` name the kill switch."""
    from fsdp_autopatch import _process

    report = _report()
    monkeypatch.setenv("FSDP_AUTOPATCH_ENABLED", "0")
    text = " ".join(_cli.format_summary(report, width=100).split())
    assert "policy pending_grads_warning: off (FSDP_AUTOPATCH_ENABLED=0: every patch and policy is off)" in text
    monkeypatch.setattr(_process, "disabled_at_start", lambda: "0")
    text = " ".join(_cli.format_summary(report, width=100).split())
    assert "policy pending_grads_warning: off (FSDP_AUTOPATCH_ENABLED=0 at interpreter start: nothing armed)" in text
    lines = _cli._policy_lines("cross_rank_check", None)
    assert "  why: FSDP_AUTOPATCH_ENABLED=0 at interpreter start: nothing armed" in lines


def test_the_footer_lists_the_policies_that_are_off_with_their_variable():
    """What can be switched on is named (opt-in policies have no record while off), and a policy's
    fired count shows in ``status``, ``status NAME`` and ``--json``."""
    report = dataclasses.replace(
        _report(), policy_records=(PolicyRecord("cross_rank_check", PatchStatus.APPLIED, "checks", fired=2),))
    text = _cli.format_summary(report, width=100)
    assert "policy cross_rank_check (fired 2 times): checks" in text
    for name in ("reduce_scatter_unused_params_default_on", "zero_grad_discards_pending_grads",
                 "pending_grads_warning"):
        variable = _catalogue.BY_NAME[name].toggle
        assert f"policy {name}: off ({variable}=1 switches it on)" in " ".join(text.split()), text
    assert "policy cross_rank_check: off" not in text
    assert report.to_dict()["policy_records"] == [
        {"name": "cross_rank_check", "status": "applied", "description": "checks", "fired": 2}]
    assert _cli._policy_lines("cross_rank_check", report.policy_records[0])[0] == (
        "cross_rank_check: policy, applied, fired 2 times")


def test_an_applied_entry_says_what_the_user_gets(real_output):
    """WHY of an applied entry is its summary, not the torch-internal reason (that is ``-v``'s)."""
    from fsdp_autopatch import patches

    lines = real_output["status"][1].splitlines()
    (row,) = [line for line in lines if line.startswith("restore_unused_param_grads ")]
    summary = patches.load_patch("restore_unused_param_grads").summary
    assert row.split("  ")[-1].rstrip(".") in summary and "_unused" not in row.split("applied")[1]


def test_pending_says_what_it_waits_for():
    """``dcp_optimizer_state_init`` waits for DCP's state_dict, not for FSDP2: status and doctor say so."""
    from fsdp_autopatch import _doctor, _registry

    reason = _registry._pending_reason("dcp_optimizer_state_init")
    record = PatchRecord("dcp_optimizer_state_init", PatchStatus.PENDING, reason, "X")
    text = _cli.format_summary(_report(record), width=100)
    assert "waits for checkpoint.state_dict to be imported" in text
    assert "torch.distributed.checkpoint.state_dict to be imported" in reason
    finding = _doctor._patch_finding(record)
    assert finding.level == _doctor.OK and "torch.distributed.checkpoint.state_dict" in finding.message
