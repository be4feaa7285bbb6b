"""The Pallas bf16 GEMM with the alpha epilogue (``pallas_kernels/gemm_alpha_sm90.py``) on
the GPU (issue 5): exactness against XLA and speed, then ``fp4jax.dot``'s fwd+bwd with the
kernel path's GEMMs on it vs on XLA (``FP4JAX_KERNEL_GEMM``).

* exactness: ``gemm_alpha`` vs ``reference`` (XLA f32 HIGHEST dot, times alpha, one
  rounding to bf16) for the three layouts (fprop NN, dgrad NT, wgrad TN) at several
  shapes: bf16 outputs differing, max difference in bf16 ulps, max relative error;
* speed (CUPTI medians, same run): per layout at 8192^3, ``gemm_alpha`` at a few tile
  configs vs XLA's bf16 ``dot`` (cuBLAS, no scale) and vs XLA's f32 dot times a runtime
  alpha then bf16 (what the kernel path ran before);
* ``fp4jax.dot`` nvfp4 fwd+bwd 8192^3: kernels with the Pallas GEMM vs with XLA GEMMs vs
  bf16, and the outputs' agreement.

    PYTHONPATH=$PWD python3 experiments/gpu_check_gemm.py [check] [speed] [dot]
    # -> $OUT/gpu_check_gemm.json
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

from experiments.kernel_timing import time_fn  # noqa: E402
from pallas_kernels import gemm_alpha_sm90 as ga  # noqa: E402

RES = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
       "started": time.strftime("%Y-%m-%d %H:%M:%S"),
       "command": "PYTHONPATH=$PWD python3 experiments/gpu_check_gemm.py "
       + " ".join(sys.argv[1:]), "check": [], "speed": [], "dot": []}
LAYOUTS = {"fprop NN": (False, False), "dgrad NT": (False, True), "wgrad TN": (True, False)}
CONFIGS = {"128x128x64 s4": ga.GemmConfig(tile_k=64, stages=4),
           "128x128x64 s4 snake16": ga.GemmConfig(tile_k=64, stages=4, snake=16),
           "128x128x128 s2": ga.GemmConfig(tile_k=128, stages=2)}


def dump():
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_check_gemm.json"), "w") as f:
        json.dump(RES, f, indent=1)


def operands(m, k, n, ta, tb, seed=0):
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(ka, (k, m) if ta else (m, k), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (n, k) if tb else (k, n), jnp.float32).astype(jnp.bfloat16)
    return a, b, jnp.float32(3.7e-3)


def check(shapes=((8192, 8192, 8192), (1024, 512, 768), (2048, 1024, 3072),
                  (16384, 512, 256))):
    for (m, k, n) in shapes:
        for name, (ta, tb) in LAYOUTS.items():
            row = {"shape": [m, k, n], "layout": name}
            try:
                a, b, al = operands(m, k, n, ta, tb, seed=m + n)
                got = ga.gemm_alpha(a, b, al, trans_a=ta, trans_b=tb)
                want = ga.reference(a, b, al, trans_a=ta, trans_b=tb)
                g = np.asarray(got, np.float32)
                w = np.asarray(want, np.float32)
                gi = np.asarray(got).view(np.int16).astype(np.int64)
                wi = np.asarray(want).view(np.int16).astype(np.int64)
                acc = np.asarray(jnp.dot(a.T if ta else a, b.T if tb else b,
                                         preferred_element_type=jnp.float32,
                                         precision=jax.lax.Precision.HIGHEST)) * 3.7e-3
                row.update(n=int(g.size), differ=int((g != w).sum()),
                           max_ulp=int(np.abs(gi - wi).max()),
                           max_rel_err_vs_f32=float(np.max(np.abs(g - acc) / (np.abs(acc) + 1e-3))))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
                traceback.print_exc()
            RES["check"].append(row)
            print(json.dumps(row), flush=True)
            dump()


def speed(m=8192, k=8192, n=8192):
    flops = 2 * m * k * n
    for name, (ta, tb) in LAYOUTS.items():
        a, b, al = operands(m, k, n, ta, tb)

        def xla_plain(a, b, ta=ta, tb=tb):
            return jnp.dot(a.T if ta else a, b.T if tb else b)

        def xla_alpha(a, b, al, ta=ta, tb=tb):
            acc = jnp.dot(a.T if ta else a, b.T if tb else b, preferred_element_type=jnp.float32)
            return (acc * al).astype(jnp.bfloat16)

        runs = [("XLA bf16 dot (no scale)", jax.jit(xla_plain), (a, b)),
                ("XLA f32 dot * alpha -> bf16", jax.jit(xla_alpha), (a, b, al))]
        for cname, cfg in CONFIGS.items():
            runs.append((f"gemm_alpha {cname}", jax.jit(
                lambda a, b, al, cfg=cfg, ta=ta, tb=tb: ga.gemm_alpha(
                    a, b, al, trans_a=ta, trans_b=tb, config=cfg)), (a, b, al)))
        base = None
        for rname, f, args in runs:
            row = {"layout": name, "shape": [m, k, n], "name": rname}
            try:
                t = time_fn(f, *args, iterations=20)
                row.update(us=round(t["median_us"], 1), method=t["method"],
                           tflops=round(flops / t["median_us"] / 1e6, 1))
                base = base or t["median_us"]
                row["ratio_to_xla_bf16"] = round(t["median_us"] / base, 4)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
                traceback.print_exc()
            RES["speed"].append(row)
            print(json.dumps(row), flush=True)
            dump()


def dot(m=8192, k=8192, n=8192):
    import fp4jax

    dot_mod = sys.modules["fp4jax.dot"]
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (0.02 * jax.random.normal(kw, (k, n), jnp.float32)).astype(jnp.bfloat16)
    ct = jax.random.normal(kc, (m, n), jnp.float32).astype(jnp.bfloat16)
    key = jax.random.key(7)

    def loss_bf(x, w):
        return (jnp.dot(x, w).astype(jnp.float32) * ct).sum()

    def loss_fp(x, w):
        y = fp4jax.dot(x, w, key=key)
        return (y.astype(jnp.float32) * ct).sum(), y

    fb = jax.jit(jax.value_and_grad(loss_bf, argnums=(0, 1)))
    t = time_fn(fb, x, w, iterations=10)
    RES["dot"].append({"name": "bf16 fwd+bwd", "us": round(t["median_us"], 1)})
    bf_us = t["median_us"]
    print(json.dumps(RES["dot"][-1]), flush=True)
    outs = {}
    for gemm in ("pallas", "xla"):
        os.environ["FP4JAX_KERNELS"] = "on"
        os.environ["FP4JAX_KERNEL_GEMM"] = gemm
        dot_mod._make_dot3.cache_clear()
        jax.clear_caches()
        f = jax.jit(jax.value_and_grad(loss_fp, argnums=(0, 1), has_aux=True))
        row = {"name": f"nvfp4 fwd+bwd kernels, FP4JAX_KERNEL_GEMM={gemm}"}
        try:
            row["mosaic_gpu_mentions"] = f.lower(x, w).as_text().count("mosaic_gpu")
            (v, y), (dx, dw) = f(x, w)
            outs[gemm] = [np.asarray(o, np.float32) for o in (y, dx, dw)]
            t = time_fn(f, x, w, iterations=10)
            row.update(us=round(t["median_us"], 1), ratio_to_bf16=round(t["median_us"] / bf_us, 4))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            traceback.print_exc()
        RES["dot"].append(row)
        print(json.dumps(row), flush=True)
        dump()
    if len(outs) == 2:
        row = {"name": "pallas vs xla GEMMs: outputs"}
        for nm, p, q in zip(("y", "dx", "dw"), outs["pallas"], outs["xla"], strict=True):
            row[nm + "_differ"] = int((p != q).sum())
            row[nm + "_max_rel"] = float(np.max(np.abs(p - q) / (np.abs(q) + 1e-6)))
        RES["dot"].append(row)
        print(json.dumps(row), flush=True)


SWEEP = ((16384, 512, 256), (16384, 512, 2048), (16384, 2048, 512), (8192, 2048, 2048),
         (4096, 4096, 4096))  # the `small` preset's GEMMs (d_model 512, d_ff 2048), mid sizes


def sweep(shapes=SWEEP):
    """gemm_alpha (default tiles) vs XLA's f32 dot times a runtime alpha (the kernel path's
    alternative) per layout, at the `small` training preset's GEMM shapes (16384 tokens,
    d_model 512, d_ff 2048, kv 256) and two mid sizes: where does the Pallas GEMM win?"""
    for (m, k, n) in shapes:
        for name, (ta, tb) in LAYOUTS.items():
            a, b, al = operands(m, k, n, ta, tb)

            def xla_alpha(a, b, al, ta=ta, tb=tb):
                acc = jnp.dot(a.T if ta else a, b.T if tb else b,
                              preferred_element_type=jnp.float32)
                return (acc * al).astype(jnp.bfloat16)

            row = {"layout": name, "shape": [m, k, n]}
            try:
                tx = time_fn(jax.jit(xla_alpha), a, b, al, iterations=20)["median_us"]
                tg = time_fn(jax.jit(lambda a, b, al, ta=ta, tb=tb: ga.gemm_alpha(
                    a, b, al, trans_a=ta, trans_b=tb)), a, b, al, iterations=20)["median_us"]
                row.update(xla_alpha_us=round(tx, 1), gemm_alpha_us=round(tg, 1),
                           ratio=round(tg / tx, 4))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            RES.setdefault("sweep", []).append(row)
            print(json.dumps(row), flush=True)
            dump()


if __name__ == "__main__":
    which = sys.argv[1:] or ["check", "speed", "dot"]
    for w in ("check", "speed", "dot", "sweep"):
        if w in which:
            globals()[w]()
    RES["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    dump()
