"""cast_inputs_keep_containers: what a unit does to a list, dict or dataclass its caller passed
reaches the caller, as without FSDP2.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/cast_inputs_keep_containers.md.

Needed here?
    ``FSDPState._pre_forward(module, args, kwargs)`` and ``_post_forward(module, input, output)``
    exist, and ``_pre_forward`` casts the inputs with ``_apply_to_tensors`` (itself, 2.8 - 2.12, or
    through ``_cast_forward_inputs``, 2.13 on), a walk that rebuilds dataclasses and containers
    (it names ``replace`` and ``fields``) -> needed. Anything else -> unsupported. The walk of
    ``FSDPParamGroup.pre_forward`` (which wraps grad-requiring inputs: ``replace_grad_tensors``,
    ``tree_unflatten`` before 2.13) and the root's device move (``_to_kwargs``) copy containers too;
    the wrapper sees what the whole ``_pre_forward`` made, so it covers them as well.

The replacement
    ``FSDPState._pre_forward``: after torch's, the inputs it returns are paired with those the
    caller passed, container by container (what the walks rebuild: list, tuple, NamedTuple, dict,
    OrderedDict, set, dataclass). A container in which no tensor was replaced (cast, moved, wrapped
    for post-backward) is the caller's own again: the unit changes it directly, as without FSDP2.
    A container that holds a replaced tensor stays torch's copy (the unit must compute with the
    cast tensors), with the caller's own containers put back inside it where nothing below was
    replaced; each such copy of a list, dict or mutable dataclass is remembered with what it held.
    ``FSDPState._post_forward`` (after torch's): each remembered copy the unit changed hands its
    changes to the caller's container: items appended to a list are appended to the caller's (any
    other change to a list: the caller's list is set to the copy's items), new, replaced and
    removed keys of a dict, changed fields of a dataclass. Items the unit took over from its copy
    are handed back as the caller's own objects (a cast tensor as the caller's tensor, a copied
    container as the caller's container). A grouped unit hands back when the group's forward
    completes; one whose post-forward never ran (its forward raised; a group force-completed by the
    root) at the start of its next forward. Where no container is changed the unit computes with
    the same tensors as without the patch: bitwise equal. An activation-checkpointing recompute
    runs the same hooks, and hands back as the forward did (what the same recompute does without
    FSDP2).

    ``fired``: once per caller's container the unit changed (the changes torch would have lost).

Call-time isolation
    Both wrappers do their work after torch's method ran and keep torch's result should it raise
    (``KEEP_RESULT``: the copies, the bug's behaviour). The hand-back of leftovers before torch's
    ``_pre_forward`` falls back to torch's method. Hidden from Dynamo as torch's hooks are
    (``AS_TORCH``). No collective.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from .. import _compat, _events
from .._spec import Patch, Verdict, Wrap, needed, unsupported

NAME = "cast_inputs_keep_containers"
_STATE = f"{_compat.FSDP2_PACKAGE}._fsdp_state"
_WALK = "_apply_to_tensors"
_CAST = "_cast_forward_inputs"
_WITHOUT = "the unit's changes to a container its caller passed are made to a copy and lost for the caller"

# FSDPState -> the containers its unit was given in this forward, until its post-forward hands
# back their changes (keyed by state: ranks that share a process never see each other's).
_given: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _structural_check() -> Verdict:
    state_module = _compat.fsdp_module("_fsdp_state")
    state_class = state_module.FSDPState
    pre = _compat.class_attr(state_class, "_pre_forward")
    post = _compat.class_attr(state_class, "_post_forward")
    if pre is None or post is None:
        return unsupported("FSDPState._pre_forward / _post_forward not found: torch left untouched")
    if not (_compat.has_parameters(pre, "module", "args", "kwargs")
            and _compat.has_parameters(post, "module", "input", "output")):
        return unsupported("FSDPState._pre_forward(module, args, kwargs) / _post_forward(module, input, output) "
                           "differ from the measured releases: torch left untouched")
    cast = _compat.class_attr(state_class, _CAST)
    casts = _compat.reads_names(pre, _WALK, "param_dtype") or (
        cast is not None and _compat.reads_names(pre, _CAST) and _compat.reads_names(cast, _WALK, "param_dtype"))
    if not casts:
        return unsupported(f"FSDPState._pre_forward casts no inputs with {_WALK}: torch left untouched")
    walk = getattr(state_module, _WALK, None)
    if walk is None or not {"replace", "fields"} <= _compat.names_read(_compat.code_of(walk)):
        return unsupported(f"{_WALK} does not rebuild containers as the measured releases do: torch left untouched")
    return needed(f"FSDPState._pre_forward casts the inputs with {_WALK}, which hands the unit a copy of every "
                  "container it walks")


# -- pairing what the caller passed with what torch's _pre_forward returns ------------------------

_LIST, _DICT, _DATACLASS = "list", "dict", "dataclass"


class _Given:
    """One container the caller passed: ``copy`` is torch's copy the unit got (None: the unit got
    the caller's own), ``before`` what the unit's container held when its forward started."""

    __slots__ = ("before", "caller", "copy", "kind")

    def __init__(self, kind: str, caller: Any, copy: Any) -> None:
        self.kind, self.caller, self.copy = kind, caller, copy
        self.before = _contents(kind, caller if copy is None else copy)


class _Pairing:
    def __init__(self) -> None:
        self.given: list[_Given] = []
        self.originals: dict[int, tuple[Any, Any]] = {}  # id(torch's object) -> (it, the caller's)
        self._own: set[int] = set()

    def unit_gets(self, caller: Any, got: Any) -> Any:
        """What the unit gets for the caller's ``caller``, where torch's walks made ``got``."""
        import torch

        if got is caller:
            return caller
        if isinstance(caller, torch.Tensor):
            if isinstance(got, torch.Tensor):
                self.originals[id(got)] = (got, caller)
            return got
        # the order of torch's walks: a dataclass before a dict, a NamedTuple before a tuple
        if dataclasses.is_dataclass(caller) and not isinstance(caller, type):
            if type(got) is not type(caller):
                return got
            names = [field.name for field in dataclasses.fields(caller)]
            inner = {n: self.unit_gets(getattr(caller, n), getattr(got, n)) for n in names}
            if all(inner[n] is getattr(caller, n) for n in names):
                return self._own_container(_DATACLASS, caller)
            for n in names:
                if inner[n] is not getattr(got, n):
                    object.__setattr__(got, n, inner[n])  # torch's fresh copy (frozen or not)
            frozen = type(caller).__dataclass_params__.frozen  # type: ignore[attr-defined]
            return self._copy(_DATACLASS, caller, got, watch=not frozen)
        if isinstance(caller, dict):
            if not isinstance(got, dict) or list(got) != list(caller):
                return got
            inner = {k: self.unit_gets(caller[k], got[k]) for k in caller}
            if all(inner[k] is caller[k] for k in caller):
                return self._own_container(_DICT, caller)
            for k, value in inner.items():
                if value is not got[k]:
                    got[k] = value
            return self._copy(_DICT, caller, got)
        if isinstance(caller, (list, tuple)):
            if not isinstance(got, (list, tuple)) or isinstance(got, list) != isinstance(caller, list) \
                    or len(got) != len(caller):
                return got
            inner_items = [self.unit_gets(c, g) for c, g in zip(caller, got)]
            if all(i is c for i, c in zip(inner_items, caller)):
                return self._own_container(_LIST, caller) if isinstance(caller, list) else caller
            if isinstance(caller, list):
                got[:] = inner_items
                return self._copy(_LIST, caller, got)
            if any(i is not g for i, g in zip(inner_items, got)):
                got = type(got)(*inner_items) if hasattr(got, "_fields") else type(got)(inner_items)
            return self._copy(None, caller, got, watch=False)
        if isinstance(caller, (set, frozenset)) and isinstance(got, (set, frozenset)):
            own = {id(item) for item in caller}
            return caller if len(got) == len(caller) and all(id(item) in own for item in got) else got
        return got  # not a container torch's walks rebuild: torch's result as it came

    def _own_container(self, kind: str, caller: Any) -> Any:
        if id(caller) not in self._own:  # passed twice: watched once
            self._own.add(id(caller))
            self.given.append(_Given(kind, caller, None))
        return caller

    def _copy(self, kind: str | None, caller: Any, got: Any, watch: bool = True) -> Any:
        self.originals[id(got)] = (got, caller)
        if watch and kind is not None:
            self.given.append(_Given(kind, caller, got))
        return got


def _contents(kind: str, container: Any) -> Any:
    if kind == _LIST:
        return list(container)
    if kind == _DICT:
        return dict(container)
    return {field.name: getattr(container, field.name) for field in dataclasses.fields(container)}


def _hand_back(given: _Given, originals: dict[int, tuple[Any, Any]]) -> bool:
    """Give the caller's container the changes the unit made to its copy; whether it changed."""
    now = _contents(given.kind, given.caller if given.copy is None else given.copy)
    before = given.before

    def caller_object(item: Any) -> Any:
        pair = originals.get(id(item))
        return pair[1] if pair is not None and pair[0] is item else item

    if given.kind == _LIST:
        kept = len(now) >= len(before) and all(a is b for a, b in zip(now, before))
        if kept and len(now) == len(before):
            return False
        if given.copy is not None:
            if kept:  # only appended: the caller's own items stay as they are
                given.caller.extend(caller_object(item) for item in now[len(before):])
            else:
                given.caller[:] = [caller_object(item) for item in now]
        return True
    changed = [k for k, v in now.items() if k not in before or before[k] is not v]
    removed = [k for k in before if k not in now]
    if not changed and not removed:
        return False
    if given.copy is not None:
        if given.kind == _DICT:
            for k in changed:
                given.caller[k] = caller_object(now[k])
            for k in removed:
                given.caller.pop(k, None)
        else:
            for k in changed:
                setattr(given.caller, k, caller_object(now[k]))
    return True


def _hand_back_all(state: Any) -> None:
    pending = _given.pop(state, None)
    for given_containers, originals in pending or ():
        for given in given_containers:  # inner containers first: the walk appended them first
            if _hand_back(given, originals):
                _events.fired(NAME, _WITHOUT, f"a {type(given.caller).__name__} passed to {_unit_of(state)}")


def _unit_of(state: Any) -> str:
    return ", ".join(type(module).__name__ for module in getattr(state, "_modules", ())) or "?"


# -- the wrappers ---------------------------------------------------------------------------------

def _keep_callers_containers(wrapped, state, args, kwargs):
    forward = _compat.fsdp_module("_fsdp_common").TrainingState.FORWARD
    if state in _given and state._training_state is not forward:  # a new pass: an earlier one's leftovers
        _hand_back_all(state)
    given_args, given_kwargs = wrapped.argument("args"), wrapped.argument("kwargs")
    result = wrapped(*args, **kwargs)
    got_args, got_kwargs = result
    if got_args is given_args and got_kwargs is given_kwargs:
        return result
    pairing = _Pairing()
    # the args tuple and the kwargs dict are the hook's own, never a container of the caller
    unit_args = tuple(pairing.unit_gets(c, g) for c, g in zip(given_args, got_args)) \
        if len(got_args) == len(given_args) else got_args
    if got_kwargs is not given_kwargs and list(got_kwargs) == list(given_kwargs):
        for key in given_kwargs:
            value = pairing.unit_gets(given_kwargs[key], got_kwargs[key])
            if value is not got_kwargs[key]:
                got_kwargs[key] = value
    if pairing.given:
        _given.setdefault(state, []).append((pairing.given, pairing.originals))
    if all(a is g for a, g in zip(unit_args, got_args)):
        unit_args = got_args
    return unit_args, got_kwargs


def _hand_back_changes(wrapped, state, args, kwargs):
    output = wrapped(*args, **kwargs)
    if state in _given:
        _hand_back_all(state)
    return output


PATCH = Patch(
    name=NAME,
    summary="a list, dict or dataclass a unit is given and changes (aux losses appended, shared KV states) "
            "reaches its caller",
    symptom="KeyError in a layer that reads a key an earlier layer stored in a shared dict (Gemma-3n "
            "shared_kv_states); an auxiliary-loss list the layers append to stays empty for the caller",
    trigger="MixedPrecisionPolicy(param_dtype=...) with cast_forward_inputs=True (the default), a list, dict or "
            "dataclass passed to a fully_shard unit that changes it in its forward",
    upstream=("transformers issue 45663", "transformers PRs 45716, 45912", "NeMo Automodel PRs 2594, 2566",
              "verl PR 7657", "Red-Hat mini_trainer issue 94"),
    # measured 2.13, 2.15; read, not run, 2.8 - 2.12 and 2.14 (the same walk, in _pre_forward itself before 2.13).
    # <2.16 means "measured up to 2.15", not "fixed in 2.16": on a later release the check decides.
    affected=">=2.8,<2.16",
    check=_structural_check,
    targets=(
        Wrap(f"{_STATE}:FSDPState._pre_forward", _keep_callers_containers, reads=("args", "kwargs")),
        Wrap(f"{_STATE}:FSDPState._post_forward", _hand_back_changes),
    ),
    changes="units get their caller's containers where nothing in them is cast, and hand back their changes "
            "to the copies torch makes",
)
