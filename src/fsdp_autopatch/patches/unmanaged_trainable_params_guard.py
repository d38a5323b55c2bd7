"""unmanaged_trainable_params_guard: stop ranks that train parameters FSDP2 does not manage apart.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/unmanaged_trainable_params_guard.md.

Needed here?
    ``FSDPState._lazy_init`` (the root's first forward) fills ``_state_ctx.all_states``, each state's
    ``FSDPParamGroup`` lists its ``fsdp_params`` (each with its ``sharded_param``) and its
    ``mesh_info`` (``shard_process_group``, HSDP's ``replicate_process_group``), and
    ``torch.optim.optimizer`` offers ``register_optimizer_step_pre_hook`` -> needed. Anything else
    -> unsupported.

The guard
    * a wrapper of ``FSDPState._lazy_init`` records, after torch's method, each root (weak references
      to its module and state): no collective, no scan. Wrappers of ``Optimizer.__init__`` and
      ``add_param_group`` note an optimizer that holds a trainable parameter that is no DTensor. Once both were seen,
      ONE global optimizer step pre-hook is installed, kept for the process (as
      ``optimizer_unsharded_params_guard`` does; [Note: a step hook only where needed] in ``_isolation``);
    * at the first ``step()`` of each optimizer, after its own step pre-hooks (a user's gradient
      sync may be one: the check is appended to them), then one ``WeakSet`` test per step, the trainable
      parameters it holds that lie in a recorded root's module tree and are no FSDPParam's sharded
      parameter are the unmanaged ones: found then, so an adapter added after the first forward is
      seen too; a DTensor is not one of them (a layout of its own: tensor or expert parallelism).
      None (every usual run): the optimizer is marked checked, nothing else happens;
    * some: a fingerprint of them (per parameter, in the optimizer's order: the sums of the weight
      and of its gradient, and of their squares, in float64, weighted by position) is compared over
      the root's data-parallel groups (FSDP2's shard group, and HSDP's replicate group): one
      ``all_gather`` of 5 float64 values per group, once per optimizer. Equal on every
      rank: the user keeps these parameters in sync (a broadcast at start and a gradient hook that
      averages, as transformers' fix does; ``ignored_params`` kept in sync by hand): the optimizer is
      marked checked. Different: one more gather names the parameters that differ, and the step
      raises :class:`fsdp_autopatch.GuardError` on every rank of the group, before the optimizer
      changes anything. Frozen parameters are skipped.
    Not done: reducing the gradients ourselves (a fix) would decide for the user how those
    parameters are meant to train (some are kept per rank on purpose, then this guard's variable
    lets the run go on). The fake backend (``init_process_group("fake")``) is skipped: its
    collectives return no peer's data.

Call-time isolation
    The recording runs after torch's method (its result is kept should it raise). The hook's code
    runs inside ``_isolation.isolated``: the only exceptions it lets out are the GuardError and what
    the collective raises (``_isolation.torch_call``: a peer's timeout is not a bug of ours). The
    collective is issued by every rank of a group alike: the ranks build their optimizers alike.
"""

from __future__ import annotations

import weakref
from typing import Any

from .. import _compat, _events, _isolation, _patching
from .._catalogue import GUARD
from .._spec import Patch, Verdict, Wrap, needed, unsupported
from ._optimizer_groups import group_targets

NAME = "unmanaged_trainable_params_guard"
_MAX_NAMED = 4  # the error names the first few parameters
_roots: list[tuple[Any, Any]] = []  # (weakref to the root module, weakref to its FSDPState)
_checked: Any = weakref.WeakSet()  # optimizers whose first step was checked and found right
_behind_own_hooks: Any = weakref.WeakSet()  # optimizers checked by a hook of their own, after theirs
_hook: dict[str, Any] = {"handle": None, "plain_trainable": False}


def _structural_check() -> Verdict:
    state = _compat.fsdp_class("_fsdp_state", "FSDPState")
    param_group = _compat.fsdp_class("_fsdp_param_group", "FSDPParamGroup")
    lazy_init = _compat.class_attr(state, "_lazy_init")
    if lazy_init is None or not _compat.reads_names(lazy_init, "all_states", "_is_root"):
        return unsupported("FSDPState._lazy_init does not collect the root's states into _state_ctx.all_states")
    if _compat.class_attr(param_group, "lazy_init") is None:
        return unsupported("FSDPParamGroup has no lazy_init (its fsdp_params and mesh_info are not the known ones)")
    import torch.optim.optimizer as optimizer_module

    if not callable(getattr(optimizer_module, "register_optimizer_step_pre_hook", None)):
        return unsupported("torch.optim.optimizer has no register_optimizer_step_pre_hook")
    return needed(
        "fully_shard manages only the parameters present when it runs: a trainable parameter added later "
        "(an adapter) or ignored is never reduced, and each rank's optimizer steps its own copy"
    )


# --- the roots ---------------------------------------------------------------------------------


def _record_root(wrapped, state, args, kwargs):
    result = wrapped(*args, **kwargs)
    if vars(state).get("_is_root") and not vars(state).get("_fsdp_autopatch_root_recorded"):
        state._fsdp_autopatch_root_recorded = True  # _lazy_init returns at once after the first: stay cheap
        modules = tuple(getattr(state, "_modules", ()))
        _roots[:] = [(m, s) for m, s in _roots if m() is not None and s() is not None]
        if modules:
            _roots.append((weakref.ref(modules[0]), weakref.ref(state)))
        _arm_when_both_seen()
    return result


def _note_plain_trainable(optimizer: Any, groups: Any) -> None:
    """A trainable parameter that is no DTensor (what an unmanaged one is; FSDP2's sharded
    parameters are DTensors) arms the hook; a group added after the first step is checked at the next."""
    if any(param.requires_grad and not hasattr(param, "placements") for group in groups for param in group["params"]):
        _checked.discard(optimizer)
        _hook["plain_trainable"] = True
        _arm_when_both_seen()


def _arm_when_both_seen() -> None:
    """The step hook, once a root was recorded and an optimizer holds a plain trainable parameter,
    in either order ([Note: a step hook only where needed] in ``_isolation``)."""
    if _hook["handle"] is None and _hook["plain_trainable"] and _roots:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook["handle"] = register_optimizer_step_pre_hook(_isolation.aside_while_compiling(check_before_step))


def _forget_roots() -> None:
    _roots.clear()


_patching.on_revert(NAME, _forget_roots)


def _live_roots() -> list[tuple[Any, Any]]:
    live = [(module_ref(), state_ref()) for module_ref, state_ref in _roots]
    return [(module, state) for module, state in live if module is not None and state is not None]


def unmanaged_in(optimizer: Any) -> tuple[Any, list[tuple[str, Any]]]:
    """The root state whose module tree holds the optimizer's parameters, and the trainable ones of
    them that no FSDPParam manages (``(None, [])`` for an optimizer of no recorded root)."""
    held = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    for module, state in _live_roots():
        names = {id(p): name for name, p in module.named_parameters()}
        if not names.keys() & held.keys():
            continue
        fsdp_params = [fp for group in _compat.all_param_groups(state) for fp in group.fsdp_params]
        # FSDP2's own: each sharded parameter, and the unsharded one it puts on the module between an
        # unshard and a reshard (optimizer_unsharded_params_guard's business)
        managed = {id(fp.sharded_param) for fp in fsdp_params} | {id(_compat.unsharded_param(fp)) for fp in fsdp_params}
        # a DTensor outside FSDP2 (tensor or expert parallelism applied by hand) has a layout of its
        # own: its copies may differ between the data-parallel ranks on purpose, so it is not compared
        found = [(names[key], param) for key, param in held.items()
                 if key in names and key not in managed and param.requires_grad and not hasattr(param, "placements")]
        return state, found
    return None, []


# --- the check ---------------------------------------------------------------------------------


def is_active() -> bool:
    """Whether the hook checks optimizers: the patch is applied and did not fail at call time."""
    return _patching.in_force(NAME)


def check_before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The global optimizer step pre-hook: torch calls it before every ``step()``, and before the
    optimizer's own step pre-hooks. Where it has some (a user's gradient sync may be one), the check
    moves behind them: one hook of this optimizer's, appended now (torch has not started on its own
    hooks yet), compares what the step will really use."""
    if optimizer in _checked or not is_active():
        return None
    own_hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    if own_hooks and optimizer not in _behind_own_hooks:
        try:
            _behind_own_hooks.add(optimizer)
        except TypeError:  # cannot be weakly referenced: checked here, before its own hooks
            pass
        else:
            optimizer.register_step_pre_hook(_isolation.aside_while_compiling(check_after_own_hooks))
            return None
    if optimizer not in _behind_own_hooks:
        _isolation.isolated(NAME, check_optimizer, optimizer)
    return None


def check_after_own_hooks(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The check, as the last of this optimizer's step pre-hooks (then one ``WeakSet`` test per step)."""
    if optimizer not in _checked and is_active():
        _isolation.isolated(NAME, check_optimizer, optimizer)
    return None


def check_optimizer(optimizer: Any) -> None:
    """Compare the optimizer's unmanaged trainable parameters across the data-parallel ranks;
    raise the guard's error where they differ, else mark the optimizer checked."""
    state, found = unmanaged_in(optimizer)
    if found:
        for process_group, device in _data_parallel_groups(state):
            differ = _differing(found, process_group, device)
            if differ is not None:
                raise _stop(optimizer, found, differ)
    try:
        _checked.add(optimizer)
    except TypeError:  # an optimizer that cannot be weakly referenced: checked at every step
        pass


def _data_parallel_groups(root_state: Any) -> list[tuple[Any, Any]]:
    """Each process group FSDP2 reduces the root's gradients over (once), with its device."""
    import torch
    import torch.distributed as dist

    seen: list[tuple[Any, Any]] = []
    for group in _compat.all_param_groups(root_state):
        device_type = getattr(getattr(group.mesh_info, "mesh", None), "device_type", "cpu")
        for process_group in _compat.reduction_domain(group):
            if any(process_group is known for known, _ in seen) or dist.get_backend(process_group) == "fake":
                continue
            device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else (
                torch.device(device_type))
            seen.append((process_group, device))
    return seen


def fingerprints(found: list[tuple[str, Any]]) -> Any:
    """Per parameter, in order: [sum(w), sum(w**2), sum(g), sum(g**2)] in float64 (g: its gradient,
    zeros where it has none), as a ``(len(found), 4)`` CPU tensor."""
    import torch

    rows = []
    for _, param in found:
        weight = _local(param).detach().double()
        grad = param.grad
        grad = _local(grad).detach().double() if grad is not None else torch.zeros(1, dtype=torch.float64)
        rows.append(torch.stack([weight.sum(), weight.pow(2).sum(), grad.sum(), grad.pow(2).sum()]).cpu())
    return torch.stack(rows)


def _local(tensor: Any) -> Any:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def digest(rows: Any) -> Any:
    """5 float64 values for the whole set: the count, then each column weighted by position."""
    import torch

    weights = torch.arange(1, rows.shape[0] + 1, dtype=torch.float64).unsqueeze(1)
    return torch.cat([torch.tensor([float(rows.shape[0])], dtype=torch.float64), (rows * weights).sum(0)])


def _gather(tensor: Any, process_group: Any, device: Any) -> Any:
    import torch
    import torch.distributed as dist

    local = tensor.to(device).contiguous()
    every = [torch.empty_like(local) for _ in range(dist.get_world_size(process_group))]
    _isolation.torch_call(dist.all_gather, every, local, group=process_group)
    return torch.stack(every).cpu()


def _differing(found: list[tuple[str, Any]], process_group: Any, device: Any) -> list[str] | None:
    """The names of the parameters whose fingerprints differ between the group's ranks; None where
    they agree (one collective; a second one only where they do not)."""
    import torch

    rows = fingerprints(found)
    gathered = _gather(digest(rows), process_group, device)
    if torch.equal(gathered, gathered[:1].expand_as(gathered)):
        return None
    counts = gathered[:, 0].tolist()
    if len(set(counts)) > 1:  # the ranks hold different numbers of them: say so, name this rank's
        held = ", ".join(str(int(count)) for count in counts)
        return [f"(the ranks hold {held} of them)"] + [name for name, _ in found]
    every = _gather(rows, process_group, device)  # (ranks, parameters, 4)
    same = (every == every[:1]).all(dim=2).all(dim=0)
    return [name for (name, _), agrees in zip(found, same.tolist()) if not agrees]


def _names(names: list[str]) -> str:
    more = len(names) - _MAX_NAMED
    return ", ".join(names[:_MAX_NAMED]) + (f", +{more} more" if more > 0 else "")


def _stop(optimizer: Any, found: list[tuple[str, Any]], differ: list[str]) -> Any:
    # every unmanaged parameter is named, not only those that differ yet: one whose gradient is still
    # the same on every rank (LoRA's A while B is zero) diverges at a later step, once nothing checks
    return _events.stop(
        NAME,
        f"{type(optimizer).__name__} holds {len(found)} trainable parameter(s) that FSDP2 does not manage (added "
        f"after fully_shard, or ignored_params): {_names([name for name, _ in found])}; {len(differ)} of them "
        f"already differ between the data-parallel ranks: {_names(differ)}. FSDP2 never reduces their gradients, "
        "so each rank would go on training its own copy",
        "Apply the adapters (LoRA, PEFT) before fully_shard so that FSDP2 shards them, or keep all of these "
        "parameters in sync yourself: broadcast them from rank 0 once and average their gradients before "
        "optimizer.step()",
    )


PATCH = Patch(
    name=NAME,
    summary="trainable parameters FSDP2 does not manage (adapters added after fully_shard) stop the first step "
    "where the ranks' copies differ",
    symptom="silent: each rank trains its own copy of the adapter (0.58 apart after 3 SGD steps on 2 ranks); "
    "rank 0's is saved",
    trigger="a trainable parameter added to the module tree after fully_shard (LoRA / PEFT on a sharded model) or "
    "passed as ignored_params, and not kept in sync by the user",
    upstream=("transformers PR 48792", "transformers PR 48873", "transformers PR 48204", "FastVideo PR 1666",
              "allenai/molmoact2 issue 35"),
    # read in 2.6 - 2.15 (fully_shard manages what it saw); measured on 2.8 - 2.15
    affected=">=2.6,<2.16",
    check=_structural_check,
    targets=(
        Wrap(f"{_compat.FSDP2_PACKAGE}._fsdp_state:FSDPState._lazy_init", _record_root),
        *group_targets(_note_plain_trainable),
    ),
    changes="each optimizer's first step compares its unmanaged trainable parameters across the data-parallel ranks",
    kind=GUARD,
)
