"""Call-time isolation on real FSDP2 training: a function of ours made to raise inside a wrapper.

Scenario ``call_faults`` (``run_ranks("call_faults")``, gloo ranks on CPU, the plugin on as the
``.pth`` installed it). ``args["plan"]``: ``[case, phases, strict]`` entries, run in
order in one process. A case (:data:`CASES`) names a patch, the function of ours replaced by a
stand-in (made with that module's globals, so a traceback shows it as the module's own function),
the wrapper of ours that must be on the stack for the stand-in to act, and the training runs
(:data:`RUNS`) each phase makes, every run on a fresh model with the same seeds. Phases:

- ``off``: the patch reverted (``_patching.revert``): torch's own behaviour;
- ``healthy``: the patch applied afresh, the stand-in counting its calls (the runs reach it);
- ``fault``: the stand-in raises :class:`InjectedFault` (kind ``torch``: a ``RuntimeError`` as a
  collective of torch's would) at its first call from the wrapper, and on every later one;
- ``later``: the stand-in counting again: a patch that failed never calls it.

Each phase records every run's outcome (the values, or the exception), the stand-in's calls, the
patch's ``fired`` growth and its registry record. ``strict``: ``_isolation.set_strict(True)`` for
that entry (what ``FSDP_AUTOPATCH_STRICT=1`` sets at activation). After each entry the patch is
reverted, applied again if it was, and its registry record put back, so that cases do not mix.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types
from collections import Counter
from typing import Any, Callable, NamedTuple

import _dist_common as sc
from _call_fault_runs import outcome
from _registry import scenario

EXAMPLE = "post_backward_census"  # the third-party example (examples/third_party_patch)
POLICY = "reduce_scatter_unused_params_default_on"
_P = "fsdp_autopatch.patches."


class InjectedFault(Exception):
    """The bug of ours a case injects; never raised by torch."""


class Case(NamedTuple):
    patch: str  # the registry (or policy) name, the guard's name
    target: str  # "module:attribute" replaced by the stand-in ("" for none)
    inside: str  # the function of ours the stand-in acts under (on the stack)
    runs: tuple[str, ...]
    where: str = ""  # what the record must name, "module.function" (default: the target)
    kind: str = "ours"  # "ours": InjectedFault; "torch": a RuntimeError as torch's collective raises


CASES = {
    "accumulated_grad_guard/before": Case(
        "accumulated_grad_guard", "fsdp_autopatch._compat:unsharded_param", "_skip_never_unsharded",
        ("mlp_bf16_accum", "tower_skipped")),
    "uniform_reduce_dtype/before": Case(
        "uniform_reduce_dtype", _P + "uniform_reduce_dtype:make_uniform", "_uniform_dtype_reduce",
        ("mlp_bf16_accum", "late_param")),
    "restore_unused_param_grads/before": Case(
        "restore_unused_param_grads", "fsdp_autopatch._compat:has_local_grad", "_probe_usage", ("unused_expert",)),
    "restore_unused_param_grads/after": Case(
        "restore_unused_param_grads", _P + "restore_unused_param_grads:restore_unused", "_restore_probed",
        ("unused_expert",)),
    "post_forward_mesh_cache/before": Case(
        "post_forward_mesh_cache", _P + "post_forward_mesh_cache:layout_key", "_shared_post_forward_mesh",
        ("reshard_int",)),
    "post_forward_mesh_cache/after": Case(
        "post_forward_mesh_cache", _P + "post_forward_mesh_cache:SHARED.put", "_shared_post_forward_mesh",
        ("reshard_int",), where=_P + "post_forward_mesh_cache.SharedMeshes.put"),
    "grouped_module_reuse/before": Case(
        "grouped_module_reuse", _P + "grouped_module_reuse:_remember", "partial_and_remember",
        ("reuse_full", "reuse_mtp")),
    "grouped_module_reuse/after": Case(
        "grouped_module_reuse", _P + "grouped_module_reuse:_grad_nodes", "_hook_remembered_outputs",
        ("reuse_mtp", "reuse_full")),
    "keep_param_attributes/before": Case(
        "keep_param_attributes", _P + "keep_param_attributes:mirror_from", "_keep_attributes", ("attributes",)),
    "keep_param_attributes/after": Case(
        "keep_param_attributes", _P + "keep_param_attributes:mirror_from", "_keep_attributes_across_apply",
        ("attributes",)),
    "clip_grad_norm_multi_mesh/before": Case(
        "clip_grad_norm_multi_mesh", _P + "clip_grad_norm_multi_mesh:_mesh_groups", "_total_norm_across_meshes",
        ("clip_one_mesh", "clip_two_meshes")),
    "clip_grad_norm_multi_mesh/after": Case(
        "clip_grad_norm_multi_mesh", _P + "clip_grad_norm_multi_mesh:_norm_of_group_norms",
        "_total_norm_across_meshes", ("clip_two_meshes", "clip_one_mesh")),
    "cross_rank_check/after": Case(
        "cross_rank_check", "fsdp_autopatch.patches.cross_rank_check:check_groups", "check_after_lazy_init", ("mlp",)),
    f"{POLICY}/after": Case(
        POLICY, _P + f"{POLICY}:unused_param_reduction", "_start_with_flag_on", ("mlp",),
        where=_P + f"{POLICY}._start_with_flag_on"),
    f"{EXAMPLE}/before": Case(
        EXAMPLE, "fsdp_autopatch_example:_counts", "_count", ("mlp",), where="fsdp_autopatch_example._count"),
    # torch raises inside a wrapped call: the user must see torch's own exception
    "torch/invalid_reshard_after_forward": Case("post_forward_mesh_cache", "", "", ("invalid_reshard",)),
    "torch/collective": Case(
        "restore_unused_param_grads", _P + "restore_unused_param_grads:dist", "restore_unused", ("unused_expert",),
        kind="torch"),
    # the collective clip_grad_norm_multi_mesh issues itself: each group norm's full_tensor()
    "torch/clip_collective": Case(
        "clip_grad_norm_multi_mesh", "torch.distributed.tensor._api:DTensor.full_tensor", "_plain",
        ("clip_two_meshes",), kind="torch"),
}
COLLECTIVE_ERROR = "[gloo] injected: connection closed by peer"


def message_of(name: str) -> str:
    """The message of the InjectedFault case ``name`` raises."""
    return f"injected into {CASES[name].target.rpartition(':')[2]} ({name})"


def where_of(name: str) -> str:
    """The function of ours the record of case ``name`` must name."""
    case = CASES[name]
    return case.where or case.target.replace(":", ".")


# --- the stand-ins ---------------------------------------------------------------------------


class Injector:
    """Replaces ``case.target``; acts only when ``case.inside`` is on the stack."""

    def __init__(self, name: str, case: Case) -> None:
        self.case, self.calls, self.raising = case, 0, False
        self.message = message_of(name)
        module_name, _, path = case.target.partition(":")
        self.module = importlib.import_module(module_name)
        *parents, self.attribute = path.split(".")
        self.owner = self.module
        for parent in parents:
            self.owner = getattr(self.owner, parent)
        self.original = getattr(self.owner, self.attribute)
        self.own_attribute = self.attribute in vars(self.owner)

    def hit(self) -> None:
        # the function of ours that called the stand-in, or one of the two above it (not further:
        # a wrapper nested inside torch's call of another wrapper of the patch must not count)
        frame, names = sys._getframe(2), []
        while frame is not None and len(names) < 3:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if self.case.inside not in names:
            return
        self.calls += 1
        if self.raising:
            raise RuntimeError(COLLECTIVE_ERROR) if self.case.kind == "torch" else InjectedFault(self.message)

    def install(self) -> None:
        setattr(self.owner, self.attribute, self._stand_in())

    def uninstall(self) -> None:
        if self.own_attribute:
            setattr(self.owner, self.attribute, self.original)
        else:
            delattr(self.owner, self.attribute)

    def _stand_in(self) -> Any:
        original, hit = self.original, self.hit
        if isinstance(original, types.ModuleType):  # a module a wrapper reads a name or a collective from
            return _Module(original, hit)
        if isinstance(original, Counter):  # the example's census counter
            return _Counts(original, hit)

        def stand_in(*args: Any, **kwargs: Any) -> Any:
            hit()
            return original(*args, **kwargs)

        qualname = getattr(original, "__qualname__", self.attribute)
        code = stand_in.__code__.replace(co_name=self.attribute)
        if hasattr(code, "co_qualname"):
            code = code.replace(co_qualname=qualname)
        # the module's own globals: a traceback through it shows the module's function
        return types.FunctionType(code, vars(self.module), self.attribute, None, stand_in.__closure__)


class _Module:
    def __init__(self, module: types.ModuleType, hit: Callable[[], None]) -> None:
        self._module, self._hit = module, hit

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if name == "FLAG":  # the attribute name the policy's wrapper sets
            self._hit()
        elif name == "all_reduce":  # restore's collective: it raises as torch's would, when called
            hit = self._hit

            def all_reduce(*args: Any, **kwargs: Any) -> Any:
                hit()
                return value(*args, **kwargs)

            return all_reduce
        return value


class _Counts:
    def __init__(self, counts: Counter, hit: Callable[[], None]) -> None:
        self._counts, self._hit = counts, hit

    def __getitem__(self, key: str) -> int:
        self._hit()
        return self._counts[key]

    def __setitem__(self, key: str, value: int) -> None:
        self._counts[key] = value


# --- one case ----------------------------------------------------------------------------------


def _declaration(name: str) -> Any:
    if name == EXAMPLE:
        import fsdp_autopatch_example

        return fsdp_autopatch_example.PATCH
    from fsdp_autopatch import patches

    return patches.load_patch(name)


def record_of(name: str) -> dict[str, Any]:
    import fsdp_autopatch

    report = fsdp_autopatch.status()
    try:
        record = report[name]
    except KeyError:  # a policy: recorded under "policies"
        return {"status": None, "reason": report.policies.get(name), "fired": None}
    return {"status": record.status.value, "reason": record.reason, "fired": record.fired}


def _census() -> int | None:
    module = sys.modules.get("fsdp_autopatch_example")
    if module is None:
        return None
    counts = module._counts
    return sum(getattr(counts, "_counts", counts).values())  # through the stand-in, if installed


class Warnings(logging.Handler):
    """The WARNING records of the ``fsdp_autopatch`` logger (the one a call-time failure logs)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:300])


WARNINGS = Warnings()


def run_phase(ctx: sc.Ctx, case: Case, injector: Injector | None, phase: str) -> dict[str, Any]:
    from fsdp_autopatch.patches import post_forward_mesh_cache

    post_forward_mesh_cache.SHARED._by_world.clear()  # every phase builds its meshes anew
    if injector is not None:
        injector.calls, injector.raising = 0, phase == "fault"
    before, census, logged = record_of(case.patch)["fired"], _census(), len(WARNINGS.messages)
    runs = {run: outcome(ctx, run) for run in case.runs}
    record = record_of(case.patch)
    return {
        "runs": runs,
        "calls": None if injector is None else injector.calls,
        "fired": None if before is None else record["fired"] - before,
        "census": None if census is None else _census() - census,
        "record": record,
        "warnings": WARNINGS.messages[logged:],
    }


def run_case(ctx: sc.Ctx, name: str, phases: list[str], strict: bool) -> dict[str, Any]:
    from fsdp_autopatch import _isolation, _patching
    from fsdp_autopatch._registry import REGISTRY
    from fsdp_autopatch.patches import PATCH_NAMES as FIXES

    case = CASES[name]
    if case.patch in FIXES and not _patching.is_applied(case.patch):  # nothing to make fail here
        return {"skipped": record_of(case.patch)}
    patch, was_applied = _declaration(case.patch), _patching.is_applied(case.patch)
    saved = (REGISTRY._records.get(case.patch), dict(REGISTRY._policies))
    injector = Injector(name, case) if case.target else None
    rec: dict[str, Any] = {"was_applied": was_applied, "strict": strict}
    previous_strict = _isolation.is_strict()
    try:
        _patching.revert(case.patch)
        if "off" in phases:
            rec["off"] = run_phase(ctx, case, None, "off")
        _patching.apply(patch)
        _isolation.set_strict(strict or previous_strict)
        if injector is not None:
            injector.install()
        for phase in (p for p in phases if p != "off"):
            rec[phase] = run_phase(ctx, case, injector, phase)
    finally:
        _isolation.set_strict(previous_strict)
        if injector is not None:
            injector.uninstall()
        _patching.revert(case.patch)
        if was_applied:
            _patching.apply(patch)
        if saved[0] is not None:
            REGISTRY._records[case.patch] = saved[0]
        REGISTRY._policies.clear()
        REGISTRY._policies.update(saved[1])
    return rec


@scenario("call_faults")
def sc_call_faults(ctx: sc.Ctx) -> None:
    import torch.distributed.fsdp  # noqa: F401 - the plugin applies here

    from fsdp_autopatch import _isolation

    ctx.data["strict_at_start"] = _isolation.is_strict()
    ctx.data["example"] = importlib.util.find_spec("fsdp_autopatch_example") is not None
    logging.getLogger("fsdp_autopatch").addHandler(WARNINGS)
    for name, phases, strict in ctx.args["plan"]:
        with ctx.case(f"{name}/strict" if strict else name, continue_on_error=True) as rec:
            rec.update(run_case(ctx, name, phases, strict))
