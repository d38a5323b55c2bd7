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


def _skip_reason() -> str | None:
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # pragma: no cover
        return f"torch not importable: {e}"
    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with gloo is not available"
    import expected as ex

    if ex.release_of(torch.__version__) < ex.OLDEST_RUNNABLE:
        return "FSDP2 on gloo/CPU needs torch >= 2.8"
    return None


@pytest.fixture(scope="session", autouse=True)
def _require_gloo_fsdp2() -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
