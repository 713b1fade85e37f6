#!/usr/bin/env bash
# Set up (the venv and the Debian packages the tests need), then run the Python test suite and the
# Kotlin core's JVM tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/test_prereqs.sh
if [ -f kotlin_app/run_tests.sh ]; then
  bash kotlin_app/run_tests.sh
fi
. .venv/bin/activate
ruff check .  # pyflakes, import order, line length (pyproject.toml [tool.ruff])
# Two workers: half the suite waits on phones, sockets and timeouts, so the other half computes
# meanwhile; a test module stays on one worker (loadfile; pytest 9.2 ignores the node-id suffix that
# xdist's loadgroup writes) and the exports are built once (tests/conftest.py).
python -m pytest tests bench/tests -n 2 --dist loadfile --durations=40 "$@"  # the slowest, to keep the suite short
