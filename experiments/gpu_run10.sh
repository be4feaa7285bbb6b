#!/usr/bin/env bash
# One nvidia-h200 call: A/B of the GPU compile time of the small NVFP4 training step, the
# NaN-safe block_amax (B) against the previous plain max patched back in (A), compiled at the
# same time on the same machine (equal contention). A also patches element_encode_scale to
# per-element div_rn, which at the commit this ran (9c51a6f) was what B used too: the table
# reciprocal (numerics.recip_scaled_rn) was wired into the quantizer only later.   OUT=<dir> bash experiments/gpu_run10.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
ARGS='["--preset","small","--seq-len","256","--batch-size","64","--lr","2e-3","--warmup-steps","50","--steps","600","--recipe","nvfp4","--devices","1","--json","'$OUT'/ab.jsonl"]'
( timeout 220 python3 -c "
import json, jax.numpy as jnp
import sys, fp4jax
q, n = sys.modules['fp4jax.quantize'], sys.modules['fp4jax.numerics']
q.element_encode_scale = lambda s, dec: jnp.where(
    s == 0, jnp.float32(0), jnp.minimum(n.div_rn(jnp.float32(1), s * dec), jnp.float32(n.FLT_MAX)))
q.block_amax = lambda b, axis: jnp.max(jnp.abs(b), axis=axis)
from experiments.compile_probe import main
main(json.loads('$ARGS') + ['--schedule', 'wsd'])" >"$OUT/a.log" 2>&1; echo "A exit $?" >>"$OUT/a.log" ) &
( timeout 220 python3 -c "
import json
from experiments.compile_probe import main
main(json.loads('$ARGS'))" >"$OUT/b.log" 2>&1; echo "B exit $?" >>"$OUT/b.log" ) &
wait
