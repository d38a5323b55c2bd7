"""zero_grad_discards_pending_grads: ``zero_grad()`` drops FSDP2's unreduced gradients, as DDP does (opt-in).

Symptom, trigger, torch versions, measurements and upstream: docs/patches/zero_grad_discards_pending_grads.md.

Needed here?
    The same internals as ``pending_grads_warning`` (``FSDPParamGroup.post_backward`` keeping
    gradients by ``reduce_grads``, ``FSDPParam`` keeping them on ``_unsharded_param`` /
    ``unsharded_accumulated_grad``) -> needed. Anything else -> unsupported: torch left as it is, and the
    variable gets a warning saying so.

What it does
    The post-backward wrapper remembers the units that kept gradients. After torch's
    ``Optimizer.zero_grad`` / ``nn.Module.zero_grad``, the kept gradients of the parameters just
    zeroed are dropped (set to ``None``; HSDP's partial reduce-scatter output, and 2.15's layout of
    it, only when every parameter of its unit is zeroed: it is one buffer), whatever
    ``set_to_none`` says (DDP's zeroed ``.grad`` holds the window, and ``set_to_none=False`` zeroes
    it too). One fire per
    ``zero_grad()`` that dropped something. Units outside the zeroed parameters, and every
    ``zero_grad()`` with nothing kept, are left exactly as torch leaves them: a run that never
    discards a window computes bitwise the same.

Call-time isolation
    The wrappers read no argument and run after torch's method (its result is kept should ours
    raise; torch's own behaviour then stays: the gradients are kept, as without the policy).
"""

from __future__ import annotations

from .._catalogue import BY_NAME
from .._spec import POLICY, Patch, Verdict, Wrap, needed, not_needed, unsupported
from . import _pending_grads

NAME = _pending_grads.DISCARD
VARIABLE = BY_NAME[NAME].variable  # FSDP_AUTOPATCH_ZERO_GRAD_DISCARDS_PENDING


def _structural_check() -> Verdict:
    handled = _pending_grads.torch_handles_pending_grads()
    if handled is not None:
        return not_needed(handled, conclusive=True)  # torch's own pending gradients (FSDPGrad)
    problem = _pending_grads.structural_problem()
    if problem is not None:
        return unsupported(problem)
    return needed("zero_grad() can drop the gradients FSDP2 keeps unreduced (sync off)")


PATCH = Patch(
    name=NAME,
    summary="zero_grad() drops FSDP2's unreduced gradients (sync off), as DDP's no_sync does (opt-in)",
    symptom="a window discarded with zero_grad() is still reduced into the next step",
    trigger="zero_grad() after a backward with set_requires_gradient_sync(False)",
    upstream=(),
    # the kept gradients: measured on 2.8 - 2.15 (2.15 in CI's matrix row)
    affected=">=2.8",
    check=_structural_check,
    targets=_pending_grads.targets(NAME, Wrap),
    changes=f"zero_grad() drops FSDP2's gradients not yet reduced, as DDP does ({VARIABLE}=1)",
    kind=POLICY,
    variable=VARIABLE,
    after=(_pending_grads.WARNING,),  # outside its wrappers: the warning sees this policy in force and stays quiet
)
