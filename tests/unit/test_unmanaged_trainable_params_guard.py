"""unmanaged_trainable_params_guard in one process: the structural check, the fingerprints, which
parameters count as unmanaged, and FSDP2 on the fake backend (4 fake ranks), where the guard must
stay silent: the fake backend's collectives return no peer's data to compare.

The stop itself, and what it lets through (parameters kept in sync by hand), need real ranks:
``test_dist_cases.py`` (the case) and ``test_dist_unmanaged_trainable_params_guard.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import torch.distributed.fsdp  # noqa: E402,F401  (fires the post-import hook if the .pth is active)

from fsdp_autopatch import _isolation  # noqa: E402
from fsdp_autopatch.patches import unmanaged_trainable_params_guard as guard  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def applied(apply_patch):
    """The guard applied (by the .pth hook, or here), counting in a registry of the test's own."""
    return apply_patch(guard)


def test_the_structural_check_finds_what_the_guard_reads():
    verdict = guard._structural_check()
    assert verdict.status == "needed", verdict
    assert "manages only the parameters present when it runs" in verdict.reason


def test_fingerprints_see_the_weight_and_the_gradient_and_the_order():
    a, b = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.full((3,), 2.0))
    a.grad = torch.full((2, 2), 0.5)
    rows = guard.fingerprints([("a", a), ("b", b)])
    assert rows.dtype == torch.float64 and rows.tolist() == [[4.0, 4.0, 2.0, 1.0], [6.0, 12.0, 0.0, 0.0]]
    swapped = guard.digest(guard.fingerprints([("b", b), ("a", a)]))
    assert guard.digest(rows)[0] == 2 and not torch.equal(guard.digest(rows), swapped)
    b.grad = torch.ones(3) * 1e-3  # a gradient alone changes the digest
    assert not torch.equal(guard.digest(rows), guard.digest(guard.fingerprints([("a", a), ("b", b)])))


# --- FSDP2 on the fake backend ---------------------------------------------------------------------


@pytest.fixture
def fake_world(applied, fake_mesh):
    return fake_mesh


def _model_with_adapter(mesh):
    from torch.distributed.fsdp import fully_shard

    from fsdp_autopatch.cases import unmanaged_trainable_params_guard as case

    model = case._model()
    fully_shard(model.inp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    case._add_adapter(model)  # after fully_shard: unmanaged
    return model


def _step(model, optimizer):
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_only_trainable_parameters_fsdp2_does_not_manage_are_found(fake_world):
    model = _model_with_adapter(fake_world)
    _step(model, torch.optim.SGD(model.parameters(), lr=0.1))  # the root's lazy init: recorded
    state, found = guard.unmanaged_in(torch.optim.SGD(model.parameters(), lr=0.1))
    assert state is not None and [name for name, _ in found] == ["adapter.weight"]
    model.adapter.weight.requires_grad_(False)
    assert guard.unmanaged_in(torch.optim.SGD(model.parameters(), lr=0.1))[1] == []
    other = nn.Linear(2, 2)  # an optimizer of no FSDP2 root
    assert guard.unmanaged_in(torch.optim.SGD(other.parameters(), lr=0.1)) == (None, [])


def test_the_fake_backend_is_not_compared_and_nothing_is_recorded_as_failed(fake_world, applied):
    model = _model_with_adapter(fake_world)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        _step(model, optimizer)
    assert optimizer in guard._checked
    assert applied.snapshot()[guard.NAME].fired == 0 and not _isolation.has_failed(guard.NAME)


def test_no_step_hook_until_a_root_and_a_plain_trainable_parameter(fake_world, applied, monkeypatch):
    """[Note: a step hook only where needed]: every parameter a DTensor (FSDP2's), or no root: none."""
    monkeypatch.setattr(guard, "_hook", {"handle": None, "plain_trainable": False})
    monkeypatch.setattr(guard, "_roots", [])
    model = _model_with_adapter(fake_world)
    model.adapter.weight.requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    _step(model, optimizer)  # the root recorded; every trainable parameter a DTensor
    assert guard._roots and guard._hook["handle"] is None
    plain = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)  # a plain trainable one: now both seen
    guard._note_plain_trainable(plain, plain.param_groups)
    assert guard._hook["handle"] is not None
    guard._hook["handle"].remove()
