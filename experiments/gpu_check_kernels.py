"""GPU exactness checks (and quick timings) of the Pallas kernels against fp4jax's XLA path.

Run on the device machine:  PYTHONPATH=$PWD python3 experiments/gpu_check_kernels.py
Writes $OUT/gpu_check_kernels.json (or ./gpu_check_kernels.json) and prints a summary.
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
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp4jax  # noqa: E402
from experiments.kernel_timing import time_fn  # noqa: E402
from pallas_kernels import reference as npref  # noqa: E402

RESULTS: dict = {
    "device": str(jax.devices()[0].device_kind),
    "jax": jax.__version__,
    "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    "checks": [],
}


def record(name, **kw):
    kw["name"] = name
    RESULTS["checks"].append(kw)
    print(json.dumps(kw), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_check_kernels.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)  # after every check: a stopped run keeps its rows


def rand(shape, dtype, seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, shape, jnp.float32)
    # per-row magnitudes over many binades, so scales hit E4M3 normals and subnormals
    x = x * jnp.exp2(jax.random.randint(k2, shape[:-1] + (1,), -12, 12).astype(jnp.float32))
    return x.astype(dtype)


def rand_blocks(shape, seed):
    """Random per-block magnitudes (each 1x16 block its own binade), so the block scales
    cover the E4M3 range and 1/(s*dec) takes thousands of distinct values."""
    rng = np.random.default_rng(seed)
    r, c = shape
    x = rng.standard_normal((r, c)).astype(np.float32)
    x *= np.exp2(rng.uniform(-14, 8, (r, c // 16, 1))).repeat(16, -1).reshape(r, c)
    return jnp.asarray(x * np.float32(rng.uniform(1, 2)), jnp.bfloat16)


def check_recip():
    """XLA-on-GPU 1/p vs IEEE, and the kernel's recip_rn (run by XLA here) vs IEEE, for
    p = s * dec over all E4M3 scales s and random tensor decode scales dec."""
    import ml_dtypes

    from pallas_kernels import quantize_nvfp4_sm90 as qk

    rng = np.random.default_rng(1)
    sv = np.arange(1, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    dec = np.exp2(rng.uniform(-30, 30, 8000)).astype(np.float32)
    p = (sv[:, None] * dec[None, :]).ravel()
    want = (1.0 / p.astype(np.float64)).astype(np.float32)
    pj = jnp.asarray(p)
    hw = np.asarray(jax.jit(lambda v: 1.0 / v)(pj))
    res, ok = jax.jit(qk.recip_rn)(pj)
    res, ok = np.asarray(res), np.asarray(ok)
    bad = int((res != want).sum())
    record("recip_rn vs IEEE 1/(s*dec) (XLA on GPU)", n=int(p.size),
           xla_div_mismatches=int((hw != want).sum()), recip_rn_mismatches=bad,
           all_ok_flag=bool(ok.all()), exact=bad == 0 and bool(ok.all()))


def check_quantize_hard(shapes):
    """Kernel vs fp4jax.quantize and vs the NumPy (IEEE) reference on whole arrays."""
    from pallas_kernels import quantize_nvfp4_sm90 as qk

    for shape in shapes:
        name = f"quantize random block scales {shape} vs fp4jax and NumPy (all blocks)"
        try:
            x = rand_blocks(shape, seed=shape[0] + shape[1])
            packed, sbits, dec = jax.jit(qk.quantize_nvfp4_1x16)(x)
            pk_hw, sb_hw, _ = jax.jit(functools.partial(qk.quantize_nvfp4_1x16,
                                                        exact_recip=False))(x)
            q = jax.jit(lambda x: fp4jax.quantize(x, fp4jax.NVFP4))(x)
            packed, sbits, pk_hw = map(np.asarray, (packed, sbits, pk_hw))
            ref_packed = np.asarray(fp4jax.pack_e2m1(q.data))
            ref_sbits = np.asarray(jax.lax.bitcast_convert_type(q.scale, jnp.uint8))
            x32 = np.asarray(x.astype(jnp.float32))
            c_np, s_np, d_np = npref.quantize_nvfp4_1x16(x32)
            p_np = npref.pack_codes(c_np)
            nb = x32.size // 16

            def bad_blocks(a, b, nb=nb):
                return int((a.reshape(nb, 8) != b.reshape(nb, 8)).any(-1).sum())

            rec = dict(blocks=nb, distinct_scales=int(len(np.unique(sbits))),
                       bad_blocks_vs_fp4jax=bad_blocks(packed, ref_packed),
                       bad_scales_vs_fp4jax=int((sbits != ref_sbits).sum()),
                       bad_blocks_vs_numpy=bad_blocks(packed, p_np),
                       bad_scales_vs_numpy=int((sbits != s_np).sum()),
                       fp4jax_bad_blocks_vs_numpy=bad_blocks(ref_packed, p_np),
                       hw_recip_kernel_bad_blocks_vs_numpy=bad_blocks(pk_hw, p_np),
                       dec_equal=bool(np.float32(dec) == np.float32(q.global_scale)
                                      == np.float32(d_np)))
            rec["exact"] = (rec["bad_blocks_vs_fp4jax"] == 0 and rec["bad_scales_vs_fp4jax"] == 0
                            and rec["bad_blocks_vs_numpy"] == 0
                            and rec["bad_scales_vs_numpy"] == 0 and rec["dec_equal"])
            record(name, **rec)
        except Exception as e:  # noqa: BLE001
            record(name, error=f"{type(e).__name__}: {str(e)[:2000]}",
                   tb=traceback.format_exc()[-3000:])


def check_table_recip():
    """recip_table + table_recip (run by XLA on the GPU, as the kernel's table is built)
    vs IEEE float32 (NumPy) 1/(s*dec) for all 127 E4M3 scales x 4000 decode scales
    log-uniform over the whole float32 range and both ends of the safe range."""
    import ml_dtypes

    from pallas_kernels import quantize_nvfp4_sm90 as qk

    rng = np.random.default_rng(2)
    dec = np.concatenate([np.exp2(rng.uniform(-126, 127.9, 3000)),
                          np.exp2(rng.uniform(-118, -116, 500)),
                          np.exp2(rng.uniform(116, 118, 500))]).astype(np.float32)
    s = np.arange(127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    with np.errstate(all="ignore"):
        want = np.minimum(np.float32(1) / (s[:, None] * dec[None, :]),
                          np.finfo(np.float32).max).astype(np.float32)
    want = np.where(s[:, None] == 0, np.float32(0), want)

    def one(d):
        safe, table = qk.recip_table(d)
        return safe, qk.table_recip(jnp.arange(127, dtype=jnp.int32), list(table))

    safe, got = jax.jit(jax.vmap(one))(jnp.asarray(dec))
    safe, got = np.asarray(safe), np.asarray(got).T
    exact = (got.view(np.int32) == want.view(np.int32)).all(axis=0)
    bad = int((safe & ~exact).sum())
    record("table reciprocal vs IEEE 1/(s*dec) (XLA on GPU)", n_dec=int(dec.size),
           n_safe=int(safe.sum()), safe_dec_inexact=bad,
           unsafe_dec_inexact=int((~safe & ~exact).sum()), exact=bad == 0)


def _count_bad(pk, sb, d, q):
    """Differing packed blocks-of-8-bytes rows and scale bytes vs a fp4jax QuantizedArray."""
    ref_pk = fp4jax.pack_e2m1(q.data)
    ref_sb = jax.lax.bitcast_convert_type(q.scale, jnp.uint8)
    return dict(bad_bytes=int(jnp.sum(pk != ref_pk)), bad_scales=int(jnp.sum(sb != ref_sb)),
                dec_equal=bool(d == q.global_scale))


def check_quantize3(shapes):
    """The table-reciprocal 1x16 kernel (auto and table-only) and the 16x16 kernel vs
    fp4jax.quantize (XLA on this GPU), bit for bit, on whole arrays; one shape also vs
    the NumPy references; a tiny tensor (dec outside the table's range) exercises the
    recip_rn fallback of "auto"."""
    from pallas_kernels import quantize_nvfp4_sm90 as qk

    for shape, kind in shapes:
        try:
            if kind == "blocks":
                x = rand_blocks(shape, seed=shape[0] + shape[1])
            else:
                x = rand(shape, jnp.bfloat16, seed=shape[0] % 1000)
            if kind == "tiny":  # amax <= 2^-110: dec <= 2^-121, outside [2^-117, 2^117)
                amax = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
                x = x * jnp.bfloat16(2.0 ** (-110 - int(np.ceil(np.log2(amax)))))
            enc, dec = jax.jit(qk.global_scales)(x)
            safe = bool(qk.recip_table(dec)[0])
            q1 = jax.jit(lambda x: fp4jax.quantize(x, fp4jax.NVFP4))(x)
            q2 = jax.jit(lambda x: fp4jax.quantize(x, fp4jax.NVFP4, block_2d=True))(x)
            variants = [("1x16 auto", qk.quantize_nvfp4_1x16, q1),
                        ("2d auto", qk.quantize_nvfp4_2d, q2)]
            if kind != "tiny":
                variants.insert(1, ("1x16 table", functools.partial(
                    qk.quantize_nvfp4_1x16, recip="table"), q1))
            else:
                variants.append(("2d rn", functools.partial(qk.quantize_nvfp4_2d, recip="rn"),
                                 q2))
            for vname, f, q in variants:
                name = f"quantize3 {vname} {shape} {kind} vs fp4jax"
                if "2d" in vname and not qk.supported_2d(shape, jnp.bfloat16):
                    record(name, ok=True, skipped="unsupported by the 16x16 kernel")
                    continue
                pk, sb, d = jax.jit(f)(x)
                rec = dict(table_safe=safe, dec=float(dec), **_count_bad(pk, sb, d, q))
                if kind == "blocks":
                    rec["distinct_scales"] = int(len(np.unique(np.asarray(sb))))
                    x32 = np.asarray(x.astype(jnp.float32))
                    ref = (npref.quantize_nvfp4_16x16 if "2d" in vname
                           else npref.quantize_nvfp4_1x16)(x32)
                    rec["bad_bytes_vs_numpy"] = int((np.asarray(pk) != npref.pack_codes(ref[0]))
                                                    .sum())
                    rec["bad_scales_vs_numpy"] = int((np.asarray(sb) != ref[1]).sum())
                rec["exact"] = (rec["bad_bytes"] == 0 and rec["bad_scales"] == 0
                                and rec["dec_equal"] and rec.get("bad_bytes_vs_numpy", 0) == 0
                                and rec.get("bad_scales_vs_numpy", 0) == 0)
                record(name, **rec)
        except Exception as e:  # noqa: BLE001
            record(f"quantize3 {shape} {kind}", error=f"{type(e).__name__}: {str(e)[:2000]}",
                   tb=traceback.format_exc()[-3000:])


def check_quantize(shapes, dtypes, timing=True):
    from pallas_kernels import quantize_nvfp4_sm90 as qk

    for shape in shapes:
        for dt in dtypes:
            name = f"quantize_nvfp4_1x16 {shape} {jnp.dtype(dt).name}"
            if not qk.supported(shape, dt):
                record(name, ok=True, skipped="unsupported by the kernel: XLA path")
                continue
            try:
                x = rand(shape, dt, seed=hash((shape, str(dt))) % 1000)
                packed, sbits, dec = jax.jit(qk.quantize_nvfp4_1x16)(x)
                q = jax.jit(lambda x: fp4jax.quantize(x, fp4jax.NVFP4))(x)
                ref_packed = fp4jax.pack_e2m1(q.data)
                ref_sbits = jax.lax.bitcast_convert_type(q.scale, jnp.uint8)
                p_eq = float(jnp.mean((packed == ref_packed).astype(jnp.float32)))
                s_eq = float(jnp.mean((sbits == ref_sbits).astype(jnp.float32)))
                d_eq = bool(dec == q.global_scale)
                # independent NumPy reference on a slice (CPU cost)
                xs = np.asarray(x[:64].astype(jnp.float32))
                c_np, s_np, _ = npref.quantize_nvfp4_1x16(xs, *map(np.float32, qk.global_scales(x)))
                np_eq = bool(
                    (np.asarray(packed[:64]) == npref.pack_codes(c_np)).all()
                    and (np.asarray(sbits[:64]) == s_np).all()
                )
                rec = dict(packed_equal_frac=p_eq, scale_equal_frac=s_eq, dec_equal=d_eq,
                           numpy_slice_equal=np_eq, exact=p_eq == 1.0 and s_eq == 1.0 and d_eq)
                if timing and shape[0] * shape[1] >= 2**24:
                    t_k = time_fn(jax.jit(qk.quantize_nvfp4_1x16), x)
                    t_x = time_fn(jax.jit(lambda x: fp4jax.quantize(x, fp4jax.NVFP4)), x)
                    rec.update(kernel_us=t_k["median_us"], xla_quantize_us=t_x["median_us"])
                record(name, **rec)
            except Exception as e:  # noqa: BLE001
                record(name, error=f"{type(e).__name__}: {str(e)[:2000]}",
                       tb=traceback.format_exc()[-3000:])


def main():
    which = sys.argv[1:] or ["quantize", "matmul"]
    if "quantize" in which:
        x = jnp.ones((8192, 8192), jnp.bfloat16) * 1.5
        t = time_fn(jax.jit(lambda x: x * 2), x)
        record("copy_bf16_8192x8192", ok=True, us=t["median_us"],
               gbps=2 * x.size * 2 / t["median_us"] / 1e3, method=t["method"])
        check_quantize([(256, 1024), (1000, 4096), (1003, 512), (24, 8192), (16, 256),
                        (4096, 14336), (8192, 8192), (16384, 4096)],
                       [jnp.bfloat16])
    if "quantize2" in which:  # the correctly rounded reciprocal (short run)
        check_recip()
        check_quantize_hard([(1024, 4096), (256, 16384)])
        check_quantize([(256, 1024), (1000, 4096), (1003, 512), (24, 8192), (16, 256),
                        (4096, 14336), (8192, 8192)], [jnp.bfloat16], timing=False)
    if "quantize3" in which:  # table reciprocal + 16x16 kernel (short run)
        check_table_recip()
        check_quantize3([((1024, 4096), "blocks"),
                         ((4096, 14336), "random"), ((8192, 8192), "random"),
                         ((1024, 4096), "tiny"), ((1000, 4096), "random")])
    if "matmul" in which:
        try:
            from experiments.gpu_check_matmul import check_matmul

            check_matmul(record)
            if "sweep" in which:
                from experiments.gpu_check_matmul import sweep_w4a16

                sweep_w4a16(record)
        except ImportError as e:
            record("matmul", error=f"not available: {e}")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "gpu_check_kernels.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    ok = [c for c in RESULTS["checks"] if c.get("exact") or c.get("ok")]
    print(f"SUMMARY: {len(ok)}/{len(RESULTS['checks'])} checks passed")
    for c in RESULTS["checks"]:
        flag = "OK " if (c.get("exact") or c.get("ok")) else "BAD"
        extra = {k: v for k, v in c.items() if k not in ("name", "tb")}
        print(flag, c["name"], str(extra)[:300])


if __name__ == "__main__":
    main()
