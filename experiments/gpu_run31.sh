#!/usr/bin/env bash
# Issue 5, sixth session, call 1 (one H200, <= 590 s):
#   phase 1: gpu_check_w4a16v2.py check speed sweep (the new W4A16 decode kernel,
#            pallas_kernels/w4a16_sm90.py: exactness on 9 shapes, speed vs bf16 and the
#            previous kernel, split_k / tile_k / stages sweep at M=16)
#   phase 2: gpu_check_packed.py check2 (the packed token-axis kernel after the 0.11.2
#            lowering fix, commit 69289fa)
#   OUT=<dir> bash experiments/gpu_run31.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
LOG=$OUT/w4a16v2.log
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$LOG" 2>&1
timeout 400 python3 experiments/gpu_check_w4a16v2.py check speed sweep >>"$LOG" 2>&1
echo "w4a16v2 exit $? $(date -u)" >>"$LOG"
timeout 150 python3 experiments/gpu_check_packed.py check2 >"$OUT/packed.log" 2>&1
echo "packed exit $? $(date -u)" >>"$OUT/packed.log"
