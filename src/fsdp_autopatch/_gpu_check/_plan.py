"""What ``fsdp-autopatch gpu-check`` runs: per entry its bug case and where that bug can strike, the
launches (which patches each disables, which cases it runs), and, where ``--expected`` names a
``tests/expected.py``, its expectations for the torch found. Standard library only.
Every fix and guard of the catalogue with a case module (``fsdp_autopatch.cases.<entry>``, of the
plugin as installed) is in the check: its model is written once there, so an entry added with its
case is in the GPU check with no line here.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import _catalogue, cases

CASES_DIR = Path(cases.__file__).resolve().parent


@dataclass(frozen=True)
class PatchCase:
    name: str
    what: str  # the case, in a few words (its WHAT)
    kind: str = "fix"  # the catalogue's kind: fix or guard


def _case_what(path: Path) -> str:
    """A case module's ``WHAT`` (read, not imported: the module imports the package)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "WHAT" for t in node.targets):
            return " ".join(str(ast.literal_eval(node.value)).split())
    return "its case"


def _cases() -> tuple[PatchCase, ...]:
    """The catalogue's fixes and guards that have a case module, in catalogue order."""
    return tuple(PatchCase(entry.name, _case_what(CASES_DIR / f"{entry.name}.py"), entry.kind)
                 for entry in _catalogue.ENTRIES if entry.kind != _catalogue.POLICY and entry.name in cases.NAMES)


PATCHES = _cases()
BY_NAME = {p.name: p for p in PATCHES}


def load_expected(path: Path) -> Any:
    """A ``tests/expected.py`` (standard library only) as a module."""
    spec = importlib.util.spec_from_file_location("_gpu_check_expected", path)
    if spec is None or spec.loader is None:
        raise OSError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_off(expected: Any, torch_version: str) -> tuple[dict[str, str], dict[str, str]]:
    """(per entry its bug letter, per entry what ``expected`` says its case shows with its patch
    off on this torch); both empty without ``expected``."""
    if expected is None or not torch_version:
        return {}, {}
    letters = dict(expected.BUG_OF)
    outcome = expected.unpatched_outcome(expected.release_of(torch_version))
    return letters, {name: outcome[letter] for name, letter in letters.items() if letter in outcome}


TRAINING = {  # flavour -> what it adds to the training case (the first four bugs at once)
    "train_eager": "eager",
    "train_compile": "per-block torch.compile",
    "train_offload": "CPUOffloadPolicy(pin_memory=True)",
}
COMPILE_MODES = {  # case -> how it compiles the training flavours' network (``_compile``)
    "compile_whole": "torch.compile(model) after fully_shard",
    "compile_units": "blocks .compile() after fully_shard",
    "compile_torchtitan": "torchtitan: blocks fullgraph, then shard",
}
COMPILE_STEPS = 3  # recompiles show from the second step on


def strikes(name: str, world_size: int, device: str = "cpu") -> tuple[bool, bool, str]:
    """(can entry ``name``'s bug strike at this world size on ``device``, is its case run, why not /
    what instead): its case's ``NEEDS``, then the world sizes its case declares (``cases.at_world_size``)."""
    unmet = cases.unmet(name, device)
    if unmet:
        return False, False, f"{unmet}: not run"
    return cases.at_world_size(name, world_size)


def agrees(expected: str, bug_seen: bool) -> bool | None:
    """Whether an off-run agrees with its expectation; None where there is none to agree with."""
    if expected.startswith("reproduces"):
        return bug_seen
    if expected.startswith("correct"):
        return not bug_seen
    return None


def variable(name: str) -> str:
    return _catalogue.toggle_for(name)


@dataclass
class Launch:
    name: str
    cases: list[str]
    env: dict[str, str] = field(default_factory=dict)
    kind: str = "bugs"  # bugs, training, compile or cost: picks its timeout
    cost: dict | None = None
    solo: bool = False  # run with nothing else on the machine (timings)


def plan(device: str, world_size: int, cost_spec: dict, only: list[str] | None = None,
         off_runs: list[str] | None = None) -> list[Launch]:
    """The launches, in the order they run: the patched bug cases, each bug with its patch off (only
    those in ``off_runs`` when given), the training flavours on and off, the compile modes on and off,
    the step cost."""
    run = [p for p in PATCHES if strikes(p.name, world_size, device)[1] and (not only or p.name in only)]
    flavours = [f for f in TRAINING if device == "cuda" or f != "train_offload"]
    launches = [Launch("plugin on: bug cases", [p.name for p in run])]
    launches += [Launch(f"{p.name} off", [p.name], {variable(p.name): "0"})
                 for p in run if not off_runs or p.name in off_runs]
    if not only:
        launches.append(Launch("plugin on: training", flavours, kind="training"))
        launches.append(Launch("plugin off: training", flavours, {"FSDP_AUTOPATCH_ENABLED": "0"}, kind="training"))
        modes = list(COMPILE_MODES)
        launches.append(Launch("plugin on: compile", modes, kind="compile"))
        launches.append(Launch("plugin off: compile", modes, {"FSDP_AUTOPATCH_ENABLED": "0"}, kind="compile"))
        launches.append(Launch("step cost", [], kind="cost", cost=cost_spec, solo=True))
    return launches


COST_SPECS = {
    # one H200: ~170 M parameters, 16k tokens a micro-batch: tens of ms per step
    "cuda": {"dim": 2048, "tokens": 16384, "blocks": 8, "experts": 4, "rounds": 10, "steps": 5},
    # the CI check of the command itself: as small as still runs every variant
    "cpu": {"dim": 32, "tokens": 16, "blocks": 2, "experts": 4, "rounds": 2, "steps": 2},
}
TIMEOUTS = {  # outer timeout of one launch (s), by kind and device; the overall guard caps each
    "cuda": {"bugs": 150, "training": 300, "compile": 240, "cost": 240},
    "cpu": {"bugs": 90, "training": 150, "compile": 120, "cost": 120},
}
MIN_TIMEOUT_S = {"compile": {"cuda": 90, "cpu": 30}}  # less left: the launch is skipped (20 s for the others)
PG_TIMEOUT_S = {"cuda": 60, "cpu": 30}
COMPILE_BACKEND = {"cuda": "inductor", "cpu": "aot_eager"}
COMPILE_NOTE = {
    "cuda": "inductor (torch.compile's default)",
    "cpu": "aot_eager on CPU: AOTAutograd traces forward and backward as inductor's input, without "
           "inductor's C++ code generation (minutes on this 2-core machine); inductor itself is what runs on CUDA",
}
