"""inplace_view_output in one process: which outputs get a hook on their base, and what it does."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torch.distributed.fsdp")

from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState  # noqa: E402

from fsdp_autopatch.patches import inplace_view_output as patch  # noqa: E402


def _hooked(*outputs) -> list:
    """The bases the patch hooks for these outputs, as the outputs' indices of their bases."""
    bases = patch.bases_to_hook(list(outputs))
    return [next(i for i, t in enumerate(outputs) if t._base is b) for b in bases]


def test_the_structural_check_finds_the_tensor_hook_per_output():
    assert patch._structural_check().status == "needed"


@pytest.mark.parametrize("make", [
    lambda y: y.transpose(0, 1), lambda y: y.view(-1), lambda y: y[1:], lambda y: y.unsqueeze(0).squeeze(0),
    lambda y: y.flatten(), lambda y: y.t()[0],
], ids=["transpose", "view", "slice", "squeeze", "flatten", "nested"])
def test_a_view_of_a_non_leaf_base_gets_a_hook_on_its_base(make):
    lin = nn.Linear(4, 4)
    out = make(lin(torch.randn(3, 4)))
    assert out._is_view()
    assert patch.bases_to_hook([out]) == [out._base]


def test_linear_on_3d_input_is_hooked_where_torch_returns_a_view():
    out = nn.Linear(4, 4)(torch.randn(2, 3, 4))
    assert patch.bases_to_hook([out]) == ([out._base] if out._is_view() else [])


def test_non_views_leaves_and_parameter_views_get_nothing():
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    assert patch.bases_to_hook([lin(x)]) == []  # not a view (2-D linear: addmm)
    assert patch.bases_to_hook([x]) == []  # a leaf
    assert patch.bases_to_hook([lin.weight.t(), lin.weight[0]]) == []  # views of a parameter
    assert patch.bases_to_hook([x.view(-1)]) == []  # a view of a leaf input
    frozen = lin(torch.randn(3, 4)).detach().t()
    assert patch.bases_to_hook([frozen]) == []  # no grad


def test_each_base_once_and_never_an_output_torch_hooked():
    y = nn.Linear(4, 4)(torch.randn(3, 4))
    a, b = y.chunk(2)
    assert _hooked(a, b) == [0]  # both views of y: one hook
    assert patch.bases_to_hook([y, y.t()]) == []  # y itself is an output: torch's hook is on it


class _State:
    """A stand-in FSDPState: the training state our hook reads, and torch's _pre_backward."""

    def __init__(self, state=TrainingState.IDLE) -> None:
        self._training_state = state
        self._modules = (nn.Linear(1, 1),)
        self.calls = 0

    def _pre_backward(self, grad):
        self.calls += 1
        self._training_state = TrainingState.PRE_BACKWARD
        return grad


@pytest.mark.parametrize("state, runs", [(TrainingState.IDLE, 1), (TrainingState.PRE_BACKWARD, 0)])
def test_the_base_hook_runs_torchs_pre_backward_only_where_torchs_hook_was_bypassed(state, runs):
    fsdp_state = _State(state)
    grad = torch.ones(2)
    assert patch._base_hook(fsdp_state)(grad) is None  # the gradient goes on unchanged
    assert fsdp_state.calls == runs


def test_in_place_op_on_a_view_reaches_the_base_hook_and_not_the_views():
    """The mechanism the patch relies on, in plain autograd: after ``out.mul_(2)`` the hook on the
    view's node never runs, the one on the base's node does, before the base's node."""
    lin = nn.Linear(4, 4)
    for in_place in (False, True):
        ran = []
        out = lin(torch.randn(3, 4)).transpose(0, 1)
        out.register_hook(lambda g, ran=ran: ran.append("view"))
        out._base.register_hook(lambda g, ran=ran: ran.append("base"))
        if in_place:
            out.mul_(2)
        out.sum().backward()
        assert ran == (["base"] if in_place else ["view", "base"]), (in_place, ran)


def test_torch_hooks_and_outputs_are_unchanged(monkeypatch):
    """The wrapper returns torch's output object itself (no copy) and adds one hook per base."""
    registered = []
    y = nn.Linear(4, 4)(torch.randn(3, 4))
    out = (y.t(), y.t(), torch.randn(2, requires_grad=True) * 2)

    class Call:
        def __call__(self, *args, **kwargs):
            return out

        def argument(self, name):
            assert name == "output"
            return out

    monkeypatch.setattr(torch.Tensor, "register_hook", lambda self, hook: registered.append(self))
    assert patch._hook_view_bases(Call(), _State(), (out,), {}) is out
    assert len(registered) == 1 and registered[0] is y
