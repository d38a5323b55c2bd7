"""An unmodified FSDP2 script training a Hugging Face ``transformers`` mixture-of-experts model.

It never imports fsdp_autopatch. Tiny configs are built in code with random weights: nothing is
downloaded (no ``from_pretrained``). Two models, chosen with ``--model``:

* ``switch_transformers`` (default): ``SwitchTransformersEncoderModel`` keeps ONE MODULE PER
  EXPERT (``SwitchTransformersExperts`` is an ``nn.ModuleDict`` of ``expert_<i>`` MLPs) and only
  calls the experts that received tokens. Rank 0 routes all its tokens to expert 0, rank 1 to
  expert 1; experts 2 and 3 get tokens from no rank.
* ``qwen3_moe``: ``Qwen3MoeForCausalLM`` stores all experts in one fused 3-D parameter
  (``Qwen3MoeExperts.gate_up_proj``): the healthy control, every rank uses the same parameters.

``--wrap`` says how the experts are sharded:

* ``experts`` (default): each MoE block (router + all its experts) is one FSDP unit, with
  ``set_reduce_scatter_unused_params(True)`` (torch >= 2.13, or fsdp-autopatch's backport) so
  that ranks using different experts still issue the same reduce-scatter; plus one unit per
  layer and the root.
* ``per-expert``: one FSDP unit per expert module. An expert that runs on one rank only issues
  its forward all-gather on that rank only: the ranks' collectives pair up wrongly. No patch can
  fix that (see docs/guides/transformers.md); kept to show the failure.

The routing is forced by the choice of inputs, not by changing the model: a sequence that
repeats one token id has the same hidden state at every position (attention averages identical
values), so each token id routes to one expert in every MoE layer. A probe forward over all
token ids, run identically on every rank before sharding, picks for rank r the ids that go to
expert r.

The reference: every rank keeps an unsharded copy of the same model (same seed) and runs the
global batch (all ranks' micro-batches concatenated) in a single process. Gradients of every
parameter must equal the reference (fp32, rtol 1e-5), a parameter without a reference gradient
must have ``grad is None``, and after AdamW (weight decay 0.1) the never-used experts keep their
weights.

    torchrun --standalone --nproc-per-node 2 examples/hf_moe_experts.py [--model qwen3_moe]

One JSON line per rank (``{"rank", "ok", "problems", "max_grad_diff", ...}``); exit 0 when the
run matches the reference, 1 otherwise.
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
from torch.distributed.fsdp import fully_shard

N_EXPERTS = 4  # rank r uses expert r; experts 2 and 3 are used by no rank
VOCAB, SEQ, BATCH = 96, 6, 2
STEPS, MICRO_BATCHES = 2, 2
RTOL, ATOL = 1e-5, 1e-6  # fp32: FSDP and the reference differ only in summation order


# --- the two models ---------------------------------------------------------------------------


def build_switch():
    from transformers import SwitchTransformersConfig, SwitchTransformersEncoderModel

    config = SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_heads=2,
        num_layers=2, num_sparse_encoder_layers=1,  # layer 1 is the MoE layer
        num_experts=N_EXPERTS, expert_capacity=SEQ,  # capacity per sequence: no token dropped
        router_jitter_noise=0.0, dropout_rate=0.0,
    )
    return SwitchTransformersEncoderModel(config)


def build_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_experts=N_EXPERTS, num_experts_per_tok=1, max_position_embeddings=32,
    )
    return Qwen3MoeForCausalLM(config)


def switch_moe_layers(model):
    """(MoE block, its experts, its router) of every MoE layer."""
    mlps = [block.layer[-1].mlp for block in model.encoder.block]
    return [(mlp, mlp.experts, mlp.router) for mlp in mlps if hasattr(mlp, "experts")]


def qwen3_moe_layers(model):
    return [(layer.mlp, layer.mlp.experts, layer.mlp.gate) for layer in model.model.layers]


def switch_top1(router_output):
    expert_index = router_output[0]  # one-hot dispatch mask (batch, seq, experts)
    return expert_index.argmax(-1).reshape(-1)


def qwen3_top1(router_output):
    return router_output[2][:, 0]  # selected experts (tokens, top_k)


def switch_loss(model, input_ids, target):
    hidden = model(input_ids=input_ids).last_hidden_state
    return (hidden - target).pow(2).mean()


def qwen3_loss(model, input_ids, target):
    return model(input_ids=input_ids, labels=input_ids).loss


MODELS = {
    "switch_transformers": (build_switch, switch_moe_layers, switch_top1, switch_loss),
    "qwen3_moe": (build_qwen3_moe, qwen3_moe_layers, qwen3_top1, qwen3_loss),
}


# --- inputs that force the routing ------------------------------------------------------------


@torch.no_grad()
def token_ids_per_expert(model, moe_layers, top1) -> dict:
    """Which token ids send every token of a repeated-id sequence to the same expert in every
    MoE layer: {expert: [ids]}."""
    chosen = []
    hooks = [router.register_forward_hook(lambda m, a, out: chosen.append(top1(out)))
             for _, _, router in moe_layers]
    ids = torch.arange(VOCAB).unsqueeze(1).expand(VOCAB, SEQ)
    model(input_ids=ids)
    for h in hooks:
        h.remove()
    per_layer = torch.stack([c.reshape(VOCAB, SEQ) for c in chosen])  # (layers, ids, positions)
    first = per_layer[0, :, 0]
    uniform = (per_layer == first.view(1, VOCAB, 1)).all(dim=2).all(dim=0)
    return {e: [t for t in range(VOCAB) if uniform[t] and first[t] == e] for e in range(N_EXPERTS)}


def micro_batch(rank: int, step: int, mb: int, ids_of: dict):
    """A rank's micro-batch: sequences that each repeat one id routed to expert ``rank``."""
    pool = ids_of[rank]
    ids = [pool[(2 * mb + b) % len(pool)] for b in range(BATCH)]
    input_ids = torch.tensor(ids).unsqueeze(1).expand(BATCH, SEQ).contiguous()
    g = torch.Generator().manual_seed(100 * rank + mb)  # the same data every step
    target = torch.randn(BATCH, SEQ, 16, generator=g)
    return input_ids, target


# --- sharding -------------------------------------------------------------------------------


def shard(model, moe_layers, all_layers, mesh, wrap: str) -> None:
    for moe_block, experts, _ in moe_layers:
        if wrap == "per-expert":
            for expert in experts.values() if isinstance(experts, torch.nn.ModuleDict) else [experts]:
                fully_shard(expert, mesh=mesh)
        else:
            # the MoE block (router + experts), not the experts container: fully_shard rejects
            # an nn.ModuleDict such as SwitchTransformersExperts before torch 2.13
            fully_shard(moe_block, mesh=mesh)
            # ranks use different experts of this unit: reduce-scatter the unused ones too
            if hasattr(moe_block, "set_reduce_scatter_unused_params"):  # torch >= 2.13 (or the backport)
                moe_block.set_reduce_scatter_unused_params(True)
    for layer in all_layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compare_grads(model, ref, step: int, problems: list) -> float:
    params = list(model.named_parameters())
    # ranks may disagree on which grads exist (that is a bug too): agree first, so that every
    # rank issues the same full_tensor() all-gathers
    has_grad = torch.tensor([p.grad is not None for _, p in params], dtype=torch.int32)
    dist.all_reduce(has_grad)
    worst = 0.0
    for (name, p), (_, r), n_ranks in zip(params, ref.named_parameters(), has_grad.tolist()):
        if n_ranks not in (0, dist.get_world_size()):
            problems.append(f"step {step}: {name}: grad is set on {n_ranks} rank(s) only")
        if n_ranks == 0 or r.grad is None:
            if (n_ranks == 0) != (r.grad is None):
                problems.append(f"step {step}: {name}: grad is {'None' if n_ranks == 0 else 'set'}, "
                                f"reference {'None' if r.grad is None else 'set'}")
            continue
        g = full(p.grad if p.grad is not None else torch.zeros_like(p))
        diff = float((g - r.grad).abs().max())
        worst = max(worst, diff)
        if not torch.allclose(g, r.grad, rtol=RTOL, atol=ATOL):
            problems.append(f"step {step}: {name}: grad differs from the reference by {diff:.2e}")
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
    parser.add_argument("--model", choices=sorted(MODELS), default="switch_transformers")
    parser.add_argument("--wrap", choices=["experts", "per-expert"], default="experts")
    args = parser.parse_args()
    build, moe_layers_of, top1, loss_fn = MODELS[args.model]

    rank = int(os.environ["RANK"])
    timeout = timedelta(seconds=int(os.environ.get("EXAMPLE_PG_TIMEOUT_S", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    torch.manual_seed(0)
    model = build()
    model.train()
    ids_of = token_ids_per_expert(model, moe_layers_of(model), top1)
    if any(not ids_of[r] for r in range(world)):
        raise SystemExit(f"no token id routes to the expert of every rank: {ids_of}")
    ref = copy.deepcopy(model)  # the single-process reference, on every rank
    ref_moe = moe_layers_of(ref)

    moe_layers = moe_layers_of(model)
    all_layers = model.encoder.block if args.model == "switch_transformers" else model.model.layers
    shard(model, moe_layers, all_layers, mesh, args.wrap)
    # every expert module's parameters (none for fused experts: one 3-D parameter for all)
    expert_params = {
        f"moe_layer{i}.expert{e}": (list(experts[f"expert_{e}"].parameters()),
                                list(ref_moe[i][1][f"expert_{e}"].parameters()))
        for i, (_, experts, _) in enumerate(moe_layers) if isinstance(experts, torch.nn.ModuleDict)
        for e in range(N_EXPERTS)
    }
    before = {name: [full(p).detach().clone() for p in ps] for name, (ps, _) in expert_params.items()}
    never_used = set(expert_params)  # the router learns: an expert may get tokens in a later step

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    problems, max_grad_diff, losses = [], 0.0, []
    for step in range(STEPS):
        total = 0.0
        for mb in range(MICRO_BATCHES):
            model.set_requires_gradient_sync(mb == MICRO_BATCHES - 1)
            input_ids, target = micro_batch(rank, step, mb, ids_of)
            loss = loss_fn(model, input_ids, target)
            loss.backward()
            total += loss.item()
            # reference: the global micro-batch (every rank's, concatenated) in one process
            batches = [micro_batch(r, step, mb, ids_of) for r in range(world)]
            ref_loss = loss_fn(ref, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
            ref_loss.backward()
        losses.append(round(total / MICRO_BATCHES, 4))
        # grads equal the reference, and grad is None exactly where the reference has None
        max_grad_diff = max(max_grad_diff, compare_grads(model, ref, step, problems))
        never_used -= {name for name, (_, ref_ps) in expert_params.items()
                       if any(r.grad is not None for r in ref_ps)}
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        sync_reference(model, ref)

    moved = max((float((full(p).detach() - b).abs().max()) for name in never_used
                 for p, b in zip(expert_params[name][0], before[name])), default=0.0)
    if moved != 0.0:
        problems.append(f"AdamW moved a never-used expert by {moved:.2e}")
    print(json.dumps({
        "rank": rank,
        "ok": not problems,
        "problems": problems[:12],
        "model": args.model,
        "wrap": args.wrap,
        "class": type(model).__name__,
        "max_grad_diff": max_grad_diff,
        "never_used_experts": sorted(never_used),
        "unused_expert_moved": moved,
        "token_ids": {str(r): ids_of[r][:4] for r in range(world)},
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
