"""Rank side of ``fsdp-autopatch gpu-check``: every entry's bug case is its case module
(``fsdp_autopatch.cases.<entry>``, of the plugin as installed), run on the check's device.

Every rank runs the case (``cases.run_case``: its raw record); rank 0 judges its record against the
case's one-process reference (``cases.verdict``) and reports ``{"right": bool, "value": str}``, as
the training cases do. One rule is added for a guard: where the guard is not in force in this process
(its variable is 0, or torch has a check of its own there and the guard is ``not_needed``), an
exception from torch stops the run just as the guard would, so it is reported as the run stopping
(right), not as a crash.
"""

from __future__ import annotations

from typing import Any, Callable

from ._net import Ctx
from ._plan import BY_NAME


def _status(name: str) -> str:
    from .. import status

    return next((p["status"] for p in status().to_dict()["patches"] if p["name"] == name), "unknown")


def _stopped_by_torch(name: str, error: dict[str, str]) -> dict[str, Any]:
    return {"right": True, "value": f"torch stopped the run itself ({name} is {_status(name)} here): "
                                    f"{error['type']}: {error['message'][:200]}"}


def case_for(name: str) -> Callable[[Ctx], dict[str, Any]]:
    """Entry ``name``'s case: its case module, on ``ctx.device``."""
    patch = BY_NAME[name]

    def run(ctx: Ctx) -> dict[str, Any]:
        from .. import cases

        record = cases.run_case(patch.name, ctx.rank, ctx.world_size, device=ctx.device.type)
        if ctx.rank != 0:
            return {"right": True, "value": ""}
        error = record["error"]
        if error and patch.kind == "guard" and error["type"] != "GuardError" and _status(patch.name) != "applied":
            return _stopped_by_torch(patch.name, error)
        return cases.verdict(patch.name, record, ctx.world_size)

    run.__doc__ = f"{patch.name}: {patch.what}"
    return run
