#!/bin/bash
# stop 53 (nvidia-h200): gemm_stats through quantized_dot.reference_gemms (each operand
# quantized once) against fp4jax.dot on the GPU, and the `small` stats step's compile time
# at this commit and at 985a178 (before reference_gemms; its fp4jax/ and pallas_kernels/
# carried in .data/old985, from `git archive 985a178 fp4jax pallas_kernels`)
set -u
PY=/opt/torch/.venv/bin/python
export PATH=/opt/torch/.venv/bin:$PATH FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
nvidia-smi -L > $OUT/device.txt
run() {  # name pythonpath args...
  local name=$1 pp=$2; shift 2
  PYTHONPATH=$pp $PY experiments/stats_step_check.py "$@" --out $OUT/$name > $OUT/$name.log 2>&1
  echo "$name rc=$?"; tail -3 $OUT/$name.log
}
S="--preset small --batch-size 16 --seq-len 256"
run new $PWD --part bits stats $S --commit $FP4JAX_COMMIT
run old $PWD/.data/old985 --part stats $S --commit 985a178
run new_again $PWD --part stats $S --commit $FP4JAX_COMMIT
