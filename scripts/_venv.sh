# Sourced by scripts/demo.sh and scripts/test.sh: create ./.venv once and install what they need.
# Idempotent and quiet on a second run. Override the interpreter with PYTHON=..., torch with TORCH_SPEC=...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
VENV="${FSDP_AUTOPATCH_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"   # the CPU build lies on this machine's disk

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
# pip's own exit status (pipefail): a failed install stops here with pip's error shown, and no stamp
# is written below, so the next run installs again instead of failing the same way for ever
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "== installing $TORCH_SPEC"
  pip_install "$TORCH_SPEC"
fi
# Editable install of this repo (activates the .pth) plus the test tools and the examples' libraries
# (transformers, Accelerate); never touches torch.
# Skipped when pyproject.toml has not changed since the last install and the package still imports
# (saves ~15 s per run).
STAMP="$VENV/.fsdp_autopatch-installed"
WANT="$(cksum < "$ROOT/pyproject.toml") $ROOT"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ] \
    || ! "$VENV/bin/python" -c "import fsdp_autopatch" >/dev/null 2>&1; then
  pip_install -e "$ROOT[test,examples]"
  echo "$WANT" > "$STAMP"
fi
"$VENV/bin/python" -c "import torch, fsdp_autopatch" >/dev/null 2>&1 || {
  echo "setup failed: torch or fsdp_autopatch cannot be imported in $VENV" >&2
  exit 1
}
