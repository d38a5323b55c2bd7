#!/usr/bin/env bash
# The test suite: ruff first (seconds), then unit, 2-rank gloo distributed, and wheel/venv install tests.
#   scripts/test.sh                     everything
#   scripts/test.sh tests/unit -q       any pytest arguments (ruff always checks the whole repository)
source "$(dirname "$0")/_venv.sh"
export CUDA_VISIBLE_DEVICES=""
# ruff comes with the `test` extra; its settings are in pyproject.toml ([tool.ruff])
"$VENV/bin/ruff" check --quiet . || { echo "ruff check failed (see above; ruff check --fix repairs some)" >&2; exit 1; }
exec "$VENV/bin/python" -m pytest "${@:-tests}"
