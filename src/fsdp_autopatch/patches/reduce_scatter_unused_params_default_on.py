"""reduce_scatter_unused_params_default_on: every FSDP unit starts with the unused-param fill on.

A policy, not a fix: off unless ``FSDP_AUTOPATCH_REDUCE_SCATTER_UNUSED_PARAMS=1``. For users who
cannot edit their training code to call ``FSDPModule.set_reduce_scatter_unused_params(True)``
(torch >= 2.13, or the ``unused_param_reduction`` backport on 2.6 - 2.12): ranks that use different
parameters of one unit then issue the same reduce-scatter, on every torch version.

Needs a fill: torch's own method, or the backport applied. Without one (the backport switched
off on torch < 2.13) the policy is recorded as "requested but not applied" and a warning names
the variable. Recorded in the registry's ``policies``.
"""

from __future__ import annotations

from .. import _compat
from .._config import REDUCE_SCATTER_UNUSED_PARAMS
from .._spec import POLICY, Patch, Verdict, Wrap, needed, unsupported
from . import unused_param_reduction


def _structural_check() -> Verdict:
    if not unused_param_reduction.has_fill():
        return unsupported(
            "no unused-param fill (torch has no FSDPModule.set_reduce_scatter_unused_params and "
            "unused_param_reduction is not applied)"
        )
    return needed("units can zero-fill unused parameters")


def _start_with_flag_on(wrapped, group, args, kwargs):
    result = wrapped(*args, **kwargs)
    setattr(group, unused_param_reduction.FLAG, True)
    return result


PATCH = Patch(
    name="reduce_scatter_unused_params_default_on",
    summary="every FSDP unit starts with reduce_scatter_unused_params on (opt-in)",
    symptom="ranks that use different parameters of one unit issue different reduce-scatters",
    trigger="training code that never calls set_reduce_scatter_unused_params(True)",
    upstream=("PyTorch PR 174862",),
    affected=">=2.6",
    check=_structural_check,
    targets=(Wrap(f"{_compat.FSDP2_PACKAGE}._fsdp_param_group:FSDPParamGroup.__init__", _start_with_flag_on),),
    changes=f"every FSDP unit starts with reduce_scatter_unused_params on ({REDUCE_SCATTER_UNUSED_PARAMS}=1)",
    kind=POLICY,
    variable=REDUCE_SCATTER_UNUSED_PARAMS,
    after=("unused_param_reduction",),  # before 2.13 the flag it sets is the backport's
)
