"""``scripts/next_torch.py``: FSDP2 files of another torch overlaid on the installed one, torch untouched.

Each test builds a tiny overlay folder from the installed torch's own ``_fsdp_param_group.py`` with
one visible edit, and runs the script's registry part (fresh interpreters, ``sys.executable``): the
verdict that the edit changes is reported, an overlay that breaks FSDP2's import is reported with
the overlay line it broke at, and ``--relabel`` changes the ``torch.__version__`` the plugin reads.
About 25 s on 2 cores (three interpreters that import torch). And the suites' skips, by reason.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

import next_torch  # noqa: E402

_TORCH = importlib.util.find_spec("torch")  # found, not imported
GROUP_FILE = (
    Path(_TORCH.submodule_search_locations[0], "distributed", "fsdp", "_fully_shard", "_fsdp_param_group.py")
    if _TORCH is not None else None
)
pytestmark = [
    pytest.mark.skipif(GROUP_FILE is None or not GROUP_FILE.is_file(), reason="needs torch with FSDP2"),
    pytest.mark.timeout(300),  # the outer bound over the probes' own timeouts
]
METHOD = "_init_mp_dtypes"  # what frozen_first_mp_dtypes's structural check looks for on FSDPParamGroup


def overlay_with(tmp_path: Path, source: str) -> Path:
    folder = tmp_path / "overlay"
    folder.mkdir()
    (folder / GROUP_FILE.name).write_text(source)
    return folder


def test_a_method_renamed_in_the_overlay_turns_its_patch_unsupported(tmp_path):
    source = GROUP_FILE.read_text()
    if f"def {METHOD}(" not in source:
        pytest.skip(f"FSDPParamGroup.{METHOD} is not in this torch")
    overlay = overlay_with(tmp_path, source.replace(METHOD, f"{METHOD}_renamed"))
    site = next_torch.write_site(tmp_path / "site", overlay, relabel=None)

    compared = next_torch.compare_registries(sys.executable, site, overlay)

    assert compared["with"]["import_failure"] is None
    assert compared["with"]["overlaid"] == ["_fsdp_param_group"]  # served from the overlay, nothing else
    changes = {row["entry"]: row for row in compared["changes"]}
    assert list(changes) == ["frozen_first_mp_dtypes"], compared["changes"]
    row = changes["frozen_first_mp_dtypes"]
    assert row["without"] in ("applied", "not_needed") and row["with"] == "unsupported"
    assert METHOD in row["reason"]
    table = next_torch.format_changes(compared["changes"])
    assert f"frozen_first_mp_dtypes  {row['without']} -> unsupported" in table
    assert not next_torch.broken(compared, suites={})


def test_an_overlay_that_breaks_the_fsdp2_import_is_reported_where_it_breaks(tmp_path):
    # a newer file that needs an internal this torch lacks, as torch 2.15's files on 2.13
    overlay = overlay_with(tmp_path, "from torch.distributed import _not_in_this_torch\n")
    site = next_torch.write_site(tmp_path / "site", overlay, relabel="2.16.0.dev")

    probed = next_torch.probe(sys.executable, next_torch.environment(site), overlay)

    assert probed["torch"] == "2.16.0.dev"  # the relabel reached torch.__version__
    failure = probed["import_failure"]
    assert "ImportError" in failure["error"] and "_not_in_this_torch" in failure["error"]
    assert failure["where"] == [f"{overlay / GROUP_FILE.name}:1: from torch.distributed import _not_in_this_torch"]
    lines = next_torch.describe_probe("with the overlay", probed)
    assert f"  the FSDP2 import FAILED: {failure['error']}" in lines
    assert next_torch.broken({"without": {}, "with": probed}, suites={})


def test_the_suites_skips_are_reported_with_their_reasons(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="t" name="a"><skipped message="x is unsupported on this torch: RuntimeError"/></testcase>'
        '<testcase classname="t" name="b"><skipped message="needs CUDA"/></testcase>'
        '<testcase classname="t" name="c"><skipped message="needs CUDA"/></testcase>'
        '<testcase classname="t" name="d"/>'
        '</testsuite></testsuites>'
    )
    assert next_torch.skip_reasons(junit) == ["2 x needs CUDA", "1 x x is unsupported on this torch: RuntimeError"]
