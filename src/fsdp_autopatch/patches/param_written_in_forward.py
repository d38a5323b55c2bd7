"""param_written_in_forward: stop a run whose forward writes a managed parameter in place, at the reshard
that would drop the write.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/param_written_in_forward.md.

Needed here?
    ``FSDPParamGroup.wait_for_unshard`` copies the all-gather out into the unsharded parameters and
    moves the group to its unsharded state (it reads ``_to_unsharded`` and ``_all_gather_result``),
    ``FSDPParamGroup.reshard`` moves it back (``_to_sharded``), ``is_unsharded`` says which, and the
    group lists its ``fsdp_params`` -> needed: torch never writes the unsharded copy back to the
    shard. Anything else -> unsupported.

The guard
    * a wrapper of ``FSDPParamGroup.wait_for_unshard``: where the call had an all-gather to copy out
      and left the group unsharded, it records each unsharded parameter with its version counter
      (``Tensor._version``), after FSDP2's own copy-out, which writes into the same tensors. A call
      with nothing to copy out (a group already unsharded: ``reshard_after_forward=False``, an
      explicit ``unshard()``) records nothing, so the earlier record stands;
    * a wrapper of ``FSDPParamGroup.reshard``: where the group is unsharded, the recorded
      parameters whose version moved since (the same tensor, another version) were written in place
      between the unshard and now: by the unit's forward (``nn.Embedding(max_norm=...)`` renormalises
      rows with ``embedding_renorm_``), or by any code that wrote the module's parameter. Torch's
      method runs; where it left the unsharded state (to the sharded or the post-forward state: the
      write is gone, or goes at the next reshard with ``reshard_after_forward=<int>``) and one was
      written, :class:`fsdp_autopatch.GuardError` names the parameters and the unit. A reshard that
      keeps the group unsharded (``reshard_after_forward=False`` in forward) keeps the record: the
      later reshard (post-backward, ``FSDPModule.reshard()``) decides.
    No false stop where nothing writes the unsharded tensors: the optimizer writes the sharded
    parameters (other tensors, other counters); backward writes gradients, never the parameter; an
    activation-checkpointing recompute runs inside backward, where FSDP2 skips its forward hooks,
    and writes nothing unless the forward does (which already stopped); ``no_grad`` forwards go the
    same way as training ones. Not seen: a write through ``.data`` (a tensor with a version counter
    of its own); a write through a view or ``.detach()`` shares the counter and is seen. A write that
    only some ranks make (data-dependent) stops those ranks only: the others meet the group's
    timeout at their next collective.
    Cost: one ``_version`` read per parameter per unshard and per reshard; no collective.

Call-time isolation
    The record runs after torch's ``wait_for_unshard`` (``KEEP_RESULT``: should it raise, torch's
    result stands and the record is missing: no stop). The comparison runs before torch's
    ``reshard`` (should it raise, torch's method runs as it came), the stop after it. Under
    ``torch.compile`` both methods run inside FSDP2's hooks, which torch hides from Dynamo: eager.
"""

from __future__ import annotations

from typing import Any

from .. import _compat, _events
from .._catalogue import GUARD
from .._spec import Patch, Verdict, Wrap, needed, unsupported

NAME = "param_written_in_forward"
_GROUP = f"{_compat.FSDP2_PACKAGE}._fsdp_param_group"
_RECORD = "_fsdp_autopatch_unsharded_versions"  # on the group: [(fsdp_param, unsharded tensor, version)]


def check_param_group(group: type) -> Verdict:
    """The structural verdict for an ``FSDPParamGroup`` class (torch's, or a stand-in)."""
    wait = _compat.class_attr(group, "wait_for_unshard")
    reshard = _compat.class_attr(group, "reshard")
    if wait is None or reshard is None or _compat.class_attr(group, "is_unsharded") is None:
        return unsupported("FSDPParamGroup has no wait_for_unshard / reshard / is_unsharded: torch left untouched")
    if not _compat.reads_names(wait, "_all_gather_result", "_to_unsharded", "fsdp_params"):
        return unsupported("FSDPParamGroup.wait_for_unshard does not copy the all-gather out into the unsharded "
                           "parameters (_all_gather_result, _to_unsharded): torch left untouched")
    if not _compat.reads_names(reshard, "_to_sharded"):
        return unsupported("FSDPParamGroup.reshard does not go back to the sharded parameters: torch left untouched")
    return needed("a forward's in-place write to a managed parameter writes the unsharded copy, which reshard "
                  "frees without writing it back to the shard")


def _structural_check() -> Verdict:
    return check_param_group(_compat.fsdp_class("_fsdp_param_group", "FSDPParamGroup"))


def _record_versions(wrapped, group, args, kwargs):
    had_all_gather = getattr(group, "_all_gather_result", None) is not None
    result = wrapped(*args, **kwargs)
    if had_all_gather and group.is_unsharded:  # after FSDP2's copy-out, which bumps the versions itself
        unsharded = ((fp, _compat.unsharded_param(fp)) for fp in group.fsdp_params)
        # an inference tensor (the buffers of a first unshard under torch.inference_mode) has no version
        # counter to read: not watched
        setattr(group, _RECORD, [(fp, tensor, tensor._version) for fp, tensor in unsharded
                                 if tensor is not None and not tensor.is_inference()])
    return result


def written_since_unshard(group: Any) -> list[Any]:
    """The group's FSDPParams whose unsharded tensor was written in place since the recorded unshard."""
    return [fp for fp, tensor, version in vars(group).get(_RECORD) or ()
            if _compat.unsharded_param(fp) is tensor and tensor._version != version]


def _stop_before_dropping(wrapped, group, args, kwargs):
    written = written_since_unshard(group) if group.is_unsharded else []
    result = wrapped(*args, **kwargs)
    if group.is_unsharded:
        return result  # kept unsharded (reshard_after_forward=False in forward): the later reshard decides
    vars(group).pop(_RECORD, None)
    if written:
        raise _stop(group, written)
    return result


def _stop(group: Any, written: list[Any]) -> Any:
    unit = getattr(group, "_module_fqn", "") or "the root"
    return _events.stop(
        NAME,
        f"{_events.param_names(written)} (unit {unit}) was written in place since FSDP2 unsharded it, by the "
        "unit's forward (nn.Embedding(max_norm=...) renormalizes its rows in place) or by other code; FSDP2 "
        "writes no unsharded parameter back to its shard, so resharding drops the write and the next forward "
        "and the optimizer see the old values",
        "Do not update a managed parameter in place in forward: for nn.Embedding(max_norm=...) leave max_norm "
        "None and renormalize the sharded weight after optimizer.step() under torch.no_grad(), or scale the "
        "looked-up rows out of place and leave the weight as it is",
    )


PATCH = Patch(
    name=NAME,
    summary="a forward that writes a managed parameter in place (nn.Embedding(max_norm=...)) stops at the reshard "
    "that would drop the write",
    symptom="silent: the in-place write lands in the unsharded copy and is dropped at reshard (nn.Embedding "
    "max_norm: no row stays renormalized; weights 5.47 from the reference after 2 steps)",
    trigger="a module inside a fully_shard unit that updates its own parameter in place in forward: "
    "nn.Embedding(max_norm=...), a hand-written in-place update of a weight",
    upstream=(),
    # measured 2.13, 2.15; read 2.14.1 (the same wait_for_unshard / reshard); 2.6 - 2.12 inferred (FSDP2 has
    # never written the unsharded parameters back)
    affected=">=2.6,<2.16",
    check=_structural_check,
    targets=(
        Wrap(f"{_GROUP}:FSDPParamGroup.wait_for_unshard", _record_versions),
        Wrap(f"{_GROUP}:FSDPParamGroup.reshard", _stop_before_dropping),
    ),
    changes="each unshard records the unsharded parameters' versions; a reshard after an in-place write stops",
    kind=GUARD,
)
