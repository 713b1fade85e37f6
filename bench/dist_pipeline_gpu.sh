#!/usr/bin/env bash
# The GPU comparison, prepared for a machine with one NVIDIA GPU (under 5 minutes): ZeroLock on 3
# torch.distributed ranks vs torch.distributed.pipelining's GPipe, 1F1B and zero bubble, the same
# chunks, LoRA, data and AdamW, throughput and torch.cuda.max_memory_allocated per rank.
#
#   bash bench/dist_pipeline_gpu.sh [EXPORT_DIR] [TAG]
#
# EXPORT_DIR: a zl-export output with --eager-weights (default build/dist_tiny). Exporting needs
# ExecuTorch, which a GPU server's torch may not load: export where it does and copy the directory:
#   zl-export --model tiny --chunks 0-6,7-13,14-21 --backend portable --eager-weights \
#             --seq-len 128 --micro-batch 4 --loss-positions 64 --out build/dist_tiny
# (a real model: --model ./TinyLlama-1.1B; the bench's figures then mean GPU compute, the tiny
# model's mean overheads). The machine needs torch (CUDA build), transformers, peft, safetensors,
# tokenizers, numpy, matplotlib: pip install -e . --no-deps plus those, no ExecuTorch.
#
# All ranks share the one GPU (cuda:0): NCCL refuses two ranks on one device, so hidden states and
# gradients cross ranks over Gloo as CPU copies (--wire cpu) for every schedule alike; the results
# file records it (ranks_share_gpu). With one GPU per rank use --wire device (NCCL) instead.
set -euo pipefail
cd "$(dirname "$0")/.."
EXPORT=${1:-build/dist_tiny}
TAG=${2:-gpu}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python - <<'PY'
import importlib, sys
missing = [m for m in ("torch", "transformers", "peft", "safetensors", "tokenizers", "numpy", "matplotlib")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing Python packages: {', '.join(missing)}")
import torch
if not torch.cuda.is_available():
    sys.exit(f"this torch ({torch.__version__}) sees no CUDA device")
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
PY
if [ ! -f "$EXPORT/manifest.json" ]; then
  echo "no export at $EXPORT: make one (see the top of this script) and copy it here" >&2
  exit 2
fi
# 3 ranks x 4 schedules, 6 windows of 8 micro-batches; one CPU thread per rank drives its kernels
timeout 280 python bench/dist_pipeline.py --program "$EXPORT" --steps 6 --window 8 --threads 2 \
  --torch-device cuda --share-gpu --wire cpu --tag "$TAG" \
  --note "one GPU shared by the 3 ranks; Gloo (CPU copies) between ranks"
