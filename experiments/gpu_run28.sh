#!/usr/bin/env bash
# Issue 5, fifth session, call 4 (one H200, <= 590 s): the README's benchmark with the Pallas
# GEMM (gemm_alpha) on the kernel path: bench_kernels.py fakequant1 dotkern quantize3 w4a4
# (dotkern: kernels with the Pallas GEMM / with XLA's GEMMs / XLA path, vs bf16, 8192^3 and
# 4096^3), then the per-kernel profile of the fwd+bwd.
#   OUT=<dir> bash experiments/gpu_run28.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
LOG=$OUT/bench.log
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$LOG" 2>&1
timeout 450 python3 experiments/bench_kernels.py fakequant1 dotkern quantize3 w4a4 >>"$LOG" 2>&1
echo "bench exit $? $(date -u)" >>"$LOG"
FP4JAX_KERNELS=on timeout 120 python3 experiments/profile_dot.py --skip-pieces >"$OUT/profile.log" 2>&1
echo "profile exit $?" >>"$OUT/profile.log"
date -u >>"$LOG"
