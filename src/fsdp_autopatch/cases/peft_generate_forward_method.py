"""peft_generate_forward_method's case: ``generate()`` on a LoRA ``PeftModel`` that is FSDP2's root (TRL
issue 4550), with the real ``peft`` package and a tiny transformers Llama built from a config (no download).

The record's ``"params"`` holds the LoRA weights after the training step and, beside them, the token ids
``generate()`` returned before the first step (``generate.before``) and after it (``generate.after``):
integers, so "within tolerance of the reference" means equal.
"""

from __future__ import annotations

from typing import Any

from ._common import fsdp_api, full, judge_against_reference, listed, sum_reduction

WORLD_SIZE = 2
NEEDS = ("peft", "transformers")
WHAT = (
    "a tiny Llama (built from a config) with LoRA adapters (peft.get_peft_model); fully_shard on each decoder "
    "layer, then on the PeftModel (the root, as TRL / Accelerate do); greedy generate() before the first training "
    "step, one SGD step on each rank's batch, generate() again"
)
VOCAB = 64
NEW_TOKENS = 5
LR = 0.5


def base_model():
    """A 2-layer Llama built from a config: the same weights in every process (seeded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def model():
    """The LoRA PeftModel around :func:`base_model`."""
    import torch
    from peft import LoraConfig, get_peft_model

    base = base_model()
    torch.manual_seed(1)  # init_lora_weights=False: both LoRA matrices random, so A and B both train
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(base, lora)


def decoder_layers(any_model):
    """The decoder layers of a PeftModel's base model, or of the Llama itself."""
    base = any_model.get_base_model() if hasattr(any_model, "get_base_model") else any_model
    return base.model.layers


def prompt(device: str = "cpu"):
    import torch

    return torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(7)).to(device)


def batch(rank: int, device: str = "cpu"):
    import torch

    return torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(100 + rank)).to(device)


def generate(peft_model, device: str = "cpu") -> list:
    """Greedy decoding of :func:`prompt`: the token ids (prompt included), as a list."""
    import torch

    with torch.no_grad():
        out = peft_model.generate(input_ids=prompt(device), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  pad_token_id=0)
    return out.cpu().tolist()


def loss(peft_model, ids):
    return peft_model(input_ids=ids, labels=ids).loss


def trainable(peft_model) -> dict[str, Any]:
    return {name: p for name, p in peft_model.named_parameters() if p.requires_grad}


def shard(peft_model, mesh) -> None:
    """Each decoder layer a unit, then the PeftModel (the root: embedding, final norm, LM head)."""
    _, _, fully_shard = fsdp_api()
    for layer in decoder_layers(peft_model):
        fully_shard(layer, mesh=mesh)
    fully_shard(peft_model, mesh=mesh)
    sum_reduction(peft_model, *decoder_layers(peft_model))


def train(sharded, rank: int, world_size: int, device: str = "cpu", before: bool = True, after: bool = True):
    """On every rank: ``generate()`` (before the first step), one SGD step on the rank's batch, ``generate()``
    again (after it); the record (see the module docstring)."""
    import torch

    optimizer = torch.optim.SGD(list(trainable(sharded).values()), lr=LR)
    ids = {"generate.before": generate(sharded, device)} if before else {}  # FSDP2's lazy init has not run
    loss(sharded, batch(rank, device)).backward()
    grads = listed({name: full(p.grad) for name, p in trainable(sharded).items() if p.grad is not None})
    optimizer.step()
    optimizer.zero_grad()
    if after:
        ids["generate.after"] = generate(sharded, device)
    params = listed({name: full(p) for name, p in trainable(sharded).items()})
    return {"grads": grads, "params": {**params, **ids}}


def one_process(plain, world_size: int, before: bool = True, after: bool = True) -> dict[str, Any]:
    """:func:`train` in one process without FSDP2: the mean of every rank's loss (FSDP2's reduction)."""
    import torch

    optimizer = torch.optim.SGD(list(trainable(plain).values()), lr=LR)
    ids = {"generate.before": generate(plain)} if before else {}
    for rank in range(world_size):
        (loss(plain, batch(rank)) / world_size).backward()
    grads = listed({name: p.grad for name, p in trainable(plain).items() if p.grad is not None})
    optimizer.step()
    optimizer.zero_grad()
    if after:
        ids["generate.after"] = generate(plain)
    return {"grads": grads, "params": {**listed(trainable(plain)), **ids}}


def run(rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    _, init_device_mesh, _ = fsdp_api()
    mesh = init_device_mesh(device, (world_size,))
    peft_model = model().to(device)
    shard(peft_model, mesh)
    return train(peft_model, rank, world_size, device)


def reference(world_size: int) -> dict[str, Any]:
    return one_process(model(), world_size)


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """Right: the ids of both ``generate()`` calls, the gradients and the LoRA weights equal the reference's."""
    right, text = judge_against_reference(record, reference)
    ids = [key for key in ("generate.before", "generate.after") if key in reference["params"]]
    same = all(record.get("params", {}).get(key) == reference["params"][key] for key in ids)
    return right and same, f"generate() ids before and after the step {'equal' if same else 'differ from'} the " \
        f"reference's; {text}"
