"""What the 2-rank gloo scenarios and their tests share: models, data, references, rank helpers.

Imported by the scenario modules (``_*_scenarios.py``, see ``_registry``) and by the tests: the
tiny models, the per-rank data plans, the single-process reference (``reference_grads``), and on
the rank side the ``Ctx`` a scenario records into and the helpers that read gradients, weights and
the plugin's registry.

A rank records what the tests assert into ``cases[<case>]``: gradients as this rank's
local shard (``None`` when ``param.grad is None``), full gradients via
``DTensor.full_tensor()`` where every rank has one, weights, AdamW step counts and the
``fsdp_autopatch`` registry. An exception is recorded (type, message, traceback) and the
rank then leaves with ``os._exit`` right after saving (``_rank``), so a peer stuck in a
collective gets a closed connection instead of waiting for the launcher's timeout.

``fsdp_autopatch`` is not imported before the first case has trained (its registry is
saved with every case), except where a scenario needs its API (the forced backport), so a
run tests exactly what the ``.pth`` bootstrap installed.
"""


from __future__ import annotations

import contextlib
import os
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
