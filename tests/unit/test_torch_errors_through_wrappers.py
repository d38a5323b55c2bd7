"""Torch's error raised through a wrapper of ours reads as torch's: between the user's call and
torch's frame at most one frame of ours, whose line says that the error below is torch's own
(``_isolation.as_torchs``), for each kind of wrapper: a wrapt proxy, a plain function
(``proxy=False``) and a replacement hidden from Dynamo as torch hides its hooks (``_hiding``)."""

from __future__ import annotations

import functools
import traceback

import pytest
import torch

from fsdp_autopatch import _isolation, _patching
from fsdp_autopatch._spec import Patch, Wrap, needed

OURS = "/fsdp_autopatch/"
SAYS = "torch's own code raised below: fsdp-autopatch ran it unchanged"


def _dynamo_disable(func):
    """torch 2.13's _fsdp_common._dynamo_disable (FSDP2's hooks are hidden with it)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return torch._dynamo.disable(func, recursive=True)(*args, **kwargs)

    return wrapper


class Torch:
    """Stand-ins for torch's functions: each raises torch's error."""

    def proxied(self, x):
        raise ValueError("torch's error (proxy)")

    def plain(self, x):
        raise ValueError("torch's error (plain)")

    @_dynamo_disable
    def hidden(self, x):
        raise ValueError("torch's error (hidden)")


def _passes_through(wrapped, instance, args, kwargs):
    x = wrapped.argument("x") if False else args[0]  # a wrapper that does its work, then calls torch
    return wrapped(x)


KINDS = {"proxied": {}, "plain": {"proxy": False}, "hidden": {}}


@pytest.fixture(params=sorted(KINDS))
def kind(request):
    name = f"test_torch_error_{request.param}"
    target = Wrap(f"{__name__}:Torch.{request.param}", _passes_through, **KINDS[request.param])
    patch = Patch(name=name, summary="", symptom="", trigger="", upstream=(), affected=">=0",
                  check=lambda: needed(""), targets=(target,), changes="")
    assert _patching.contract_problem(patch) is None
    _patching.apply(patch)
    yield request.param
    _patching.revert(name)
    _isolation.forget()


def test_a_torch_error_shows_at_most_one_frame_of_ours_saying_whose_it_is(kind):
    with pytest.raises(ValueError, match="torch's error") as raised:
        getattr(Torch(), kind)(1)
    frames = traceback.extract_tb(raised.value.__traceback__)
    assert frames[0].name == "test_a_torch_error_shows_at_most_one_frame_of_ours_saying_whose_it_is"
    assert frames[-1].name == kind  # torch's frame raised it
    ours = [frame for frame in frames if OURS in frame.filename]
    assert len(ours) <= 1, traceback.format_list(frames)
    assert all(SAYS in frame.line for frame in ours), traceback.format_list(frames)
    assert not _isolation.has_failed(f"test_torch_error_{kind}")  # torch's error is not the patch's failure


@pytest.mark.parametrize("state", ["failed", "reverted"])
def test_a_wrapper_that_steps_aside_shows_one_frame_too(kind, state):
    """A patch that failed passes every call to torch; a reverted wrapper that a framework still
    holds does the same: torch's error then shows the same single frame of ours."""
    name = f"test_torch_error_{kind}"
    held = Torch.__dict__[kind]
    if state == "failed":
        _isolation.record_failure(name, RuntimeError("the patch broke"), __name__)
    else:
        _patching.revert(name)
    with pytest.raises(ValueError, match="torch's error") as raised:
        held(Torch(), 1) if state == "reverted" else getattr(Torch(), kind)(1)
    frames = traceback.extract_tb(raised.value.__traceback__)
    assert frames[-1].name == kind  # torch's frame raised it
    ours = [frame for frame in frames if OURS in frame.filename]
    assert len(ours) <= 1 and all(SAYS in frame.line for frame in ours), traceback.format_list(frames)


def test_an_error_of_ours_keeps_its_frames():
    """Only torch's errors lose our frames: a guard's error (raised in our code) keeps them all."""

    def guard(wrapped, instance, args, kwargs):
        raise _isolation.for_the_user(RuntimeError("a guard stopped it"))

    wrapper = _patching.wrap(Torch.plain, _isolation.isolate("test_ours", guard, _isolation.NO_BINDER, "keep"),
                             proxy=False)
    with pytest.raises(RuntimeError) as raised:
        wrapper(Torch(), 1)
    frames = traceback.extract_tb(raised.value.__traceback__)
    assert frames[-1].name == "guard" and not any(SAYS in (frame.line or "") for frame in frames)
