"""PyTorch's pending-gradient rewrite (commit acf70b43: ``FSDPGrad``, ``synchronize_gradients()``,
``FSDPParam.publish_unsharded_grad``) recognised by its shape, in one process: its skeleton is laid
over the installed torch's classes (the methods the checks read, with the rewrite's reads), and the
entries whose premise it removes report not_needed, conclusively, with the reason;
restore_unused_param_grads stays needed and also wraps ``synchronize_gradients()``, which runs each
unit's ``post_backward`` outside any backward. (The rewrite's real files: the release-day runbook in
docs/compatibility.md, ``scripts/next_torch.py``.)"""

import sys
import types

import pytest

pytest.importorskip("torch")
import torch.distributed.fsdp  # noqa: E402, F401  (fires the post-import hook if the .pth is active)

from fsdp_autopatch import _activate, _compat  # noqa: E402
from fsdp_autopatch.patches import (  # noqa: E402
    accumulated_grad_guard,
    pending_grads_warning,
    restore_unused_param_grads,
    zero_grad_discards_pending_grads,
)


class FSDPGrad:  # the rewrite's _fsdp_grad.FSDPGrad, as far as the checks read it
    def materialize(self):
        return None

    def local_components(self):
        return {}


def post_backward(self, *unused):  # the rewrite's no-sync path, as far as the checks read it
    if not self.reduce_grads:
        for fsdp_param in self.fsdp_params:
            fsdp_param.publish_unsharded_grad("avg", None)


def publish_unsharded_grad(self, reduce_op=None, divide_factor=None):
    leaf = getattr(self, "_unsharded_param", None)
    return leaf, isinstance(self.sharded_param.grad, FSDPGrad)


def synchronize_gradients(self, *, recurse=True):  # FSDPModule's: each unit's, once
    for group in self._get_fsdp_state()._fsdp_param_groups:
        group.synchronize_gradients()


def group_synchronize_gradients(self):  # FSDPParamGroup's: post_backward outside any backward
    self.post_backward()


@pytest.fixture
def rewrite(monkeypatch):
    group = _compat.fsdp_class("_fsdp_param_group", "FSDPParamGroup")
    fsdp_param = _compat.fsdp_class("_fsdp_param", "FSDPParam")
    fsdp_module = _compat.fsdp_class("_fully_shard", "FSDPModule")
    monkeypatch.setattr(group, "post_backward", post_backward)
    monkeypatch.setattr(fsdp_param, "publish_unsharded_grad", publish_unsharded_grad, raising=False)
    monkeypatch.setattr(fsdp_param, "unsharded_grad_dtype", None, raising=False)  # an attribute there
    for gone in ("to_accumulated_grad_if_needed", "unsharded_accumulated_grad"):
        if gone in vars(fsdp_param):
            monkeypatch.delattr(fsdp_param, gone)
    monkeypatch.setattr(fsdp_module, "synchronize_gradients", synchronize_gradients, raising=False)
    monkeypatch.setattr(group, "synchronize_gradients", group_synchronize_gradients, raising=False)
    module = types.ModuleType(f"{_compat.FSDP2_PACKAGE}._fsdp_grad")
    module.FSDPGrad = FSDPGrad
    monkeypatch.setitem(sys.modules, module.__name__, module)
    yield


@pytest.mark.parametrize("patch", [pending_grads_warning.PATCH, zero_grad_discards_pending_grads.PATCH])
def test_the_pending_grads_policies_are_not_needed_on_the_rewrite(rewrite, patch):
    verdict = patch.check()
    assert (verdict.status, verdict.conclusive) == ("not_needed", True), verdict
    assert "FSDPGrad" in verdict.reason and "synchronize_gradients" in verdict.reason
    assert _activate.verdict_of(patch).status == "not_needed"


def test_the_guard_is_not_needed_where_torch_skips_a_never_unsharded_param(rewrite):
    verdict = accumulated_grad_guard.PATCH.check()
    assert (verdict.status, verdict.conclusive) == ("not_needed", True), verdict
    assert "publish_unsharded_grad" in verdict.reason
    assert _activate.verdict_of(accumulated_grad_guard.PATCH).status == "not_needed"


def test_without_synchronize_gradients_the_policies_keep_their_premise(rewrite, monkeypatch):
    monkeypatch.delattr(_compat.fsdp_class("_fully_shard", "FSDPModule"), "synchronize_gradients")
    assert pending_grads_warning.PATCH.check().status != "not_needed"


def test_a_method_gone_alone_proves_nothing(rewrite, monkeypatch):
    def post_backward(self, *unused):  # the no-sync path no longer hands parameters to torch's skip
        return self.reduce_grads

    monkeypatch.setattr(_compat.fsdp_class("_fsdp_param_group", "FSDPParamGroup"), "post_backward", post_backward)
    assert accumulated_grad_guard.PATCH.check().status == "unsupported"


def _synchronize_target():
    targets = restore_unused_param_grads.PATCH.targets
    return next(t for t in targets if t.path.endswith("FSDPModule.synchronize_gradients"))


def test_restore_unused_param_grads_also_restores_after_synchronize_gradients(rewrite):
    verdict = restore_unused_param_grads.PATCH.check()
    assert verdict.status == "needed", verdict  # the fill still turns None into zero there
    assert _synchronize_target().when(), "the synchronize_gradients wrapper must apply on the rewrite"


def test_without_synchronize_gradients_its_wrapper_stays_off(rewrite, monkeypatch):
    monkeypatch.delattr(_compat.fsdp_class("_fully_shard", "FSDPModule"), "synchronize_gradients")
    assert not _synchronize_target().when()
    assert restore_unused_param_grads.PATCH.check().status == "needed"


def test_a_synchronize_gradients_that_runs_no_post_backward_is_unsupported(rewrite, monkeypatch):
    def synchronize_elsewhere(self):  # the probe would never see this reduction
        return self.reduce_grads

    monkeypatch.setattr(_compat.fsdp_class("_fsdp_param_group", "FSDPParamGroup"), "synchronize_gradients",
                        synchronize_elsewhere)
    verdict = restore_unused_param_grads.PATCH.check()
    assert verdict.status == "unsupported" and "synchronize_gradients" in verdict.reason, verdict
