"""What the built wheel contains: the package, and the two start-up files at its root."""

from __future__ import annotations

import ast
import email
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = [pytest.mark.install, pytest.mark.timeout(900)]  # includes building the wheel


def _read(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(name).decode("utf-8")


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def _dist_info(wheel: Path) -> str:
    (dist_info,) = {n.split("/", 1)[0] for n in _names(wheel) if n.split("/", 1)[0].endswith(".dist-info")}
    return dist_info


def test_wheel_has_the_package(wheel: Path) -> None:
    names = set(_names(wheel))
    for module in (
        "__init__.py",
        "__main__.py",
        "_bootstrap.py",
        "_config.py",
        "_registry.py",
        "_activate.py",
        "_cli.py",
        "patches/__init__.py",
        "patches/accumulated_grad_guard.py",
        "patches/unused_param_reduction.py",
        "patches/uniform_reduce_dtype.py",
        "patches/restore_unused_param_grads.py",
    ):
        assert f"fsdp_autopatch/{module}" in names, module
    # The one module interpreter start imports sits beside the package, at the root.
    assert "_fsdp_autopatch_bootstrap.py" in names
    # Nothing from the source layout or the test suite leaks into site-packages.
    tops = {n.split("/", 1)[0] for n in names}
    expected = {"fsdp_autopatch", "_fsdp_autopatch_bootstrap.py", "fsdp_autopatch.pth", "fsdp_autopatch.start"}
    assert tops == expected | {_dist_info(wheel)}, tops


def test_pth_is_one_import_line_at_the_wheel_root(wheel: Path) -> None:
    text = _read(wheel, "fsdp_autopatch.pth")
    lines = text.splitlines()
    assert len(lines) == 1, lines
    (line,) = lines
    # site.addpackage executes a line only if it starts with "import" followed by a space or tab.
    assert line.startswith(("import ", "import\t")), line
    # One top-level module: a submodule would make Python execute the package's __init__ too. The
    # line is nothing more (site compiles it at every start, twice in a venv): the module starts
    # the plugin when site imports it, and never raises (tests/unit/test_bootstrap.py).
    assert line == "import _fsdp_autopatch_bootstrap", line


def test_start_file_names_an_existing_callable(wheel: Path) -> None:
    entries = [
        line.strip()
        for line in _read(wheel, "fsdp_autopatch.start").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert entries == ["_fsdp_autopatch_bootstrap:start"], entries
    module, _, function = entries[0].partition(":")
    source = _read(wheel, module.replace(".", "/") + ".py")
    functions = {
        node.name: node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)
    }
    assert function in functions, sorted(functions)
    arguments = functions[function].args
    assert not arguments.args and not arguments.posonlyargs and not arguments.kwonlyargs  # PEP 829 calls it with none


def test_record_lists_the_start_up_files(wheel: Path) -> None:
    """pip uninstall removes exactly what RECORD lists."""
    record = _read(wheel, f"{_dist_info(wheel)}/RECORD")
    recorded = {line.split(",", 1)[0] for line in record.splitlines() if line}
    start_up = {"fsdp_autopatch.pth", "fsdp_autopatch.start", "_fsdp_autopatch_bootstrap.py",
                "fsdp_autopatch/_bootstrap.py"}
    assert start_up <= recorded


def test_metadata_and_console_script(wheel: Path) -> None:
    dist_info = _dist_info(wheel)
    metadata = email.message_from_string(_read(wheel, f"{dist_info}/METADATA"))
    requires = [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]
    bare = {r.name.lower() for r in requires if r.marker is None}  # not behind an extra
    assert {"wrapt", "packaging"} <= bare, requires
    # Installing the plugin must never install, upgrade or replace the user's torch.
    assert "torch" not in bare, requires
    entry_points = _read(wheel, f"{dist_info}/entry_points.txt")
    assert "[console_scripts]" in entry_points
    assert "fsdp-autopatch = fsdp_autopatch.__main__:main" in entry_points, entry_points
