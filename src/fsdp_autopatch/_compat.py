"""FSDP2 internals, walked in one place: torch's version, "needed here?", and what a patch reads.

* the version: which release a torch build belongs to, and :func:`decide`, which combines a
  patch's structural check with the releases measured to have its bug;
* inspection: an attribute as a class defines it, which names a function's bytecode reads;
* FSDP2's object graph, as every patch needs it: a state's param groups, a group's reduction
  domain, whether this rank holds a local gradient for a parameter. Patches that must agree
  (the unused-param fill and the restore) read these from here, never on their own.

Imported only once torch's FSDP2 is being imported, so packaging is fair game; torch itself is
never imported here (the patches' objects are handed in).

Public, re-exported from ``fsdp_autopatch`` for third-party structural checks (stable, see
docs/guides/writing-a-patch.md "What is stable"): :func:`fsdp_module`, :func:`fsdp_class`,
:func:`class_attr`, :func:`innermost`, :func:`has_parameters`, :func:`reads_names`.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from . import _process
from ._spec import STRUCTURE, VERSION_AND_STRUCTURE, Need, Verdict

FSDP2_PACKAGE = _process.HOOK_TARGET

# The releases whose FSDP2 internals were read and tested (docs/compatibility.md). Inside this
# range a patch's version range and its structural check must agree; outside it (2.16 nightlies,
# unparsable versions) the structural check decides alone.
MEASURED_RELEASES = SpecifierSet(">=2.6,<2.16")


def decide(structural: Verdict, version: Version | None, affected: SpecifierSet, bug: str = "the bug") -> Verdict:
    """Combine a patch's structural check with the releases known to have its bug.

    * structure unsupported: the internals the patch wraps are not there; torch stays untouched.
    * a release outside :data:`MEASURED_RELEASES` (or an unparsable version): the structure decides.
    * a measured release where both agree: that verdict, decided by both.
    * the structure shows the buggy code on a release thought fixed: patch it (the wrapper only
      changes behaviour where the bug would strike), decided by the structure.
    * the structure shows no bug on a release known to have it (a vendor build?): we cannot tell
      where the bug went, so torch is left untouched ("unsupported"), unless the structural
      verdict is conclusive (torch's own fix is there, or nothing for the patch to act on).
    """
    where = version_text(version)
    if structural.status == Need.UNSUPPORTED:
        return Verdict(Need.UNSUPPORTED, f"{where}: {structural.reason}", STRUCTURE)
    if version is None or version not in MEASURED_RELEASES:
        note = f"outside the measured releases {range_text(MEASURED_RELEASES)}"
        return Verdict(structural.status, f"{where}: {structural.reason} ({note})", STRUCTURE)
    has_bug = version in affected
    known = f"{bug}: torch {range_text(affected)}"
    if has_bug == (structural.status == Need.NEEDED):
        return Verdict(
            structural.status,
            f"{where}: {structural.reason}; the version range agrees ({known})",
            VERSION_AND_STRUCTURE,
        )
    if structural.status == Need.NEEDED:
        return Verdict(Need.NEEDED, f"{where}: {structural.reason}, outside the version range ({known})", STRUCTURE)
    if structural.conclusive:
        return Verdict(structural.status, f"{where}: {structural.reason}", STRUCTURE)
    return Verdict(
        Need.UNSUPPORTED,
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
    """The release of the torch in this process (or installed), parsed; None if unknown."""
    raw = _process.torch_version()
    return parse_torch_version(raw) if raw is not None else None


def version_text(version: Version | None, raw: str | None = None) -> str:
    """``torch 2.13.0`` for a release (``+cpu``/``+cu128`` builds included); a pre-release or dev
    build is shown as it calls itself, with the release it counts as: ``torch 2.13.0a0+nv26.06
    (counted as 2.13.0)`` (NGC's vendor builds), ``torch 2.16.0.dev20261201+cpu (counted as 2.16.0)``."""
    if version is None:
        return "torch (unparsable version)"
    raw = _process.torch_version() if raw is None else raw
    try:
        shown = Version(raw) if raw else None
    except InvalidVersion:
        shown = None
    if shown is not None and Version(shown.base_version) == version and (shown.is_prerelease or shown.is_devrelease):
        return f"torch {raw} (counted as {version})"
    return f"torch {version}"


def before(version: Version | None, release: str) -> bool:
    """``version < release``; an unparsable version counts as "not before" (structure decides)."""
    return version is not None and version < Version(release)


# --- FSDP2 internals -------------------------------------------------------------------------


def fsdp_module(name: str) -> ModuleType:
    """A submodule of torch's FSDP2 package (``torch.distributed.fsdp._fully_shard``), imported if
    needed, e.g. ``fsdp_module("_fsdp_collectives")``. ``ImportError`` when this torch lacks it."""
    full_name = f"{FSDP2_PACKAGE}.{name}"
    module = sys.modules.get(full_name)
    if module is None:
        import importlib

        module = importlib.import_module(full_name)
    return module


def class_attr(cls: type, name: str) -> Any:
    """The attribute as the class, or the first class of its MRO that has it, defines it: the
    function itself, not a bound method (no descriptor binding); None when no class defines it."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return None


def innermost(func: Any) -> Any:
    """Torch's function behind any wrappers (wrapt, functools.wraps, ``torch._dynamo.disable``,
    fsdp-autopatch's own and other distributions' patches, a wrapper's ``wrapped``),
    and behind a framework's monkey-patch made before ours without ``functools.wraps`` (NeMo
    Automodel's ``fsdp_patches``: a function of its own module whose closure holds torch's)."""
    for _ in range(10):
        inner = getattr(func, "__wrapped__", None)
        if inner is None:
            inner = _closed_over_torch_function(func)
        if inner is None:
            break
        func = inner
    return func


def _closed_over_torch_function(func: Any) -> Any:
    """The one torch function a function outside torch holds in its closure, or None."""
    if _is_torch_own(func):
        return None
    held = []
    for cell in getattr(func, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(value) and not isinstance(value, type) and _is_torch_own(value):
            held.append(value)
    return held[0] if len(held) == 1 else None


def _is_torch_own(func: Any) -> bool:
    module = getattr(func, "__module__", None) or ""
    return module == "torch" or module.startswith("torch.")


def code_of(func: Any) -> Any:
    """The code object of the innermost function behind wrappers, or None."""
    return getattr(innermost(func), "__code__", None)


def reads_names(func: Any, *names: str) -> bool:
    """Whether the bytecode of torch's function behind ``func`` (:func:`innermost`) refers to all
    ``names``: as attributes or globals, or as string constants (``hasattr(fsdp_param,
    "_unsharded_param")`` names it only as a constant). False when there is no bytecode to read."""
    code = code_of(func)
    if code is None:
        return False
    known = set(code.co_names) | {c for c in code.co_consts if isinstance(c, str)}
    return all(name in known for name in names)


def has_string_constant(func: Any, fragment: str) -> bool:
    """Whether a function's bytecode holds a string constant containing ``fragment``."""
    code = code_of(func)
    return code is not None and any(isinstance(c, str) and fragment in c for c in code.co_consts)


def names_read(code: Any) -> set:
    """The names a code object reads, its comprehensions and nested functions included (a function
    that reads ``t.full_tensor()`` inside a list comprehension reads it in a nested code object);
    empty for None."""
    names = set(code.co_names) if code is not None else set()
    for const in code.co_consts if code is not None else ():
        if isinstance(const, type(code)):
            names |= names_read(const)
    return names


def nested_code(func: Any, name: str) -> Any:
    """The code object of a function defined inside ``func`` (at any depth) under ``name``, or
    None: a closure torch builds per call (a hook factory's inner hook) is only visible there."""
    pending = [code_of(func)]
    while pending:
        code = pending.pop()
        for const in code.co_consts if code is not None else ():
            if isinstance(const, type(code)):
                if const.co_name == name:
                    return const
                pending.append(const)
    return None


def has_parameters(func: Any, *names: str) -> bool:
    """Whether ``func``'s signature has every parameter in ``names`` (by name, any kind); False when
    it has no signature to read. What a ``Wrap.reads`` must pass (wrappers keep the signature)."""
    import inspect

    try:
        parameters = inspect.signature(func).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin, not a function)
        return False
    return all(name in parameters for name in names)


def first_parameters(func: Any, count: int) -> tuple[str, ...]:
    code = code_of(func)
    return tuple(code.co_varnames[:count]) if code is not None else ()


def fsdp_class(module: str, name: str) -> type:
    """A class of torch's FSDP2, e.g. ``fsdp_class("_fsdp_param_group", "FSDPParamGroup")``;
    ``ImportError`` / ``AttributeError`` when this torch lacks it (a check records ``unsupported``)."""
    return getattr(fsdp_module(module), name)


def state_param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's ``FSDPParamGroup``s: torch >= 2.12 keeps a list, older ones keep one or None."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def all_param_groups(root_state: Any) -> list[Any]:
    """Every ``FSDPParamGroup`` under a root state, in module-tree order (the same on every rank)."""
    return [group for state in root_state._state_ctx.all_states for group in state_param_groups(state)]


def mesh_process_groups(group: Any) -> tuple[Any, ...]:
    """A unit's process groups: its shard group, plus the replicate group under HSDP."""
    mesh_info = group.mesh_info
    found = (getattr(mesh_info, attribute, None) for attribute in ("shard_process_group", "replicate_process_group"))
    return tuple(process_group for process_group in found if process_group is not None)


def reduction_domain(group: Any) -> tuple[Any, ...]:
    """The process groups a unit's gradients are reduced over (:func:`mesh_process_groups`); groups
    of one rank are left out (nothing to reduce with)."""
    return tuple(process_group for process_group in mesh_process_groups(group) if process_group.size() > 1)


def unsharded_param(fsdp_param: Any) -> Any:
    """The parameter's unsharded tensor, or None if its unit never ran forward on this rank
    (FSDP2 creates ``_unsharded_param`` lazily at the first unshard)."""
    return vars(fsdp_param).get("_unsharded_param")


def has_local_grad(fsdp_param: Any) -> bool:
    """Whether this rank's backward produced a gradient for the parameter since its last reduction:
    an unsharded gradient, or one accumulated in ``reduce_dtype`` (gradient accumulation).

    Usage is gradient *presence*, never a zero value. The unused-param fill and the restore both
    decide from this, so they always agree on what "unused" means.
    """
    unsharded = unsharded_param(fsdp_param)
    if unsharded is None:
        return False
    return unsharded.grad is not None or getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None
