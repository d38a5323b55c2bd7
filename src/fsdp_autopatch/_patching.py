"""Apply and revert a declared patch: resolve its targets, replace all or nothing, undo in reverse.

Imported only once torch's FSDP2 is being imported, so wrapt is fair game. Every patch goes through
:func:`apply` and :func:`revert`; no patch module replaces anything itself. Every wrapper is
installed inside ``_isolation.isolate`` (call-time isolation: our exceptions never reach the caller),
with the parameters it reads bound by name against the signature of the function it wraps.
:func:`contract_problem` says, before anything is replaced, whether torch's functions still offer
what the declaration relies on (the parameters its wrappers read, call sites that can be replaced).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Iterable
from typing import Any, Callable

import wrapt

from . import _hiding, _isolation, _tracebacks
from ._registry import REGISTRY
from ._spec import AS_TORCH, TRACED, Add, Patch, Wrap

_MISSING = object()
# patch name -> the (owner, attribute, original) triples it replaced, in order
_applied: dict[str, list[tuple[Any, str, Any]]] = {}
# patch name -> the value it set at each of those places, in the same order (how a revert and
# ``status`` tell ours from a replacement someone else made after us)
_ours: dict[str, list[Any]] = {}
# what reverts left in place: "<owner>.<attribute>: <their value>" (someone replaced ours after us)
left_in_place: list[str] = []
# patch name -> what its module forgets when the patch is reverted (state kept beside its wrappers)
_forgetting: dict[str, Callable[[], None]] = {}


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


def wrap(original: Any, wrapper: Callable[..., Any], proxy: bool = True, method: bool = False) -> Any:
    """``wrapper`` (wrapt's signature) around ``original``: a wrapt ``FunctionWrapper``, which keeps
    the original's name, docstring and signature, or (``proxy=False``) a plain function made with
    ``functools.wraps``, which ``torch.compile`` traces like torch's own (``method``: a function on a
    class, bound to the instance per call as wrapt binds it)."""
    if proxy:
        return wrapt.FunctionWrapper(original, wrapper)

    # torch's error passing through: one frame of ours above torch's, its line saying whose it is
    replacement = functools.wraps(original)(_tracebacks.plain_caller(original, wrapper, method))

    # How a probe tells ours from torch's own functools.wraps decorators (both set __wrapped__).
    replacement.__fsdp_autopatch_replacement__ = True
    replacement.__fsdp_autopatch_wrapper__ = wrapper  # what a revert retires
    return replacement


def is_method(owner: Any, original: Any) -> bool:
    """Whether wrapt binds ``owner.<original>`` to an instance: a function on a class, or an earlier
    patch's wrapper of one (wrapt binds those alike)."""
    return isinstance(owner, type) and not isinstance(original, (staticmethod, classmethod, type))


def binder_for(target: Wrap, owner: Any, original: Any) -> _isolation.Binder:
    """Where the parameters ``target.wrapper`` reads sit, from the real signature of ``original``."""
    return _isolation.Binder(original, target.reads, skip_self=is_method(owner, original))


def replacement_for(patch_name: str, target: Wrap, owner: Any, original: Any) -> Any:
    """The value that replaces ``original``: the target's wrapper, isolated, bound by name."""
    binder = binder_for(target, owner, original) if target.reads else _isolation.NO_BINDER
    wrapper = _isolation.isolate(patch_name, target.wrapper, binder, target.after_torch, target.dynamo)
    hiding = _hiding.hiding_of(original) if target.dynamo == AS_TORCH else None
    if hiding is not None:  # [Note: hidden as torch hides]
        return _hiding.hidden_replacement(original, wrapper, is_method(owner, original), hiding)
    return wrap(original, wrapper, proxy=target.proxy, method=is_method(owner, original))


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
            value = replacement_for(patch.name, target, owner, original)
            copies = import_sites(original) if target.everywhere else []
            planned.append((owner, attribute, value))
            planned += [(site, name, value) for site, name in copies if (site, name) != (owner, attribute)]
        else:
            raise TypeError(f"{patch.name}: unknown target {target!r}")
    return planned


def import_sites(original: Any) -> list[tuple[Any, str]]:
    """Every ``(module, name)`` of a loaded ``torch.*`` module that holds ``original`` itself, under
    any name (``from x import f`` and ``from x import f as g`` alike): found by the object."""
    return _sites_of([original]).get(id(original), [])


def _sites_of(objects: Iterable[Any]) -> dict[int, list[tuple[Any, str]]]:
    """:func:`import_sites` of many objects (by ``id``; each alive while the answer is used) in one
    pass over torch's modules, which is what costs (~8 ms a pass here, and a revert undoes ~80 values)."""
    wanted = {id(value) for value in objects}
    sites: dict[int, list[tuple[Any, str]]] = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "torch" or module_name.startswith("torch.")):
            continue
        for name, value in list(vars(module).items()):
            if id(value) in wanted:
                sites.setdefault(id(value), []).append((module, name))
    return sites


def contract_problem(patch: Patch) -> str | None:
    """What torch no longer offers that the patch's wrappers rely on, or None.

    * a parameter a wrapper reads (``Wrap.reads``) is not in the wrapped function's signature;
    * an ``everywhere`` function is also held where it cannot be replaced (a default argument, a
      closure, a class attribute in torch's FSDP2): ``applied`` must mean every call site torch
      uses goes through the wrapper.
    """
    for target in patch.targets:
        if not isinstance(target, Wrap) or (target.when is not None and not target.when()):
            continue
        owner, attribute = resolve(target.path)
        original = original_of(owner, attribute)
        missing = binder_for(target, owner, original).missing if target.reads else ()
        if missing:
            return f"{_short_name(owner)}.{attribute} has no parameter {', '.join(missing)} (its wrapper reads it)"
        traced = dynamo_problem(target, original)
        if traced:
            return f"{_short_name(owner)}.{attribute}: {traced}"
        hidden = hidden_references(original, owner) if target.everywhere else []
        if hidden:
            return f"{attribute} is also held where it cannot be replaced ({', '.join(hidden)})"
    return None


def dynamo_problem(target: Wrap, original: Any) -> str | None:
    """Why Dynamo could not trace a ``dynamo=TRACED`` wrapper as declared, or None."""
    if target.dynamo not in (AS_TORCH, TRACED):
        return f"Wrap.dynamo {target.dynamo!r} is neither AS_TORCH nor TRACED"
    if target.dynamo != TRACED:
        return None
    if target.proxy:
        return "its wrapper is declared traced by Dynamo but is a wrapt proxy (Dynamo cannot trace one)"
    if _hiding.hiding_of(original) is not None:
        return "torch hides it from Dynamo, and its wrapper is declared traced (it would add graph breaks)"
    return None


def hidden_references(original: Any, owner: Any) -> list[str]:
    """Places in torch's loaded FSDP2 modules that hold ``original`` other than as a module global."""
    package = getattr(owner, "__name__", "").rpartition(".")[0] or "torch.distributed.fsdp"
    found = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(package):
            continue
        for name, value in list(vars(module).items()):
            for holder, held in _held_by(value):
                if held is original and getattr(value, "__module__", None) == module_name:
                    found.append(f"{module_name}.{name}{holder}")
    return found


def _held_by(value: Any) -> list[tuple[str, Any]]:
    """What a module global holds by reference: a function's defaults and closure, a class's
    attributes (one level), a ``functools.partial``'s function."""
    held: list[tuple[str, Any]] = []
    functions = [("", value)]
    if isinstance(value, type):
        functions = [(f".{name}", member) for name, member in list(vars(value).items())]
        held += functions
    for where, function in functions:
        if isinstance(function, functools.partial):
            held.append((f"{where} (partial)", function.func))
        function = getattr(function, "__func__", function)
        for default in (getattr(function, "__defaults__", None) or ()):
            held.append((f"{where} (default)", default))
        for cell in (getattr(function, "__closure__", None) or ()):
            try:
                held.append((f"{where} (closure)", cell.cell_contents))
            except ValueError:  # an empty cell
                continue
    return held


def replaced_text(planned: Iterable[tuple[Any, str, Any]], patch_name: str = "") -> str:
    """``FSDPParam.to_accumulated_grad_if_needed, FSDPParamGroup.post_backward (over
    unused_param_reduction's wrapper)``: what is replaced, and which earlier patches it composes with."""
    planned = list(planned)
    shorts = [f"{_short_name(owner)}.{attribute}" for owner, attribute, _ in planned]
    parts = []
    for (owner, attribute, _), short in zip(planned, shorts):
        others = [name for name in holders(owner, attribute) if name != patch_name]
        over = f" (over {', '.join(others)}'s wrapper)" if others else _over_foreign(owner, attribute, patch_name)
        # the package _fully_shard and its module _fully_shard: two sites, one short name
        shown = short if shorts.count(short) == 1 else f"{getattr(owner, '__name__', short)}.{attribute}"
        parts.append(f"{shown}{over}")
    return ", ".join(parts)


def _over_foreign(owner: Any, attribute: str, patch_name: str) -> str:
    """`` (over <module.function>, not torch's own)`` when someone else replaced the attribute before us."""
    if patch_name in _applied:  # applied: the value before ours is what we recorded
        before = next((o for ow, a, o in _applied[patch_name] if ow is owner and a == attribute), _MISSING)
    else:
        before = vars(owner).get(attribute, _MISSING)
    module = getattr(getattr(before, "__func__", before), "__module__", None) or ""
    if before is _MISSING or module == "torch" or module.startswith("torch.") or _wrapper_of(before) is not None:
        return ""
    return f" (over {qualified_name(before)}, not torch's own)"


def holders(owner: Any, attribute: str) -> list[str]:
    """The applied patches that replaced ``owner.attribute``, in the order they were applied."""
    return [name for name, done in _applied.items() if any(o is owner and a == attribute for o, a, _ in done)]


def _short_name(owner: Any) -> str:
    name = getattr(owner, "__name__", type(owner).__name__)
    return name.rsplit(".", 1)[-1]


def apply(patch: Patch) -> str:
    """Apply every target of ``patch``, all or nothing; idempotent. Returns what was replaced."""
    if patch.name in _applied:
        return replaced_text(_applied[patch.name], patch.name)
    planned = replacements(patch)
    description = replaced_text(planned, patch.name)
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
    ours: list[Any] = []
    try:
        for owner, attribute, value in planned:
            original = vars(owner).get(attribute, _MISSING)
            setattr(owner, attribute, value)
            done.append((owner, attribute, original))
            ours.append(value)
    except BaseException:
        _undo(done, ours, _sites_of(ours))
        raise
    _applied[patch_name] = done
    _ours[patch_name] = ours


def is_applied(patch_name: str) -> bool:
    return patch_name in _applied


def in_force(patch_name: str) -> bool:
    """Applied, and its wrappers have not failed at call time (``_isolation``: they pass through
    to torch from then on): what a patch's own hooks ask before acting."""
    return patch_name in _applied and not _isolation.has_failed(patch_name)


def on_revert(patch_name: str, forget: Callable[[], None]) -> None:
    """``forget()`` runs whenever ``patch_name`` is reverted: a patch module that keeps state
    beside its wrappers (the cross-rank check's compared groups) starts afresh with the patch."""
    _forgetting[patch_name] = forget


def revert(patch_name: str, sites: dict[int, list[tuple[Any, str]]] | None = None) -> None:
    """Undo one patch (tests). Revert patches in the reverse order of application.

    A place where someone else replaced our value after us keeps theirs (a revert of ours never
    undoes theirs; noted in :data:`left_in_place`); our wrapper, should theirs still call it,
    passes every call straight through from then on. ``sites``: :func:`_sites_of` our values, read
    once for many reverts (:func:`revert_all`) and kept up to date by them.
    """
    done, ours = _applied.pop(patch_name, []), _ours.pop(patch_name, [])
    _undo(done, ours, _sites_of(ours) if sites is None else sites)
    _isolation.forget(patch_name)
    if patch_name in _forgetting:
        _forgetting[patch_name]()


def revert_all() -> None:
    """Undo every applied patch, the last applied first (wrappers over wrappers unwind in order),
    and let every module that keeps state beside its wrappers forget it (:func:`on_revert`)."""
    sites = _sites_of(value for values in _ours.values() for value in values)
    for name in [*reversed(list(_applied)), *(name for name in _forgetting if name not in _applied)]:
        revert(name, sites)


def _undo(done: list[tuple[Any, str, Any]], ours: list[Any], sites: dict[int, list[tuple[Any, str]]]) -> None:
    for (owner, attribute, original), value in reversed(list(zip(done, ours))):
        _isolation.retire(_wrapper_of(value))
        installed = vars(owner).get(attribute, _MISSING)
        if installed is not value and installed is not original:
            # replaced after us by someone else: theirs stays (it may hold ours, now inert)
            left_in_place.append(f"{_short_name(owner)}.{attribute}: {qualified_name(installed)}")
            continue
        if original is not _MISSING and installed is not _MISSING and installed is not original:
            # copies made after we applied (torch.distributed.fsdp re-exports fully_shard from the
            # package whose import our hook runs in): they get torch's object back too
            for site, name in sites.get(id(installed), ()):
                if (site, name) != (owner, attribute) and vars(site).get(name) is installed:
                    setattr(site, name, original)
                    sites.setdefault(id(original), []).append((site, name))  # see below
        if original is _MISSING:
            try:
                delattr(owner, attribute)
            except AttributeError:
                pass
        else:
            setattr(owner, attribute, original)
            # every place that now holds ``original``: if it is a wrapper of an earlier patch (ours
            # or another's), that patch's revert comes next and finds its copies here
            sites.setdefault(id(original), []).append((owner, attribute))


def _wrapper_of(value: Any) -> Any:
    """The isolated wrapper inside one of our values: a wrapt proxy's wrapper, or the plain function
    ``wrap(proxy=False)`` made (None for what an ``Add`` target set)."""
    return getattr(value, "_self_wrapper", None) or getattr(value, "__fsdp_autopatch_wrapper__", None)


def qualified_name(value: Any) -> str:
    """``module.qualname`` of a function, method or class (what ``status`` names someone else's by)."""
    value = getattr(value, "__func__", value)
    module = getattr(value, "__module__", None) or "?"
    return f"{module}.{getattr(value, '__qualname__', None) or type(value).__qualname__}"


def holds(outer: Any, inner: Any, depth: int = 6) -> bool:
    """Whether ``outer`` reaches ``inner`` as a wrapper does: through ``__wrapped__``, a bound
    method's function, a ``functools.partial``, its closure or its defaults (a few levels deep)."""
    pending, seen = [(outer, 0)], set()
    while pending:
        value, level = pending.pop()
        if value is inner:
            return True
        if level >= depth or id(value) in seen:
            continue
        seen.add(id(value))
        # a wrapt proxy read off a class is a bound wrapper whose parent is the proxy we set
        reached = [getattr(value, name, None) for name in ("__wrapped__", "__func__", "_self_parent")]
        if isinstance(value, functools.partial):
            reached.append(value.func)
        reached += [held for _, held in _held_by(value) if not isinstance(value, type)]
        pending += [(item, level + 1) for item in reached if item is not None]
    return False


def displaced(patch_name: str) -> list[tuple[str, str, bool]]:
    """The places of an applied patch that no longer hold our value, read now: ``(place, what is
    there, whether it still calls ours)``; empty when every place still holds ours."""
    found: list[tuple[str, str, bool]] = []
    for (owner, attribute, _), value in zip(_applied.get(patch_name, []), _ours.get(patch_name, [])):
        installed = vars(owner).get(attribute, _MISSING)
        if installed is value or any(installed is later for values in _ours.values() for later in values):
            continue  # ours, or another of our patches' wrappers over it (they unwind in order)
        place = f"{getattr(owner, '__name__', _short_name(owner))}.{attribute}"
        what = "nothing" if installed is _MISSING else qualified_name(installed)
        found.append((place, what, installed is not _MISSING and holds(installed, value)))
    return found


REGISTRY.watch_displacement(displaced)
