"""A discarded accumulation window on 2 gloo ranks (``_pending_grads_warning_scenarios``), under each
setting of the two policies that handle it: one launch per setting.

* defaults (``pending_grads_warning`` on, ``zero_grad_discards_pending_grads`` off): FSDP2's result
  (the discarded window reduced into the step, far from DDP's), and one warning per variant that
  meets kept gradients, naming both variables, on rank 0 only (``LOCAL_RANK`` 0: one copy per node;
  rank 1 stays silent but counts the fire);
* ``FSDP_AUTOPATCH_ZERO_GRAD_DISCARDS_PENDING=1``: DDP's result (the one-process reference that
  applies only the second window), no ``zero_grad()`` warning; a ``step()`` with the sync left off
  still warns;
* ``FSDP_AUTOPATCH_PENDING_GRADS_WARNING=0``: FSDP2's result and no warning at all (torch as it is).

The usual loop (``clean``) is bitwise the same under every setting and never warned about.

Where torch keeps pending gradients itself (PyTorch's pending-gradient rewrite: an ``FSDPGrad``),
both policies report ``not_needed`` and the tests follow that verdict, read from the registry each
run records (its structure, never a release number): torch's ``zero_grad()`` drops the window
(DDP's result under every setting), no warning of ours, and torch refuses the ``step()`` on a
gradient not yet synchronized (a ``RuntimeError`` naming ``synchronize_gradients()``).
"""

from __future__ import annotations

import functools

import pytest
import torch

import _pending_grads_warning_scenarios as pg
from _dist_launcher import RunResult, run_ranks

pytestmark = pytest.mark.timeout(300)

WARNING, DISCARD = "pending_grads_warning", "zero_grad_discards_pending_grads"
SETTINGS = {
    "defaults": {},
    "discard": {"FSDP_AUTOPATCH_ZERO_GRAD_DISCARDS_PENDING": "1"},
    "no_warning": {"FSDP_AUTOPATCH_PENDING_GRADS_WARNING": "0"},
}
ZERO_GRAD_WARNING = "fsdp-autopatch: "  # then "<Optimizer or model>.zero_grad() left FSDP2 gradients ..."
FP32_REL, BF16_REL = 1e-5, 2e-2


@functools.cache
def launch(setting: str) -> RunResult:
    return run_ranks("pending_grads_warning", env=SETTINGS[setting], timeout=240)


@functools.cache
def reference(kind: str, variant: str = "") -> dict:
    return pg.reference(2, (1,) if kind == "ddp" else (0, 1), frozen_bias=variant == "hsdp_frozen_bias")


def far_from(got: dict, want: dict) -> float:
    """max |got - want| over the weights, relative to the largest weight."""
    worst = 0.0
    for name, value in want.items():
        g, w = torch.tensor(got[name], dtype=torch.float64), torch.tensor(value, dtype=torch.float64)
        worst = max(worst, float((g - w).abs().max() / w.abs().max()))
    return worst


def tolerance(variant: str) -> float:
    return BF16_REL if variant == "mixed_precision" else FP32_REL


def records(run: RunResult, variant: str, *, raises: bool = False) -> list[dict]:
    """Each rank's record of ``variant``; ``raises``: torch refused it (the record holds the error)."""
    found = []
    for rank in run.ranks:
        rec = rank.cases.get(variant)
        assert rec is not None and (rec["error"] is not None) == raises, (
            rank.rank, rec and rec["error"], rank.stderr_tail[-2000:])
        found.append(rec)
    return found


@functools.cache
def torch_keeps_pending_grads() -> bool:
    """Whether the registry says torch keeps no-sync gradients itself (``pending_grads_warning``
    not_needed: an ``FSDPGrad`` that torch's ``zero_grad()`` drops), as the default launch records it.
    Decided by the plugin's structural check on the torch the ranks ran, not by the release."""
    policies = [rank.cases["policies"]["records"][WARNING] for rank in launch("defaults").ranks]
    statuses = {policy["status"] for policy in policies}
    assert len(statuses) == 1 and statuses <= {"applied", "not_needed"}, policies
    if statuses == {"not_needed"}:
        assert all("synchronize_gradients()" in policy["description"] for policy in policies), policies
    return statuses == {"not_needed"}


def window_result(variant: str) -> dict:
    """The weights torch gives without our discard policy: the window kept (FSDP2 up to 2.15),
    or dropped as DDP drops it where torch keeps pending gradients itself."""
    return reference("ddp" if torch_keeps_pending_grads() else "keep", variant)


def the_other_result(variant: str) -> dict:
    return reference("keep" if torch_keeps_pending_grads() else "ddp", variant)


def printing(run: RunResult) -> list[bool]:
    """Per rank, whether it prints our warnings: the first rank of the node only (``_warn``)."""
    return [rank.rank == 0 for rank in run.ranks]


def zero_grad_warnings(rec: dict) -> list[str]:
    return [w for w in rec["warnings"] if ".zero_grad() left FSDP2 gradients" in w]


def step_warnings(rec: dict) -> list[str]:
    return [w for w in rec["warnings"] if ".step() ran while FSDP2 gradients" in w]


@pytest.mark.parametrize("variant", pg.DISCARDED)
def test_without_the_discard_policy_the_window_is_reduced_into_the_step(variant):
    """Torch as it is: up to 2.15 the window is kept (the bug); where torch keeps pending
    gradients itself, its zero_grad() drops the window, as DDP does."""
    for rec in records(launch("no_warning"), variant):
        assert far_from(rec["params"], window_result(variant)) < tolerance(variant)
        # the window matters (up to 2.15 the bug: DDP would have dropped it; 1.3 times the DDP
        # update away on 2.13), so kept and dropped cannot be confused
        assert far_from(rec["params"], the_other_result(variant)) > 10 * tolerance(variant)
        assert rec["warnings"] == []


@pytest.mark.parametrize("variant", pg.DISCARDED)
def test_by_default_one_warning_says_what_is_kept_and_how_to_choose(variant):
    run = launch("defaults")
    for rec, prints in zip(records(run, variant), printing(run)):
        assert far_from(rec["params"], window_result(variant)) < tolerance(variant)  # nothing changed
        if torch_keeps_pending_grads():  # not_needed: torch dropped the window, nothing to warn about
            assert rec["warnings"] == []
            continue
        if not prints:  # rank 1: silent, the same message printed once per node is enough
            assert rec["warnings"] == []
            continue
        (warning,) = zero_grad_warnings(rec)
        assert "FSDP_AUTOPATCH_ZERO_GRAD_DISCARDS_PENDING=1" in warning
        assert "FSDP_AUTOPATCH_PENDING_GRADS_WARNING=0" in warning
        assert ("model.zero_grad()" if variant == "model_zero_grad" else "SGD.zero_grad()") in warning
        assert "0.weight" in warning, warning
        names = warning.split("unit(s): ", 1)[1].split(")", 1)[0].split(", ")
        assert names == sorted(names), warning  # the same order on every rank
        assert step_warnings(rec) == []


@pytest.mark.parametrize("variant", pg.DISCARDED)
def test_with_the_discard_policy_zero_grad_drops_the_window_as_ddp_does(variant):
    for rec in records(launch("discard"), variant):
        assert far_from(rec["params"], reference("ddp", variant)) < tolerance(variant)
        assert rec["warnings"] == []


def test_a_step_with_the_sync_left_off_is_warned_about_unless_switched_off():
    if torch_keeps_pending_grads():  # torch refuses that step itself, under every setting, unwarned by us
        for setting in SETTINGS:
            for rec in records(launch(setting), "step_sync_off", raises=True):
                assert rec["error"]["type"] == "RuntimeError", rec["error"]
                assert "synchronize_gradients()" in rec["error"]["message"], rec["error"]
                assert rec["warnings"] == [], setting
        return
    for setting in ("defaults", "discard"):
        run = launch(setting)
        for rec, prints in zip(records(run, "step_sync_off"), printing(run)):
            if not prints:
                assert rec["warnings"] == []
                continue
            (warning,) = step_warnings(rec)
            assert warning.startswith("fsdp-autopatch: SGD.step() ran while FSDP2 gradients it updates"), warning
            assert zero_grad_warnings(rec) == []
    for rec in records(launch("no_warning"), "step_sync_off"):
        assert rec["warnings"] == []


def test_the_usual_loop_is_bitwise_the_same_under_every_setting_and_never_warned_about():
    runs = {setting: records(launch(setting), "clean") for setting in SETTINGS}
    first = runs["no_warning"][0]["params"]
    assert far_from(first, reference("keep")) < FP32_REL  # two micro-batches, one step
    for setting, recs in runs.items():
        for rec in recs:
            assert rec["params"] == first, setting
            assert rec["warnings"] == [], setting


def test_each_policy_is_recorded_where_it_is_in_force_and_counts_what_it_did():
    n = sum(pg.ZERO_GRADS.get(variant, 1) for variant in pg.DISCARDED)  # zero_grad() calls meeting kept gradients
    want = {
        "defaults": {WARNING: ("applied", n + 1)},  # each such zero_grad(), and the step
        "discard": {WARNING: ("applied", 1), DISCARD: ("applied", n)},
        "no_warning": {},
    }
    if torch_keeps_pending_grads():  # both share the premise: both not_needed, neither acts
        want = {setting: {name: ("not_needed", 0) for name in expected} for setting, expected in want.items()}
    for setting, expected in want.items():
        for rank in launch(setting).ranks:
            got = rank.cases["policies"]["records"]
            assert {name: (got[name]["status"], got[name]["fired"]) for name in expected} == expected, (setting, got)
            assert (WARNING in got) == (setting != "no_warning") and (DISCARD in got) == (setting == "discard"), got
