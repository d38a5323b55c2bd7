"""peft_generate_forward_method's variants on 2 gloo ranks, the entry off and the plugin as installed
(``_peft_generate_forward_method_scenarios``). The bug itself (``generate()`` before and after the first
step on the PeftModel root), off and on, is its case's (``test_dist_cases.py``).

* ``generate()`` only after the first step: off, the mixed Tensor / DTensor error on every rank; on,
  the ids, the step's gradients and the LoRA weights equal the one-process reference, one fire;
* registered by hand (``register_fsdp_forward_method``) on the PeftModel root: right off and on, the
  same number of FSDP2 post-forwards (no second pre-/post-forward around ``generate``), no fire;
* a transformers model as the root, registered by hand or not: nothing installed, no fire, and the
  records bitwise equal off and on and within fp32 tolerance of (in practice equal to) the reference.
"""

from __future__ import annotations

import functools

import pytest
import torch

import _dist_checks as ck
import _peft_generate_forward_method_scenarios as pg
from fsdp_autopatch import cases
from fsdp_autopatch.cases import peft_generate_forward_method as case

pytestmark = [pytest.mark.timeout(300)]

PATCH = pg.NAME
MIXED = "got mixed torch.Tensor and DTensor"

if cases.unmet(PATCH):
    pytest.skip(f"{cases.unmet(PATCH)}: not run here", allow_module_level=True)

unpatched, patched = ck.off_and_on("peft_generate_forward_method", PATCH)


@functools.cache
def reference(variant: str) -> dict:
    plain = case.base_model() if variant.startswith("plain/") else case.model()
    return case.one_process(plain, 2, before=variant not in pg.AFTER_ONLY)


def assert_reference(record: dict, variant: str) -> None:
    want = reference(variant)
    assert record["error"] is None, (variant, record["error"])
    for key in ("grads", "params"):
        assert record[key].keys() == want[key].keys(), (variant, key)
        for name in want[key]:
            torch.testing.assert_close(torch.tensor(record[key][name]), torch.tensor(want[key][name]),
                                       rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{variant} {n}: {m}")
    assert [record["params"][k] for k in ("generate.before", "generate.after") if k in want["params"]] == [
        want["params"][k] for k in ("generate.before", "generate.after") if k in want["params"]]


def test_without_the_entry(unpatched):
    assert not unpatched.timed_out, unpatched.describe()
    ck.assert_registry_with_disabled(unpatched, PATCH)
    for rank in unpatched.ranks:
        for variant in pg.BUGGED:
            error = ck.error_of(rank, variant)
            assert error is not None and error["type"] == "RuntimeError" and MIXED in error["message"], error
            assert error["message"].startswith("aten.embedding.default"), error
        for variant in (v for v in pg.VARIANTS if v not in pg.BUGGED):
            assert_reference(rank.cases[variant], variant)
            assert rank.cases[variant]["values"]["installed"] is False


@pytest.mark.parametrize("variant", pg.VARIANTS)
def test_with_the_plugin_every_variant_equals_the_reference(patched, variant):
    assert not patched.timed_out, patched.describe()
    ck.assert_registry(patched, {PATCH: ck.EXPECTED_STATUS[PATCH]})
    for rank in patched.ranks:
        record = rank.cases[variant]
        assert_reference(record, variant)
        assert record["values"]["installed"] is variant.startswith("peft/"), record["values"]
        assert record["values"]["fired"] == (1 if variant in pg.BUGGED else 0), (variant, record["values"])


@pytest.mark.parametrize("variant", [v for v in pg.VARIANTS if v not in pg.BUGGED])
def test_where_the_bug_does_not_strike_nothing_changes(unpatched, patched, variant):
    """Bitwise equal off and on (ids, gradients, weights), and as many FSDP2 post-forwards: a hand
    registration on the PeftModel root is not wrapped twice, a plain root is left alone."""
    for off, on in zip(unpatched.ranks, patched.ranks):
        got, want = on.cases[variant], off.cases[variant]
        assert got["error"] is None and want["error"] is None, (got["error"], want["error"])
        assert got["values"]["forward_entries"] == want["values"]["forward_entries"], (variant, got["values"])
        for key in ("grads", "params"):
            assert got[key] == want[key], (variant, key)


def test_one_pre_and_post_forward_around_generate(patched):
    """The PeftModel root, fixed or registered by hand, records one post-forward of the root per
    ``generate()`` beside its layers' (a plain root: one per decoding forward): the same counts."""
    for rank in patched.ranks:
        by_hand = rank.cases["peft/by_hand"]["values"]["forward_entries"]
        plain = rank.cases["plain/by_hand"]["values"]["forward_entries"]
        layers = len(case.decoder_layers(case.base_model()))
        # plain root by hand: (layers + root) per decoding forward, + 1 for generate; PEFT root: layers per
        # decoding forward + 1 for generate (the wrapped model's forward runs no hook of the root)
        forwards = (plain - 1) // (layers + 1)
        assert (plain - 1) % (layers + 1) == 0 and by_hand == forwards * layers + 1, (by_hand, plain)
