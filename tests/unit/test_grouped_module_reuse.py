"""grouped_module_reuse: the structural check on stand-in shapes, and its helpers (no process group)."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
fsdp_state = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_state")

import expected  # noqa: E402
from fsdp_autopatch import _compat, _isolation  # noqa: E402
from fsdp_autopatch.patches import grouped_module_reuse as reuse  # noqa: E402

RELEASE = expected.release_of(torch.__version__)
STATUS_HERE = expected.expected_status(RELEASE)["grouped_module_reuse"]  # NOT_MEASURED on 2.16+
NEEDED_HERE = STATUS_HERE == "applied"
HAS_FORCE_COMPLETE = hasattr(fsdp_state.FSDPState, "_force_complete_incomplete_states")


def test_verdict_on_this_torch_matches_the_expectations():
    if STATUS_HERE == expected.NOT_MEASURED:
        pytest.skip(f"torch {torch.__version__}: {expected.NOT_MEASURED} (tests/expected.py)")
    verdict = reuse._structural_check()
    assert verdict.status == ("needed" if NEEDED_HERE else "not_needed"), verdict
    assert verdict.conclusive is (not NEEDED_HERE)  # no force-complete: nothing to act on, any release


def _group_hooks_casting_only(modules, pre_hook, post_hook, modules_to_run, cast_output_dtype):
    """A stand-in ``_register_group_forward_hooks`` with torch's shape: the partial path casts only."""

    def get_wrapped_post_hook(module):
        def wrapped_post_hook(hook_module, input, output):
            if module in modules_to_run:
                modules_to_run.remove(module)
                if len(modules_to_run) == 0:
                    return post_hook(hook_module, input, output)
            return cast_output_dtype(output)

        return wrapped_post_hook

    return get_wrapped_post_hook


def _group_hooks_hooking_partial_outputs(modules, pre_hook, post_hook, modules_to_run, cast_output_dtype):
    """The same, with a partial path that also hooks its output (a torch that fixed the bug)."""

    def get_wrapped_post_hook(module):
        def wrapped_post_hook(hook_module, input, output):
            if module in modules_to_run:
                modules_to_run.remove(module)
                if len(modules_to_run) == 0:
                    return post_hook(hook_module, input, output)
            return cast_output_dtype(register_pre_backward_hook(output))  # noqa: F821 - never run

        return wrapped_post_hook

    return get_wrapped_post_hook


@pytest.mark.skipif(not HAS_FORCE_COMPLETE, reason="this torch has no force-complete: not_needed before any shape")
@pytest.mark.parametrize(
    "group_hooks,status", [(_group_hooks_casting_only, "needed"), (_group_hooks_hooking_partial_outputs, "not_needed")]
)
def test_partial_path_decides(monkeypatch, group_hooks, status):
    monkeypatch.setattr(fsdp_state, "_register_group_forward_hooks", group_hooks)
    assert reuse._structural_check().status == status


@pytest.mark.skipif(not HAS_FORCE_COMPLETE, reason="this torch has no force-complete: not_needed before any shape")
def test_other_group_hook_parameters_are_unsupported(monkeypatch):
    def _register_group_forward_hooks(modules, pre_hook, post_hook, modules_to_run):  # 2.8 - 2.12's shape
        return None

    monkeypatch.setattr(fsdp_state, "_register_group_forward_hooks", _register_group_forward_hooks)
    assert reuse._structural_check().status == "unsupported"


def test_no_force_complete_is_conclusively_not_needed(monkeypatch):
    monkeypatch.delattr(fsdp_state.FSDPState, "_force_complete_incomplete_states", raising=False)
    verdict = reuse._structural_check()
    assert (verdict.status, verdict.conclusive) == ("not_needed", True)


def test_nested_code_finds_a_closure_at_any_depth():
    def outer():
        def middle():
            def inner():
                return 1

            return inner

        return middle

    assert _compat.nested_code(outer, "inner").co_name == "inner"
    assert _compat.nested_code(outer, "absent") is None
    assert _compat.nested_code(len, "inner") is None  # a builtin has no code object


class _State:
    """What the patch reads of an FSDPState (weakly referenced, like torch's)."""

    def __init__(self, root=None):
        self._state_ctx = SimpleNamespace(iter_forward_root=root)


def _state(root=None):
    return _State(root)


def _output():
    return torch.ones(2, requires_grad=True) * 2


@pytest.fixture
def records():
    yield reuse._remembered
    reuse._remembered.clear()


def test_remembers_only_inside_another_states_root_forward(records):
    outside = _state(root=None)  # chunked loss after the root's forward: no root
    reuse._remember(outside, _output())
    own_root = _state()
    own_root._state_ctx.iter_forward_root = own_root  # the call claimed the root itself
    reuse._remember(own_root, _output())
    assert len(records) == 0
    inside = _state(root=object())
    out = _output()
    reuse._remember(inside, {"logits": out, "plain": torch.ones(2)})
    assert records[inside] == [out.grad_fn]


def test_nothing_is_remembered_without_grad(records):
    inside = _state(root=object())
    with torch.no_grad():
        reuse._remember(inside, torch.ones(2) * 2)
    reuse._remember(inside, torch.ones(2))  # no autograd node
    assert len(records) == 0


def test_group_hooks_pass_through_without_a_bound_state():
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(args)
        return "handle"

    hooks = ((), print, lambda *args: None, set(), str)  # no bound post_hook: not FSDPState.init's
    def torch_signature(modules, pre_hook, post_hook, modules_to_run, cast_output_dtype):
        raise AssertionError("only its signature is read")

    handle = _isolation.run_wrapper(
        reuse._hook_partial_outputs_through("cast_output_dtype"), wrapped, None, hooks, {},
        (*reuse._HOOKS, "cast_output_dtype"), signature_of=torch_signature
    )
    assert handle == "handle"
    assert calls == [hooks]


def test_force_complete_fast_path_when_nothing_is_remembered(records):
    def wrapped(output):
        return output

    root = SimpleNamespace(_state_ctx=None)  # never read on the fast path
    out = _output()
    assert reuse._hook_remembered_outputs(wrapped, root, (out,), {}) is out
