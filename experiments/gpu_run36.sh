#!/usr/bin/env bash
# Issue 5, sixth session, W4A16 verification call after the slot-3 shift change and the smem-aware defaults (one H200, <= 590 s):
#   phase 1: gpu_check_w4a16v2.py check speed with the slot-3 plain-shift decode and the
#            default configuration (two compute warpgroups, x read in place)
#   phase 2: SASS of the default kernel at M=16 (MOSAIC_GPU_DUMP_SASS), for op counts
#   phase 3: bench_kernels.py decode (README table rows)
#   OUT=<dir> bash experiments/gpu_run36.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
LOG=$OUT/w4a16v2.log
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$LOG" 2>&1
timeout 300 python3 experiments/gpu_check_w4a16v2.py check speed >>"$LOG" 2>&1
echo "w4a16v2 exit $? $(date -u)" >>"$LOG"
mkdir -p "$OUT/sass"
MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO="$OUT/sass" timeout 60 python3 -c "
import jax, jax.numpy as jnp
from pallas_kernels import w4a16_sm90 as wk
x = jnp.ones((16, 8192), jnp.bfloat16); wp = jnp.zeros((8192, 1024), jnp.uint32)
ws = jnp.ones((512, 8192), jnp.bfloat16)
print(wk.w4a16_matmul(x, wp, ws, jnp.float32(1)).shape)
" >"$OUT/sass.log" 2>&1
echo "sass exit $?" >>"$OUT/sass.log"
timeout 150 python3 experiments/bench_kernels.py decode >"$OUT/bench_decode.log" 2>&1
echo "bench exit $? $(date -u)" >>"$OUT/bench_decode.log"
