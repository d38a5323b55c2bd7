"""pending_grads_warning: say so when ``zero_grad()`` or ``step()`` meets FSDP2 gradients not yet reduced.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/pending_grads_warning.md.

Needed here?
    ``FSDPParamGroup.post_backward`` keeps gradients by ``reduce_grads``; ``FSDPParam`` keeps them
    on ``_unsharded_param`` (up to 2.14 ``to_accumulated_grad_if_needed`` moves them to
    ``unsharded_accumulated_grad``; in 2.15 that is a property reading the leaf's gradient); and
    ``torch.optim.optimizer`` has ``register_optimizer_step_pre_hook`` -> needed. Anything else ->
    unsupported (torch left as it is).

What it does
    A wrapper of ``FSDPParamGroup.post_backward`` remembers, after torch's method, the units that
    kept gradients (a ``WeakSet``; no collective). After torch's ``Optimizer.zero_grad`` /
    ``nn.Module.zero_grad``, where a remembered unit holds unreduced gradients of the parameters
    just zeroed: one ``UserWarning`` per process naming them, what happens to them and both
    variables. Before ``optimizer.step()`` (a global step pre-hook, installed when a unit first keeps
    gradients): the same for the parameters the optimizer updates. Each such call counts as a fire.
    Nothing else changes: the warning never alters a gradient. A loop that never turns the sync off
    pays one empty-set test per ``zero_grad()``.

Call-time isolation
    The wrappers read no argument (``set_to_none`` and anything else go to torch unchanged) and run
    after torch's method (its result is kept should ours raise). The step hook runs inside
    ``_isolation.isolated``. ``python -W error`` turns the warning into a line on stderr, never into
    an exception.
"""

from __future__ import annotations

from .._catalogue import BY_NAME
from .._spec import POLICY, Patch, Verdict, Wrap, needed, not_needed, unsupported
from . import _pending_grads

NAME = _pending_grads.WARNING
VARIABLE = BY_NAME[NAME].variable  # FSDP_AUTOPATCH_PENDING_GRADS_WARNING


def _structural_check() -> Verdict:
    handled = _pending_grads.torch_handles_pending_grads()
    if handled is not None:
        return not_needed(handled, conclusive=True)  # torch's own pending gradients (FSDPGrad)
    problem = _pending_grads.structural_problem()
    if problem is not None:
        return unsupported(problem)
    return needed("zero_grad() leaves the gradients FSDP2 keeps unreduced (sync off), and the next step reduces them")


PATCH = Patch(
    name=NAME,
    summary="a warning when zero_grad() or step() meets FSDP2 gradients not yet reduced (sync off)",
    symptom="silent: a window discarded with zero_grad() is still reduced into the next step (the weights 1.3 "
    "times the DDP update away from DDP's on 2 ranks)",
    trigger="zero_grad() or optimizer.step() after a backward with set_requires_gradient_sync(False)",
    upstream=(),
    # the kept gradients: measured on 2.8 - 2.15 (2.15 in CI's matrix row)
    affected=">=2.8",
    check=_structural_check,
    targets=_pending_grads.targets(NAME, Wrap),
    changes="one warning per process when zero_grad() or optimizer.step() meets FSDP2 gradients not yet reduced "
    f"({VARIABLE}=0 turns it off)",
    kind=POLICY,
    variable=VARIABLE,
)
