#!/usr/bin/env bash
# Issue 5, third session, calls 2-3 (one GPU, <= 560 s): the fused GEMM-operand kernels.
#   phase 1 (parallel): gpu_check_fakequant.py (kernels vs XLA path, dot on vs off, bit for bit)
#                       || GPU pytest of test_kernel_fakequant, test_dot, the RHT/threefry core tests
#   phase 2: bench_kernels.py fakequant dotkern3 (alone on the GPU)
#   phase 3: profile_dot.py with the kernels on (per-kernel breakdown of the fwd+bwd)
#   OUT=<dir> bash experiments/gpu_run12.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$OUT/env.log" 2>&1
( timeout 170 python3 experiments/gpu_check_fakequant.py >"$OUT/check.log" 2>&1; echo "check exit $?" >>"$OUT/check.log" ) &
( JAX_PLATFORMS=cuda,cpu timeout 170 python3 -m pytest -q -p no:benchmark -n 3 -rfE \
    tests/test_dot.py \
    tests/test_core.py -k "not interpret and (threefry or rht or butterfly or dot or kernel or stochastic or sr_)" \
    >"$OUT/pytest.log" 2>&1; echo "pytest exit $?" >>"$OUT/pytest.log" ) &
wait
timeout 250 python3 experiments/bench_kernels.py fakequant dotkern3 >"$OUT/bench.log" 2>&1
echo "bench exit $?" >>"$OUT/bench.log"
mkdir -p "$OUT/prof"
OUT=$OUT/prof FP4JAX_KERNELS=on timeout 90 python3 experiments/profile_dot.py --skip-pieces >"$OUT/prof/profile.log" 2>&1
echo "exit $?" >>"$OUT/prof/profile.log"
date -u >>"$OUT/env.log"
