"""The scenario registry (``_registry``): what a rank finds by name is what the modules declare.

In-process, no ranks: every ``_*_scenarios.py`` declares its scenarios with a literal
``@scenario("<name>")`` (what ``find`` reads without importing), each name once, and ``_rank.py``
is the only rank entry point of this folder.
"""

from __future__ import annotations

import importlib
import re

import _registry


def test_every_scenario_is_declared_literally_once_and_found_in_its_module():
    declared: dict[str, list[str]] = {}
    for module in _registry.modules():
        names = _registry.declared_in(module)
        assert names, f"{module} declares no @scenario(...)"
        for name in names:
            declared.setdefault(name, []).append(module)
        importlib.import_module(module)
    assert {n: m for n, m in declared.items() if len(m) > 1} == {}
    registered = {name: s.module for name, s in _registry.SCENARIOS.items()}
    assert registered == {name: modules[0] for name, modules in declared.items()}
    for name, modules in declared.items():
        assert _registry.find(name).module == modules[0]


def test_an_entrys_scenarios_are_named_after_it():
    """``_<entry>_scenarios.py`` declares ``<entry>`` and ``<entry>:<variant>`` only, so a launch's
    scenario names the entry it tests (``cases``: every entry's case, ``test_dist_cases.py``)."""
    import expected

    for entry in expected.PATCHES:
        module = f"_{entry}_scenarios"
        if (_registry.HERE / f"{module}.py").is_file():
            names = _registry.declared_in(module)
            assert all(name == entry or name.startswith(f"{entry}:") for name in names), (module, names)


def test_the_rank_entry_point_is_the_only_main():
    main = re.compile(r"^if __name__ == .__main__.:", re.M)
    mains = sorted(path.name for path in _registry.HERE.glob("*.py") if main.search(path.read_text()))
    assert mains == ["_rank.py"]
