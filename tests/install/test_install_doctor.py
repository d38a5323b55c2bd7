"""``fsdp-autopatch doctor`` against the real wheel: each cause named, exit status 1 when unprotected.

Covers the causes the docs promise: not installed in this interpreter, ``python -S``, the kill
switch, a malformed variable (named, still protected), an unsupported torch (no FSDP2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _install_support import PATCH_NAMES, T_PY, T_TORCH, Venv, base_python, clean_env, describe, run

pytestmark = [pytest.mark.install, pytest.mark.timeout(1800)]  # includes building the venvs


def doctor(python, *flags: str, env: dict | None = None, timeout: float = T_TORCH, cwd=None) -> tuple[int, dict]:
    command = [python, *flags, "-m", "fsdp_autopatch", "doctor", "--json"]
    result = run(command, env=clean_env(env), timeout=timeout, cwd=cwd)
    assert result.returncode in (0, 1), describe(result)
    # the findings carry everything: none of our warnings on stderr (torch may warn about numpy)
    assert "fsdp" not in result.stderr.lower() and "ConfigWarning" not in result.stderr, describe(result)
    return result.returncode, json.loads(result.stdout)


def by_check(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for finding in report["findings"]:
        out.setdefault(finding["check"], []).append(finding)
    return out


def problems(report: dict) -> list[dict]:
    return [f for f in report["findings"] if f["level"] == "problem"]


def test_healthy_install_is_protected(torch_venv: Venv) -> None:
    code, report = doctor(torch_venv.python)
    assert code == 0 and report["protected"] is True, report
    assert problems(report) == []
    checks = by_check(report)
    assert checks["startup file"][0]["level"] == "ok" and "fsdp_autopatch.pth" in checks["startup file"][0]["message"]
    assert "ran at interpreter start" in checks["bootstrap"][0]["message"]
    assert all(checks[name][0]["level"] == "ok" for name in PATCH_NAMES)


def test_text_output_ends_with_the_verdict(torch_venv: Venv) -> None:
    result = run([torch_venv.python, "-m", "fsdp_autopatch", "doctor"], timeout=T_TORCH)
    assert result.returncode == 0, describe(result)
    assert result.stdout.strip().splitlines()[-1] == "verdict: runs started like this one are protected"


def test_kill_switch(torch_venv: Venv) -> None:
    code, report = doctor(torch_venv.python, env={"FSDP_AUTOPATCH_ENABLED": "off"})
    assert code == 1 and not report["protected"]
    (problem,) = problems(report)
    assert problem["check"] == "bootstrap"
    assert "FSDP_AUTOPATCH_ENABLED=off at interpreter start" in problem["message"]
    assert problem["action"] == "unset FSDP_AUTOPATCH_ENABLED (or set it to 1)"


def test_python_minus_S(torch_venv: Venv) -> None:
    # -S removes site-packages from sys.path too: a real -S job puts it back by hand, so do we
    code, report = doctor(torch_venv.python, "-S", env={"PYTHONPATH": str(torch_venv.site_packages)})
    assert code == 1
    (problem,) = problems(report)
    assert problem["check"] == "bootstrap" and "python -S" in problem["message"]
    assert "fsdp_autopatch.install()" in problem["action"]
    assert "python -S does not run it" in by_check(report)["startup file"][0]["message"]
    # what the patches would do is still reported
    assert {by_check(report)[name][0]["level"] for name in PATCH_NAMES} == {"ok"}


def test_malformed_and_misspelled_variables_are_named_but_still_protected(torch_venv: Venv) -> None:
    env = {"FSDP_AUTOPATCH_STRICT": "maybe", "FSDP_AUTOPATCH_RESTORE_UNUSED_PARAMS_GRADS_ENABLED": "0"}
    code, report = doctor(torch_venv.python, env=env)
    assert code == 0, report  # safe defaults: every patch still on
    warnings = [f for f in by_check(report)["environment"] if f["level"] == "warning"]
    named = {w["action"] for w in warnings}
    assert named == {
        "fix or unset FSDP_AUTOPATCH_STRICT", "fix or unset FSDP_AUTOPATCH_RESTORE_UNUSED_PARAMS_GRADS_ENABLED"
    }
    assert any("FSDP_AUTOPATCH_RESTORE_UNUSED_PARAM_GRADS_ENABLED" in w["message"] for w in warnings)  # the suggestion


def test_cross_rank_check_off_is_a_warning_to_set_it_on_every_rank(torch_venv: Venv) -> None:
    # off on some ranks only, the checking ranks would blame the others as "never reported"
    code, report = doctor(torch_venv.python, env={"FSDP_AUTOPATCH_CROSS_RANK_CHECK": "0"})
    assert code == 0, report
    (warning,) = [f for f in by_check(report)["environment"] if f["level"] == "warning"]
    assert "not stopped at the first forward" in warning["message"]
    assert warning["action"] == "set FSDP_AUTOPATCH_CROSS_RANK_CHECK=0 on every rank of the job or on none"


def test_not_installed_in_this_interpreter(plain_venv: Venv) -> None:
    """The package importable (PYTHONPATH) from an interpreter whose site-packages lacks the .pth."""
    code, report = doctor(base_python(), env={"PYTHONPATH": str(plain_venv.site_packages)}, timeout=T_PY)
    assert code == 1
    checks = by_check(report)
    assert checks["startup file"][0]["level"] == "problem"
    assert "not installed in this interpreter" in checks["startup file"][0]["message"]
    assert checks["startup file"][0]["action"].endswith("-m pip install fsdp-autopatch")
    assert "another environment" in checks["bootstrap"][0]["message"]


def test_torch_without_fsdp2_is_unsupported(plain_venv: Venv, tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    (fake / "torch" / "distributed" / "fsdp").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text('__version__ = "2.5.1"\n')
    (fake / "torch" / "distributed" / "__init__.py").write_text("")
    (fake / "torch" / "distributed" / "fsdp" / "__init__.py").write_text("")
    code, report = doctor(plain_venv.python, env={"PYTHONPATH": str(fake)}, timeout=T_PY)
    assert code == 1
    (problem,) = problems(report)
    assert problem["check"] == "torch"
    assert "torch 2.5.1" in problem["message"] and "FSDP2 needs torch >= 2.6" in problem["message"]


def test_no_torch(plain_venv: Venv) -> None:
    code, report = doctor(plain_venv.python, timeout=T_PY)
    assert code == 1
    (problem,) = problems(report)
    assert problem["check"] == "torch" and "not installed" in problem["message"]
