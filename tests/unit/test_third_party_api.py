"""The API a third-party patch is written against, without the traps of 0.2 (issue 30, item 4).

In one process, with the stand-ins of ``test_isolation.py`` (its autouse fixture gives the fake
patch :data:`NAME` an ``applied`` record and resets everything after each test):

* a ``GuardError`` raised by a wrapper (a guard's or a fix's) reaches the caller as raised and
  counts one fire; the patch stays healthy; a third-party declaration of kind guard is accepted;
* ``wrapped`` forwards the attributes of torch's function, as wrapt's ``wrapped`` does;
* an argument not declared in ``Wrap.reads`` raises ``UndeclaredArgument`` naming it and ``reads``,
  and the record's reason says so;
* ``fsdp_autopatch.torch_call`` is public: what its function raises reaches the caller unchanged;
* the structural-check helpers are public, in ``__all__``, and see through our wrappers.

The same four, from a wheel installed next to ours: tests/install/test_install_third_party.py.
"""

from __future__ import annotations

import inspect

import pytest
from test_isolation import (  # noqa: F401 - fake_patches: the same autouse fixture here
    NAME,
    PREFIX,
    Torch,
    assert_healthy,
    counted,
    fake_patches,
    install,
    record_of,
)

import fsdp_autopatch
from fsdp_autopatch import _isolation, _patching, _thirdparty
from fsdp_autopatch._registry import REGISTRY, PatchStatus
from fsdp_autopatch._spec import FIX, GUARD, POLICY, Patch, Wrap, needed

PUBLIC_HELPERS = ("torch_call", "fsdp_module", "fsdp_class", "class_attr", "innermost", "has_parameters", "reads_names")


def torchs_function(tensor_size, dim0_factor=1):
    """Torch's docstring."""
    return ("torch", tensor_size, dim0_factor)


# --- a GuardError reaches the user ----------------------------------------------------------------


@pytest.mark.parametrize("phase", ["before", "after"])
def test_a_guard_error_of_a_wrapper_reaches_the_caller_and_counts_one_fire(phase):
    error = fsdp_autopatch.GuardError(NAME, f"{NAME}: stopped on purpose")
    torch_fn = Torch()

    def body(wrapped, args, kwargs):
        if phase == "after":
            wrapped(*args, **kwargs)
        raise error

    wrapper = counted(body)
    patched = install(wrapper, torch_fn)
    for calls in (1, 2):
        with pytest.raises(fsdp_autopatch.GuardError) as raised:
            patched(1)
        assert raised.value is error and wrapper.calls == calls  # not isolated: the next call stops too
    assert len(torch_fn.calls) == (2 if phase == "after" else 0)  # torch's original never runs in its place
    assert REGISTRY.snapshot()[NAME].fired == 1  # counted once, however often it is raised again
    assert_healthy()


def test_a_guard_error_made_by_stop_is_counted_once():
    from fsdp_autopatch import _events

    def body(wrapped, args, kwargs):
        raise _events.stop(NAME, "found", "remedy")

    with pytest.raises(fsdp_autopatch.GuardError):
        install(counted(body), Torch())(1)
    assert REGISTRY.snapshot()[NAME].fired == 1
    assert_healthy()


def test_a_guard_error_from_a_hook_of_ours_reaches_the_caller():
    error = fsdp_autopatch.GuardError(NAME, "stopped in a hook")

    def hook():
        raise error

    with pytest.raises(fsdp_autopatch.GuardError) as raised:
        _isolation.isolated(NAME, hook)
    assert raised.value is error
    assert REGISTRY.snapshot()[NAME].fired == 1
    assert_healthy()


def _declaration(kind: str, variable: str | None = None) -> Patch:
    return Patch(name="myfw_guard", summary="s", symptom="s", trigger="t", upstream=(), affected=">=2.6",
                 check=lambda: needed("r"), targets=(Wrap("m:f", lambda *a: None),), changes="c",
                 kind=kind, variable=variable)


@pytest.mark.parametrize("kind", [FIX, GUARD])
def test_a_third_party_may_declare_a_fix_or_a_guard(kind):
    external = _thirdparty.External("myfw_guard", "myfw 1.0", lambda: None)
    assert _thirdparty.validate(_declaration(kind), external).kind == kind


@pytest.mark.parametrize("kind, variable", [(POLICY, None), (GUARD, "MYFW_GUARD")])
def test_a_policy_or_an_own_variable_is_still_refused(kind, variable):
    external = _thirdparty.External("myfw_guard", "myfw 1.0", lambda: None)
    with pytest.raises(ValueError, match="a fix or a guard with its derived toggle"):
        _thirdparty.validate(_declaration(kind, variable), external)


# --- wrapped forwards torch's function's attributes -------------------------------------------------


def test_wrapped_forwards_the_attributes_of_torchs_function():
    seen = {}

    def body(wrapped, args, kwargs):
        seen.update(
            name=wrapped.__name__, qualname=wrapped.__qualname__, doc=wrapped.__doc__, module=wrapped.__module__,
            inner=wrapped.__wrapped__, defaults=wrapped.__defaults__, signature=str(inspect.signature(wrapped)),
            innermost=fsdp_autopatch.innermost(wrapped),
        )
        return wrapped(*args, **kwargs)

    assert install(counted(body), torchs_function)(3) == ("torch", 3, 1)
    assert seen == {
        "name": "torchs_function", "qualname": "torchs_function", "doc": "Torch's docstring.", "module": __name__,
        "inner": torchs_function, "defaults": (1,), "signature": "(tensor_size, dim0_factor=1)",
        "innermost": torchs_function,
    }
    assert_healthy()


def test_wrapped_still_says_what_it_lacks():
    call = _isolation.Call(torchs_function, (), {})
    with pytest.raises(AttributeError, match="no_such_attribute"):
        call.no_such_attribute  # noqa: B018 - the lookup is the test
    assert "torchs_function" in repr(call)


# --- an argument not declared in Wrap.reads ---------------------------------------------------------


@pytest.mark.parametrize("declared", [(), ("dim0_factor",)])
@pytest.mark.parametrize("use", ["argument", "again"])
def test_an_undeclared_argument_names_itself_and_reads_and_torch_runs_instead(declared, use):
    calls = []

    def original(tensor_size, dim0_factor=1):
        calls.append((tensor_size, dim0_factor))
        return "torch's result"

    def body(wrapped, args, kwargs):
        if use == "argument":
            wrapped.argument("tensor_size")  # in the signature, not in reads
        return wrapped.again(tensor_size=7)

    assert install(counted(body), original, reads=declared)(3, dim0_factor=2) == "torch's result"
    assert calls == [(3, 2)]  # the caller's call, untouched
    status, reason = record_of()
    assert status is PatchStatus.FAILED
    assert reason.startswith(f"{PREFIX}: UndeclaredArgument: the wrapper reads argument 'tensor_size' of "), reason
    assert f"its Wrap.reads {declared!r} does not declare" in reason, reason


def test_undeclared_argument_is_a_key_error_with_a_readable_message():
    error = _isolation.UndeclaredArgument("x", ("y",), torchs_function)
    assert isinstance(error, KeyError)
    assert str(error).startswith("the wrapper reads argument 'x' of torchs_function, which its Wrap.reads ('y',)")


# --- torch_call is public -------------------------------------------------------------------------


def test_torch_call_is_public_and_what_it_calls_raises_reaches_the_caller_unchanged():
    error = TimeoutError("Wait timeout after 200ms: a peer never came")

    def collective():
        raise error

    def body(wrapped, args, kwargs):
        fsdp_autopatch.torch_call(collective)
        return wrapped(*args, **kwargs)

    with pytest.raises(TimeoutError) as raised:
        install(counted(body), Torch())(1)
    assert raised.value is error
    assert fsdp_autopatch.torch_call is _isolation.torch_call
    assert fsdp_autopatch.torch_call(max, 1, 2) == 2
    assert_healthy()


# --- the helpers of a structural check ----------------------------------------------------------------


def test_the_helpers_are_public_and_listed():
    for name in PUBLIC_HELPERS:
        assert name in fsdp_autopatch.__all__ and name in dir(fsdp_autopatch), name
        assert callable(getattr(fsdp_autopatch, name)), name
        assert getattr(fsdp_autopatch, name).__doc__, name


def test_the_helpers_see_torchs_function_behind_our_wrappers():
    class Group:
        def post_backward(self, reduce_scatter_group=None):
            return self.reduce_grads  # its bytecode names reduce_grads

    original = Group.__dict__["post_backward"]
    Group.post_backward = _patching.wrap(original, lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    defined = fsdp_autopatch.class_attr(Group, "post_backward")
    assert defined is Group.__dict__["post_backward"] and fsdp_autopatch.innermost(defined) is original
    assert fsdp_autopatch.class_attr(Group, "missing") is None
    assert fsdp_autopatch.has_parameters(defined, "self", "reduce_scatter_group")
    assert not fsdp_autopatch.has_parameters(defined, "no_such_parameter")
    assert fsdp_autopatch.reads_names(defined, "reduce_grads") and not fsdp_autopatch.reads_names(defined, "nope")


def test_fsdp_class_and_module_reach_torchs_fsdp2():
    pytest.importorskip("torch")
    group = fsdp_autopatch.fsdp_class("_fsdp_param_group", "FSDPParamGroup")
    assert group.__name__ == "FSDPParamGroup"
    assert fsdp_autopatch.fsdp_module("_fsdp_param_group").FSDPParamGroup is group
    with pytest.raises(ImportError):
        fsdp_autopatch.fsdp_module("_no_such_module")
