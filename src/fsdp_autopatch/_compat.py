"""Helpers the patches share: torch version parsing, FSDP2 internals lookup, atomic patching.

Imported only once torch's FSDP2 is being imported, so torch, wrapt and packaging are fair game.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Callable, Iterable, NamedTuple

import wrapt
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

FSDP2_PACKAGE = "torch.distributed.fsdp._fully_shard"

# The releases whose FSDP2 internals were read and tested (docs/compatibility.md). Inside this
# range a patch's version range and its structural check must agree; outside it (2.16 nightlies,
# unparsable versions) the structural check decides alone.
MEASURED_RELEASES = SpecifierSet(">=2.6,<2.16")

STRUCTURE = "structural check"
VERSION_AND_STRUCTURE = "version range and structural check"


class Verdict(NamedTuple):
    """A patch's answer to "needed here?".

    ``status`` is "needed", "not_needed" or "unsupported"; ``decided_by`` says which check
    decided it (:data:`STRUCTURE` or :data:`VERSION_AND_STRUCTURE`).
    """

    status: str
    reason: str
    decided_by: str = STRUCTURE


def needed(reason: str) -> Verdict:
    return Verdict("needed", reason)


def not_needed(reason: str) -> Verdict:
    return Verdict("not_needed", reason)


def unsupported(reason: str) -> Verdict:
    return Verdict("unsupported", reason)


def decide(structural: Verdict, version: Version | None, affected: SpecifierSet, bug: str) -> Verdict:
    """Combine a patch's structural check with the releases known to have its bug.

    * structure unsupported: the internals the patch wraps are not there; torch stays untouched.
    * a release outside :data:`MEASURED_RELEASES` (or an unparsable version): the structure decides.
    * a measured release where both agree: that verdict, decided by both.
    * the structure shows the buggy code on a release thought fixed: patch it (the wrapper only
      changes behaviour where the bug would strike), decided by the structure.
    * the structure shows no bug on a release known to have it (a vendor build?): we cannot tell
      where the bug went, so torch is left untouched ("unsupported").
    """
    where = describe(version)
    if structural.status == "unsupported":
        return Verdict("unsupported", f"{where}: {structural.reason}", STRUCTURE)
    if version is None or version not in MEASURED_RELEASES:
        note = f"outside the measured releases {range_text(MEASURED_RELEASES)}"
        return Verdict(structural.status, f"{where}: {structural.reason} ({note})", STRUCTURE)
    has_bug = version in affected
    known = f"{bug}: torch {range_text(affected)}"
    if has_bug == (structural.status == "needed"):
        return Verdict(
            structural.status, f"{where}: {structural.reason}; the version range agrees ({known})", VERSION_AND_STRUCTURE
        )
    if structural.status == "needed":
        return Verdict("needed", f"{where}: {structural.reason}, outside the version range ({known})", STRUCTURE)
    return Verdict(
        "unsupported",
        f"{where}: {structural.reason}, inside the version range ({known}): this build differs from the "
        "measured release, torch left untouched",
        STRUCTURE,
    )


def range_text(specifiers: SpecifierSet) -> str:
    """``>=2.6, <2.15`` (lower bound first; SpecifierSet's own str sorts ``<`` first)."""
    return ", ".join(sorted((str(s) for s in specifiers), key=lambda s: (not s.startswith(">"), s)))


# --- torch version ---------------------------------------------------------------------------


def parse_torch_version(raw: str) -> Version | None:
    """The release a torch version string belongs to, or None if it is not PEP 440.

    Local parts and pre-releases count as the release they lead to: ``2.13.0+cpu`` -> 2.13.0,
    ``2.9.0.dev20250801+cu128`` -> 2.9.0, NGC's ``2.8.0a0+git1234`` -> 2.8.0. A nightly of 2.15
    is therefore judged as 2.15, which is why every patch also checks the internals themselves.
    """
    try:
        return Version(Version(raw).base_version)
    except (InvalidVersion, TypeError):
        return None


def torch_release() -> Version | None:
    torch = sys.modules.get("torch")
    return parse_torch_version(getattr(torch, "__version__", "")) if torch else None


def describe(version: Version | None) -> str:
    return f"torch {version}" if version is not None else "torch (unparsable version)"


def before(version: Version | None, release: str) -> bool:
    """``version < release``; an unparsable version counts as "not before" (structure decides)."""
    return version is not None and version < Version(release)


# --- FSDP2 internals -------------------------------------------------------------------------


def fsdp_module(name: str) -> ModuleType:
    """A submodule of torch's FSDP2 package, e.g. ``fsdp_module("_fsdp_param_group")``."""
    full_name = f"{FSDP2_PACKAGE}.{name}"
    module = sys.modules.get(full_name)
    if module is None:
        import importlib

        module = importlib.import_module(full_name)
    return module


def class_attr(cls: type, name: str) -> Any:
    """The attribute as defined on the class (no descriptor binding), or None."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return None


def code_of(func: Any) -> Any:
    """The code object of the innermost function behind wrappers (wrapt, functools.wraps,
    ``torch._dynamo.disable``), or None."""
    for _ in range(10):
        inner = getattr(func, "__wrapped__", None)
        if inner is None:
            break
        func = inner
    return getattr(func, "__code__", None)


def reads_names(func: Any, *names: str) -> bool:
    """Whether a function's own bytecode refers to all ``names``: as attributes or globals, or as
    string constants (``hasattr(fsdp_param, "_unsharded_param")`` names it only as a constant)."""
    code = code_of(func)
    if code is None:
        return False
    known = set(code.co_names) | {c for c in code.co_consts if isinstance(c, str)}
    return all(name in known for name in names)


def has_string_constant(func: Any, fragment: str) -> bool:
    """Whether a function's bytecode holds a string constant containing ``fragment``."""
    code = code_of(func)
    return code is not None and any(isinstance(c, str) and fragment in c for c in code.co_consts)


def first_parameters(func: Any, count: int) -> tuple[str, ...]:
    code = code_of(func)
    return tuple(code.co_varnames[:count]) if code is not None else ()


def state_param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's ``FSDPParamGroup``s: torch >= 2.12 keeps a list, older ones keep one or None."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


# --- atomic, reversible patching ---------------------------------------------------------------

_MISSING = object()
# patch name -> the (owner, attribute, original) triples it replaced, in order
_applied: dict[str, list[tuple[Any, str, Any]]] = {}


def is_applied(patch_name: str) -> bool:
    return patch_name in _applied


def wrap(original: Any, wrapper: Callable[..., Any]) -> Any:
    """A wrapt ``FunctionWrapper``: keeps the original's name, docstring and signature."""
    return wrapt.FunctionWrapper(original, wrapper)


def replace_all(patch_name: str, replacements: Iterable[tuple[Any, str, Any]]) -> None:
    """Set every ``owner.attribute = value``, all or nothing; idempotent per patch name.

    If any assignment fails, the ones already made are undone before the error propagates, so
    half-applied is never a state torch is left in.
    """
    if patch_name in _applied:
        return
    done: list[tuple[Any, str, Any]] = []
    try:
        for owner, attribute, value in replacements:
            original = vars(owner).get(attribute, _MISSING)
            setattr(owner, attribute, value)
            done.append((owner, attribute, original))
    except BaseException:
        _undo(done)
        raise
    _applied[patch_name] = done


def revert(patch_name: str) -> None:
    """Undo one patch (tests). Revert patches in the reverse order of application."""
    _undo(_applied.pop(patch_name, []))


def _undo(done: list[tuple[Any, str, Any]]) -> None:
    for owner, attribute, original in reversed(done):
        if original is _MISSING:
            try:
                delattr(owner, attribute)
            except AttributeError:
                pass
        else:
            setattr(owner, attribute, original)
