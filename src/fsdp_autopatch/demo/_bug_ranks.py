"""The rank side of ``demo --bug NAME``: run the entry's case (``fsdp_autopatch.cases.<NAME>``).

Every rank runs the case on CPU ranks (gloo); rank 0 then judges its raw record against the case's
one-process reference (``cases.verdict``): ``{"right": bool, "value": str}``, what was measured
(process groups, gradients against the reference, attribute names, norms) and whether that is the
right value. torch is imported inside functions.
"""

from __future__ import annotations

from typing import Any, NoReturn


def bug_worker_main(bug: str, rank: int, out_dir: str, deadline_s: float) -> NoReturn:
    """One rank of ``demo --bug``: write ``<out_dir>/rank<r>.json`` (result or error), then exit."""
    from ._worker import run_rank_process

    run_rank_process(lambda result, progress: result.update(_show(bug, rank, progress)), rank, out_dir, deadline_s)


def _show(bug: str, rank: int, progress) -> dict[str, Any]:
    import os

    import torch
    import torch.distributed.fsdp  # noqa: F401  -- the patches are applied on this import

    from .._rank_side import end_process_group, init_process_group
    from ._scenarios import PG_TIMEOUT_S

    torch.set_num_threads(1)  # the ranks share the machine's cores
    progress.at("init_process_group")
    init_process_group(PG_TIMEOUT_S)
    progress.at(bug)
    from .. import cases

    world_size = int(os.environ["WORLD_SIZE"])
    record = cases.run_case(bug, rank, world_size)
    progress.at("barrier")
    end_process_group()
    if rank != 0:
        return {"right": True, "value": ""}
    progress.at("reference")
    out = cases.verdict(bug, record, world_size)
    out.update(_what_the_plugin_says(bug))
    return out


def _what_the_plugin_says(bug: str) -> dict[str, Any]:
    """The patch's registry record and declaration, so that the demo never repeats them."""
    try:
        import fsdp_autopatch
        from fsdp_autopatch.patches import load_patch

        records = fsdp_autopatch.status().to_dict()["patches"]
        declared = load_patch(bug)
        return {
            "status": next((r for r in records if r["name"] == bug), {}),
            "declared": {"symptom": declared.symptom, "upstream": ", ".join(declared.upstream),
                         "summary": declared.summary},
        }
    except Exception as exc:  # informative only: the run's value stands without it
        return {"status": {"status": "unknown", "reason": f"{type(exc).__name__}: {exc}"}}
