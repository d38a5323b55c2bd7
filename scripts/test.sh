#!/usr/bin/env bash
# The test suite: unit, 2-rank gloo distributed, and wheel/venv install tests.
#   scripts/test.sh                     everything
#   scripts/test.sh tests/unit -q       any pytest arguments
source "$(dirname "$0")/_venv.sh"
export CUDA_VISIBLE_DEVICES=""
exec "$VENV/bin/python" -m pytest "${@:-tests}"
