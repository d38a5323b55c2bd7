"""The compile suite: FSDP2 under ``torch.compile`` (aot_eager) sees the same Dynamo with the plugin as without.

Scenario ``compile`` (``_compile_scenarios``): six variants, all in one 2-rank gloo job per
setting: plugin on (as installed) and off (``FSDP_AUTOPATCH_ENABLED=0``). For every variant:

* Dynamo's counters are the same on and off, rank by rank: graph breaks (their count and their
  reasons' first lines), frames converted, unique graphs, recompiles (and their reasons), compiles;
* the final weights (``full_tensor()``) and the losses are bitwise equal on and off, equal on both
  ranks, and equal to a one-process reference within fp32 tolerance;
* the on run has the plugin's patches applied (``fsdp_autopatch.status()``), the off run none.

Measured on torch 2.13 (per rank, on / off): before ``Wrap.dynamo`` (6027423) the plugin's wrappers
of FSDP2's hooks made Dynamo break and recompile: graph breaks 22 / 0 and recompiles 18 / 1 for
``whole_model`` and ``fill_on``, 17 / 0 and 12 / 1 for ``per_unit`` and ``checkpointed_unit``;
since, equal. ``compiled_optimizer_step``: the guards' global optimizer step pre-hooks were traced
inside the compiled ``step`` (a guard on ``optimizer_unsharded_params_guard``'s WeakSet of checked
optimizers: one recompile at the second step); they step aside while Dynamo traces since
(``_isolation.aside_while_compiling``): equal.
"""

from __future__ import annotations

import re

import pytest
import torch

import _compile_scenarios as cs
import _dist_checks as ck
import _dist_common as sc
from _dist_launcher import RunResult

pytestmark = pytest.mark.timeout(600)  # two jobs that compile six variants each: 30 - 50 s each here

SCENARIO = "compile"
TIMEOUT_S = 240.0  # each job, all ranks (both jobs fit in the module's timeout)
VARIANTS = tuple(cs.VARIANTS)
COUNTS = ("graph_breaks", "frames_total", "frames_ok", "unique_graphs", "recompiles", "compiles")
SPARE = ("blocks.1.spare.bias", "blocks.1.spare.weight")  # fill_on's parameter no rank uses
def _run(env: dict[str, str]) -> RunResult:
    return ck.run_compiling(SCENARIO, env, TIMEOUT_S)


@pytest.fixture(scope="module")
def plugin_on() -> RunResult:
    return _run({})


@pytest.fixture(scope="module")
def plugin_off() -> RunResult:
    return _run({"FSDP_AUTOPATCH_ENABLED": "0"})


def records(run: RunResult, variant: str) -> list[dict]:
    """Each rank's record of ``variant``, which must have trained (or be skipped on every rank)."""
    run.assert_clean()
    recs = []
    for rank in run.ranks:
        rec = rank.cases.get(variant)
        assert rec is not None, f"rank {rank.rank} did not run {variant}\n{run.describe()}"
        assert rec["error"] is None, (
            f"rank {rank.rank} {variant}: {rec['error']['type']}: {rec['error']['message']}\n"
            + rec["error"]["traceback"][-3000:]
        )
        recs.append(rec)
    return recs


def skip_if_skipped(*runs: RunResult, variant: str) -> None:
    for run in runs:
        reason = next((r.cases[variant]["skipped"] for r in run.ranks if r.cases[variant].get("skipped")), None)
        if reason:
            pytest.skip(f"{variant} ({'plugin off' if run.env else 'plugin on'}): {reason}")


def comparable(counters: dict) -> dict:
    """The counters with the objects' addresses in recompile reasons (type ids) taken out."""
    out = dict(counters)
    out["recompile_reasons"] = [re.sub(r"\d{6,}", "<id>", r) for r in counters["recompile_reasons"]]
    return out


def test_registry(plugin_on, plugin_off):
    """On: every patch as expected on this torch, some applied (the comparison is not vacuous); off: none."""
    plugin_on.assert_clean()
    plugin_off.assert_clean()
    ck.assert_registry(plugin_on, ck.EXPECTED_STATUS)
    assert ck.EXPECTED_APPLIED, "no patch applies on this torch: the on/off comparison would be vacuous"
    for rank in plugin_on.ranks:
        assert ck.applied_with_fsdp2(rank.autopatch["applied"]) == ck.EXPECTED_APPLIED, rank.autopatch["applied"]
    ck.assert_plugin_off(plugin_off)


@pytest.mark.parametrize("variant", VARIANTS)
def test_counters_equal(plugin_on, plugin_off, variant):
    """Dynamo counts the same graph breaks, frames, graphs and recompiles with the plugin as without."""
    ons, offs = records(plugin_on, variant), records(plugin_off, variant)
    skip_if_skipped(plugin_on, plugin_off, variant=variant)
    for rank, (on_rec, off_rec) in enumerate(zip(ons, offs)):
        on, off = comparable(on_rec["counters"]), comparable(off_rec["counters"])
        differ = {key: (on[key], off[key]) for key in on if on[key] != off[key]}
        assert not differ, f"rank {rank} {variant}: Dynamo's counters differ (on, off): {differ}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_bitwise_equal_on_and_off(plugin_on, plugin_off, variant):
    ons, offs = records(plugin_on, variant), records(plugin_off, variant)
    skip_if_skipped(plugin_on, plugin_off, variant=variant)
    for rank, (on, off) in enumerate(zip(ons, offs)):
        assert on["losses"] == off["losses"], (rank, on["losses"], off["losses"])
        assert on["weights"].keys() == off["weights"].keys()
        for name, weight in on["weights"].items():
            assert weight.dtype == torch.float32, (name, weight.dtype)
            assert torch.equal(weight, off["weights"][name]), f"rank {rank} {variant} {name} differs on / off"
            assert torch.equal(weight, ons[0]["weights"][name]), f"{variant} {name}: ranks 0 and {rank} differ"


def reference(variant: str) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """One process: SGD on the mean of the ranks' losses (what FSDP2's reduce-scatter averages);
    the final weights and each rank's loss per step."""
    model = cs.Net(**cs.model_kwargs(variant))
    opt = torch.optim.SGD(model.parameters(), lr=cs.LR)
    losses: list[list[float]] = [[] for _ in range(sc.WORLD_SIZE)]
    for step in range(cs.STEPS):
        per_rank = [cs.loss_of(model, *cs.rank_batch(rank, step)) for rank in range(sc.WORLD_SIZE)]
        for rank, loss in enumerate(per_rank):
            losses[rank].append(loss.item())
        (sum(per_rank) / sc.WORLD_SIZE).backward()
        opt.step()
        opt.zero_grad()
    return {name: param.detach().clone() for name, param in model.named_parameters()}, losses


@pytest.mark.parametrize("variant", VARIANTS)
def test_equals_the_reference(plugin_on, variant):
    """The compiled FSDP2 training is the right one (guards against comparing two wrong runs)."""
    recs = records(plugin_on, variant)
    skip_if_skipped(plugin_on, variant=variant)
    weights, losses = reference(variant)
    initial = dict(cs.Net(**cs.model_kwargs(variant)).named_parameters())
    for rank, rec in enumerate(recs):
        assert rec["weights"].keys() == weights.keys(), (sorted(rec["weights"]), sorted(weights))
        for name, ref in weights.items():
            torch.testing.assert_close(rec["weights"][name], ref, rtol=ck.FP32_RTOL, atol=ck.FP32_ATOL,
                                       msg=lambda m, name=name, rank=rank: f"rank {rank} {variant} {name}: {m}")
            moved = not torch.equal(ref, initial[name])
            assert moved == (name not in SPARE), f"{name}: moved {moved}"  # 3 steps train all but the spare
        torch.testing.assert_close(rec["losses"], losses[rank], rtol=ck.FP32_RTOL, atol=ck.FP32_ATOL)


def test_fill_on_keeps_unused_grad_none(plugin_on, plugin_off):
    """The fill under compile: torch gives the unused parameter a zero gradient, the plugin keeps it None
    (restore_unused_param_grads acts inside the compiled run, and its weights stay bitwise equal)."""
    ons, offs = records(plugin_on, "fill_on"), records(plugin_off, "fill_on")
    skip_if_skipped(plugin_on, plugin_off, variant="fill_on")
    restored = ck.EXPECTED_STATUS["restore_unused_param_grads"] == "applied"
    for on, off in zip(ons, offs):
        assert not set(SPARE) & set(off["grad_none"]), off["grad_none"]  # torch's zeros
        assert set(on["grad_none"]) == (set(SPARE) if restored else set()), on["grad_none"]
    if restored:
        assert all(count > 0 for count in ck.fired(plugin_on, "restore_unused_param_grads"))
