"""A module of ours that fails to import (or raises) never breaks the user's import.

Each case copies ``src/`` and makes one of the package's modules raise at import (a ``TypeError``,
as Python 3.9 raised for ``str | None`` annotations, or an ``ImportError``), then, in a fresh
interpreter against the stand-in torch:

1. runs the ``.pth`` line and ``import torch.distributed.fsdp``: exit status 0, nothing printed
   (but for the bootstrap itself: then Python reports the ``.pth`` line, once);
2. ``fsdp_autopatch.status()`` says which patches failed and names the module, where the registry
   itself still imports;
3. ``python -m fsdp_autopatch status`` and ``doctor`` name the broken module (exit status non-zero).
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
from test_fault_injection import FAKE_TORCH, SRC, describe, run_child

from fsdp_autopatch import _catalogue as catalogue

pytestmark = pytest.mark.timeout(300)

INJECTED = "injected by the test"
# module -> what the registry must show: "all" patches failed, some patches, "policy" (only the
# cross-rank check is not armed), or None when the registry itself cannot be imported.
_CORE = {
    "fsdp_autopatch._activate": "all",
    "fsdp_autopatch._compat": "all",
    "fsdp_autopatch._spec": "all",
    "fsdp_autopatch._patching": "all",
    "fsdp_autopatch.patches": "all",  # load_patch imports each patch module through the package
    "fsdp_autopatch._catalogue": None,  # the settings and the registry read its names
    "fsdp_autopatch._config": None,
    "fsdp_autopatch._registry": None,
    "fsdp_autopatch._version": None,
    "fsdp_autopatch._process": None,
}


def _patch_modules_importing(name: str) -> tuple[str, ...]:
    """The entries whose module imports patch module ``name`` (``from . import name``): they fail with it."""
    importers = []
    for entry in catalogue.ENTRIES:
        if not entry.default:  # a policy left off is never loaded
            continue
        tree = ast.parse((Path(SRC) / "fsdp_autopatch" / "patches" / f"{entry.name}.py").read_text())
        imported = {
            alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1
            for alias in node.names
        }
        if name in imported:
            importers.append(entry.name)
    return tuple(importers)


def _fails_with_its_module(entry) -> object:
    if entry.kind == catalogue.POLICY:
        return "policy"
    return (entry.name, *_patch_modules_importing(entry.name))


# Derived from the catalogue: every entry on by default (a policy left off is never loaded).
HOOK_PATH = {**_CORE, **{entry.module: _fails_with_its_module(entry) for entry in catalogue.ENTRIES if entry.default}}
# Start-up modules: the bootstrap (top-level, the one module the .pth imports) failing means the
# .pth arms nothing, and status says the bootstrap did not run. The package's __init__ failing
# stops the hook when torch executes (caught there) and status cannot be asked.
PATCHES = catalogue.PATCH_NAMES

PROGRAM = """
    import json, site, sys
    site.addpackage({src!r}, "fsdp_autopatch.pth", set())   # what site does with the installed .pth
    import torch.distributed.fsdp                            # the user's import: must succeed
    try:
        import fsdp_autopatch
        report = fsdp_autopatch.status().to_dict()
    except Exception as error:
        report = {{"error": type(error).__name__ + ": " + str(error)}}
    print(json.dumps(report))
"""


def broken_copy(tmp_path, module: str, error: str):
    """A copy of ``src`` (with the .pth) whose ``module`` raises ``error`` when imported."""
    src = tmp_path / "src"
    shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("__pycache__"))
    parts = module.split(".")
    path = src.joinpath(*parts)
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    text = path.read_text()
    # After a leading docstring and __future__ import, if any, so the file still compiles.
    marker = "from __future__ import annotations\n"
    head, sep, tail = text.partition(marker) if marker in text else ("", "", text)
    path.write_text(f"{head}{sep}raise {error}({INJECTED!r})\n{tail}")
    fake = tmp_path / "fake_torch"
    for relative, body in FAKE_TORCH.items():
        target = fake / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(body)
    return src, fake


def run_user_program(src, fake):
    result = run_child(PROGRAM.format(src=str(src)), path=[fake, src])
    assert result.returncode == 0, describe(result)
    assert result.stderr == "", describe(result)  # nothing printed unless asked
    lines = result.stdout.splitlines()
    assert len(lines) == 1, describe(result)
    return json.loads(lines[0])


def run_cli(src, fake, *args):
    code = (
        f"import sys; sys.path[:0] = [{str(fake)!r}, {str(src)!r}]; "
        f"from fsdp_autopatch.__main__ import main; sys.exit(main({list(args)!r}))"
    )
    return run_child(code, path=[fake, src])


@pytest.mark.parametrize("error", ["TypeError", "ImportError"])
@pytest.mark.parametrize("module", sorted(HOOK_PATH))
def test_our_module_raising_on_the_hook_path_leaves_the_import_working(tmp_path, module, error):
    src, fake = broken_copy(tmp_path, module, error)
    report = run_user_program(src, fake)
    expected = HOOK_PATH[module]
    if expected is None:
        assert report == {"error": f"{error}: {INJECTED}"}  # the registry itself cannot be imported
    else:
        got = {p["name"]: p for p in report["patches"]}
        failed = set(PATCHES) if expected == "all" else set() if expected == "policy" else set(expected)
        assert {n for n, p in got.items() if p["status"] == "failed"} == failed
        assert {p["status"] for n, p in got.items() if n not in failed} <= {"unsupported"}  # stand-in torch
        for name in failed:
            assert module in got[name]["reason"] and f"{error}: {INJECTED}" in got[name]["reason"]
        if expected == "policy":
            policy = module.rsplit(".", 1)[1]
            assert report["policies"][policy] == f"not armed: {error}: {INJECTED} (in {module})"
    for command in ("status", "doctor"):
        result = run_cli(src, fake, command)
        # the stand-in torch leaves every patch unsupported, a problem for doctor whatever broke
        assert result.returncode != 0 or (command, expected) == ("status", "policy"), describe(result)
        assert module in result.stdout + result.stderr, describe(result)


def test_the_package_raising_at_start_up_leaves_the_import_working(tmp_path):
    src, fake = broken_copy(tmp_path, "fsdp_autopatch", "TypeError")
    report = run_user_program(src, fake)
    assert report == {"error": f"TypeError: {INJECTED}"}  # nothing armed; status cannot be asked


def test_the_bootstrap_raising_leaves_the_import_working_and_python_names_the_file(tmp_path):
    """The .pth line is a bare ``import _fsdp_autopatch_bootstrap`` (the cheapest line there is,
    docs/performance.md): a bootstrap that cannot even be imported (deleted, or raising at its top)
    is the one case that prints at start-up, Python's own one report naming the .pth line. The
    user's program still runs, unpatched, and status says the bootstrap did not run."""
    src, fake = broken_copy(tmp_path, "_fsdp_autopatch_bootstrap", "TypeError")
    result = run_child(PROGRAM.format(src=str(src)), path=[fake, src])
    assert result.returncode == 0, describe(result)
    assert f"Error processing line 1 of {src / 'fsdp_autopatch.pth'}" in result.stderr, describe(result)
    assert f"TypeError: {INJECTED}" in result.stderr, describe(result)
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["bootstrap"] == "not_run", report  # nothing armed, and status says so
    assert {p["status"] for p in report["patches"]} == {"pending"}, report


def test_the_hook_module_raising_leaves_the_import_working_and_patches_pending(tmp_path):
    src, fake = broken_copy(tmp_path, "fsdp_autopatch._hook", "TypeError")
    report = run_user_program(src, fake)
    assert {p["status"] for p in report["patches"]} == {"pending"}  # nothing could be armed


def test_strict_re_raises_from_the_hook(tmp_path):
    src, fake = broken_copy(tmp_path, "fsdp_autopatch._activate", "TypeError")
    result = run_child(PROGRAM.format(src=str(src)), path=[fake, src], env={"FSDP_AUTOPATCH_STRICT": "1"})
    assert result.returncode == 1 and f"TypeError: {INJECTED}" in result.stderr, describe(result)
