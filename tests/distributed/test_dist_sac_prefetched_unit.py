"""sac_prefetched_unit's variants on 2 gloo ranks, with the fix off and on
(``_sac_prefetched_unit_scenarios``). Its case (``test_dist_cases.py``) shows ``l1.unshard()`` before
a selective-activation-checkpointing region over ``l1``.

* ``l0.set_modules_to_forward_prefetch([l1])`` instead (and a block of ops FSDP2 also dispatches:
  ``split``, ``cat``, ``view``): fix off, the first backward raises ``RuntimeError: ... invocation
  index N encountered during backward but not found in storage. ...`` on every rank
  (``profiler._record_function_enter_new.default``, index 2 / 3 on torch 2.13 / 2.15); fix on, the
  gradients of both steps equal a one-process reference without checkpointing (fp32: 1e-5);
* a save-every-op policy, no prefetch (silent without the fix): with it the reference too;
  ``fired`` on every rank in both (each forward-hook call inside a SAC region is rerouted);
* the control (no prefetch, a policy saving mm/addmm) gives bitwise the same gradients with the
  fix off and on.
"""

from __future__ import annotations

import pytest
import torch

import _dist_checks as ck
import _sac_prefetched_unit_scenarios as sac
from _dist_launcher import RunResult

pytestmark = pytest.mark.timeout(300)

PATCH = "sac_prefetched_unit"
BUG = ck.ex.BUG_OF[PATCH]
CORRECTED = ("prefetch", "save_all")
MESSAGE_START = "profiler._record_function_enter_new.default invocation index "
MESSAGE_END = (
    " encountered during backward but not found in storage. This can happen if the operations in the "
    "checkpointed region are nondeterministic or depend on global state that changed between forward and backward."
)


unpatched, patched = ck.off_and_on("sac_prefetched_unit", PATCH)


@pytest.fixture(scope="module")
def reference() -> list[dict[str, torch.Tensor]]:
    return sac.reference_grads()


def _steps(run: RunResult, case: str) -> list[dict[str, torch.Tensor]]:
    """Each step's full gradients (``grad.full_tensor()``, the same on every rank)."""
    for rank in run.ranks:
        rec = rank.cases.get(case)
        assert rec is not None and rec["error"] is None, (rank.rank, case, rec and rec["error"], run.describe())
    first = run.ranks[0].cases[case]["steps"]
    for rank in run.ranks[1:]:
        for mine, theirs in zip(first, rank.cases[case]["steps"]):
            assert all(torch.equal(mine[n], theirs[n]) for n in mine), (rank.rank, case)
    return first


def _index(error: dict | None) -> int | None:
    """N of the SAC mismatch error, or None if ``error`` is not it."""
    if error is None or error["type"] != "RuntimeError":
        return None
    message = error["message"]
    if not (message.startswith(MESSAGE_START) and message.endswith(MESSAGE_END)):
        return None
    number = message[len(MESSAGE_START):-len(MESSAGE_END)]
    return int(number) if number.isdigit() else None


def _trains_right(run: RunResult, case: str, reference: list[dict[str, torch.Tensor]]) -> bool:
    try:
        for step, grads in enumerate(_steps(run, case)):
            ck.assert_grads_match(grads, reference[step])
    except AssertionError:
        return False
    return True


def test_unpatched(unpatched, reference):
    """The forward prefetch raises SAC's mismatch in the first backward on every rank."""
    assert not unpatched.timed_out, unpatched.describe()
    found = [_index(ck.error_of(rank, "prefetch")) for rank in unpatched.ranks]
    if None not in found and len(set(found)) == 1:
        outcome = ck.ex.REPRODUCES
    elif _trains_right(unpatched, "prefetch", reference):
        outcome = ck.ex.FIXED
    else:
        outcome = "differs"
    errors = [(ck.error_of(rank, "prefetch") or {}).get("message", "")[:120] for rank in unpatched.ranks]
    assert ck.unpatched_agrees(BUG, outcome), (outcome, errors, unpatched.describe())
    ck.assert_registry_with_disabled(unpatched, PATCH)


def test_patched_registry(patched):
    patched.assert_clean()
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    ck.assert_fired_where_applied(patched, PATCH)


@pytest.mark.parametrize("case", CORRECTED)
def test_patched_gradients_equal_the_reference(patched, reference, case):
    patched.assert_clean()
    if ck.EXPECTED_STATUS[PATCH] != "applied":
        pytest.skip(f"{PATCH} is {ck.EXPECTED_STATUS[PATCH]} on this torch")
    steps = _steps(patched, case)
    assert len(steps) == sac.STEPS
    for step, grads in enumerate(steps):
        ck.assert_grads_match(grads, reference[step])
    counts = [rank.cases[case]["fired"] for rank in patched.ranks]
    assert all(count > 0 for count in counts), counts


def test_control_is_bitwise_unchanged(unpatched, patched, reference):
    """No prefetch, a policy naming only mm/addmm: the patch changes no bit of the gradients."""
    off, on = _steps(unpatched, "control"), _steps(patched, "control")
    for step in range(sac.STEPS):
        assert set(off[step]) == set(on[step])
        for name in off[step]:
            assert torch.equal(off[step][name], on[step][name]), (step, name)
        ck.assert_grads_match(on[step], reference[step])
