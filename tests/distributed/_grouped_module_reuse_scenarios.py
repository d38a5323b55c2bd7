"""grouped_module_reuse scenarios (PyTorch issue 183702): a grouped unit's module called again, in
the ways its case (``mtp`` with one micro-batch on a 1-D mesh) does not show, and the paths the patch
must leave alone.

Scenario ``grouped_module_reuse`` (2 gloo ranks; ``_rank`` makes the 30 s process group and the
gloo-AVG workaround of torch 2.8), and the one-process worlds ``grouped_module_reuse:threaded`` and
``grouped_module_reuse:fake`` (``world_size=1``, ``gloo=False``). The test imports this module for
the model, the losses and the one-process reference.

The model is the issue's smallest input: ``layer = Linear(8, 8)``, ``norm = LayerNorm(8)``,
``head = Linear(8, 4, bias=False)``, ``mtp.proj = Linear(8, 8)``; units ``fully_shard(layer)``,
``fully_shard([norm, head])``, ``fully_shard(model)``. A case is ``<mode>/<micro-batches>`` (plus a
variant suffix): two optimizer steps, each of 1 or 2 micro-batches with
``set_requires_gradient_sync(False)`` on all but the last. Modes:

- ``mtp``: ``logits = head(norm(h)); model.mtp.aux = head(proj(h)); return logits`` (the bug);
- ``mtp2``: the head called twice more (``aux = head(p) + head(2 p)``);
- ``mtp_return``: ``aux`` returned from the forward (torch's own workaround);
- ``full``: the group used once per forward, the ordinary path;
- ``chunk_one``: chunked loss (PyTorch PR 180428): the forward runs ``norm`` only, ``head`` is called
  per chunk outside the root's forward, one backward;
- ``chunk_each``: the same, torchtitan style: a backward per chunk, then ``h.backward(hd.grad)``.

Variants of ``mtp/1``: ``hsdp`` (a (2, 1) replicate x shard mesh: gradients all-reduced over both
ranks), ``offload`` (``CPUOffloadPolicy`` on every unit), ``compile`` (``torch.compile`` of the root,
eager backend: dynamo runs the forward, FSDP2's hooks stay eager).

Each case records, per step, the full parameters before the step and the full gradients after
it, the counts of all-gathers, reduce-scatters and ``FSDPState._pre_backward`` calls, and the
plugin's fired count after it.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import _dist_common as sc
from _registry import scenario

STEPS = 2
LR = 1e-3
CHUNKS = 2
MODES = ("mtp", "mtp2", "mtp_return", "full", "chunk_one", "chunk_each")
# the bug's modes: a repeat call whose output the root's forward does not return
REUSE_MODES = ("mtp", "mtp2")
# outputs of repeat calls per forward that the patch hooks (what it counts as fired)
REPEAT_OUTPUTS = {"mtp": 1, "mtp2": 2}
VARIANTS = ("hsdp", "offload", "compile")


class MTP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(sc.DIM, sc.DIM)
        self.aux: torch.Tensor | None = None


class ReuseModel(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.layer = nn.Linear(sc.DIM, sc.DIM)
        self.norm = nn.LayerNorm(sc.DIM)
        self.head = nn.Linear(sc.DIM, sc.OUT, bias=False)
        self.mtp = MTP()

    def forward(self, x: torch.Tensor) -> Any:
        h = F.relu(self.layer(x))
        if self.mode.startswith("chunk"):
            return self.norm(h)  # the head runs outside, per chunk
        logits = self.head(self.norm(h))
        if self.mode == "full":
            return logits
        aux = self.head(self.mtp.proj(h))
        if self.mode == "mtp2":
            aux = aux + self.head(self.mtp.proj(h) * 2.0)
        if self.mode == "mtp_return":
            return logits, aux
        self.mtp.aux = aux
        return logits


def parse(case: str) -> tuple[str, int, str]:
    """``"mtp/2"`` -> ``("mtp", 2, "")``; ``"mtp/1/hsdp"`` -> ``("mtp", 1, "hsdp")``."""
    mode, micro, *variant = case.split("/")
    return mode, int(micro), variant[0] if variant else ""


def build(mode: str) -> ReuseModel:
    torch.manual_seed(sc.MODEL_SEED)
    return ReuseModel(mode)


def inputs(rank: int, step: int, mb: int) -> torch.Tensor:
    return sc._randn(20_000 + 1000 * step + 100 * mb + rank, sc.ROWS_PER_RANK, sc.DIM)


def forward_backward(model: nn.Module, x: torch.Tensor) -> None:
    """One micro-batch's forward and backward, in the model's mode (its loss: every output squared)."""
    mode = _mode_of(model)
    if mode in REUSE_MODES:
        logits = model(x)
        (logits.pow(2).sum() + _root(model).mtp.aux.pow(2).sum()).backward()
    elif mode == "mtp_return":
        logits, aux = model(x)
        (logits.pow(2).sum() + aux.pow(2).sum()).backward()
    elif mode == "full":
        model(x).pow(2).sum().backward()
    elif mode == "chunk_one":
        h = model(x)
        sum(_root(model).head(c).pow(2).sum() for c in h.chunk(CHUNKS, dim=0)).backward()
    elif mode == "chunk_each":
        h = model(x)
        detached = h.detach().requires_grad_()
        for c in detached.chunk(CHUNKS, dim=0):
            _root(model).head(c).pow(2).sum().backward()
        h.backward(detached.grad)
    else:
        raise ValueError(mode)


def _root(model: nn.Module) -> ReuseModel:
    return getattr(model, "_orig_mod", model)  # torch.compile's wrapper keeps the model there


def _mode_of(model: nn.Module) -> str:
    return _root(model).mode


def reference_grads(model: ReuseModel, step: int, micro: int, world_size: int = sc.WORLD_SIZE) -> dict[str, Any]:
    """What FSDP2 must give for one step: each micro-batch's gradient averaged over the ranks,
    summed over the micro-batches, computed by one process on the unsharded model."""
    model.zero_grad(set_to_none=True)
    for mb in range(micro):
        for rank in range(world_size):
            forward_backward(model, inputs(rank, step, mb))
    return {n: None if p.grad is None else p.grad / world_size for n, p in model.named_parameters()}


# --- rank side ---------------------------------------------------------------------------------


def count_fsdp_calls() -> dict[str, int]:
    """Count FSDP2's all-gathers, reduce-scatters and state pre-backward calls in this process."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group, _fsdp_state

    counts = {"all_gather": 0, "reduce_scatter": 0, "pre_backward": 0}

    def counted(function, key):
        def call(*args, **kwargs):
            counts[key] += 1
            return function(*args, **kwargs)

        return call

    _fsdp_param_group.foreach_all_gather = counted(_fsdp_param_group.foreach_all_gather, "all_gather")
    _fsdp_param_group.foreach_reduce = counted(_fsdp_param_group.foreach_reduce, "reduce_scatter")
    state_class = _fsdp_state.FSDPState
    state_class._pre_backward = counted(state_class._pre_backward, "pre_backward")
    return counts


def _mesh(ctx: sc.Ctx, variant: str):
    if not variant.startswith("hsdp"):
        return ctx.mesh
    from torch.distributed.device_mesh import init_device_mesh

    shape = (1, ctx.world_size) if variant == "hsdp" else (ctx.world_size, 1)
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def shard(model: ReuseModel, ctx: sc.Ctx, variant: str) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    kwargs = {"mesh": _mesh(ctx, variant)}
    kwargs["offload_policy"] = CPUOffloadPolicy() if variant == "offload" else OffloadPolicy()
    fully_shard(model.layer, **kwargs)
    fully_shard([model.norm, model.head], **kwargs)
    fully_shard(model, **kwargs)
    if variant == "compile":
        return torch.compile(model, backend="eager")
    return model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _fired() -> int:
    status = sc.autopatch_status()
    records = {p["name"]: p for p in status.get("patches", ())}
    return records.get("grouped_module_reuse", {}).get("fired", 0)


def run_case(ctx: sc.Ctx, case: str, counts: dict[str, int], rec: dict[str, Any]) -> None:
    mode, micro, variant = parse(case)
    root = build(mode)
    model = shard(root, ctx, variant)
    opt = torch.optim.SGD(root.parameters(), lr=LR)
    for key in counts:
        counts[key] = 0
    for step in range(STEPS):
        rec[f"params_{step}"] = {n: _full(p) for n, p in root.named_parameters()}
        for mb in range(micro):
            root.set_requires_gradient_sync(mb == micro - 1)
            forward_backward(model, inputs(ctx.rank, step, mb))
        rec[f"grads_{step}"] = {n: None if p.grad is None else _full(p.grad) for n, p in root.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    rec["counts"] = dict(counts)


@scenario("grouped_module_reuse")
def sc_grouped_reuse(ctx: sc.Ctx) -> None:
    """args["cases"]: the cases to run, in order, each on a fresh model; a case that raises is
    recorded and the next one runs (both ranks raise alike: nothing waits in a collective)."""
    import torch.distributed.fsdp  # noqa: F401 - the plugin applies here, before the counters wrap

    counts = count_fsdp_calls()
    for case in ctx.args["cases"]:
        with ctx.case(case, continue_on_error=True) as rec:
            rec["fired_before"] = _fired() if ctx.data["cases"].keys() - {case} else 0
            run_case(ctx, case, counts, rec)
            rec["fired_after"] = _fired()


# --- worlds in one process (run with world_size=1: no gloo group) -------------------------------

THREADS = 2
FAKE_WORLD = 2


def train_thread_rank(lock: threading.Lock) -> dict[str, Any]:
    """``mtp/1`` on this thread's rank of a threaded world: every rank's states in one process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with lock:  # building seeds torch's global generator: one thread at a time
        model = build("mtp")
    fully_shard(model.layer, mesh=mesh)
    fully_shard([model.norm, model.head], mesh=mesh)
    fully_shard(model, mesh=mesh)
    out: dict[str, Any] = {}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        out[f"params_{step}"] = {n: _full(p) for n, p in model.named_parameters()}
        forward_backward(model, inputs(rank, step, 0))
        out[f"grads_{step}"] = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


@scenario("grouped_module_reuse:threaded", gloo=False)
def sc_reuse_threaded(ctx: sc.Ctx) -> None:
    """``mtp/1`` on 2 thread ranks (PyTorch's ``spawn_threads_and_init_comms``)."""
    import io
    import unittest

    from torch.testing._internal.common_distributed import spawn_threads_and_init_comms

    results: dict[int, Any] = {}
    lock = threading.Lock()

    class Threaded(unittest.TestCase):
        @spawn_threads_and_init_comms(world_size=THREADS)
        def test_train(self) -> None:
            import torch.distributed as dist

            results[dist.get_rank()] = train_thread_rank(lock)

    with ctx.case("threaded") as rec:
        rec["fired_before"] = 0
        stream = io.StringIO()
        outcome = unittest.TextTestRunner(stream=stream, verbosity=0).run(
            unittest.defaultTestLoader.loadTestsFromTestCase(Threaded)
        )
        rec["passed"] = outcome.wasSuccessful() and outcome.testsRun == 1
        rec["report"] = stream.getvalue()[-4000:]
        rec["ranks"] = results
        rec["fired_after"] = _fired()


@scenario("grouped_module_reuse:fake", gloo=False)
def sc_reuse_fake(ctx: sc.Ctx) -> None:
    """``mtp/1``, one step, rank 0 of the fake backend: with the patch, then with it reverted."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=FAKE_WORLD)
    mesh = init_device_mesh("cpu", (FAKE_WORLD,))

    def one_step(rec: dict[str, Any]) -> None:
        model = build("mtp")
        for unit in (model.layer, [model.norm, model.head], model):
            fully_shard(unit, mesh=mesh)
        rec["fired_before"] = _fired()
        forward_backward(model, inputs(0, 0, 0))
        rec["fired_after"] = _fired()
        rec["grad_present"] = {n: p.grad is not None for n, p in model.named_parameters()}

    with ctx.case("fake_patched") as rec:
        one_step(rec)
    with ctx.case("fake_reverted", continue_on_error=True) as rec:
        from fsdp_autopatch import _patching

        _patching.revert("grouped_module_reuse")  # units built from now on get torch's own hooks
        one_step(rec)
