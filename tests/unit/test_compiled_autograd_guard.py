"""compiled_autograd_guard in one process: the structural check, when the check says "inside a
compiled-autograd graph" (never imports dynamo; a flag set by another thread does not count), the
wrapper's error, and the check inside a real compiled-autograd backward (a plain tensor hook)."""

from __future__ import annotations

import sys
import threading
import types

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.fsdp  # noqa: E402,F401,F811  (fires the post-import hook if the .pth is active)

from fsdp_autopatch import _isolation  # noqa: E402
from fsdp_autopatch._events import GuardError  # noqa: E402
from fsdp_autopatch.patches import compiled_autograd_guard as guard  # noqa: E402

pytestmark = pytest.mark.timeout(300)
TOGGLE = "FSDP_AUTOPATCH_COMPILED_AUTOGRAD_GUARD_ENABLED"


@pytest.fixture
def fake_ca(monkeypatch):
    """A stand-in for torch._dynamo.compiled_autograd in sys.modules, region flag off."""
    module = types.ModuleType(guard._CA)
    module.in_compiled_autograd_region = False
    monkeypatch.setitem(sys.modules, guard._CA, module)
    return module


def call_from_compiled_autograd(function):
    """``function()`` called from a frame whose module is compiled autograd's (the runtime wrapper)."""
    namespace = {"__name__": guard._CA, "function": function}
    exec("def runtime_wrapper():\n    return function()\n", namespace)
    return namespace["runtime_wrapper"]()


def test_the_structural_check_finds_no_compiled_autograd_path():
    verdict = guard._structural_check()
    common = sys.modules["torch.distributed.fsdp._fully_shard._fsdp_common"]
    if callable(getattr(common, "compiled_autograd_enabled", None)):  # 2.6 - 2.11: FSDP2's own path
        assert verdict.status == "not_needed" and "its own compiled-autograd path" in verdict.reason, verdict
        return
    assert verdict.status == "needed", verdict
    assert "no compiled-autograd path" in verdict.reason


def test_an_fsdp2_with_its_own_compiled_autograd_path_is_not_needed_and_its_path_left_alone(monkeypatch):
    """2.6 - 2.11: around a plain backward torch's own path raises (measured 2.8), nothing silent."""
    common = sys.modules["torch.distributed.fsdp._fully_shard._fsdp_common"]
    chosen = {"own path": False}
    monkeypatch.setattr(common, "compiled_autograd_enabled", lambda: chosen["own path"], raising=False)
    verdict = guard._structural_check()
    assert verdict.status == "not_needed" and "its own compiled-autograd path" in verdict.reason, verdict
    assert not guard._fsdp2_took_its_own_path()
    chosen["own path"] = True
    assert guard._fsdp2_took_its_own_path()


def test_an_fsdp2_that_reads_compiled_autograd_otherwise_is_left_alone(monkeypatch):
    common = sys.modules["torch.distributed.fsdp._fully_shard._fsdp_common"]
    monkeypatch.setattr(common, "traceable_compiled_autograd_hooks", True, raising=False)
    verdict = guard._structural_check()
    assert verdict.status == "unsupported" and "traceable_compiled_autograd_hooks" in verdict.reason


def test_outside_compiled_autograd_the_check_is_silent(fake_ca, monkeypatch):
    assert not guard.in_compiled_autograd_graph()  # flag off
    assert not call_from_compiled_autograd(guard.in_compiled_autograd_graph)
    monkeypatch.delitem(sys.modules, guard._CA)
    assert not guard.in_compiled_autograd_graph()  # dynamo never loaded: nothing imported
    assert guard._CA not in sys.modules


def test_inside_the_runtime_wrapper_the_check_fires(fake_ca):
    fake_ca.in_compiled_autograd_region = True
    assert call_from_compiled_autograd(guard.in_compiled_autograd_graph)
    assert call_from_compiled_autograd(lambda: [guard.in_compiled_autograd_graph()][0])  # deeper


def test_the_flag_set_by_another_thread_does_not_count(fake_ca):
    """A threaded process group: one thread's compiled-autograd region is visible to all."""
    inside, release, seen = threading.Event(), threading.Event(), {}

    def other_rank():
        def in_region():
            fake_ca.in_compiled_autograd_region = True
            seen["other"] = guard.in_compiled_autograd_graph()
            inside.set()
            release.wait(30)
            fake_ca.in_compiled_autograd_region = False

        call_from_compiled_autograd(in_region)

    thread = threading.Thread(target=other_rank)
    thread.start()
    try:
        assert inside.wait(30)
        assert fake_ca.in_compiled_autograd_region
        seen["this"] = guard.in_compiled_autograd_graph()
    finally:
        release.set()
        thread.join(30)
    assert seen == {"other": True, "this": False}


def test_the_wrapper_raises_the_guard_error_and_counts_a_fire(fake_ca, registry, monkeypatch):
    ran = []
    hook = lambda grad: ran.append(grad) or grad  # noqa: E731
    assert _isolation.run_wrapper(guard._stop_under_compiled_autograd, hook, None, (1,), {}) == 1
    assert ran == [1] and registry.snapshot()[guard.NAME].fired == 0
    fake_ca.in_compiled_autograd_region = True
    with pytest.raises(GuardError) as raised:
        call_from_compiled_autograd(
            lambda: _isolation.run_wrapper(guard._stop_under_compiled_autograd, hook, None, (2,), {})
        )
    assert ran == [1], "torch's hook must not run once the guard stopped the backward"
    common = sys.modules["torch.distributed.fsdp._fully_shard._fsdp_common"]
    monkeypatch.setattr(common, "compiled_autograd_enabled", lambda: True, raising=False)
    assert call_from_compiled_autograd(  # an FSDP2 that took its own compiled-autograd path: torch's
        lambda: _isolation.run_wrapper(guard._stop_under_compiled_autograd, hook, None, (3,), {})
    ) == 3
    assert ran == [1, 3]
    error = raised.value
    assert error.patch == guard.NAME and f"{TOGGLE}=0" in str(error)
    assert str(error).startswith(f"fsdp-autopatch guard {guard.NAME}: backward() runs FSDP2's hooks")
    assert "Run backward without compiled autograd" in str(error)
    assert registry.snapshot()[guard.NAME].fired == 1


def test_the_check_inside_a_real_compiled_autograd_backward():
    """A tensor hook in a compiled-autograd graph is reached while Dynamo traces it, then eagerly:
    the check says True there (the stack walk leaves the graph for Python), False in eager."""
    try:
        torch.compile(lambda t: t + 1, backend="eager")(torch.ones(1))
        from torch._dynamo import compiled_autograd
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"torch.compile is unavailable here: {type(error).__name__}: {error}")
    seen = []

    def hook(grad):
        seen.append(guard.in_compiled_autograd_graph())
        return grad

    def backward():
        x = torch.ones(3, requires_grad=True)
        y = x * 2
        y.register_hook(hook)
        y.sum().backward()
        return x.grad

    assert torch.equal(backward(), torch.full((3,), 2.0)) and seen == [False]
    seen.clear()
    with compiled_autograd._enable(torch.compile(backend="eager")):
        grad = backward()
    assert torch.equal(grad, torch.full((3,), 2.0))
    assert seen and all(seen), seen
    assert not guard.in_compiled_autograd_graph()  # the region is over
