#!/usr/bin/env bash
# Issue 5, fourth session, call 1 (one GPU, <= 590 s): 8-bit SR draws (a 2x2 square of
# elements per 32-bit Threefry output; fq_rows takes row pairs) and one read for both tensor
# amaxes of x and dy (cols_amaxes).
#   phase 1 (parallel): gpu_check_fakequant.py kernels (vs the XLA path, bit for bit)
#                       || GPU pytest: SR / threefry / RHT tests of test_core, test_dot
#   phase 2: bench_kernels.py fakequant1 dotkern1 (alone on the GPU)
#   OUT=<dir> bash experiments/gpu_run17.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$OUT/env.log" 2>&1
( timeout 250 python3 experiments/gpu_check_fakequant.py kernels >"$OUT/check.log" 2>&1; echo "check exit $?" >>"$OUT/check.log" ) &
( JAX_PLATFORMS=cuda,cpu timeout 250 python3 -m pytest -q -p no:benchmark -n 3 -rfE tests/test_dot.py \
    tests/test_core.py -k "threefry or sr_ or stochastic or rht or butterfly or dgrad" \
    >"$OUT/pytest.log" 2>&1; echo "pytest exit $?" >>"$OUT/pytest.log" ) &
wait
timeout 300 python3 experiments/bench_kernels.py fakequant1 dotkern1 >"$OUT/bench.log" 2>&1
echo "bench exit $?" >>"$OUT/bench.log"
date -u >>"$OUT/env.log"
