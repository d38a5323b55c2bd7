"""Scenarios run by every rank of a 2-rank gloo CPU job (see ``_dist_launcher``).

Run as ``python _dist_scenarios.py <scenario> <result file> <json args>``. The file is
also imported by the tests for the shared pieces: the tiny models, the per-rank data
plans and the single-process reference (``reference_grads``).

A rank records what the tests assert into ``cases[<case>]``: gradients as this rank's
local shard (``None`` when ``param.grad is None``), full gradients via
``DTensor.full_tensor()`` where every rank has one, weights, AdamW step counts and the
``fsdp_autopatch`` registry. An exception is recorded (type, message, traceback) and the
rank then leaves with ``os._exit`` right after saving, so a peer stuck in a collective
gets a closed connection instead of waiting for the launcher's timeout.

``fsdp_autopatch`` is not imported before the first case has trained (its registry is
saved with every case), except where a scenario needs its API (the forced backport), so a
run tests exactly what the ``.pth`` bootstrap installed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import traceback
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM = 8
OUT = 4
ROWS_PER_RANK = 4
WORLD_SIZE = 2
MODEL_SEED = 1234

# --------------------------------------------------------------------------------------
# Tiny models (constructed identically on every rank and in the test process)
# --------------------------------------------------------------------------------------


class TextVisionModel(nn.Module):
    """A text path, a separately wrapped vision tower and a shared layer."""

    IMAGE_DIM = 6

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.tower = nn.Sequential(nn.Linear(self.IMAGE_DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
        self.shared = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(x)
        if image is not None:
            h = h + self.tower(image)
        return self.head(torch.tanh(self.shared(h)))


class ExpertsModel(nn.Module):
    """One FSDP unit holding equally shaped experts; ``experts`` picks the ones used."""

    def __init__(self, n_experts: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(n_experts))
        self.out = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor, experts: tuple[int, ...] = ()) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        y = h
        for e in experts:
            y = y + self.experts[e](h)
        return self.out(torch.tanh(y))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class MLP(nn.Module):
    """Every parameter is used by every rank in every micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "text_vision": TextVisionModel,
    "experts": ExpertsModel,
    "mlp": MLP,
}


def build_model(kind: str, **kw: Any) -> nn.Module:
    torch.manual_seed(MODEL_SEED)
    return MODELS[kind](**kw)


# --------------------------------------------------------------------------------------
# Data plans: plan(rank, step, micro_batch) -> forward kwargs + target
# --------------------------------------------------------------------------------------


def _randn(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def batch(rank: int, step: int, mb: int, **fwd: Any) -> dict[str, Any]:
    """This rank's rows of the global batch for (step, micro-batch)."""
    seed = 10_000 + 1000 * step + 100 * mb + rank
    return {
        "x": _randn(seed, ROWS_PER_RANK, DIM),
        "target": _randn(seed + 50_000, ROWS_PER_RANK, OUT),
        **fwd,
    }


def image(rank: int, step: int, mb: int) -> torch.Tensor:
    return _randn(90_000 + 1000 * step + 100 * mb + rank, ROWS_PER_RANK, TextVisionModel.IMAGE_DIM)


def plan_grad_guard(rank: int, step: int, mb: int) -> dict[str, Any]:
    # step 0: text-only micro-batches (the tower never runs forward);
    # step 1: text-only, then a micro-batch with images on every rank.
    if step == 1 and mb == 1:
        return batch(rank, step, mb, image=image(rank, step, mb))
    return batch(rank, step, mb)


def plan_expert_routing(rank: int, step: int, mb: int) -> dict[str, Any]:
    # rank r uses expert r only; expert 2 is used by both ranks, expert 3 by none
    return batch(rank, step, mb, experts=(rank, 2))


def plan_expert_routing_uneven(rank: int, step: int, mb: int) -> dict[str, Any]:
    # rank 0 uses experts 0 and 2, rank 1 only expert 2: different reduce-scatter sizes
    return batch(rank, step, mb, experts=(0, 2) if rank == 0 else (2,))


def plan_uniform_late_param(rank: int, step: int, mb: int) -> dict[str, Any]:
    # expert 1 is first used in the last micro-batch (every rank)
    return batch(rank, step, mb, experts=(0,) if mb == 0 else (0, 1))


def plan_uniform_fill_zero(rank: int, step: int, mb: int) -> dict[str, Any]:
    # expert 1 is used by rank 0 in micro-batch 0 only; rank 1 never uses it, so with the
    # unused-param fill rank 1 reduces a bf16 zero next to fp32 accumulated gradients
    return batch(rank, step, mb, experts=(0, 1) if (rank == 0 and mb == 0) else (0,))


def plan_restore_unused(rank: int, step: int, mb: int) -> dict[str, Any]:
    # step 0 (warm-up): every expert used on every rank; step 1: rank r uses expert r,
    # expert 2 is used by no rank
    return batch(rank, step, mb, experts=(0, 1, 2) if step == 0 else (rank,))


def plan_mlp(rank: int, step: int, mb: int) -> dict[str, Any]:
    return batch(rank, step, mb)


PLANS: dict[str, Callable[[int, int, int], dict[str, Any]]] = {
    "grad_guard": plan_grad_guard,
    "expert_routing": plan_expert_routing,
    "expert_routing_uneven": plan_expert_routing_uneven,
    "uniform_late_param": plan_uniform_late_param,
    "uniform_fill_zero": plan_uniform_fill_zero,
    "restore_unused": plan_restore_unused,
    "mlp": plan_mlp,
}


def loss_fn(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    kw = dict(inputs)
    target = kw.pop("target")
    out = model(**kw)
    return F.mse_loss(out.float(), target)


# --------------------------------------------------------------------------------------
# Single-process reference (used by the tests)
# --------------------------------------------------------------------------------------


def reference_grads(
    model: nn.Module,
    plan: Callable[[int, int, int], dict[str, Any]],
    step: int,
    n_micro_batches: int,
    *,
    ranks: tuple[int, ...] = tuple(range(WORLD_SIZE)),
    world_size: int = WORLD_SIZE,
) -> dict[str, torch.Tensor | None]:
    """Gradients FSDP2 must produce for one optimizer step, computed in one process.

    FSDP2 averages each micro-batch's per-rank gradients over the ranks and sums the
    micro-batches, i.e. the gradient of ``sum_mb mean_over_ranks(local mean loss)``: the
    global-batch mean loss of every micro-batch (equal rows per rank). ``ranks`` limits
    the sum to some ranks (still divided by ``world_size``), for per-rank gradients.
    """
    model.zero_grad(set_to_none=True)
    for mb in range(n_micro_batches):
        loss = sum(loss_fn(model, plan(r, step, mb)) for r in ranks) / world_size
        loss.backward()
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def shard_rows(full: torch.Tensor, rank: int, world_size: int = WORLD_SIZE) -> torch.Tensor:
    """The rows of ``full`` that FSDP2's Shard(0) gives ``rank`` (torch.chunk semantics)."""
    chunks = torch.chunk(full, world_size, dim=0)
    return chunks[rank] if rank < len(chunks) else full[:0]


# --------------------------------------------------------------------------------------
# Rank-side helpers
# --------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.detach().clone()


def grads_local(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else _local(p.grad) for n, p in model.named_parameters()}


def params_local(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _local(p) for n, p in model.named_parameters()}


def grads_full(model: nn.Module) -> dict[str, torch.Tensor]:
    """``grad.full_tensor()`` for the params that have a gradient on every rank.

    Presence is agreed on first (one small collective), so every rank issues the same
    all-gathers even when some gradients are None on some ranks.
    """
    import torch.distributed as dist

    params = list(model.named_parameters())
    present = torch.tensor([int(p.grad is not None) for _, p in params], dtype=torch.int32)
    dist.all_reduce(present, op=dist.ReduceOp.MIN)
    out = {}
    for flag, (n, p) in zip(present.tolist(), params):
        if flag:
            out[n] = p.grad.full_tensor().detach().clone()
    return out


def adam_steps(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for n, p in model.named_parameters():
        st = opt.state.get(p, {})
        out[n] = float(st["step"]) if "step" in st else None
    return out


def group_flags(model: nn.Module) -> dict[str, bool | None]:
    """``reduce_scatter_unused_params`` of every FSDP unit's parameter groups."""
    from torch.distributed.fsdp import FSDPModule

    out: dict[str, bool | None] = {}
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                g = getattr(state, "_fsdp_param_group", None)
                groups = [] if g is None else [g]
            for i, g in enumerate(groups):
                out[f"{name or '<root>'}[{i}]"] = getattr(g, "reduce_scatter_unused_params", None)
    return out


def autopatch_status() -> dict[str, Any]:
    """The plugin's registry as seen by this rank (tolerates the package's absence)."""
    try:
        import fsdp_autopatch
    except Exception as e:  # noqa: BLE001 - record, never fail here
        return {"import_error": f"{type(e).__name__}: {e}"}
    try:
        d = fsdp_autopatch.status().to_dict()
        d["applied"] = list(fsdp_autopatch.applied())
        return d
    except Exception as e:  # noqa: BLE001
        return {"status_error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


class Ctx:
    def __init__(self, result_path: str, args: dict[str, Any]) -> None:
        self.result_path = result_path
        self.args = args
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.mesh: Any = None
        self.data: dict[str, Any] = {
            "rank": self.rank,
            "torch": torch.__version__,
            "args": args,
            "cases": {},
            "error": None,
        }

    def save(self) -> None:
        # the registry is saved with every case: a rank that dies later (a gloo abort
        # kills the process) still reports it
        self.data["autopatch"] = autopatch_status()
        tmp = self.result_path + ".tmp"
        torch.save(self.data, tmp)
        os.replace(tmp, self.result_path)

    @contextlib.contextmanager
    def case(self, name: str, *, continue_on_error: bool = False):
        rec: dict[str, Any] = {"error": None}
        self.data["cases"][name] = rec
        try:
            yield rec
        except Exception as e:
            rec["error"] = _error_record(e)
            self.save()
            if not continue_on_error:
                raise
        else:
            self.save()


def _error_record(e: BaseException) -> dict[str, str]:
    return {
        "type": type(e).__name__,
        "message": str(e),
        "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
    }


def _mp_policy(kind: str | None):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if kind is None:
        return MixedPrecisionPolicy()
    if kind == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise ValueError(kind)


def _run_step(ctx: Ctx, model: nn.Module, plan, step: int, n_mb: int, *, accumulate: bool = True) -> None:
    """One optimizer step's forward/backward: sync only on the last micro-batch."""
    for mb in range(n_mb):
        if accumulate:
            model.set_requires_gradient_sync(mb == n_mb - 1)
        loss = loss_fn(model, plan(ctx.rank, step, mb))
        loss.backward()


# --------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------


def sc_grad_guard(ctx: Ctx) -> None:
    """Vision tower skipped by text-only micro-batches, bf16/fp32 MP, accumulation."""
    from torch.distributed.fsdp import fully_shard

    model = build_model("text_vision")
    mp = _mp_policy("bf16")
    fully_shard(model.tower, mesh=ctx.mesh, mp_policy=mp)
    fully_shard(model.shared, mesh=ctx.mesh, mp_policy=mp)
    fully_shard(model, mesh=ctx.mesh, mp_policy=mp)
    ctx.data["init_params"] = params_local(model)
    with ctx.case("text_only") as rec:  # step 0: the tower has never run forward
        _run_step(ctx, model, plan_grad_guard, step=0, n_mb=2)
        rec["grads"] = grads_local(model)
        rec["full_grads"] = grads_full(model)
    model.zero_grad(set_to_none=True)
    with ctx.case("image_last") as rec:  # step 1: text-only, then images
        _run_step(ctx, model, plan_grad_guard, step=1, n_mb=2)
        rec["grads"] = grads_local(model)
        rec["full_grads"] = grads_full(model)


def sc_expert_routing(ctx: Ctx) -> None:
    """Rank r uses expert r inside one FSDP unit; expert 2 both ranks, expert 3 none (fp32).

    args["modes"]: the cases to run, each on a fresh model, in order:
    "native" (torch's public API); "flag_off" (nothing set: the ranks reduce different
    parameter lists of equal total size); "flag_off_uneven" (nothing set, rank 0 uses
    one expert more than rank 1: different sizes, gloo aborts, so it must come last);
    "backport" (public API deleted, the plugin's backport forced; alone in its job);
    "env_policy" (nothing in code; the launcher sets
    FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS=1).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    modes = ctx.args["modes"]
    if "backport" in modes:
        assert modes == ["backport"], "the backport changes torch for the whole process"
        method = FSDPModule.__dict__.get("set_reduce_scatter_unused_params")
        if method is not None and not getattr(method, "__fsdp_autopatch__", False):
            del FSDPModule.set_reduce_scatter_unused_params  # simulate torch < 2.13
        ctx.data["backport"] = _force_unused_param_backport()
    native_fill_calls = _count_native_fill()
    for mode in modes:
        with ctx.case(mode) as rec:
            model = build_model("experts", n_experts=4)
            fully_shard(model, mesh=ctx.mesh)
            if mode in ("native", "backport"):
                model.set_reduce_scatter_unused_params(True)
            rec["group_flags"] = group_flags(model)
            rec["init_params"] = params_local(model)
            before = native_fill_calls[0]
            plan = plan_expert_routing_uneven if mode == "flag_off_uneven" else plan_expert_routing
            _run_step(ctx, model, plan, step=0, n_mb=1, accumulate=False)
            rec["native_fill_calls"] = native_fill_calls[0] - before
            rec["grads"] = grads_local(model)
            if not mode.startswith("flag_off"):  # flag off: a grad may be None on one rank only
                rec["full_grads"] = grads_full(model)


def _count_native_fill() -> list[int]:
    """Count torch 2.13's own zero fill (``FSDPParam.unsharded_zero_grad_data``).

    With the backport forced, its fill runs first, so torch's never has to: the count
    stays 0 and the gradients are right only because of the backport.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    calls = [0]
    prop = FSDPParam.__dict__.get("unsharded_zero_grad_data")
    if isinstance(prop, property):

        def counted(self):
            calls[0] += 1
            return prop.fget(self)

        FSDPParam.unsharded_zero_grad_data = property(counted)
    return calls


def _force_unused_param_backport() -> dict[str, Any]:
    """Apply the plugin's ``unused_param_reduction`` backport on a torch that has the API.

    Run after ``del FSDPModule.set_reduce_scatter_unused_params``. The patch order of
    a torch < 2.13 process is kept: ``restore_unused_param_grads`` (applied at import)
    is reverted, the backport applied, then the restore patch applied again on top, so
    its usage probe runs before the backport's zero fill as it would on torch 2.12.
    """
    from torch.distributed.fsdp import FSDPModule

    import fsdp_autopatch.patches.restore_unused_param_grads as restore
    import fsdp_autopatch.patches.unused_param_reduction as upr
    from fsdp_autopatch import _activate, _patching

    info: dict[str, Any] = {"check": repr(_activate.verdict_of(upr.PATCH))}
    _patching.revert(restore.PATCH.name)
    info["apply"] = _patching.apply(upr.PATCH)
    info["restore_check"] = repr(_activate.verdict_of(restore.PATCH))
    info["restore_apply"] = _patching.apply(restore.PATCH)
    method = getattr(FSDPModule, "set_reduce_scatter_unused_params", None)
    info["has_method"] = method is not None
    info["method_is_backport"] = bool(getattr(method, "__fsdp_autopatch__", False))
    return info


def sc_uniform_dtype(ctx: Ctx) -> None:
    """bf16 params, fp32 reduce, accumulation; mixed gradient dtypes at the reduce.

    Case "late_param": expert 1 is first used in the last micro-batch on every rank
    (the upstream assertion, when unpatched, fires on every rank before any collective,
    so the job can go on). Case "fill_zero": the unused-param fill gives rank 1 a bf16
    zero for expert 1 while its other gradients are fp32 accumulations (unpatched: the
    assertion fires on rank 1 only).
    """
    from torch.distributed.fsdp import fully_shard

    mp = _mp_policy("bf16")
    for name, plan, fill in (
        ("late_param", plan_uniform_late_param, False),
        ("fill_zero", plan_uniform_fill_zero, True),
    ):
        model = build_model("experts", n_experts=2)
        fully_shard(model, mesh=ctx.mesh, mp_policy=mp)
        if fill:
            model.set_reduce_scatter_unused_params(True)
        with ctx.case(name, continue_on_error=(name == "late_param")) as rec:
            rec["init_params"] = params_local(model)
            _run_step(ctx, model, plan, step=0, n_mb=2)
            rec["grads"] = grads_local(model)
            rec["full_grads"] = grads_full(model)


def sc_restore_unused(ctx: Ctx) -> None:
    """Fill on, AdamW(weight_decay>0); warm-up step, then expert 2 used by no rank."""
    from torch.distributed.fsdp import fully_shard

    model = build_model("experts", n_experts=3)
    fully_shard(model, mesh=ctx.mesh)
    model.set_reduce_scatter_unused_params(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ctx.data["init_params"] = params_local(model)
    with ctx.case("warmup") as rec:
        _run_step(ctx, model, plan_restore_unused, step=0, n_mb=1, accumulate=False)
        rec["grads"] = grads_local(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec["steps_after"] = adam_steps(model, opt)
        rec["params_after"] = params_local(model)
    with ctx.case("partial") as rec:
        rec["params_before"] = params_local(model)
        rec["steps_before"] = adam_steps(model, opt)
        rec["exp_avg_before"] = {n: _local(opt.state[p]["exp_avg"]) for n, p in model.named_parameters()}
        _run_step(ctx, model, plan_restore_unused, step=1, n_mb=1, accumulate=False)
        rec["grads"] = grads_local(model)
        rec["full_grads"] = grads_full(model)
        opt.step()
        rec["params_after"] = params_local(model)
        rec["steps_after"] = adam_steps(model, opt)


def sc_no_change(ctx: Ctx) -> None:
    """Nothing unused; fp32, bf16/fp32 MP, and MP with the fill on: 2 AdamW steps."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for name, mp_kind, fill in (("fp32", None, False), ("mp", "bf16", False), ("mp_fill", "bf16", True)):
        if fill and not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
            continue  # torch < 2.13 with the plugin off: no fill to compare
        model = build_model("mlp")
        mp = _mp_policy(mp_kind)
        for b in model.blocks:
            fully_shard(b, mesh=ctx.mesh, mp_policy=mp)
        fully_shard(model, mesh=ctx.mesh, mp_policy=mp)
        if fill:
            model.set_reduce_scatter_unused_params(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        with ctx.case(name) as rec:
            rec["init_params"] = params_local(model)
            for step in range(2):
                _run_step(ctx, model, plan_mlp, step=step, n_mb=2)
                rec[f"grads_{step}"] = grads_local(model)
                opt.step()
                opt.zero_grad(set_to_none=True)
            rec["params_after"] = params_local(model)
            rec["steps_after"] = adam_steps(model, opt)


def count_cross_rank_checks() -> list[int]:
    """``[n]``: how many process groups this rank's cross-rank check compared so far."""
    calls = [0]
    try:
        import fsdp_autopatch._consistency as consistency
    except ImportError:
        return calls
    announce = consistency._announce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return announce(*args, **kwargs)

    consistency._announce = counted
    return calls


def sc_cross_rank(ctx: Ctx) -> None:
    """Two models on the same process group, two steps each: the check runs once per group.

    ``checks`` counts the process groups this rank compared (``count_cross_rank_checks``).
    """
    from torch.distributed.fsdp import fully_shard

    calls = count_cross_rank_checks()
    for name in ("first_model", "second_model"):
        with ctx.case(name) as rec:
            model = build_model("mlp")
            for b in model.blocks:
                fully_shard(b, mesh=ctx.mesh)
            fully_shard(model, mesh=ctx.mesh)
            rec["init_params"] = params_local(model)
            for step in range(2):
                _run_step(ctx, model, plan_mlp, step=step, n_mb=1, accumulate=False)
            rec["checks"] = calls[0]
            rec["grads"] = grads_local(model)


def sc_restore_hsdp_window(ctx: Ctx) -> None:
    """HSDP mesh (2 replicas x 1 shard), fill on, all-reduce deferred on the first micro-batch.

    Micro-batch 0: both replicas use expert 0 (its gradient goes into the pending partial reduce).
    Micro-batch 1: no replica uses expert 0 (the fill's zero folds into that partial reduce).
    Expert 0's final gradient holds micro-batch 0's contribution and must survive; expert 2 is
    used in no micro-batch of the window.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ctx.world_size, 1), mesh_dim_names=("replicate", "shard"))
    model = build_model("experts", n_experts=3)
    fully_shard(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(True)
    with ctx.case("window") as rec:
        for mb, experts in enumerate(((0, 1), (1,))):
            model.set_requires_all_reduce(mb == 1)
            x = _randn(100 + 10 * ctx.rank + mb, ROWS_PER_RANK, DIM)
            model(x, experts=experts).pow(2).mean().backward()
        rec["grads"] = {
            n: (None if p.grad is None else p.grad.full_tensor()) for n, p in model.named_parameters()
        }


def count_restore_all_reduces() -> list[int]:
    """The sizes of the all-reduces restore_unused_param_grads issues (only the patch's own)."""
    calls: list[int] = []
    try:
        from fsdp_autopatch.patches import restore_unused_param_grads as restore
    except ImportError:
        return calls
    real_dist = restore.dist

    class CountingDist:
        def __getattr__(self, name: str) -> Any:
            return getattr(real_dist, name)

        def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append(tensor.numel())
            return real_dist.all_reduce(tensor, *args, **kwargs)

    restore.dist = CountingDist()
    return calls


def sc_restore_collectives(ctx: Ctx) -> None:
    """How many all-reduces restore_unused_param_grads adds per backward, and of what size.

    MLP with 3 FSDP units (2 blocks + root holding the head), all on one process group. Cases:
    fill off everywhere; fill on one block only (recurse=False); fill on every unit.
    """
    from torch.distributed.fsdp import fully_shard

    calls = count_restore_all_reduces()
    for name in ("fill_off", "fill_one_unit", "fill_all"):
        model = build_model("mlp")
        for b in model.blocks:
            fully_shard(b, mesh=ctx.mesh)
        fully_shard(model, mesh=ctx.mesh)
        if name == "fill_one_unit":
            model.blocks[0].set_reduce_scatter_unused_params(True, recurse=False)
        elif name == "fill_all":
            model.set_reduce_scatter_unused_params(True)
        with ctx.case(name) as rec:
            del calls[:]
            for step in range(2):
                _run_step(ctx, model, plan_mlp, step=step, n_mb=1, accumulate=False)
            rec["all_reduce_numels"] = list(calls)
            rec["grads"] = grads_local(model)


SCENARIOS: dict[str, Callable[[Ctx], None]] = {
    "grad_guard": sc_grad_guard,
    "expert_routing": sc_expert_routing,
    "uniform_dtype": sc_uniform_dtype,
    "restore_unused": sc_restore_unused,
    "no_change": sc_no_change,
    "restore_hsdp_window": sc_restore_hsdp_window,
    "restore_collectives": sc_restore_collectives,
    "cross_rank": sc_cross_rank,
}


def main() -> None:
    name, result_path, args_json = sys.argv[1], sys.argv[2], sys.argv[3]
    ctx = Ctx(result_path, json.loads(args_json))
    code = 0
    try:
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        timeout = int(os.environ.get("FSDP_DIST_PG_TIMEOUT_S", "30"))
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
        ctx.mesh = init_device_mesh("cpu", (ctx.world_size,))
        ctx.data["gloo_avg_sums"] = _gloo_reduce_scatter_avg_sums()
        if ctx.data["gloo_avg_sums"]:
            _force_sum_reduction_in_fully_shard()
        SCENARIOS[name](ctx)
    except BaseException as e:  # noqa: BLE001 - record everything, then leave
        ctx.data["error"] = _error_record(e)
        code = 3
    ctx.data["fsdp_module_has_api"] = _has_public_api()
    try:
        ctx.save()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # No destroy_process_group / interpreter teardown: a peer may be wedged in a
        # collective, and this rank must not wait for it.
        os._exit(code)


def _gloo_reduce_scatter_avg_sums() -> bool:
    """Whether this torch's gloo reduce-scatter ignores ``ReduceOp.AVG`` and sums.

    torch 2.8 does (PyTorch issue 162338): FSDP2 reduce-scatters fp32/bf16 gradients with AVG,
    so on gloo every gradient comes out multiplied by the world size, with or without this
    plugin. Probed with one tiny collective rather than guessed from the version.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    inp = torch.full((world,), float(dist.get_rank() + 1))
    out = torch.empty(1)
    dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.AVG)
    mean = (world + 1) / 2
    return not torch.allclose(out, torch.tensor([mean]))


def _force_sum_reduction_in_fully_shard() -> None:
    """Work around the gloo AVG bug the way a user would: every ``fully_shard`` unit gets
    ``set_force_sum_reduction_for_comms(True)`` (SUM, then FSDP2 divides by the world size).
    The scenarios import ``fully_shard`` from ``torch.distributed.fsdp`` when they run, so they
    all get this wrapper."""
    import torch.distributed.fsdp as fsdp

    original = fsdp.fully_shard

    # wraps: keeps the contract's attributes, e.g. ``fully_shard.state``, which torch 2.8 - 2.14's
    # pipelining stage calls on the fully_shard it imports from torch.distributed.fsdp.
    @functools.wraps(original)
    def fully_shard(module, *args, **kwargs):
        result = original(module, *args, **kwargs)
        for m in result if isinstance(result, list) else [result]:
            m.set_force_sum_reduction_for_comms(True)
        return result

    fsdp.fully_shard = fully_shard


def _has_public_api() -> bool | None:
    mod = sys.modules.get("torch.distributed.fsdp")
    if mod is None:
        return None
    return hasattr(mod.FSDPModule, "set_reduce_scatter_unused_params")


if __name__ == "__main__":
    main()
