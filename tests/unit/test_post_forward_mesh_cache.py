"""post_forward_mesh_cache in one process: the lookup key, hit/miss, worlds kept apart, the
structural check, and the real patch under the fake backend and threaded process groups (world
size 4, several ranks in this process)."""

from __future__ import annotations

import gc
import threading
import types

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.fsdp  # noqa: E402,F401  (fires the post-import hook if the .pth is active)
import torch.nn as nn  # noqa: E402

import fsdp_autopatch  # noqa: E402
from fsdp_autopatch import _compat, _isolation  # noqa: E402
from fsdp_autopatch.patches import post_forward_mesh_cache as pfmc  # noqa: E402

pytestmark = pytest.mark.timeout(120)

WORLD = 4
FUNCTION = "_get_post_forward_mesh_info"


# --- the wrapper against a stand-in for torch's function ------------------------------------------


class World:  # stands for a default process group: weakly referenceable, hashed by identity
    pass


class Built:  # stands for the HSDPMeshInfo torch builds
    pass


def mesh_info(ranks=(0, 1, 2, 3), shard_size=4):
    mesh = types.SimpleNamespace(device_type="cpu", mesh=torch.tensor(ranks))
    return types.SimpleNamespace(mesh=mesh, shard_mesh_size=shard_size)


def stand_in():
    """Torch's rules: ValueError unless k divides the shard size; k == 1 -> None; k == size -> the
    mesh_info itself; otherwise a new object per call."""
    calls = []

    def original(reshard_after_forward, mesh_info):
        calls.append(reshard_after_forward)
        k, size = reshard_after_forward, mesh_info.shard_mesh_size
        if not isinstance(k, bool) and (k < 1 or k > size or size % k):
            raise ValueError(f"it should be a factor of {size}, not {k}")
        if k is True or k == size:
            return mesh_info
        return None if k in (False, 1) else Built()

    return calls, original


def _torch_signature(reshard_after_forward, mesh_info):  # torch's _get_post_forward_mesh_info
    raise AssertionError("only its signature is read")


def call(original, *args, **kwargs):
    return _isolation.run_wrapper(
        pfmc._shared_post_forward_mesh, original, None, args, kwargs, pfmc._READS, signature_of=_torch_signature
    )


@pytest.fixture
def one_world(monkeypatch):
    world = World()
    monkeypatch.setattr(pfmc, "SHARED", pfmc.SharedMeshes())
    monkeypatch.setattr(pfmc, "current_world", lambda: (world, 0))
    return world


def test_layout_key_only_for_ints_and_equal_for_equal_layouts():
    info = mesh_info()
    assert pfmc.layout_key(True, info) is None and pfmc.layout_key(False, info) is None
    assert pfmc.layout_key(2.0, info) is None and pfmc.layout_key(None, info) is None
    assert pfmc.layout_key(2, info) == ("cpu", (4,), (0, 1, 2, 3), 2, 4)
    # world_mesh["dp"] gives a new, equal DeviceMesh per slicing: same key
    assert pfmc.layout_key(2, mesh_info()) == pfmc.layout_key(2, info)
    assert pfmc.layout_key(2, mesh_info((4, 5, 6, 7))) != pfmc.layout_key(2, info)
    assert pfmc.layout_key(2, types.SimpleNamespace(mesh=None)) is None  # another shape: torch decides


def test_a_hit_skips_torch_and_bad_values_always_reach_torch(one_world):
    calls, original = stand_in()
    first = call(original, 2, mesh_info())
    assert call(original, 2, mesh_info()) is first
    assert call(original, reshard_after_forward=2, mesh_info=mesh_info()) is first
    assert calls == [2]
    for _ in range(2):  # never cached: torch's ValueError every time
        with pytest.raises(ValueError, match="factor of 4, not 3"):
            call(original, 3, mesh_info())
    info = mesh_info()
    assert call(original, 4, info) is info and call(original, True, info) is info
    assert call(original, 1, info) is None
    assert calls == [2, 3, 3, 4, True, 1]
    assert len(pfmc.SHARED.entries(one_world)) == 1


def test_ranks_and_worlds_never_share_and_a_dead_world_takes_its_entries(monkeypatch):
    monkeypatch.setattr(pfmc, "SHARED", pfmc.SharedMeshes())
    calls, original = stand_in()
    worlds = [World(), World()]
    here = [(worlds[0], 0)]
    monkeypatch.setattr(pfmc, "current_world", lambda: here[0])
    rank0 = call(original, 2, mesh_info())
    here[0] = (worlds[1], 1)  # another thread rank (threaded process groups), or a new world
    rank1 = call(original, 2, mesh_info())
    assert rank1 is not rank0 and calls == [2, 2]
    assert [key[0] for key in pfmc.SHARED.entries(worlds[1])] == [1]  # the calling rank is in the key
    here[0] = (worlds[0], 0)
    assert call(original, 2, mesh_info()) is rank0
    assert pfmc.SHARED.worlds() == 2
    del worlds[0], here[0]
    gc.collect()
    assert pfmc.SHARED.worlds() == 1  # destroyed and collected world: its meshes are let go


def test_without_a_process_group_torch_decides(monkeypatch):
    monkeypatch.setattr(pfmc, "current_world", lambda: None)
    calls, original = stand_in()
    assert call(original, 2, mesh_info()) is not call(original, 2, mesh_info())
    assert calls == [2, 2]


# --- the structural check ---------------------------------------------------------------------------


def test_structural_check_is_needed_on_this_torch():
    verdict = pfmc._structural_check()
    assert verdict.status == "needed", verdict


def _init_module():
    return _compat.fsdp_module("_fsdp_init")


_post_forward_mesh_info_cache: dict = {}


def _cached_shape(reshard_after_forward, mesh_info):  # the shape of PyTorch PRs 179402 / 187161
    return _post_forward_mesh_info_cache.get((reshard_after_forward, mesh_info))


def test_structural_check_sees_torchs_own_cache(monkeypatch):
    monkeypatch.setattr(_init_module(), FUNCTION, _cached_shape)
    verdict = pfmc._structural_check()
    assert (verdict.status, verdict.conclusive) == ("not_needed", True), verdict


def test_structural_check_refuses_other_shapes(monkeypatch):
    monkeypatch.setattr(_init_module(), FUNCTION, lambda mesh_info, reshard_after_forward: None)
    assert pfmc._structural_check().status == "unsupported"

    def _get_post_forward_mesh_info(reshard_after_forward, mesh_info):  # builds nothing we know
        return mesh_info

    monkeypatch.setattr(_init_module(), FUNCTION, _get_post_forward_mesh_info)
    assert pfmc._structural_check().status == "unsupported"
    monkeypatch.delattr(_init_module(), FUNCTION)
    assert pfmc._structural_check().status == "unsupported"


# --- the real patch: fake backend and threaded process groups, world size 4 --------------------------


@pytest.fixture
def applied():
    fsdp_autopatch.install()
    status = {p.name: p.status.value for p in fsdp_autopatch.status().patches}
    if status.get(pfmc.NAME) != "applied":
        pytest.skip(f"{pfmc.NAME} is {status.get(pfmc.NAME)} in this process")


@pytest.fixture
def torch_own(monkeypatch):
    """A callable that puts torch's own function back where the patch wrapped it (until teardown)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

    def unwrap() -> None:
        for module in (_fsdp_init, _fully_shard):
            monkeypatch.setattr(module, FUNCTION, getattr(module, FUNCTION).__wrapped__)

    return unwrap


def process_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def post_forward_infos(units) -> list:
    groups = [group for unit in units for group in _compat.state_param_groups(unit._get_fsdp_state())]
    return [group.post_forward_mesh_info for group in groups]


def shard(mesh, units: int, k=2):
    """``units`` Linear units with reshard_after_forward=k plus the root; the groups created."""
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(units)))
    before = process_groups()
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=k)
    fully_shard(model, mesh=mesh)
    return model, process_groups() - before


def validation_errors(mesh) -> list[str]:
    from torch.distributed.fsdp import fully_shard

    errors = []
    for k in (3, 0, 8, -2, 2.0):
        with pytest.raises(ValueError) as raised:
            fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=k)
        errors.append(str(raised.value))
    return errors


@pytest.fixture
def fake_world():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield init_device_mesh("cpu", (WORLD,))
    finally:
        dist.destroy_process_group()


def test_fake_backend_process_groups_do_not_grow_with_units(applied, fake_world):
    mesh = fake_world
    patched = {units: shard(mesh, units) for units in (8, 16)}
    assert {units: created for units, (_, created) in patched.items()} == {8: 2, 16: 0}  # 16: shares 8's
    infos = post_forward_infos(patched[8][0]) + post_forward_infos(patched[16][0])
    assert len({id(info) for info in infos}) == 1
    assert validation_errors(mesh)[0] == "If passing reshard_after_forward as an int, it should be a factor of 4, not 3"


def hsdp(replicate: int, shard_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (replicate, shard_size), mesh_dim_names=("replicate", "shard"))


def test_fake_backend_hsdp(applied, fake_world):
    one_by_four = hsdp(1, WORLD)  # its own layout (shape (1, 4)): one post-forward mesh of its own
    model, created = shard(one_by_four, 8)
    assert created == 2 and len({id(info) for info in post_forward_infos(model)}) == 1
    two_by_two = hsdp(2, 2)  # k=2 is the shard size: torch answers True, nothing is built or kept
    model, created = shard(two_by_two, 8)
    assert created == 0
    groups = [group for unit in model for group in _compat.state_param_groups(unit._get_fsdp_state())]
    assert all(group.post_forward_mesh_info is group.mesh_info for group in groups)


def test_fake_backend_torchs_own_numbers(applied, fake_world, torch_own):
    mesh = fake_world
    patched_errors = validation_errors(mesh)
    shard(mesh, 8)  # the cache is warm; torch's own function ignores it
    torch_own()
    created = {units: shard(mesh, units)[1] for units in (8, 16)}
    assert created == {8: 16, 16: 32}
    assert shard(hsdp(1, WORLD), 8)[1] == 16
    assert validation_errors(mesh) == patched_errors  # the same ValueError texts with the patch


def run_thread_ranks(body, world_size: int = WORLD, timeout_s: float = 60.0) -> dict[int, object]:
    """``body(rank)`` on ``world_size`` thread ranks of one threaded world (PyTorch's
    ``spawn_threads_and_init_comms`` recipe); the results by rank, or the first rank's error."""
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

    isolate = getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode", None)
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}
    store = dist.HashStore()

    def worker(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            results[rank] = body(rank)
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            errors[rank] = error
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    if isolate is not None:
        isolate(True)
    _install_threaded_pg()
    try:
        threads = [threading.Thread(target=worker, args=(rank,), daemon=True) for rank in range(world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s)
        assert not any(thread.is_alive() for thread in threads), "a thread rank hangs"
    finally:
        _uninstall_threaded_pg()
        if isolate is not None:
            isolate(False)
    if errors:
        raise next(iter(errors.values()))
    return results


def test_threaded_ranks_never_get_another_ranks_mesh(applied):
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")

    def rank_body(rank: int) -> dict:
        mesh = init_device_mesh("cpu", (WORLD,))
        model, created = shard(mesh, 8)
        infos = post_forward_infos(model)
        own_groups = set(dist.distributed_c10d._world.pg_map)
        world = dist.group.WORLD
        return {
            "created": created,
            "infos": {id(info) for info in infos},
            "info": infos[0],
            "groups_are_this_ranks": all(
                group in own_groups for group in (infos[0].shard_process_group, infos[0].replicate_process_group)
            ),
            "keys": list(pfmc.SHARED.entries(world)),
            "world": world,
        }

    ranks = run_thread_ranks(rank_body)
    assert sorted(ranks) == list(range(WORLD))
    for rank, got in ranks.items():
        assert got["created"] == 2, (rank, got["created"])
        assert len(got["infos"]) == 1, rank  # 8 units of one rank share one post-forward mesh
        assert got["groups_are_this_ranks"], rank
        assert [key[0] for key in got["keys"]] == [rank]  # keyed by the calling rank, in its own world
    assert len({id(got["info"]) for got in ranks.values()}) == WORLD  # no rank was handed another's
    assert len({id(got["world"]) for got in ranks.values()}) == WORLD


def test_threaded_ranks_torchs_own_numbers(applied, torch_own):
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    torch_own()

    def rank_body(rank: int) -> int:
        return shard(init_device_mesh("cpu", (WORLD,)), 8)[1]

    assert run_thread_ranks(rank_body) == {rank: 16 for rank in range(WORLD)}
