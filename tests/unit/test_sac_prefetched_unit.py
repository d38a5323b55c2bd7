"""sac_prefetched_unit in one process: which hook calls run outside SAC, and the dispatch-mode stack.

The wrapper is driven with a stand-in for torch's hook that records the stack it ran under: SAC's
modes are gone inside, every other mode is there in its order, the stack is restored exactly
afterwards (also when torch's hook raises, and when our own code fails half-way); with no SAC mode
on the stack torch's function is called with the caller's arguments and the stack is not touched.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import expected as ex

pytest.importorskip("torch.distributed.fsdp")

from torch.utils import checkpoint as torch_checkpoint  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack  # noqa: E402

from fsdp_autopatch import _isolation  # noqa: E402
from fsdp_autopatch.patches import sac_prefetched_unit as patch  # noqa: E402

# On a release where tests/expected.py says the patch is unsupported (torch < 2.13), the shape these
# tests start from is not there: the patch leaves torch untouched, which test_patches_in_process checks.
SHAPED = pytest.mark.skipif(
    ex.expected_status(ex.release_of(torch.__version__)).get("sac_prefetched_unit") == "unsupported",
    reason="sac_prefetched_unit is unsupported on this torch (tests/expected.py)",
)


class Seen(TorchDispatchMode):
    """A plain user mode that records the ops it sees."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.ops: list[str] = []

    def __repr__(self) -> str:
        return self.name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def sac_modes():
    """(caching, cached): the two modes SAC pushes, as torch's own factory builds them."""
    return torch_checkpoint.create_selective_checkpoint_contexts(lambda ctx, func, *a, **k: False)


def stack() -> list[object]:
    return list(_get_current_dispatch_mode_stack())


@pytest.fixture
def fires(monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(patch._events, "fired", lambda name, without, where="": seen.append(where))
    return seen


def call_hook(hook, *args, **kwargs):
    """Run the pre-forward wrapper around ``hook`` (torch's function), as its guard would."""
    return _isolation.run_wrapper(patch._pre_forward_outside_sac, hook, SimpleNamespace(), args, kwargs)


def recording_hook(log: list):
    def hook(*args, **kwargs):
        log.append(stack())
        torch.ones(2).add(1)  # an op of "FSDP2's": who sees it?
        return ("torch's result", args, kwargs)

    return hook


@SHAPED
def test_the_structural_check_finds_indexed_sac_and_the_hooks():
    assert patch._structural_check().status == "needed"


def test_no_mode_on_the_stack_calls_torch_with_the_same_arguments(fires):
    log: list = []
    assert call_hook(recording_hook(log), 1, k=2) == ("torch's result", (1,), {"k": 2})
    assert log == [[]] and stack() == [] and fires == []


def test_only_other_modes_on_the_stack_are_left_alone(fires):
    log: list = []
    a, b = Seen("A"), Seen("B")
    with a, b:
        before = stack()
        call_hook(recording_hook(log))
        assert stack() == before
    assert log == [[a, b]] and fires == []
    assert "aten.add.Tensor" in a.ops and "aten.add.Tensor" in b.ops


def test_sac_modes_are_taken_off_and_every_other_mode_kept_in_order(fires):
    log: list = []
    a, b, c = Seen("A"), Seen("B"), Seen("C")
    caching, cached = sac_modes()
    with a, caching, b, cached, c:
        before = stack()
        assert call_hook(recording_hook(log))[0] == "torch's result"
        after = stack()
    assert before == [a, caching, b, cached, c]
    assert log == [[a, b, c]]
    assert after == before, "the stack is restored exactly"
    for mode in (a, b, c):
        assert "aten.add.Tensor" in mode.ops, mode
    assert fires == ["FSDPState._pre_forward ran outside SAC"]


def test_modes_below_the_lowest_sac_mode_are_not_touched(monkeypatch, fires):
    a = Seen("A")
    caching, _ = sac_modes()
    popped: list[object] = []
    real_pop = patch._dispatch_module()._pop_mode

    def pop(*args):
        mode = real_pop(*args)
        popped.append(mode)
        return mode

    monkeypatch.setattr(patch._dispatch_module(), "_pop_mode", pop)
    with a, caching:
        call_hook(recording_hook([]))
        assert popped == [caching]  # (the with-block's exit pops the rest)


def test_the_stack_is_restored_when_torchs_hook_raises(fires):
    a = Seen("A")
    caching, _ = sac_modes()

    def raising(*args, **kwargs):
        assert stack() == [a]
        raise RuntimeError("torch's own error")

    with a, caching:
        with pytest.raises(RuntimeError, match="torch's own error"):
            call_hook(raising)
        assert stack() == [a, caching]
    assert fires == []


def test_a_failure_while_taking_the_modes_off_puts_the_stack_back(monkeypatch):
    a = Seen("A")
    caching, cached = sac_modes()
    dispatch = patch._dispatch_module()
    real_push = dispatch._push_mode
    pushes = {"n": 0}

    def failing_push(mode):
        pushes["n"] += 1
        if pushes["n"] == 1:
            raise MemoryError("ours")
        real_push(mode)

    with caching, a, cached:
        before = stack()
        monkeypatch.setattr(dispatch, "_push_mode", failing_push)
        with pytest.raises(MemoryError):
            patch.OutsideSac().enter(patch._sac_mode_types())
        monkeypatch.setattr(dispatch, "_push_mode", real_push)
        assert stack() == before


def test_nested_sac_regions_and_a_mode_pushed_inside(fires):
    """Two SAC regions, one inside the other, with a mode pushed inside the inner one: the hook
    runs with neither region's modes; a bare pop of the top mode would have popped ``inner_mode``."""
    log: list = []
    outer_mode, inner_mode = Seen("outer"), Seen("inner")
    outer_caching, _ = sac_modes()
    inner_caching, _ = sac_modes()
    with outer_mode, outer_caching, inner_caching, inner_mode:
        call_hook(recording_hook(log))
        assert stack() == [outer_mode, outer_caching, inner_caching, inner_mode]
    assert log == [[outer_mode, inner_mode]]


def test_inside_a_real_sac_region_the_policy_never_sees_the_hooks_ops(fires):
    """A real checkpoint with a policy: the user's ops are policy-checked (and their recompute finds
    them), the hook's op is not; the gradient is that of the plain function."""
    decisions: list[str] = []

    def policy(ctx, func, *args, **kwargs):
        if not ctx.is_recompute:
            decisions.append(str(func))
        return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    def hook_op(*args, **kwargs):
        return torch.zeros(3).mul(2)  # aten.mul: the hook's own op

    def fn(x):
        call_hook(hook_op)
        return x.sin().cos()

    x = torch.randn(3, requires_grad=True)
    out = torch_checkpoint.checkpoint(
        fn, x, use_reentrant=False,
        context_fn=lambda: torch_checkpoint.create_selective_checkpoint_contexts(policy),
    )
    out.sum().backward()
    assert "aten.mul.Tensor" not in decisions and "aten.sin.default" in decisions
    torch.testing.assert_close(x.grad, -torch.sin(x.sin()) * torch.cos(x))
    assert len(fires) == 2  # the forward and the recompute


@SHAPED
def test_under_compile_the_wrappers_are_hidden_as_torch_hides_its_hooks(apply_patch):
    """Dynamo never traces them: torch.compile runs FSDP2's hooks eagerly, where the SAC modes are."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    from fsdp_autopatch import _hiding

    apply_patch(patch)
    for hook in ("_pre_forward", "_post_forward"):
        assert _hiding.hiding_of(vars(FSDPState)[hook]) is not None, hook


def test_post_forward_is_wrapped_the_same_way(fires):
    log: list = []
    caching, _ = sac_modes()
    with caching:
        _isolation.run_wrapper(patch._post_forward_outside_sac, recording_hook(log), SimpleNamespace(), (), {})
    assert log == [[]] and fires == ["FSDPState._post_forward ran outside SAC"]


# --- the structural check on other torches --------------------------------------------------------


def test_no_sac_classes_is_unsupported(monkeypatch):
    monkeypatch.setattr(patch, "_checkpoint_module", lambda: SimpleNamespace())
    assert patch._structural_check().status == "unsupported"


def test_fifo_replay_sac_is_unsupported(monkeypatch):
    """torch < 2.13: storage lists popped in order, no func_counter, no invocation index."""

    class Caching:
        def __init__(self, policy_fn, storage):
            self.policy_fn, self.storage = policy_fn, storage

    class Cached(Caching):
        def __init__(self, policy_fn, storage):
            self.policy_fn, self.storage = policy_fn, storage

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            raise RuntimeError(f"{func} encountered during backward, but not found in storage")

    fake = SimpleNamespace(_CachingTorchDispatchMode=Caching, _CachedTorchDispatchMode=Cached, SAC_IGNORED_OPS=set())
    monkeypatch.setattr(patch, "_checkpoint_module", lambda: fake)
    verdict = patch._structural_check()
    assert verdict.status == "unsupported" and "invocation index" in verdict.reason


def test_an_fsdp_state_without_the_hooks_is_unsupported(monkeypatch):
    class State:
        def init(self):
            pass

    monkeypatch.setattr(patch._compat, "fsdp_class", lambda module, name: State)
    assert patch._structural_check().status == "unsupported"


@SHAPED
def test_an_init_that_no_longer_registers_the_hooks_is_unsupported(monkeypatch):
    class State:
        def init(self):
            pass

        def _pre_forward(self, module, args, kwargs):
            return args, kwargs

        def _post_forward(self, module, input, output):
            return output

    monkeypatch.setattr(patch._compat, "fsdp_class", lambda module, name: State)
    verdict = patch._structural_check()
    assert verdict.status == "unsupported" and "init" in verdict.reason


@SHAPED
def test_torch_ignoring_the_profiler_ops_itself_is_unsupported(monkeypatch):
    """Part of upstream's fix (PyTorch PRs 185178 / 196862) in torch's own source."""
    source = "SAC_IGNORED_OPS = {\n    torch.ops.profiler._record_function_enter_new.default,\n}\n"
    monkeypatch.setattr(patch.inspect, "getsource", lambda module: source)
    verdict = patch._structural_check()
    assert verdict.status == "unsupported" and "upstream" in verdict.reason


@SHAPED
def test_a_framework_adding_the_profiler_ops_at_run_time_does_not_count(monkeypatch):
    """NeMo Automodel's ensure_fsdp_ops_sac_ignored adds them to the set: torch's source decides."""
    monkeypatch.setattr(
        torch_checkpoint, "SAC_IGNORED_OPS",
        set(torch_checkpoint.SAC_IGNORED_OPS) | {torch.ops.profiler._record_function_enter_new.default},
    )
    assert patch._structural_check().status == "needed"
