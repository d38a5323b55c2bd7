"""Call-time isolation (``_isolation``): arguments read by name, and the contract a check verifies.

``Call.argument`` / ``again`` / ``rebind`` and ``Binder`` against stand-in signatures (positional,
keyword, keyword-only and defaulted parameters, a method), ``run_wrapper``, and
``_patching.contract_problem`` on a stand-in torch module whose function lacks a parameter a
wrapper reads. The guard itself: ``test_isolation.py`` (its fixture and stand-ins are shared).
"""

from __future__ import annotations

import sys
import types

import pytest
from test_isolation import (  # noqa: F401 - fake_patches: the same autouse fixture here
    NAME,
    Torch,
    assert_healthy,
    counted,
    fake_patches,
    our_bug_before_torch,
)

from fsdp_autopatch import _activate, _isolation, _patching
from fsdp_autopatch._spec import KEEP_RESULT, Patch, Wrap, needed

# --- arguments by name ---------------------------------------------------------------------------


def torch_function(tensors, norm_type=2.0, *rest, foreach, dtype=None, **extra):
    raise AssertionError("only its signature is used")


def torch_function_no_varargs(tensors, norm_type=2.0, *, foreach=None, dtype=None):
    raise AssertionError("only its signature is used")


READS = ("tensors", "norm_type", "foreach", "dtype")


@pytest.mark.parametrize("function", [torch_function, torch_function_no_varargs])
def test_call_reads_arguments_by_name(function):
    binder = _isolation.Binder(function, READS)
    assert binder.missing == ()
    grads = [object()]
    positional = _isolation.Call(Torch(), (grads, 3.0), {"foreach": True}, binder)
    assert positional.argument("tensors") is grads
    assert positional.argument("norm_type") == 3.0
    assert positional.argument("foreach") is True
    assert positional.argument("dtype") is None  # the default
    by_keyword = _isolation.Call(Torch(), (), {"tensors": grads, "foreach": False, "dtype": "bf16"}, binder)
    assert by_keyword.argument("tensors") is grads
    assert by_keyword.argument("norm_type") == 2.0  # the default
    assert (by_keyword.argument("foreach"), by_keyword.argument("dtype")) == (False, "bf16")


@pytest.mark.parametrize("function", [torch_function, torch_function_no_varargs])
def test_call_again_replaces_where_each_argument_came_from(function):
    binder = _isolation.Binder(function, READS)
    grads, other = [object()], [object()]
    torch_fn = Torch()
    call = _isolation.Call(torch_fn, (grads, 3.0), {"foreach": True, "unknown": 5}, binder)
    call.again(tensors=other, dtype="fp32")
    call.again(norm_type=1.0, foreach=False)
    assert torch_fn.calls[0] == ((other, 3.0), {"foreach": True, "unknown": 5, "dtype": "fp32"})
    assert torch_fn.calls[1] == ((grads, 1.0), {"foreach": False, "unknown": 5})
    assert call.args == (grads, 3.0) and call.kwargs == {"foreach": True, "unknown": 5}  # the caller's call
    short = _isolation.Call(torch_fn, (grads,), {"foreach": None}, binder)
    short.again(norm_type=4.0)  # not passed: it goes by keyword, the others as they came
    assert torch_fn.calls[2] == ((grads,), {"foreach": None, "norm_type": 4.0})
    assert call.ran and call.result is torch_fn.results[1]


def test_an_iterator_read_before_the_failure_reaches_torch_as_the_list_read():
    torch_fn = Torch()

    def body(wrapped, args, kwargs):
        wrapped.rebind(tensors=list(wrapped.argument("tensors")))  # the caller's iterator is spent now
        our_bug_before_torch()

    def torch_signature(tensors, norm_type=2.0):
        raise AssertionError("only its signature is used")

    patched = _patching.wrap(
        torch_fn, _isolation.isolate(NAME, counted(body), _isolation.Binder(torch_signature, ("tensors",)), KEEP_RESULT)
    )
    assert patched(iter([1, 2, 3]), norm_type=3.0) is torch_fn.results[0]
    assert torch_fn.calls == [(([1, 2, 3],), {"norm_type": 3.0})]


def test_call_rebind_changes_the_callers_call_from_then_on():
    binder = _isolation.Binder(torch_function, READS)
    torch_fn = Torch()
    call = _isolation.Call(torch_fn, (iter([1, 2]),), {"foreach": None}, binder)
    call.rebind(tensors=[1, 2], dtype="bf16")
    assert call.args == ([1, 2],) and call.kwargs == {"foreach": None, "dtype": "bf16"}
    call.again()
    call.fallback()
    assert torch_fn.calls == [(([1, 2],), {"foreach": None, "dtype": "bf16"})] * 2


def test_call_on_a_method_skips_self():
    class Owner:
        def method(self, param, *, strict=False):
            return (self, param, strict)

    original = Owner.__dict__["method"]
    seen = []

    def wrapper(wrapped, instance, args, kwargs):
        seen.append((instance, wrapped.argument("param"), wrapped.argument("strict")))
        return wrapped.again(param="replaced")

    target = Wrap("unused:Owner.method", wrapper, reads=("param", "strict"))
    Owner.method = _patching.replacement_for(NAME, target, Owner, original)
    owner = Owner()
    assert owner.method("given") == (owner, "replaced", False)
    assert owner.method(param="kw", strict=True) == (owner, "replaced", True)
    assert seen == [(owner, "given", False), (owner, "kw", True)]
    assert _patching.binder_for(target, Owner, original).positions == {"param": 0, "strict": None}
    assert_healthy()


def test_binder_missing_names_what_the_signature_lacks():
    assert _isolation.Binder(torch_function, ("tensors", "foreach")).missing == ()
    assert _isolation.Binder(torch_function, ("tensors", "max_norm", "error_if_nonfinite")).missing == (
        "max_norm",
        "error_if_nonfinite",
    )
    assert _isolation.Binder(lambda self, param: None, ("self",), skip_self=True).missing == ("self",)


def test_run_wrapper_drives_a_wrapper_without_isolation():
    torch_fn = Torch()

    def wrapper(wrapped, instance, args, kwargs):
        return wrapped.again(norm_type=wrapped.argument("norm_type") * 2)

    assert _isolation.run_wrapper(wrapper, torch_fn, None, ([1], 3.0), {}, READS, signature_of=torch_function) is (
        torch_fn.results[0]
    )
    assert torch_fn.calls == [(([1], 6.0), {})]
    with pytest.raises(TypeError):
        _isolation.run_wrapper(lambda *a: our_bug_before_torch(), torch_fn, None, (), {})
    assert_healthy()


# --- the contract a check verifies before anything is replaced -------------------------------------


@pytest.fixture
def stand_in_torch(monkeypatch):
    module = types.ModuleType("fake_torch_for_isolation")

    def foreach_reduce(fsdp_params, grads, group, *, dtype=None):  # a torch that renamed a parameter
        raise AssertionError("never called")

    class Group:
        def post_backward(self, *unused):
            raise AssertionError("never called")

    module.foreach_reduce, module.Group = foreach_reduce, Group
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def declaration(*targets) -> Patch:
    return Patch(
        name=NAME, summary="s", symptom="s", trigger="t", upstream=(), affected=">=2.6",
        check=lambda: needed("the bug is there"), targets=targets, changes="c",
    )


def test_contract_problem_when_a_parameter_the_wrapper_reads_is_gone(stand_in_torch):
    def wrapper(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    reads = ("fsdp_params", "unsharded_grads")
    gone = declaration(Wrap("fake_torch_for_isolation:foreach_reduce", wrapper, reads=reads))
    assert _patching.contract_problem(gone) == (
        "fake_torch_for_isolation.foreach_reduce has no parameter unsharded_grads (its wrapper reads it)"
    )
    verdict = _activate.verdict_of(gone)
    assert verdict.status == "unsupported"
    assert "has no parameter unsharded_grads (its wrapper reads it): torch left untouched" in verdict.reason
    there = declaration(
        Wrap("fake_torch_for_isolation:foreach_reduce", wrapper, reads=("fsdp_params", "grads", "dtype")),
        Wrap("fake_torch_for_isolation:Group.post_backward", wrapper),
    )
    assert _patching.contract_problem(there) is None
    assert _activate.verdict_of(there).status != "unsupported"
