#!/usr/bin/env bash
# The GPU lab's one entry point for a device call: the checker, the benchmark, the step
# profiler, a training run or the test suite on the GPU, one or several steps in one call,
# each step's log and JSON under $OUT. Run from the repository root:
#
#   FP4JAX_COMMIT=<sha> bash experiments/gpu_lab.sh check all + bench dotkern1
#   bash experiments/gpu_lab.sh check rows cols + profile --preset small --specs bf16 nvfp4
#
# Steps are separated by "+"; each is TOOL ARGS... (ARGS go to the tool unchanged):
#   check    python3 experiments/gpu_check.py     -> gpu_check.json, check.log
#   bench    python3 experiments/bench_kernels.py -> bench_kernels.json, bench.log
#   profile  python3 experiments/profile_step.py  -> profile_step.json, profile.log
#   (profile_dot.py and gpu_tune_quant.py, the former profile and tune steps: in git at
#   4cd04a4, `git show 4cd04a4:experiments/profile_dot.py`)
#   train    python3 -m fp4jax.train (run folder in /tmp; its metrics.jsonl, result.json and
#            compare.* are copied) -> train.log; the machine has no network: carry .data/
#            and pass --data .data/<corpus>
#   pytest   JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -p no:benchmark -> pytest.log
# A tool's second step in the same call writes to $OUT/<tool>_2/ (third: _3, ...).
# Environment: OUT (default /tmp/gpu_lab_out); FP4JAX_COMMIT, the commit recorded in every
# JSON (write the hash into the command: the machine's .git, if any, is not the commit
# being run); LAB_TIMEOUT,
# seconds per step (default 570); FP4JAX_KERNELS, FP4JAX_KERNEL_GEMM pass through.
# $OUT/env.log: date, GPUs, JAX, commit, each step's command, exit status and seconds.
# Exit status: 0 if every step exited 0, else 1 (2: usage).
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
TOOLS=" check bench profile train pytest "

usage() {  # the comment block above
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2
  exit 2
}
[ $# -gt 0 ] || usage
first=1
for a in "$@"; do  # every step's tool is known before anything runs
  if [ "$first" = 1 ] && [[ $TOOLS != *" $a "* ]]; then
    echo "gpu_lab.sh: unknown tool '$a'" >&2
    usage
  fi
  first=0
  [ "$a" = "+" ] && first=1
done
OUT=${OUT:-/tmp/gpu_lab_out}
mkdir -p "$OUT"
ENV_LOG=$OUT/env.log

{
  date -u
  nvidia-smi -L 2>&1 || true
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1
  echo "commit ${FP4JAX_COMMIT:-unset} (FP4JAX_COMMIT); git HEAD here: $(git rev-parse HEAD 2>/dev/null || echo none)"
  echo "command: bash experiments/gpu_lab.sh $*"
} >>"$ENV_LOG"

declare -A SEEN=()
FAILED=0

run_step() {  # TOOL ARGS...
  local tool=$1; shift
  local n=$(( ${SEEN[$tool]:-0} + 1 ))
  SEEN[$tool]=$n
  local dir=$OUT
  [ "$n" -gt 1 ] && dir=$OUT/${tool}_$n
  mkdir -p "$dir"
  local cmd
  case $tool in
    check) cmd=(python3 experiments/gpu_check.py "$@" --out "$dir/gpu_check.json") ;;
    bench) cmd=(python3 experiments/bench_kernels.py "$@" --out "$dir/bench_kernels.json") ;;
    profile) cmd=(python3 experiments/profile_step.py "$@" --out "$dir") ;;
    train) cmd=(python3 -m fp4jax.train "$@" --out "/tmp/gpu_lab_train_$n") ;;
    pytest) cmd=(env JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -p no:benchmark "$@") ;;
  esac
  local t0=$SECONDS
  echo "== step $tool: ${cmd[*]}" | tee -a "$ENV_LOG"
  timeout "${LAB_TIMEOUT:-570}" "${cmd[@]}" 2>&1 | tee "$dir/$tool.log"
  local rc=${PIPESTATUS[0]}
  if [ "$tool" = train ]; then
    cp /tmp/gpu_lab_train_"$n"/{metrics.jsonl,result.json,compare.md,compare.json,compare.png} \
       "$dir/" 2>/dev/null
    for m in /tmp/gpu_lab_train_"$n"/*/metrics.jsonl; do
      [ -f "$m" ] && cp "$m" "$dir/$(basename "$(dirname "$m")")_metrics.jsonl"
    done
  fi
  echo "== step $tool exit $rc after $((SECONDS - t0)) s" | tee -a "$ENV_LOG"
  [ "$rc" -eq 0 ] || FAILED=1
}

step=()
for a in "$@"; do
  if [ "$a" = "+" ]; then
    [ ${#step[@]} -gt 0 ] && run_step "${step[@]}"
    step=()
  else
    step+=("$a")
  fi
done
[ ${#step[@]} -gt 0 ] && run_step "${step[@]}"
date -u >>"$ENV_LOG"
exit "$FAILED"
