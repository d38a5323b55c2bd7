"""The packages the cases need (their ``NEEDS``), as the pip requirements that install them.

A case module (``src/fsdp_autopatch/cases/<entry>.py``) names in ``NEEDS`` what its run needs beyond
torch on gloo: ``"cuda"`` (a device, nothing to install) and importable modules, each named as its
distribution (``"peft"``). Each package's requirement is written once, in ``pyproject.toml``'s
``examples`` extra (the development venv installs it, ``scripts/_venv.sh``); the compatibility
matrix's venvs install the ones the cases need from there (``scripts/matrix.py``), so a case that
adds a need adds one requirement to the extra and nothing here.

Standard library only, any Python >= 3.9 (no ``tomllib``): the cases are read, not imported, and the
extra's array is read as the Python literal it also is.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "src" / "fsdp_autopatch" / "cases"
PYPROJECT = ROOT / "pyproject.toml"
NOT_PACKAGES = ("cuda",)  # NEEDS items that name a device, not something pip installs


def case_needs(cases_dir: Path = CASES) -> dict[str, tuple[str, ...]]:
    """Per case module that needs packages, the packages its ``NEEDS`` names."""
    needs = {}
    for path in sorted(cases_dir.glob("[!_]*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NEEDS" for t in node.targets):
                packages = tuple(need for need in ast.literal_eval(node.value) if need not in NOT_PACKAGES)
                if packages:
                    needs[path.stem] = packages
    return needs


def examples_extra(pyproject: Path = PYPROJECT) -> list[str]:
    """The requirements of ``[project.optional-dependencies] examples`` (one array of double-quoted
    strings, no comment inside it)."""
    match = re.search(r"^examples\s*=\s*(\[.*?\])", pyproject.read_text(), re.M | re.S)
    if match is None:
        raise LookupError(f"{pyproject} has no examples extra")
    return list(ast.literal_eval(match.group(1)))


def project_name(requirement: str) -> str:
    """A requirement's project name, normalized as pip compares them: ``"Foo_Bar>=1"`` -> ``"foo-bar"``."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(needs: dict[str, tuple[str, ...]] | None = None, extra: list[str] | None = None) -> tuple[str, ...]:
    """The ``examples`` extra's requirement of each package a case needs, in the extra's order;
    a ``LookupError`` naming every need the extra lacks, and its case."""
    needs = case_needs() if needs is None else needs
    by_name = {project_name(requirement): requirement for requirement in (examples_extra() if extra is None else extra)}
    wanted = {project_name(package): (case, package) for case, packages in needs.items() for package in packages}
    missing = [f"{case}'s {package!r}" for name, (case, package) in wanted.items() if name not in by_name]
    if missing:
        raise LookupError(f"pyproject.toml's examples extra has no requirement for {', '.join(missing)} (NEEDS)")
    return tuple(requirement for name, requirement in by_name.items() if name in wanted)
