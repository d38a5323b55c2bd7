"""clip_grad_norm_multi_mesh: the structural check, the combination rule and the pass-through, on
plain tensors (no process group: DTensors on several meshes are in the 2-rank test)."""

import math

import pytest

torch = pytest.importorskip("torch")
clip_grad = pytest.importorskip("torch.nn.utils.clip_grad")
pytest.importorskip("torch.distributed.fsdp")  # the plugin applies its patches here

from fsdp_autopatch import _isolation, _patching  # noqa: E402
from fsdp_autopatch.patches import clip_grad_norm_multi_mesh as clip  # noqa: E402

# torch's own _get_total_norm, whether the plugin replaced it in this process or not
TORCH_TOTAL = {attribute: original for _, attribute, original in _patching._applied.get(clip.PATCH.name, [])}.get(
    "_get_total_norm", clip_grad._get_total_norm
)


def test_verdict_on_this_torch_is_needed():
    assert clip._structural_check().status == "needed"


def test_a_total_norm_that_handles_meshes_is_conclusively_not_needed(monkeypatch):
    def _get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        return torch.stack([t.full_tensor() for t in tensors])  # PyTorch PR 180501's shape

    monkeypatch.setattr(clip_grad, "_get_total_norm", _get_total_norm)
    verdict = clip._structural_check()
    assert (verdict.status, verdict.conclusive) == ("not_needed", True)


def test_other_shapes_are_unsupported(monkeypatch):
    def _get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        return sum(t.norm() for t in tensors)  # no stack: not the code the patch knows

    monkeypatch.setattr(clip_grad, "_get_total_norm", _get_total_norm)
    assert clip._structural_check().status == "unsupported"
    monkeypatch.setattr(clip_grad, "_get_total_norm", lambda tensors, norm_type: None)
    assert clip._structural_check().status == "unsupported"


def _tensors():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, generator=gen), torch.randn(3, 2, generator=gen), torch.zeros(4)]
    tensors.append(torch.randn(2, generator=gen))
    return tensors, [[0, 2], [1], [3]]  # three "mesh groups", one tensor all zero


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.5, math.inf, -math.inf, 0.0])
def test_norm_of_group_norms_is_torchs_norm_of_per_tensor_norms(norm_type):
    tensors, groups = _tensors()
    whole = TORCH_TOTAL(tensors, norm_type)
    per_group = torch.stack([TORCH_TOTAL([tensors[i] for i in group], norm_type) for group in groups])
    torch.testing.assert_close(clip._norm_of_group_norms(per_group, norm_type), whole)


def _drive(wrapper, spy, args, kwargs):
    """The wrapper as its guard calls it, with ``spy`` standing in for torch's function."""
    target = next(t for t in clip.PATCH.targets if t.wrapper is wrapper)
    owner, attribute = _patching.resolve(target.path)
    torch_function = _patching.original_of(owner, attribute)  # its signature: the replacement's
    return _isolation.run_wrapper(wrapper, spy, None, args, kwargs, target.reads, signature_of=torch_function)


def _spy():
    calls = []
    result = object()

    def torch_stand_in(*args, **kwargs):
        calls.append((args, kwargs))
        return result

    return torch_stand_in, calls, result


def test_plain_tensors_reach_torch_as_the_callers_objects():
    tensors, _ = _tensors()
    spy, calls, result = _spy()
    assert _drive(clip._total_norm_across_meshes, spy, (tensors, 2.0), {"foreach": False}) is result
    assert calls[0][0][0] is tensors and calls[0][1] == {"foreach": False}
    params = [torch.nn.Parameter(t.clone()) for t in tensors]
    for p in params:
        p.grad = torch.ones_like(p)
    total = torch.tensor(3.0)
    assert _drive(clip._clip_across_meshes, spy, (params,), {"max_norm": 1.0, "total_norm": total}) is result
    assert calls[1][0][0] is params and calls[1][1]["total_norm"] is total


def test_a_generator_reaches_torch_as_the_list_read_from_it():
    tensors, _ = _tensors()
    spy, calls, _ = _spy()
    _drive(clip._total_norm_across_meshes, spy, (iter(tensors),), {})
    assert type(calls[0][0][0]) is list and all(a is b for a, b in zip(calls[0][0][0], tensors))


def test_clip_grad_norm_through_the_patch_equals_torch_on_plain_tensors():
    tensors, _ = _tensors()
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
    for p, t in zip(params, tensors):
        p.grad = t.clone()
    total = torch.nn.utils.clip_grad_norm_(params, 0.5)
    assert torch.equal(total, TORCH_TOTAL(tensors, 2.0))
    scale = 0.5 / (float(total) + 1e-6)
    assert all(torch.allclose(p.grad, t * scale) for p, t in zip(params, tensors))


def test_torch_compile_traces_the_replaced_functions():
    """A wrapt proxy there made dynamo fail ("Guard failed on the same frame it was created")."""
    tensors, _ = _tensors()
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
    for p, t in zip(params, tensors):
        p.grad = t.clone()

    @torch.compile(backend="eager")
    def total_then_clip(xs, ps):
        return torch.nn.utils.get_total_norm(xs, 2.0), torch.nn.utils.clip_grad_norm_(ps, 0.5)

    total, clipped_total = total_then_clip(tensors, params)
    torch.testing.assert_close(total, TORCH_TOTAL(tensors, 2.0))
    torch.testing.assert_close(clipped_total, total)
    assert clip._structural_check().status == "needed"  # the check still sees torch's code
