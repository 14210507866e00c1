#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the GPU-marked tests, then the demo on CUDA.
# Usage: scripts/gpu_check.sh [OUT_DIR]   (run inside the project's virtual environment)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
mkdir -p "$out"
python - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device: this script is for GPU machines"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/nvidia-smi.csv"
n=$(python -c "import torch; print(max(1, torch.cuda.device_count()))")
# GPU-marked tests (NVML for real, CUDA streams, pinned copies, real OOM, cuDNN).
pytest -m gpu -ra -p no:cacheprovider --ignore=tests/tui -q 2>&1 | tee "$out/gpu-tests.log"
# The observation layer on CUDA: NVML telemetry, CUDA traces, H2D/D2H probe.
tunekit hardware probe --nproc "$((n > 1 ? n : 2))" 2>&1 | tee "$out/probe.log" || true
tunekit profile example:cnn --nproc "$n" --out "$out/profile" 2>&1 | tee "$out/profile.log"
# The demo, tuned on the GPU(s).
tunekit auto example:cnn --nproc "$n" --device cuda --out "$out/auto" --store "$out/store" 2>&1 | tee "$out/auto.log"
# A live job on the GPU: apply a batch change at a step boundary, watch it, stop it.
{
  tunekit run example:cnn --nproc "$n" --device cuda --name gpu --store "$out/store" &  # until stopped
  job=$!
  for _ in $(seq 120); do tunekit status gpu --store "$out/store" --json 2>/dev/null | grep -q '"step": [1-9][0-9]' && break; sleep 1; done
  tunekit apply gpu '{"plugins": {"batch_ps_sizing": {"batch_size": 64}}}' --store "$out/store" || true
  tunekit status gpu --store "$out/store"
  tunekit stop gpu --store "$out/store" || true
  wait "$job"
} 2>&1 | tee "$out/live.log"
echo "done: see $out/"
