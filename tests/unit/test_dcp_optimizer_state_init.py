"""dcp_optimizer_state_init in one process: which optimizers it fills, what, and what it leaves to torch.

DCP's ``get_state_dict`` works on a plain module without a process group, so the wrapped
``_init_optim_state`` is exercised through it here; torch's own function is ``__wrapped__``. The
2-rank FSDP2 save / fresh-process load is ``tests/distributed/test_dist_dcp_optimizer_state_init.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint.state_dict as dcp_sd  # noqa: E402  (the module the fix waits for)
from torch import nn  # noqa: E402

import fsdp_autopatch  # noqa: E402
from fsdp_autopatch.patches import dcp_optimizer_state_init as fix  # noqa: E402

pytestmark = pytest.mark.skipif(
    fsdp_autopatch.status()["dcp_optimizer_state_init"].status.value != "applied",
    reason="dcp_optimizer_state_init is not applied on this torch",
)

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.1),
    "adamw_amsgrad_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.1, amsgrad=True, foreach=True),
    "adam_single_tensor": lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=False),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
    "sgd_momentum_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "sgd_plain": lambda ps: torch.optim.SGD(ps, lr=0.1),
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)  # never in the forward: never a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _train_step(model: nn.Module, optim: torch.optim.Optimizer, seed: int, spare_too: bool = False) -> None:
    torch.manual_seed(seed)
    x = torch.randn(3, 4)
    loss = model(x).square().mean() + (model.spare(x).square().mean() if spare_too else 0)
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _state(optim: torch.optim.Optimizer) -> dict:
    return {name: {k: v.clone() for k, v in optim.state[p].items()} for name, p in _named(optim)}


def _named(optim: torch.optim.Optimizer):
    names = {p: n for n, p in optim._fsdp_test_model.named_parameters()}
    return [(names[p], p) for g in optim.param_groups for p in g["params"]]


def _make(kind: str):
    model = Net()
    optim = OPTIMIZERS[kind](list(model.parameters()))
    optim._fsdp_test_model = model
    return model, optim


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) and a[n][k].dtype == b[n][k].dtype
                                           for k in a[n]) for n in a
    )


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_a_step_0_template_is_the_lazy_state_and_moves_nothing(kind):
    """Before the first step: the fix creates the lazy state (Adam's step 0), no step hook runs, no
    weight moves, and training after it is bitwise training without it."""
    model, optim = _make(kind)
    twin, twin_optim = _make(kind)
    hooks = []
    optim.register_step_pre_hook(lambda *a: hooks.append(1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    dcp_sd.get_state_dict(model, optim)
    assert hooks == []
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    if kind != "sgd_plain":
        assert all(len(optim.state[p]) for p in model.parameters())
    if "adam" in kind:
        assert {float(optim.state[p]["step"]) for p in model.parameters()} == {0.0}
    for seed in (1, 2):
        _train_step(model, optim, seed, spare_too=True)
        _train_step(twin, twin_optim, seed, spare_too=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert _equal(_state(optim), _state(twin_optim))


def test_torch_alone_records_the_dummy_step():
    """The bug, for the record: torch's function gives AdamW step 1 and moves the next update."""
    model, optim = _make("adamw")
    twin, twin_optim = _make("adamw")
    dcp_sd._init_optim_state.__wrapped__(optim)
    assert {float(optim.state[p]["step"]) for p in model.parameters()} == {1.0}
    _train_step(model, optim, 1, spare_too=True)
    _train_step(twin, twin_optim, 1, spare_too=True)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


@pytest.mark.parametrize("kind", ["adamw", "sgd_momentum_wd"])
def test_a_parameter_without_state_gets_an_entry_the_fresh_template_expects(kind):
    """After training with a never-used parameter, the save has its entry, exactly the keys a fresh
    optimizer's template has; torch's function alone leaves it out (the resume's missing key)."""
    model, optim = _make(kind)
    _train_step(model, optim, 1)
    assert all(len(optim.state[p]) == 0 for p in model.spare.parameters())
    missing = [n for n, p in model.named_parameters() if len(optim.state.get(p, ())) == 0]
    assert missing == ["spare.weight", "spare.bias"]
    _, saved = dcp_sd.get_state_dict(model, optim)
    fresh_model, fresh_optim = _make(kind)
    _, template = dcp_sd.get_state_dict(fresh_model, fresh_optim)
    assert sorted(saved["state"]) == sorted(template["state"]) == sorted(n for n, _ in model.named_parameters())
    assert {k: sorted(v) for k, v in saved["state"].items()} == {k: sorted(v) for k, v in template["state"].items()}
    # ...and the spare's first real step equals its lazy initialisation's
    twin, twin_optim = _make(kind)
    _train_step(twin, twin_optim, 1)
    _train_step(model, optim, 2, spare_too=True)
    _train_step(twin, twin_optim, 2, spare_too=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert _equal(_state(optim), _state(twin_optim))


def test_other_optimizers_and_dampening_are_left_to_torch():
    for make in (lambda ps: torch.optim.RMSprop(ps, lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9,
                                                                                       dampening=0.5)):
        model = Net()
        optim = make(list(model.parameters()))
        hooks: list[int] = []
        optim.register_step_pre_hook(lambda *a, seen=hooks: seen.append(1))
        dcp_sd.get_state_dict(model, optim)
        assert hooks == [1]  # torch's dummy step ran


def test_an_optimizer_left_to_torch_is_said_once_where_logging_is_on(caplog):
    class MyAdamW(torch.optim.AdamW):  # a subclass: its step may differ, so it is torch's
        pass

    model = Net()
    optim = MyAdamW(list(model.parameters()), lr=0.1)
    with caplog.at_level("INFO", logger="fsdp_autopatch"):
        dcp_sd.get_state_dict(model, optim)
        dcp_sd.get_state_dict(model, MyAdamW(list(model.parameters()), lr=0.1))
    notes = [r.getMessage() for r in caplog.records if "left to torch" in r.getMessage()]
    assert len(notes) == 1 and "MyAdamW is not exactly torch.optim.Adam" in notes[0], notes


def test_a_parameter_without_state_that_has_a_gradient_is_left_to_torch():
    model, optim = _make("adamw")
    model(torch.randn(2, 4)).sum().backward()  # mid-accumulation, before the first step
    dcp_sd.get_state_dict(model, optim)
    assert len(optim.state) == 0  # torch returns early: nothing filled, nothing stepped


def test_a_failing_fill_removes_what_it_created(monkeypatch):
    """All or nothing: our fill raises halfway and the state it created is removed, so that torch's
    function, which call-time isolation runs in its place, finds the optimizer as it was."""
    model, optim = _make("sgd_momentum_wd")
    calls = []

    def fail_after_one(optim_, group, params, torch_):
        optim_.state[params[0]]["momentum_buffer"] = torch_.zeros_like(params[0])
        calls.append(1)
        raise RuntimeError("injected by the test")

    monkeypatch.setattr(fix, "_init_sgd_group", fail_after_one)
    with pytest.raises(RuntimeError, match="injected"):
        fix._fill(optim, fix._stateless(optim), torch)
    assert calls == [1] and len(optim.state) == 0


def test_the_structural_check_reads_the_dummy_step(monkeypatch):
    assert fix._structural_check().status == "needed"

    def without_dummy_step(optim):
        if optim.state:
            return

    monkeypatch.setattr(dcp_sd, "_init_optim_state", without_dummy_step)
    verdict = fix._structural_check()
    assert (verdict.status, verdict.conclusive) == ("not_needed", True)
