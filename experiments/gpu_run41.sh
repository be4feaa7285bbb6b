#!/usr/bin/env bash
# Issue 5, seventh session: verification of the new fq_rows default (one 256-block tile per
# step, up to 4 double-buffered steps per CTA, "auto" reciprocal) on one H200:
#   phase 1: gpu_tune_quant.py exact rows: all six operand kernels of fp4jax.dot against the
#            XLA path on fresh hard inputs (NaN = NaN), then the default against the previous one
#   phase 2: bench_kernels.py fakequant1 dotkern1 (README rows: the operand kernels with
#            their amax passes, and the NVFP4 recipe fwd+bwd at 8192^3 against bf16)
#   OUT=<dir> bash experiments/gpu_run41.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
LOG=$OUT/tune.log
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$LOG" 2>&1
timeout 200 python3 experiments/gpu_tune_quant.py exact rows2 >>"$LOG" 2>&1
echo "tune exit $? $(date -u)" >>"$LOG"
timeout 330 python3 experiments/bench_kernels.py fakequant1 dotkern1 >"$OUT/bench.log" 2>&1
echo "bench exit $? $(date -u)" >>"$OUT/bench.log"
