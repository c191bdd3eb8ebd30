#!/usr/bin/env bash
# The loop on one CUDA machine in a few minutes: calibrate it (NCCL collectives when it has 2+ GPUs, CUDA-event
# timings), train a small plan on one GPU with the calibrated topology, and compare predicted with measured.
#
#   bash benchmarks/gpu_loop.sh [OUT_DIR]        # default runs/gpu-loop; prints everything it measured
#
# Steps: 1. `rackcast calibrate --quick` (base preset h200-hgx: what one machine cannot measure, the scale-out
# fabric, is kept from it); 2. a 1-GPU plan of tiny-moe with global batch 64 whose topology is the calibrated file;
# 3. 30 training steps (torchrun, NCCL, bf16 autocast); 4. `rackcast compare` with the side-by-side trace.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-loop}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
CLI=("$PY" -m rackcast.cli)
"$PY" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
time "${CLI[@]}" calibrate --quick --out "$OUT/calibrated.yaml" --save-measurements "$OUT/measurements.json"
head -40 "$OUT/calibrated.yaml"
cat > "$OUT/plan.yaml" <<EOF
# tiny-moe on one GPU, predicted with the topology just calibrated
name: gpu-tiny-1
model: tiny-moe
topology: {name: $(realpath "$OUT/calibrated.yaml"), domains: 1, usable_gpus: 1}
parallel: {}
batch: {global_batch: 64, micro_batch: 16}
optimizer: {name: muonh, lr: 0.01, adam_lr: 0.003}
EOF
rm -rf "$OUT/run"
time GLOO_SOCKET_IFNAME=lo PYTHONPATH=. "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m backend.train --plan "$OUT/plan.yaml" --steps 30 --out "$OUT/run" --data-dir runs/.data --log-every 10
"${CLI[@]}" compare "$OUT/plan.yaml" "$OUT/run" --trace "$OUT/compare-trace.json"
"${CLI[@]}" compare "$OUT/plan.yaml" "$OUT/run" --json > "$OUT/compare.json"
"${CLI[@]}" calibrate --from-run "$OUT/run" --out "$OUT/fitted.yaml"
echo "outputs in $OUT"
