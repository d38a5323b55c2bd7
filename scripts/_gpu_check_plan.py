"""What ``scripts/gpu_check.py`` runs: per patch its bug case and where that bug can strike, the
launches (which patches each disables, which cases it runs), and the expectations of
``tests/expected.py`` for the torch found. Standard library only.

Every fix and guard of the catalogue has a case: the first four have cases of their own here
(``_gpu_check_cases.py``: bf16 and the MoE model they share); every later entry runs its
``demo --bug`` show (``fsdp_autopatch.demo.bugs``, from the installed wheel) on the check's device,
so its model is written once and an entry added with its show is in the GPU check with no line here.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = ROOT / "tests" / "expected.py"
PACKAGE = ROOT / "src" / "fsdp_autopatch"


@dataclass(frozen=True)
class PatchCase:
    name: str
    bug: str  # the letter of tests/expected.py and the docs
    what: str  # the case, in a few words
    kind: str = "fix"  # the catalogue's kind: fix or guard
    show: bool = False  # runs the entry's demo --bug show (else a case of this script's)


NATIVE = (
    PatchCase("accumulated_grad_guard", "a", "a tower unit skipped by a text-only micro-batch, accumulation"),
    PatchCase("unused_param_reduction", "b", "ranks run different experts, set_reduce_scatter_unused_params(True)"),
    PatchCase("uniform_reduce_dtype", "c", "an expert first used in the last micro-batch: bf16 next to fp32 gradients"),
    PatchCase("restore_unused_param_grads", "d", "fill on, an expert used by no rank, two AdamW steps"),
)


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _show_what(path: Path) -> str:
    """A show module's ``WHAT`` (read, not imported: the module imports the package)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "WHAT" for t in node.targets):
            return " ".join(str(ast.literal_eval(node.value)).split())
    return "its demo --bug show"


def _show_cases() -> tuple[PatchCase, ...]:
    """The catalogue's fixes and guards after the first four that have a show, in catalogue order."""
    catalogue = _load(PACKAGE / "_catalogue.py", "_gpu_check_catalogue")  # a leaf: imports nothing
    letters = load_expected().BUG_OF if EXPECTED.is_file() else {}
    native = {p.name for p in NATIVE}
    cases = []
    for entry in catalogue.ENTRIES:
        path = PACKAGE / "demo" / "bugs" / f"{entry.name}.py"
        if entry.kind != catalogue.POLICY and entry.name not in native and path.is_file():
            cases.append(PatchCase(entry.name, letters.get(entry.name, entry.name), _show_what(path), entry.kind, True))
    return tuple(cases)


def load_expected():
    """``tests/expected.py`` of this checkout as a module, or None where it is missing."""
    return _load(EXPECTED, "_gpu_check_expected") if EXPECTED.is_file() else None


PATCHES = NATIVE + _show_cases()
BY_NAME = {p.name: p for p in PATCHES}
BY_BUG = {p.bug: p for p in PATCHES}

TRAINING = {  # flavour -> what it adds to the training case (the first four bugs at once)
    "train_eager": "eager",
    "train_compile": "per-block torch.compile",
    "train_offload": "CPUOffloadPolicy(pin_memory=True)",
}


def strikes(bug: str, world_size: int) -> tuple[bool, bool, str]:
    """(can the bug strike at this world size, is its case run, why not / what instead)."""
    if bug == "b" and world_size < 2:
        return (False, True, "one rank issues the only reduce-scatter, so ranks cannot disagree; run instead: "
                "the fill's method exists (torch's from 2.13, the backport before) and gives the right gradients")
    if bug == "e" and (world_size < 4 or world_size % 2):
        return (False, False, f"needs 1 < reshard_after_forward < shard size, i.e. an even mesh of 4 or more "
                f"ranks (k=2), not {world_size}: not run")
    if bug == "d" and world_size < 2:
        return (True, True, "strikes (the fill zero-fills at any size); at one rank the usage flags have no peer, "
                "so the flag all-reduce and its host sync do not run (see the cost's on_forced_sync)")
    return True, True, ""


def expected_off(torch_version: str) -> dict[str, str]:
    """Per bug letter, what tests/expected.py says the case shows with its patch off on this torch."""
    expected = load_expected()
    if expected is None or not torch_version:
        return {}
    return expected.unpatched_outcome(expected.release_of(torch_version))


def agrees(expected: str, bug_seen: bool) -> bool | None:
    """Whether an off-run agrees with its expectation; None where there is none to agree with."""
    if expected.startswith("reproduces"):
        return bug_seen
    if expected.startswith("correct"):
        return not bug_seen
    return None


def variable(name: str) -> str:
    return f"FSDP_AUTOPATCH_{name.upper()}_ENABLED"


@dataclass
class Launch:
    name: str
    cases: list[str]
    env: dict[str, str] = field(default_factory=dict)
    kind: str = "bugs"  # bugs, training or cost: picks its timeout
    cost: dict | None = None
    solo: bool = False  # run with nothing else on the machine (timings)


def plan(device: str, world_size: int, cost_spec: dict, only: list[str] | None = None) -> list[Launch]:
    """The launches, in the order they run: the patched bug cases, each bug with its patch off, the
    training flavours on and off, the step cost."""
    run = [p for p in PATCHES if strikes(p.bug, world_size)[1] and (not only or p.name in only)]
    flavours = [f for f in TRAINING if device == "cuda" or f != "train_offload"]
    launches = [Launch("plugin on: bug cases", [p.bug for p in run])]
    launches += [Launch(f"{p.name} off", [p.bug], {variable(p.name): "0"}) for p in run]
    if not only:
        launches.append(Launch("plugin on: training", flavours, kind="training"))
        launches.append(Launch("plugin off: training", flavours, {"FSDP_AUTOPATCH_ENABLED": "0"}, kind="training"))
        launches.append(Launch("step cost", [], kind="cost", cost=cost_spec, solo=True))
    return launches


COST_SPECS = {
    # one H200: ~170 M parameters, 16k tokens a micro-batch: tens of ms per step
    "cuda": {"dim": 2048, "tokens": 16384, "blocks": 8, "experts": 4, "rounds": 10, "steps": 5},
    # the CI check of the script itself: as small as still runs every variant
    "cpu": {"dim": 32, "tokens": 16, "blocks": 2, "experts": 4, "rounds": 2, "steps": 2},
}
TIMEOUTS = {  # outer timeout of one launch (s), by kind and device; the overall guard caps each
    "cuda": {"bugs": 150, "training": 300, "cost": 240},
    "cpu": {"bugs": 90, "training": 150, "cost": 120},
}
PG_TIMEOUT_S = {"cuda": 60, "cpu": 30}
COMPILE_BACKEND = {"cuda": "inductor", "cpu": "aot_eager"}
COMPILE_NOTE = {
    "cuda": "inductor (torch.compile's default)",
    "cpu": "aot_eager on CPU: AOTAutograd traces forward and backward as inductor's input, without "
           "inductor's C++ code generation (minutes on this 2-core machine); inductor itself is what runs on CUDA",
}
