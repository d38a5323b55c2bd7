"""cast_inputs_keep_containers's variants on 2 gloo ranks, the entry off and the plugin as installed
(``_cast_inputs_keep_containers_scenarios``). The aux-loss list itself is its case's
(``test_dist_cases.py``).

* a Gemma-3n-style shared dict, empty or holding an fp32 tensor: off, ``KeyError: 'kv'`` in the block
  that reads what block 0 stored, on every rank; on, the one-process bf16 reference's gradients, and a
  fire for each unit that changed the dict through torch's copy (the ``dict/fp32`` run);
* a dict holding an fp32 scale and the aux-loss list (nested containers): off 0, on 3 of 3 terms and
  the reference's gradients (the root's forward extends the loss's list: a change to a container too);
* containers read and changed by no unit (tuple, NamedTuple, dataclass, dict holding a list): the
  gradients bitwise equal off and on, no fire.
"""

from __future__ import annotations

import functools

import pytest
import torch

import _cast_inputs_keep_containers_scenarios as sc
import _dist_checks as ck

pytestmark = [pytest.mark.timeout(300)]

PATCH = sc.NAME
BUG = ck.ex.BUG_OF[PATCH]

unpatched, patched = ck.off_and_on("cast_inputs_keep_containers", PATCH)


@functools.cache
def reference(variant: str) -> dict:
    return sc.reference(variant)


def assert_reference(record: dict, variant: str) -> None:
    want = reference(variant)
    assert record["error"] is None, (variant, record["error"])
    assert record["grads"].keys() == want["grads"].keys(), variant
    for name, grad in want["grads"].items():
        torch.testing.assert_close(record["grads"][name], grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{variant} {n}: {m}")
    assert record["values"]["aux_terms"] == want["aux_terms"], (variant, record["values"])


def test_without_the_entry(unpatched):
    assert not unpatched.timed_out, unpatched.describe()
    ck.assert_registry_with_disabled(unpatched, PATCH)
    for rank in unpatched.ranks:
        for variant in sc.BUGGED:
            error = ck.error_of(rank, variant)
            assert error is not None and (error["type"], error["message"]) == ("KeyError", "'kv'"), (variant, error)
        nested = rank.cases["nested"]
        assert nested["error"] is None and nested["values"]["aux_terms"] == 0, nested
    ck.expect_unpatched(BUG, ck.ex.REPRODUCES, f"KeyError: 'kv' ({', '.join(sc.BUGGED)}); nested: 0 of 3 aux "
                        "terms (every rank)", unpatched)


@pytest.mark.parametrize("variant", sc.VARIANTS)
def test_with_the_plugin_every_variant_equals_the_reference(patched, variant):
    assert not patched.timed_out, patched.describe()
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    for rank in patched.ranks:
        record = rank.cases[variant]
        assert_reference(record, variant)
        # dict/empty: block 0 changes the caller's own dict (nothing in it cast), which counts too; nested: the
        # 3 blocks' lists and the root's (it extends the loss's aux list, empty, so the caller's own)
        fires = {"dict/empty": 1, "dict/fp32": 1, "nested": 4, "unchanged": 0}[variant]
        assert record["values"]["fired"] == fires, (variant, record["values"])


def test_unchanged_containers_stay_bitwise_equal(unpatched, patched):
    for off, on in zip(unpatched.ranks, patched.ranks):
        got, want = on.cases["unchanged"], off.cases["unchanged"]
        assert got["error"] is None and want["error"] is None, (got["error"], want["error"])
        assert got["grads"].keys() == want["grads"].keys()
        assert all(torch.equal(got["grads"][n], want["grads"][n]) for n in want["grads"]), "not bitwise equal"
