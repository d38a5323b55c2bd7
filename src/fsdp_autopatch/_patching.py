"""Apply and revert a declared patch: resolve its targets, replace all or nothing, undo in reverse.

Imported only once torch's FSDP2 is being imported, so wrapt is fair game. Every patch goes through
:func:`apply` and :func:`revert`; no patch module replaces anything itself.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from typing import Any, Callable

import wrapt

from ._spec import Add, Patch, Wrap

_MISSING = object()
# patch name -> the (owner, attribute, original) triples it replaced, in order
_applied: dict[str, list[tuple[Any, str, Any]]] = {}


def resolve(path: str) -> tuple[Any, str]:
    """``"pkg.module:Class.attr"`` -> ``(Class, "attr")``; ``"pkg.module:func"`` -> ``(module, "func")``.

    The module is imported if needed (it is part of torch, already loading). Raises ImportError or
    AttributeError when the internals are not there.
    """
    module_name, _, qualified = path.partition(":")
    owner: Any = sys.modules.get(module_name) or importlib.import_module(module_name)
    *parents, attribute = qualified.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, attribute


def original_of(owner: Any, attribute: str) -> Any:
    """The attribute as defined on ``owner`` or, for a class, its MRO (no descriptor binding)."""
    for klass in getattr(owner, "__mro__", (owner,)):
        if attribute in vars(klass):
            return vars(klass)[attribute]
    raise AttributeError(f"{getattr(owner, '__name__', owner)!r} has no attribute {attribute!r}")


def wrap(original: Any, wrapper: Callable[..., Any]) -> Any:
    """A wrapt ``FunctionWrapper``: keeps the original's name, docstring and signature."""
    return wrapt.FunctionWrapper(original, wrapper)


def replacements(patch: Patch) -> list[tuple[Any, str, Any]]:
    """Every ``(owner, attribute, new value)`` the patch sets, computed before anything is set."""
    planned: list[tuple[Any, str, Any]] = []
    for target in patch.targets:
        if target.when is not None and not target.when():
            continue
        owner, attribute = resolve(target.path)
        if isinstance(target, Add):
            planned.append((owner, attribute, target.factory(owner)))
        elif isinstance(target, Wrap):
            original = original_of(owner, attribute)
            value = wrap(original, target.wrapper)
            copies = import_sites(original, attribute) if target.everywhere else []
            planned += [(site, attribute, value) for site in [owner, *(m for m in copies if m is not owner)]]
        else:
            raise TypeError(f"{patch.name}: unknown target {target!r}")
    return planned


def import_sites(original: Any, attribute: str) -> list[Any]:
    """Every loaded ``torch.*`` module that holds ``original`` under ``attribute`` (``from x import f``)."""
    return [
        module
        for name, module in list(sys.modules.items())
        if (name == "torch" or name.startswith("torch."))
        and module is not None
        and vars(module).get(attribute) is original
    ]


def describe(planned: Iterable[tuple[Any, str, Any]], patch_name: str = "") -> str:
    """``FSDPParam.to_accumulated_grad_if_needed, FSDPParamGroup.post_backward (over
    unused_param_reduction's wrapper)``: what is replaced, and which earlier patches it composes with."""
    parts = []
    for owner, attribute, _ in planned:
        others = [name for name in holders(owner, attribute) if name != patch_name]
        over = f" (over {', '.join(others)}'s wrapper)" if others else ""
        parts.append(f"{_short_name(owner)}.{attribute}{over}")
    return ", ".join(parts)


def holders(owner: Any, attribute: str) -> list[str]:
    """The applied patches that replaced ``owner.attribute``, in the order they were applied."""
    return [name for name, done in _applied.items() if any(o is owner and a == attribute for o, a, _ in done)]


def _short_name(owner: Any) -> str:
    name = getattr(owner, "__name__", type(owner).__name__)
    return name.rsplit(".", 1)[-1]


def apply(patch: Patch) -> str:
    """Apply every target of ``patch``, all or nothing; idempotent. Returns what was replaced."""
    if patch.name in _applied:
        return describe(_applied[patch.name], patch.name)
    planned = replacements(patch)
    description = describe(planned, patch.name)
    replace_all(patch.name, planned)
    return description


def replace_all(patch_name: str, planned: Iterable[tuple[Any, str, Any]]) -> None:
    """Set every ``owner.attribute = value``, all or nothing; idempotent per patch name.

    If any assignment fails, the ones already made are undone before the error propagates, so
    half-applied is never a state torch is left in.
    """
    if patch_name in _applied:
        return
    done: list[tuple[Any, str, Any]] = []
    try:
        for owner, attribute, value in planned:
            original = vars(owner).get(attribute, _MISSING)
            setattr(owner, attribute, value)
            done.append((owner, attribute, original))
    except BaseException:
        _undo(done)
        raise
    _applied[patch_name] = done


def is_applied(patch_name: str) -> bool:
    return patch_name in _applied


def revert(patch_name: str) -> None:
    """Undo one patch (tests). Revert patches in the reverse order of application."""
    _undo(_applied.pop(patch_name, []))


def revert_all() -> None:
    """Undo every applied patch, the last applied first (wrappers over wrappers unwind in order)."""
    for name in reversed(list(_applied)):
        revert(name)


def _undo(done: list[tuple[Any, str, Any]]) -> None:
    for owner, attribute, original in reversed(done):
        if original is _MISSING:
            try:
                delattr(owner, attribute)
            except AttributeError:
                pass
        else:
            setattr(owner, attribute, original)
