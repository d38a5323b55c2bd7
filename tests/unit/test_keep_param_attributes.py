"""keep_param_attributes: the carrying rule, the mirror, the structural check, and FSDP2 in one
process on the fake backend (4 fake ranks: the post-forward shard of an int
``reshard_after_forward``; and a ``torch.compile``d forward)."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import torch.distributed.fsdp  # noqa: E402,F401  (fires the post-import hook if the .pth is active)

from fsdp_autopatch import _events, _patching  # noqa: E402
from fsdp_autopatch._registry import Registry  # noqa: E402
from fsdp_autopatch.patches import keep_param_attributes as kpa  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def param(**attributes):
    p = nn.Parameter(torch.zeros(4, 2))
    for name, value in attributes.items():
        setattr(p, name, value)
    return p


# --- the rule ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,value,carried",
    [
        ("no_weight_decay", True, True),
        ("tag", "expert0", True),
        ("meta", {"lr_mult": 0.5, "groups": [1, 2]}, True),
        ("_user_private", 1, False),  # private names: torch's own live there
        ("_fsdp_orig_uid", 7, False),
        ("main_grad", torch.zeros(2), False),  # a tensor would keep unsharded storage alive
        ("buffers", [torch.zeros(2)], False),
        ("by_key", {"g": torch.zeros(2)}, False),
        ("keyed", {torch.zeros(1): 1}, False),
        ("nested", ({"g": torch.zeros(2)},), False),  # second level
        ("deep", [[[torch.zeros(2)]]], True),  # third level: not looked at (documented)
        ("device_mesh", "mine", False),  # an attribute of the class: would shadow torch
        ("shape", (1,), False),
    ],
)
def test_carried_rule(name, value, carried):
    target_class = torch.distributed.tensor.DTensor
    assert kpa.is_carried(name, value, target_class) is carried


def test_mirror_gives_exactly_the_carried_attributes_as_the_same_objects():
    meta = {"lr_mult": 0.5}
    source = param(tag="dense", meta=meta, _user_private=1, main_grad=torch.zeros(4, 2))
    target = param()
    assert kpa.mirror_attributes(source, target) == ("tag", "meta")
    assert target.tag == "dense" and target.meta is meta
    assert not hasattr(target, "_user_private") and not hasattr(target, "main_grad")
    assert kpa.carried_attributes(target) == {"tag": "dense", "meta": meta}


def test_in_sync_swap_writes_nothing():
    source, target = param(tag="dense", main_grad=torch.zeros(4, 2)), param()
    kpa.mirror_attributes(source, target)
    before = dict(vars(target))
    assert kpa.mirror_attributes(source, target) == ()  # the fast path, tensor attribute and all
    assert vars(target) == before


def test_removes_only_names_it_carried():
    source, target = param(tag="dense", flag=True), param()
    kpa.mirror_attributes(source, target)
    target.set_on_target = "kept"  # the user set it on this very parameter
    del source.tag  # the user deleted it on the parameter the module showed
    kpa.mirror_attributes(source, target)
    assert not hasattr(target, "tag")
    assert target.flag is True and target.set_on_target == "kept"
    source.flag = torch.zeros(1)  # a carried name that now holds a tensor: no longer carried
    kpa.mirror_attributes(source, target)
    assert not hasattr(target, "flag") and kpa.CARRIED_NAMES not in vars(target)


def test_a_parameter_without_attributes_gets_nothing():
    target = param()
    assert kpa.mirror_attributes(param(_private=1), target) == ()
    assert kpa.CARRIED_NAMES not in vars(target)


# --- the structural check -----------------------------------------------------------------------


class _Buggy:
    def _setattr_on_modules(self, param):
        setattr(self._module_info.module, self._module_info.param_name, param)

    def _init_sharded_param(self, param):
        self.sharded_param = nn.Parameter(param)
        self._setattr_on_modules(self.sharded_param)

    def to_sharded(self):
        self._setattr_on_modules(self.sharded_param)

    def to_unsharded(self):
        self._setattr_on_modules(self._unsharded_param)


class _CopiesDict(_Buggy):
    def _init_sharded_param(self, param):
        self.sharded_param = nn.Parameter(param)
        self.sharded_param.__dict__.update(param.__dict__)
        self._setattr_on_modules(self.sharded_param)


class _OtherSignature(_Buggy):
    def _setattr_on_modules(self, module, param):
        module.weight = param


class _InstallsElsewhere(_Buggy):
    def to_unsharded(self):
        self._module_info.module._parameters["weight"] = self._unsharded_param


def test_structural_check_on_this_torch_says_needed():
    verdict = kpa._structural_check()
    assert verdict.status == "needed", verdict


@pytest.mark.parametrize(
    "cls,status",
    [(_Buggy, "needed"), (_CopiesDict, "not_needed"), (_OtherSignature, "unsupported"),
     (_InstallsElsewhere, "unsupported"), (object, "unsupported")],
)
def test_structural_check_on_stand_ins(cls, status):
    verdict = kpa.check_fsdp_param(cls)
    assert verdict.status == status, verdict
    assert verdict.conclusive is (status == "not_needed")


# --- the wrapper, on a stand-in FSDPParam ---------------------------------------------------------


@pytest.fixture
def registry(monkeypatch):
    fresh = Registry()
    monkeypatch.setattr(_events, "REGISTRY", fresh)
    return fresh


def test_fires_once_per_parameter_whose_attributes_it_carried(registry):
    module = nn.Linear(2, 4)
    module.weight.tag = "w"

    class StandIn:
        _module_info = types.SimpleNamespace(module=module, param_name="weight")

        def _setattr_on_modules(self, param):
            module._parameters["weight"] = param

    target = kpa.PATCH.targets[0]  # installed as the patch installs it: isolated, bound by name
    setter = _patching.replacement_for(kpa.NAME, target, StandIn, vars(StandIn)["_setattr_on_modules"])
    fsdp_param, other = StandIn(), StandIn()
    for _ in range(3):
        setter.__get__(fsdp_param)(param())  # every swap carries "tag" onto a new object
    assert module.weight.tag == "w"
    assert registry.snapshot()[kpa.NAME].fired == 1
    module.bias.__dict__.clear()
    other._module_info = types.SimpleNamespace(module=module, param_name="bias")
    setter.__get__(other)(param())  # nothing to carry: no fire
    assert registry.snapshot()[kpa.NAME].fired == 1


# --- FSDP2 on the fake backend, in this process ----------------------------------------------------


@pytest.fixture
def fake_world():
    """A fake 4-rank world with the patch applied (by the .pth hook, or here)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    applied_here = not _patching.is_applied(kpa.NAME)
    if applied_here:
        _patching.apply(kpa.PATCH)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,))
    finally:
        dist.destroy_process_group()
        if applied_here:
            _patching.revert(kpa.NAME)


def marked_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    model[1].weight.no_weight_decay = True
    model[1].weight.sequence_parallel = True
    model[2].weight.tag = "expert0"
    model[2].weight.main_grad = torch.zeros(4, 8)
    return model


def attributes(model):
    return {n: kpa.carried_attributes(p) for n, p in model.named_parameters() if kpa.carried_attributes(p)}


EXPECTED = {"1.weight": {"no_weight_decay": True, "sequence_parallel": True}, "2.weight": {"tag": "expert0"}}


def test_post_forward_shard_carries_them(fake_world):
    from torch.distributed.fsdp import fully_shard

    model = marked_model()
    fully_shard(model[0], mesh=fake_world, reshard_after_forward=2)
    fully_shard([model[1], model[2]], mesh=fake_world, reshard_after_forward=2)
    fully_shard(model, mesh=fake_world)
    assert attributes(model) == EXPECTED
    out = model(torch.randn(2, 8))
    # after forward, the units hold a post-forward shard over 2 of the 4 ranks
    assert model[2].weight.device_mesh.ndim == 2, model[2].weight.device_mesh
    assert attributes(model) == EXPECTED
    out.sum().backward()
    assert model[2].weight.device_mesh.ndim == 1 and attributes(model) == EXPECTED
    assert not hasattr(model[2].weight, "main_grad")


def test_compiled_forward_keeps_working_with_the_wrapper(fake_world):
    from torch.distributed.fsdp import fully_shard

    model = marked_model()
    for unit in (model[0], [model[1], model[2]], model):
        fully_shard(unit, mesh=fake_world)
    seen = []
    model[2].register_forward_pre_hook(lambda module, args: seen.append(getattr(module.weight, "tag", None)))
    x = torch.randn(2, 8)
    eager = model(x).detach()
    compiled = torch.compile(model)
    for _ in range(2):
        out = compiled(x)
        out.sum().backward()
    assert torch.equal(out.detach(), eager)
    assert seen == ["expert0"] * 3  # Dynamo runs FSDP2's hooks (and the wrapper) eagerly
    assert attributes(model) == EXPECTED


def test_module_apply_keeps_them(fake_world):
    """``to_empty`` after ``fully_shard`` on a meta-device model, then ``.to(float64)``: Module._apply
    swaps each DTensor parameter's contents (``__dict__`` included) with ``swap_tensors``."""
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = marked_model()
    for unit in (model[0], [model[1], model[2]], model):
        fully_shard(unit, mesh=fake_world)
    sharded = model[2].weight
    model.to_empty(device="cpu")
    assert model[2].weight is sharded and attributes(model) == EXPECTED
    model.to(torch.float64)
    assert model[2].weight.dtype == torch.float64 and attributes(model) == EXPECTED
    model(torch.randn(2, 8, dtype=torch.float64)).sum().backward()
    assert attributes(model) == EXPECTED
