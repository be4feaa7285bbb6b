#!/usr/bin/env bash
# Issue 5, seventh session: reciprocal mode x tiling of the rows operand kernel and the
# packed 1x16 kernel, exactness on hard inputs (one H200; run 39 found "auto" slower than
# both "rn" and "table"):
#   gpu_tune_quant.py rows packed cols
#   OUT=<dir> bash experiments/gpu_run40.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
LOG=$OUT/tune.log
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$LOG" 2>&1
timeout 420 python3 experiments/gpu_tune_quant.py rows packed cols >>"$LOG" 2>&1
echo "tune exit $? $(date -u)" >>"$LOG"
