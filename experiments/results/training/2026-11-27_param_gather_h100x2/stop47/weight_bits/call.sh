#!/bin/bash
# stop 47 call C (x2): FP4 parameter gather vs plain gather, whole step, XLA excess precision off, mini (issue 37 item 1)
set -u
PY=/opt/torch/.venv/bin/python
export PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=$PWD FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
W=/tmp/wa; mkdir -p $W; t0=$(date +%s)
nvidia-smi -L > $W/device.txt
G="experiments/param_gather_check.py --devices 2 --fsdp 2 --no-deterministic --steps 3 --iterations 2 --commit $FP4JAX_COMMIT --weight-bits"
XLA_FLAGS=--xla_allow_excess_precision=false timeout 500 $PY $G --preset mini --batch-size 64 --seq-len 256 --out $W/mini_noexcess > $W/mini_noexcess.log 2>&1; echo "mini_noexcess rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt
cat $W/timeline.txt; tail -12 $W/mini_noexcess.log
(cd /tmp && tar czf $OUT/wa.tgz wa)
