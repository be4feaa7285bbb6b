"""GPU checks + timings of the W4A16 packed-NVFP4 GEMM kernel (imported by gpu_check_kernels)."""

from __future__ import annotations

import functools
import traceback

import jax
import jax.numpy as jnp

import fp4jax
from experiments.kernel_timing import time_fn
from pallas_kernels import fp4_matmul_sm90 as mm


def _rel(a, b):
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def check_matmul(record, shapes=((1, 8192, 8192), (16, 8192, 8192), (64, 8192, 8192),
                                 (16, 4096, 14336), (3, 1024, 320), (200, 2048, 512)),
                 time_shapes=((1, 8192, 8192), (16, 8192, 8192), (64, 8192, 8192))):
    for (m, k, n) in shapes:
        name = f"w4a16 M={m} K={k} N={n}"
        try:
            kx, kw = jax.random.split(jax.random.key(m * 7 + k + n))
            x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
            w = jax.random.normal(kw, (k, n), jnp.float32) * 0.02
            q = jax.jit(lambda w: fp4jax.quantize(w, fp4jax.NVFP4, axis=0))(w)
            wq, ws, dec = jax.jit(mm.prepare_weight)(q)
            if n % 64 or k % 256:
                record(name, ok=True, skipped="unsupported shape: XLA path")
                continue
            y = jax.jit(mm.w4a16_matmul, static_argnames=("out_dtype",))(
                x, wq, ws, dec, out_dtype=jnp.float32)
            ref_layout = jax.jit(mm.reference_w4a16)(x, wq, ws, dec)
            wdq = fp4jax.dequantize(q, jnp.float32)
            ref_fp4jax = jnp.dot(x.astype(jnp.float32), wdq, precision=jax.lax.Precision.HIGHEST)
            r1, r2 = _rel(y, ref_layout), _rel(y, ref_fp4jax)
            rec = dict(rel_err_vs_layout_ref=r1, rel_err_vs_fp4jax_dequant_dot=r2,
                       finite=bool(jnp.isfinite(y).all()), ok=r1 < 1e-5 and r2 < 1e-5)
            if (m, k, n) in time_shapes:
                wb = wdq.astype(jnp.bfloat16)
                t_bf16 = time_fn(jax.jit(jnp.dot), x, wb)
                t_k = time_fn(jax.jit(mm.w4a16_matmul), x, wq, ws, dec)
                t_xla = time_fn(jax.jit(lambda x, q: jnp.dot(
                    x, fp4jax.dequantize(q, jnp.bfloat16))), x, q)
                rec.update(bf16_us=t_bf16["median_us"], kernel_us=t_k["median_us"],
                           xla_dequant_dot_us=t_xla["median_us"],
                           speedup_vs_bf16=t_bf16["median_us"] / t_k["median_us"],
                           method=t_k["method"])
            record(name, **rec)
        except Exception as e:  # noqa: BLE001
            record(name, error=f"{type(e).__name__}: {str(e)[:1500]}",
                   tb=traceback.format_exc()[-3000:])


def sweep_w4a16(record, m=16, k=8192, n=8192):
    """Exactness + time of W4A16 kernel variants at the decode shape."""
    kx, kw = jax.random.split(jax.random.key(123))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.float32) * 0.02
    q = jax.jit(lambda w: fp4jax.quantize(w, fp4jax.NVFP4, axis=0))(w)
    wq, ws, dec = jax.jit(mm.prepare_weight)(q)
    ref = jax.jit(mm.reference_w4a16)(x, wq, ws, dec)
    wb = fp4jax.dequantize(q, jnp.bfloat16)
    t_bf16 = time_fn(jax.jit(jnp.dot), x, wb)["median_us"]
    for tile_k in (256, 512):
        for split_k, stages in ((4, 2), (8, 2), (8, 3), (16, 2)):
            for safe in (True, False):
                name = f"sweep w4a16 M={m} tile_k={tile_k} split={split_k} st={stages} safe={safe}"
                try:
                    f = jax.jit(functools.partial(
                        mm.w4a16_matmul, tile_k=tile_k, split_k=split_k, stages=stages,
                        safe_subnormal=safe, out_dtype=jnp.float32))
                    y = f(x, wq, ws, dec)
                    r = _rel(y, ref)
                    t = time_fn(f, x, wq, ws, dec)["median_us"]
                    record(name, ok=r < 1e-5, rel_err=r, kernel_us=t, bf16_us=t_bf16,
                           speedup_vs_bf16=t_bf16 / t)
                except Exception as e:  # noqa: BLE001
                    record(name, error=f"{type(e).__name__}: {str(e)[:500]}")
