#!/usr/bin/env bash
# One nvidia-h200 call (issue 5), ~400 s, writing <= 6 files to $OUT:
#   phase 1 (parallel; correctness only): GPU pytest of the reciprocal/NaN core tests and the
#           new kernel tests || gpu_check_kernels quantize3 (all rows, longer limit)
#   phase 2: bench_kernels dotkern1: fp4jax.dot nvfp4 at 8192^3, fwd and fwd+bwd, with the
#           kernels off and on (FP4JAX_KERNELS), against bf16, alone on the GPU
#   OUT=<dir> bash experiments/gpu_run8.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } \
  >"$OUT/check.log" 2>&1
( JAX_PLATFORMS=cuda,cpu timeout 150 python3 -m pytest -q -p no:benchmark -n 4 -rfEs \
    tests/test_core.py -k "recip_scaled or div_rn or non_finite or nvfp4 or stochastic" \
    >"$OUT/pytest.log" 2>&1; echo "pytest exit $?" >>"$OUT/pytest.log" ) &
( timeout 170 python3 experiments/gpu_check_kernels.py quantize3 >>"$OUT/check.log" 2>&1
  echo "check exit $?" >>"$OUT/check.log" ) &
wait
timeout "${BENCH_TIMEOUT:-260}" python3 experiments/bench_kernels.py dotkern1 >"$OUT/bench.log" 2>&1
echo "bench exit $?" >>"$OUT/bench.log"
