#!/bin/bash
# stop 45 call B (x1): does XLA drop the bf16 rounding before fp4jax's quantizer?
set -u
PY=/opt/torch/.venv/bin/python
export PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=$PWD FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
mkdir -p $OUT/epc
nvidia-smi -L > $OUT/epc/device.txt
timeout 200 $PY experiments/excess_precision_check.py --out $OUT/epc --tag _default 2>&1 | tee $OUT/epc/default.log
XLA_FLAGS=--xla_allow_excess_precision=false timeout 200 $PY experiments/excess_precision_check.py --out $OUT/epc --tag _noexcess 2>&1 | tee $OUT/epc/noexcess.log
