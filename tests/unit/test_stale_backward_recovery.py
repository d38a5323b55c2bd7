"""stale_backward_recovery in one process: when the pre-forward resets, and what the reset drops."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import expected as ex

pytest.importorskip("torch.distributed.fsdp")

from fsdp_autopatch import _isolation  # noqa: E402
from fsdp_autopatch.patches import stale_backward_recovery as patch  # noqa: E402

# On a release where tests/expected.py says the patch is unsupported (torch < 2.13), the shape these
# tests start from is not there: the patch leaves torch untouched, which test_patches_in_process checks.
SHAPED = pytest.mark.skipif(
    ex.expected_status(ex.release_of(torch.__version__)).get("stale_backward_recovery") == "unsupported",
    reason="stale_backward_recovery is unsupported on this torch (tests/expected.py)",
)

IDLE = SimpleNamespace(name="IDLE")
PRE_BACKWARD = SimpleNamespace(name="PRE_BACKWARD")


class FakeParam:
    def __init__(self, unsharded_grad: bool, sharded_grad: bool, accumulated: bool) -> None:
        self._unsharded_param = torch.nn.Parameter(torch.ones(2))
        self._unsharded_param.grad = torch.ones(2) if unsharded_grad else None
        self.sharded_param = torch.nn.Parameter(torch.ones(1))
        self.sharded_param.grad = torch.ones(1) if sharded_grad else None
        self.unsharded_accumulated_grad = torch.ones(2) if accumulated else None


class FakeState:
    """A root FSDPState as the wrappers read it: a shared context, param groups, a reset."""

    def __init__(self, queued: bool, params=()) -> None:
        group = SimpleNamespace(fsdp_params=list(params), _training_state=PRE_BACKWARD if queued else IDLE,
                                _module_fqn="fc1")
        self._fsdp_param_groups = [group]
        self._training_state = PRE_BACKWARD if queued else IDLE
        self._is_root = True
        self._state_ctx = SimpleNamespace(post_backward_final_callback_queued=queued, all_states=[self])
        self.resets = 0

    def _reset_iter_state(self) -> None:  # what the wrapper below calls: through ours, as torch's would be
        _isolation.run_wrapper(patch._drop_stale_grads_after_reset, self._torch_reset, self, (), {})

    def _torch_reset(self) -> None:
        self.resets += 1
        self._state_ctx.post_backward_final_callback_queued = False
        self._training_state = IDLE


def pre_forward(state: FakeState) -> list[str]:
    calls: list[str] = []
    _isolation.run_wrapper(patch._recover_before_forward, lambda: calls.append("torch"), state, (), {})
    return calls


@SHAPED
def test_the_structural_check_finds_the_recompute_branch_and_torchs_reset():
    assert patch._structural_check().status == "needed"


def test_a_healthy_pre_forward_goes_straight_to_torch():
    state = FakeState(queued=False)
    assert pre_forward(state) == ["torch"]
    assert state.resets == 0


def test_a_backward_cut_off_is_reset_before_torchs_pre_forward():
    params = [FakeParam(True, True, True), FakeParam(False, False, False)]
    state = FakeState(queued=True, params=params)
    assert pre_forward(state) == ["torch"]
    assert state.resets == 1
    assert params[0]._unsharded_param.grad is None and params[0].sharded_param.grad is None
    assert params[0].unsharded_accumulated_grad is None
    assert pre_forward(state) == ["torch"] and state.resets == 1  # once per recovery


def test_inside_a_backward_the_queued_flag_is_a_recompute_not_a_failure():
    state = FakeState(queued=True)
    seen = []
    x = torch.ones(1, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(pre_forward(state)) or g)
    y.sum().backward()
    assert seen == [["torch"]] and state.resets == 0


def test_torchs_reset_of_a_healthy_iteration_keeps_the_gradients():
    params = [FakeParam(True, True, True)]
    state = FakeState(queued=False, params=params)
    state._reset_iter_state()
    assert params[0]._unsharded_param.grad is not None and params[0].sharded_param.grad is not None


def test_the_users_reset_after_a_failed_backward_drops_its_gradients():
    params = [FakeParam(True, False, False)]
    state = FakeState(queued=True, params=params)
    state._reset_iter_state()
    assert params[0]._unsharded_param.grad is None


def test_the_units_left_mid_backward_are_named():
    assert patch._stale_units(FakeState(queued=True)) == "units left mid-backward: fc1"
    assert patch._stale_units(FakeState(queued=False)) == "units left mid-backward: none"
