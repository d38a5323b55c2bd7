"""fsdp_module_abc_layout: ``fully_shard`` on ``class Model(abc.ABC, nn.Module)`` (2 gloo ranks).

Scenario ``fsdp_module_abc_layout`` (``_fsdp_module_abc_layout_scenarios``): two ABC-first blocks, a plain
``LayerNorm`` and an ABC-first root, each its own unit, fp32 and bf16/fp32 mixed precision.

* patch off: the first ``fully_shard`` raises ``TypeError: __class__ assignment: 'FSDPTanhBlock'
  object layout differs from 'TanhBlock'`` on every rank;
* patch on: every unit is an ``FSDPModule`` and still an instance of its class, each FSDP class
  has torch's method resolution order (``FSDP<Name>, FSDPModule, <Name>, ...``), the plain class's
  FSDP class is torch's own, and the gradients equal a one-process reference (fp32: 1e-5; bf16:
  the bf16 tolerance).
"""

from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _dist_common as sc
import _fsdp_module_abc_layout_scenarios as abc_sc
from _dist_launcher import RunResult

pytestmark = pytest.mark.timeout(300)

PATCH = "fsdp_module_abc_layout"
BUG = ck.ex.BUG_OF[PATCH]
CASES = {"default": False, "bf16": True}  # case -> bf16 tolerance
MESSAGE = "__class__ assignment: 'FSDPTanhBlock' object layout differs from 'TanhBlock'"


unpatched, patched = ck.off_and_on("fsdp_module_abc_layout", PATCH)


def reference_grads() -> dict[str, torch.Tensor]:
    """One process: the mean of every rank's loss, what FSDP2's reduce-scatter gives."""
    model = abc_sc.build()
    for rank in range(sc.WORLD_SIZE):
        (abc_sc.loss(model, abc_sc.rank_batch(rank)) / sc.WORLD_SIZE).backward()
    return {name: param.grad for name, param in model.named_parameters()}


def _errors(run: RunResult, case: str) -> list[dict | None]:
    return [ck.error_of(rank, case) for rank in run.ranks]


def test_unpatched(unpatched):
    """Every FSDP2 release raises at the first fully_shard of an ABC-first class."""
    assert not unpatched.timed_out, unpatched.describe()
    errors = _errors(unpatched, "default")
    if all(e is not None and e["type"] == "TypeError" and e["message"] == MESSAGE for e in errors):
        outcome, detail = ck.ex.REPRODUCES, f"TypeError: {MESSAGE} on every rank"
    else:
        assert errors == [None] * len(errors), errors
        outcome, detail = ck.ex.FIXED, "fully_shard works without the plugin"
    ck.expect_unpatched(BUG, outcome, detail, unpatched)
    ck.assert_registry_with_disabled(unpatched, PATCH)


@pytest.mark.parametrize("case", CASES)
def test_patched(patched, case):
    patched.assert_clean()
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    for rank in patched.ranks:
        rec = rank.cases[case]
        assert rec["error"] is None, rec["error"]
        assert all(rec["is_fsdp_module"].values()), rec["is_fsdp_module"]
        assert all(rec["keeps_class"].values()), rec["keeps_class"]
        for unit, mro in rec["mro"].items():
            assert mro[1] == "FSDPModule" and mro[0] == "FSDP" + mro[2], (unit, mro)
        assert rec["norm_metaclass"] == "type", "a class torch handles must get torch's own FSDP class"
    grads = patched.ranks[0].cases[case]["full_grads"]
    for rank in patched.ranks[1:]:
        assert all(torch.equal(grads[n], g) for n, g in rank.cases[case]["full_grads"].items())
    ck.assert_grads_match(grads, reference_grads(), bf16=CASES[case])
    ck.assert_fired_where_applied(patched, PATCH)


def test_patched_observed(patched):
    patched.assert_clean()
    ck.observe_patched(BUG, "fully_shard works; isinstance of FSDPModule and the class; grads equal the reference")
