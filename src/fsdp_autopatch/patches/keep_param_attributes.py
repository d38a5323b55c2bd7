"""keep_param_attributes: the Python attributes user code set on an ``nn.Parameter`` survive ``fully_shard``.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/keep_param_attributes.md.

Needed here?
    ``FSDPParam._setattr_on_modules(self, param)`` installs a parameter through
    ``_module_info.module`` / ``param_name``; ``FSDPParam._init_sharded_param`` builds a new
    ``nn.Parameter`` and installs it through that method, and ``to_sharded`` / ``to_unsharded``
    go through it -> needed. One of them reads ``__dict__`` or calls ``vars`` (torch copying the
    attributes itself) -> not needed. Anything else -> unsupported.

What is carried, exactly
    Every entry of the replaced parameter's ``__dict__`` whose
      * name does not start with ``_``: what torch puts on parameters is underscore-prefixed
        (FSDP2's ``_fsdp_orig_uid``, ``_is_param`` on a DTensor parameter, FSDP1's
        ``_fsdp_flattened``, DDP's ``_ddp_ignored``, the optimizer-in-backward
        ``_in_backward_optimizers``, Dynamo's ``_dynamo_*`` marks); carrying those would
        corrupt torch's bookkeeping, so other libraries' private names are not carried either;
      * value is not a tensor, nor a list / tuple / set / frozenset / dict holding one in its
        first two levels (dict keys and values): such a value (Megatron's ``main_grad``) has the
        unsharded shape and would keep full-size storage alive next to the shard;
      * name is not an attribute of the new parameter's class (``placements``, ``device_mesh``,
        Tensor methods and properties): setting it would fail or shadow torch.
    Values are carried as the same objects (no copy). The new parameter gets exactly those
    entries; a name carried earlier that the replaced parameter no longer has (the user deleted
    it, or a ``load_state_dict(assign=True)`` installed a parameter without it) is removed, while
    an attribute set directly on the new parameter is kept. So the parameter the module shows
    carries the attributes of the one it replaced, original -> sharded -> unsharded ->
    (post-forward shard) -> sharded, and a change made on the parameter the module shows travels
    with the next swap. Not carried, as in PyTorch without FSDP: ``state_dict()`` values
    (detached tensors) and parameters installed by ``load_state_dict(..., assign=True)``.

The replacement
    * ``FSDPParam._setattr_on_modules`` wrapped (the one place FSDP2 installs a parameter on its
      module and the modules sharing it): before torch installs ``param``, the parameter the
      module still shows (``_module_info.module._parameters[param_name]``) is the one being
      replaced, and its carried attributes are mirrored onto ``param``. A swap whose attributes
      already match takes a fast path that compares object identities only. While Dynamo traces
      FSDP2's hooks (``torch._dynamo.config.skip_fsdp_hooks = False``, an option 2.8 and 2.10
      have and 2.13 no longer has) it steps aside (``Wrap.dynamo``'s default).
    * ``FSDPModule._apply`` wrapped (``model.to(...)``, ``.float()``, ``to_empty()``):
      ``nn.Module._apply`` swaps a DTensor parameter's contents with ``torch.utils.swap_tensors``,
      ``__dict__`` included; the unit's attributes are saved before and mirrored back after.
    Values, gradients, collectives and FSDP2's state are unchanged. The patch fires once per
    parameter, the first time it carries a non-empty set of attributes. It raises nothing of its
    own: an attribute a parameter subclass refuses (a read-only slot) is left out.

Call-time isolation
    The mirroring runs before torch installs the parameter (``_setattr_on_modules``) and after
    ``FSDPModule._apply``. Should it raise, torch installs the parameter (or ``_apply``'s result is
    returned) without the attributes, as without the patch. Local to the rank: no collective.
    ``param`` is read by name; any other argument is forwarded.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _compat, _events
from .._spec import Patch, Verdict, Wrap, needed, not_needed, unsupported

NAME = "keep_param_attributes"
_FSDP2 = _compat.FSDP2_PACKAGE
_SETTER = "_setattr_on_modules"
_INIT = "_init_sharded_param"
_SWAPS = ("to_sharded", "to_unsharded")  # the per-step swaps that must go through _SETTER
# On a parameter: the names this patch put there, so that only those are ever removed.
CARRIED_NAMES = "_fsdp_autopatch_carried"
# On an FSDPParam: it carried attributes once (the patch fires once per parameter).
_FIRED = "_fsdp_autopatch_attributes_carried"
_CONTAINERS = (list, tuple, set, frozenset)
_MISSING = object()


# --- needed here? ---------------------------------------------------------------------------


def _reads_any(func: Any, *names: str) -> bool:
    return any(_compat.reads_names(func, name) for name in names)


def check_fsdp_param(cls: type) -> Verdict:
    """The structural verdict for an ``FSDPParam`` class (torch's, or a stand-in in the tests)."""
    setter, init = _compat.class_attr(cls, _SETTER), _compat.class_attr(cls, _INIT)
    # ``param`` is checked by name from the target's ``reads``; any other argument is forwarded.
    if setter is None:
        return unsupported(f"FSDPParam.{_SETTER} not found")
    if not _compat.reads_names(setter, "_module_info", "module", "param_name"):
        return unsupported(f"FSDPParam.{_SETTER} does not install through _module_info.module / param_name")
    swaps_through_setter = all(_compat.reads_names(_compat.class_attr(cls, swap), _SETTER) for swap in _SWAPS)
    if init is None or not _compat.reads_names(init, "Parameter", _SETTER) or not swaps_through_setter:
        return unsupported(f"FSDPParam.{_INIT} / to_sharded / to_unsharded do not install parameters via {_SETTER}")
    if _reads_any(setter, "__dict__", "vars") or _reads_any(init, "__dict__", "vars"):
        return not_needed(f"FSDPParam copies the parameter's __dict__ itself ({_INIT} or {_SETTER})", conclusive=True)
    return needed(f"FSDPParam.{_INIT} and {_SETTER} install new Parameters without the replaced one's attributes")


def _structural_check() -> Verdict:
    return check_fsdp_param(_compat.fsdp_class("_fsdp_param", "FSDPParam"))


# --- what is carried --------------------------------------------------------------------------


def holds_tensor(value: Any, depth: int = 2) -> bool:
    """A tensor, or a list / tuple / set / frozenset / dict holding one in its first ``depth`` levels."""
    if isinstance(value, torch.Tensor):
        return True
    if depth == 0:
        return False
    if isinstance(value, dict):
        return any(holds_tensor(k, depth - 1) or holds_tensor(v, depth - 1) for k, v in value.items())
    if isinstance(value, _CONTAINERS):
        return any(holds_tensor(item, depth - 1) for item in value)
    return False


def is_carried(name: str, value: Any, target_class: type) -> bool:
    """Whether attribute ``name`` (holding ``value``) travels to a parameter of ``target_class``."""
    # cheapest first: this runs on every swap for a public tensor attribute such as main_grad
    return not name.startswith("_") and not holds_tensor(value) and not hasattr(target_class, name)


def carried_attributes(param: Any, target_class: type | None = None) -> dict[str, Any]:
    """The entries of ``param.__dict__`` that travel to a parameter of ``target_class`` (default:
    ``param``'s own class)."""
    target_class = type(param) if target_class is None else target_class
    return {name: value for name, value in vars(param).items() if is_carried(name, value, target_class)}


def _in_sync(source_attrs: dict, target_attrs: dict, target_class: type) -> bool:
    """Fast path (every swap after the first): each public entry of the source is the same object
    on the target or is not carried, and every name carried earlier still holds that object on the
    source (not deleted, not replaced by a tensor)."""
    missing = _MISSING
    for name, value in source_attrs.items():
        if name[0] != "_" and target_attrs.get(name, missing) is not value and is_carried(name, value, target_class):
            return False
    for name in target_attrs.get(CARRIED_NAMES, ()):
        if source_attrs.get(name, missing) is not target_attrs.get(name, missing):
            return False
    return True


def mirror_attributes(source: Any, target: Any) -> tuple[str, ...]:
    """Give ``target`` the carried attributes of ``source``; returns the names carried now (empty
    when nothing changed)."""
    return mirror_from(vars(source), target)


def mirror_from(source_attrs: dict, target: Any) -> tuple[str, ...]:
    """:func:`mirror_attributes` from a parameter's ``__dict__`` (or a copy of it)."""
    target_attrs, target_class = vars(target), type(target)
    if _in_sync(source_attrs, target_attrs, target_class):
        return ()
    wanted = {name: value for name, value in source_attrs.items() if is_carried(name, value, target_class)}
    for name in target_attrs.get(CARRIED_NAMES, ()):
        if name not in wanted:
            target_attrs.pop(name, None)
    carried = []
    for name, value in wanted.items():
        try:
            setattr(target, name, value)
        except (AttributeError, TypeError):  # a read-only slot on a parameter subclass: leave it
            continue
        carried.append(name)
    if carried:
        target_attrs[CARRIED_NAMES] = tuple(carried)
    else:
        target_attrs.pop(CARRIED_NAMES, None)
    return tuple(carried)


# --- the wrappers ---------------------------------------------------------------------------


def _param_on_module(fsdp_param: Any) -> Any:
    """The parameter the module shows now: the one torch is about to replace."""
    info = fsdp_param._module_info
    parameters = getattr(info.module, "_parameters", None)
    return parameters.get(info.param_name) if parameters is not None else None


def _shown_or_sharded(fsdp_param: Any) -> Any:
    shown = _param_on_module(fsdp_param)
    return fsdp_param.sharded_param if shown is None else shown


def _carry(fsdp_param: Any, source_attrs: dict, target: Any, how: str) -> None:
    carried = mirror_from(source_attrs, target)
    if carried and not vars(fsdp_param).get(_FIRED):
        fsdp_param.__dict__[_FIRED] = True
        info = fsdp_param._module_info
        _events.fired(
            NAME,
            f"the attributes {', '.join(carried)} dropped by {how}",
            f"{type(info.module).__name__}.{info.param_name}",
        )


def _keep_attributes(wrapped, fsdp_param, args, kwargs):
    incoming = wrapped.argument("param")
    outgoing = _param_on_module(fsdp_param)
    if outgoing is not None and incoming is not None and outgoing is not incoming:
        _carry(fsdp_param, vars(outgoing), incoming, "the parameter swap")
    return wrapped(*args, **kwargs)


def _keep_attributes_across_apply(wrapped, module, args, kwargs):
    # Module._apply (.to(), .float(), to_empty()) swaps a DTensor parameter's contents with
    # torch.utils.swap_tensors, __dict__ included: the same object comes back without them.
    fsdp_params = [p for group in _compat.state_param_groups(module._get_fsdp_state()) for p in group.fsdp_params]
    saved = [(p, dict(vars(_shown_or_sharded(p)))) for p in fsdp_params]
    result = wrapped(*args, **kwargs)
    for fsdp_param, attributes in saved:
        _carry(fsdp_param, attributes, fsdp_param.sharded_param, "Module._apply (to, float, to_empty)")
    return result


def _fsdp_module_has_apply() -> bool:
    """FSDPModule overrides nn.Module._apply (to re-pad its shards) on every release read."""
    return "_apply" in vars(_compat.fsdp_class("_fully_shard", "FSDPModule"))


PATCH = Patch(
    name=NAME,
    summary="attributes set on a parameter (`p.no_weight_decay = True`) are still there after `fully_shard`",
    symptom=(
        "AttributeError: 'DTensor' object has no attribute 'no_weight_decay'; "
        "getattr(p, 'no_weight_decay', False) is False for every parameter"
    ),
    trigger="Python attributes set on parameters before fully_shard, read after it (optimizer groups, filters)",
    upstream=("PyTorch issue 136929", "Megatron-LM's save/restore of parameter attributes"),
    # Every FSDP2 release installs new Parameters without the old __dict__ (measured on 2.8 - 2.15).
    affected=">=2.6",
    check=_structural_check,
    targets=(
        Wrap(f"{_FSDP2}._fsdp_param:FSDPParam.{_SETTER}", _keep_attributes, reads=("param",)),
        Wrap(f"{_FSDP2}._fully_shard:FSDPModule._apply", _keep_attributes_across_apply, when=_fsdp_module_has_apply),
    ),
    changes="parameter swaps and FSDPModule._apply carry the replaced parameter's public, non-tensor attributes",
)
