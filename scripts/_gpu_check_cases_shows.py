"""Rank side of ``scripts/gpu_check.py``: an entry without a case of its own here runs its
``demo --bug`` show (``fsdp_autopatch.demo.bugs``, from the installed wheel) on the check's device.

A show returns ``{"right": bool, "value": str}`` on every rank, as the cases here do. One rule is
added for a guard: where the guard is not in force in this process (its variable is 0, or torch has
a check of its own there and the guard is ``not_needed``), an exception from torch stops the run
just as the guard would, so it is reported as the run stopping (right), not as a crash.
"""

from __future__ import annotations

from typing import Any, Callable

from _gpu_check_net import Ctx
from _gpu_check_plan import BY_BUG


def _status(name: str) -> str:
    import fsdp_autopatch

    return next((p["status"] for p in fsdp_autopatch.status().to_dict()["patches"] if p["name"] == name), "unknown")


def _stopped_by_torch(name: str, error: Exception) -> dict[str, Any]:
    message = " ".join(str(error).split())[:200]
    return {"right": True, "value": f"torch stopped the run itself ({name} is {_status(name)} here): "
                                    f"{type(error).__name__}: {message}"}


def case_for(bug: str) -> Callable[[Ctx], dict[str, Any]]:
    """The case of bug letter ``bug``: its entry's show, on ``ctx.device``."""
    patch = BY_BUG[bug]

    def run(ctx: Ctx) -> dict[str, Any]:
        from fsdp_autopatch.demo import bugs

        try:
            return bugs.load(patch.name).show(ctx.rank, ctx.world_size, device=ctx.device.type)
        except Exception as error:
            if patch.kind == "guard" and type(error).__name__ != "GuardError" and _status(patch.name) != "applied":
                return _stopped_by_torch(patch.name, error)
            raise

    run.__doc__ = f"{patch.name}: {patch.what}"
    return run
