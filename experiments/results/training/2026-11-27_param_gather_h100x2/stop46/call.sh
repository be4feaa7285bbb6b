#!/bin/bash
# stop 46 call A (x2): FP4 parameter gather bit-identity with XLA's excess precision off (issue 37 item 1)
set -u
PY=/opt/torch/.venv/bin/python
export PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=$PWD FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
W=/tmp/wa; mkdir -p $W; t0=$(date +%s)
nvidia-smi -L > $W/device.txt
G="experiments/param_gather_check.py --devices 2 --fsdp 2 --no-deterministic --steps 3 --iterations 2"
timeout 150 $PY $G --preset mini --batch-size 64 --seq-len 256 --out $W/mini_default > $W/mini_default.log 2>&1; echo "mini_default rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt
XLA_FLAGS=--xla_allow_excess_precision=false timeout 150 $PY $G --preset mini --batch-size 64 --seq-len 256 --out $W/mini_noexcess > $W/mini_noexcess.log 2>&1; echo "mini_noexcess rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt
left=$(( 570 - ($(date +%s) - t0) ))
XLA_FLAGS=--xla_allow_excess_precision=false timeout $left $PY $G --preset small --batch-size 64 --seq-len 256 --out $W/small_noexcess > $W/small_noexcess.log 2>&1; echo "small_noexcess rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt
cat $W/timeline.txt; for f in mini_default mini_noexcess small_noexcess; do echo "== $f"; tail -8 $W/$f.log; done
(cd /tmp && tar czf $OUT/wa.tgz wa)
