"""One case per entry: the smallest training that meets the entry's bug, written once.

``demo --bug NAME``, the GPU check (``fsdp-autopatch gpu-check``, on any device) and the tests
(``tests/distributed/test_dist_cases.py``) all run these modules; no bug's model is written anywhere
else. A case module is named after its entry (``fsdp_autopatch.cases.<entry>``, found by listing
this package) and holds:

- ``WORLD_SIZE`` (ranks) and ``WHAT`` (the run, in one line): literals, so the demo's parent
  process reads them without torch;
- ``run(rank, world_size, device="cpu") -> dict``: the training with the trigger, on every rank of
  an initialized process group; returns its *raw record*;
- ``reference(world_size) -> dict``: the same training in one process on the CPU, where it is
  right: the values the record is compared with;
- optionally ``judge(record, reference) -> (right, text)``: the case's own verdict, which the demo
  and the GPU check print (default: :func:`judge`). The tests never read it: they judge the raw
  record against ``tests/expected.py`` with their own tolerances;
- optionally ``NEEDS``: what the run needs beyond torch, a tuple of ``"cuda"`` (a CUDA device and
  NCCL: the bug exists only there) and importable module names (``"peft"``). Where one is missing
  (:func:`unmet`), the tests, the demo and the GPU check skip the case and say why. A package need
  (named as its distribution) has its requirement in ``pyproject.toml``'s ``examples`` extra, from
  which the development venv and the compatibility matrix's venvs install it (``scripts/_case_needs.py``);
- optionally ``strikes_at(world_size) -> (strikes, runs, why)``, for a bug that does not strike at
  every world size: whether it can strike at ``world_size``, whether the GPU check (which runs at the
  machine's size) runs the case there all the same, and why not or what a run there shows instead;
  ``None`` where it strikes and runs with nothing to say (:func:`at_world_size`).

A raw record and a reference are JSON values (the demo's and the GPU check's ranks write JSON):
``"grads"`` (the full gradients, ``{name: nested list}``), ``"params"`` (the full weights after the
run's steps), ``"values"`` (``{key: number, bool, str or list}``: process groups, attributes kept,
norms, optimizer steps), each only where the case measures it. :func:`run_case` adds ``"error"``:
``None``, or ``{"type", "message"}`` of what the run raised (a guard's ``GuardError`` included).
Batches and references are drawn on the CPU, so a record reads the same numbers on every device.
torch is imported inside functions only.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import pkgutil
from typing import Any

NAMES = tuple(sorted(module.name for module in pkgutil.iter_modules(__path__) if not module.name.startswith("_")))


def load(name: str):
    """The case module of entry ``name`` (a ``KeyError`` for a name without a case)."""
    if name not in NAMES:
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{name}")


def unmet(name: str, device: str = "cpu") -> str | None:
    """Why entry ``name``'s case cannot run on ``device`` here (its ``NEEDS``), or None where it can.

    Modules are looked up, not imported (``find_spec``): the demo's parent process stays light."""
    missing = []
    for need in getattr(load(name), "NEEDS", ()):
        if need == "cuda":
            if not device.startswith("cuda"):
                missing.append(f"a CUDA device with NCCL (device here: {device})")
        elif importlib.util.find_spec(need) is None:
            missing.append(f"the {need!r} package (pip install {need})")
    return f"{name}'s case needs " + " and ".join(missing) if missing else None


def at_world_size(name: str, world_size: int) -> tuple[bool, bool, str]:
    """(can entry ``name``'s bug strike at ``world_size`` ranks, is its case run there, why not / what
    instead): its case's ``strikes_at``; by default it strikes and runs at every size."""
    rule = getattr(load(name), "strikes_at", None)
    said = rule(world_size) if rule is not None else None
    return said if said is not None else (True, True, "")


def run_case(name: str, rank: int, world_size: int, device: str = "cpu") -> dict[str, Any]:
    """Entry ``name``'s run on this rank: its raw record, with ``"error"`` (what it raised, or None).

    Every exception of the run is recorded, not raised: a bug's crash is the record's value.
    """
    try:
        record = dict(load(name).run(rank, world_size, device=device))
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as error:  # the bug's crash or a guard's stop (DCP's CheckpointException is a BaseException)
        return {"error": error_record(error)}
    try:  # the demo and the GPU check write records as JSON: a case that returns more breaks them all alike
        json.dumps(record, allow_nan=True)
    except (TypeError, ValueError) as error:
        return {"error": {"type": "CaseError", "message": f"case {name!r} returned a record that is not JSON: {error}"}}
    record["error"] = None
    return record


def error_record(error: BaseException) -> dict[str, str]:
    return {"type": type(error).__name__, "message": str(error)}


def error_text(error: dict[str, str]) -> str:
    return f"{error['type']}: {error['message']}"


def verdict(name: str, record: dict[str, Any], world_size: int) -> dict[str, Any]:
    """What the demo and the GPU check print of rank 0's ``record``: ``{"right", "value"}``, and a
    guard's whole error (``"guard_error"``) where the run stopped with one. Computes the reference."""
    error = record.get("error")
    if error and error["type"] == "GuardError":  # whole: it is what the user's own run prints
        return {"right": True, "value": "the run stopped with the guard's error:", "guard_error": error_text(error)}
    if error:
        return {"right": False, "value": error_text(error)}
    module = load(name)
    right, value = getattr(module, "judge", judge)(record, module.reference(world_size))
    return {"right": right, "value": value}


def judge(record: dict[str, Any], reference: dict[str, Any]) -> tuple[bool, str]:
    """The default verdict: no error, and the gradients and weights the reference has equal it
    (``max |got - ref| / max |ref|`` within ``_common.TOLERANCE``)."""
    from ._common import judge_against_reference

    if record.get("error"):
        return False, error_text(record["error"])
    return judge_against_reference(record, reference)


__all__ = ["NAMES", "at_world_size", "error_record", "error_text", "judge", "load", "run_case", "unmet", "verdict"]
