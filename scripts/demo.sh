#!/usr/bin/env bash
# The main job: 2 CPU ranks train a tiny vision-language MoE that hits all four FSDP2 bugs.
#   scripts/demo.sh                     with the patches (trains, checks the invariants, exit 0)
#   scripts/demo.sh --without-patches   shows each original failure (bounded by timeouts)
source "$(dirname "$0")/_venv.sh"
export CUDA_VISIBLE_DEVICES=""
exec "$VENV/bin/fsdp-autopatch" demo "$@"
