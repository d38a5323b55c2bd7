"""The parameter groups of every optimizer a run builds, shown to a guard once torch has made them.

Two guards install their optimizer step pre-hook only once an optimizer holds what they check
([Note: a step hook only where needed] in ``_isolation``). They find it here: ``Optimizer.__init__``
calls ``self.add_param_group`` per group, and a subclass may override that method without calling
the base class's, so both are wrapped: after ``__init__`` every group, after ``add_param_group``
the new one. Neither runs inside a compiled step (torch hides ``add_param_group`` from Dynamo, and
optimizers are built eagerly).
"""

from __future__ import annotations

from typing import Any, Callable

from .._spec import Wrap

OPTIMIZER = "torch.optim.optimizer:Optimizer"


def group_targets(on_groups: Callable[[Any, Any], None]) -> tuple[Wrap, Wrap]:
    """The two targets that call ``on_groups(optimizer, groups)`` after torch's method."""

    def after_adding_a_group(wrapped, optimizer, args, kwargs):
        result = wrapped(*args, **kwargs)
        on_groups(optimizer, optimizer.param_groups[-1:])
        return result

    def after_building(wrapped, optimizer, args, kwargs):
        result = wrapped(*args, **kwargs)
        on_groups(optimizer, getattr(optimizer, "param_groups", ()))
        return result

    return (Wrap(f"{OPTIMIZER}.add_param_group", after_adding_a_group), Wrap(f"{OPTIMIZER}.__init__", after_building))
