"""keep_param_attributes's variants on 2 gloo ranks (``_keep_param_attributes_scenarios``), with the
patch off and on. Its case (``test_dist_cases.py``) shows marks set before ``fully_shard`` lost (off)
and kept (on), with an AdamW built from them.

``AttrsNet``: units ``fully_shard(inp)``, ``fully_shard([norm, head])`` and the root (holding
``proj``); ``no_weight_decay``, ``sequence_parallel``, tag strings, a dict, a private name, a tensor
and a list holding a tensor set on the original parameters. An AdamW built from ``no_weight_decay``
(weight decay 0.5 for the others) takes two steps; the weights are compared with a one-process
reference whose groups come from the original marks. The same runs again with
``CPUOffloadPolicy(pin_memory=False)``. The public, tensor-free marks are on the parameter the module
shows after ``fully_shard``, after ``model.float()`` (``Module._apply``), inside the grouped unit's
forward (unsharded), after backward, each step, ``unshard()`` and ``reshard()``; changes the user
makes travel with the swaps; the weights equal the reference within 1e-5. Without the patch the
marks are gone at every later stage too, the unsharded parameter inside forward has none, and under
CPU offload everything the case shows goes wrong the same way (lost marks, every parameter in the
decay group, weights off the reference); the default run's loss at ``fully_shard`` and its decay
group are the case's, not judged here.
"""
from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _keep_param_attributes_scenarios as at
from _dist_launcher import RunResult

pytestmark = pytest.mark.timeout(420)

PATCH = "keep_param_attributes"
BUG = ck.ex.BUG_OF[PATCH]
LAUNCH_TIMEOUT_S = 180.0
CASES = ("default", "cpu_offload")
STAGES = ("fully_shard", "apply", "forward", "backward", "step0", "step1", "unshard", "reshard")
NAMES = tuple(at.MARKS)
REFERENCE_DECAY = sorted(n for n in NAMES if not at.MARKS[n].get("no_weight_decay"))
MARKED = sum(1 for n in NAMES if at.expected_carried(n))  # parameters with something to carry
FP32_ATOL = 1e-5
MIN_UNPATCHED_DIFF = 0.01  # AdamW's decoupled decay lr * 0.5 * |p| on wrongly decayed params (~0.05 / step)
STRICT_ERROR = "AttributeError: 'DTensor' object has no attribute 'no_weight_decay'"
# off: the marks lost right at fully_shard, the decay group and the weights are the case's; under CPU
# offload (another path through fully_shard) every stage is judged
OFF_STAGES = {"default": STAGES[1:], "cpu_offload": STAGES}


unpatched, patched = ck.off_and_on("keep_param_attributes", PATCH, timeout=LAUNCH_TIMEOUT_S)


def case_records(run: RunResult, case: str) -> list[dict]:
    ck.case_grads(run, case, key="params_after")  # every rank ran the case without error
    return [rank.cases[case] for rank in run.ranks]


def reference(run: RunResult, case: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The weights after ``STEPS`` AdamW steps in one process, groups from the original marks."""
    model = at.build_marked_model()
    ck.load_weights(model, ck.gather(run, lambda r: r.cases[case]["init_params"]), must_equal=True)
    opt, decay = at.build_optimizer(model)
    world = len(run.ranks)
    for step in range(at.STEPS):
        loss = sum(at.sc.loss_fn(model, at.plan(rank, step, 0)) for rank in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, decay


def max_param_diff(run: RunResult, case: str) -> float:
    got = ck.gather(run, lambda r: r.cases[case]["params_after"])
    ref, _ = reference(run, case)
    return max(float((got[n] - ref[n]).abs().max()) for n in NAMES)


def public_after_sharding(records: list[dict], stages: tuple[str, ...] = STAGES) -> dict[str, list[str]]:
    """Each parameter's public ``__dict__`` names at each of ``stages``, all ranks."""
    return {
        f"{stage}:{name}": rec["stages"][stage][name]["public"]
        for rec in records
        for stage in stages
        for name in NAMES
    }


def _unpatched_outcome(run: RunResult) -> tuple[str, str]:
    """Judged on the CPU-offload run (the default run's loss is the case's)."""
    records = case_records(run, "cpu_offload")
    public = public_after_sharding(records)
    decay = records[0]["decay_group"]
    diff = max_param_diff(run, "cpu_offload")
    if all(names == [] for names in public.values()) and decay == sorted(NAMES):
        return ck.ex.REPRODUCES, f"cpu_offload: every attribute lost, decay group {len(decay)}, max diff {diff:.3g}"
    if decay == REFERENCE_DECAY and diff <= FP32_ATOL:
        return ck.ex.FIXED, f"cpu_offload: attributes kept, weights equal the reference ({diff:.2g})"
    return "other", f"cpu_offload: public names {public}, decay group {decay}, max diff {diff:.3g}"


def test_unpatched(unpatched):
    """Every release: the attributes are gone at every stage, inside forward too, and under CPU offload
    the decay group takes every parameter. Judged, not recorded: the matrix's "off" record is the case's."""
    assert not unpatched.timed_out, unpatched.describe()
    outcome, detail = _unpatched_outcome(unpatched)
    assert ck.unpatched_agrees(BUG, outcome), (ck.UNPATCHED[BUG], outcome, detail, unpatched.describe())
    ck.assert_registry_with_disabled(unpatched, PATCH)
    unpatched.assert_clean()
    assert ck.fired(unpatched, PATCH) == [0] * len(unpatched.ranks)
    if outcome == ck.ex.FIXED:
        return
    for case in CASES:
        records = case_records(unpatched, case)
        public = public_after_sharding(records, OFF_STAGES[case])
        assert all(names == [] for names in public.values()), (case, public)
        for rec in records:
            assert rec["stages"]["before"]["norm.weight"]["marks"] == at.MARKS["norm.weight"]  # set, then lost
            assert rec["in_forward"]["type"] == "Parameter"
            assert rec["in_forward"]["strict_read"] == (
                "AttributeError: 'Parameter' object has no attribute 'sequence_parallel'"
            )
    for rec in case_records(unpatched, "cpu_offload"):
        assert rec["strict_read"] == STRICT_ERROR, rec["strict_read"]
        assert rec["decay_group"] == sorted(NAMES)
    assert max_param_diff(unpatched, "cpu_offload") > MIN_UNPATCHED_DIFF


def test_reference_groups_differ_from_all_parameters():
    """The weights check is not vacuous: the original marks put 4 of the 8 parameters in the decay
    group (lost marks put all 8 there)."""
    assert REFERENCE_DECAY == ["head.weight", "inp.weight", "proj.bias", "proj.weight"]
    assert MARKED == 6


@pytest.mark.parametrize("case", CASES)
def test_patched_attributes_at_every_stage(patched, case):
    for rec in case_records(patched, case):
        for stage in STAGES:
            for name in NAMES:
                seen = rec["stages"][stage][name]
                want = at.expected_carried(name)
                assert seen["marks"] == want, (case, stage, name, seen)
                assert seen["public"] == sorted(want), (case, stage, name, seen)
        assert {rec["stages"]["fully_shard"][n]["type"] for n in NAMES} == {"DTensor"}
        assert rec["stages"]["unshard"]["norm.weight"]["type"] == "Parameter"  # the unsharded one
        assert rec["strict_read"] == "True"
        assert rec["in_forward"] == {"marks": at.expected_carried("norm.weight"), "type": "Parameter",
                                     "strict_read": "True"}


@pytest.mark.parametrize("case", CASES)
def test_patched_changes_travel_with_the_swaps(patched, case):
    for rec in case_records(patched, case):
        changed = rec["stages"]["changed"]
        assert changed["head.weight"]["marks"] == {**at.expected_carried("head.weight"), "tag": "expert1"}
        assert changed["inp.weight"]["marks"] == {}  # deleted by the user: not resurrected by a swap


@pytest.mark.parametrize("case", CASES)
def test_patched_weights_equal_the_reference(patched, case):
    _, reference_decay = reference(patched, case)
    assert reference_decay == REFERENCE_DECAY
    for rec in case_records(patched, case):
        assert rec["decay_group"] == REFERENCE_DECAY
    diff = max_param_diff(patched, case)
    assert diff <= FP32_ATOL, diff


def test_patched_registry_and_fired(patched):
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    fired = ck.fired(patched, PATCH)
    if ck.EXPECTED_STATUS[PATCH] == "applied":  # once per marked parameter of each model
        assert fired == [MARKED * len(CASES)] * len(patched.ranks), fired
    else:
        assert fired == [0] * len(patched.ranks), fired


def test_patched_run_clean(patched):
    patched.assert_clean()
