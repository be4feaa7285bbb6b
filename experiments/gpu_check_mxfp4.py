"""MXFP4 W4A4 on the GPU (issue 5): exactness and timing of the two-pass kernel path
(``pallas_kernels/fp4_gemm_w4a4_sm90.py`` with ``scale_fmt="ue8m0"``).

* decode kernel bits == ``fp4jax.dequantize`` (bf16) of random MXFP4 operands (and of
  mixed-range data), per operand;
* ``dispatch.w4a4_matmul`` (two-pass) vs ``dequantize(A) @ dequantize(B)`` in float32
  (HIGHEST): max relative error (float32 accumulation order only);
* CUPTI medians at 8192^3: bf16 ``jnp.dot``, XLA dequantize + dot (f32 HIGHEST, the
  dispatch's XLA path), XLA decode + bf16 dot, the two-pass kernel path.

    PYTHONPATH=$PWD python3 experiments/gpu_check_mxfp4.py   # -> $OUT/gpu_check_mxfp4.json
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fp4jax  # noqa: E402
from experiments.kernel_timing import time_fn  # noqa: E402
from pallas_kernels import dispatch  # noqa: E402
from pallas_kernels import fp4_gemm_w4a4_sm90 as w4  # noqa: E402

RES = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
       "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": []}


def dump():
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_check_mxfp4.json"), "w") as f:
        json.dump(RES, f, indent=1)


def row(**kw):
    RES["rows"].append(kw)
    print(json.dumps(kw), flush=True)
    dump()


def operands(m, k, n, seed, wide):
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(ka, (m, k), jnp.float32)
    b = jax.random.normal(kb, (k, n), jnp.float32) * 0.02
    if wide:  # per-block magnitudes over many binades
        rng = np.random.default_rng(seed)
        a = a * jnp.asarray(np.exp2(rng.uniform(-40, 40, (m, k // 32, 1))).repeat(32, -1)
                            .reshape(m, k), jnp.float32)
    return (fp4jax.quantize(a.astype(jnp.bfloat16), fp4jax.MXFP4, axis=1),
            fp4jax.quantize(b.astype(jnp.bfloat16), fp4jax.MXFP4, axis=0))


def check(m, k, n, seed, wide):
    qa, qb = operands(m, k, n, seed, wide)
    (aq, as_, _), (bq, bs, _) = w4.prepare_a(qa), w4.prepare_b(qb)
    mism = 0
    for cq, cs, q, ax in ((aq, as_, qa, 1), (bq, bs, qb, 0)):
        got = w4.decode_operand(cq, cs, scale_fmt="ue8m0")
        want = fp4jax.dequantize(q, jnp.float32)
        want = (want if ax == 1 else want.T).astype(jnp.bfloat16)
        g = np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint16))
        w = np.asarray(jax.lax.bitcast_convert_type(want, jnp.uint16))
        mism += int((g != w).sum())
    y = dispatch.w4a4_matmul(qa, qb, out_dtype=jnp.float32, backend="pallas")
    ref = jnp.dot(fp4jax.dequantize(qa, jnp.float32), fp4jax.dequantize(qb, jnp.float32),
                  precision=jax.lax.Precision.HIGHEST)
    rel = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
    row(kind="check", shape=[m, k, n], wide=wide, decode_mismatch=mism, rel_err=rel)


def bench(m, k, n):
    qa, qb = operands(m, k, n, 1, False)
    pa, pb = w4.prepare_a(qa), w4.prepare_b(qb)
    x = jax.random.normal(jax.random.key(3), (m, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(4), (k, n), jnp.bfloat16)
    kw = dict(scale_a="ue8m0", scale_b="ue8m0")
    cases = [
        ("bf16 jnp.dot", jnp.dot, (x, w)),
        ("XLA dequantize + f32 dot (HIGHEST)", lambda a, b: jnp.dot(
            fp4jax.dequantize(a, jnp.float32), fp4jax.dequantize(b, jnp.float32),
            precision=jax.lax.Precision.HIGHEST).astype(jnp.bfloat16), (qa, qb)),
        ("XLA decode + bf16 dot", lambda *a: w4.w4a4_matmul_xla(*a, **kw), (*pa, *pb)),
        ("two-pass kernel (decode kernel x2 + bf16 dot)",
         lambda *a: w4.w4a4_matmul_two_pass(*a, **kw), (*pa, *pb)),
    ]
    t_bf = None
    for name, f, args in cases:
        try:
            t = time_fn(jax.jit(f), *args, iterations=20)["median_us"]
            t_bf = t_bf or t
            row(kind="bench", shape=[m, k, n], name=name, us=t,
                tflops=2 * m * k * n / t / 1e6, ratio_to_bf16_tflops=t_bf / t)
        except Exception as e:  # noqa: BLE001
            row(kind="bench", shape=[m, k, n], name=name, error=f"{type(e).__name__}: {e}"[:400])
            traceback.print_exc()


if __name__ == "__main__":
    for args in ((1024, 4096, 2048, 0, True), (8192, 8192, 8192, 1, False),
                 (4096, 14336, 4096, 2, True)):
        try:
            check(*args)
        except Exception as e:  # noqa: BLE001
            row(kind="check", shape=list(args[:3]), error=f"{type(e).__name__}: {e}"[:400])
            traceback.print_exc()
    bench(8192, 8192, 8192)
    RES["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    dump()
