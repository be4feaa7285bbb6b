#!/usr/bin/env bash
# Issue 5, fifth session, call 2 (one H200, <= 590 s): element rounding without int<->float conversions,
# float (full-rate) amax ops in the column kernels; same phases as gpu_run25.sh.
#   phase 1 (parallel): gpu_check_fakequant.py kernels5 (vs the XLA path, bit for
#                       bit) || GPU pytest: SR / threefry / RHT tests of test_core, test_dot
#   phase 2: bench_kernels.py fakequant1 dotkern1 (alone on the GPU)
#   phase 3: profile_dot.py --skip-pieces --hlo (per-kernel breakdown, launch order)
#   OUT=<dir> bash experiments/gpu_run26.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
LOG=$OUT/bench.log  # environment and phase times at its head (8 files come back at most)
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$LOG" 2>&1
( timeout 220 python3 experiments/gpu_check_fakequant.py kernels5 >"$OUT/check.log" 2>&1; echo "check exit $?" >>"$OUT/check.log" ) &
( JAX_PLATFORMS=cuda,cpu timeout 220 python3 -m pytest -q -p no:benchmark -n 3 -rfE tests/test_dot.py \
    tests/test_core.py -k "threefry or sr_ or stochastic or rht or butterfly or dgrad" \
    >"$OUT/pytest.log" 2>&1; echo "pytest exit $?" >>"$OUT/pytest.log" ) &
wait
echo "phase 1 done $(date -u)" >>"$LOG"
timeout 220 python3 experiments/bench_kernels.py fakequant1 dotkern1 >>"$LOG" 2>&1
echo "bench exit $?" >>"$OUT/bench.log"
echo "phase 2 done $(date -u)" >>"$LOG"
FP4JAX_KERNELS=on timeout 140 python3 experiments/profile_dot.py --skip-pieces --hlo >"$OUT/profile.log" 2>&1
echo "profile exit $?" >>"$OUT/profile.log"
date -u >>"$LOG"
