#!/bin/bash
# x1 call 2 of stop 43: the recip fix on the GPU, dot_recipes kernel check, golden Llama under CUDA
set -u
FINAL=$OUT; OUT=/tmp/w; mkdir -p $OUT
PY=/opt/torch/.venv/bin/python
export PYTHONPATH=$PWD
export FP4JAX_COMMIT=${FP4JAX_COMMIT:?}
t0=$(date +%s)
nvidia-smi -L > $OUT/device.txt
mkdir -p /tmp/old && tar xzf .data/old7e8.tar.gz -C /tmp/old && cp -r tests /tmp/old/
(cd /tmp/old && JAX_PLATFORMS=cuda PYTHONPATH=/tmp/old timeout 400 $PY tests/nn/golden/llama_micro_step.py > $OUT/golden_old.json 2>$OUT/golden_old.err; echo "golden old rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/timeline.txt) &
(JAX_PLATFORMS=cuda timeout 400 $PY tests/nn/golden/llama_micro_step.py > $OUT/golden_new.json 2>$OUT/golden_new.err; echo "golden new rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/timeline.txt) &
timeout 120 $PY experiments/native_rounding_check.py recip_scaled_subnormal encode_scale reciprocal_rn --out $OUT/native_rounding.json > $OUT/native.log 2>&1
echo "native rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/timeline.txt
timeout 300 $PY experiments/gpu_check.py dot_recipes --out $OUT/gpu_check.json > $OUT/gpu_check.log 2>&1
echo "gpu_check rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/timeline.txt
wait
$PY - <<'PYEOF' > $OUT/golden_cuda.json
import json
try:
    a = json.load(open("/tmp/w/golden_old.json")); b = json.load(open("/tmp/w/golden_new.json"))
    res = {k: {"same": a["cases"][k] == b["cases"].get(k), "old": a["cases"][k]["loss"], "new": b["cases"].get(k, {}).get("loss")} for k in a["cases"]}; res["jax"] = a["jax"]
except Exception as e:
    res = {"error": repr(e)}
print(json.dumps(res, indent=1))
PYEOF
cat $OUT/timeline.txt $OUT/golden_cuda.json; tail -3 $OUT/native.log $OUT/gpu_check.log; tail -c 1500 $OUT/golden_new.err
tar czf $FINAL/call.tgz -C /tmp w
cp $OUT/golden_cuda.json $OUT/native_rounding.json $OUT/gpu_check.json $OUT/timeline.txt $FINAL/ 2>/dev/null
