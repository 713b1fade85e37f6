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
python -m pytest tests "$@"
