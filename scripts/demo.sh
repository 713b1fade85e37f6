#!/usr/bin/env bash
# The main job on the embedded default: export the built-in tiny Llama into three two-phase
# ExecuTorch programs, train it with ZeroLock on three emulated phones, evaluate the adapter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
OUT=${OUT:-build/tiny}
RUN=${RUN:-runs/demo}
if [ ! -f "$OUT/manifest.json" ]; then
  zl-export --model tiny --chunks 0-6,7-13,14-21 --seq-len 32 --micro-batch 2 --loss-positions 8 \
            --backend "${BACKEND:-portable}" --out "$OUT" --verify
fi
rm -rf "$RUN"
zl-host run --program "$OUT" --devices emulated:3 --steps "${STEPS:-30}" --window 4 --lr 1e-2 --out "$RUN"
zl-host eval --program "$OUT" --adapter "$RUN/adapter"
echo "report: $RUN/report.md (plots: loss.png, memory.png, timeline.png)"
