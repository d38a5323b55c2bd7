"""``fsdp-autopatch demo``: train a tiny vision-language MoE on two CPU ranks and show the four bugs.

Run ``fsdp-autopatch demo`` (or ``python -m fsdp_autopatch demo``) to see the patches at work, and
``fsdp-autopatch demo --without-patches`` to see what PyTorch's FSDP2 does without them.

The model
---------
Two ranks on gloo train a deliberately small model with ``fully_shard`` and
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``, AdamW with weight
decay, ``STEPS`` optimizer steps of ``MICRO_BATCHES`` micro-batches each, gradient sync off
(``set_requires_gradient_sync(False)``) on every micro-batch but the last, and the unused-parameter
fill on (``set_reduce_scatter_unused_params(True)``, torch's own API from 2.13, the package's
backport before).

    tokens ─► embed ─┐
                     + ─► mixer ─► MoE (3 experts, routed by token id) ─► head ─► logits
    pixels ─► vision ┘    (vision: its own FSDP unit;  MoE: its own FSDP unit;  rest: the root unit)

Every part is chosen to hit one bug:

(a) accumulated_grad_guard -- the vision tower is a separately wrapped unit and only the last
    micro-batch of a step carries images. On step 1 the tower has never run forward when the first,
    text-only micro-batch finishes backward; FSDP's root callback still runs the tower's
    post-backward, which reads the not-yet-created ``_unsharded_param``: AttributeError.
(b) unused_param_reduction -- the MoE routes token ids 0-7 to expert 0, 8-15 to expert 1 and
    16-23 to expert 2. Rank 0's text uses ids 0-15, rank 1's ids 0-7, and no rank ever sees 16-23.
    So expert 1 has a gradient on rank 0 only: without the fill the two ranks reduce-scatter
    different amounts of data (gloo raises; NCCL can hang or mix gradients).
(c) uniform_reduce_dtype -- with the fill, the zero gradient given to expert 1 (rank 1) and expert 2
    (both ranks) is bf16 while expert 0's gradient, accumulated over the earlier micro-batches, is
    fp32: FSDP's reduce-scatter asserts "uniform gradient dtype".
(d) restore_unused_param_grads -- expert 2 is used by no rank, yet the fill turns its missing
    gradient into an exact zero, so AdamW applies weight decay and moves its weights.

With the patches, the demo checks and prints three invariants:
(1) the gradients of every used parameter (shared layers, vision tower, experts 0 and 1) match a
    single-process reference on the same global batch and micro-batching with the same bf16 compute
    (computed in rank 0 from the gathered weights of each step), within bf16 tolerance;
(2) the never-used expert keeps ``grad is None`` after every backward and its weights stay bitwise
    unchanged;
(3) the loss decreases (every step trains on the same fixed global batch).

Modes and exit codes
--------------------
``demo``: exit 0 if the run completes and all three invariants hold, else 1.

``demo --without-patches``: a failure masks the next one, so the demo runs one short two-rank
sub-run per bug: (a) with no patches at all (``FSDP_AUTOPATCH_ENABLED=0``); (b), (c), (d) each with
only that bug's patch disabled (``FSDP_AUTOPATCH_<NAME>_ENABLED=0``; for (b) the demo also does not
call ``set_reduce_scatter_unused_params``, the only way to switch the fill off when torch provides it
itself). It prints, per bug, what happened, the upstream report and the patch that fixes it. Exit 0
if every bug reproduced as expected (it is a demonstration), 1 otherwise, e.g. when a bug does not
reproduce because this torch fixed it upstream.

Every sub-run is bounded: a short gloo timeout, an outer timeout that kills both ranks' process
groups, a grace period after the first rank fails (a rank that fails alone leaves its peer waiting
in a collective), and a watchdog in each rank that exits when the demo's parent process goes away.
Inherited ``FSDP_AUTOPATCH_*`` settings other than ``FSDP_AUTOPATCH_LOG_LEVEL`` are removed from the
ranks' environment so that each mode runs exactly the configuration it describes.

Implementation: stdlib only at import time; torch is imported inside the rank process
(``python -m fsdp_autopatch._demo --worker ...``) and inside functions only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------
# Shape of the run
# --------------------------------------------------------------------------------------------

WORLD_SIZE = 2
STEPS = 4
MICRO_BATCHES = 3
IMAGE_MICRO_BATCH = MICRO_BATCHES - 1  # only the last micro-batch of each step has images
SEQUENCES = 2  # sequences per micro-batch per rank
SEQ_LEN = 8
VOCAB = 24
DIM = 16
PATCHES = 4
PATCH_DIM = 12
NUM_EXPERTS = 3
TOKENS_PER_EXPERT = VOCAB // NUM_EXPERTS  # hash routing: expert = token_id // 8
SHARED_EXPERT, RANK0_EXPERT, UNUSED_EXPERT = 0, 1, 2
# Token ids each rank's text is drawn from: rank 0 reaches experts 0 and 1, rank 1 expert 0 only,
# and ids 16-23 (expert 2) never occur.
TOKEN_RANGE = {0: 2 * TOKENS_PER_EXPERT, 1: TOKENS_PER_EXPERT}
SEED = 1234
LR = 1e-2
WEIGHT_DECAY = 0.1
GRAD_TOLERANCE = 1e-2  # max |fsdp - ref| <= tol * max |ref| per tensor (bf16 eps is 7.8e-3)

PG_TIMEOUT_S = 20.0  # gloo collectives give up after this
RUN_TIMEOUT_S = 50.0  # the parent kills a sub-run's ranks after this
FAIL_GRACE_S = 5.0  # after one rank failed, how long its peer may take to fail too

UNUSED_EXPERT_PREFIX = f"moe.experts.{UNUSED_EXPERT}."


# --------------------------------------------------------------------------------------------
# Scenarios: what each two-rank sub-run disables
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    env: dict[str, str] = field(default_factory=dict)
    fill: bool = True  # call model.set_reduce_scatter_unused_params(True)
    patch: str = ""  # the patch that fixes this scenario's bug
    upstream: str = ""
    symptom: str = ""  # what the user sees without the patch
    fix_note: str = ""


PATCHED = Scenario("patched", "all patches on")

BUG_SCENARIOS = (
    Scenario(
        "a",
        "no patches at all (FSDP_AUTOPATCH_ENABLED=0)",
        env={"FSDP_AUTOPATCH_ENABLED": "0"},
        patch="accumulated_grad_guard",
        upstream="PyTorch PR 194058 (also verl PR 7475, NeMo Automodel PR 2744)",
        symptom="a vision tower skipped by text-only micro-batches crashes backward",
    ),
    Scenario(
        "b",
        "unused-param fill off (FSDP_AUTOPATCH_UNUSED_PARAM_REDUCTION_ENABLED=0, "
        "set_reduce_scatter_unused_params not called)",
        env={"FSDP_AUTOPATCH_UNUSED_PARAM_REDUCTION_ENABLED": "0"},
        fill=False,
        patch="unused_param_reduction",
        upstream="PyTorch issue 158719 / PR 174862 (also torchtitan 2747)",
        symptom="ranks whose experts got different tokens issue mismatched reduce-scatters",
        fix_note=" (from torch 2.13 torch's own set_reduce_scatter_unused_params, which the "
                 "demo turns on; the patch backports it to older torch)",
    ),
    Scenario(
        "c",
        "uniform_reduce_dtype off (FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED=0)",
        env={"FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED": "0"},
        patch="uniform_reduce_dtype",
        upstream="PyTorch issue 196996 / PR 160279 (also NeMo Automodel PR 3540)",
        symptom="bf16 zero fill next to fp32 accumulated gradients trips an assertion",
    ),
    Scenario(
        "d",
        "restore_unused_param_grads off (FSDP_AUTOPATCH_RESTORE_UNUSED_PARAM_GRADS_ENABLED=0)",
        env={"FSDP_AUTOPATCH_RESTORE_UNUSED_PARAM_GRADS_ENABLED": "0"},
        patch="restore_unused_param_grads",
        upstream="same class as PyTorch issue 28294 (DDP); documented by Megatron-LM",
        symptom="an expert no rank used gets a zero gradient and AdamW moves it",
    ),
)

SCENARIOS = {s.key: s for s in (PATCHED, *BUG_SCENARIOS)}


# --------------------------------------------------------------------------------------------
# Model and data (shared by the FSDP ranks and the single-process reference)
# --------------------------------------------------------------------------------------------


def build_model():
    """The tiny vision-language MoE, initialised identically on every rank (fixed seed).

    The classes are defined in here so that importing this module never imports torch.
    """
    import torch
    from torch import nn

    class MoE(nn.Module):
        """Hash-routed experts: a token's id picks its expert, so routing is deterministic."""

        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(
                nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
                for _ in range(NUM_EXPERTS)
            )

        def forward(self, hidden, tokens):
            flat = hidden.reshape(-1, DIM)
            expert_ids = (tokens // TOKENS_PER_EXPERT).reshape(-1)
            out = torch.zeros_like(flat)
            for index, expert in enumerate(self.experts):
                mask = expert_ids == index
                # An expert without tokens does not run, so its parameters get no gradient on
                # this rank: the situation bugs (b), (c) and (d) are about.
                if mask.any():
                    out[mask] = expert(flat[mask])
            return out.reshape(hidden.shape)

    class VisionLanguageMoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.vision = nn.Sequential(nn.Linear(PATCH_DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM))
            self.mixer = nn.Linear(DIM, DIM)
            self.moe = MoE()
            self.head = nn.Linear(DIM, VOCAB)

        def forward(self, tokens, pixels=None):
            hidden = self.embed(tokens)
            if pixels is not None:
                # Text-only batches skip the vision tower entirely (bug (a)'s trigger).
                image = self.vision(pixels).mean(dim=1)
                hidden = hidden + image[:, None, :]
            hidden = hidden + torch.tanh(self.mixer(hidden))
            hidden = hidden + self.moe(hidden, tokens)
            return self.head(hidden)

    torch.manual_seed(SEED)
    return VisionLanguageMoE()


def make_micro_batch(rank: int, micro: int):
    """(tokens, pixels or None, targets) of one rank's micro-batch; the same for every step."""
    import torch

    gen = torch.Generator().manual_seed(SEED + 100 * rank + micro)
    tokens = torch.randint(0, TOKEN_RANGE[rank], (SEQUENCES, SEQ_LEN), generator=gen)
    if rank == 0:
        # Make sure rank 0 uses both of its experts in every micro-batch, so that without the fill
        # both ranks hold uniformly fp32-accumulated gradients and bug (b) shows on its own.
        tokens[0, 0] = SHARED_EXPERT * TOKENS_PER_EXPERT
        tokens[0, 1] = RANK0_EXPERT * TOKENS_PER_EXPERT
    targets = (tokens * 5 + 3) % VOCAB  # a learnable token -> token mapping
    pixels = None
    if micro == IMAGE_MICRO_BATCH:
        pixels = torch.randn(SEQUENCES, PATCHES, PATCH_DIM, generator=gen)
    return tokens, pixels, targets


def loss_fn(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


# --------------------------------------------------------------------------------------------
# Rank process
# --------------------------------------------------------------------------------------------


class Progress:
    """Where the rank is, e.g. 'step 1, micro-batch 1/3 (text-only) backward'.

    Kept in memory for exception reports and mirrored to a file, so that the parent can still say
    where a rank was stuck when it has to kill it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.at("startup")

    def at(self, where: str) -> None:
        self.where = where
        self.path.write_text(where)


def _start_watchdogs(deadline_s: float) -> None:
    """Exit if the demo's parent dies or the run overstays its budget: never leave an orphan."""
    parent = os.getppid()
    started = time.monotonic()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent or time.monotonic() - started > deadline_s:
                os._exit(4)

    threading.Thread(target=watch, name="demo-watchdog", daemon=True).start()


def _registry_snapshot() -> dict[str, Any]:
    """fsdp_autopatch.status() as JSON, after torch's FSDP2 was imported (hook has run)."""
    try:
        import fsdp_autopatch

        return fsdp_autopatch.status().to_dict()
    except Exception as exc:  # the registry is informative only: never fail the demo on it
        return {"error": f"{type(exc).__name__}: {exc}"}


def _ensure_installed() -> str:
    """Install the patches if this interpreter did not run the .pth (e.g. PYTHONPATH checkout)."""
    try:
        import fsdp_autopatch

        if fsdp_autopatch.status().bootstrap == "not_run":
            fsdp_autopatch.install()
            return "the .pth did not run in the ranks; the demo called fsdp_autopatch.install()"
    except Exception as exc:
        return f"fsdp_autopatch unavailable in the ranks: {type(exc).__name__}: {exc}"
    return ""


def _shard(model, mesh):
    """Vision tower and MoE get their own FSDP units (as in real VLM/MoE recipes), then the root."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model.vision, mesh=mesh, mp_policy=policy)
    fully_shard(model.moe, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _enable_fill(model, scenario: Scenario) -> str:
    if not scenario.fill:
        return "off (not called)"
    if not hasattr(model, "set_reduce_scatter_unused_params"):
        # torch < 2.13 with the backport disabled: nothing can turn the fill on.
        return "unavailable (torch < 2.13 and the backport is off)"
    model.set_reduce_scatter_unused_params(True)
    return "on"


def _gather_params(model) -> dict[str, Any]:
    """Full fp32 copies of all parameters (collective: every rank calls it)."""
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _gather_grads(model) -> dict[str, Any]:
    """Full gradients of the parameters that have one (collective: every rank calls it)."""
    import torch
    import torch.distributed as dist

    # Gathering would deadlock if the ranks disagree on which gradients exist: compare first
    # (with tensors; all_gather_object would need numpy).
    has_grad = torch.tensor([p.grad is not None for p in model.parameters()], dtype=torch.int32)
    anywhere, everywhere = has_grad.clone(), has_grad.clone()
    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    if not torch.equal(anywhere, everywhere):
        names = [n for (n, _), a, e in zip(model.named_parameters(), anywhere, everywhere) if a != e]
        raise RuntimeError(f"ranks disagree on which parameters have a gradient: {names}")
    return {
        name: p.grad.full_tensor().detach().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def _train(model, rank: int, progress: Progress) -> dict[str, Any]:
    """The training loop; returns what the checks need (losses, per-step weights and gradients)."""
    import torch
    import torch.distributed as dist

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, params_per_step, grads_per_step = [], [], []
    for step in range(1, STEPS + 1):
        params_per_step.append(_gather_params(model))
        step_loss = torch.zeros(())
        for micro in range(MICRO_BATCHES):
            last = micro == MICRO_BATCHES - 1
            # Accumulate without communication; reduce-scatter only after the last micro-batch.
            model.set_requires_gradient_sync(last)
            tokens, pixels, targets = make_micro_batch(rank, micro)
            kind = "text+images" if pixels is not None else "text-only"
            progress.at(f"step {step}, micro-batch {micro + 1}/{MICRO_BATCHES} ({kind}) forward")
            loss = loss_fn(model(tokens, pixels), targets)
            progress.at(f"step {step}, micro-batch {micro + 1}/{MICRO_BATCHES} ({kind}) backward")
            (loss / MICRO_BATCHES).backward()
            step_loss += loss.detach()
        progress.at(f"step {step}, gathering gradients")
        grads_per_step.append(_gather_grads(model))
        progress.at(f"step {step}, optimizer step")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / (WORLD_SIZE * MICRO_BATCHES))
    progress.at("gathering final weights")
    final_params = _gather_params(model)
    return {"losses": losses, "params": params_per_step, "grads": grads_per_step, "final": final_params}


def _reference_grads(params: dict[str, Any]) -> dict[str, Any]:
    """Single-process gradients for one step, mirroring FSDP's arithmetic.

    FSDP computes each micro-batch's gradient in bf16 (param_dtype), accumulates micro-batches in
    fp32 (reduce_dtype) and averages over ranks; here the same model runs in bf16 on every rank's
    micro-batches of the global batch, accumulating in fp32 and dividing by the world size.
    """
    import torch

    model = build_model()
    model.load_state_dict(params)
    model.to(torch.bfloat16)
    acc: dict[str, Any] = {}
    for rank in range(WORLD_SIZE):
        for micro in range(MICRO_BATCHES):
            model.zero_grad(set_to_none=True)
            tokens, pixels, targets = make_micro_batch(rank, micro)
            if pixels is not None:
                pixels = pixels.to(torch.bfloat16)  # FSDP casts floating forward inputs too
            (loss_fn(model(tokens, pixels), targets) / MICRO_BATCHES).backward()
            for name, p in model.named_parameters():
                if p.grad is not None:
                    acc[name] = acc.get(name, 0) + p.grad.float()
    return {name: grad / WORLD_SIZE for name, grad in acc.items()}


def _check_gradients(run: dict[str, Any]) -> dict[str, Any]:
    """Invariant (1): every gradient the reference has matches FSDP's, within bf16 tolerance."""
    worst = {"error": 0.0, "name": "", "step": 0}
    compared, problems = 0, []
    for step, (params, grads) in enumerate(zip(run["params"], run["grads"]), start=1):
        for name, ref in _reference_grads(params).items():
            got = grads.get(name)
            if got is None:
                problems.append(f"step {step}: {name} has no gradient (reference has one)")
                continue
            scale = ref.abs().max().item() or 1.0
            error = (got - ref).abs().max().item() / scale
            compared += 1
            if not worst["name"] or error > worst["error"]:
                worst = {"error": error, "name": name, "step": step}
            if error > GRAD_TOLERANCE:
                problems.append(f"step {step}: {name} off by {error:.2e} (relative)")
    return {"ok": not problems and compared > 0, "compared": compared, "worst": worst,
            "problems": problems[:5]}


def _check_unused_expert(run: dict[str, Any]) -> dict[str, Any]:
    """Invariant (2): the expert no rank used has grad None every step and unchanged weights."""
    grad_states = []  # per step: "None" (all expert tensors), "zero" or "nonzero"
    for grads in run["grads"]:
        expert_grads = [g for name, g in grads.items() if name.startswith(UNUSED_EXPERT_PREFIX)]
        if not expert_grads:
            grad_states.append("None")
        else:
            grad_states.append("nonzero" if any(g.any() for g in expert_grads) else "zero")
    initial, final = run["params"][0], run["final"]
    names = [n for n in initial if n.startswith(UNUSED_EXPERT_PREFIX)]
    max_change = max((final[n] - initial[n]).abs().max().item() for n in names)
    bitwise = all(initial[n].equal(final[n]) for n in names)
    return {"ok": bitwise and all(s == "None" for s in grad_states),
            "grad_states": grad_states, "bitwise_unchanged": bitwise, "max_change": max_change}


def _check_loss(losses: list[float]) -> dict[str, Any]:
    """Invariant (3): training on a fixed batch must lower the loss."""
    return {"ok": len(losses) == STEPS and losses[-1] < losses[0], "losses": losses}


def _run_rank(scenario: Scenario, rank: int, progress: Progress, result: dict[str, Any]) -> None:
    clock = time.monotonic()
    timings = result["seconds"] = {}

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.monotonic()
        timings[phase] = round(now - clock, 2)
        clock = now

    result["install_note"] = _ensure_installed()  # before torch, like the .pth would
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh
    import torch.distributed.fsdp  # noqa: F401  -- the patches are applied on this import

    torch.set_num_threads(1)  # two ranks share two cores
    # torch 2.13 warns whenever an FSDP unit returns a view (any nn.Linear on a 3-D input does):
    # harmless here, no output is modified in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    if rank == 0:
        result["registry"] = _registry_snapshot()
        result["torch"] = torch.__version__
    lap("import")
    progress.at("init_process_group")
    dist.init_process_group("gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    progress.at("fully_shard")
    model = _shard(build_model(), mesh)
    result["fill"] = _enable_fill(model, scenario)
    lap("setup")
    run = _train(model, rank, progress)
    dist.barrier()
    dist.destroy_process_group()
    lap("train")
    if rank == 0:
        progress.at("checking invariants")
        result["checks"] = {
            "gradients": _check_gradients(run),
            "unused_expert": _check_unused_expert(run),
            "loss": _check_loss(run["losses"]),
        }
        lap("check")


def _worker_main(scenario_key: str, rank: int, out_dir: str, deadline_s: float) -> int:
    _start_watchdogs(deadline_s)
    scenario = SCENARIOS[scenario_key]
    progress = Progress(Path(out_dir) / f"rank{rank}.where")
    result: dict[str, Any] = {"rank": rank, "error": None}
    code = 0
    try:
        _run_rank(scenario, rank, progress, result)
    except BaseException as exc:  # report every failure, including a gloo error, to the parent
        result["error"] = {
            "type": type(exc).__name__,
            "message": str(exc).strip(),
            "where": progress.where,
            "time": time.time(),
            "traceback": traceback.format_exc()[-4000:],
        }
        code = 3
    path = Path(out_dir) / f"rank{rank}.json"
    path.write_text(json.dumps(result, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    # A failed rank exits at once: tearing down gloo after a failed collective can block.
    os._exit(code)


# --------------------------------------------------------------------------------------------
# Parent: launch two ranks, bound them, collect their reports
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    rank: int
    kind: str  # "crash" (died without a report), "exception" or "killed" (by the demo)
    text: str  # the error message (for a crash: the native error it printed)
    where: str = ""  # what the rank was doing, if it could tell
    error_type: str = ""


@dataclass
class RunResult:
    scenario: Scenario
    seconds: float
    returncodes: list[int | None]
    ranks: list[dict[str, Any] | None]  # each rank's JSON report (None if it died without one)
    output_tails: list[str]
    killed: list[int]  # ranks the demo had to kill (stuck in a collective or past the timeout)
    last_where: list[str]  # what each rank was last doing
    timed_out: bool
    timeout_s: float

    @property
    def rank0(self) -> dict[str, Any]:
        return self.ranks[0] or {}

    def failures(self) -> list[Failure]:
        """Every rank's failure, the likely cause first.

        A rank that died natively (gloo aborts on a collective size mismatch) comes first, since
        its peer's error is then only "connection reset"; then Python exceptions in the order they
        happened; then ranks the demo killed because they were still waiting for their peer.
        """
        crashes, exceptions, killed = [], [], []
        for rank, report in enumerate(self.ranks):
            if rank in self.killed:
                killed.append(Failure(rank, "killed", "killed by the demo", self.last_where[rank]))
            elif report and report.get("error"):
                error = report["error"]
                exceptions.append((error.get("time", 0.0), Failure(
                    rank, "exception", error["message"], error["where"], error["type"])))
            elif report is None and self.returncodes[rank] != 0:
                text = _native_error(self.output_tails[rank])
                crashes.append(Failure(rank, "crash", text, error_type=f"exit {self.returncodes[rank]}"))
        return crashes + [f for _, f in sorted(exceptions, key=lambda item: item[0])] + killed


def _native_error(output: str) -> str:
    """The message a natively aborted rank printed (C++ 'what():' line), else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("what():"):
            return line[len("what():"):].strip()
    return lines[-1] if lines else "no output"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_env(scenario: Scenario, rank: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FSDP_AUTOPATCH_") or k == "FSDP_AUTOPATCH_LOG_LEVEL"}
    env.update(scenario.env)
    env.update({
        "CUDA_VISIBLE_DEVICES": "",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(WORLD_SIZE),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def _kill(proc: subprocess.Popen) -> None:
    """Kill a rank's whole process group (it was started in its own session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    proc.wait()


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> bool:
    """Wait for all ranks; after the first failure give the peer a short grace. True if killed."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + FAIL_GRACE_S)
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)
    return False


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _tail(path: Path, lines: int = 12) -> str:
    return "\n".join(_read(path).splitlines()[-lines:])


def run_scenario(scenario: Scenario, timeout_s: float = RUN_TIMEOUT_S) -> RunResult:
    """Run one two-rank sub-run of ``scenario`` and collect both ranks' reports.

    The free port is only reserved until the parent closes its probe socket; on a busy machine
    another process can take it before rank 0's store binds it. That run is simply retried.
    """
    for _ in range(3):
        result = _run_once(scenario, timeout_s)
        if not any("EADDRINUSE" in f.text or "address already in use" in f.text
                   for f in result.failures()):
            break
    return result


def _run_once(scenario: Scenario, timeout_s: float) -> RunResult:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fsdp-autopatch-demo-") as tmp:
        out = Path(tmp)
        port = _free_port()
        procs: list[subprocess.Popen] = []
        timed_out, killed = False, []
        try:
            for rank in range(WORLD_SIZE):
                cmd = [sys.executable, "-m", "fsdp_autopatch._demo", "--worker",
                       "--scenario", scenario.key, "--rank", str(rank), "--out", tmp,
                       "--deadline", str(timeout_s + 10)]
                with open(out / f"rank{rank}.out", "wb") as log:
                    procs.append(subprocess.Popen(
                        cmd, env=_rank_env(scenario, rank, port), stdin=subprocess.DEVNULL,
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            timed_out = _wait(procs, timeout_s)
        finally:
            killed = [rank for rank, proc in enumerate(procs) if proc.poll() is None]
            for proc in procs:
                _kill(proc)
        ranks = []
        for rank in range(WORLD_SIZE):
            report = out / f"rank{rank}.json"
            ranks.append(json.loads(report.read_text()) if report.exists() else None)
        tails = [_tail(out / f"rank{rank}.out") for rank in range(WORLD_SIZE)]
        wheres = [_read(out / f"rank{rank}.where") or "startup" for rank in range(WORLD_SIZE)]
    return RunResult(scenario, time.monotonic() - start, [p.returncode for p in procs], ranks,
                     tails, killed, wheres, timed_out, timeout_s)


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def _print_registry(rank0: dict[str, Any]) -> None:
    registry = rank0.get("registry") or {}
    if "error" in registry or not registry:
        print(f"Patch registry: unavailable ({registry.get('error', 'no report from rank 0')})")
        return
    print(f"Patch registry (rank 0): fsdp_autopatch {registry.get('version')}, "
          f"torch {registry.get('torch')}, bootstrap={registry.get('bootstrap')}")
    for patch in registry.get("patches", []):
        reason = patch.get("reason") or ""
        if len(reason) > 72:
            reason = reason[:69] + "..."
        print(f"  {patch['name']:<27} {patch['status']:<11} {reason}")
    if rank0.get("install_note"):
        print(f"  note: {rank0['install_note']}")


def _registry_line(rank0: dict[str, Any]) -> str:
    registry = rank0.get("registry") or {}
    patches = registry.get("patches")
    if not patches:
        return "registry unavailable"
    return ", ".join(f"{p['name']}={p['status']}" for p in patches)


def _one_line(text: str, limit: int = 200) -> str:
    """First line of an error, without gloo's '[/path/to/file.cc:123] ' prefix."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    line = re.sub(r"^\[(enforce fail at )?/[^\]]*\]\s*", "", line)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _describe_failure(result: RunResult) -> str:
    """One line about a run that did not complete: its first failure, then what the peers did."""
    failures = result.failures()
    if not failures:
        return f"ranks exited with codes {result.returncodes} without a report"
    first, rest = failures[0], failures[1:]
    if first.kind == "crash":
        text = f"rank {first.rank} aborted ({first.error_type}): {_one_line(first.text)}"
    elif first.kind == "exception":
        text = f"{first.error_type}: {_one_line(first.text)} (rank {first.rank}, {first.where})"
    else:
        text = (f"timeout: no rank finished within {result.timeout_s:g} s, the demo killed them "
                f"(rank {first.rank} was at: {first.where})")
    for other in rest:
        if other.kind == "killed" and first.kind == "killed":
            text += f"; rank {other.rank} was at: {other.where}"
        elif other.kind == "killed":
            text += (f"; rank {other.rank} was left waiting ({other.where}) "
                     f"and was killed after {FAIL_GRACE_S:g} s")
        elif other.kind == "exception":
            text += f"; rank {other.rank} then raised {other.error_type}: {_one_line(other.text, 70)}"
        else:
            text += f"; rank {other.rank} aborted too: {_one_line(other.text, 70)}"
    return text


def _print_unexpected(result: RunResult) -> None:
    for rank, report in enumerate(result.ranks):
        if report and report.get("error"):
            print(f"  rank {rank} traceback (tail):")
            for line in report["error"]["traceback"].strip().splitlines()[-8:]:
                print(f"    {line}")
        elif result.output_tails[rank]:
            print(f"  rank {rank} output (tail):")
            for line in result.output_tails[rank].splitlines():
                print(f"    {line}")


def _mark(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _print_invariants(checks: dict[str, Any]) -> bool:
    grads, unused, loss = checks["gradients"], checks["unused_expert"], checks["loss"]
    worst = grads["worst"]
    print(f"  {_mark(grads['ok'])}  (1) gradients of all used parameters match a single-process "
          f"bf16 reference: {grads['compared']} tensors over {STEPS} steps, worst relative error "
          f"{worst['error']:.1e} ({worst['name']}, step {worst['step']}; tolerance {GRAD_TOLERANCE:g})")
    for problem in grads["problems"]:
        print(f"        {problem}")
    print(f"  {_mark(unused['ok'])}  (2) never-used expert {UNUSED_EXPERT}: grad after each backward "
          f"{unused['grad_states']}, weights bitwise unchanged={unused['bitwise_unchanged']} "
          f"(max |change| {unused['max_change']:.1e})")
    losses = " -> ".join(f"{value:.4f}" for value in loss["losses"])
    print(f"  {_mark(loss['ok'])}  (3) loss decreases: {losses}")
    return grads["ok"] and unused["ok"] and loss["ok"]


def _print_model() -> None:
    print(f"Model: tiny vision-language MoE on {WORLD_SIZE} CPU ranks (gloo), "
          f"bf16 params / fp32 reduce, AdamW(weight_decay={WEIGHT_DECAY}), {STEPS} steps x "
          f"{MICRO_BATCHES} micro-batches (sync on the last only; images in micro-batch "
          f"{IMAGE_MICRO_BATCH + 1} only).")
    print("  vision tower: own FSDP unit, skipped by text-only micro-batches      -> bug (a)")
    print(f"  MoE experts: expert {SHARED_EXPERT} on both ranks, expert {RANK0_EXPERT} on rank 0 only, "
          f"expert {UNUSED_EXPERT} on no rank -> bugs (b), (c), (d)")


def demo_patched(timeout_s: float = RUN_TIMEOUT_S) -> int:
    print("fsdp-autopatch demo (patches on)")
    _print_model()
    result = run_scenario(PATCHED, timeout_s)
    rank0 = result.rank0
    _print_registry(rank0)
    print(f"Unused-param fill (set_reduce_scatter_unused_params): {rank0.get('fill', '?')}")
    checks = rank0.get("checks")
    if not checks:
        print(f"FAIL: the run did not complete: {_describe_failure(result)}")
        _print_unexpected(result)
        print(f"Demo took {result.seconds:.1f} s.")
        return 1
    for step, value in enumerate(checks["loss"]["losses"], start=1):
        print(f"  step {step}  loss {value:.4f}")
    print("Invariants:")
    ok = _print_invariants(checks)
    timings = ", ".join(f"{phase} {sec:.1f} s" for phase, sec in rank0.get("seconds", {}).items())
    print(f"Result: {_mark(ok)} ({result.seconds:.1f} s; rank 0: {timings})")
    return 0 if ok else 1


# --- --without-patches: how each sub-run's outcome is judged ---------------------------------


@dataclass(frozen=True)
class Verdict:
    reproduced: bool
    headline: str  # what happened, in a few words
    detail: str  # why, and what each rank reported


def _first_failure(result: RunResult) -> Failure | None:
    failures = result.failures()
    return failures[0] if failures else None


def _not_reproduced(expected: str, result: RunResult) -> Verdict:
    return Verdict(False, f"expected {expected}", "got: " + _outcome(result))


def _judge_a(result: RunResult) -> Verdict:
    first = _first_failure(result)
    if first and first.error_type == "AttributeError" and "_unsharded_param" in first.text:
        return Verdict(
            True, f"AttributeError '_unsharded_param' in {first.where}",
            "the vision tower never ran forward (text-only micro-batch, gradient sync off), yet "
            "FSDP's root post-backward callback ran its post_backward: " + _describe_failure(result))
    return _not_reproduced("AttributeError '_unsharded_param'", result)


def _judge_b(result: RunResult) -> Verdict:
    first = _first_failure(result)
    why = (f"expert {RANK0_EXPERT} has a gradient on rank 0 only, so rank 0 reduce-scatters "
           f"experts {SHARED_EXPERT}+{RANK0_EXPERT} and rank 1 expert {SHARED_EXPERT} only: ")
    other_bug = first is not None and (
        "_unsharded_param" in first.text or "uniform gradient dtype" in first.text)
    if first is not None and first.kind == "crash":
        return Verdict(True, f"mismatched reduce-scatter, rank {first.rank} aborted in gloo",
                       why + _describe_failure(result))
    if first is not None and first.kind == "exception" and "backward" in first.where \
            and not other_bug:
        return Verdict(True, f"mismatched reduce-scatter, {first.error_type} in {first.where}",
                       why + _describe_failure(result))
    if result.timed_out and not other_bug:
        return Verdict(True, "mismatched reduce-scatter hung", why + _describe_failure(result))
    checks = result.rank0.get("checks")
    if checks and not checks["gradients"]["ok"]:
        return Verdict(True, "silently wrong gradients",
                       why + "the run completed but gradients differ from the reference: "
                       + "; ".join(checks["gradients"]["problems"][:2]))
    return _not_reproduced("a reduce-scatter mismatch or wrong gradients", result)


def _judge_c(result: RunResult) -> Verdict:
    first = _first_failure(result)
    if first and "uniform gradient dtype" in first.text:
        return Verdict(
            True, f"AssertionError 'uniform gradient dtype' in {first.where}",
            f"expert {SHARED_EXPERT}'s gradient was accumulated in fp32 over the earlier "
            "micro-batches, the fill's zeros for the unused experts are bf16: "
            + _describe_failure(result))
    return _not_reproduced("AssertionError 'uniform gradient dtype'", result)


def _judge_d(result: RunResult) -> Verdict:
    checks = result.rank0.get("checks")
    if not checks:
        return _not_reproduced("a completed run with a zero gradient", result)
    unused = checks["unused_expert"]
    moved = unused["max_change"]
    if any(state != "None" for state in unused["grad_states"]) and moved > 0:
        return Verdict(
            True, f"never-used expert got grad 0 instead of None, AdamW moved it by {moved:.1e}",
            f"expert {UNUSED_EXPERT} got no token on any rank, yet its grad after each backward "
            f"was {unused['grad_states']} instead of None, so AdamW (weight_decay={WEIGHT_DECAY}) "
            f"changed its weights by up to {moved:.2e} in {STEPS} steps")
    return Verdict(False, "expected a zero gradient and moved weights",
                   f"grad after each backward {unused['grad_states']}, max |change| {moved:.1e}")


JUDGES = {"a": _judge_a, "b": _judge_b, "c": _judge_c, "d": _judge_d}


def _outcome(result: RunResult) -> str:
    if result.failures() or not result.rank0.get("checks"):
        return _describe_failure(result)
    return "the run completed normally"


def demo_without_patches(timeout_s: float = RUN_TIMEOUT_S) -> int:
    print("fsdp-autopatch demo --without-patches: one two-rank sub-run per bug, "
          "with that bug's patch disabled")
    _print_model()
    start = time.monotonic()
    verdicts = []
    for scenario in BUG_SCENARIOS:
        result = run_scenario(scenario, timeout_s)
        verdict = JUDGES[scenario.key](result)
        verdicts.append(verdict.reproduced)
        print(f"\n({scenario.key}) {scenario.symptom}")
        print(f"    sub-run: {scenario.title} [{result.seconds:.1f} s]")
        print(f"    patches: {_registry_line(result.rank0)}")
        print(f"    what happened: {verdict.detail}")
        if not verdict.reproduced:
            _print_unexpected(result)
        label = "REPRODUCED" if verdict.reproduced else "NOT REPRODUCED"
        print(f"==> ({scenario.key}) {label}: {verdict.headline}. Known upstream bug: "
              f"{scenario.upstream}. Fixed by patch '{scenario.patch}'{scenario.fix_note}.")
    total = time.monotonic() - start
    print(f"\n{sum(verdicts)}/{len(verdicts)} bugs reproduced without their patch ({total:.1f} s). "
          "Run 'fsdp-autopatch demo' to see the same training succeed with the patches.")
    return 0 if all(verdicts) else 1


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-autopatch demo",
        description="Train a tiny vision-language MoE with FSDP2 on two CPU ranks and check that "
                    "the four patched bugs stay fixed.")
    parser.add_argument("--without-patches", action="store_true",
                        help="reproduce each bug with its patch disabled "
                             "(exit 0 if all four reproduce)")
    parser.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S,
                        help=f"seconds before a sub-run's ranks are killed (default {RUN_TIMEOUT_S:g})")
    # Internal: the rank processes the demo launches.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scenario", default="patched", choices=sorted(SCENARIOS),
                        help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=RUN_TIMEOUT_S + 10, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        return _worker_main(args.scenario, args.rank, args.out, args.deadline)
    try:
        if args.without_patches:
            return demo_without_patches(args.timeout)
        return demo_patched(args.timeout)
    except KeyboardInterrupt:  # the running sub-run's ranks were already killed on the way out
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
