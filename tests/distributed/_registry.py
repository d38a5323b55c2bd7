"""The one registry of the rank-side scenarios of ``tests/distributed``, and how a rank finds one.

A scenario is a function of a ``Ctx`` (``_dist_common``) that every rank of a job runs; a test
starts it by name, ``_dist_launcher.run_ranks("<name>", ...)``, whose ranks all run the one rank
entry point, ``python _rank.py <name> <result file> <json args>``.

To add a new patch's scenarios, add ONE module to this folder, named ``_<patch>_scenarios.py``
(next to its tests, ``test_dist_<patch>.py``), and decorate each scenario with a literal name::

    from _registry import scenario

    @scenario("my_patch")            # the gloo world and a 1-D CPU mesh (ctx.mesh) are made first
    def sc_my_patch(ctx): ...

    @scenario("my_patch:fake", gloo=False)  # a world in one process: the scenario makes its own
    def sc_my_patch_fake(ctx): ...

A patch's scenarios are named after it: ``<patch>``, and ``<patch>:<variant>`` for more than one.
Its smallest training is not here but in its case (``fsdp_autopatch.cases.<patch>``), which
``test_dist_cases.py`` runs with the patch off and on; a patch's scenarios are its variants.

Nothing else is edited: no list, no ``__main__``, no ``script=``. ``find(name)`` looks for
``@scenario("<name>")`` in every ``_*_scenarios.py`` of this folder (read with ``ast``, not
imported) and imports only the module that declares it, so a rank imports what its scenario needs
and nothing more (some modules must be imported before FSDP2 is: ``_clip_grad_norm_multi_mesh``
binds ``clip_grad_norm_`` early). A name that is not a literal is still found: then every module
is imported. A name declared twice raises. Shared models, data plans and references belong in
``_dist_common``; what only one patch uses stays in its module.
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
PATTERN = "_*_scenarios.py"


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[Any], None]
    gloo: bool  # True: the rank entry makes the gloo world and ctx.mesh before running it
    module: str


SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, *, gloo: bool = True) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    """Register the decorated function as scenario ``name`` (see the module docstring)."""

    def register(run: Callable[[Any], None]) -> Callable[[Any], None]:
        known = SCENARIOS.get(name)
        if known is not None and known.module != run.__module__:
            raise ValueError(f"scenario {name!r} declared in {known.module} and in {run.__module__}")
        SCENARIOS[name] = Scenario(name, run, gloo, run.__module__)
        return run

    return register


def modules() -> list[str]:
    """The scenario modules of this folder, by name, sorted."""
    return sorted(path.stem for path in HERE.glob(PATTERN))


def declared_in(module: str) -> list[str]:
    """The names ``module`` declares with ``@scenario("<literal>")``, read from its source."""
    tree = ast.parse((HERE / f"{module}.py").read_text(), f"{module}.py")
    names = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for decorator in node.decorator_list:
            if (
                isinstance(decorator, ast.Call)
                and getattr(decorator.func, "id", getattr(decorator.func, "attr", None)) == "scenario"
                and decorator.args
                and isinstance(decorator.args[0], ast.Constant)
                and isinstance(decorator.args[0].value, str)
            ):
                names.append(decorator.args[0].value)
    return names


def find(name: str) -> Scenario:
    """Scenario ``name``, importing the module that declares it (every module if none does literally)."""
    if name not in SCENARIOS:
        owners = [module for module in modules() if name in declared_in(module)]
        if len(owners) > 1:
            raise ValueError(f"scenario {name!r} declared in {', '.join(owners)}")
        for module in owners or modules():
            importlib.import_module(module)
    try:
        return SCENARIOS[name]
    except KeyError:
        raise KeyError(f"no scenario {name!r} in {HERE}/{PATTERN}; known: {sorted(SCENARIOS)}") from None
