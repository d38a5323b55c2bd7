"""Real Hugging Face ``transformers`` models under FSDP2 (2 gloo ranks on CPU, torchrun).

Reuses the helpers of ``tests/distributed`` (``_dist_launcher``, ``_dist_checks``,
``test_dist_torchrun``), so that folder goes on ``sys.path``. Every test here gets the
``models`` marker (declared in pyproject.toml): deselect the folder with ``-m "not models"``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DISTRIBUTED = str(HERE.parent / "distributed")
if DISTRIBUTED not in sys.path:
    sys.path.insert(0, DISTRIBUTED)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.models)


@pytest.fixture(scope="session", autouse=True)
def _require_gloo_fsdp2() -> None:
    from _dist_launcher import fsdp2_gloo_skip_reason

    reason = fsdp2_gloo_skip_reason()
    if reason:
        pytest.skip(reason)
