"""An unmodified FSDP2 script training a Hugging Face ``transformers`` vision-language model.

It never imports fsdp_autopatch. ``LlavaForConditionalGeneration`` with a tiny CLIP vision tower
and a tiny Llama language model, built in code with random weights: nothing is downloaded.

The job the bug reports describe: the vision tower is its own FSDP unit, most micro-batches are
text-only (the tower never runs forward), ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``, gradient accumulation over 2 micro-batches with
``set_requires_gradient_sync``:

* step 0: both micro-batches text-only: the tower's FSDPParamGroup is skipped -> bug (a);
* step 1: text-only, then a micro-batch with images: the tower and the multi-modal projector get
  their first gradient next to fp32 accumulated gradients -> bug (c);
* step 2: images, then text-only.

``--images-first`` starts with an images micro-batch instead (to show the ``--wrap vision_tower``
failure below without the plugin, where bug (a) would crash step 0 first).

``--wrap`` says which module is the vision unit:

* ``vision_encoder`` (default): ``model.model.vision_tower.encoder`` (all CLIP layers).
* ``vision_tower``: the ``CLIPVisionModel`` itself. ``fully_shard`` swaps its class for
  ``FSDPCLIPVisionModel``, and transformers 5.x looks up the model's output-capture settings
  (``_can_record_outputs``) by ``str(model.__class__)``: the lookup misses, the tower returns
  ``hidden_states=None`` and the first forward with images fails in ``get_image_features`` with
  ``TypeError: 'NoneType' object is not subscriptable``, with or without fsdp-autopatch (see
  docs/guides/transformers.md). Wrapping the encoder instead is the workaround.

The reference: every rank keeps an unsharded fp32 copy of the model (same seed) and runs the
global micro-batch (every rank's, concatenated) in one process. FSDP computes in bf16, so each
gradient must match with a norm-relative error ||g - g_ref|| / max(||g_ref||, 1e-2) <= 5e-2
(``BF16_REL``, ``BF16_FLOOR``): bf16 keeps 8 mantissa bits (~4e-3 per rounding, compounded through
a few layers); the same global batch run in one process with bf16 weights is already 1.7e-2 away
from the fp32 reference. The 1e-2 floor is for gradients that are zero in exact arithmetic (they
hold only rounding noise). ``grad is None`` must match exactly (the tower after the text-only
step 0). After each AdamW step the reference takes FSDP's weights, so each step compares gradients
at the same weights.

    torchrun --standalone --nproc-per-node 2 examples/hf_vlm_text_only.py [--wrap vision_tower --images-first]

One JSON line per rank; exit 0 when the run matches the reference, 1 otherwise (``--wrap
vision_tower`` fails with the ``TypeError`` above, with or without the plugin).
"""

import argparse
import copy
import json
import os
import sys
from datetime import timedelta

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tiny configs in code: nothing to download

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

VOCAB, SEQ, BATCH = 64, 8, 2
IMAGE_TOKEN = VOCAB - 1
IMAGE_SIZE, PATCH = 8, 4  # 4 patches per image -> 4 image tokens (the CLS token is dropped)
N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
MICRO_BATCHES = 2
# which micro-batches carry images, per step
TEXT_FIRST = [(False, False), (False, True), (True, False)]
IMAGES_FIRST = [(True, False), (False, True), (False, False)]  # --images-first
# bf16 tolerance: the same global batch run in ONE process with bf16 weights differs from the fp32
# reference by up to 1.7e-2 (norm-relative, measured on this model); FSDP2 (bf16 compute, fp32
# reduction) measured up to 1.95e-2. A lost or a doubled micro-batch is off by 0.64 - 1.12
# (measured, per step).
BF16_REL = 5e-2
# a gradient that is zero in exact arithmetic (the attention key bias: softmax ignores a shift
# that is the same for every key) is compared with this norm instead of its own rounding noise
BF16_FLOOR = 1e-2


def build_model():
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=16,
        ).to_dict(),
        text_config=LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        ).to_dict(),
        image_token_id=IMAGE_TOKEN,
        vision_feature_layer=-1,
    )
    return LlavaForConditionalGeneration(config)


def micro_batch(rank: int, step: int, mb: int, schedule=TEXT_FIRST) -> dict:
    """Token ids (with 4 image placeholders when the micro-batch has images), labels, pixels."""
    g = torch.Generator().manual_seed(100 * rank + 10 * step + mb)
    input_ids = torch.randint(0, VOCAB - 1, (BATCH, SEQ), generator=g)
    with_images = schedule[step][mb]
    batch = {"input_ids": input_ids}
    if with_images:
        input_ids[:, 1:1 + N_IMAGE_TOKENS] = IMAGE_TOKEN
        batch["pixel_values"] = torch.randn(BATCH, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    labels = input_ids.clone()
    labels[labels == IMAGE_TOKEN] = -100  # same count on every rank: the mean of means is exact
    batch["labels"] = labels
    return batch


def global_batch(world: int, step: int, mb: int, schedule) -> dict:
    parts = [micro_batch(r, step, mb, schedule) for r in range(world)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def shard(model, mesh, wrap: str) -> None:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    tower = model.model.vision_tower
    fully_shard(tower if wrap == "vision_tower" else tower.encoder, mesh=mesh, mp_policy=mp)
    for layer in model.model.language_model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compare_grads(model, ref, step: int, problems: list) -> float:
    params = list(model.named_parameters())
    has_grad = torch.tensor([p.grad is not None for _, p in params], dtype=torch.int32)
    dist.all_reduce(has_grad)  # agree first, so that every rank issues the same all-gathers
    worst = 0.0
    for (name, p), (_, r), n_ranks in zip(params, ref.named_parameters(), has_grad.tolist()):
        if n_ranks not in (0, dist.get_world_size()):
            problems.append(f"step {step}: {name}: grad is set on {n_ranks} rank(s) only")
        if n_ranks == 0 or r.grad is None:
            if (n_ranks == 0) != (r.grad is None):
                problems.append(f"step {step}: {name}: grad is {'None' if n_ranks == 0 else 'set'}, "
                                f"reference {'None' if r.grad is None else 'set'}")
            continue
        g = full(p.grad if p.grad is not None else torch.zeros_like(p)).float()
        err, scale = float((g - r.grad).norm()), float(r.grad.norm())
        rel = err / max(scale, BF16_FLOOR)
        worst = max(worst, rel)
        if rel > BF16_REL:
            problems.append(f"step {step}: {name}: grad differs from the reference by {rel:.2e} "
                            f"(||g - g_ref|| = {err:.2e}, ||g_ref|| = {scale:.2e})")
    return worst


@torch.no_grad()
def sync_reference(model, ref) -> None:
    """The reference takes the weights FSDP's AdamW produced, so that every step compares the
    gradients of the same weights. (Stepping the reference with its own AdamW would not do:
    Adam's m/sqrt(v) turns last-bit differences of near-zero gradient entries into lr-sized
    weight differences, and later gradients would be computed at different weights.)"""
    for p, r in zip(model.parameters(), ref.parameters()):
        r.copy_(full(p))


def applied_by_the_plugin() -> list[str] | None:
    """The patches fsdp-autopatch applied in this process (None: not loaded). Not an import: if it is
    installed, its .pth armed it at interpreter start and it loaded when this script imported torch."""
    plugin = sys.modules.get("fsdp_autopatch")
    return None if plugin is None else list(plugin.applied())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrap", choices=["vision_encoder", "vision_tower"], default="vision_encoder")
    parser.add_argument("--images-first", action="store_true",
                        help="start with a micro-batch with images (no text-only step 0)")
    args = parser.parse_args()
    schedule = IMAGES_FIRST if args.images_first else TEXT_FIRST

    rank = int(os.environ["RANK"])
    timeout = timedelta(seconds=int(os.environ.get("EXAMPLE_PG_TIMEOUT_S", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    torch.manual_seed(0)
    model = build_model()
    model.train()
    ref = copy.deepcopy(model)  # the single-process fp32 reference, on every rank
    shard(model, mesh, args.wrap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    problems, worst, losses, tower_grad_none_step0 = [], 0.0, [], None
    for step in range(len(schedule)):
        total = 0.0
        for mb in range(MICRO_BATCHES):
            model.set_requires_gradient_sync(mb == MICRO_BATCHES - 1)
            loss = model(**micro_batch(rank, step, mb, schedule)).loss
            loss.backward()
            total += loss.item()
            ref(**global_batch(world, step, mb, schedule)).loss.backward()
        losses.append(round(total / MICRO_BATCHES, 4))
        worst = max(worst, compare_grads(model, ref, step, problems))
        if step == 0 and not schedule[0][0] and not schedule[0][1]:
            tower_grad_none_step0 = all(p.grad is None for p in model.model.vision_tower.parameters())
            if not tower_grad_none_step0:
                problems.append("step 0: the skipped vision tower got a gradient")
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        sync_reference(model, ref)

    print(json.dumps({
        "rank": rank,
        "ok": not problems,
        "problems": problems[:12],
        "wrap": args.wrap,
        "tower_class": type(model.model.vision_tower).__name__,
        "max_grad_rel_diff": worst,
        "tolerance": BF16_REL,
        "tower_grad_none_on_text_only_step": tower_grad_none_step0,
        "loss": losses,
        "fsdp_autopatch_applied": applied_by_the_plugin(),  # via the .pth, never imported here
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }), flush=True)
    # Every rank past its last collective before any leaves: a peer still waiting on a rank that has
    # exited fails with gloo's 'Connection closed by peer'. (A rare abort at exit, 'terminate called
    # without an active exception', is another thing: docs/troubleshooting.md.)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
