"""Wrap.dynamo: a wrapper of a function torch hides from Dynamo is hidden the same way
([Note: hidden as torch hides] in fsdp_autopatch._hiding); elsewhere it steps aside while Dynamo
traces, unless declared TRACED. The 2-rank compile suite (tests/distributed/test_dist_compile.py)
shows the same on FSDP2 itself; these are the mechanism's cases on one process."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

from fsdp_autopatch import _hiding, _patching
from fsdp_autopatch._isolation import aside_while_compiling
from fsdp_autopatch._spec import AS_TORCH, TRACED, Patch, Wrap, needed

FSDP2 = "torch.distributed.fsdp._fully_shard"


def _dynamo_disable(func):
    """torch 2.13's _fsdp_common._dynamo_disable, as the stand-in torch hides a hook with."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return torch._dynamo.disable(func, recursive=True)(*args, **kwargs)

    return wrapper


def disable_if_config_true(func):
    """torch 2.8's: hidden only while torch._dynamo.config.skip_fsdp_hooks."""

    @functools.wraps(func)
    def fsdp_hook_wrapper(*args, **kwargs):
        if torch._dynamo.config.skip_fsdp_hooks:
            return torch._dynamo.disable(func, recursive=True)(*args, **kwargs)
        return func(*args, **kwargs)

    return fsdp_hook_wrapper


class State:
    """A stand-in for FSDPState: a hidden forward pre-hook that counts its calls."""

    calls = 0

    @_dynamo_disable
    def _pre_forward(self, module, args):
        State.calls += 1
        return None

    def plain(self, x):
        return x + 1


def test_torch_hooks_are_recognised_as_hidden():
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group, _fsdp_state

    for owner, name in ((_fsdp_state.FSDPState, "_pre_forward"), (_fsdp_state.FSDPState, "_post_forward"),
                        (_fsdp_param_group.FSDPParamGroup, "post_backward")):
        assert _hiding.hiding_of(vars(owner)[name]) is not None, (owner, name)  # torch's, or ours over it
    assert _hiding.hiding_of(vars(_fsdp_param.FSDPParam)["init_unsharded_param"]) is None
    assert _hiding.hiding_of(nn.Module.zero_grad) is None
    assert _hiding.hiding_of(_dynamo_disable(lambda: None)) == _hiding.ALWAYS
    assert _hiding.hiding_of(disable_if_config_true(lambda: None)) == _hiding.WHILE_SKIPPING_FSDP_HOOKS


def _calls(log):
    def wrapper(wrapped, instance, args, kwargs):
        log.append((type(instance).__name__, getattr(wrapped, "__name__", None)))
        return wrapped(*args, **kwargs)
    return wrapper


def _apply(name, target_name, wrapper, **wrap_options):
    patch = Patch(name=name, summary="", symptom="", trigger="", upstream=(), affected=">=0",
                  check=lambda: needed(""), targets=(Wrap(f"{__name__}:State.{target_name}", wrapper, **wrap_options),),
                  changes="")
    assert _patching.contract_problem(patch) is None
    _patching.apply(patch)
    return patch


@pytest.fixture
def patched_state():
    original = vars(State)["_pre_forward"]
    yield original
    for name in ("test_outer", "test_inner"):
        _patching.revert(name)
    assert vars(State)["_pre_forward"] is original


def test_hidden_replacement_is_torch_wrapper_with_ours_inside(patched_state):
    log = []
    _apply("test_inner", "_pre_forward", _calls(log))
    _apply("test_outer", "_pre_forward", _calls(log))
    replacement = vars(State)["_pre_forward"]
    assert replacement.__code__ is patched_state.__code__  # torch's own hiding code
    assert replacement.__wrapped__ is not None and _hiding.hiding_of(replacement) == _hiding.ALWAYS
    State.calls = 0
    State()._pre_forward(nn.Identity(), ())
    # both patches ran (outer first), each with the instance; torch's function ran once, itself
    assert log == [("State", "_pre_forward"), ("State", "_pre_forward")] and State.calls == 1


def _graph_breaks(module: nn.Module) -> tuple[int, int]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(module, backend="eager")
    for _ in range(3):
        compiled(torch.ones(2, 2))
    return sum(counters["graph_break"].values()), counters["stats"].get("unique_graphs", 0)


def _hooked_model(state: State) -> nn.Module:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    for layer in (model, model[0], model[2]):
        layer.register_forward_pre_hook(state._pre_forward)
    return model


def test_compiled_model_meets_the_same_breaks_with_and_without_the_wrapper(patched_state):
    State.calls = 0
    without = _graph_breaks(_hooked_model(State()))
    torch_calls = State.calls
    log = []
    _apply("test_inner", "_pre_forward", _calls(log))
    State.calls = 0
    with_ours = _graph_breaks(_hooked_model(State()))
    assert with_ours == without
    assert State.calls == torch_calls and len(log) == torch_calls  # ours ran, eagerly, at every hook call


def test_not_hidden_target_steps_aside_while_dynamo_traces():
    log = []
    _apply("test_inner", "plain", _calls(log), proxy=False)
    try:
        state = State()
        out = torch.compile(lambda x: state.plain(x) * 2, backend="eager", fullgraph=True)(torch.ones(1))
        assert torch.equal(out, torch.full((1,), 4.0)) and log == []  # traced torch's, not ours
        state.plain(torch.ones(1))
        assert len(log) == 1  # eager: ours
    finally:
        _patching.revert("test_inner")


def test_traced_target_is_traced():
    log = []
    _apply("test_inner", "plain", _calls(log), proxy=False, dynamo=TRACED)
    try:
        state = State()
        torch.compile(lambda x: state.plain(x), backend="eager", fullgraph=True)(torch.ones(1))
        assert len(log) == 1  # ours ran while Dynamo traced (once, at trace time)
    finally:
        _patching.revert("test_inner")


@pytest.mark.parametrize("target, options, problem", [
    ("plain", {"dynamo": TRACED}, "wrapt proxy"),
    ("_pre_forward", {"dynamo": TRACED, "proxy": False}, "torch hides it from Dynamo"),
    ("plain", {"dynamo": "sometimes"}, "neither AS_TORCH nor TRACED"),
])
def test_contract_refuses_what_dynamo_cannot_do(target, options, problem):
    patch = Patch(name="test_contract", summary="", symptom="", trigger="", upstream=(), affected=">=0",
                  check=lambda: needed(""), targets=(Wrap(f"{__name__}:State.{target}", _calls([]), **options),),
                  changes="")
    assert problem in (_patching.contract_problem(patch) or "")
    assert Wrap("x:y", _calls([])).dynamo == AS_TORCH


def test_a_fire_while_dynamo_traces_is_no_graph_break():
    from torch._dynamo.utils import counters

    from fsdp_autopatch import _events
    from fsdp_autopatch._isolation import NO_BINDER, isolate

    isolate("test_inner", _calls([]), NO_BINDER, "keep torch's result")  # an applied patch sets the check
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(lambda x: (_events.fired("test_inner", "nothing", "here"), x + 1)[1], backend="eager",
                        fullgraph=True)(torch.ones(1))
    assert torch.equal(out, torch.full((1,), 2.0)) and sum(counters["graph_break"].values()) == 0


def test_step_hook_steps_aside_while_dynamo_traces():
    from torch._dynamo.utils import counters

    seen = []
    hook = aside_while_compiling(lambda *args: seen.append(args))
    torch._dynamo.reset()
    counters.clear()
    torch.compile(lambda x: (hook(x), x + 1)[1], backend="eager", fullgraph=True)(torch.ones(1))
    assert seen == [] and sum(counters["graph_break"].values()) == 0
    hook(1)
    assert seen == [(1,)]


def _train_step_counters() -> tuple[int, int, list]:
    """A compiled train step that calls both zero_grads (what the pending-gradients policies wrap)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        model.zero_grad()
        optimizer.zero_grad()
        return model(x).sum()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="eager")
    losses = [compiled(torch.ones(1, 3)).item() for _ in range(2)]
    return sum(counters["graph_break"].values()), counters["stats"].get("unique_graphs", 0), losses


def test_compiled_zero_grad_meets_the_same_graph_with_the_policies_wrappers():
    from fsdp_autopatch import _patching
    from fsdp_autopatch.patches import pending_grads_warning

    applied = _patching.is_applied(pending_grads_warning.NAME)
    if applied:  # by the .pth hook: measured without it, then put back as it was
        _patching.revert(pending_grads_warning.NAME)
    try:
        without = _train_step_counters()
        _patching.apply(pending_grads_warning.PATCH)
        assert _hiding.hiding_of(vars(torch.optim.Optimizer)["zero_grad"]) is not None  # hidden as torch's
        assert type(vars(nn.Module)["zero_grad"]) is type(_train_step_counters)  # a plain function Dynamo traces
        assert _train_step_counters() == without
    finally:
        if not applied:
            _patching.revert(pending_grads_warning.NAME)


def _clip_counters() -> tuple[int, int, float]:
    """A compiled function that clips plain gradients (what the two clip fixes wrap, TRACED)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    model(torch.ones(2, 4)).sum().backward()
    torch._dynamo.reset()
    counters.clear()
    total = torch.compile(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5), backend="eager")()
    return sum(counters["graph_break"].values()), counters["stats"].get("unique_graphs", 0), float(total)


def test_compiled_clip_meets_the_same_graph_with_the_clip_fixes():
    from fsdp_autopatch.patches import clip_grad_norm_cpu_offload, clip_grad_norm_multi_mesh

    patches = (clip_grad_norm_cpu_offload, clip_grad_norm_multi_mesh)  # applied in this order
    applied = [module for module in patches if _patching.is_applied(module.PATCH.name)]
    for module in reversed(applied):  # by the .pth hook: measured without them, then put back as they were
        _patching.revert(module.PATCH.name)
    try:
        without = _clip_counters()
        for module in patches:
            if _patching.contract_problem(module.PATCH) is None:
                _patching.apply(module.PATCH)
        assert any(_patching.is_applied(module.PATCH.name) for module in patches)
        assert _clip_counters() == without
    finally:
        for module in reversed(patches):
            if module not in applied:
                _patching.revert(module.PATCH.name)


class DisabledState:
    """A stand-in for a torch that decorates its hook with torch._dynamo.disable itself."""

    calls = 0

    @torch._dynamo.disable(recursive=True)
    def _pre_forward(self, module, args):
        DisabledState.calls += 1
        return None


def test_a_hook_decorated_with_dynamo_disable_itself_is_hidden_the_same_way():
    state = DisabledState()
    assert _hiding.hiding_of(vars(DisabledState)["_pre_forward"]) == _hiding.DISABLED

    def model_of(state):
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        for layer in (model, model[0], model[2]):
            layer.register_forward_pre_hook(state._pre_forward)
        return model

    DisabledState.calls = 0
    without = _graph_breaks(model_of(state))
    torch_calls = DisabledState.calls
    log = []
    patches = []
    for name in ("test_inner", "test_outer"):
        patch = Patch(name=name, summary="", symptom="", trigger="", upstream=(), affected=">=0",
                      check=lambda: needed(""), changes="",
                      targets=(Wrap(f"{__name__}:DisabledState._pre_forward", _calls(log)),))
        _patching.apply(patch)
        patches.append(name)
    try:
        replacement = vars(DisabledState)["_pre_forward"]
        assert replacement._torchdynamo_orig_callable is _hiding.unhidden(replacement)  # ours, not torch's
        DisabledState.calls = 0
        assert _graph_breaks(model_of(DisabledState())) == without
        assert DisabledState.calls == torch_calls and len(log) == 2 * torch_calls  # both ran, eagerly
    finally:
        for name in reversed(patches):
            _patching.revert(name)


def test_the_view_base_hook_is_hidden_as_torch_hooks_are():
    """inplace_view_output's autograd hook runs where backward() runs, inside a compiled function too:
    hidden, it is not compiled as a frame of its own (measured: one compilation and 4 frames more
    than torch alone in a compiled train step whose model returns a view)."""
    from types import SimpleNamespace

    from fsdp_autopatch.patches import inplace_view_output

    hook = inplace_view_output._base_hook(SimpleNamespace())
    assert getattr(hook, "_torchdynamo_disable", False) is True
