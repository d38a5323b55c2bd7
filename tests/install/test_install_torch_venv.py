"""The wheel in a fresh venv with torch (FSDP_TEST_TORCH, 2.13 by default): activation through the .pth, start-up
cost, the CLI.

The user programs below never import fsdp_autopatch: they import torch's FSDP2 and then read the
already-loaded plugin from ``sys.modules``.
"""

from __future__ import annotations

import json
import re

import pytest

from _install_support import (
    CLI_STATUSES,
    DEFAULT_STATUSES,
    PATCH_NAMES,
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

# Generous: the first test to use the shared venv also pays for building the wheel, creating the
# venv and installing torch (minutes on a busy 2-core machine).
pytestmark = [pytest.mark.install, pytest.mark.timeout(1800)]


# --- activation --------------------------------------------------------------------------------


def test_importing_fsdp2_applies_the_patches(torch_venv: Venv) -> None:
    result = torch_venv.py(probe_code(), timeout=T_TORCH)
    probe = json_from(result)
    assert probe["loaded"], "the .pth did not load fsdp_autopatch"
    assert str(torch_venv.site_packages) in probe["file"]
    report = probe["status"]
    assert report["bootstrap"] == "pth"
    assert report["torch"].startswith(TORCH_VERSION)
    assert statuses(report) == DEFAULT_STATUSES
    # torch's own method is really replaced, once, by a wrapper around the original
    assert probe["guard_has___wrapped__"]
    assert_torch_matches_registry(probe)
    assert probe["patched"]["FSDPParam.to_accumulated_grad_if_needed"] == 1
    # and the plugin said nothing
    assert "fsdp-autopatch" not in result.stderr and "Traceback" not in result.stderr, describe(result)


def test_patches_also_apply_through_a_plain_torch_import(torch_venv: Venv) -> None:
    """``import torch`` first, FSDP2 later (the usual order in training scripts)."""
    result = torch_venv.py(
        """
        import sys, json, torch
        before = sys.modules["fsdp_autopatch"].status().to_dict()
        from torch.distributed.fsdp import fully_shard
        after = sys.modules["fsdp_autopatch"].status().to_dict()
        print(json.dumps([before, after]))
        """,
        timeout=T_TORCH,
    )
    before, after = json_from(result)
    assert set(statuses(before).values()) == {"pending"}, before
    assert statuses(after) == DEFAULT_STATUSES


# --- start-up: cheap and silent ------------------------------------------------------------------

MUST_NOT_LOAD_AT_START = (
    "torch",
    "wrapt",
    "packaging",
    "inspect",
    "importlib.metadata",
    "dataclasses",
    "typing",
    "logging",
    "threading",
    "asyncio",
    "difflib",
    "warnings",
    "fsdp_autopatch._registry",
    "fsdp_autopatch._activate",
    "fsdp_autopatch._compat",
    "fsdp_autopatch._cli",
    "fsdp_autopatch.patches",
)


def test_start_up_imports_nothing_heavy(torch_venv: Venv) -> None:
    result = torch_venv.py(
        """
        import sys, json
        print(json.dumps({
            "modules": sorted(sys.modules),
            # the trigger is the bootstrap module itself (its module-level find_spec)
            "triggers": [f.__name__ for f in sys.meta_path if f is sys.modules.get("_fsdp_autopatch_bootstrap")],
        }))
        """
    )
    state = json_from(result)
    modules = set(state["modules"])
    assert "_fsdp_autopatch_bootstrap" in modules, "the .pth did not run"
    loaded = sorted(m for m in MUST_NOT_LOAD_AT_START if m in modules)
    assert not loaded, f"imported at interpreter start: {loaded}"
    # The venv runs its .pth files twice (CPython issue 75723): the trigger is armed once only.
    assert state["triggers"] == ["_fsdp_autopatch_bootstrap"], state["triggers"]


def test_start_up_imports_only_the_bootstrap(torch_venv: Venv) -> None:
    """``-X importtime``: interpreter start imports one module of ours, the top-level bootstrap, and
    nothing while importing it (not the package: its ``__init__`` would be a second module)."""
    result = torch_venv.py("pass", flags=("-X", "importtime"))
    assert result.returncode == 0 and not result.stdout, describe(result)
    rows = []  # (depth, module) in the order importtime reports them: children before parents
    for line in result.stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+\d+ \|( *)(\S+)$", line)
        if match:
            rows.append((len(match.group(1)) // 2, match.group(2)))
    ours = [(i, depth) for i, (depth, name) in enumerate(rows) if "fsdp_autopatch" in name.split(".")[0]]
    assert [rows[i][1] for i, _ in ours] == ["_fsdp_autopatch_bootstrap"], result.stderr
    ((end, level),) = ours
    start = end
    while start > 0 and rows[start - 1][0] > level:  # the rows reported just before it, deeper: its imports
        start -= 1
    assert rows[start:end] == [], f"the bootstrap imports {rows[start:end]} at interpreter start"


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"FSDP_AUTOPATCH_ACCUMULATED_GRAD_GUARD_ENABLED": "maybe"},
        {"FSDP_AUTOPATCH_ENABLED": "maybe"},
        {"FSDP_AUTOPATCH_ENABLED": "0"},
        {"FSDP_AUTOPATCH_DISABLED": "no_such_patch"},
        {"FSDP_AUTOPATCH_FOO": "1", "FSDP_AUTOPATCH_STRICT": "1", "FSDP_AUTOPATCH_LOG_LEVEL": "DEBUG"},
    ],
    ids=["clean", "bad-bool", "bad-kill-switch", "kill-switch", "unknown-patch", "unknown-var-strict-debug"],
)
def test_start_up_is_silent(torch_venv: Venv, env: dict) -> None:
    """Warnings come only when the hook runs (torch's FSDP2 imported), never at interpreter start."""
    result = torch_venv.py("pass", env=env)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", ""), describe(result)


@pytest.mark.parametrize("flags", [("-I",), ("-X", "dev"), ("-W", "error")], ids=["isolated", "dev-mode", "W-error"])
def test_start_up_is_silent_under_interpreter_flags(torch_venv: Venv, flags: tuple) -> None:
    result = torch_venv.py(
        "import sys; print('_fsdp_autopatch_bootstrap' in sys.modules)",
        flags=flags,
        env={"FSDP_AUTOPATCH_ACCUMULATED_GRAD_GUARD_ENABLED": "maybe", "FSDP_AUTOPATCH_FOO": "1"},
    )
    # -I and -X dev still process .pth files
    assert (result.returncode, result.stdout, result.stderr) == (0, "True\n", ""), describe(result)


# --- python -S: no .pth, explicit install() ------------------------------------------------------


def test_python_dash_S_needs_an_explicit_install(torch_venv: Venv) -> None:
    result = torch_venv.py(
        f"""
        import sys, json
        sys.path.append({str(torch_venv.site_packages)!r})  # what an embedding application does
        import torch.distributed.fsdp
        pth_ran = "_fsdp_autopatch_bootstrap" in sys.modules
        import fsdp_autopatch, wrapt
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        def depth():
            obj, n = vars(FSDPParam)["to_accumulated_grad_if_needed"], 0
            while isinstance(obj, wrapt.FunctionWrapper):
                obj, n = obj.__wrapped__, n + 1
            return n
        before = (fsdp_autopatch.status().to_dict(), depth())
        fsdp_autopatch.install()
        after = (fsdp_autopatch.status().to_dict(), depth())
        fsdp_autopatch.install()  # idempotent
        again = (fsdp_autopatch.status().to_dict(), depth())
        print(json.dumps({{"pth_ran": pth_ran, "before": before, "after": after, "again": again}}))
        """,
        flags=("-S",),
        timeout=T_TORCH,
    )
    state = json_from(result)
    assert state["pth_ran"] is False
    report, depth = state["before"]
    assert report["bootstrap"] == "not_run"
    assert set(statuses(report).values()) == {"pending"}, report
    assert depth == 0
    report, depth = state["after"]
    assert report["bootstrap"] == "explicit"
    assert statuses(report) == DEFAULT_STATUSES
    assert depth == 1
    assert state["again"] == state["after"]
    assert "fsdp-autopatch" not in result.stderr and "Traceback" not in result.stderr, describe(result)


# --- the CLI -----------------------------------------------------------------------------------


def test_cli_status_json(torch_venv: Venv, wheel) -> None:
    result = run([torch_venv.python, "-m", "fsdp_autopatch", "status", "--json"], timeout=T_TORCH)
    assert result.returncode == 0, describe(result)
    report = json.loads(result.stdout)  # nothing but the JSON on stdout
    assert {"version", "torch", "bootstrap", "patches"} <= set(report), report
    assert report["version"] == wheel.name.split("-")[1]
    assert report["torch"].startswith(TORCH_VERSION)
    assert report["bootstrap"] == "pth"
    assert [p["name"] for p in report["patches"]] == list(PATCH_NAMES)
    for patch in report["patches"]:
        fields = {"name", "status", "reason", "env", "decided_by", "variable", "value", "fired", "provider"}
        assert set(patch) == fields, patch
        assert patch["fired"] == 0, patch  # `status` trains nothing: no patch had to act
        assert patch["env"] == f"FSDP_AUTOPATCH_{patch['name'].upper()}_ENABLED"
        # every release the tests run on is a measured one: the version range and the structure both decided
        assert patch["decided_by"] == "version range and structural check", patch
        assert "decided by" not in patch["reason"], patch  # a field, not prose
    assert statuses(report) == CLI_STATUSES


def test_console_script_prints_a_table(torch_venv: Venv, wheel) -> None:
    script = torch_venv.bin("fsdp-autopatch")
    assert script.exists()
    result = run([script, "status"], timeout=T_TORCH)
    assert result.returncode == 0, describe(result)
    version = wheel.name.split("-")[1]
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"fsdp-autopatch {version}") and f"torch {TORCH_VERSION}" in lines[0], lines[0]
    assert "bootstrap: pth" in lines[0]
    assert any(re.match(r"PATCH\s+KIND\s+STATUS\s+FIRED\s+WHY", line) for line in lines), result.stdout
    for name, status in CLI_STATUSES.items():
        row = re.compile(rf"{name}\s+(fix|guard)\s+{status}\s+\d+\s+\S")
        assert any(row.match(line) for line in lines), (name, result.stdout)
    assert max(map(len, lines)) <= 100, result.stdout  # fits a terminal; status -v has the whole reasons
