"""Call-time isolation (``_isolation``): the guard's contract, with stand-ins for torch's functions.

No process group: each wrapper is installed the way ``_patching`` installs a patch's wrapper
(``_isolation.isolate`` in a wrapt proxy) around a stand-in that records its calls (arguments by name
and ``contract_problem``: ``test_isolation_arguments.py``). Our failing code is a real function of
the package called with a bad argument (``_compat.unsharded_param(42)``, ``REGISTRY.get`` of an
unknown name), so the record names a function of the package as a real failure would.

The patch is a fake one (:data:`NAME`) with a registry record of its own; every test starts and
ends with no call-time failure, the registry reset and strict mode off.
"""

from __future__ import annotations

import logging

import pytest

from fsdp_autopatch import _compat, _isolation, _patching
from fsdp_autopatch._registry import REGISTRY, PatchStatus
from fsdp_autopatch._spec import CALL_AGAIN, KEEP_RESULT

NAME = "fake_isolation_patch"
OTHER = "other_fake_isolation_patch"
APPLIED_REASON = "applied for the test"
PREFIX = "failed at call time"


def _message(action) -> str:
    try:
        action()
    except Exception as error:  # noqa: BLE001 - the message is what we want
        return f"{type(error).__name__}: {error}"
    raise AssertionError("expected an exception")


# The errors of ours the tests raise, and how the record must say them.
VARS_ERROR = _message(lambda: vars(42))
OURS_BEFORE = f"{PREFIX}: {VARS_ERROR} in fsdp_autopatch._compat.unsharded_param"
KEY_ERROR = _message(lambda: {}["no such patch"])
OURS_AFTER = f"{PREFIX}: {KEY_ERROR} in fsdp_autopatch._registry.Registry.get"


def our_bug_before_torch() -> None:
    _compat.unsharded_param(42)  # vars(42): TypeError inside a function of ours


def our_bug_after_torch() -> None:
    REGISTRY.get("no such patch")  # KeyError inside a method of ours


@pytest.fixture(autouse=True)
def fake_patches():
    strict = _isolation.is_strict()  # another test may have activated with STRICT on
    _isolation.set_strict(False)
    _isolation.forget()
    for name in (NAME, OTHER):
        REGISTRY.record(name, PatchStatus.APPLIED, APPLIED_REASON, "structural check")
    yield
    _isolation.set_strict(strict)
    _isolation.forget()
    REGISTRY.reset()


class Torch:
    """A stand-in for one of torch's functions: records each call, returns a new object per call."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.calls: list[tuple[tuple, dict]] = []
        self.results: list[object] = []
        self.error = error

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.error is not None:
            raise self.error
        self.results.append(object())
        return self.results[-1]


def install(wrapper, original, after_torch=KEEP_RESULT, reads=(), name=NAME):
    """``wrapper`` around ``original`` as ``_patching`` installs it: isolated, in a wrapt proxy."""
    binder = _isolation.Binder(original, reads) if reads else _isolation.NO_BINDER
    return _patching.wrap(original, _isolation.isolate(name, wrapper, binder, after_torch))


def counted(body):
    """A wrapper running ``body(wrapped, args, kwargs)``; ``.calls`` counts its calls."""

    def wrapper(wrapped, instance, args, kwargs):
        wrapper.calls += 1
        return body(wrapped, args, kwargs)

    wrapper.calls = 0
    return wrapper


def warnings_of(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "fsdp_autopatch" and r.levelno == logging.WARNING]


def record_of(name=NAME) -> tuple[PatchStatus, str]:
    return REGISTRY.get(name)


def assert_healthy(name=NAME) -> None:
    assert not _isolation.has_failed(name)
    assert record_of(name) == (PatchStatus.APPLIED, APPLIED_REASON)


# --- our exception before torch's original ---------------------------------------------------


def test_our_error_before_torch_runs_torch_once_with_the_callers_arguments(caplog):
    torch_fn = Torch()

    def body(wrapped, args, kwargs):
        our_bug_before_torch()
        return wrapped(*args, **kwargs)

    wrapper = counted(body)
    patched = install(wrapper, torch_fn)
    first, second, keyword = object(), [1, 2], {"k": 3}
    with caplog.at_level(logging.WARNING, logger="fsdp_autopatch"):
        result = patched(first, second, option=keyword)
    assert result is torch_fn.results[0]
    assert len(torch_fn.calls) == 1
    (args, kwargs), = torch_fn.calls
    assert len(args) == 2 and args[0] is first and args[1] is second
    assert list(kwargs) == ["option"] and kwargs["option"] is keyword
    status, reason = record_of()
    assert status is PatchStatus.FAILED
    assert reason.startswith(OURS_BEFORE), reason
    assert reason.endswith(f"(it had applied: {APPLIED_REASON})"), reason
    assert _isolation.has_failed(NAME)
    # later calls go straight to torch: the wrapper is not called again
    with caplog.at_level(logging.WARNING, logger="fsdp_autopatch"):
        assert patched(first) is torch_fn.results[1]
        assert patched(second, option=1) is torch_fn.results[2]
    assert wrapper.calls == 1
    assert [call[0][0] for call in torch_fn.calls[1:]] == [first, second]
    (warning,) = warnings_of(caplog)
    assert NAME in warning.getMessage() and OURS_BEFORE in warning.getMessage()
    assert warning.exc_info is not None and warning.exc_info[0] is TypeError


def test_one_warning_per_patch_and_process_and_other_patches_untouched(caplog):
    fails = counted(lambda wrapped, args, kwargs: (our_bug_before_torch(), wrapped(*args, **kwargs))[1])
    also_fails = counted(lambda wrapped, args, kwargs: (our_bug_before_torch(), wrapped(*args, **kwargs))[1])
    fine = counted(lambda wrapped, args, kwargs: wrapped(*args, **kwargs))
    torch_a, torch_b, torch_c = Torch(), Torch(), Torch()
    first = install(fails, torch_a)
    second = install(also_fails, torch_b)  # another wrapper of the same patch
    other = install(fine, torch_c, name=OTHER)
    with caplog.at_level(logging.WARNING, logger="fsdp_autopatch"):
        for _ in range(3):
            first(1)
            second(2)
            other(3)
        _isolation.record_failure(NAME, RuntimeError("a second failure of the same patch"))
    assert (fails.calls, also_fails.calls, fine.calls) == (1, 0, 3)  # the patch steps aside as a whole
    assert (len(torch_a.calls), len(torch_b.calls), len(torch_c.calls)) == (3, 3, 3)
    assert len(warnings_of(caplog)) == 1
    assert record_of()[1].startswith(OURS_BEFORE)  # the first failure is the one recorded
    assert_healthy(OTHER)
    with caplog.at_level(logging.WARNING, logger="fsdp_autopatch"):
        failing_other = install(counted(lambda wrapped, args, kwargs: our_bug_after_torch()), Torch(), name=OTHER)
        failing_other(4)
        failing_other(5)
    assert len(warnings_of(caplog)) == 2  # one more for the other patch, once
    assert record_of(OTHER)[1].startswith(f"{PREFIX}: {KEY_ERROR} in fsdp_autopatch._registry.Registry.get")


def test_the_record_names_the_innermost_function_of_ours():
    def body(wrapped, args, kwargs):
        _compat.has_local_grad(42)  # has_local_grad -> unsharded_param -> vars(42)
        return wrapped(*args, **kwargs)

    install(counted(body), Torch())(1)
    assert record_of()[1].startswith(OURS_BEFORE)


# --- our exception after torch's original ----------------------------------------------------


@pytest.mark.parametrize("after_torch", [KEEP_RESULT, CALL_AGAIN])
def test_our_error_after_torch(after_torch, caplog):
    torch_fn = Torch()

    def body(wrapped, args, kwargs):
        result = wrapped(*args, **kwargs)
        our_bug_after_torch()
        return result

    wrapper = counted(body)
    patched = install(wrapper, torch_fn, after_torch)
    first = object()
    with caplog.at_level(logging.WARNING, logger="fsdp_autopatch"):
        result = patched(first, flag=True)
    if after_torch == KEEP_RESULT:  # torch's result, torch not called again
        assert len(torch_fn.calls) == 1
        assert result is torch_fn.results[0]
    else:  # torch called once more, with the caller's arguments; that result is returned
        assert len(torch_fn.calls) == 2
        assert result is torch_fn.results[1]
        args, kwargs = torch_fn.calls[1]
        assert args[0] is first and kwargs == {"flag": True}
    status, reason = record_of()
    assert status is PatchStatus.FAILED and reason.startswith(OURS_AFTER), reason
    assert len(warnings_of(caplog)) == 1
    calls = len(torch_fn.calls)
    assert patched(first) is torch_fn.results[-1]
    assert wrapper.calls == 1 and len(torch_fn.calls) == calls + 1


def test_call_again_falls_back_to_the_callers_arguments_not_the_changed_ones():
    torch_fn = Torch()

    def body(wrapped, args, kwargs):
        wrapped.again(norm_type=99.0)  # torch on a changed call, then a bug of ours
        our_bug_after_torch()

    def torch_signature(tensors, norm_type=2.0, foreach=None):
        raise AssertionError("only its signature is used")

    binder = _isolation.Binder(torch_signature, ("tensors", "norm_type"))
    patched = _patching.wrap(torch_fn, _isolation.isolate(NAME, counted(body), binder, CALL_AGAIN))
    grads = [object()]
    assert patched(grads, 2.0, foreach=True) is torch_fn.results[1]
    assert torch_fn.calls[0] == ((grads, 99.0), {"foreach": True})
    assert torch_fn.calls[1] == ((grads, 2.0), {"foreach": True})


# --- torch's exceptions, and ours on purpose -------------------------------------------------


@pytest.mark.parametrize("after_torch", [KEEP_RESULT, CALL_AGAIN])
@pytest.mark.parametrize("how", ["call", "again"])
def test_torchs_error_propagates_as_the_same_object(after_torch, how, caplog):
    error = ValueError("torch says no")
    torch_fn = Torch(error)

    def body(wrapped, args, kwargs):
        return wrapped(*args, **kwargs) if how == "call" else wrapped.again()

    wrapper = counted(body)
    patched = install(wrapper, torch_fn, after_torch)
    with caplog.at_level(logging.WARNING, logger="fsdp_autopatch"):
        for expected_calls in (1, 2):
            with pytest.raises(ValueError) as raised:
                patched(1, b=2)
            assert raised.value is error
            assert wrapper.calls == expected_calls and len(torch_fn.calls) == expected_calls
    assert_healthy()
    assert warnings_of(caplog) == []


def test_torchs_error_propagates_when_our_code_then_raises_too(caplog):
    """Our code raises while torch's exception is on its way out (a ``finally`` of ours): the
    caller must get torch's exception, never a made-up result, and the failure is ours."""
    error = ValueError("torch says no")
    torch_fn = Torch(error)

    def body(wrapped, args, kwargs):
        try:
            return wrapped(*args, **kwargs)
        finally:
            our_bug_after_torch()

    patched = install(counted(body), torch_fn, KEEP_RESULT)
    with caplog.at_level(logging.WARNING, logger="fsdp_autopatch"), pytest.raises(ValueError) as raised:
        patched(1)
    assert raised.value is error
    assert len(torch_fn.calls) == 1


@pytest.mark.parametrize("phase", ["before", "after"])
def test_an_error_from_torch_call_propagates_and_the_patch_stays_healthy(phase):
    error = RuntimeError("[gloo] connection closed by peer")
    torch_fn = Torch()

    def collective(tensor):
        raise error

    def body(wrapped, args, kwargs):
        result = wrapped(*args, **kwargs) if phase == "after" else None
        _isolation.torch_call(collective, [1])
        return result if phase == "after" else wrapped(*args, **kwargs)

    wrapper = counted(body)
    patched = install(wrapper, torch_fn)
    for calls in (1, 2):
        with pytest.raises(RuntimeError) as raised:
            patched(1)
        assert raised.value is error
        assert wrapper.calls == calls
    assert len(torch_fn.calls) == (2 if phase == "after" else 0)
    assert_healthy()


def test_an_error_marked_for_the_user_propagates_and_the_patch_stays_healthy():
    error = RuntimeError("fsdp-autopatch cross-rank check: ranks disagree")

    def body(wrapped, args, kwargs):
        wrapped(*args, **kwargs)
        raise _isolation.for_the_user(error)

    torch_fn = Torch()
    patched = install(counted(body), torch_fn)
    with pytest.raises(RuntimeError) as raised:
        patched(1)
    assert raised.value is error and len(torch_fn.calls) == 1
    assert_healthy()


# --- strict ------------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["before", "after"])
def test_strict_records_then_reraises(phase, caplog):
    _isolation.set_strict(True)
    torch_fn = Torch()

    def body(wrapped, args, kwargs):
        if phase == "before":
            our_bug_before_torch()
        result = wrapped(*args, **kwargs)
        our_bug_after_torch()
        return result

    wrapper = counted(body)
    patched = install(wrapper, torch_fn)
    with caplog.at_level(logging.WARNING, logger="fsdp_autopatch"):
        with pytest.raises(TypeError if phase == "before" else KeyError):
            patched(1)
    assert len(torch_fn.calls) == (0 if phase == "before" else 1)  # torch is not called instead
    status, reason = record_of()
    assert status is PatchStatus.FAILED
    assert reason.startswith(OURS_BEFORE if phase == "before" else OURS_AFTER)
    assert len(warnings_of(caplog)) == 1
    assert patched(2) is torch_fn.results[-1]  # from then on torch's own, without raising
    assert wrapper.calls == 1


def test_isolated_records_our_error_and_then_skips_our_function():
    calls = []

    def ours(value):
        calls.append(value)
        our_bug_before_torch()

    assert _isolation.isolated(NAME, ours, 1) is None
    assert _isolation.isolated(NAME, ours, 2) is None
    assert calls == [1]
    assert record_of()[1].startswith(OURS_BEFORE)
    _isolation.set_strict(True)
    with pytest.raises(TypeError):
        _isolation.isolated(OTHER, ours, 3)
    assert record_of(OTHER)[0] is PatchStatus.FAILED


def test_isolated_lets_torchs_error_through():
    error = RuntimeError("torch's collective failed")

    def collective():
        raise error

    def ours():
        _isolation.torch_call(collective)

    with pytest.raises(RuntimeError) as raised:
        _isolation.isolated(NAME, ours)
    assert raised.value is error
    assert_healthy()


# --- the record stays what happened ----------------------------------------------------------------


def test_a_later_install_keeps_a_call_time_failure_recorded():
    """``fsdp_autopatch.install()`` is documented as idempotent and safe to call at any time; after a
    call-time failure the patch's wrappers go to torch, so its record must keep saying failed."""
    pytest.importorskip("torch")
    import torch.distributed.fsdp  # noqa: F401 - the plugin applies here

    import fsdp_autopatch

    fsdp_autopatch.install()
    applied = fsdp_autopatch.applied()
    if not applied:
        pytest.skip("no patch applies in this process")
    name = applied[0]
    _isolation.record_failure(name, RuntimeError("a bug of ours at call time"))
    assert fsdp_autopatch.status()[name].status is PatchStatus.FAILED
    fsdp_autopatch.install()
    record = fsdp_autopatch.status()[name]
    assert _isolation.has_failed(name)  # its wrappers go straight to torch
    assert record.status is PatchStatus.FAILED, f"{name}: {record.status} ({record.reason})"
    assert record.reason.startswith(f"{PREFIX}: RuntimeError: a bug of ours at call time"), record.reason
    assert name not in fsdp_autopatch.applied()
