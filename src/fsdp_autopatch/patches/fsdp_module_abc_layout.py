"""fsdp_module_abc_layout: ``fully_shard`` works on a module class that lists ``abc.ABC`` first.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/fsdp_module_abc_layout.md.

Needed here?
    ``fully_shard`` and torch's class cache (``_fully_shard.cls_to_fsdp_cls``, the dict torch
    looks a class up in before it builds one) exist -> needed (each call still checks whether the
    bug would strike for the classes at hand). Either missing -> unsupported.

The replacement
    A wrapper of ``fully_shard`` that, before torch's function runs, tries torch's own class
    swap on a bare instance of each module class it is given. Only where that raises does it put
    a class of its own into torch's cache, which torch then finds and uses: the same name, the same
    ``__deepcopy__``, and the same method resolution order as torch's class
    (``FSDP<Name>, FSDPModule, Model, ...``, so ``super()``, ``FSDPModule.__new__`` and every
    override behave as torch intends), but with ``Model`` as its layout base, through a
    metaclass (a subclass of ``type(Model)``, ``ABCMeta``) whose ``mro()`` returns that order.
    ``isinstance(m, FSDPModule)`` and ``isinstance(m, Model)`` hold. Classes torch already
    handles reach torch's code unchanged (nothing is added to the cache for them); a class
    where even our class would not fit is left to torch (its ``TypeError``).

Call-time isolation
    Our code runs before torch's ``fully_shard``; should it raise, torch's function runs as without
    the patch (``_isolation``). A class it prepared stays in torch's cache (correct, and what
    torch would use for that class from then on). Nothing here is collective.
"""

from __future__ import annotations

from typing import Any

from .. import _compat, _events
from .._spec import Patch, Verdict, Wrap, needed, unsupported

NAME = "fsdp_module_abc_layout"
_CACHE = "cls_to_fsdp_cls"
_DEEPCOPY = "_unimplemented_deepcopy"  # what torch's FSDP classes have as __deepcopy__
_MRO = "_fsdp_autopatch_mro"  # our class's namespace: the order its metaclass's mro() returns
_metaclasses: dict[type, type] = {}  # type(Model) -> its subclass with our mro()


def _fully_shard_module() -> Any:
    return _compat.fsdp_module("_fully_shard")


def _structural_check() -> Verdict:
    module = _fully_shard_module()
    missing = [name for name in ("fully_shard", "FSDPModule", _DEEPCOPY) if not callable(getattr(module, name, None))]
    if not isinstance(getattr(module, _CACHE, None), dict):
        missing.append(f"{_CACHE} (a dict)")
    if missing:
        return unsupported(f"_fully_shard has no {', '.join(missing)}: torch left untouched")
    return needed(
        "fully_shard swaps a module's class for type('FSDP<Name>', (FSDPModule, cls)), whose layout differs "
        "from a class that lists abc.ABC first"
    )


def _classes_of(module: Any) -> list[type]:
    """The classes of the module(s) ``fully_shard`` was given (one module, or a list of them)."""
    modules = [module] if hasattr(module, "named_parameters") else list(module or ())
    return list(dict.fromkeys(type(m) for m in modules))


def _torch_class_fits(torch_class: type, cls: type) -> bool | None:
    """Whether torch's class swap works for instances of ``cls``; None if we cannot tell."""
    try:
        probe = object.__new__(cls)
    except TypeError:
        return None
    try:
        probe.__class__ = torch_class
    except TypeError:
        return False
    return True


def _metaclass_for(meta: type) -> type:
    found = _metaclasses.get(meta)
    if found is None:

        def mro(cls):
            order = cls.__dict__.get(_MRO)
            return [cls, *order] if order is not None else meta.mro(cls)

        found = _metaclasses[meta] = type(f"FSDPLayout{meta.__name__}", (meta,), {"mro": mro})
    return found


def _layout_compatible_class(torch_class: type, cls: type, fsdp_module: type) -> type | None:
    """Torch's class for ``cls`` with ``cls`` as its layout base, or None if it would not fit either."""
    namespace = {key: value for key, value in vars(torch_class).items() if key not in ("__dict__", "__weakref__")}
    namespace[_MRO] = torch_class.__mro__[1:]
    namespace["__module__"] = fsdp_module.__module__  # where torch's own FSDP classes say they come from
    bases = (cls, *(base for base in torch_class.__bases__ if base is not cls))
    ours = _metaclass_for(type(cls))(torch_class.__name__, bases, namespace)
    if ours.__mro__[1:] != torch_class.__mro__[1:] or not _torch_class_fits(ours, cls):
        return None
    return ours


def _prepare(cls: type, cache: dict, fsdp_module: type, deepcopy: Any) -> None:
    if cls in cache or not isinstance(cls, type) or issubclass(cls, fsdp_module):
        return
    # torch's own class, built as torch builds it (the probe never touches torch's cache)
    try:
        torch_class = type(f"FSDP{cls.__name__}", (fsdp_module, cls), {"__deepcopy__": deepcopy})
    except TypeError:  # torch's own type() call will raise it: torch's error, not ours
        return
    if _torch_class_fits(torch_class, cls) is not False:
        return  # torch handles it, or we cannot tell: torch's code decides
    ours = _layout_compatible_class(torch_class, cls, fsdp_module)
    if ours is not None:
        cache[cls] = ours
        without = f"TypeError: __class__ assignment: layout of FSDP{cls.__name__} differs from {cls.__name__}"
        _events.fired(NAME, without, cls.__qualname__)


def _layout_compatible_classes(wrapped, instance, args, kwargs):
    module = _fully_shard_module()
    cache = getattr(module, _CACHE)
    for cls in _classes_of(wrapped.argument("module")):
        _prepare(cls, cache, module.FSDPModule, getattr(module, _DEEPCOPY))
    return wrapped(*args, **kwargs)


PATCH = Patch(
    name=NAME,
    summary="fully_shard works on a module class that lists abc.ABC first (`class Model(abc.ABC, nn.Module)`)",
    symptom="TypeError: __class__ assignment: 'FSDPModel' object layout differs from 'Model'",
    trigger="fully_shard on a module whose class inherits abc.ABC before nn.Module",
    upstream=("PyTorch issue 160068", "transformers issue 39977", "verl PR 3072"),
    affected=">=2.6,<2.16",
    check=_structural_check,
    targets=(
        Wrap(f"{_compat.FSDP2_PACKAGE}._fully_shard:fully_shard", _layout_compatible_classes,
             everywhere=True, reads=("module",)),
    ),
    changes="module classes whose FSDP class would not fit get one with the same MRO and their own layout",
)
