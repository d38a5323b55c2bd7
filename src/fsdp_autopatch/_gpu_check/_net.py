"""Rank side of ``fsdp-autopatch gpu-check``: what every case of a rank is given. The training
flavours' and compile modes' model, data, loop and reference are the demo's
(``fsdp_autopatch.cases._four_bugs``). Imports torch (rank processes only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Ctx:
    rank: int
    world_size: int
    device: torch.device
    compile_backend: str

    def mesh(self, names: tuple[str, ...] | None = None):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=names)
