"""``pip install -e`` (hatchling's editable wheel) of a copy of the repository, in a fresh venv."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _install_support import (
    DEFAULT_STATUSES,
    T_PY,
    T_TORCH,
    TORCH_VERSION,
    Venv,
    assert_torch_matches_registry,
    describe,
    json_from,
    probe_code,
    run,
    statuses,
)

pytestmark = [pytest.mark.install, pytest.mark.timeout(1800)]


def test_editable_install_puts_the_start_up_files_into_site_packages(
    editable_venv: Venv, editable_source: Path
) -> None:
    site = editable_venv.site_packages
    assert (site / "fsdp_autopatch.pth").read_text() == (editable_source / "src" / "fsdp_autopatch.pth").read_text()
    assert (site / "fsdp_autopatch.start").is_file()
    assert not (site / "fsdp_autopatch").exists(), "an editable install must not copy the package"
    assert not (site / "_fsdp_autopatch_bootstrap.py").exists(), "nor the bootstrap: edits would not take effect"
    # The .pth that puts src/ on sys.path must be processed before ours (site sorts by name).
    path_files = [
        p.name
        for p in site.glob("*.pth")
        if str(editable_source / "src") in p.read_text() and p.name != "fsdp_autopatch.pth"
    ]
    assert path_files, sorted(p.name for p in site.glob("*.pth"))
    assert all(name < "fsdp_autopatch.pth" for name in path_files), path_files


def test_editable_start_up_runs_the_bootstrap_from_the_checkout(editable_venv: Venv, editable_source: Path) -> None:
    result = editable_venv.py(
        """
        import sys, json
        bootstrap = sys.modules.get("_fsdp_autopatch_bootstrap")
        print(json.dumps({
            "bootstrap": bootstrap is not None,
            "file": getattr(bootstrap, "__file__", None),
            "triggers": sum(f is sys.modules.get("_fsdp_autopatch_bootstrap") for f in sys.meta_path),
            "heavy": [m for m in ("torch", "wrapt", "packaging", "inspect", "importlib.metadata") if m in sys.modules],
        }))
        """
    )
    state = json_from(result)
    assert state["bootstrap"], "the .pth did not run"
    assert state["file"].startswith(str(editable_source / "src")), state["file"]
    assert state["triggers"] == 1
    assert state["heavy"] == []
    silent = editable_venv.py("pass", env={"FSDP_AUTOPATCH_ACCUMULATED_GRAD_GUARD_ENABLED": "maybe"})
    assert (silent.returncode, silent.stdout, silent.stderr) == (0, "", ""), describe(silent)


def test_editable_status_json(editable_venv: Venv) -> None:
    result = run([editable_venv.python, "-m", "fsdp_autopatch", "status", "--json"], timeout=T_PY)
    assert result.returncode == 0, describe(result)
    report = json.loads(result.stdout)
    assert report["bootstrap"] == "pth" and report["torch"] is None
    assert {p["status"] for p in report["patches"]} == {"unsupported"}


def test_editable_install_activates_with_torch(editable_venv: Venv, editable_source: Path, torch_venv: Venv) -> None:
    """With a real torch. To avoid a second torch install, the program borrows the torch venv's
    torch by appending its site-packages to sys.path: that is after the editable checkout, so the
    package (already loaded by the .pth at start-up) is still the checkout's."""
    pre = f"sys.path.append({str(torch_venv.site_packages)!r})"
    probe = json_from(editable_venv.py(probe_code(pre), timeout=T_TORCH))
    assert probe["loaded"] and probe["file"].startswith(str(editable_source / "src")), probe["file"]
    assert probe["status"]["bootstrap"] == "pth"
    assert probe["status"]["torch"].startswith(TORCH_VERSION)
    assert statuses(probe["status"]) == DEFAULT_STATUSES
    assert_torch_matches_registry(probe)


def test_editable_uninstall_leaves_no_file(_editable_venv: Venv, editable_venv: Venv) -> None:
    before = editable_venv.fsdp_autopatch_files()
    assert "fsdp_autopatch.pth" in before and "fsdp_autopatch.start" in before, before
    _editable_venv.installed = False  # the next test that needs it gets it reinstalled
    editable_venv.pip("uninstall", "-y", "fsdp-autopatch")
    assert editable_venv.fsdp_autopatch_files() == []
    result = editable_venv.py("import sys; print([m for m in sys.modules if 'fsdp_autopatch' in m])")
    assert (result.returncode, result.stdout, result.stderr) == (0, "[]\n", ""), describe(result)
