"""Third-party patches (entry-point group ``fsdp_autopatch.patches``) against the installed torch.

Each case puts one or two stand-in distributions (a ``*.dist-info`` with ``entry_points.txt`` next
to their module) on PYTHONPATH of a fresh interpreter, imports ``torch.distributed.fsdp`` and reads
``fsdp_autopatch.status()``. The worked example's own source (examples/third_party_patch) is one of
them; tests/install/test_install_third_party.py builds and installs its real wheel.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_fault_injection import describe, run_child

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "third_party_patch" / "src" / "fsdp_autopatch_example"
PROVIDER = "fsdp-autopatch-example 0.1.0"

PROGRAM = """
    import json, sys
    error = None
    try:
        import torch.distributed.fsdp
    except Exception as e:
        error = type(e).__name__ + ": " + str(e)
    import fsdp_autopatch
    report = fsdp_autopatch.status().to_dict()
    print(json.dumps({"error": error, "patches": {p["name"]: p for p in report["patches"]}}))
"""


def make_dist(root: Path, dist: str, entry_points: dict[str, str], module: str | None = None, source: str = "") -> Path:
    """A distribution as pip leaves it: ``<dist>-0.1.0.dist-info`` (METADATA, entry_points.txt) + module."""
    info = root / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[fsdp_autopatch.patches]\n{lines}")
    if module:
        (root / f"{module}.py").write_text(source)
    return root


def example(root: Path, broken: str = "") -> Path:
    shutil.copytree(EXAMPLE, root / "fsdp_autopatch_example")
    if broken:
        init = root / "fsdp_autopatch_example" / "__init__.py"
        init.write_text(f"{broken}\n{init.read_text()}")
    return make_dist(root, "fsdp-autopatch-example", {"post_backward_census": "fsdp_autopatch_example:PATCH"})


def run(path: Path, env: dict | None = None) -> dict:
    result = run_child(PROGRAM, path=[path], env=env)
    assert result.returncode == 0 and result.stderr == "", describe(result)
    return json.loads(result.stdout.splitlines()[-1])


def test_the_example_applies_after_the_builtin_patches_with_its_provider(tmp_path):
    data = run(example(tmp_path))
    assert data["error"] is None
    names = list(data["patches"])
    assert names[-1] == "post_backward_census"  # built-in patches first
    record = data["patches"]["post_backward_census"]
    assert record["status"] == "applied", record
    assert record["provider"] == PROVIDER
    assert record["env"] == "FSDP_AUTOPATCH_POST_BACKWARD_CENSUS_ENABLED"
    # it wraps FSDPParamGroup.post_backward too: the registry says it composes
    assert "FSDPParamGroup.post_backward (over " in record["reason"], record
    assert "(over " in record["reason"] and "restore_unused_param_grads" in record["reason"], record  # and later ones
    assert all(data["patches"][name]["provider"] is None for name in names[:-1])


@pytest.mark.parametrize(
    "env, variable",
    [
        ({"FSDP_AUTOPATCH_POST_BACKWARD_CENSUS_ENABLED": "0"}, "FSDP_AUTOPATCH_POST_BACKWARD_CENSUS_ENABLED"),
        ({"FSDP_AUTOPATCH_DISABLED": "post_backward_census"}, "FSDP_AUTOPATCH_DISABLED"),
        ({"FSDP_AUTOPATCH_THIRD_PARTY": "0"}, "FSDP_AUTOPATCH_THIRD_PARTY"),
    ],
)
def test_toggles_turn_it_off_and_say_which(tmp_path, env, variable):
    data = run(example(tmp_path), env)
    record = data["patches"]["post_backward_census"]
    assert (record["status"], record["variable"]) == ("disabled", variable), record
    assert data["patches"]["restore_unused_param_grads"]["status"] == "applied"


def test_a_broken_patch_is_recorded_and_breaks_nothing(tmp_path):
    data = run(example(tmp_path, broken="raise ImportError('injected by the test')"))
    assert data["error"] is None  # the user's import works
    record = data["patches"]["post_backward_census"]
    assert record["status"] == "failed", record
    assert record["reason"] == f"loading the patch failed in {PROVIDER}: ImportError: injected by the test"
    assert data["patches"]["restore_unused_param_grads"]["status"] == "applied"  # on every release


def test_strict_re_raises_a_broken_patch(tmp_path):
    data = run(example(tmp_path, broken="raise ImportError('injected by the test')"), {"FSDP_AUTOPATCH_STRICT": "1"})
    assert data["error"] == "ImportError: injected by the test"


def test_a_name_of_a_builtin_patch_is_refused(tmp_path):
    make_dist(
        tmp_path, "evil-dist", {"uniform_reduce_dtype": "evil:PATCH"}, "evil", "raise SystemExit('never imported')"
    )
    data = run(tmp_path)
    assert data["patches"]["uniform_reduce_dtype"]["provider"] is None
    assert data["patches"]["uniform_reduce_dtype"]["status"] != "failed"  # applied, or not_needed on 2.15
    refused = data["patches"]["evil-dist:uniform_reduce_dtype"]
    assert refused["status"] == "failed" and refused["provider"] == "evil-dist 0.1.0"
    builtin = "the name 'uniform_reduce_dtype' is a built-in patch or policy of fsdp-autopatch"
    assert refused["reason"] == f"refused: {builtin}"


def test_refused_ones_are_disabled_with_every_third_party_patch(tmp_path):
    make_dist(tmp_path, "evil-dist", {"uniform_reduce_dtype": "evil:PATCH"}, "evil", "raise SystemExit('never')")
    refused = run(tmp_path, {"FSDP_AUTOPATCH_THIRD_PARTY": "0"})["patches"]["evil-dist:uniform_reduce_dtype"]
    assert refused["status"] == "disabled", refused
    assert refused["env"] == "FSDP_AUTOPATCH_THIRD_PARTY"  # its name's toggle belongs to the built-in


def test_a_name_two_distributions_declare_is_refused_for_both(tmp_path):
    example(tmp_path)
    make_dist(tmp_path / "other", "other-dist", {"post_backward_census": "fsdp_autopatch_example:PATCH"})
    data = run_two(tmp_path)
    assert "post_backward_census" not in data["patches"]
    for key in ("fsdp-autopatch-example:post_backward_census", "other-dist:post_backward_census"):
        reason = "refused: 2 installed distributions declare a patch named 'post_backward_census'"
        assert data["patches"][key]["reason"] == reason


def run_two(root: Path) -> dict:
    result = run_child(PROGRAM, path=[root, root / "other"])
    assert result.returncode == 0 and result.stderr == "", describe(result)
    return json.loads(result.stdout.splitlines()[-1])


def test_something_else_than_a_patch_is_refused_with_a_clear_error(tmp_path):
    make_dist(tmp_path, "odd-dist", {"odd_patch": "odd:PATCH"}, "odd", "PATCH = {'name': 'odd_patch'}")
    record = run(tmp_path)["patches"]["odd_patch"]
    assert record["status"] == "failed"
    assert record["reason"].endswith("TypeError: the entry point gives a dict, not a fsdp_autopatch.Patch"), record
