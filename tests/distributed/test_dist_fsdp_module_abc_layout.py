"""fsdp_module_abc_layout's variants on 2 gloo ranks, the plugin as installed
(``_fsdp_module_abc_layout_scenarios``). The bug itself (an ABC-first root, its ``TypeError`` with the
fix off, torch's class order and the reference gradients with it on) is its case's (``test_dist_cases.py``).

* ABC-first units below the root (two blocks with an abstract method and a ``super()`` call in
  ``forward``) beside a plain ``nn.LayerNorm`` unit, with bf16 parameters and an fp32 reduce: every
  unit is an ``FSDPModule`` and still an instance of its class, each FSDP class has torch's method
  resolution order (``FSDP<Name>, FSDPModule, <Name>, ...``), the plain class's FSDP class is
  torch's own (built by ``type``), and the gradients equal a one-process reference (the bf16 tolerance).
"""

from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _dist_common as sc
import _fsdp_module_abc_layout_scenarios as abc_sc
from _dist_launcher import RunResult, run_ranks

pytestmark = pytest.mark.timeout(300)

PATCH = "fsdp_module_abc_layout"


@pytest.fixture(scope="module")
def patched() -> RunResult:
    return run_ranks("fsdp_module_abc_layout")


def reference_grads() -> dict[str, torch.Tensor]:
    """One process: the mean of every rank's loss, what FSDP2's reduce-scatter gives."""
    model = abc_sc.build()
    for rank in range(sc.WORLD_SIZE):
        (abc_sc.loss(model, abc_sc.rank_batch(rank)) / sc.WORLD_SIZE).backward()
    return {name: param.grad for name, param in model.named_parameters()}


def test_nested_abc_units_beside_a_plain_one_in_bf16(patched):
    patched.assert_clean()
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    for rank in patched.ranks:
        rec = rank.cases["bf16"]
        assert rec["error"] is None, rec["error"]
        assert all(rec["is_fsdp_module"].values()), rec["is_fsdp_module"]
        assert all(rec["keeps_class"].values()), rec["keeps_class"]
        for unit, mro in rec["mro"].items():
            assert mro[1] == "FSDPModule" and mro[0] == "FSDP" + mro[2], (unit, mro)
        assert rec["norm_metaclass"] == "type", "a class torch handles must get torch's own FSDP class"
    grads = patched.ranks[0].cases["bf16"]["full_grads"]
    for rank in patched.ranks[1:]:
        assert all(torch.equal(grads[n], g) for n, g in rank.cases["bf16"]["full_grads"].items())
    ck.assert_grads_match(grads, reference_grads(), bf16=True)
    ck.assert_fired_where_applied(patched, PATCH)
