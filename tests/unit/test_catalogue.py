"""The catalogue (``fsdp_autopatch._catalogue``) and the declarations (each module's ``PATCH``) agree.

The catalogue is the one list of names, kinds and order; the declarations say what each entry
does. Every per-patch table of the package is derived from the two; these tests name the entry
when something is missing or out of order, so that a new entry cannot be half-added.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import expected as ex
from fsdp_autopatch import _catalogue as catalogue
from fsdp_autopatch.patches import load_patch

PATCHES_DIR = Path(catalogue.__file__).parent / "patches"
CASES_DIR = Path(catalogue.__file__).parent / "cases"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "patches"


def test_every_patch_module_is_in_the_catalogue():
    # "_name": a private helper two entries share (_pending_grads), not an entry
    modules = {path.stem for path in PATCHES_DIR.glob("*.py") if not path.stem.startswith("_")}
    assert sorted(modules - set(catalogue.BY_NAME)) == [], "patch modules missing from _catalogue.ENTRIES"
    assert sorted(set(catalogue.BY_NAME) - modules) == [], "catalogue entries without a module"


@pytest.mark.parametrize("entry", catalogue.ENTRIES, ids=lambda entry: entry.name)
def test_the_declaration_agrees_with_its_entry(entry):
    patch = load_patch(entry.name)
    assert (patch.name, patch.kind, patch.toggle) == (entry.name, entry.kind, entry.toggle)


@pytest.mark.parametrize("entry", catalogue.ENTRIES, ids=lambda entry: entry.name)
def test_the_order_respects_every_after(entry):
    position = {e.name: i for i, e in enumerate(catalogue.ENTRIES)}
    for earlier in load_patch(entry.name).after:
        assert earlier in position, f"{entry.name}.after names {earlier!r}, which is not in the catalogue"
        assert position[earlier] < position[entry.name], f"{entry.name} must come after {earlier} in _catalogue.ENTRIES"


def test_policies_apply_after_every_fix_and_guard():
    kinds = [entry.kind for entry in catalogue.ENTRIES]
    first_policy = kinds.index(catalogue.POLICY)
    assert catalogue.POLICY not in kinds[:first_policy] and set(kinds[first_policy:]) == {catalogue.POLICY}


def test_the_catalogue_module_is_a_leaf():
    tree = ast.parse(Path(catalogue.__file__).read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert imports == [], "the catalogue is read on the start-up path: it imports nothing"


@pytest.mark.parametrize("name", catalogue.PATCH_NAMES)
def test_every_fix_and_guard_has_a_docs_page(name):
    assert (DOCS / f"{name}.md").is_file(), f"docs/patches/{name}.md is missing"


@pytest.mark.parametrize("name", catalogue.PATCH_NAMES)
def test_every_fix_and_guard_has_a_case_and_its_rows(name):
    """Its bug's smallest training, written once (demo --bug, the GPU check, test_dist_cases run it)."""
    assert (CASES_DIR / f"{name}.py").is_file(), f"src/fsdp_autopatch/cases/{name}.py is missing"
    for release in ex.MEASURED:
        rows = ex.case_rows(release)
        assert name in rows and set(rows[name]) == {"on", "off"}, f"tests/expected.py case_rows: {name}"
        for which in ("on", "off"):
            problems = ex.check_case_row(rows[name][which])
            assert not problems, f"tests/expected.py case_rows[{name!r}][{which!r}] on {release}: {problems}"


def test_every_case_module_is_an_entry():
    cases = {path.stem for path in CASES_DIR.glob("*.py") if not path.stem.startswith("_")}
    assert sorted(cases - set(catalogue.PATCH_NAMES)) == [], "case modules of no fix or guard"


def test_the_oracle_knows_every_fix_and_guard():
    """tests/expected.py is hand-written on purpose (the matrix checks against it), but complete."""
    assert list(ex.PATCHES) == list(catalogue.PATCH_NAMES), "tests/expected.py PATCHES must follow the catalogue"
    assert sorted(ex.BUG_OF) == sorted(catalogue.PATCH_NAMES), "tests/expected.py BUG_OF lacks an entry"
    for release in ex.MEASURED:
        status, outcome = ex.expected_status(release), ex.unpatched_outcome(release)
        missing = sorted(set(catalogue.PATCH_NAMES) - set(status)), sorted(set(ex.BUG_OF.values()) - set(outcome))
        assert missing == ([], []), (f"on {ex.release_text(release)}, tests/expected.py's expected_status lacks "
                                     f"{missing[0]} and unpatched_outcome lacks bug letters {missing[1]}")
        assert sorted(status) == sorted(catalogue.PATCH_NAMES), "expected_status names unknown entries"
        assert sorted(outcome) == sorted(ex.BUG_OF.values()), "unpatched_outcome names unknown bug letters"
    waits = {entry.name: entry.waits_for for entry in catalogue.ENTRIES if entry.waits_for}
    assert ex.WAITS_FOR == waits, "tests/expected.py WAITS_FOR must name the entries that wait for another module"
