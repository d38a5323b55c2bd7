"""optimizer_unsharded_params_guard in one process: the structural check, the registry of unsharded
parameters, the hook (once per optimizer, inert once reverted, isolated), and FSDP2 on the fake
backend (4 fake ranks: the bug case stops, the right orders are silent)."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import torch.distributed.fsdp  # noqa: E402,F401  (fires the post-import hook if the .pth is active)
from torch.optim import optimizer as torch_optimizer  # noqa: E402

from fsdp_autopatch import _activate, _isolation, _patching  # noqa: E402
from fsdp_autopatch._events import GuardError  # noqa: E402
from fsdp_autopatch.patches import optimizer_unsharded_params_guard as guard  # noqa: E402

pytestmark = pytest.mark.timeout(300)
TOGGLE = "FSDP_AUTOPATCH_OPTIMIZER_UNSHARDED_PARAMS_GUARD_ENABLED"


@pytest.fixture
def applied(apply_patch):
    """The guard applied (by the .pth hook, or here), counting in a registry of the test's own."""
    return apply_patch(guard)


class FakeFSDPParam:
    """What the wrapper reads from an FSDPParam: ``_unsharded_param``, ``sharded_param``, names."""


def fake_fsdp_param(sharded, unsharded, fqn="head.weight"):
    fsdp_param = FakeFSDPParam()
    fsdp_param.sharded_param, fsdp_param._param_fqn = sharded, fqn
    fsdp_param._orig_size, fsdp_param._unsharded_param = torch.Size(unsharded.shape), unsharded
    return fsdp_param


def test_the_structural_check_finds_the_root_kept_unsharded():
    verdict = guard._structural_check()
    assert verdict.status == "needed", verdict
    assert "reshard_after_forward was not given" in verdict.reason  # 2.8+ (PyTorch PR 155319)


def test_a_torch_without_the_shape_is_unsupported(monkeypatch):
    fsdp_param = guard._compat.fsdp_class("_fsdp_param", "FSDPParam")
    monkeypatch.setattr(fsdp_param, "to_unsharded", lambda self: None)
    assert guard._structural_check().status == "unsupported"


def test_the_registry_records_each_parameter_once_and_forgets_dead_ones():
    sharded, unsharded = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.ones(4))
    fsdp_param = fake_fsdp_param(sharded, unsharded)
    guard.record(fsdp_param)
    entry = guard._unsharded[id(unsharded)]
    guard.record(fsdp_param)  # a later unshard reuses the parameter: nothing new
    assert guard._unsharded[id(unsharded)] is entry
    assert guard.owner_of(unsharded) is fsdp_param and guard.owner_of(sharded) is None
    key = id(unsharded)
    del fsdp_param._unsharded_param, unsharded
    gc.collect()
    assert key not in guard._unsharded
    guard.record(FakeFSDPParam())  # never unsharded: nothing to record
    assert guard.owner_of(sharded) is None


def test_the_hook_stops_an_optimizer_holding_unsharded_parameters(applied):
    sharded, unsharded = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.ones(4, 2))
    other = nn.Parameter(torch.ones(3))
    fsdp_param = fake_fsdp_param(sharded, unsharded)
    guard.record(fsdp_param)
    optimizer = torch.optim.SGD([other, unsharded], lr=0.1)
    assert guard._hook["handle"] is not None  # armed by the group that holds it (Optimizer.add_param_group)
    for _ in range(2):  # never marked checked: each step stops
        with pytest.raises(GuardError) as caught:
            optimizer.step()
        assert caught.value.patch == guard.NAME
    assert applied.snapshot()[guard.NAME].fired == 2
    message = str(caught.value)
    assert "SGD holds 1 FSDP2 unsharded parameter(s): head.weight [4, 2] (param_groups[0]['params'][1])" in message
    assert "call model.reshard()" in message and f"{TOGGLE}=0" in message
    assert not _isolation.has_failed(guard.NAME)


def test_a_right_optimizer_is_checked_once(applied, monkeypatch):
    sharded, unsharded = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.ones(4))
    guard.record(fake_fsdp_param(sharded, unsharded))
    optimizer = torch.optim.SGD([sharded], lr=0.1)
    calls = []
    monkeypatch.setattr(guard, "offenders", lambda opt: calls.append(opt) or [])
    for _ in range(3):
        optimizer.step()
    assert calls == [optimizer] and optimizer in guard._checked


def test_frozen_and_sharded_parameters_are_not_offenders():
    sharded, unsharded = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.ones(4), requires_grad=False)
    guard.record(fake_fsdp_param(sharded, unsharded))
    same = nn.Parameter(torch.ones(2))
    guard.record(fake_fsdp_param(same, same, fqn="same"))  # a parameter that is its own shard
    assert guard.offenders(torch.optim.SGD([sharded, unsharded, same], lr=0.1)) == []


def test_our_failure_in_the_hook_reaches_no_step(applied, monkeypatch):
    param, unsharded = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(1))
    guard.record(fake_fsdp_param(nn.Parameter(torch.zeros(1)), unsharded))

    def broken(optimizer):
        raise KeyError("ours")

    monkeypatch.setattr(guard, "offenders", broken)
    param.grad = torch.ones(2)
    torch.optim.SGD([param, unsharded], lr=0.5).step()  # no exception; torch's step ran
    assert torch.equal(param.detach(), torch.full((2,), 0.5))
    assert _isolation.has_failed(guard.NAME) and not guard.is_active()


def test_revert_all_leaves_no_active_check():
    """The global hook stays registered with torch (it is not a target), and does nothing."""
    was_applied = _patching.is_applied(guard.NAME)  # by the .pth hook: activated again afterwards
    _patching.apply(guard.PATCH)
    sharded, unsharded = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.ones(4))
    guard.record(fake_fsdp_param(sharded, unsharded))
    torch.optim.SGD([unsharded], lr=0.1)  # arms the hook
    assert guard.is_active()
    try:
        _activate.revert_all()
        assert not guard.is_active() and not _patching.is_applied(guard.NAME)
        # each of ours steps aside while Dynamo traces (_isolation.aside_while_compiling)
        hooks = [getattr(h, "__wrapped__", h) for h in torch_optimizer._global_optimizer_pre_hooks.values()]
        assert hooks.count(guard.check_before_step) == 1  # one hook for the process
        optimizer = torch.optim.SGD([unsharded], lr=0.1)
        optimizer.step()  # no error: the check is off
        assert optimizer not in guard._checked
        assert guard.check_before_step(optimizer, (), {}) is None
    finally:
        if was_applied:
            _activate.activate()


# --- FSDP2 on the fake backend ---------------------------------------------------------------------


@pytest.fixture
def fake_world(applied, fake_mesh):
    return fake_mesh


def sharded_model(mesh, **root_kwargs):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh, **root_kwargs)
    return model


def train_step(model, optimizer):
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_fsdp2_bug_case_stops_at_the_first_step(fake_world):
    model = sharded_model(fake_world)
    with torch.no_grad():
        model(torch.randn(2, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(GuardError, match=r"2\.weight \[4, 8\] \(param_groups\[0\]\['params'\]\[2\]\), 2\.bias \[4\]"):
        train_step(model, optimizer)


@pytest.mark.parametrize("order", ["optimizer_first", "reshard", "explicit_reshard"])
def test_fsdp2_right_orders_are_silent(fake_world, order):
    model = sharded_model(fake_world, **({"reshard_after_forward": True} if order == "explicit_reshard" else {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if order == "optimizer_first" else None
    with torch.no_grad():
        model(torch.randn(2, 8))
    if order == "reshard":
        model.reshard()
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        train_step(model, optimizer)
    assert optimizer in guard._checked


def test_no_step_hook_until_a_group_holds_an_unsharded_parameter(applied, monkeypatch):
    """[Note: a step hook only where needed]: on Python 3.13 any step pre-hook changes a compiled step."""
    monkeypatch.setattr(guard, "_hook", {"handle": None})
    sharded, unsharded = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.ones(4))
    fsdp_param = fake_fsdp_param(sharded, unsharded)
    guard.record(fsdp_param)
    optimizer = torch.optim.SGD([sharded], lr=0.1)
    guard._arm_if_held(optimizer, [{"params": [nn.Parameter(torch.ones(1))]}])
    assert guard._hook["handle"] is None
    guard._arm_if_held(optimizer, [{"params": [unsharded]}])
    assert guard._hook["handle"] is not None
    guard._hook["handle"].remove()
