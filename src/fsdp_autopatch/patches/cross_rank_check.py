"""Policy ``cross_rank_check``: every rank of a process group runs the same patches.

What, why, errors and where it steps aside: ``fsdp_autopatch._consistency`` (the check itself).
Declared here like every other entry of the catalogue. On by default; ``FSDP_AUTOPATCH_CROSS_RANK_CHECK=0``
on every rank turns it off. Recorded under ``status().policies``.
"""

from .. import _compat, _consistency, _patching
from .._catalogue import BY_NAME, POLICY
from .._spec import Patch, Verdict, Wrap, needed


def _structural_check() -> Verdict:
    # The root's _lazy_init runs before its first forward, before any FSDP2 collective.
    _patching.original_of(_compat.fsdp_class("_fsdp_state", "FSDPState"), "_lazy_init")
    return needed("FSDPState._lazy_init runs before the root's first collective")


PATCH = Patch(
    name=_consistency.NAME,
    summary="every rank of a process group runs the same patches, checked at the first forward",
    symptom="ranks with different patches issue different collectives: NCCL hangs, gloo aborts",
    trigger="one node's environment differs (a patch switched off, another torch, no plugin)",
    upstream=(),
    affected=">=2.6",
    check=_structural_check,
    targets=(Wrap(f"{_compat.FSDP2_PACKAGE}._fsdp_state:FSDPState._lazy_init", _consistency.check_after_lazy_init),),
    changes=_consistency.ARMED,
    kind=POLICY,
    variable=BY_NAME[_consistency.NAME].variable,
)
