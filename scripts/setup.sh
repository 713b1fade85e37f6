#!/usr/bin/env bash
# Create .venv and install ZeroLock with its pinned dependencies (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
if ! python -c "import zl_common, exporter, zl_mobile, host, executorch, pytest, xdist, filelock, gguf, cryptography, pyarrow" 2>/dev/null || ! command -v zl-dist >/dev/null || ! command -v ruff >/dev/null; then
  python -m pip install -q --upgrade pip
  python -m pip install -q -e ".[test]"
fi
