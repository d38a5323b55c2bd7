"""peft_generate_forward_method's variants (2 gloo ranks), the plugin as installed or the entry off.

The bug's own run (``generate()`` on the PeftModel root before the first step, a step, ``generate()``
again) is its case, ``fsdp_autopatch.cases.peft_generate_forward_method``, whose model, steps and
record these reuse (each variant a fresh model; an exception is the variant's recorded error):

- ``peft/after_step``: ``generate()`` only after the first training step (FSDP2's lazy init done);
- ``peft/by_hand``: ``register_fsdp_forward_method(model, "generate")`` after ``fully_shard``, as
  transformers' Trainer and many scripts do: the patch's ``generate`` must pass through (no second
  pre-/post-forward, no fire);
- ``plain/before_and_after``: the Llama itself as the root (no PEFT): its ``generate`` runs the
  root's forward, so nothing is installed and nothing changes;
- ``plain/by_hand``: the same root registered by hand (the "9e-3 after generate on a plain root"
  question: the values against the one-process reference).

Each records the case's record, plus ``values``: the fires of the entry during the variant, the
``post_forward_order`` entries FSDP2 recorded by the end of the first ``generate()`` (one per unit
forward: a second pre-/post-forward around ``generate`` adds one), and whether the module holds an
instance ``generate`` and whose.
"""

from __future__ import annotations

from typing import Any

import _dist_common as sc
from _registry import scenario
from fsdp_autopatch.cases import peft_generate_forward_method as case

NAME = "peft_generate_forward_method"
VARIANTS = ("plain/before_and_after", "plain/by_hand", "peft/by_hand", "peft/after_step")
BUGGED = ("peft/after_step",)  # fail without the entry (the case itself is the other)
AFTER_ONLY = ("peft/after_step",)


def _fires() -> int:
    import fsdp_autopatch

    return fsdp_autopatch.status()[NAME].fired


def _forward_entries(sharded) -> int:
    """FSDP2's ``post_forward_order`` length: one entry per post-forward of a unit since the last backward."""
    return len(sharded._get_fsdp_state()._comm_ctx.post_forward_order)


def run_variant(ctx: sc.Ctx, variant: str, rec: dict[str, Any]) -> None:
    import torch.distributed.fsdp as fsdp

    fires = _fires()
    sharded = case.model() if variant.startswith("peft/") else case.base_model()
    case.shard(sharded, ctx.mesh)
    own = vars(sharded).get("generate")
    rec["values"] = {"installed": own is not None and getattr(own, "__fsdp_autopatch_patch__", None) == NAME}
    if variant.endswith("/by_hand"):
        fsdp.register_fsdp_forward_method(sharded, "generate")
    after_only = variant in AFTER_ONLY
    entries = []
    original = case.generate

    def counted(model, device="cpu"):  # the post_forward_order entries once the first generate() returned
        ids = original(model, device)
        entries.append(_forward_entries(model))
        return ids

    case.generate = counted
    try:
        rec.update(case.train(sharded, ctx.rank, ctx.world_size, before=not after_only))
    finally:
        case.generate = original
    rec["values"].update({"fired": _fires() - fires, "forward_entries": entries[0]})


@scenario("peft_generate_forward_method")
def sc_peft_generate(ctx: sc.Ctx) -> None:
    for variant in VARIANTS:
        with ctx.case(variant, continue_on_error=True) as rec:
            run_variant(ctx, variant, rec)
