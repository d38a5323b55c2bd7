"""The start-up path, in fresh interpreters, against a tiny fake torch (fast: no real torch import).

The fake torch has the FSDP2 module the hook waits for but none of the internals the patches wrap,
which is also the "internals differ" case: every patch must say unsupported and nothing may raise.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

FAKE_TORCH = {
    "torch/__init__.py": "__version__ = '2.13.0+fake'\n",
    "torch/distributed/__init__.py": "",
    "torch/distributed/fsdp/__init__.py": "from . import _fully_shard\n",
    "torch/distributed/fsdp/_fully_shard/__init__.py": "",
}

SRC = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "src")


@pytest.fixture
def fake_torch(tmp_path):
    for relative, text in FAKE_TORCH.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def run(code, fake_torch, *flags, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_AUTOPATCH_")}
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join([str(fake_torch), os.path.abspath(SRC)])
    return subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )


PROGRAM = """
    import sys, json
    import _fsdp_autopatch_bootstrap as bootstrap
    bootstrap.install("pth")          # what the .pth line does (idempotent if it already ran)
    bootstrap.install("pth")          # a venv runs .pth files twice
    before = sorted(m for m in ("torch", "wrapt", "packaging", "inspect", "importlib.metadata") if m in sys.modules)
    import torch.distributed.fsdp
    import fsdp_autopatch
    print(json.dumps({"before": before, "report": fsdp_autopatch.status().to_dict(),
                      "finders": sum(f is bootstrap for f in sys.meta_path)}))
"""


def test_hook_waits_for_torch_then_reports_unsupported_internals(fake_torch):
    result = run(PROGRAM, fake_torch)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    data = json.loads(result.stdout)
    assert data["before"] == []  # nothing heavy until torch is imported
    assert data["finders"] == 1  # installed once despite two install() calls
    report = data["report"]
    assert report["torch"] == "2.13.0+fake"
    assert {p["status"] for p in report["patches"]} == {"unsupported"}
    assert all("torch internals differ" in p["reason"] for p in report["patches"])


def test_kill_switch_at_start_arms_nothing(fake_torch):
    program = PROGRAM.replace(
        "import torch.distributed.fsdp", "import torch.distributed.fsdp\n    assert 'wrapt' not in sys.modules"
    )
    result = run(program, fake_torch, FSDP_AUTOPATCH_ENABLED="0")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)["report"]
    assert {p["status"] for p in report["patches"]} == {"disabled"}


def test_explicit_install_after_torch_patches_right_away(fake_torch):
    code = """
        import sys, json
        import torch.distributed.fsdp      # torch first, as under python -S or in an embedded interpreter
        import fsdp_autopatch
        pending = [p.status.value for p in fsdp_autopatch.status().patches]
        fsdp_autopatch.install()
        print(json.dumps({"pending": pending, "report": fsdp_autopatch.status().to_dict()}))
    """
    result = run(code, fake_torch, "-S")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data["pending"]) == {"pending"}
    assert data["report"]["bootstrap"] == "explicit"
    assert {p["status"] for p in data["report"]["patches"]} == {"unsupported"}


def test_explicit_install_after_the_kill_switch_is_lifted_reports_explicit(fake_torch):
    code = """
        import os, json
        import _fsdp_autopatch_bootstrap as bootstrap
        bootstrap.install("pth")           # at start-up, with FSDP_AUTOPATCH_ENABLED=0: arms nothing
        os.environ["FSDP_AUTOPATCH_ENABLED"] = "1"
        import fsdp_autopatch
        fsdp_autopatch.install()           # the program lifts the switch and starts the plugin itself
        import torch.distributed.fsdp
        print(json.dumps(fsdp_autopatch.status().to_dict()))
    """
    result = run(code, fake_torch, FSDP_AUTOPATCH_ENABLED="0")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["bootstrap"] == "explicit"
    assert {p["status"] for p in report["patches"]} == {"unsupported"}  # armed: the hook ran


def test_bad_values_warn_only_when_the_hook_runs(fake_torch):
    quiet = run("import _fsdp_autopatch_bootstrap as b; b.install('pth')", fake_torch, FSDP_AUTOPATCH_STRICT="maybe")
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == ""
    loud = run(PROGRAM, fake_torch, FSDP_AUTOPATCH_STRICT="maybe", FSDP_AUTOPATCH_TYPO="1")
    assert loud.returncode == 0, loud.stderr
    assert loud.stderr.count("FSDP_AUTOPATCH_STRICT='maybe' is not a boolean") == 1
    assert "FSDP_AUTOPATCH_TYPO" in loud.stderr


def test_the_pth_line_imports_one_module_of_ours_and_only_the_standard_library():
    """Every interpreter of the environment runs the line: one module of ours, not the package."""
    code = f"""
        import site, sys
        before = set(sys.modules)
        site.addpackage({os.path.abspath(SRC)!r}, "fsdp_autopatch.pth", set())   # what site does at start
        new = sorted(set(sys.modules) - before)
        print(",".join(new), sys.modules["_fsdp_autopatch_bootstrap"].source)
    """
    result = subprocess.run(
        [sys.executable, "-S", "-c", textwrap.dedent(code)],
        env={**os.environ, "PYTHONPATH": os.path.abspath(SRC)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    modules, source = result.stdout.split()
    new = set(modules.split(","))
    assert source == "pth"
    # _config loads only when FSDP_AUTOPATCH_ENABLED is set; the package when torch executes
    assert {m for m in new if "fsdp_autopatch" in m} == {"_fsdp_autopatch_bootstrap"}
    assert not new & {"torch", "wrapt", "packaging", "inspect", "importlib.metadata", "dataclasses", "logging"}
    # The rest of `new` is what `site` (imported before `before` here) has always loaded before
    # it reads a .pth file; `from __future__ import annotations` would add `__future__`.
    assert "__future__" not in new


def test_the_package_name_of_the_bootstrap_is_the_same_module(fake_torch):
    """A .pth or .start written by an earlier install names ``fsdp_autopatch._bootstrap``: it must
    still arm the plugin, sharing one trigger and one set of process facts with the new name."""
    code = """
        import sys, json
        import fsdp_autopatch._bootstrap as old
        old.install("pth")                 # the line an earlier .pth runs
        import _fsdp_autopatch_bootstrap as new
        new.install("pth")                 # and this install's own
        import torch.distributed.fsdp, fsdp_autopatch
        print(json.dumps({"same": old is new and fsdp_autopatch._bootstrap is new,
                          "triggers": sum(f is new for f in sys.meta_path),
                          "report": fsdp_autopatch.status().to_dict()}))
    """
    result = run(code, fake_torch)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    data = json.loads(result.stdout)
    assert data["same"] is True
    assert data["triggers"] == 1
    assert data["report"]["bootstrap"] == "pth"
    assert {p["status"] for p in data["report"]["patches"]} == {"unsupported"}  # the hook ran


def test_first_import_of_torch_in_one_thread_does_not_deadlock_another_thread(fake_torch):
    """The trigger must import nothing while the import system holds its global lock: a thread
    importing ``logging`` (a module wrapt needs) at the same moment would otherwise hang forever."""
    code = """
        import threading
        import _fsdp_autopatch_bootstrap as bootstrap
        bootstrap.install("pth")
        barrier = threading.Barrier(2)
        def first_torch_import():
            barrier.wait(); import torch
        def other_import():
            barrier.wait(); import logging
        threads = [threading.Thread(target=f) for f in (first_torch_import, other_import)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        import torch.distributed.fsdp, fsdp_autopatch
        print(fsdp_autopatch.status().bootstrap, "wrapt" in __import__("sys").modules)
    """
    for _ in range(3):
        try:
            result = run(code, fake_torch)
        except subprocess.TimeoutExpired:
            pytest.fail("deadlock: the first `import torch` hung a concurrent `import logging`")
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["pth", "True"]


def test_availability_check_does_not_use_up_the_trigger(fake_torch):
    """``importlib.util.find_spec("torch")`` (libraries probe for torch this way) must not arm or
    disarm anything: the real ``import torch`` afterwards still activates the plugin."""
    code = """
        import importlib.util, sys, json
        import _fsdp_autopatch_bootstrap as bootstrap
        bootstrap.install("pth")
        assert importlib.util.find_spec("torch") is not None
        armed_early = "wrapt" in sys.modules
        import torch
        assert type(torch.__loader__).__name__ == "SourceFileLoader", torch.__loader__
        import torch.distributed.fsdp, fsdp_autopatch
        print(json.dumps([armed_early, [p.status.value for p in fsdp_autopatch.status().patches]]))
    """
    result = run(code, fake_torch)
    assert result.returncode == 0, result.stderr
    armed_early, statuses = json.loads(result.stdout)
    assert armed_early is False
    assert set(statuses) == {"unsupported"}  # the hook ran (fake torch has no FSDP2 internals)


def test_the_bootstrap_spells_the_kill_switch_as_the_config_does():
    import _fsdp_autopatch_bootstrap as bootstrap
    from fsdp_autopatch import _config

    assert bootstrap.KILL_SWITCH == _config.KILL_SWITCH


def test_version_is_loaded_on_first_use():
    import fsdp_autopatch
    from fsdp_autopatch import _version

    assert fsdp_autopatch.__version__ == _version.__version__
    assert "__version__" in dir(fsdp_autopatch)
    from fsdp_autopatch import __version__

    assert __version__ == _version.__version__


def test_only_site_importing_the_bootstrap_starts_the_plugin():
    """The .pth line is ``import _fsdp_autopatch_bootstrap``: the module starts the plugin ("pth")
    when ``site`` imports it for a .pth line, and only then. A plain import (``python -S``, the
    package, a test) arms nothing; the .start file's ``start`` says "start"."""
    code = f"""
        import json, pkgutil, site, sys
        import _fsdp_autopatch_bootstrap as plain
        seen = {{"plain": [plain.source, plain in sys.meta_path]}}
        del sys.modules["_fsdp_autopatch_bootstrap"]
        site.addpackage({os.path.abspath(SRC)!r}, "fsdp_autopatch.pth", set())   # what site does at start
        by_site = sys.modules["_fsdp_autopatch_bootstrap"]
        seen["site"] = [by_site.source, sum(f is by_site for f in sys.meta_path)]
        site.addpackage({os.path.abspath(SRC)!r}, "fsdp_autopatch.pth", set())   # a venv's second pass
        seen["again"] = [by_site.source, sum(f is by_site for f in sys.meta_path)]
        sys.meta_path.remove(by_site)
        del sys.modules["_fsdp_autopatch_bootstrap"]
        pkgutil.resolve_name("_fsdp_autopatch_bootstrap:start")()   # what a PEP 829 site does
        by_start = sys.modules["_fsdp_autopatch_bootstrap"]
        seen["start"] = [by_start.source, sum(f is by_start for f in sys.meta_path)]
        print(json.dumps(seen))
    """
    result = subprocess.run(
        [sys.executable, "-S", "-c", textwrap.dedent(code)],
        env={**os.environ, "PYTHONPATH": os.path.abspath(SRC)}, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert json.loads(result.stdout) == {"plain": [None, False], "site": ["pth", 1], "again": ["pth", 1],
                                         "start": ["start", 1]}
