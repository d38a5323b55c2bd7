"""Patches other installed distributions declare: the entry-point group ``fsdp_autopatch.patches``.

A framework ships its FSDP2 fix as a :class:`fsdp_autopatch.Patch` and declares it in its own
``pyproject.toml``::

    [project.entry-points."fsdp_autopatch.patches"]
    keep_moe_tags = "my_framework.fsdp_fixes:PATCH"

The entry point's name is the patch's name. Discovery reads installed metadata only, when torch's
FSDP2 is imported (never at interpreter start), and imports nothing: a distribution's module is
imported when its patch is applied, inside the same isolation as the built-in patches.

Order: built-in patches first, then third-party ones sorted by distribution name and entry-point
name. A name that clashes with a built-in patch or policy, or that two distributions declare, is
refused (every claimant, so that no install order decides), recorded as ``failed`` under
``<distribution>:<name>``.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Callable, NamedTuple

from ._spec import FIX, GUARD, Patch

GROUP = "fsdp_autopatch.patches"
_VALID_NAME = re.compile(r"^[a-z][a-z0-9_]*$")  # also a valid part of FSDP_AUTOPATCH_<NAME>_ENABLED


class External(NamedTuple):
    """One patch another distribution declares."""

    name: str
    provider: str  # "<distribution> <version>"
    load: Callable[[], Any]  # imports the distribution's module and returns its declaration


class Refused(NamedTuple):
    key: str  # "<distribution>:<name>", the registry record that says why
    provider: str
    reason: str


def discover(builtin: tuple[str, ...]) -> tuple[list[External], list[Refused]]:
    """The usable third-party patches, in application order, and the refused ones."""
    found = sorted(_entry_points(), key=lambda ep: (_distribution(ep)[0].lower(), ep.name))
    claimants: dict[str, int] = {}
    for ep in found:
        claimants[ep.name] = claimants.get(ep.name, 0) + 1
    usable, refused = [], []
    for ep in found:
        dist, version = _distribution(ep)
        provider = f"{dist} {version}"
        why = _why_refused(ep.name, builtin, claimants)
        if why:
            refused.append(Refused(f"{dist}:{ep.name}", provider, f"refused: {why}"))
        else:
            usable.append(External(ep.name, provider, ep.load))
    return usable, refused


def _why_refused(name: str, builtin: tuple[str, ...], claimants: dict[str, int]) -> str:
    if not _VALID_NAME.match(name):
        return f"the name {name!r} is not lowercase letters, digits and underscores"
    if name in builtin:
        return f"the name {name!r} is a built-in patch or policy of fsdp-autopatch"
    if claimants[name] > 1:
        return f"{claimants[name]} installed distributions declare a patch named {name!r}"
    return ""


def validate(declared: Any, external: External) -> Patch:
    """The declaration, checked up front; ``TypeError`` / ``ValueError`` say what is wrong."""
    if not isinstance(declared, Patch):
        raise TypeError(f"the entry point gives a {type(declared).__name__}, not a fsdp_autopatch.Patch")
    if declared.name != external.name:
        raise ValueError(f"the declaration is named {declared.name!r} but its entry point {external.name!r}")
    if declared.kind not in (FIX, GUARD) or declared.variable is not None:
        raise ValueError(
            "a third-party patch is a fix or a guard with its derived toggle (kind='fix' or 'guard', no variable)"
        )
    if not declared.targets:
        raise ValueError("the declaration has no targets")
    return declared


def _entry_points() -> list[Any]:
    if sys.version_info >= (3, 10):
        from importlib.metadata import entry_points
    else:  # 3.9's entry_points() has no group selection
        from importlib_metadata import entry_points
    return list(entry_points(group=GROUP))


def _distribution(ep: Any) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "unknown distribution", "?"
    return str(dist.metadata["Name"]), str(dist.version)
