"""clip_grad_norm_cpu_offload in one process: the structural check, and which inputs it leaves to
torch (plain tensors, a mesh whose group serves the gradients' device, one rank). Its values (the
2-rank CPU stand-in) are in tests/distributed/test_dist_clip_grad_norm_cpu_offload.py."""

import pytest

torch = pytest.importorskip("torch")
clip_grad = pytest.importorskip("torch.nn.utils.clip_grad")
pytest.importorskip("torch.distributed.fsdp")  # the plugin applies its patches here

from fsdp_autopatch.patches import clip_grad_norm_cpu_offload as fix  # noqa: E402


def test_verdict_on_this_torch_is_needed():
    assert fix._structural_check().status == "needed"


def test_a_parameter_torch_adds_with_a_default_leaves_it_needed(monkeypatch):
    # bound by name: PyTorch PR 194033's dtype (or any parameter with a default) keeps the verdict
    def _get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None, dtype=None):
        return original(tensors, norm_type, error_if_nonfinite, foreach)

    original = clip_grad._get_total_norm
    monkeypatch.setattr(clip_grad, "_get_total_norm", _get_total_norm)
    names = set(fix._compat.names_read(_get_total_norm.__code__))
    monkeypatch.setattr(fix._compat, "reads_names", lambda f, *n: f is not _get_total_norm or names.issuperset(
        set(n) - set(fix._LOOP)))
    assert fix._structural_check().status == "needed"


def test_a_parameter_torch_adds_without_a_default_makes_it_unsupported(monkeypatch):
    def _get_total_norm(tensors, norm_type, error_if_nonfinite, foreach, mode):
        return None

    monkeypatch.setattr(clip_grad, "_get_total_norm", _get_total_norm)
    verdict = fix._structural_check()
    assert verdict.status == "unsupported" and "mode" in verdict.reason


def _call(*args, **kwargs):
    from fsdp_autopatch import _isolation

    def _get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None, dtype=None, *, mode="a"):
        return None

    return _isolation.Call(_get_total_norm, args, kwargs, _isolation.Binder(_get_total_norm, fix._READS))


def test_the_dtype_is_read_by_name_and_another_value_of_an_unknown_parameter_goes_to_torch():
    assert fix._dtype_of(_call([], 2.0, False, None)) is None  # torch's own callers of 2.8 - 2.15
    assert fix._dtype_of(_call([], 2.0, False, None, torch.float64)) is torch.float64
    assert fix._dtype_of(_call([], 2.0, dtype=torch.float64, mode="a")) is torch.float64  # at its default
    assert fix._dtype_of(_call([], 2.0, mode="b")) is fix._STEP_ASIDE  # a behaviour only torch knows
    assert fix._dtype_of(_call([], 2.0, nonsense=1)) is fix._STEP_ASIDE  # torch's own TypeError


def test_norms_in_a_dtype_are_vector_norms_in_it():
    tensors = [torch.randn(5), torch.randn(3, 2).bfloat16()]
    for foreach in (None, False):
        norms = fix._norms_where_they_live(tensors, 2.0, foreach, torch.float64)
        assert [n.dtype for n in norms] == [torch.float64] * 2
        want = [torch.linalg.vector_norm(t, 2.0, dtype=torch.float64) for t in tensors]
        assert sorted(map(float, norms)) == sorted(map(float, want))  # in torch's (device, dtype) group order


def test_a_total_norm_that_reduces_on_the_mesh_device_is_conclusively_not_needed(monkeypatch):
    def _get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        return torch.stack([t.to(t.device_mesh.device_type) for t in tensors])

    monkeypatch.setattr(clip_grad, "_get_total_norm", _get_total_norm)
    verdict = fix._structural_check()
    assert (verdict.status, verdict.conclusive) == ("not_needed", True)


def test_other_shapes_are_unsupported(monkeypatch):
    def _get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        return sum(t.norm() for t in tensors)  # no per-(device, dtype) loop: not the code it mirrors

    monkeypatch.setattr(clip_grad, "_get_total_norm", _get_total_norm)
    assert fix._structural_check().status == "unsupported"


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0, 0.0])
@pytest.mark.parametrize("foreach", [None, True, False])
def test_plain_tensors_are_torchs_bitwise(norm_type, foreach):
    from fsdp_autopatch import _compat

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, generator=gen), torch.randn(3, 2, generator=gen).bfloat16()]
    got = torch.nn.utils.get_total_norm(tensors, norm_type, foreach=foreach)
    assert torch.equal(got, _compat.innermost(clip_grad._get_total_norm)(tensors, norm_type, foreach=foreach))
    assert fix._stranded(tensors) is None


def test_a_group_that_serves_the_gradients_device_is_left_to_torch(fake_mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    grads = [distribute_tensor(torch.randn(8, 4), fake_mesh, [Shard(0)]) for _ in range(2)]
    assert fix._stranded(grads) is None  # the fake backend serves the CPU
    assert fix._stranded([]) is None


def _offloaded(mesh, rows: int = 8):
    """A DTensor on ``mesh`` whose local shard is a CPU tensor (as FSDP2's CPU offload makes it)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    local = torch.randn(rows // mesh.size(0), 4)
    meta = TensorMeta(torch.Size([rows, 4]), (4, 1), local.dtype)
    return DTensor(local, DTensorSpec(mesh, (Shard(0),), tensor_meta=meta), requires_grad=False)


def test_a_group_without_a_backend_for_the_gradients_device_is_stranded():
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("cuda:fake", store=FakeStore(), rank=0, world_size=2)  # NCCL's shape: cuda only
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
        grads = [_offloaded(mesh), _offloaded(mesh)]
        assert fix._stranded(grads) is mesh
        cpu_mesh = DeviceMesh.from_group(dist.new_group(backend="fake"), "cpu")  # a group that serves the CPU
        assert fix._stranded([_offloaded(cpu_mesh), _offloaded(cpu_mesh)]) is None
        assert fix._stranded([_offloaded(mesh), _offloaded(cpu_mesh)]) is None  # two meshes: multi_mesh's
        assert fix._stranded([_offloaded(mesh), torch.randn(3)]) is None  # a plain tensor: torch's own error
        one = DeviceMesh.from_group(dist.new_group([0]), "cuda")  # one rank: DTensor reduces nothing
        assert fix._stranded([_offloaded(one)]) is None
    finally:
        dist.destroy_process_group()


def test_a_gradient_with_placements_of_its_own_is_never_read():
    """PyTorch's pending FSDPGrad (a DTensor whose ``placements`` raises): left to torch, unread."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    class PendingGrad(DTensor):
        @property
        def placements(self):
            raise RuntimeError("FSDPGrad has no single placement")

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("cuda:fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
        grads = [_offloaded(mesh), _offloaded(mesh)]
        assert fix._stranded(grads) is mesh
        grads[1] = _pending(grads[1], PendingGrad)
        assert fix._stranded(grads) is None
    finally:
        dist.destroy_process_group()


def _pending(grad, cls):
    """``grad`` as an instance of ``cls`` (the same spec and local shard)."""
    return cls(grad._local_tensor, grad._spec, requires_grad=False)
