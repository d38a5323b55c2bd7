"""What the cases need (``NEEDS``) is what gets installed: every package need has its requirement in
``pyproject.toml``'s ``examples`` extra, and the compatibility matrix's venvs install exactly those
(``scripts/_case_needs.py``, read by ``scripts/matrix.py``). Standard library and pytest only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fsdp_autopatch import cases

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

import _case_needs as case_needs  # noqa: E402
import matrix  # noqa: E402

EXTRA = case_needs.examples_extra()


def test_the_needs_read_without_importing_are_the_cases_own():
    imported = {name: tuple(need for need in getattr(cases.load(name), "NEEDS", ()) if need != "cuda")
                for name in cases.NAMES}
    assert case_needs.case_needs() == {name: needs for name, needs in imported.items() if needs}


def test_the_extra_read_by_pattern_is_what_a_toml_parser_reads():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the script itself runs on 3.9
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert EXTRA == pyproject["project"]["optional-dependencies"]["examples"]


def test_every_package_a_case_needs_is_in_the_examples_extra():
    in_extra = {case_needs.project_name(requirement) for requirement in EXTRA}
    for name, needs in case_needs.case_needs().items():
        for package in needs:
            assert case_needs.project_name(package) in in_extra, (name, package)


def test_the_matrix_installs_the_extras_requirement_of_each_need():
    wanted = {case_needs.project_name(package) for needs in case_needs.case_needs().values() for package in needs}
    assert wanted  # peft_generate_forward_method's peft and transformers, at least
    from_extra = tuple(requirement for requirement in EXTRA if case_needs.project_name(requirement) in wanted)
    assert case_needs.requirements() == from_extra
    assert matrix.TEST_PACKAGES[-len(from_extra):] == from_extra


def test_a_need_without_a_requirement_is_refused_by_case():
    needs = {"my_entry": ("peft", "Some_Package")}
    with pytest.raises(LookupError, match="my_entry's 'Some_Package'"):
        case_needs.requirements(needs, ["peft>=0.17"])
    found = case_needs.requirements(needs, ["some-package==1", "other", "peft>=0.17"])
    assert found == ("some-package==1", "peft>=0.17")  # the extra's order, names compared as pip does
