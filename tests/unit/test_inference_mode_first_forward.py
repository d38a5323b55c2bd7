"""inference_mode_first_forward in one process: the structural check, and what the wrappers do
in inference mode and outside it (with stand-ins for torch's methods)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.fsdp  # noqa: E402,F401,F811  (fires the post-import hook if the .pth is active)

from fsdp_autopatch import _isolation  # noqa: E402
from fsdp_autopatch.patches import inference_mode_first_forward as patch  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _mode() -> tuple[bool, bool]:
    """Kept out of the stand-in's methods: the check reads their names."""
    return torch.is_inference_mode_enabled(), torch.is_grad_enabled()


class _Param:
    """A stand-in FSDPParam: torch's two methods, as they create their tensors."""

    _param_fqn = "inp.weight"

    def __init__(self) -> None:
        self.all_gather_outputs: list = []
        self.modes: list = []

    def init_all_gather_outputs(self, numels, dtypes, world_size, device):
        self.modes.append(_mode())
        if len(self.all_gather_outputs) > 0:
            return
        self.all_gather_outputs = [torch.empty(n * world_size, dtype=d, device=device) for n, d in zip(numels, dtypes)]

    def init_unsharded_param(self):
        self.modes.append(_mode())
        if hasattr(self, "_unsharded_param"):
            return
        self._unsharded_param = torch.nn.Parameter(torch.as_strided(self.all_gather_outputs[0], (2, 2), (2, 1), 0))


def _copy_out(fsdp_param):
    fsdp_param.init_all_gather_outputs([2], [torch.float32], 2, "cpu")


def _unshard(fsdp_param) -> None:
    args = ([2], [torch.float32], 2, torch.device("cpu"))
    _isolation.run_wrapper(patch._create_outputs, fsdp_param.init_all_gather_outputs, fsdp_param, args, {})
    _isolation.run_wrapper(patch._create_unsharded, fsdp_param.init_unsharded_param, fsdp_param, (), {})


def test_the_structural_check_finds_the_buffers_created_in_the_callers_mode():
    assert patch._structural_check().status == "needed"


def test_the_check_on_stand_ins():
    assert patch.check_fsdp_param(_Param, (_copy_out,)).status == "needed"
    assert patch.check_fsdp_param(_Param, ()).status == "unsupported"  # no copy-out creates through it
    assert patch.check_fsdp_param(object, (_copy_out,)).status == "unsupported"

    class Fixed(_Param):
        def init_all_gather_outputs(self, numels, dtypes, world_size, device):
            with torch.inference_mode(False):
                super().init_all_gather_outputs(numels, dtypes, world_size, device)

    verdict = patch.check_fsdp_param(Fixed, (_copy_out,))
    assert (verdict.status, verdict.conclusive) == ("not_needed", True)

    class NoEmpty(_Param):
        def init_all_gather_outputs(self, numels, dtypes, world_size, device):
            self.all_gather_outputs = []

    assert patch.check_fsdp_param(NoEmpty, (_copy_out,)).status == "unsupported"


def test_names_in_reads_a_comprehension_compiled_on_its_own():
    assert {"all_gather_outputs", "empty"} <= patch.names_in(_Param.init_all_gather_outputs)


def test_under_inference_mode_the_buffers_are_normal_tensors_made_as_under_no_grad(registry):
    fsdp_param = _Param()
    with torch.inference_mode():
        _unshard(fsdp_param)
        _unshard(fsdp_param)  # the second unshard reuses them: nothing created, nothing counted
    assert not fsdp_param.all_gather_outputs[0].is_inference()
    assert not fsdp_param._unsharded_param.is_inference()
    assert fsdp_param.modes == [(False, False)] * 4  # torch's methods ran as under no_grad
    assert registry.snapshot()[patch.NAME].fired == 1
    with torch.no_grad():  # what the training step's copy-out does: no error
        fsdp_param.all_gather_outputs[0].copy_(torch.arange(4.0))
    assert fsdp_param._unsharded_param.tolist() == [[0.0, 1.0], [2.0, 3.0]]


@pytest.mark.parametrize("mode", ["grad", "no_grad"])
def test_outside_inference_mode_torch_runs_as_it_came(registry, mode):
    fsdp_param = _Param()
    with torch.enable_grad() if mode == "grad" else torch.no_grad():
        _unshard(fsdp_param)
    assert fsdp_param.modes == [(False, mode == "grad")] * 2
    assert registry.snapshot()[patch.NAME].fired == 0


def test_buffers_made_before_an_inference_mode_forward_count_nothing(registry):
    fsdp_param = _Param()
    _unshard(fsdp_param)
    before = fsdp_param.all_gather_outputs
    with torch.inference_mode():
        _unshard(fsdp_param)
    assert fsdp_param.all_gather_outputs is before
    assert registry.snapshot()[patch.NAME].fired == 0
