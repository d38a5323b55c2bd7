"""Where the built-in patches wrap torch, derived from their declarations in the test venv's torch.

Each entry's ``PATCH.targets`` (``fsdp_autopatch.patches.load_patch``, in the catalogue's order,
``fsdp_autopatch._catalogue.ENTRIES``: fixes, guards and policies) names what it replaces: a ``Wrap``'s ``path``
(``"module:Qualified.name"``), applied only where its ``when`` holds, and for ``everywhere``
targets also every loaded ``torch.*`` module holding the same function
(``fsdp_autopatch._patching.import_sites``). ``Add`` targets add an attribute torch lacks: no wrapper.

``when`` and the copies depend on the torch release, so the table is computed once per session by
a child of the torch venv (its torch, the plugin from the wheel, the plugin switched off so that
torch is as it ships): :func:`learn` (the ``torch_venv`` fixture calls it). A new patch, target or
copy is probed without any change here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import pytest

# Run in the torch venv with FSDP_AUTOPATCH_ENABLED=0: torch's FSDP2 untouched, the plugin's code
# imported only to read its declarations. Python 3.9 syntax (FSDP_TEST_PYTHON).
DERIVE = r'''
import json
import torch.distributed.fsdp
from fsdp_autopatch._catalogue import ENTRIES
from fsdp_autopatch._patching import import_sites, original_of, resolve
from fsdp_autopatch._process import HOOK_TARGET, trigger_of
from fsdp_autopatch._spec import Wrap
from fsdp_autopatch.patches import load_patch

FSDP2 = "torch.distributed.fsdp._fully_shard."


def point_name(module, owner, attribute):
    """FSDPParam.to_accumulated_grad_if_needed, _fsdp_collectives.foreach_reduce"""
    return f"{owner or (module[len(FSDP2):] if module.startswith(FSDP2) else module)}.{attribute}"


points, by_patch = {}, {}
for patch_name in [entry.name for entry in ENTRIES]:
    mine = []
    # an entry that waits for another module (DCP's state_dict) is pending in the probes, which
    # import FSDP2 only: it wraps nothing there
    targets = load_patch(patch_name).targets if trigger_of(patch_name) == HOOK_TARGET else ()
    for target in targets:
        if not isinstance(target, Wrap) or (target.when is not None and not target.when()):
            continue
        module, _, qualified = target.path.partition(":")
        owner, _, attribute = qualified.rpartition(".")
        places = [(module, owner or None, attribute)]
        if target.everywhere:
            original = original_of(*resolve(target.path))
            copies = {(site.__name__, None, name) for site, name in import_sites(original)}
            places += sorted(copies - set(places))
        for place in places:
            name = point_name(*place)
            if points.setdefault(name, list(place)) != list(place):
                raise SystemExit(f"two places named {name}: {points[name]} and {place}")
            mine.append(name)
    by_patch[patch_name] = mine
print(json.dumps({"points": points, "by_patch": by_patch}))
'''

# How many of our wrappers sit around ``obj``: wrapt FunctionWrappers (torch itself never uses
# wrapt) and the plain functions of ``Wrap(proxy=False)`` targets, which carry
# ``__fsdp_autopatch_replacement__`` (torch's own functools.wraps decorators also set __wrapped__).
# Source for the probe programs; ``wrapt`` is whatever the process has in sys.modules.
DEPTH = r'''
def _depth(obj):
    wrapper_type = getattr(__import__("sys").modules.get("wrapt"), "FunctionWrapper", None)
    depth = 0
    while (wrapper_type is not None and isinstance(obj, wrapper_type)) or (
        getattr(obj, "__fsdp_autopatch_replacement__", False) is True
    ):
        depth, obj = depth + 1, obj.__wrapped__
    return depth
'''


class WrapTable(NamedTuple):
    # point name -> (module, owner class's qualified name or None, attribute)
    points: dict[str, tuple[str, str | None, str]]
    # patch name -> the points it wraps when applied (once each), in the order of its targets
    by_patch: dict[str, tuple[str, ...]]


_learned: list[WrapTable] = []


def learn(venv, timeout: float) -> WrapTable:
    """Compute the table in ``venv`` (an ``_install_support.Venv`` with torch and the plugin)."""
    result = venv.py(DERIVE, env={"FSDP_AUTOPATCH_ENABLED": "0"}, timeout=timeout)
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and lines, f"deriving the wrap points failed:\n{result.stdout}\n{result.stderr}"
    data = json.loads(lines[-1])
    table = WrapTable(
        {name: tuple(place) for name, place in data["points"].items()},
        {name: tuple(points) for name, points in data["by_patch"].items()},
    )
    _learned[:] = [table]
    return table


def table() -> WrapTable:
    if not _learned:
        pytest.fail("the wrap points are learned by the torch_venv fixture: request it first", pytrace=False)
    return _learned[0]


def wrap_points() -> dict[str, tuple[str, str | None, str]]:
    """Every torch attribute a built-in patch wraps on this torch: name -> where it is."""
    return dict(table().points)


def applied_entries(report: Mapping) -> dict[str, str]:
    """A registry report's status per entry: each fix's and guard's, and each policy's that is switched
    on (a policy left off has no record), since a policy's wrappers sit on torch's attributes beside
    the fixes' and guards'."""
    patches = {p["name"]: p["status"] for p in report["patches"]}
    policies = {p["name"]: p["status"] for p in report.get("policy_records", ())}
    return {**patches, **policies}


def expected_wrappers(status: Mapping[str, str], missing: Sequence[str] = ()) -> dict[str, object]:
    """How many wrappers each probed attribute carries given ``status`` (one per applied entry that
    wraps it: :func:`applied_entries` of a report); ``None`` for the attributes in ``missing`` (a
    point's name, or its owner's: ``"FSDPParamGroup"`` is every ``FSDPParamGroup.*`` point)."""
    expected: dict[str, object] = {}
    for name, points in table().by_patch.items():
        for point in points:
            expected[point] = expected.get(point, 0) + (status.get(name) == "applied")
    gone = [point for point in expected if point in missing or point.rpartition(".")[0] in missing]
    expected.update(dict.fromkeys(gone))
    return expected
