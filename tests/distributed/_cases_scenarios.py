"""The rank side of ``test_dist_cases.py``: run entries' cases (``fsdp_autopatch.cases``) by name.

Scenario ``cases`` (gloo ranks; the world size is the cases'): ``args["names"]``, in order, each
recorded under its name as ``{"record": <the case's raw record>}``. The case's own exceptions are in
its record (``cases.run_case``), so one case's crash does not stop the next.
"""

from __future__ import annotations

from _registry import scenario


@scenario("cases")
def sc_cases(ctx) -> None:
    from fsdp_autopatch import cases

    for name in ctx.args["names"]:
        with ctx.case(name, continue_on_error=True) as rec:
            rec["record"] = cases.run_case(name, ctx.rank, ctx.world_size)
