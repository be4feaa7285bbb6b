"""GPU exactness of the fused GEMM-operand kernels and of fp4jax.dot's kernel path (issue 5).

* every kernel (rows RtN/SR, cols RtN/SR with and without RHT, 16x16) against the XLA path
  (``scaled_data(quantize(...))`` in bf16) on fresh random inputs of several shapes, one
  with NaN/Inf/-0 and a wide dynamic range: mismatching elements (NaN == NaN);
* ``fp4jax.dot`` nvfp4 forward + backward (value_and_grad, random cotangent) with the
  kernels on vs off at several shapes: y, loss, dx, dw compared bit for bit.

    PYTHONPATH=$PWD python3 experiments/gpu_check_fakequant.py  # -> $OUT/gpu_check_fakequant.json
"""

from __future__ import annotations

import importlib
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
from fp4jax.formats import NVFP4  # noqa: E402
from fp4jax.hadamard import default_signs, random_hadamard_transform  # noqa: E402
from pallas_kernels import fakequant_nvfp4_sm90 as fq  # noqa: E402

qz = importlib.import_module("fp4jax.quantize")
dot_mod = importlib.import_module("fp4jax.dot")
RES = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
       "started": time.strftime("%Y-%m-%d %H:%M:%S"), "kernels": [], "dot": []}


def dump():
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_check_fakequant.json"), "w") as f:
        json.dump(RES, f, indent=1)


def mismatches(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    ok = (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))
    return int((~ok).sum())


def data(shape, seed, wild):
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    if wild:
        rng = np.random.default_rng(seed)
        x = x * jnp.exp(jnp.asarray(rng.uniform(-8, 8, (shape[0], 1)), jnp.float32))
        x = x.at[0, :32].set(-0.0).at[3, 7].set(jnp.nan).at[9, 100].set(jnp.inf)
        x = x.at[17, 5].set(-jnp.inf)
    return x.astype(jnp.bfloat16)


KERNEL_SHAPES = (((1024, 4096), True), ((16384, 4096), True), ((8192, 8192), False),
                 ((48, 2048), True), ((4096, 14336), False))


def check_kernels(shapes=KERNEL_SHAPES):
    signs = jnp.asarray(default_signs(16))
    key = jax.random.key(2024)
    for shape, wild in shapes:
        x = data(shape, sum(shape), wild)
        row = {"shape": list(shape), "wild": wild, "kernel": "cols_amaxes"}
        try:  # the one-read pair of tensor amaxes (plain, rotated) vs XLA
            plain, rot = jax.jit(fq.cols_amaxes)(x, signs)
            xa = jnp.abs(x.astype(jnp.float32))
            r = jnp.abs(random_hadamard_transform(x, axis=0, size=16, signs=signs))
            fin = lambda a: jnp.max(jnp.where(jnp.isfinite(a), a, 0.0))  # noqa: E731
            row.update(plain_equal=bool(float(plain) == float(fin(xa))),
                       rot_equal=bool(float(rot) == float(fin(r))))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        RES["kernels"].append(row)
        print(json.dumps(row), flush=True)
        for name, fk, axis, sr, b2, rht in (
                ("rows RtN", lambda x: fq.fq_rows(x), -1, False, False, False),
                ("rows SR", lambda x: fq.fq_rows(x, key), -1, True, False, False),
                ("2d RtN", lambda x: fq.fq_2d(x), -1, False, True, False),
                ("cols RtN", lambda x: fq.fq_cols(x), 0, False, False, False),
                ("cols RHT RtN", lambda x: fq.fq_cols(x, signs=signs), 0, False, False, True),
                ("cols SR", lambda x: fq.fq_cols(x, key), 0, True, False, False),
                ("cols RHT SR", lambda x: fq.fq_cols(x, key, signs=signs), 0, True, False, True)):
            row = {"shape": list(shape), "wild": wild, "kernel": name}
            try:
                got, dec = jax.jit(fk)(x)
                xin = random_hadamard_transform(x, axis=0, size=16, signs=signs) if rht else x
                q = qz._quantize_impl(xin, key if sr else None, NVFP4, axis, b2,
                                      "stochastic" if sr else "nearest")
                row.update(mismatch=mismatches(got, qz.scaled_data(q, jnp.bfloat16)),
                           dec_equal=bool(float(dec) == float(q.global_scale)), n=int(x.size))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                traceback.print_exc()
            RES["kernels"].append(row)
            print(json.dumps(row), flush=True)
            dump()


def fwd_bwd(x, w, ct, setting):
    os.environ["FP4JAX_KERNELS"] = setting
    dot_mod._make_dot3.cache_clear()
    jax.clear_caches()
    key = jax.random.key(7)

    def loss(x, w):
        y = fp4jax.dot(x, w, key=key)
        return (y.astype(jnp.float32) * ct).sum(), y

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    n_mosaic = f.lower(x, w).as_text().count("mosaic_gpu")
    (v, y), (dx, dw) = f(x, w)
    return (y, v, dx, dw), n_mosaic


DOT_SHAPES = ((8192, 8192, 8192), (4096, 4096, 4096), (16384, 4096, 14336),
              (1000, 4096, 4096), (2048, 1024, 3072))


def check_dot(shapes=DOT_SHAPES):
    for (m, k, n) in shapes:
        kx, kw, kc = jax.random.split(jax.random.key(m + n), 3)
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        w = (0.02 * jax.random.normal(kw, (k, n), jnp.float32)).astype(jnp.bfloat16)
        ct = jax.random.normal(kc, (m, n), jnp.float32).astype(jnp.bfloat16)
        row = {"shape": [m, k, n]}
        try:
            off, _ = fwd_bwd(x, w, ct, "off")
            on, calls = fwd_bwd(x, w, ct, "on")
            row["mosaic_gpu_mentions_on"] = calls
            for name, a, b in zip(("y", "loss", "dx", "dw"), off, on, strict=True):
                row[name + "_mismatch"] = mismatches(a, b)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
        RES["dot"].append(row)
        print(json.dumps(row), flush=True)
        dump()


if __name__ == "__main__":
    which = sys.argv[1:] or ["kernels", "dot"]
    if "kernels" in which:
        check_kernels()
    if "dot" in which:
        check_dot()
    if "kernels64" in which:  # widths whose SR rows tiles are 64 blocks (C % 2048 != 0)
        check_kernels((((2048, 1024), True), ((4096, 3072), False)))
    if "kernels5" in which:  # one call's worth: wild small/odd widths, 64-block SR tiles
        check_kernels((((1024, 4096), True), ((48, 2048), True), ((2048, 1024), True),
                       ((4096, 3072), False), ((4096, 14336), False)))
    if "dot3" in which:  # 1000 tokens: the 16x1 kernels fall back to XLA
        check_dot(DOT_SHAPES[:1] + DOT_SHAPES[3:])
    RES["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    dump()
