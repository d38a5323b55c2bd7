"""The demo's model, data and loss: shared by the FSDP ranks and the single-process reference.

The shape constants below say which parts of the model each rank reaches (see the package
docstring for the bug each part hits). The torch classes are defined inside :func:`build_model`
so that importing this module never imports torch.
"""

from __future__ import annotations

WORLD_SIZE = 2
STEPS = 4
MICRO_BATCHES = 3
IMAGE_MICRO_BATCH = MICRO_BATCHES - 1  # only the last micro-batch of each step has images
SEQUENCES = 2  # sequences per micro-batch per rank
SEQ_LEN = 8
VOCAB = 24
DIM = 16
PATCHES = 4
PATCH_DIM = 12
NUM_EXPERTS = 3
TOKENS_PER_EXPERT = VOCAB // NUM_EXPERTS  # hash routing: expert = token_id // 8
SHARED_EXPERT, RANK0_EXPERT, UNUSED_EXPERT = 0, 1, 2
# Token ids each rank's text is drawn from: rank 0 reaches experts 0 and 1, rank 1 expert 0 only,
# and ids 16-23 (expert 2) never occur.
TOKEN_RANGE = {0: 2 * TOKENS_PER_EXPERT, 1: TOKENS_PER_EXPERT}
SEED = 1234
LR = 1e-2
WEIGHT_DECAY = 0.1
GRAD_TOLERANCE = 1e-2  # max |fsdp - ref| <= tol * max |ref| per tensor (bf16 eps is 7.8e-3)

UNUSED_EXPERT_PREFIX = f"moe.experts.{UNUSED_EXPERT}."


def build_model():
    """The tiny vision-language MoE, initialised identically on every rank (fixed seed).

    The classes are defined in here so that importing this module never imports torch.
    """
    import torch
    from torch import nn

    class MoE(nn.Module):
        """Hash-routed experts: a token's id picks its expert, so routing is deterministic."""

        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(
                nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
                for _ in range(NUM_EXPERTS)
            )

        def forward(self, hidden, tokens):
            flat = hidden.reshape(-1, DIM)
            expert_ids = (tokens // TOKENS_PER_EXPERT).reshape(-1)
            out = torch.zeros_like(flat)
            for index, expert in enumerate(self.experts):
                mask = expert_ids == index
                # An expert without tokens does not run, so its parameters get no gradient on
                # this rank: the situation bugs (b), (c) and (d) are about.
                if mask.any():
                    out[mask] = expert(flat[mask])
            return out.reshape(hidden.shape)

    class VisionLanguageMoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.vision = nn.Sequential(nn.Linear(PATCH_DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM))
            self.mixer = nn.Linear(DIM, DIM)
            self.moe = MoE()
            self.head = nn.Linear(DIM, VOCAB)

        def forward(self, tokens, pixels=None):
            hidden = self.embed(tokens)
            if pixels is not None:
                # Text-only batches skip the vision tower entirely (bug (a)'s trigger).
                image = self.vision(pixels).mean(dim=1)
                hidden = hidden + image[:, None, :]
            hidden = hidden + torch.tanh(self.mixer(hidden))
            hidden = hidden + self.moe(hidden, tokens)
            return self.head(hidden)

    torch.manual_seed(SEED)
    return VisionLanguageMoE()


def make_micro_batch(rank: int, micro: int):
    """(tokens, pixels or None, targets) of one rank's micro-batch; the same for every step."""
    import torch

    gen = torch.Generator().manual_seed(SEED + 100 * rank + micro)
    tokens = torch.randint(0, TOKEN_RANGE[rank], (SEQUENCES, SEQ_LEN), generator=gen)
    if rank == 0:
        # Make sure rank 0 uses both of its experts in every micro-batch, so that without the fill
        # both ranks hold uniformly fp32-accumulated gradients and bug (b) shows on its own.
        tokens[0, 0] = SHARED_EXPERT * TOKENS_PER_EXPERT
        tokens[0, 1] = RANK0_EXPERT * TOKENS_PER_EXPERT
    targets = (tokens * 5 + 3) % VOCAB  # a learnable token -> token mapping
    pixels = None
    if micro == IMAGE_MICRO_BATCH:
        pixels = torch.randn(SEQUENCES, PATCHES, PATCH_DIM, generator=gen)
    return tokens, pixels, targets


def loss_fn(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
