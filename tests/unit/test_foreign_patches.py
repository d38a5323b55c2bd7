"""A framework's own monkey-patch next to ours (issue 29, item 4), on a stand-in torch function.

NeMo Automodel's ``fsdp_patches`` replaces ``foreach_reduce`` at both modules that hold it, with a
plain function whose closure holds the previous one (no ``functools.wraps``). Here the same shape
on a stand-in module under ``torch.``: one function, held by two modules.

* after us: a revert of ours leaves theirs where they put it (and says so), our wrapper inside
  theirs passes through from then on, and ``status`` / ``doctor`` say what is in force;
* before us: ours wraps theirs, both run once, the structural check still reads torch's function.
"""

from __future__ import annotations

import sys
import types

import pytest

from fsdp_autopatch import _compat, _doctor, _patching
from fsdp_autopatch._registry import REGISTRY, PatchStatus
from fsdp_autopatch._spec import Patch, Wrap, needed

MODULE = "torch._fsdp_autopatch_foreign_test"
NAME = "foreign_test"
calls: list[str] = []


def _ours(wrapped, instance, args, kwargs):
    calls.append("ours")
    return wrapped(*args, **kwargs)


PATCH = Patch(
    name=NAME, summary="", symptom="", trigger="", upstream=(), affected=">=0", check=lambda: needed(""),
    targets=(Wrap(f"{MODULE}:reduce", _ours, everywhere=True),), changes="test",
)


@pytest.fixture
def torch_like():
    """``reduce`` defined in one module and imported by name into another (like foreach_reduce)."""
    defining, user = types.ModuleType(MODULE), types.ModuleType(MODULE + "_user")

    def reduce(grads):
        calls.append("torch")
        return [2 * g for g in grads]

    reduce.__module__ = MODULE
    defining.reduce = user.reduce = reduce
    sys.modules[MODULE], sys.modules[MODULE + "_user"] = defining, user
    calls.clear()
    _patching.left_in_place.clear()
    yield defining, user, reduce
    _patching.revert(NAME)
    with REGISTRY._lock:
        REGISTRY._records.pop(NAME, None)
    del sys.modules[MODULE], sys.modules[MODULE + "_user"]


def _theirs_over(modules, calling=True):
    """NeMo's pattern: keep the current function, install a plain function at every site."""
    previous = modules[0].reduce

    def reduce_uniform(grads, *args, **kwargs):
        calls.append("theirs")
        return previous(grads, *args, **kwargs)

    def reduce_uniform_own(grads, *args, **kwargs):  # a rewrite that holds nothing of ours
        calls.append("theirs")
        return [2 * g for g in grads]

    if not calling:
        reduce_uniform = reduce_uniform_own
        reduce_uniform.__qualname__ = reduce_uniform.__name__ = "reduce_uniform"

    for module in modules:
        module.reduce = reduce_uniform
    return reduce_uniform


def test_revert_keeps_a_replacement_made_after_us(torch_like):
    defining, user, torch_reduce = torch_like
    _patching.apply(PATCH)
    theirs = _theirs_over([defining, user])
    assert user.reduce([1]) == [2] and calls == ["theirs", "ours", "torch"]
    _patching.revert(NAME)
    assert defining.reduce is theirs and user.reduce is theirs  # never undone by our revert
    calls.clear()
    assert user.reduce([1]) == [2] and calls == ["theirs", "torch"]  # ours, still inside theirs, is inert
    assert len(_patching.left_in_place) == 2
    assert all("reduce_uniform" in entry for entry in _patching.left_in_place)


def test_revert_restores_the_sites_nobody_else_replaced(torch_like):
    defining, user, torch_reduce = torch_like
    _patching.apply(PATCH)
    theirs = _theirs_over([defining])  # one site only
    _patching.revert(NAME)
    assert defining.reduce is theirs and user.reduce is torch_reduce


@pytest.mark.parametrize("calling", [True, False])
def test_status_and_doctor_say_what_is_in_force(torch_like, calling):
    defining, user, _ = torch_like
    _patching.apply(PATCH)
    REGISTRY.add_external(NAME, "test-dist 1.0", PatchStatus.APPLIED, "applied for the test")
    assert REGISTRY.snapshot()[NAME].displaced == ()
    _theirs_over([defining, user], calling=calling)
    record = REGISTRY.snapshot()[NAME]
    assert record.status is PatchStatus.APPLIED
    assert [(calls_ours, what.rsplit(".", 1)[-1]) for _, what, calls_ours in record.displaced] == [
        (calling, "reduce_uniform")
    ] * 2
    assert record.in_force is calling
    finding = _doctor._patch_finding(record)
    if calling:
        assert "which wraps ours" in record.reason and finding.level == _doctor.OK
    else:
        assert "which does not hold ours: not in force there" in record.reason
        assert finding.level == _doctor.WARNING and "reduce_uniform now runs instead" in finding.action
    assert record.to_dict()["status"] == "applied"


def test_patched_before_us_we_wrap_theirs_and_still_read_torch(torch_like):
    defining, user, torch_reduce = torch_like
    theirs = _theirs_over([defining, user])
    assert _compat.innermost(defining.reduce) is torch_reduce  # the structural check reads torch's code
    described = _patching.apply(PATCH)
    assert "not torch's own" in described and "reduce_uniform" in described
    assert user.reduce([1]) == [2] and calls == ["ours", "theirs", "torch"]  # each once
    _patching.revert(NAME)
    assert defining.reduce is theirs and user.reduce is theirs and not _patching.left_in_place


def test_innermost_follows_only_one_torch_function_in_a_closure():
    def a():
        return 1

    def b():
        return 2

    a.__module__ = b.__module__ = MODULE

    def two():
        return a() + b()

    def one():
        return a()

    assert _compat.innermost(one) is a and _compat.innermost(two) is two
