#!/usr/bin/env bash
# Issue 5, third session, call 4 (one GPU, <= 560 s): after the RHT-amax kernel and the fused
# XLA butterfly.
#   phase 1 (parallel): gpu_check_fakequant.py dot3 (dot on vs off, bit for bit, 3 shapes)
#                       || GPU pytest of test_dot (kernel path is the default now)
#   phase 2: bench_kernels.py fakequant1 dotkern1 (alone on the GPU)
#   phase 3: profile_dot.py, kernels on and off (per-kernel breakdown of the fwd+bwd)
#   OUT=<dir> bash experiments/gpu_run14.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$OUT/env.log" 2>&1
( timeout 150 python3 experiments/gpu_check_fakequant.py dot3 >"$OUT/check.log" 2>&1; echo "check exit $?" >>"$OUT/check.log" ) &
( JAX_PLATFORMS=cuda,cpu timeout 150 python3 -m pytest -q -p no:benchmark -n 3 -rfE tests/test_dot.py \
    >"$OUT/pytest.log" 2>&1; echo "pytest exit $?" >>"$OUT/pytest.log" ) &
wait
timeout 230 python3 experiments/bench_kernels.py fakequant1 dotkern1 >"$OUT/bench.log" 2>&1
echo "bench exit $?" >>"$OUT/bench.log"
mkdir -p "$OUT/on" "$OUT/off"
OUT=$OUT/on FP4JAX_KERNELS=on timeout 70 python3 experiments/profile_dot.py --skip-pieces >"$OUT/on/profile.log" 2>&1
echo "exit $?" >>"$OUT/on/profile.log"
OUT=$OUT/off FP4JAX_KERNELS=off timeout 60 python3 experiments/profile_dot.py --skip-pieces >"$OUT/off/profile.log" 2>&1
echo "exit $?" >>"$OUT/off/profile.log"
date -u >>"$OUT/env.log"
