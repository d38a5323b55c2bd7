"""The wheel in a fresh venv without torch: silent, a working CLI, the PEP 829 entry, uninstall."""

from __future__ import annotations

import json

import pytest

from _install_support import PATCH_NAMES, T_PY, Venv, describe, json_from, run

pytestmark = [pytest.mark.install, pytest.mark.timeout(900)]  # includes building the wheel


@pytest.mark.parametrize(
    "env",
    [{}, {"FSDP_AUTOPATCH_ACCUMULATED_GRAD_GUARD_ENABLED": "maybe", "FSDP_AUTOPATCH_FOO": "1"}],
    ids=["clean", "bad-values"],
)
def test_start_up_is_silent(plain_venv: Venv, env: dict) -> None:
    result = plain_venv.py("pass", env=env)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", ""), describe(result)


def test_bootstrap_runs_and_waits_for_torch(plain_venv: Venv) -> None:
    state = json_from(
        plain_venv.py(
            """
            import sys, json
            print(json.dumps({
                "bootstrap": "_fsdp_autopatch_bootstrap" in sys.modules,
                "package": "fsdp_autopatch" in sys.modules,
                "heavy": [m for m in ("wrapt", "packaging", "inspect", "importlib.metadata") if m in sys.modules],
            }))
            """
        )
    )
    assert state == {"bootstrap": True, "package": False, "heavy": []}


def test_status_json_without_torch(plain_venv: Venv) -> None:
    result = run([plain_venv.python, "-m", "fsdp_autopatch", "status", "--json"], timeout=T_PY)
    assert result.returncode == 0, describe(result)
    assert result.stderr == "", describe(result)
    report = json.loads(result.stdout)
    assert report["torch"] is None
    assert report["bootstrap"] == "pth"
    assert [p["name"] for p in report["patches"]] == list(PATCH_NAMES)
    for patch in report["patches"]:
        assert patch["status"] == "unsupported", patch
        assert "torch is not installed" in patch["reason"], patch


def test_console_script_without_torch(plain_venv: Venv) -> None:
    result = run([plain_venv.bin("fsdp-autopatch"), "status"], timeout=T_PY)
    assert result.returncode == 0, describe(result)
    assert "torch not installed" in result.stdout.splitlines()[0], result.stdout


def test_start_file_entry_point_works(plain_venv: Venv) -> None:
    """What Python 3.15+ does with ``fsdp_autopatch.start`` (PEP 829), done by hand under ``-S``."""
    start_file = plain_venv.site_packages / "fsdp_autopatch.start"
    (entry,) = [line.strip() for line in start_file.read_text().splitlines() if line.strip()]
    result = plain_venv.py(
        f"""
        import importlib, json, sys
        sys.path.append({str(plain_venv.site_packages)!r})
        module, _, function = {entry!r}.partition(":")
        getattr(importlib.import_module(module), function)()
        getattr(importlib.import_module(module), function)()  # 3.15 does not de-duplicate either
        import fsdp_autopatch as plugin   # the start file imports only the bootstrap
        triggers = [f for f in sys.meta_path if f is sys.modules[module]]  # the trigger: the module itself
        print(json.dumps([plugin.status().bootstrap, len(triggers)]))
        """,
        flags=("-S",),
    )
    assert json_from(result) == ["start", 1]
    assert result.stderr == "", describe(result)


def test_uninstall_leaves_no_file(_plain_venv: Venv, plain_venv: Venv) -> None:
    assert "fsdp_autopatch.pth" in plain_venv.fsdp_autopatch_files()
    _plain_venv.installed = False  # the next test that needs it gets it reinstalled
    plain_venv.pip("uninstall", "-y", "fsdp-autopatch")
    assert plain_venv.fsdp_autopatch_files() == []
    result = plain_venv.py("import sys; print([m for m in sys.modules if 'fsdp_autopatch' in m])")
    assert (result.returncode, result.stdout, result.stderr) == (0, "[]\n", ""), describe(result)
