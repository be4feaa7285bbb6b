"""Benchmark of fp4jax's Pallas Mosaic GPU kernels against the baselines (issue 5).

One script, one device call:

    PYTHONPATH=$PWD python3 experiments/bench_kernels.py [copy quantize quantize2 quantize3 sweep
                                                          decode gemm dotkern dotkern1
                                                          dotkern3 dotsweep fakequant w4a4 w4a4two]

Device time of every jitted call is measured with CUPTI
(``jax.experimental.mosaic.gpu.profiler.measure``: the sum of the kernels one call
launches, so dispatch overhead is excluded and decode-sized calls are timed exactly),
after 2 warm-up calls, as the median of 20 (or 50 for decode) calls. Ratios are taken
against bf16 ``jnp.dot`` timed in the same run. Writes ``$OUT/bench_kernels.json``
(``./bench_kernels.json`` without $OUT) with the device name and JAX version, and
prints a table.
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
from pallas_kernels import quantize_nvfp4_sm90 as qk  # noqa: E402
from pallas_kernels import w4a16_sm90 as wk  # noqa: E402

OUT = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
       "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command":
       "PYTHONPATH=$PWD python3 experiments/bench_kernels.py", "results": []}


def rec(group, name, **kw):
    kw.update(group=group, name=name)
    OUT["results"].append(kw)
    print(json.dumps(kw), flush=True)
    _dump()


def _dump():
    """Write the JSON after every row, so a run stopped at its time limit keeps its rows."""
    with open(os.path.join(os.environ.get("OUT", "."), "bench_kernels.json"), "w") as f:
        json.dump(OUT, f, indent=1)


def timed(group, name, f, *args, iterations=20, **extra):
    try:
        t = time_fn(jax.jit(f), *args, iterations=iterations)
        rec(group, name, us=t["median_us"], min_us=t["min_us"], method=t["method"], **extra)
        return t["median_us"]
    except Exception as e:  # noqa: BLE001
        rec(group, name, error=f"{type(e).__name__}: {str(e)[:600]}",
            tb=traceback.format_exc()[-1500:])
        return None


def rand(shape, key, dtype=jnp.bfloat16, scale=1.0):
    return (jax.random.normal(jax.random.key(key), shape, jnp.float32) * scale).astype(dtype)


def bench_copy():
    x = rand((8192, 8192), 0)
    us = timed("copy", "bf16 x*2 8192x8192", lambda x: x * 2, x)
    gbps = 2 * x.size * 2 / us / 1e3
    OUT["copy_gbps"] = gbps
    rec("copy", "copy bandwidth", gbps=gbps)
    return gbps


def bench_quantize(copy_gbps, sweep=False, shapes=((8192, 8192), (16384, 4096), (4096, 14336))):
    for (r, c) in shapes:
        x = rand((r, c), 1)
        n = r * c
        g = f"quantize {r}x{c}"
        enc, dec = jax.jit(qk.global_scales)(x)
        # correctness of the timed configuration, on this input
        pk, sb, d = jax.jit(qk.quantize_nvfp4_1x16)(x)
        q = jax.jit(lambda x: fp4jax.quantize(x, fp4jax.NVFP4))(x)
        exact = bool((pk == fp4jax.pack_e2m1(q.data)).all()
                     & (sb == jax.lax.bitcast_convert_type(q.scale, jnp.uint8)).all()
                     & (d == q.global_scale))
        rec(g, "kernel exact vs fp4jax.quantize", exact=exact)
        total_bytes = n * (2 + 2 + 0.5 + 1 / 16)  # amax read + read + packed + scales
        kern_bytes = n * (2 + 0.5 + 1 / 16)
        for name, f, args, nbytes in (
            ("xla quantize-dequantize (fp4jax.dequantize(fp4jax.quantize(x)))",
             lambda x: fp4jax.dequantize(fp4jax.quantize(x, fp4jax.NVFP4), jnp.bfloat16),
             (x,), n * (2 + 2 + 2)),
            ("xla fp4jax.quantize", lambda x: fp4jax.quantize(x, fp4jax.NVFP4), (x,),
             total_bytes),
            ("xla amax + scales only", qk.global_scales, (x,), n * 2),
            ("pallas kernel + xla amax (total)", qk.quantize_nvfp4_1x16, (x,), total_bytes),
            ("pallas kernel only (scales given)", qk.quantize_nvfp4_1x16_scaled,
             (x, enc, dec), kern_bytes),
            ("pallas kernel + xla amax, hardware 1/(s*dec) (pre-fix, not exact)",
             functools.partial(qk.quantize_nvfp4_1x16, exact_recip=False), (x,), total_bytes),
            ("pallas kernel only, hardware 1/(s*dec) (pre-fix, not exact)",
             functools.partial(qk.quantize_nvfp4_1x16_scaled, exact_recip=False),
             (x, enc, dec), kern_bytes),
        ):
            us = timed(g, name, f, *args)
            if us:
                gbps = nbytes / us / 1e3
                rec(g, name + " [bw]", gbps=gbps, frac_of_copy=gbps / copy_gbps, us=us)
        if sweep and (r, c) == (8192, 8192):  # tile sweep of the kernel alone
            for kt in (1, 2):
                for spc in (1, 2, 4):
                    f = functools.partial(qk.quantize_nvfp4_1x16_scaled, block=kt,
                                          steps_per_cta=spc)
                    us = timed(g, f"sweep kernel only block={kt} steps_per_cta={spc}", f,
                               x, enc, dec)
                    if us:
                        rec(g, f"sweep block={kt} spc={spc} [bw]",
                            frac_of_copy=kern_bytes / us / 1e3 / copy_gbps, us=us)


def bench_quantize3(copy_gbps, shapes=((8192, 8192), (4096, 14336))):
    """Table reciprocal vs recip_rn, the 16x16 kernel, and XLA fp4jax.quantize (1x16, 2D),
    each as a fraction of the copy bandwidth of the same run (KERNELS.md run 4)."""
    for (r, c) in shapes:
        x = rand((r, c), 1)
        n = r * c
        g = f"quantize3 {r}x{c}"
        enc, dec = jax.jit(qk.global_scales)(x)
        rec(g, "table reciprocal safe for this dec", ok=bool(qk.recip_table(dec)[0]),
            dec=float(dec))
        q1 = jax.jit(lambda x: fp4jax.quantize(x, fp4jax.NVFP4))(x)
        q2 = jax.jit(lambda x: fp4jax.quantize(x, fp4jax.NVFP4, block_2d=True))(x)
        for name, f, q in (("1x16 auto (table)", qk.quantize_nvfp4_1x16, q1),
                           ("2d auto (table)", qk.quantize_nvfp4_2d, q2)):
            pk, sb, d = jax.jit(f)(x)
            exact = bool((pk == fp4jax.pack_e2m1(q.data)).all()
                         & (sb == jax.lax.bitcast_convert_type(q.scale, jnp.uint8)).all()
                         & (d == q.global_scale))
            rec(g, f"kernel {name} exact vs fp4jax.quantize", exact=exact)
        total_1 = n * (2 + 2 + 0.5 + 1 / 16)  # amax read + read + packed + scales
        total_2 = n * (2 + 2 + 0.5 + 1 / 256)
        kern_1 = n * (2 + 0.5 + 1 / 16)
        kern_2 = n * (2 + 0.5 + 1 / 256)
        rows = (
            ("1x16 kernel + amax, table reciprocal (auto)", qk.quantize_nvfp4_1x16, (x,),
             total_1),
            ("1x16 kernel + amax, table only (recip=table)",
             functools.partial(qk.quantize_nvfp4_1x16, recip="table"), (x,), total_1),
            ("1x16 kernel + amax, recip_rn (run 3 kernel)",
             functools.partial(qk.quantize_nvfp4_1x16, recip="rn"), (x,), total_1),
            ("1x16 kernel + amax, hardware 1/x (not exact)",
             functools.partial(qk.quantize_nvfp4_1x16, recip="hw"), (x,), total_1),
            ("1x16 kernel only, table reciprocal (auto)", qk.quantize_nvfp4_1x16_scaled,
             (x, enc, dec), kern_1),
            ("1x16 kernel only, recip_rn",
             functools.partial(qk.quantize_nvfp4_1x16_scaled, recip="rn"), (x, enc, dec),
             kern_1),
            ("2d kernel + amax (auto, g=64)", qk.quantize_nvfp4_2d, (x,), total_2),
            ("2d kernel + amax (auto, g=128)", functools.partial(qk.quantize_nvfp4_2d, g=128),
             (x,), total_2),
            ("2d kernel + amax (recip_rn)", functools.partial(qk.quantize_nvfp4_2d, recip="rn"),
             (x,), total_2),
            ("2d kernel only (auto, g=64)", qk.quantize_nvfp4_2d_scaled, (x, enc, dec), kern_2),
            ("xla fp4jax.quantize 1x16", lambda x: fp4jax.quantize(x, fp4jax.NVFP4), (x,),
             total_1),
            ("xla fp4jax.quantize 2d",
             lambda x: fp4jax.quantize(x, fp4jax.NVFP4, block_2d=True), (x,), total_2),
        )
        for i, (name, f, args, nbytes) in enumerate(rows):
            if (r, c) != shapes[0] and i in (1, 3, 5, 7, 8):  # 2nd shape: main rows only (time)
                continue
            us = timed(g, name, f, *args)
            if us:
                gbps = nbytes / us / 1e3
                rec(g, name + " [bw]", gbps=gbps, frac_of_copy=gbps / copy_gbps, us=us)


def bench_gemm():
    key = jax.random.key(7)
    recipe = fp4jax.recipes.nvfp4()
    for (m, k, n) in ((8192, 8192, 8192), (4096, 4096, 4096), (16384, 4096, 14336)):
        g = f"gemm {m}x{k}x{n}"
        x, w = rand((m, k), 2), rand((k, n), 3, scale=0.02)
        flops = 2 * m * k * n
        t_bf = timed(g, "bf16 jnp.dot", jnp.dot, x, w)
        t_fp = timed(g, "fp4jax.dot nvfp4 fwd (XLA path)",
                     lambda x, w: fp4jax.dot(x, w, recipe=recipe, key=key), x, w)
        try:
            cfg = jax.nn.get_scaled_dot_general_config("nvfp4")
            dn = (((1,), (0,)), ((), ()))
            t_sd = timed(g, "jax.nn.scaled_dot_general nvfp4 fwd", lambda x, w, dn=dn, c=cfg: (
                jax.nn.scaled_dot_general(x, w, dn, preferred_element_type=jnp.bfloat16,
                                          configs=[c, c, c])), x, w)
        except Exception as e:  # noqa: BLE001
            t_sd = None
            rec(g, "jax.nn.scaled_dot_general nvfp4 fwd", error=f"{type(e).__name__}: {e}"[:300])
        for name, t in (("bf16 jnp.dot", t_bf), ("fp4jax.dot nvfp4 fwd (XLA path)", t_fp),
                        ("jax.nn.scaled_dot_general nvfp4 fwd", t_sd)):
            if t and t_bf:
                rec(g, name + " [rate]", tflops=flops / t / 1e6, ratio_to_bf16=t / t_bf)
        rec(g, "fp4jax W4A4 Pallas kernel", error="not implemented (see report)")
        if (m, k, n) != (16384, 4096, 14336):
            def loss_bf(x, w):
                return jnp.dot(x, w).astype(jnp.float32).sum()

            def loss_fp(x, w):
                return fp4jax.dot(x, w, recipe=recipe, key=key).astype(jnp.float32).sum()

            t1 = timed(g, "bf16 fwd+bwd", jax.grad(loss_bf, argnums=(0, 1)), x, w)
            t2 = timed(g, "fp4jax nvfp4 recipe fwd+bwd (XLA path)",
                       jax.grad(loss_fp, argnums=(0, 1)), x, w)
            if t1 and t2:
                rec(g, "recipe fwd+bwd ratio to bf16", ratio_to_bf16=t2 / t1)


def _with_kernels(setting, make, gemm="pallas"):
    """Build and trace ``make()`` with FP4JAX_KERNELS=setting and FP4JAX_KERNEL_GEMM=gemm.
    fp4jax.dot caches its jitted custom_vjp per recipe (``_make_dot3``), so that cache and
    JAX's trace caches are cleared first: otherwise the first setting's trace would be
    reused."""
    dot_mod = sys.modules["fp4jax.dot"]  # the module (fp4jax.dot is also the function)
    env = {"FP4JAX_KERNELS": setting, "FP4JAX_KERNEL_GEMM": gemm}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        dot_mod._make_dot3.cache_clear()
        jax.clear_caches()
        return make()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bench_dot_kernels(iterations=10, shapes=((8192, 8192, 8192), (4096, 4096, 4096))):
    """fp4jax.dot (nvfp4 recipe, bf16 inputs) fwd and fwd+bwd with the quantize kernel
    on/off, against bf16."""
    key = jax.random.key(7)
    recipe = fp4jax.recipes.nvfp4()
    for (m, k, n) in shapes:
        g = f"dot kernels {m}x{k}x{n}"
        x, w = rand((m, k), 2), rand((k, n), 3, scale=0.02)

        # value_and_grad keeps the forward GEMM (grad alone lets XLA drop it), and a
        # random cotangent ct (an argument) keeps XLA from constant-folding the
        # gradient's quantization at compile time (a .sum() loss makes g all ones).
        ct = rand((m, n), 4)

        def loss_bf(x, w, ct):
            return (jnp.dot(x, w).astype(jnp.float32) * ct).sum()

        def loss_fp(x, w, ct):
            y = fp4jax.dot(x, w, recipe=recipe, key=key).astype(jnp.float32)
            return (y * ct).sum()

        t_bf = timed(g, "bf16 jnp.dot fwd", jnp.dot, x, w, iterations=iterations)
        t_bfb = timed(g, "bf16 fwd+bwd (value_and_grad)",
                      jax.value_and_grad(loss_bf, argnums=(0, 1)), x, w, ct,
                      iterations=iterations)
        res = {}
        # "on": kernels with the Pallas GEMM (gemm_alpha, the default); "on-xla-gemm": the
        # same operand kernels with XLA's GEMMs and a separate alpha pass
        for setting in ("off", "on", "on-xla-gemm"):
            def make(setting=setting, x=x, w=w, ct=ct, g=g, loss_fp=loss_fp):
                fwd = jax.jit(lambda x, w: fp4jax.dot(x, w, recipe=recipe, key=key))
                fb = jax.jit(jax.value_and_grad(loss_fp, argnums=(0, 1)))
                uses_f = fwd.lower(x, w).as_text().count("mosaic_gpu")
                uses_b = fb.lower(x, w, ct).as_text().count("mosaic_gpu")
                v, (dx, dw) = fb(x, w, ct)  # traced here, under this setting
                out = (fwd(x, w), v, dx, dw)
                tf = timed(g, f"fp4jax.dot nvfp4 fwd FP4JAX_KERNELS={setting}", fwd, x, w,
                           iterations=iterations, mosaic_gpu_mentions=uses_f)
                tb = timed(g, f"fp4jax.dot nvfp4 fwd+bwd FP4JAX_KERNELS={setting}", fb, x, w,
                           ct, iterations=iterations, mosaic_gpu_mentions=uses_b)
                return tf, tb, out

            res[setting] = _with_kernels(setting.split("-")[0], make,
                                         "xla" if setting.endswith("xla-gemm") else "pallas")
        for other in ("on", "on-xla-gemm"):
            same = all(bool((a == b).all())
                       for a, b in zip(res["off"][2], res[other][2], strict=True))
            rec(g, f"outputs (y, loss, dx, dw) bit-identical {other} vs off", ok=same)
        for setting, (tf, tb, _) in res.items():
            if tf and t_bf:
                rec(g, f"fwd {setting} [ratio to bf16 fwd]", ratio_to_bf16=tf / t_bf, us=tf)
            if tb and t_bfb:
                rec(g, f"fwd+bwd {setting} [ratio to bf16 fwd+bwd]", ratio_to_bf16=tb / t_bfb,
                    us=tb)


def bench_fakequant(copy_gbps, shapes=((8192, 8192), (16384, 4096))):
    """The fused GEMM-operand kernels (bf16 in, bf16 data*scale out) incl. their amax pass,
    against the XLA path's same output (``scaled_data(quantize(...))``); bytes = read x
    twice (amax + kernel) + write the output, as a fraction of copy bandwidth."""
    import importlib

    from fp4jax.formats import NVFP4
    from fp4jax.hadamard import default_signs, random_hadamard_transform
    from pallas_kernels import fakequant_nvfp4_sm90 as fq

    qz = importlib.import_module("fp4jax.quantize")
    key = jax.random.key(11)
    signs = jnp.asarray(default_signs(16))
    for (r, c) in shapes:
        g = f"fakequant {r}x{c}"
        x = rand((r, c), 1)
        nbytes = 3 * x.size * 2

        def xla(axis, sr=False, block_2d=False, rht=False):
            def f(a):
                xin = random_hadamard_transform(a, axis=0, size=16, signs=signs) if rht else a
                q = qz._quantize_impl(xin, key if sr else None, NVFP4, axis, block_2d,
                                      "stochastic" if sr else "nearest")
                return qz.scaled_data(q, jnp.bfloat16)
            return f

        rows = [
            ("1x16 rows RtN", lambda x: fq.fq_rows(x)[0], xla(-1)),
            ("1x16 rows SR", lambda x: fq.fq_rows(x, key)[0], xla(-1, sr=True)),
            ("16x16 RtN", lambda x: fq.fq_2d(x)[0], xla(-1, block_2d=True)),
            ("16x1 cols RtN", lambda x: fq.fq_cols(x)[0], xla(0)),
            ("16x1 cols RHT RtN", lambda x: fq.fq_cols(x, signs=signs)[0], xla(0, rht=True)),
            ("16x1 cols RHT SR", lambda x: fq.fq_cols(x, key, signs=signs)[0],
             xla(0, sr=True, rht=True)),
        ]
        # the tensor amaxes: an XLA reduction (plain), the rotated one (a Pallas pass), and
        # both from one read (what dot's kernel path does for x and dy)
        def xla_amax(a):
            a = jnp.abs(a.astype(jnp.float32))
            return jnp.max(jnp.where(jnp.isfinite(a), a, 0.0))

        ta = timed(g, "amax XLA reduction", xla_amax, x)
        tr = timed(g, "rht_cols_amax", lambda x: fq.rht_cols_amax(x, signs), x)
        tp = timed(g, "cols_amaxes (both from one read)", lambda x: fq.cols_amaxes(x, signs), x)
        if ta and tr and tp:
            rec(g, "cols_amaxes vs separate passes", us_saved=ta + tr - tp,
                frac_copy_bw_read=(x.size * 2) / tp / 1e3 / copy_gbps)
        for name, fk, fx in rows:
            tk = timed(g, f"kernel+amax {name}", fk, x)
            tx = timed(g, f"XLA {name}", fx, x)
            if tk:
                rec(g, f"kernel {name} [fraction of copy BW]",
                    frac_copy_bw=nbytes / tk / 1e3 / copy_gbps, us=tk,
                    speedup_vs_xla=(tx / tk) if tx else None)


def bench_decode():
    """W4A16 at decode sizes: bf16 dot, XLA dequantize + dot, the kernel
    (``w4a16_sm90``, default configuration) and the previous kernel (``fp4_matmul_sm90``)."""
    for m in (1, 16, 64):
        k = n = 8192
        g = f"decode M={m} K={k} N={n}"
        x = rand((m, k), 4)
        w = rand((k, n), 5, dtype=jnp.float32, scale=0.02)
        q = jax.jit(lambda w: fp4jax.quantize(w, fp4jax.NVFP4, block_2d=True))(w)
        wp, ws, dec = jax.jit(wk.prepare_weight)(q)
        wb = fp4jax.dequantize(q, jnp.bfloat16)
        y = wk.w4a16_matmul(x, wp, ws, dec, out_dtype=jnp.float32)
        ref = jnp.dot(x.astype(jnp.float32), fp4jax.dequantize(q, jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
        rel = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
        rec(g, "w4a16 kernel rel err vs x @ dequantize(W) (f32)", rel_err=rel, ok=rel < 1e-5)
        t_bf = timed(g, "bf16 jnp.dot", jnp.dot, x, wb, iterations=50)
        t_x = timed(g, "xla dot(x, dequantize(W)) (pre-quantized W)",
                    lambda x, q: jnp.dot(x, fp4jax.dequantize(q, jnp.bfloat16)), x, q,
                    iterations=50)
        t_k = timed(g, "pallas w4a16 kernel (w4a16_sm90)", wk.w4a16_matmul, x, wp, ws, dec,
                    iterations=50, config=str(wk.default_config(m, k, n)))
        owq, ows, odec = jax.jit(mm.prepare_weight)(q)
        t_o = timed(g, "previous pallas w4a16 kernel (fp4_matmul_sm90)", mm.w4a16_matmul,
                    x, owq, ows, odec, iterations=50)
        for name, t, per_w in (("bf16 jnp.dot", t_bf, 2.0), ("xla dequant+dot", t_x, 2.0),
                               ("pallas w4a16 kernel", t_k, 0.5 + 2 / 16),
                               ("previous pallas w4a16 kernel", t_o, 0.5 + 1 / 16)):
            if t and t_bf:
                rec(g, name + " [rate]", speedup_vs_bf16=t_bf / t,
                    weight_gbps=k * n * per_w / t / 1e3)


def bench_w4a4(shapes=((8192, 8192, 8192), (4096, 4096, 4096), (16384, 4096, 14336)),
               fused_cfgs=((128, 128), (256, 128), (128, 256)), two_pass_only=False):
    """W4A4 (packed NVFP4 A and B, pallas_kernels/fp4_gemm_w4a4_sm90.py) against bf16
    jnp.dot in the same run: XLA decode + bf16 dot, (a) decode kernel + bf16 dot (and the
    decode kernel alone), (b) fused kernel at a few (tile_n, tile_k); fused configs
    beyond the first only at the first shape (compile time)."""
    from pallas_kernels import fp4_gemm_w4a4_sm90 as w4

    for si, (m, k, n) in enumerate(shapes):
        g = f"w4a4 {m}x{k}x{n}"
        a, b = rand((m, k), 11, jnp.float32), rand((k, n), 12, jnp.float32, scale=0.02)
        qa = jax.jit(lambda a: fp4jax.quantize(a, fp4jax.NVFP4, axis=1))(a)
        qb = jax.jit(lambda b: fp4jax.quantize(b, fp4jax.NVFP4, axis=0))(b)
        pa, pb = jax.jit(w4.prepare_a)(qa), jax.jit(w4.prepare_b)(qb)
        a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        flops = 2 * m * k * n
        ref = jax.jit(w4.reference_w4a4)(*pa, *pb)
        t_bf = timed(g, "bf16 jnp.dot", jnp.dot, a16, b16)
        cands = [("xla decode + bf16 dot", w4.w4a4_matmul_xla),
                 ("(a) two-pass: decode kernel + bf16 dot", w4.w4a4_matmul_two_pass)]
        if si == 0 and not two_pass_only:
            cands.append(("(a) two-pass, decode tile_k=128 out_swizzle=False",
                          functools.partial(w4.w4a4_matmul_two_pass, tile_k=128,
                                            out_swizzle=False)))
        for tn, tk in () if two_pass_only else (fused_cfgs if si == 0 else fused_cfgs[:1]):
            cands.append((f"(b) fused tile_n={tn} tile_k={tk}",
                          functools.partial(w4.w4a4_matmul_fused, tile_n=tn, tile_k=tk)))
        for name, f in cands:
            try:
                y = jax.jit(functools.partial(f, out_dtype=jnp.float32))(*pa, *pb)
                rel = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
            except Exception as e:  # noqa: BLE001
                rec(g, name, error=f"{type(e).__name__}: {str(e)[:600]}")
                continue
            y16 = jax.jit(functools.partial(f, out_dtype=jnp.bfloat16))(*pa, *pb)
            # the bf16 output (the Pallas GEMM's epilogue for two-pass) vs the f32
            # reference rounded once to bf16
            differ16 = float(jnp.mean((y16 != ref.astype(jnp.bfloat16)).astype(jnp.float32)))
            t = timed(g, name, functools.partial(f, out_dtype=jnp.bfloat16), *pa, *pb,
                      rel_err_f32_out=rel, exact_ok=rel < 1e-5,
                      bf16_out_frac_differ_from_rounded_ref=differ16)
            if t and t_bf:
                rec(g, name + " [rate]", tflops=flops / t / 1e6, ratio_to_bf16_time=t / t_bf,
                    frac_of_bf16_tflops=t_bf / t)
        timed(g, "decode kernel alone (operand A)", w4.decode_operand, pa[0], pa[1])


def main():
    which = sys.argv[1:] or ["copy", "quantize", "decode", "gemm", "dotkern"]
    OUT["command"] = "PYTHONPATH=$PWD python3 experiments/bench_kernels.py " + " ".join(which)
    copy_gbps = bench_copy()
    if "quantize" in which:
        bench_quantize(copy_gbps, sweep="sweep" in which)
    if "quantize2" in which:  # two shapes only (short runs)
        bench_quantize(copy_gbps, shapes=((8192, 8192), (4096, 14336)))
    if "quantize3" in which:  # table reciprocal, 16x16 kernel
        bench_quantize3(copy_gbps)
    if "fakequant" in which:
        bench_fakequant(copy_gbps)
    if "fakequant1" in which:  # 8192x8192 only
        bench_fakequant(copy_gbps, shapes=((8192, 8192),))
    if "dotkern" in which:
        bench_dot_kernels()
    if "dotkern1" in which:  # 8192^3 only
        bench_dot_kernels(shapes=((8192, 8192, 8192),))
    if "w4a4two" in which:  # 8192^3 and the Llama MLP shape, two-pass and XLA only
        bench_w4a4(shapes=((8192, 8192, 8192), (16384, 4096, 14336)), two_pass_only=True)
    if "dotsweep" in which:  # sizes around the auto threshold (FP4JAX_KERNELS=auto)
        bench_dot_kernels(iterations=10, shapes=(
            (2048, 2048, 2048), (16384, 512, 2048), (16384, 2048, 512), (8192, 2048, 2048),
            (16384, 2048, 2048), (4096, 4096, 4096), (8192, 4096, 4096)))
    if "dotkern3" in which:  # 8192^3, 4096^3, Llama-8B MLP up-projection
        bench_dot_kernels(shapes=((8192, 8192, 8192), (4096, 4096, 4096),
                                  (16384, 4096, 14336)))
    if "decode" in which:
        bench_decode()
    if "gemm" in which:
        bench_gemm()
    if "w4a4" in which:
        bench_w4a4()
    OUT["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    _dump()
    print("\n==== summary ====")
    for r in OUT["results"]:
        if "error" in r:
            print(f"{r['group']:<28} {r['name'][:60]:<60} ERROR {r['error'][:120]}")
        else:
            vals = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                    if k not in ("group", "name", "method", "min_us")}
            print(f"{r['group']:<28} {r['name'][:60]:<60} {vals}")


if __name__ == "__main__":
    main()
