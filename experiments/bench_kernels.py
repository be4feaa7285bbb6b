"""The one benchmark of fp4jax's Pallas Mosaic GPU kernels against their baselines (XLA's
path of the same output, bf16 ``jnp.dot``, the copy bandwidth), one device call:

    PYTHONPATH=$PWD python3 experiments/bench_kernels.py [MODE ...] [--list] [--dry-run]
        [--out PATH] [--commit SHA]

Device time of every jitted call is measured with CUPTI (``lab.time_fn``:
``jax.experimental.mosaic.gpu.profiler.measure``, the sum of the kernels one call launches,
so dispatch overhead is excluded and decode-sized calls are timed exactly), after 2 warm-up
calls, as the median of 20 calls (10 for ``fp4jax.dot``, 50 at decode sizes). Ratios are
taken against bf16 ``jnp.dot`` or the copy bandwidth (``copy``, always run first) of the same
process. Writes ``$OUT/bench_kernels.json`` (or ``--out``): device, JAX version, git commit,
the command, one row per measurement (rows are saved as they come, so a run stopped at its
time limit keeps them), then prints a table. ``MODE``: names from ``--list`` (default: copy
quantize decode gemm dotkern); ``dotkern1`` is the headline (the NVFP4 recipe's forward +
backward at 8192^3 with the kernels, with XLA's GEMMs, and on the XLA path, against bf16).
``--dry-run`` needs no GPU: every timed call is lowered for CUDA instead of run and the
exactness rows are skipped, so it shows that each mode builds its inputs and kernels.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import lab  # before fp4jax: puts the repository root on sys.path

import fp4jax
from fp4jax.hadamard import default_signs
from pallas_kernels.gemm import alpha_sm90 as ga
from pallas_kernels.gemm import w4a4_sm90 as w4
from pallas_kernels.gemm import w4a16_sm90 as wk
from pallas_kernels.quantize import common_sm90 as cm
from pallas_kernels.quantize import operand_sm90 as fq
from pallas_kernels.quantize import packed_sm90 as qk

RES: lab.Results | None = None
DRY = False  # --dry-run: lower for CUDA instead of timing; skip exactness rows


def rec(group, name, **kw):
    return RES.add("results", {"group": group, "name": name, **kw})


def timed(group, name, f, *args, iterations=20, **extra):
    """Median device µs of ``jax.jit(f)(*args)`` (a row; None on error or in a dry run)."""
    try:
        if DRY:
            rec(group, name, cuda_lowering_mosaic_gpu_mentions=lab.lower_for_cuda(f, *args),
                **extra)
            return None
        t = lab.time_fn(jax.jit(f), *args, iterations=iterations)
        rec(group, name, us=t["median_us"], min_us=t["min_us"], method=t["method"], **extra)
        return t["median_us"]
    except Exception as e:  # noqa: BLE001
        rec(group, name, error=lab.error_text(e))
        return None


def verify(group, name, fields):
    """An exactness row: ``fields()`` returns its values (skipped in a dry run)."""
    if DRY:
        return
    try:
        rec(group, name, **fields())
    except Exception as e:  # noqa: BLE001
        rec(group, name, error=lab.error_text(e))


def timed_bw(group, name, f, args, nbytes, copy_gbps, **extra):
    """``timed`` plus a bandwidth row: ``nbytes`` moved per call, as GB/s and as a fraction
    of the copy bandwidth measured in this process."""
    us = timed(group, name, f, *args, **extra)
    if us and nbytes:
        gbps = nbytes / us / 1e3
        rec(group, name + " [bw]", gbps=gbps, frac_of_copy=gbps / copy_gbps, us=us)
    return us


def rand(shape, key, dtype=jnp.bfloat16, scale=1.0):
    return (jax.random.normal(jax.random.key(key), shape, jnp.float32) * scale).astype(dtype)


def _packed_exact(f, x, block_2d=False):
    """Kernel ``f(x) -> (packed, scale bits, dec)`` bit-identical to ``fp4jax.quantize``."""
    q = fp4jax.quantize(x, fp4jax.NVFP4, block_2d=block_2d)
    want = (fp4jax.pack_e2m1(q.data), jax.lax.bitcast_convert_type(q.scale, jnp.uint8),
            q.global_scale)
    return {"exact": lab.same_bits(jax.jit(f)(x), want)}


# ---------------------------------------------------------------------------
# Modes.
# ---------------------------------------------------------------------------

MODES, mode = lab.registry()  # name -> (mode(copy_gbps), description)


def bench_copy():
    x = rand((8192, 8192), 0)
    us = timed("copy", "bf16 x*2 8192x8192", lambda x: x * 2, x)
    gbps = 2 * x.size * 2 / us / 1e3 if us else 3300.0  # dry run: a nominal H200 figure
    RES.data["copy_gbps"] = gbps
    rec("copy", "copy bandwidth", gbps=gbps)
    return gbps


@mode("quantize", "packed NVFP4 1x16 RtN kernel (quantize_nvfp4_1x16) with and without its "
      "amax pass vs XLA fp4jax.quantize, 8192^2, 16384x4096, 4096x14336")
def bench_quantize(copy_gbps, shapes=((8192, 8192), (16384, 4096), (4096, 14336))):
    for (r, c) in shapes:
        x = rand((r, c), 1)
        n = r * c
        g = f"quantize {r}x{c}"
        enc, dec = jax.jit(cm.global_scales)(x)
        verify(g, "kernel exact vs fp4jax.quantize",
               lambda x=x: _packed_exact(qk.quantize_nvfp4_1x16, x))
        total_bytes = n * (2 + 2 + 0.5 + 1 / 16)  # amax read + read + packed + scales
        kern_bytes = n * (2 + 0.5 + 1 / 16)
        for name, f, args, nbytes in (
            ("xla quantize-dequantize (fp4jax.dequantize(fp4jax.quantize(x)))",
             lambda x: fp4jax.dequantize(fp4jax.quantize(x, fp4jax.NVFP4), jnp.bfloat16),
             (x,), n * (2 + 2 + 2)),
            ("xla fp4jax.quantize", lambda x: fp4jax.quantize(x, fp4jax.NVFP4), (x,),
             total_bytes),
            ("xla amax + scales only", cm.global_scales, (x,), n * 2),
            ("pallas kernel + xla amax (total)", qk.quantize_nvfp4_1x16, (x,), total_bytes),
            ("pallas kernel only (scales given)", qk.quantize_nvfp4_1x16_scaled,
             (x, enc, dec), kern_bytes),
            ("pallas kernel + xla amax, hardware 1/(s*dec) (not exact)",
             functools.partial(qk.quantize_nvfp4_1x16, recip="hw"), (x,), total_bytes),
            ("pallas kernel only, hardware 1/(s*dec) (not exact)",
             functools.partial(qk.quantize_nvfp4_1x16_scaled, recip="hw"), (x, enc, dec),
             kern_bytes),
        ):
            timed_bw(g, name, f, args, nbytes, copy_gbps)


@mode("quantize2", "as quantize, 8192^2 and 4096x14336 only")
def bench_quantize2(copy_gbps):
    bench_quantize(copy_gbps, shapes=((8192, 8192), (4096, 14336)))


@mode("sweep", "tile sweep of the packed 1x16 kernel alone (block, steps per CTA), 8192^2")
def bench_quantize_sweep(copy_gbps, r=8192, c=8192):
    x = rand((r, c), 1)
    enc, dec = jax.jit(cm.global_scales)(x)
    for kt in (1, 2):
        for spc in (1, 2, 4):
            f = functools.partial(qk.quantize_nvfp4_1x16_scaled, block=kt, steps_per_cta=spc)
            timed_bw(f"quantize {r}x{c}", f"sweep kernel only block={kt} steps_per_cta={spc}",
                     f, (x, enc, dec), r * c * (2 + 0.5 + 1 / 16), copy_gbps)


@mode("quantize3", "packed kernels: table reciprocal vs recip_rn vs hardware 1/x, 1x16 and "
      "16x16 (tile groups), XLA 1x16 and 16x16, 8192^2 (4096x14336: main rows)")
def bench_quantize3(copy_gbps, shapes=((8192, 8192), (4096, 14336))):
    for (r, c) in shapes:
        x = rand((r, c), 1)
        n = r * c
        g = f"quantize3 {r}x{c}"
        enc, dec = jax.jit(cm.global_scales)(x)
        rec(g, "table reciprocal safe for this dec", ok=bool(cm.recip_table(dec)[0]),
            dec=float(dec))
        verify(g, "kernel 1x16 auto exact vs fp4jax.quantize",
               lambda x=x: _packed_exact(qk.quantize_nvfp4_1x16, x))
        verify(g, "kernel 2d auto exact vs fp4jax.quantize",
               lambda x=x: _packed_exact(qk.quantize_nvfp4_2d, x, block_2d=True))
        total_1 = n * (2 + 2 + 0.5 + 1 / 16)  # amax read + read + packed + scales
        total_2 = n * (2 + 2 + 0.5 + 1 / 256)
        kern_1 = n * (2 + 0.5 + 1 / 16)
        kern_2 = n * (2 + 0.5 + 1 / 256)
        p1, p2 = qk.quantize_nvfp4_1x16, qk.quantize_nvfp4_2d
        rows = (  # (name, f, args, bytes, first shape only)
            ("1x16 kernel + amax, table reciprocal (auto)", p1, (x,), total_1, False),
            ("1x16 kernel + amax, table only (recip=table)", functools.partial(
                p1, recip="table"), (x,), total_1, True),
            ("1x16 kernel + amax, recip_rn", functools.partial(p1, recip="rn"), (x,), total_1,
             False),
            ("1x16 kernel + amax, hardware 1/x (not exact)", functools.partial(p1, recip="hw"),
             (x,), total_1, True),
            ("1x16 kernel only, table reciprocal (auto)", qk.quantize_nvfp4_1x16_scaled,
             (x, enc, dec), kern_1, False),
            ("1x16 kernel only, recip_rn", functools.partial(
                qk.quantize_nvfp4_1x16_scaled, recip="rn"), (x, enc, dec), kern_1, True),
            ("2d kernel + amax (auto, g=64)", p2, (x,), total_2, False),
            ("2d kernel + amax (auto, g=128)", functools.partial(p2, g=128), (x,), total_2,
             True),
            ("2d kernel + amax (recip_rn)", functools.partial(p2, recip="rn"), (x,), total_2,
             True),
            ("2d kernel only (auto, g=64)", qk.quantize_nvfp4_2d_scaled, (x, enc, dec), kern_2,
             False),
            ("xla fp4jax.quantize 1x16", lambda x: fp4jax.quantize(x, fp4jax.NVFP4), (x,),
             total_1, False),
            ("xla fp4jax.quantize 2d", lambda x: fp4jax.quantize(
                x, fp4jax.NVFP4, block_2d=True), (x,), total_2, False),
        )
        for name, f, args, nbytes, first_only in rows:
            if first_only and (r, c) != shapes[0]:
                continue
            timed_bw(g, name, f, args, nbytes, copy_gbps)


@mode("packedsr", "packed 1x16 SR kernel (quantize_nvfp4_1x16_sr) alone and with its amax "
      "pass vs the bf16-operand SR kernel and XLA, 8192^2")
def bench_packed_sr(copy_gbps, r=8192, c=8192):
    x = rand((r, c), 1)
    n = r * c
    g = f"packed SR {r}x{c}"
    key = jax.random.key(0)
    enc, dec = jax.jit(cm.global_scales)(x)
    kw = cm.key_words(key)
    packed_bytes = 2 * n + n // 2 + n // 16  # read x, write codes + scales
    for name, f, nbytes in (
        ("rows SR packed, kernel only",
         lambda x: qk.quantize_nvfp4_1x16_sr_scaled(x, enc, dec, kw), packed_bytes),
        ("rows SR packed + amax", lambda x: qk.quantize_nvfp4_1x16_sr(x, key),
         packed_bytes + 2 * n),
        ("rows SR bf16 operand (fq_rows) + amax", lambda x: fq.fq_rows(x, key)[0], 6 * n),
        ("rows SR XLA fp4jax.quantize", lambda x: fp4jax.quantize(
            x, fp4jax.NVFP4, rounding="stochastic", key=key), None),
    ):
        timed_bw(g, name, f, (x,), nbytes, copy_gbps)


@mode("fakequant", "the fused GEMM-operand kernels (operand_sm90: rows RtN/SR, 16x16, cols "
      "RtN, RHT, RHT+SR) with their amax passes vs the XLA path's same output, and the amax "
      "passes alone, 8192^2 and 16384x4096")
def bench_fakequant(copy_gbps, shapes=((8192, 8192), (16384, 4096))):
    """Bytes = read x twice (amax + kernel) + write the bf16 output, as a fraction of the
    copy bandwidth."""
    key = jax.random.key(11)
    signs = jnp.asarray(default_signs(16))
    for (r, c) in shapes:
        g = f"fakequant {r}x{c}"
        x = rand((r, c), 1)
        nbytes = 3 * x.size * 2
        rows = [
            ("1x16 rows RtN", lambda x: fq.fq_rows(x)[0], dict(axis=-1)),
            ("1x16 rows SR", lambda x: fq.fq_rows(x, key)[0], dict(axis=-1, key=key)),
            ("16x16 RtN", lambda x: fq.fq_2d(x)[0], dict(block_2d=True)),
            ("16x1 cols RtN", lambda x: fq.fq_cols(x)[0], dict(axis=0)),
            ("16x1 cols RHT RtN", lambda x: fq.fq_cols(x, signs=signs)[0],
             dict(axis=0, signs=signs)),
            ("16x1 cols RHT SR", lambda x: fq.fq_cols(x, key, signs=signs)[0],
             dict(axis=0, key=key, signs=signs)),
        ]

        def xla_amax(a):
            a = jnp.abs(a.astype(jnp.float32))
            return jnp.max(jnp.where(jnp.isfinite(a), a, 0.0))

        # the tensor amaxes: an XLA reduction (plain), the rotated one (a Pallas pass), and
        # both from one read (what dot's kernel path does for x and dy)
        ta = timed(g, "amax XLA reduction", xla_amax, x)
        tr = timed(g, "rht_cols_amax", lambda x: fq.rht_cols_amax(x, signs), x)
        tp = timed(g, "cols_amaxes (both from one read)", lambda x: fq.cols_amaxes(x, signs), x)
        if ta and tr and tp:
            rec(g, "cols_amaxes vs separate passes", us_saved=ta + tr - tp,
                frac_copy_bw_read=(x.size * 2) / tp / 1e3 / copy_gbps)
        for name, fk, ref in rows:
            tk = timed(g, f"kernel+amax {name}", fk, x)
            tx = timed(g, f"XLA {name}", lambda a, ref=ref: lab.xla_operand(a, **ref)[0], x)
            if tk:
                rec(g, f"kernel {name} [fraction of copy BW]",
                    frac_copy_bw=nbytes / tk / 1e3 / copy_gbps, us=tk,
                    speedup_vs_xla=(tx / tk) if tx else None)


@mode("fakequant1", "as fakequant, 8192^2 only")
def bench_fakequant1(copy_gbps):
    bench_fakequant(copy_gbps, shapes=((8192, 8192),))


@mode("rowscols", "fq_rows_cols_scaled (1x16 rows + RHT-16 16x1 cols "
      "from one read) vs fq_rows_scaled + fq_cols_scaled, x (RtN) and dy (SR, two keys), "
      "given the scalars; 8192^2, 16384x4096, 16384x768; exactness rows (fused == the two)")
def bench_rowscols(copy_gbps, shapes=((8192, 8192), (16384, 4096), (16384, 768))):
    """Bytes: the two kernels read x twice and write two bf16 copies (8 bytes an element),
    the fused one reads it once (6 bytes); the amax pass (``cols_amaxes``) is left out."""
    signs = jnp.asarray(default_signs(16), jnp.float32)
    ones = jnp.ones((16,), jnp.float32)
    for r, c in shapes:
        g = f"rowscols {r}x{c}"
        x = rand((r, c), 3)
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)))  # a dry run runs no kernel
        amax, rht_amax = (amax, amax) if DRY else fq.cols_amaxes(x, signs)
        enc, dec = cm.global_scales(None, jnp.stack([amax, rht_amax]))
        sc = cm.scalars(enc, dec, jnp.stack([ones, signs])).reshape(-1)
        for name, sr in (("x RtN", False), ("dy SR", True)):
            args = (x, sc, cm.key_words(jax.random.key(1) if sr else None),
                    cm.key_words(jax.random.key(2) if sr else None))

            def two(x, sc, kr, kc, sr=sr):
                return (fq.fq_rows_scaled(x, sc, kr, sr=sr, sc_row=0),
                        fq.fq_cols_scaled(x, sc, kc, sr=sr, rht=True, sc_row=1))

            def fused(x, sc, kr, kc, sr=sr):
                return fq.fq_rows_cols_scaled(x, sc, sc, kr, kc, sr_rows=sr, sr_cols=sr,
                                              rht=True, sc_row_rows=0, sc_row_cols=1)

            t2 = timed_bw(g, f"{name} two kernels", two, args, 8 * x.size, copy_gbps)
            t1 = timed_bw(g, f"{name} fused", fused, args, 6 * x.size, copy_gbps)
            verify(g, f"{name} fused == two kernels", lambda two=two, fused=fused, args=args: {
                "exact": lab.same_bits(jax.jit(fused)(*args), jax.jit(two)(*args))})
            if t1 and t2:
                rec(g, f"{name} fused vs two kernels", us_saved=t2 - t1, speedup=t2 / t1)


@mode("gemm", "the XLA path: fp4jax.dot nvfp4 forward and fwd+bwd and "
      "jax.nn.scaled_dot_general nvfp4 vs bf16, 8192^3, 4096^3, 16384x4096x14336")
def bench_gemm(copy_gbps):
    key = jax.random.key(7)
    recipe = fp4jax.recipes.nvfp4()
    for (m, k, n) in ((8192, 8192, 8192), (4096, 4096, 4096), (16384, 4096, 14336)):
        g = f"gemm {m}x{k}x{n}"
        x, w = rand((m, k), 2), rand((k, n), 3, scale=0.02)
        flops = 2 * m * k * n
        t_bf = timed(g, "bf16 jnp.dot", jnp.dot, x, w)
        with lab.kernel_env("off"):
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
            rec(g, "jax.nn.scaled_dot_general nvfp4 fwd", error=lab.error_text(e, 300))
        for name, t in (("bf16 jnp.dot", t_bf), ("fp4jax.dot nvfp4 fwd (XLA path)", t_fp),
                        ("jax.nn.scaled_dot_general nvfp4 fwd", t_sd)):
            if t and t_bf:
                rec(g, name + " [rate]", tflops=flops / t / 1e6, ratio_to_bf16=t / t_bf)
        if (m, k, n) != (16384, 4096, 14336):
            ct = rand((m, n), 4)
            t1 = timed(g, "bf16 fwd+bwd", jax.value_and_grad(_bf16_loss, argnums=(0, 1)),
                       x, w, ct)
            with lab.kernel_env("off"):
                t2 = timed(g, "fp4jax nvfp4 recipe fwd+bwd (XLA path)", jax.value_and_grad(
                    lab.dot_loss(recipe, key), argnums=(0, 1)), x, w, ct)
            if t1 and t2:
                rec(g, "recipe fwd+bwd ratio to bf16", ratio_to_bf16=t2 / t1)


def _bf16_loss(x, w, ct):
    return (jnp.dot(x, w).astype(jnp.float32) * ct.astype(jnp.float32)).sum()


def bench_dot_kernels(iterations=10, shapes=((8192, 8192, 8192), (4096, 4096, 4096))):
    """fp4jax.dot (nvfp4 recipe, bf16 inputs) fwd and fwd+bwd with the kernels (Pallas GEMM,
    the default), with the kernels and XLA's GEMMs, and on the XLA path, against bf16; the
    outputs of the three settings compared bit for bit."""
    recipe = fp4jax.recipes.nvfp4()
    key = jax.random.key(7)
    for (m, k, n) in shapes:
        g = f"dot kernels {m}x{k}x{n}"
        # value_and_grad keeps the forward GEMM (grad alone lets XLA drop it); the random
        # cotangent ct is an argument, so XLA cannot constant-fold the backward
        x, w, ct = lab.dot_problem(m, k, n)
        t_bf = timed(g, "bf16 jnp.dot fwd", jnp.dot, x, w, iterations=iterations)
        t_bfb = timed(g, "bf16 fwd+bwd (value_and_grad)",
                      jax.value_and_grad(_bf16_loss, argnums=(0, 1)), x, w, ct,
                      iterations=iterations)
        res = {}
        # "on": kernels with the Pallas GEMM (gemm_alpha, the default); "on-xla-gemm": the
        # same operand kernels with XLA's GEMMs and a separate alpha pass
        for setting in ("off", "on", "on-xla-gemm"):
            gemm = "xla" if setting.endswith("xla-gemm") else "pallas"
            with lab.kernel_env(setting.split("-")[0], gemm):
                fwd = jax.jit(lambda x, w: fp4jax.dot(x, w, recipe=recipe, key=key))
                fb = jax.jit(jax.value_and_grad(lab.dot_loss(recipe, key), argnums=(0, 1)))
                uses_f = uses_b = None
                if not DRY:
                    uses_f = fwd.lower(x, w).as_text().count("mosaic_gpu")
                    uses_b = fb.lower(x, w, ct).as_text().count("mosaic_gpu")
                    v, (dx, dw) = fb(x, w, ct)  # traced here, under this setting
                    res[setting] = (fwd(x, w), v, dx, dw)
                tf = timed(g, f"fp4jax.dot nvfp4 fwd FP4JAX_KERNELS={setting}", fwd, x, w,
                           iterations=iterations, mosaic_gpu_mentions=uses_f)
                tb = timed(g, f"fp4jax.dot nvfp4 fwd+bwd FP4JAX_KERNELS={setting}", fb, x, w,
                           ct, iterations=iterations, mosaic_gpu_mentions=uses_b)
            if tf and t_bf:
                rec(g, f"fwd {setting} [ratio to bf16 fwd]", ratio_to_bf16=tf / t_bf, us=tf)
            if tb and t_bfb:
                rec(g, f"fwd+bwd {setting} [ratio to bf16 fwd+bwd]", ratio_to_bf16=tb / t_bfb,
                    us=tb)
        for other in ("on", "on-xla-gemm"):
            verify(g, f"outputs (y, loss, dx, dw) bit-identical {other} vs off",
                   lambda other=other, res=res: {"ok": lab.same_bits(res["off"], res[other])})


mode("dotkern", "fp4jax.dot nvfp4 fwd and fwd+bwd: kernels (Pallas GEMM), kernels with XLA's "
     "GEMMs, XLA path, vs bf16, 8192^3 and 4096^3")(
    lambda copy_gbps: bench_dot_kernels())
mode("dotkern1", "as dotkern, 8192^3 only (the README's headline row)")(
    lambda copy_gbps: bench_dot_kernels(shapes=((8192, 8192, 8192),)))
mode("dotkern3", "as dotkern at 8192^3, 4096^3 and the Llama-8B MLP 16384x4096x14336")(
    lambda copy_gbps: bench_dot_kernels(shapes=((8192, 8192, 8192), (4096, 4096, 4096),
                                                (16384, 4096, 14336))))
mode("dotsweep", "as dotkern at the sizes around FP4JAX_KERNELS=auto's threshold")(
    lambda copy_gbps: bench_dot_kernels(shapes=(
        (2048, 2048, 2048), (16384, 512, 2048), (16384, 2048, 512), (8192, 2048, 2048),
        (16384, 2048, 2048), (4096, 4096, 4096), (8192, 4096, 4096))))

LAYOUTS = {"fprop NN": (False, False), "dgrad NT": (False, True), "wgrad TN": (True, False)}


def _gemm_operands(m, k, n, ta, tb, seed=0):
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(ka, (k, m) if ta else (m, k), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (n, k) if tb else (k, n), jnp.float32).astype(jnp.bfloat16)
    return a, b, jnp.float32(3.7e-3)


def _xla_alpha(a, b, al, ta, tb):
    """XLA's alternative to gemm_alpha: f32 dot, times a runtime alpha, then bf16."""
    acc = jnp.dot(a.T if ta else a, b.T if tb else b, preferred_element_type=jnp.float32)
    return (acc * al).astype(jnp.bfloat16)


@mode("gemmalpha", "gemm_alpha (tile configs) per layout NN/NT/TN vs XLA's bf16 dot (no scale) "
      "and XLA's f32 dot times a runtime alpha, 8192^3")
def bench_gemm_alpha(copy_gbps, m=8192, k=8192, n=8192):
    configs = {"default 128x128x128 s2": ga.DEFAULT,
               "128x128x64 s4": ga.GemmConfig(tile_k=64, stages=4),
               "128x128x64 s4 snake16": ga.GemmConfig(tile_k=64, stages=4, snake=16)}
    for layout, (ta, tb) in LAYOUTS.items():
        g = f"gemm_alpha {layout} {m}x{k}x{n}"
        a, b, al = _gemm_operands(m, k, n, ta, tb)
        base = timed(g, "XLA bf16 dot (no scale)",
                     lambda a, b, ta=ta, tb=tb: jnp.dot(a.T if ta else a, b.T if tb else b), a, b)
        runs = [("XLA f32 dot * alpha -> bf16", functools.partial(_xla_alpha, ta=ta, tb=tb))]
        runs += [(f"gemm_alpha {cname}", functools.partial(
            ga.gemm_alpha, trans_a=ta, trans_b=tb, config=cfg)) for cname, cfg in configs.items()]
        for name, f in runs:
            t = timed(g, name, f, a, b, al)
            if t and base:
                rec(g, name + " [rate]", tflops=2 * m * k * n / t / 1e6,
                    ratio_to_xla_bf16=t / base)


@mode("gemmsweep", "gemm_alpha vs XLA's f32 dot times alpha per layout at the small training "
      "preset's GEMM sizes and two mid sizes (where the Pallas GEMM wins: MIN_MKN)")
def bench_gemm_sweep(copy_gbps, shapes=((16384, 512, 256), (16384, 512, 2048),
                                        (16384, 2048, 512), (8192, 2048, 2048),
                                        (4096, 4096, 4096))):
    for (m, k, n) in shapes:
        for layout, (ta, tb) in LAYOUTS.items():
            g = f"gemmsweep {m}x{k}x{n}"
            a, b, al = _gemm_operands(m, k, n, ta, tb)
            tx = timed(g, f"{layout} XLA f32 dot * alpha",
                       functools.partial(_xla_alpha, ta=ta, tb=tb), a, b, al)
            tg = timed(g, f"{layout} gemm_alpha", functools.partial(
                ga.gemm_alpha, trans_a=ta, trans_b=tb), a, b, al)
            if tx and tg:
                rec(g, f"{layout} [ratio gemm_alpha / XLA]", ratio=tg / tx)


def _w4a16_problem(m, k, n, block_2d=True):
    x = rand((m, k), 4)
    w = rand((k, n), 5, dtype=jnp.float32, scale=0.02)
    q = jax.jit(lambda w: fp4jax.quantize(w, fp4jax.NVFP4, axis=0, block_2d=block_2d))(w)
    return x, q, jax.jit(wk.prepare_weight)(q)


def _w4a16_rel_err(x, q, prepared, **cfg):
    y = wk.w4a16_matmul(x, *prepared, out_dtype=jnp.float32, **cfg)
    ref = jnp.dot(x.astype(jnp.float32), fp4jax.dequantize(q, jnp.float32),
                  precision=jax.lax.Precision.HIGHEST)
    rel = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    return {"rel_err": rel, "ok": rel < 1e-5}


@mode("decode", "W4A16 (w4a16_sm90, default configuration) at decode sizes M = 1, 16, 64, "
      "K = N = 8192, vs bf16 jnp.dot and XLA dot(x, dequantize(W))")
def bench_decode(copy_gbps):
    for m in (1, 16, 64):
        k = n = 8192
        g = f"decode M={m} K={k} N={n}"
        x, q, (wp, ws, dec) = _w4a16_problem(m, k, n)
        wb = fp4jax.dequantize(q, jnp.bfloat16)
        verify(g, "w4a16 kernel rel err vs x @ dequantize(W) (f32)",
               lambda x=x, q=q, p=(wp, ws, dec): _w4a16_rel_err(x, q, p))
        t_bf = timed(g, "bf16 jnp.dot", jnp.dot, x, wb, iterations=50)
        t_x = timed(g, "xla dot(x, dequantize(W)) (pre-quantized W)",
                    lambda x, q: jnp.dot(x, fp4jax.dequantize(q, jnp.bfloat16)), x, q,
                    iterations=50)
        t_k = timed(g, "pallas w4a16 kernel (w4a16_sm90)", wk.w4a16_matmul, x, wp, ws, dec,
                    iterations=50, config=str(wk.default_config(m, k, n)))
        for name, t, per_w in (("bf16 jnp.dot", t_bf, 2.0), ("xla dequant+dot", t_x, 2.0),
                               ("pallas w4a16 kernel", t_k, 0.5 + 2 / 16)):
            if t and t_bf:
                rec(g, name + " [rate]", speedup_vs_bf16=t_bf / t,
                    weight_gbps=k * n * per_w / t / 1e3)


@mode("decodesweep", "W4A16 configurations at M=16, K=N=8192: the default, its no-decode "
      "floor (timing only), tile_k x split_k x stages x compute warpgroups, k_wgs")
def bench_decode_sweep(copy_gbps, m=16, k=8192, n=8192):
    g = f"decodesweep M={m} K={k} N={n}"
    x, q, prepared = _w4a16_problem(m, k, n)
    t_bf = timed(g, "bf16 jnp.dot", jnp.dot, x, fp4jax.dequantize(q, jnp.bfloat16),
                 iterations=50)
    cfgs = [dict(), dict(_mode="nodecode")]
    cfgs += [dict(tile_k=t, split_k=s, stages=st, compute_wgs=cw) for cw in (1, 2)
             for t in (256, 512) for s in (1, 2, 4) for st in (2, 3)]
    cfgs += [dict(k_wgs=kw, tile_k=512, split_k=1) for kw in (2, 3)]
    best = (None, None)
    for cfg in cfgs:
        t = timed(g, f"w4a16 {cfg or 'default'}", functools.partial(wk.w4a16_matmul, **cfg),
                  x, *prepared, iterations=50)
        if t and cfg.get("_mode") is None and (best[0] is None or t < best[0]):
            best = (t, cfg)
    if best[0] and t_bf:
        rec(g, "best", us=best[0], cfg=str(best[1]), speedup_vs_bf16=t_bf / best[0])
        verify(g, "best config rel err vs x @ dequantize(W) (f32)",
               lambda: _w4a16_rel_err(x, q, prepared, **best[1]))


def bench_w4a4(shapes=((8192, 8192, 8192), (4096, 4096, 4096), (16384, 4096, 14336)),
               fmt="nvfp4", variants=True):
    """W4A4 (packed A and B, ``gemm/w4a4_sm90``) against bf16 jnp.dot in the same run: XLA
    dequantize + f32 dot (the dispatcher's XLA path), XLA decode + bf16 dot, the two-pass
    kernel path (decode kernel + gemm_alpha) and the decode kernel alone; ``variants``: the
    decode kernel's tile_k 128 unswizzled at the first shape."""
    f4 = {"nvfp4": fp4jax.NVFP4, "mxfp4": fp4jax.MXFP4}[fmt]
    for si, (m, k, n) in enumerate(shapes):
        g = f"w4a4 {fmt} {m}x{k}x{n}"
        a, b = rand((m, k), 11, jnp.float32), rand((k, n), 12, jnp.float32, scale=0.02)
        qa = jax.jit(lambda a: fp4jax.quantize(a, f4, axis=1))(a)
        qb = jax.jit(lambda b: fp4jax.quantize(b, f4, axis=0))(b)
        pa, pb = jax.jit(w4.prepare_a)(qa), jax.jit(w4.prepare_b)(qb)
        sf = dict(scale_a=w4.scale_format(qa.fmt), scale_b=w4.scale_format(qb.fmt))
        a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        flops = 2 * m * k * n
        t_bf = timed(g, "bf16 jnp.dot", jnp.dot, a16, b16)
        timed(g, "xla dequantize + f32 dot (HIGHEST): dispatch's XLA path", lambda qa, qb: jnp.dot(
            fp4jax.dequantize(qa, jnp.float32), fp4jax.dequantize(qb, jnp.float32),
            precision=jax.lax.Precision.HIGHEST).astype(jnp.bfloat16), qa, qb, iterations=5)
        cands = [("xla decode + bf16 dot", functools.partial(w4.w4a4_matmul_xla, **sf)),
                 ("two-pass: decode kernel + bf16 GEMM",
                  functools.partial(w4.w4a4_matmul_two_pass, **sf))]
        if si == 0 and variants:
            cands.append(("two-pass, decode tile_k=128 out_swizzle=False", functools.partial(
                w4.w4a4_matmul_two_pass, tile_k=128, out_swizzle=False, **sf)))
        for name, f in cands:
            def exactness(f=f, pa=pa, pb=pb):
                ref = jax.jit(w4.reference_w4a4)(*pa, *pb)
                y = jax.jit(functools.partial(f, out_dtype=jnp.float32))(*pa, *pb)
                y16 = jax.jit(functools.partial(f, out_dtype=jnp.bfloat16))(*pa, *pb)
                rel = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
                # the bf16 output vs the f32 reference rounded once to bf16
                d16 = float(jnp.mean((y16 != ref.astype(jnp.bfloat16)).astype(jnp.float32)))
                return dict(rel_err_f32_out=rel, exact_ok=rel < 1e-5,
                            bf16_out_frac_differ_from_rounded_ref=d16)
            verify(g, name + " [exactness]", exactness)
            t = timed(g, name, functools.partial(f, out_dtype=jnp.bfloat16), *pa, *pb)
            if t and t_bf:
                rec(g, name + " [rate]", tflops=flops / t / 1e6, ratio_to_bf16_time=t / t_bf,
                    frac_of_bf16_tflops=t_bf / t)
        timed(g, "decode kernel alone (operand A)", functools.partial(
            w4.decode_operand, scale_fmt=sf["scale_a"]), pa[0], pa[1])


mode("w4a4", "W4A4 from packed NVFP4: XLA paths, two-pass kernel path (+ a decode tiling "
     "variant), decode kernel alone, vs bf16; 8192^3, 4096^3, 16384x4096x14336")(
    lambda copy_gbps: bench_w4a4())
mode("w4a4two", "as w4a4 without the variant, 8192^3 and 16384x4096x14336")(
    lambda copy_gbps: bench_w4a4(shapes=((8192, 8192, 8192), (16384, 4096, 14336)),
                                 variants=False))
mode("w4a4mx", "as w4a4two with MXFP4 operands (UE8M0 scales), 8192^3")(
    lambda copy_gbps: bench_w4a4(shapes=((8192, 8192, 8192),), fmt="mxfp4", variants=False))


# ---------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------

DEFAULT_MODES = ("quantize", "decode", "gemm", "dotkern")


def main(argv: list[str] | None = None) -> int:
    global RES, DRY
    argv = sys.argv[1:] if argv is None else argv
    ap = lab.arg_parser(__doc__, "bench_kernels.json", "mode",
                        f"modes to run, in order (default: {' '.join(DEFAULT_MODES)})")
    ap.epilog = "modes: copy (always first), " + ", ".join(MODES)
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: lower every timed call for CUDA instead of timing it")
    args = ap.parse_args(argv)
    if args.list:
        print(f"{'copy':12} bf16 copy bandwidth, 8192^2 (always run first: the baseline)")
        for name, (_, doc) in MODES.items():
            print(f"{name:12} {doc}")
        return 0
    modes = [m for m in (args.names or DEFAULT_MODES) if m != "copy"]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}: use {', '.join(MODES)}")
    DRY = args.dry_run
    RES = lab.Results(args.out or lab.default_out("bench_kernels.json"),
                      lab.run_info(__file__, argv, args.commit) | {"modes": ["copy", *modes],
                                                                   "dry_run": DRY})
    copy_gbps = bench_copy()
    for m in modes:
        MODES[m][0](copy_gbps)
    errors = [r for r in RES.data.get("results", []) if "error" in r]
    RES.finish(errors=len(errors))
    print("\n==== summary ====")
    for r in RES.data.get("results", []):
        if "error" in r:
            print(f"{r['group']:<28} {r['name'][:60]:<60} ERROR {r['error'][:120]}")
        else:
            vals = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                    if k not in ("group", "name", "method", "min_us")}
            print(f"{r['group']:<28} {r['name'][:60]:<60} {vals}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
