#!/bin/bash
# x1 call 1 of stop 43: bench (switch rows), native rounding, golden Llama under CUDA
set -u
FINAL=$OUT; OUT=/tmp/w; mkdir -p $OUT
PY=/opt/torch/.venv/bin/python
export PYTHONPATH=$PWD
export FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
t0=$(date +%s)
nvidia-smi -L > $OUT/device.txt
$PY experiments/bench_train.py --presets small --configs bf16 nvfp4 nvfp4_fwd_only \
  "bf16(name='nvfp4>bf16-fwd', dgrad.lhs.fmt=nvfp4, dgrad.lhs.rounding=stochastic, dgrad.rhs.fmt=nvfp4, dgrad.rhs.block_2d=True, wgrad.hadamard=16, wgrad.lhs.fmt=nvfp4, wgrad.rhs.fmt=nvfp4, wgrad.rhs.rounding=stochastic)" \
  --time-limit 330 --out $OUT/bench > $OUT/bench.log 2>&1
echo "bench done $(( $(date +%s) - t0 )) s" >> $OUT/timeline.txt
timeout 90 $PY experiments/native_rounding_check.py --out $OUT/native_rounding.json > $OUT/native.log 2>&1
echo "native rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/timeline.txt
mkdir -p /tmp/old && tar xzf .data/old7e8.tar.gz -C /tmp/old && cp -r tests /tmp/old/
(cd /tmp/old && JAX_PLATFORMS=cuda PYTHONPATH=/tmp/old timeout 80 $PY tests/nn/golden/llama_micro_step.py > /tmp/golden_old.json 2>/tmp/golden_old.err)
echo "golden old rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/timeline.txt
JAX_PLATFORMS=cuda timeout 80 $PY tests/nn/golden/llama_micro_step.py > /tmp/golden_new.json 2>/tmp/golden_new.err
echo "golden new rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/timeline.txt
$PY - <<'PYEOF' > $OUT/golden_cuda.json
import json
try:
    a = json.load(open("/tmp/golden_old.json")); b = json.load(open("/tmp/golden_new.json"))
    res = {k: {"same": a["cases"][k] == b["cases"].get(k), "old": a["cases"][k]["loss"], "new": b["cases"].get(k, {}).get("loss")} for k in a["cases"]}; res["jax"] = a["jax"]
except Exception as e:
    res = {"error": repr(e), "old_err": open("/tmp/golden_old.err").read()[-3000:], "new_err": open("/tmp/golden_new.err").read()[-3000:]}
print(json.dumps(res, indent=1))
PYEOF
tail -c 2000 /tmp/golden_old.err /tmp/golden_new.err >> $OUT/timeline.txt
cp /tmp/golden_*.json $OUT/
cat $OUT/timeline.txt
tar czf $FINAL/call.tgz -C /tmp w
cp $OUT/golden_cuda.json $OUT/native_rounding.json $OUT/timeline.txt $FINAL/ 2>/dev/null
cp $OUT/bench/*.md $FINAL/ 2>/dev/null; ls -la $OUT $OUT/bench
