#!/usr/bin/env bash
# Issue 5, fourth session, call 2 (one GPU, <= 590 s): the auto threshold and dot's exactness.
#   phase 1: bench_kernels.py dotsweep (fp4jax.dot nvfp4 fwd / fwd+bwd, kernels on vs off vs
#            bf16, 7 sizes from 2048^3 to 8192x4096x4096)
#   phase 2: gpu_check_fakequant.py dot (kernels on vs off, bit for bit, 5 shapes)
#   OUT=<dir> bash experiments/gpu_run18.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$OUT/env.log" 2>&1
timeout 380 python3 experiments/bench_kernels.py dotsweep >"$OUT/bench.log" 2>&1
echo "bench exit $?" >>"$OUT/bench.log"
timeout 190 python3 experiments/gpu_check_fakequant.py dot >"$OUT/check.log" 2>&1
echo "check exit $?" >>"$OUT/check.log"
date -u >>"$OUT/env.log"
