"""uniform_reduce_dtype's widening rule, on plain tensors (no process group needed)."""

import pytest

torch = pytest.importorskip("torch")

from fsdp_autopatch.patches.uniform_reduce_dtype import make_uniform, widest_float_dtype  # noqa: E402


def test_bf16_with_fp32_widens_to_fp32_in_place_without_changing_values():
    fp32 = torch.randn(4)
    bf16 = torch.randn(3).to(torch.bfloat16)
    grads = [fp32, bf16]
    make_uniform(grads)
    assert [g.dtype for g in grads] == [torch.float32, torch.float32]
    assert grads[0] is fp32  # already wide: the same tensor object
    assert torch.equal(grads[1], bf16.float())


def test_bf16_with_fp16_widens_to_fp32_not_an_arbitrary_pick():
    grads = [torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float16)]
    make_uniform(grads)
    assert {g.dtype for g in grads} == {torch.float32}
    assert widest_float_dtype([torch.bfloat16, torch.float16]) == torch.float32


def test_uniform_list_passes_through_untouched():
    grads = [torch.zeros(2, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)]
    before = [id(g) for g in grads]
    make_uniform(grads)
    assert [id(g) for g in grads] == before


def test_non_float_mixture_is_left_for_the_upstream_assertion():
    grads = [torch.zeros(2, dtype=torch.float32), torch.zeros(2, dtype=torch.int64)]
    make_uniform(grads)
    assert [g.dtype for g in grads] == [torch.float32, torch.int64]


def test_fp8_mixture_without_a_promotion_is_left_alone():
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        pytest.skip("no float8 in this torch")
    grads = [torch.zeros(2, dtype=torch.float32), torch.zeros(2).to(fp8)]
    make_uniform(grads)
    assert [g.dtype for g in grads] == [torch.float32, fp8]


DTENSOR_PROGRAM = r"""
import json, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from fsdp_autopatch.patches.uniform_reduce_dtype import localize, make_uniform
mesh = init_device_mesh("cpu", (1,))
local = torch.randn(3, dtype=torch.bfloat16)
plain = torch.randn(4)
grads = [plain, DTensor.from_local(local, mesh, [Replicate()])]
count = localize(grads)
make_uniform(grads)
print(json.dumps({
    "count": count, "types": [type(g).__name__ for g in grads], "dtypes": [str(g.dtype) for g in grads],
    "plain_kept": grads[0] is plain, "values": torch.equal(grads[1], local.float()),
    "again": localize(grads),
}))
dist.destroy_process_group()
"""


def test_a_dtensor_entry_is_made_local_then_widened():
    """Vendor 2.13.0a0 builds hand foreach_reduce DTensor gradients among plain tensors."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "FSDP_AUTOPATCH_ENABLED": "0", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-c", DTENSOR_PROGRAM]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.splitlines()[-1])
    assert got == {"count": 1, "types": ["Tensor", "Tensor"], "dtypes": ["torch.float32", "torch.float32"],
                   "plain_kept": True, "values": True, "again": 0}
