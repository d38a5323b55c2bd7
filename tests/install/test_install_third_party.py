"""The worked example of a third-party patch (examples/third_party_patch), built and installed for real.

Its wheel is built like ours and installed next to fsdp-autopatch's wheel in one fresh venv of its
own: installed into the shared torch venv, it would add a record to every other install test's
status. That venv gets torch by linking the torch venv's site-packages (``Venv.linked_to``), not by a
second torch install; fsdp-autopatch and the example are pip-installed into it.

Checked with subprocesses, each bounded: a 2-rank gloo run under torchrun (the example's patch is
``applied`` on both ranks with its provider, and its census counts every unit once per backward),
``fsdp-autopatch status --json``, its toggle, a broken copy (recorded ``failed``, the user's import
unharmed, torch untouched by it) and ``fsdp-autopatch doctor``.

A second distribution, ``traps_patch/`` (a guard and a fix, built and installed in a venv of their
own), springs on purpose the four traps of a framework author: its own ``GuardError``, ``wrapped``'s
function attributes, an argument not declared in ``Wrap.reads``, a collective of its own that times
out (through ``fsdp_autopatch.torch_call``); its structural check uses only the public helpers.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from _install_support import (
    CLI_STATUSES,
    DEFAULT_STATUSES,
    REPO,
    T_TORCH,
    Venv,
    assert_torch_matches_registry,
    build_wheel,
    clean_env,
    describe,
    json_from,
    probe_code,
    run,
    statuses,
)

pytestmark = [pytest.mark.install, pytest.mark.timeout(1800)]  # includes building the torch venv

EXAMPLE = REPO / "examples" / "third_party_patch"
TRAPS = Path(__file__).resolve().parent / "traps_patch"
NAME = "post_backward_census"
PROVIDER = "fsdp-autopatch-example 0.1.0"
TOGGLE = "FSDP_AUTOPATCH_POST_BACKWARD_CENSUS_ENABLED"
# torch warns on import when numpy is not installed (these venvs have none); that line is torch's
TORCH_NOISE = {"PYTHONWARNINGS": "ignore:Failed to initialize NumPy"}
T_RANKS = 300  # torchrun's agent and two ranks each import torch; each rank's gloo timeout is 30 s
BACKWARDS = 3

RANKS = r'''
import datetime, json, os, sys
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdp_autopatch
import fsdp_autopatch_example

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
fully_shard(model[0], mesh=mesh)
fully_shard(model[2], mesh=mesh)
fully_shard(model, mesh=mesh)  # three units: "0", "2" and the root
census = []
for _ in range({backwards}):
    model(torch.randn(4, 8)).sum().backward()
    census.append(fsdp_autopatch_example.census())
report = fsdp_autopatch.status()
with open(f"rank{{dist.get_rank()}}.json", "w") as out:
    json.dump({{"record": report["{name}"].to_dict(), "policies": report.policies, "census": census}}, out)
dist.barrier()  # no rank leaves while its peer still waits on it in a collective
dist.destroy_process_group()
# Leave without interpreter finalization: during it, a gloo worker thread that still has to release a
# work captured in backward aborts the rank, at random, plugin on or off (docs/troubleshooting.md).
os._exit(0)
'''


@pytest.fixture(scope="module")
def example_wheel(install_root: Path) -> Path:
    return build_wheel(EXAMPLE, install_root / "dist-example")


def _ours(name: str) -> bool:
    return "fsdp_autopatch" in name.lower() or name == "__pycache__"


@pytest.fixture(scope="module")
def example_venv(torch_venv: Venv, wheel: Path, example_wheel: Path, install_root: Path) -> Venv:
    """torch (linked from the torch venv), fsdp-autopatch's wheel and the example's wheel.

    ``--no-deps`` for the example: its requirement on fsdp-autopatch is checked on its own
    (test_the_example_requires_a_version_our_wheel_has), so that the checks below still run when
    that one fails."""
    venv = Venv.linked_to(torch_venv, install_root / "venv-third-party", leave_out=_ours)
    venv.install_plugin(wheel)
    venv.pip("install", "-q", "--no-deps", example_wheel)
    return venv


def cli_json(venv: Venv, *args: str, env: dict | None = None, exits: tuple = (0,)) -> dict:
    """``fsdp-autopatch <args> --json`` (the console script pip put into the venv), silent on stderr."""
    command = [venv.bin("fsdp-autopatch"), *args, "--json"]
    result = run(command, env=clean_env({**TORCH_NOISE, **(env or {})}), timeout=T_TORCH)
    assert result.returncode in exits and result.stderr == "", describe(result)
    return json.loads(result.stdout)


def records(report: dict) -> dict[str, dict]:
    return {record["name"]: record for record in report["patches"]}


def test_the_example_requires_a_version_our_wheel_has(example_wheel: Path, wheel: Path) -> None:
    """``pip install`` of the example next to our wheel resolves (what its README tells users)."""
    with zipfile.ZipFile(example_wheel) as archive:
        (metadata,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        lines = archive.read(metadata).decode().splitlines()
    (requirement,) = [Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")]
    ours = wheel.name.split("-")[1]
    assert requirement.name == "fsdp-autopatch"
    assert requirement.specifier.contains(ours, prereleases=True), (
        f"the example requires {requirement}, this checkout builds fsdp-autopatch {ours}: "
        "pip install of both fails with ResolutionImpossible"
    )


def test_two_gloo_ranks_apply_it_and_count_every_unit_once_per_backward(example_venv: Venv, tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS.format(backwards=BACKWARDS, name=NAME))
    command = [example_venv.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script]
    result = run(command, env=clean_env({**TORCH_NOISE, "OMP_NUM_THREADS": "1"}), timeout=T_RANKS, cwd=tmp_path)
    assert result.returncode == 0, describe(result)
    for rank in (0, 1):
        data = json.loads((tmp_path / f"rank{rank}.json").read_text())
        record = data["record"]
        assert (record["status"], record["provider"]) == ("applied", PROVIDER), record
        assert record["fired"] == 0  # it counts, it fixes nothing
        assert "cross_rank_check" in data["policies"], data["policies"]  # which compared it across ranks
        units = sorted(data["census"][-1])
        assert len(units) == 3 and {"0", "2"} < set(units), data["census"]
        assert data["census"] == [dict.fromkeys(units, k) for k in range(1, BACKWARDS + 1)], (rank, data["census"])


def test_status_json_shows_it_after_the_builtin_patches_with_its_provider(example_venv: Venv) -> None:
    report = cli_json(example_venv, "status")
    assert list(statuses(report)) == [*CLI_STATUSES, NAME]
    assert statuses(report) == {**CLI_STATUSES, NAME: "applied"}
    record = records(report)[NAME]
    assert (record["provider"], record["env"]) == (PROVIDER, TOGGLE), record
    assert all(records(report)[name]["provider"] is None for name in DEFAULT_STATUSES)


def test_its_toggle_turns_it_off_alone(example_venv: Venv) -> None:
    report = cli_json(example_venv, "status", env={TOGGLE: "0"})
    assert statuses(report) == {**CLI_STATUSES, NAME: "disabled"}
    record = records(report)[NAME]
    assert (record["variable"], record["value"], record["provider"]) == (TOGGLE, "0", PROVIDER), record


def test_doctor_names_it_and_its_provider(example_venv: Venv) -> None:
    # the verdict over the whole install is test_install_doctor's; here: the example's own finding
    report = cli_json(example_venv, "doctor", exits=(0, 1))
    (finding,) = [f for f in report["findings"] if f["check"] == NAME]
    assert finding["level"] == "ok", finding
    assert finding["message"].startswith("applied: ") and finding["message"].endswith(f"[from {PROVIDER}]"), finding


@pytest.fixture
def broken_example(example_venv: Venv):
    """The installed example's module raises at import; put back afterwards."""
    module = example_venv.site_packages / "fsdp_autopatch_example" / "__init__.py"
    original = module.read_text()
    module.write_text(f"raise ImportError('broken on purpose by the test')\n{original}")
    try:
        yield example_venv
    finally:
        module.write_text(original)


def test_a_broken_copy_is_recorded_failed_and_the_import_goes_on(broken_example: Venv) -> None:
    result = broken_example.py(probe_code(), env=TORCH_NOISE, timeout=T_TORCH)
    assert result.returncode == 0 and result.stderr == "", describe(result)  # import torch.distributed.fsdp
    probe = json.loads(result.stdout.splitlines()[-1])
    assert statuses(probe["status"]) == {**DEFAULT_STATUSES, NAME: "failed"}
    record = records(probe["status"])[NAME]
    assert record["provider"] == PROVIDER
    assert record["reason"] == f"loading the patch failed in {PROVIDER}: ImportError: broken on purpose by the test"
    assert_torch_matches_registry(probe)  # only the built-in patches' wrappers: torch untouched by it


# --- the four traps: a guard and a fix of another distribution ---------------------------------

TRAPS_PROGRAM = r"""
import json
import torch
import torch.distributed.fsdp
from torch.distributed.fsdp._fully_shard import _fsdp_common
import fsdp_autopatch
import fsdp_autopatch_traps as traps


def attempt(mode):
    traps.MODE = mode
    try:
        return {"result": list(_fsdp_common._get_dim0_padded_size(torch.Size([5, 2]), 4))}
    except Exception as error:
        return {"error": type(error).__name__, "message": str(error), "theirs": error is traps.RAISED.get(mode)}


out = {mode or "plain": attempt(mode) for mode in ("", "guard", "guard_from_fix", "collective", "undeclared")}
out["after"] = attempt("")
out["seen"] = traps.SEEN
out["records"] = {name: fsdp_autopatch.status()[name].to_dict() for name in ("traps_fix", "traps_guard")}
print(json.dumps(out))
"""
TORCHS = [8, 2]  # _get_dim0_padded_size(torch.Size([5, 2]), 4): dim 0 padded to a multiple of 4


@pytest.fixture(scope="module")
def traps(torch_venv: Venv, wheel: Path, install_root: Path) -> dict:
    """What ``TRAPS_PROGRAM`` saw, each mode in turn, in a venv with our wheel and the traps' wheel."""
    traps_wheel = build_wheel(TRAPS, install_root / "dist-traps")
    venv = Venv.linked_to(torch_venv, install_root / "venv-traps", leave_out=_ours)
    venv.install_plugin(wheel)
    venv.pip("install", "-q", "--no-deps", traps_wheel)
    return json_from(venv.py(TRAPS_PROGRAM, env=TORCH_NOISE, timeout=T_TORCH))


def test_a_third_party_guard_is_applied_and_its_guard_error_reaches_the_user(traps: dict) -> None:
    assert traps["plain"] == {"result": TORCHS} and traps["after"] == {"result": TORCHS}, traps
    assert traps["guard"]["error"] == "GuardError" and traps["guard"]["theirs"], traps["guard"]
    assert "stopped on purpose" in traps["guard"]["message"]
    guard = traps["records"]["traps_guard"]
    assert (guard["status"], guard["fired"], guard["provider"]) == ("applied", 1, "fsdp-autopatch-traps 0.1.0"), guard


def test_a_guard_error_of_a_third_party_fix_reaches_the_user_too(traps: dict) -> None:
    assert traps["guard_from_fix"]["error"] == "GuardError" and traps["guard_from_fix"]["theirs"], traps


def test_wrapped_forwards_the_attributes_of_torchs_function(traps: dict) -> None:
    for name in ("traps_fix", "traps_guard"):  # the guard's wrapped is the fix's wrapper around torch's
        assert traps["seen"][name] == {
            "name": "_get_dim0_padded_size",
            "qualname": "_get_dim0_padded_size",
            "module": "torch.distributed.fsdp._fully_shard._fsdp_common",
            "doc_is_torchs": True,
            "wrapped_is_torchs": True,
        }, (name, traps["seen"])


def test_a_collective_of_its_own_that_times_out_reaches_the_caller_unchanged(traps: dict) -> None:
    collective = traps["collective"]
    assert collective["theirs"] and "timeout" in collective["message"].lower(), collective


def test_an_undeclared_argument_fails_the_patch_with_a_reason_naming_it_and_reads(traps: dict) -> None:
    assert traps["undeclared"] == {"result": TORCHS}, traps["undeclared"]  # torch's original ran instead
    fix = traps["records"]["traps_fix"]
    assert fix["status"] == "failed", fix
    assert fix["reason"].startswith("failed at call time: UndeclaredArgument: "), fix
    assert "'no_such_argument'" in fix["reason"] and "Wrap.reads ('dim0_factor',)" in fix["reason"], fix
    assert "fsdp_autopatch_traps._fix" in fix["reason"], fix  # where: the author's function
    assert traps["records"]["traps_guard"]["status"] == "applied"  # the guard was not the one at fault
