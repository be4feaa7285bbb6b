"""GPU exactness and speed of the W4A16 decode kernel ``pallas_kernels/w4a16_sm90.py``.

* exactness: the kernel (f32 out) against ``x @ dequantize(W)`` in f32 (HIGHEST) on fresh
  inputs of several shapes, 1x16 and 16x16 weights, weights spanning 6 decades (E4M3
  subnormal block scales), a NaN row in x; relative error (f32 accumulation order only:
  < 1e-5) and max abs difference;
* speed (CUPTI device time of every kernel of the call, medians, same run): bf16
  ``jnp.dot`` on the dequantized weight, the earlier W4A16 kernel (``fp4_matmul_sm90``),
  the new kernel with its defaults and a sweep of split_k / tile_k / stages at M = 16.

    PYTHONPATH=$PWD python3 experiments/gpu_check_w4a16v2.py [check] [speed] [sweep]
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp4jax  # noqa: E402
from experiments.kernel_timing import time_fn  # noqa: E402
from pallas_kernels import fp4_matmul_sm90 as mm  # noqa: E402
from pallas_kernels import w4a16_sm90 as wk  # noqa: E402

RES = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
       "started": time.strftime("%Y-%m-%d %H:%M:%S"),
       "command": "PYTHONPATH=$PWD python3 experiments/gpu_check_w4a16v2.py "
                  + " ".join(sys.argv[1:]),
       "check": [], "speed": []}


def dump():
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_check_w4a16v2.json"), "w") as f:
        json.dump(RES, f, indent=1)


def rec(kind, **row):
    RES[kind].append(row)
    print(json.dumps(row), flush=True)
    dump()


def make(m, k, n, block_2d, seed, wide=True):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.float32) * 0.02
    if wide:
        w = w * jnp.logspace(-6, 0, n, dtype=jnp.float32)[None, :]
    q = jax.jit(lambda w: fp4jax.quantize(w, fp4jax.NVFP4, block_2d=block_2d, axis=0))(w)
    return x, q


def check():
    shapes = [(16, 8192, 8192, False), (16, 8192, 8192, True), (1, 8192, 8192, False),
              (64, 8192, 8192, True), (16, 4096, 14336, False), (16, 14336, 4096, True),
              (3, 1024, 320, False), (200, 2048, 512, False), (33, 512, 128, True)]
    for i, (m, k, n, b2) in enumerate(shapes):
        row = {"m": m, "k": k, "n": n, "block_2d": b2}
        try:
            x, q = make(m, k, n, b2, 100 + i)
            if m >= 3:
                x = x.at[1].set(jnp.nan)
            wp, ws, dec = jax.jit(wk.prepare_weight)(q)
            y = wk.w4a16_matmul(x, wp, ws, dec, out_dtype=jnp.float32)
            ref = jnp.dot(x.astype(jnp.float32), fp4jax.dequantize(q, jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
            ok_rows = jnp.ones((m,), bool)
            if m >= 3:
                row["nan_row_all_nan"] = bool(jnp.all(jnp.isnan(y[1])))
                ok_rows = ok_rows.at[1].set(False)
            yv, rv = y[ok_rows], ref[ok_rows]
            row["finite"] = bool(jnp.all(jnp.isfinite(yv)))
            row["rel_err"] = float(jnp.linalg.norm(yv - rv) / jnp.linalg.norm(rv))
            row["max_abs_diff"] = float(jnp.max(jnp.abs(yv - rv)))
            row["max_abs_ref"] = float(jnp.max(jnp.abs(rv)))
            ybf = wk.w4a16_matmul(x, wp, ws, dec)
            row["bf16_out_equals_f32_out_rounded"] = bool(
                jnp.array_equal(ybf[ok_rows], yv.astype(jnp.bfloat16)))
            row["ok"] = (row["rel_err"] < 1e-5 and row["finite"]
                         and row.get("nan_row_all_nan", True))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            row["tb"] = traceback.format_exc()[-2500:]
        rec("check", **row)


def timed(name, f, *args, **extra):
    try:
        t = time_fn(jax.jit(f), *args, iterations=100, warmup=3)
        rec("speed", name=name, us=t["median_us"], min_us=t["min_us"], method=t["method"],
            **extra)
        return t["median_us"]
    except Exception as e:  # noqa: BLE001
        rec("speed", name=name, error=f"{type(e).__name__}: {str(e)[:800]}", **extra)
        return None


def speed(sweep=False):
    for m, k, n in ((16, 8192, 8192), (1, 8192, 8192), (32, 8192, 8192), (64, 8192, 8192),
                    (128, 8192, 8192), (16, 4096, 14336), (16, 14336, 4096)):
        g = {"m": m, "k": k, "n": n}
        x, q = make(m, k, n, True, 7, wide=False)
        wb = fp4jax.dequantize(q, jnp.bfloat16)
        wp, ws, dec = jax.jit(wk.prepare_weight)(q)
        t_bf = timed("bf16 jnp.dot", jnp.dot, x, wb, **g)
        t_old = None
        if k % 256 == 0:
            owq, ows, odec = jax.jit(mm.prepare_weight)(q)
            t_old = timed("w4a16 fp4_matmul_sm90 (previous)", mm.w4a16_matmul,
                          x, owq, ows, odec, **g)
        t_new = timed("w4a16 w4a16_sm90 default", wk.w4a16_matmul, x, wp, ws, dec,
                      config=str(wk.default_config(m, k, n)), **g)
        wbytes = k * n * (0.5 + 2 / 16)
        rec("speed", name="summary", bf16_us=t_bf, previous_us=t_old, new_us=t_new,
            speedup_vs_bf16=(t_bf / t_new) if t_bf and t_new else None,
            weight_gbps=(wbytes / t_new / 1e3) if t_new else None, **g)
        if sweep and m == 16 and k == n == 8192:
            best = (t_new, "default")
            timed("default, nodecode (timing only)",
                  functools.partial(wk.w4a16_matmul, _mode="nodecode"), x, wp, ws, dec, **g)
            for tile_k in (256, 512):
                for split in (1, 2, 4):
                    for stages in (2, 3):
                        f = functools.partial(wk.w4a16_matmul, tile_k=tile_k, split_k=split,
                                              stages=stages, compute_wgs=2)
                        t = timed(f"sweep tile_k={tile_k} split_k={split} stages={stages}",
                                  f, x, wp, ws, dec, **g)
                        if t and (best[0] is None or t < best[0]):
                            best = (t, f"tile_k={tile_k} split_k={split} stages={stages}")
            rec("speed", name="sweep best", us=best[0], cfg=best[1], bf16_us=t_bf,
                speedup_vs_bf16=(t_bf / best[0]) if t_bf and best[0] else None, **g)


def breakdown(name, f, *args, iterations=50, **extra):
    """Per-kernel CUPTI medians of one call (which launches what, and how long)."""
    import statistics

    from jax.experimental.mosaic.gpu import profiler

    try:
        jf = jax.jit(f)
        jax.block_until_ready(jf(*args))
        _, t = profiler.measure(jf, aggregate=False, iterations=iterations)(*args)
        per = {}
        for it in t:
            for kname, ms in it:
                per.setdefault(kname, []).append(ms * 1e3)
        rec("speed", name=name, kernels={k: statistics.median(v) for k, v in per.items()},
            **extra)
    except Exception as e:  # noqa: BLE001
        rec("speed", name=name, error=f"{type(e).__name__}: {str(e)[:800]}", **extra)


def _m16():
    """The M=16, K=N=8192 case of the sweeps: labels, x, prepared W, bf16 W."""
    m, k, n = 16, 8192, 8192
    x, q = make(m, k, n, True, 7, wide=False)
    return ({"m": m, "k": k, "n": n}, x, jax.jit(wk.prepare_weight)(q),
            fp4jax.dequantize(q, jnp.bfloat16))


def diag():
    """Where the time goes at M=16, K=N=8192: per-kernel split, decode / scale removed
    (wrong results, timing only), x read through a transposed view, and its sweep."""
    g, x, (wp, ws, dec), wb = _m16()
    breakdown("breakdown bf16 jnp.dot", jnp.dot, x, wb, **g)
    breakdown("breakdown default", wk.w4a16_matmul, x, wp, ws, dec, **g)
    breakdown("breakdown x_direct", functools.partial(wk.w4a16_matmul, x_direct=True),
              x, wp, ws, dec, **g)
    for cfg in (dict(), dict(tile_k=512, split_k=2, stages=3)):
        for mode in ("full", "noscale", "nodecode"):
            for xd in (False, True):
                f = functools.partial(wk.w4a16_matmul, _mode=mode, x_direct=xd, **cfg)
                timed(f"diag mode={mode} x_direct={xd} {cfg}", f, x, wp, ws, dec, **g)
    for tile_k in (256, 512):
        for split in (1, 2, 4, 8):
            for stages in (2, 3, 4):
                f = functools.partial(wk.w4a16_matmul, tile_k=tile_k, split_k=split,
                                      stages=stages, x_direct=True)
                timed(f"sweep x_direct tile_k={tile_k} split_k={split} stages={stages}",
                      f, x, wp, ws, dec, **g)
    for m2, k2, n2, b2 in ((16, 8192, 8192, False), (3, 1024, 320, True), (64, 2048, 512, False)):
        x2, q2 = make(m2, k2, n2, b2, 300 + m2)
        p2 = jax.jit(wk.prepare_weight)(q2)
        y = wk.w4a16_matmul(x2, *p2, out_dtype=jnp.float32, x_direct=True)
        ref = jnp.dot(x2.astype(jnp.float32), fp4jax.dequantize(q2, jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
        rel = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
        rec("check", m=m2, k=k2, n=n2, block_2d=b2, x_direct=True, rel_err=rel, ok=rel < 1e-5)


def ws(checks=True, wgs=(1, 2), splits=(1, 2, 4, 8)):
    """Warp-specialized variants (compute_wgs >= 1): exactness on 3 shapes, then a sweep.

    compute_wgs=4 hung on the H200 (run 33: no result within 400 s), so it is not swept.
    """
    for cw in wgs if checks else ():
        for m2, k2, n2, b2 in ((16, 8192, 8192, False), (3, 1024, 512, True),
                               (64, 2048, 1024, False)):
            row = {"m": m2, "k": k2, "n": n2, "block_2d": b2, "compute_wgs": cw,
                   "x_direct": True}
            try:
                x2, q2 = make(m2, k2, n2, b2, 400 + m2 + cw)
                p2 = jax.jit(wk.prepare_weight)(q2)
                y = wk.w4a16_matmul(x2, *p2, out_dtype=jnp.float32, x_direct=True,
                                    compute_wgs=cw)
                ref = jnp.dot(x2.astype(jnp.float32), fp4jax.dequantize(q2, jnp.float32),
                              precision=jax.lax.Precision.HIGHEST)
                row["rel_err"] = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
                row["ok"] = row["rel_err"] < 1e-5
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            rec("check", **row)
    g, x, (wp, ws_, dec), wb = _m16()
    t_bf = timed("bf16 jnp.dot", jnp.dot, x, wb, **g)
    best = (None, None)
    for cw in wgs:
        for tile_k in (256, 512):
            for split in splits:
                for stages in (2, 3, 4):
                    cfg = dict(tile_k=tile_k, split_k=split, stages=stages, compute_wgs=cw,
                               x_direct=True)
                    t = timed(f"ws {cfg}", functools.partial(wk.w4a16_matmul, **cfg),
                              x, wp, ws_, dec, **g)
                    if t and (best[0] is None or t < best[0]):
                        best = (t, cfg)
    rec("speed", name="ws best", us=best[0], cfg=best[1], bf16_us=t_bf,
        speedup_vs_bf16=(t_bf / best[0]) if t_bf and best[0] else None, **g)
    if best[1]:
        breakdown("breakdown ws best", functools.partial(wk.w4a16_matmul, **best[1]),
                  x, wp, ws_, dec, **g)


def accs():
    """Several accumulators per warpgroup (nacc) and one wgmma in four (timing only)."""
    g, x, (wp, ws_, dec), wb = _m16()
    timed("bf16 jnp.dot", jnp.dot, x, wb, **g)
    base_ws = dict(tile_k=512, split_k=2, stages=3, compute_wgs=2, x_direct=True)
    base_1 = dict(tile_k=256, split_k=4, stages=2, x_direct=True)
    for base in (base_ws, base_1):
        for nacc in (1, 2, 4):
            for mode in ("full", "mma1of4", "nodecode"):
                cfg = dict(base, nacc=nacc, _mode=mode)
                timed(f"acc {cfg}", functools.partial(wk.w4a16_matmul, **cfg), x, wp, ws_,
                      dec, **g)
    for m2, k2, n2, b2 in ((16, 8192, 8192, False), (5, 1024, 512, True)):
        x2, q2 = make(m2, k2, n2, b2, 500 + m2)
        p2 = jax.jit(wk.prepare_weight)(q2)
        ref = jnp.dot(x2.astype(jnp.float32), fp4jax.dequantize(q2, jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
        for cfg in (dict(base_ws, nacc=4), dict(base_1, nacc=2)):
            y = wk.w4a16_matmul(x2, *p2, out_dtype=jnp.float32,
                                **dict(cfg, tile_k=256, split_k=1))
            rel = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
            rec("check", m=m2, k=k2, n=n2, cfg=str(cfg), rel_err=rel, ok=rel < 1e-5)


def cw3():
    """Three compute warpgroups (12 compute warps per SM instead of 8): N = 8256 = 43 x 192
    (the weight padded by 64 zero rows), against two warpgroups on N = 8192 and 8256."""
    m, k = 16, 8192
    for n in (8256, 8192):
        g = {"m": m, "k": k, "n": n}
        x, q = make(m, k, n, True, 7, wide=False)
        wp, ws_, dec = jax.jit(wk.prepare_weight)(q)
        wb = fp4jax.dequantize(q, jnp.bfloat16)
        ref = jnp.dot(x.astype(jnp.float32), fp4jax.dequantize(q, jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
        timed("bf16 jnp.dot", jnp.dot, x, wb, **g)
        cfgs = [dict(compute_wgs=2, tile_k=512, split_k=2, stages=3)]
        if n % 192 == 0:
            cfgs = [dict(compute_wgs=3, tile_k=t, split_k=s, stages=st)
                    for t, st in ((256, 2), (256, 3), (512, 2)) for s in (1, 2, 4)] + cfgs
        for cfg in cfgs:
            try:
                y = wk.w4a16_matmul(x, wp, ws_, dec, out_dtype=jnp.float32, **cfg)
                rel = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
                rec("check", cfg=str(cfg), rel_err=rel, ok=rel < 1e-5, **g)
            except Exception as e:  # noqa: BLE001
                rec("check", cfg=str(cfg), error=f"{type(e).__name__}: {str(e)[:800]}", **g)
                continue
            timed(f"cw3 {cfg}", functools.partial(wk.w4a16_matmul, **cfg), x, wp, ws_, dec, **g)


def kwgs(wgs=(2, 3)):
    """Compute warpgroups splitting the k range of one 64-row tile (``k_wgs``): more compute
    warps per SM with 128 CTAs. Exactness on 4 shapes, then M=16, K=N=8192 timings against
    bf16 and the default two-warpgroup kernel in the same process."""
    for cw in wgs:
        for m2, k2, n2, b2 in ((16, 8192, 8192, False), (3, 1024, 320, True),
                               (64, 2048, 1024, False), (16, 4096, 14336, True)):
            row = {"m": m2, "k": k2, "n": n2, "block_2d": b2, "k_wgs": cw}
            try:
                x2, q2 = make(m2, k2, n2, b2, 600 + m2 + cw)
                if m2 >= 3:
                    x2 = x2.at[1].set(jnp.nan)
                p2 = jax.jit(wk.prepare_weight)(q2)
                y = wk.w4a16_matmul(x2, *p2, out_dtype=jnp.float32, k_wgs=cw)
                ref = jnp.dot(x2.astype(jnp.float32), fp4jax.dequantize(q2, jnp.float32),
                              precision=jax.lax.Precision.HIGHEST)
                ok = jnp.arange(m2) != 1
                row["nan_row_all_nan"] = bool(jnp.all(jnp.isnan(y[1])))
                yv, rv = y[ok], ref[ok]
                row["finite"] = bool(jnp.all(jnp.isfinite(yv)))
                row["rel_err"] = float(jnp.linalg.norm(yv - rv) / jnp.linalg.norm(rv))
                row["ok"] = row["rel_err"] < 1e-5 and row["finite"] and row["nan_row_all_nan"]
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            rec("check", **row)
    g, x, (wp, ws_, dec), wb = _m16()
    t_bf = timed("bf16 jnp.dot", jnp.dot, x, wb, **g)
    t_def = timed("w4a16 default", wk.w4a16_matmul, x, wp, ws_, dec, **g)
    best = (None, None)
    for cw in wgs:
        for tile_k in (512, 256):
            for split in (1, 2):
                cfg = dict(k_wgs=cw, tile_k=tile_k, split_k=split)
                t = timed(f"kwgs {cfg}", functools.partial(wk.w4a16_matmul, **cfg),
                          x, wp, ws_, dec, **g)
                if t and (best[0] is None or t < best[0]):
                    best = (t, cfg)
    if best[1]:
        timed(f"kwgs best nodecode {best[1]}",
              functools.partial(wk.w4a16_matmul, _mode="nodecode", **best[1]),
              x, wp, ws_, dec, **g)
        breakdown("breakdown kwgs best", functools.partial(wk.w4a16_matmul, **best[1]),
                  x, wp, ws_, dec, **g)
    t_bf2 = timed("bf16 jnp.dot (again)", jnp.dot, x, wb, **g)
    rec("speed", name="kwgs best", us=best[0], cfg=best[1], bf16_us=t_bf, bf16_again_us=t_bf2,
        default_us=t_def, speedup_vs_bf16=(t_bf / best[0]) if t_bf and best[0] else None,
        default_speedup=(t_bf / t_def) if t_bf and t_def else None, **g)


if __name__ == "__main__":
    which = sys.argv[1:] or ["check", "speed"]
    if "kwgs" in which:
        kwgs()
    if "kwgs4" in which:  # four warpgroups (the row-split variant hung in run 33)
        kwgs(wgs=(4,))
    if "cw3" in which:
        cw3()
    if "accs" in which:
        accs()
    if "ws" in which:
        ws()
    if "ws2" in which:  # sweep only
        ws(checks=False, splits=(1, 2, 4))
    if "diag" in which:
        diag()
    if "check" in which:
        check()
    if "speed" in which or "sweep" in which:
        speed(sweep="sweep" in which)
    RES["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    dump()
