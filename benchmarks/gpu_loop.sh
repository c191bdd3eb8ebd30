#!/usr/bin/env bash
# The loop on one CUDA machine in a few minutes: calibrate it (CUDA-event timings; NCCL collectives when it has 2+
# GPUs), train two plans on one GPU with the calibrated topology, compare predicted with measured, and fit.
#
#   bash benchmarks/gpu_loop.sh [OUT_DIR]        # default runs/gpu-loop; prints everything it measured
#   PY=python3 bash benchmarks/gpu_loop.sh       # with a Python other than .venv/bin/python
#
# Steps: 1. `rackcast calibrate --quick` (base preset h200-hgx: what one machine cannot measure, the scale-out
# fabric, is kept from it); 2. tiny-moe on one GPU, global batch 64, 30 steps (launch-bound: host time per op
# dominates); 3. marin-ladder-d768 (911M parameters, 192 experts, sequences of 4,096) on one GPU, global batch 8,
# 12 steps (kernels matter); each with torchrun, NCCL, bf16 autocast, then `rackcast compare`; 4. `rackcast calibrate
# --from-run` on both runs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-loop}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
CLI=("$PY" -m rackcast.cli)
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD GLOO_SOCKET_IFNAME=lo PYTHONUNBUFFERED=1
"$PY" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
time "${CLI[@]}" calibrate --quick --out "$OUT/calibrated.yaml" --save-measurements "$OUT/measurements.json"
head -24 "$OUT/calibrated.yaml"
TOPO=$(realpath "$OUT/calibrated.yaml")

plan() {  # name model global_batch micro_batch
  cat > "$OUT/$1.yaml" <<EOF
# $2 on one GPU, predicted with the topology just calibrated (benchmarks/gpu_loop.sh)
name: $1
model: $2
topology: {name: $TOPO, domains: 1, usable_gpus: 1}
parallel: {}
batch: {global_batch: $3, micro_batch: $4}
optimizer: {name: muonh, lr: 0.01, adam_lr: 0.003}
EOF
}

run() {  # name steps
  rm -rf "$OUT/$1-run"
  time "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
      -m backend.train --plan "$OUT/$1.yaml" --steps "$2" --out "$OUT/$1-run" --data-dir runs/.data --log-every 10
  "${CLI[@]}" compare "$OUT/$1.yaml" "$OUT/$1-run" --trace "$OUT/$1-compare-trace.json"
  "${CLI[@]}" compare "$OUT/$1.yaml" "$OUT/$1-run" --json > "$OUT/$1-compare.json"
}

plan gpu-tiny tiny-moe 64 16
run gpu-tiny 30
plan gpu-d768 marin-ladder-d768 8 2
"${CLI[@]}" calibrate --op-counts marin-ladder-d768   # its op counts (the packaged table holds the tiny presets)
run gpu-d768 12 || echo "gpu-d768 failed (exit $?)"
"${CLI[@]}" calibrate --from-run "$OUT/gpu-tiny-run" --from-run "$OUT/gpu-d768-run" --out "$OUT/fitted.yaml" \
    || echo "fit failed (exit $?)"
echo "outputs in $OUT"
