"""Exactness and speed of fp4jax's Blackwell (sm_100+) path, for someone with a B200/GB200/
GB300: run it, send the JSON back. Nothing here has run on Blackwell hardware yet.

    PYTHONPATH=$PWD python3 experiments/blackwell_check.py [CHECK ...] [--list]
        [--dry-run] [--out PATH] [--commit SHA] [--seed N]

Checks (``--list``; default ``all`` = every check but ``tcgen05``, which is opt-in):

* ``swizzle``: ``blockscale_sm100.swizzle_scales_128x4`` on the device against the
  documented per-element offsets (cuBLAS "1D Block Scaling Factors Layout").
* ``path``: which GEMM XLA compiled ``jax.nn.scaled_matmul`` into: a cuDNN fusion (native
  FP4 tensor cores) or XLA's dequantize-then-dot fallback (correct, not fast). Records the
  fusion names found in the optimized HLO.
* ``gemm``: the three GEMMs of ``fp4jax.dot`` (fprop, dgrad, wgrad layouts) on
  ``jax.nn.scaled_matmul`` against the XLA emulation (``fp4jax.dot``'s ``_gemm``: f32 einsum
  of ``data * scale`` times alpha) on the same quantized operands: 1x16 and 16x16 weights,
  partial blocks and padded K, NaN/Inf blocks, a 40-binade input, a tiny tensor. Reports
  mismatching elements (NaN = NaN), NaN-position agreement and the max error relative to
  ``max|ref|`` (pass: every element within ``half ulp(out) |ref| + 1e-5 max|ref|``: only the
  float32 accumulation order may differ).
* ``dot``: ``fp4jax.dot`` forward + backward (nvfp4 and fp4_all_the_way recipes, random
  cotangent) with ``FP4JAX_KERNELS=auto`` (the native path on sm_100+) against
  ``FP4JAX_KERNELS=off`` (XLA emulation): y, loss, dx, dw under the same criterion.
* ``tcgen05``: the Pallas kernel (``gemm/tcgen05_sm100``, never run anywhere so far) against
  ``jax.nn.scaled_matmul``'s GEMM, bf16 outputs. If this passes on hardware the kernel may
  become a default candidate; if it fails, ``FP4JAX_KERNELS=tcgen05`` must stay off.
* ``bench``: device time (CUPTI medians) of ``fp4jax.dot`` nvfp4 forward and forward +
  backward at 4096^3 and 8192^3 on the native path vs the XLA emulation vs bf16
  ``jnp.dot``, and of the bare GEMM (``scaled_matmul`` + alpha vs the tcgen05 kernel vs
  bf16).

Writes ``$OUT/blackwell_check.json`` (or ``--out``): device, JAX version, git commit, the
command, then one row per case and a summary; exit status 1 if any case failed or raised, 2
when the default device is not an sm_100+ GPU (``--dry-run``: small shapes on any device
with the backend forced by ``FP4JAX_KERNELS=native``, the kernel only lowered; a check of
this script, not of the hardware).

What would change if it disagreed: see the README section "Blackwell". In short: a ``gemm``
or ``dot`` failure means the native path does not compute fp4jax's numerics on that device
(most likely the scale layout or the scales' sign/NaN handling): ``dispatch.native_mode``'s
``auto`` must then stay off on sm_100 (users keep the XLA emulation) until fixed; a
``path`` result without a cuDNN fusion means correct but emulated GEMMs (no speed-up).
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import lab  # before fp4jax: puts the repository root on sys.path
import numpy as np

import fp4jax
from fp4jax.backends import XLA, Operand
from pallas_kernels import dispatch
from pallas_kernels.gemm import blockscale_sm100 as bs

GEMM_TOL = 1e-5
CHECKS, register = lab.registry()
LAYOUTS = {"fprop": "bmk,bkn->bmn", "dgrad": "bmn,bkn->bmk", "wgrad": "bmk,bmn->bkn"}


def _close(got, want) -> dict:
    """Mismatch count (NaN = NaN), NaN agreement, max error relative to max|ref| and the
    pass criterion of the module docstring."""
    g = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    w = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    nan_ok = bool((np.isnan(g) == np.isnan(w)).all())
    fin = np.isfinite(w) & np.isfinite(g)
    scale = float(np.abs(w[fin]).max()) if fin.any() else 0.0
    err = np.abs(g - w)[fin]
    eps = float(jnp.finfo(jnp.asarray(got).dtype).eps) / 2
    bound = eps * np.abs(w[fin]) + GEMM_TOL * scale
    inf_ok = bool((np.isinf(g) == np.isinf(w)).all() and (g[np.isinf(w)] == w[np.isinf(w)]).all())
    return {"mismatches": lab.mismatches(got, want), "nan_positions_equal": nan_ok,
            "inf_equal": inf_ok, "max_rel_err": float(err.max() / scale) if scale else 0.0,
            "status": "pass" if nan_ok and inf_ok and bool((err <= bound).all()) else "fail"}


def _row(res, section, name, fn, **kw) -> None:
    """Runs ``fn(**kw)`` (a dict of results) now and records it as one row."""
    t0 = time.perf_counter()
    try:
        row = {"case": name} | fn(**kw)
    except Exception as e:  # noqa: BLE001
        row = {"case": name, "status": "error", "error": lab.error_text(e)}
    row["seconds"] = round(time.perf_counter() - t0, 2)
    res.add(section, row)


def _operands(m, k, n, kind, block_2d, seed):
    """NVFP4 operands of the three GEMMs from fresh inputs: x (1, M, K), w (1, K, N), dy
    (1, M, N), quantized as fp4jax.dot quantizes them (no RHT here: the GEMM is the point)."""
    x = lab.make_input((m, k), kind, seed)[None]
    w = (0.02 * lab.make_input((k, n), "normal", seed + 1))[None]
    dy = lab.make_input((m, n), "normal", seed + 2)[None]
    q = fp4jax.quantize
    w2d = q(w, fp4jax.NVFP4, block_2d=True) if block_2d else None
    return {
        "fprop": (q(x, axis=-1), w2d if block_2d else q(w, axis=-2)),
        "dgrad": (q(dy, axis=-1), w2d if block_2d else q(w, axis=-1)),
        "wgrad": (q(x, axis=-2), q(dy, axis=-2, rounding="stochastic",
                                    key=jax.random.key(seed))),
    }


@register("swizzle", "the 128x4 scale layout on the device vs the documented offsets")
def check_swizzle(ctx):
    for shape in ((128, 4), (300, 37), (1024, 256)):
        def run(shape=shape):
            s = np.arange(np.prod(shape), dtype=np.int32).reshape(shape) % 251
            got = np.asarray(bs.swizzle_scales_128x4(jnp.asarray(s))).reshape(-1)
            r_, c_ = shape
            nct = -(-c_ // 4)
            want = np.zeros_like(got)
            rr, cc = np.meshgrid(np.arange(r_), np.arange(c_), indexing="ij")
            off = (((rr // 128) * nct + cc // 4) * 512 + 16 * (rr % 32)
                   + 4 * ((rr % 128) // 32) + cc % 4)
            want[off.reshape(-1)] = s.reshape(-1)
            ok = np.array_equal(got, want)
            return {"shape": shape, "status": "pass" if ok else "fail"}
        _row(ctx["res"], "checks", f"swizzle {shape}", run)


@register("path", "which GEMM XLA compiles jax.nn.scaled_matmul into (cuDNN or fallback)")
def check_path(ctx):
    def run():
        m = k = n = 256 if ctx["dry"] else 4096
        a = jnp.zeros((1, m, k), jnp.float4_e2m1fn)
        b = jnp.zeros((1, n, k), jnp.float4_e2m1fn)
        sa = jnp.ones((1, m, k // 16), jnp.float8_e4m3fn)
        sb = jnp.ones((1, n, k // 16), jnp.float8_e4m3fn)
        hlo = jax.jit(bs.scaled_matmul).lower(a, b, sa, sb).compile().as_text()
        cudnn = "cudnn" in hlo.lower()
        return {"cudnn_fusion": cudnn, "native_tensor_cores": cudnn,
                "hlo_lines_with_cudnn": [ln.strip()[:200] for ln in hlo.splitlines()
                                         if "cudnn" in ln.lower()][:5],
                "status": "pass" if cudnn or ctx["dry"] else "fail"}
    _row(ctx["res"], "checks", "scaled_matmul compiled path", run)


def _gemm_case(qa, qb, sub, shape, kind, block_2d) -> dict:
    got = dispatch.native_gemm(sub, qa, qb, out_dtype=jnp.float32, mode="scaled_matmul")
    want = XLA.gemm(sub, Operand.from_codes(qa), Operand.from_codes(qb), out_dtype=jnp.float32)
    return {"shape": shape, "input": kind, "block_2d": block_2d, **_close(got, want)}


@register("gemm", "the three GEMM layouts on scaled_matmul vs the XLA emulation")
def check_gemm(ctx):
    shapes = [(40, 80, 48)] if ctx["dry"] else [(40, 80, 48), (1000, 4096, 4096),
                                                (8192, 8192, 8192), (4096, 3072, 14336)]
    kinds = ("normal", "wild") if ctx["dry"] else ("normal", "wild", "wide40", "tiny",
                                                    "blocks")
    for (m, k, n) in shapes:
        for kind in kinds:
            for block_2d in (True, False):
                ops = _operands(m, k, n, kind, block_2d, ctx["seed"])
                for gemm, sub in LAYOUTS.items():
                    _row(ctx["res"], "checks", f"gemm {gemm} {m}x{k}x{n} {kind} "
                         f"{'2d' if block_2d else '1d'}", _gemm_case, qa=ops[gemm][0],
                         qb=ops[gemm][1], sub=sub, shape=(m, k, n), kind=kind,
                         block_2d=block_2d)


@register("dot", "fp4jax.dot fwd+bwd on the native path vs FP4JAX_KERNELS=off")
def check_dot(ctx):
    shapes = [(48, 64, 32)] if ctx["dry"] else [(1000, 4096, 4096), (8192, 8192, 8192)]
    native_env = "native" if ctx["dry"] else "auto"
    for m, k, n in shapes:
        for spec in ("nvfp4", "fp4_all_the_way"):
            def run(m=m, k=k, n=n, spec=spec):
                x, w, ct = lab.dot_problem(m, k, n, ctx["seed"])
                f = jax.jit(jax.value_and_grad(
                    lab.dot_loss(fp4jax.recipes.parse(spec), with_y=True),
                    argnums=(0, 1), has_aux=True))
                outs = {}
                for env in (native_env, "off"):
                    with lab.kernel_env(env):
                        mode = dispatch.native_mode()
                        (v, y), (dx, dw) = f(x, w, ct)
                        outs[env] = (mode, {"y": y, "loss": v, "dx": dx, "dw": dw})
                got, want = outs[native_env][1], outs["off"][1]
                per = {name: _close(got[name], want[name]) for name in got}
                ok = all(p["status"] == "pass" for p in per.values())
                return {"shape": (m, k, n), "recipe": spec, "mode": outs[native_env][0],
                        "outputs": per,
                        "status": "pass" if ok and outs[native_env][0] != "off" else "fail"}
            _row(ctx["res"], "checks", f"dot {spec} {m}x{k}x{n}", run)


@register("tcgen05", "the Pallas tcgen05 kernel vs scaled_matmul's GEMM (bf16; opt-in)")
def check_tcgen05(ctx):
    from pallas_kernels.gemm import tcgen05_sm100 as tc

    shapes = [(256, 512, 128)] if ctx["dry"] else [(128, 256, 128), (1024, 4096, 2048),
                                                  (8192, 8192, 8192)]
    for m, k, n in shapes:
        for kind in ("normal", "wild", "blocks"):
            def run(m=m, k=k, n=n, kind=kind):
                ops = _operands(m, k, n, kind, True, ctx["seed"])
                out = {}
                for gemm, sub in LAYOUTS.items():
                    qa, qb = ops[gemm]
                    want = bs.gemm(sub, qa, qb, jnp.bfloat16)
                    if ctx["dry"]:  # no Blackwell GPU: lower only
                        n_mgpu = lab.lower_for_cuda(lambda a, b, s=sub: tc.gemm(s, a, b),
                                                    qa, qb)
                        out[gemm] = {"lowered_mosaic_gpu": n_mgpu, "status": "skip"}
                        continue
                    got = tc.gemm(sub, qa, qb)
                    out[gemm] = ({"status": "skip", "why": "shape not tiled"} if got is None
                                 else _close(got, want))
                bad = [g for g, r in out.items() if r["status"] == "fail"]
                status = "skip" if ctx["dry"] else ("fail" if bad else "pass")
                return {"shape": (m, k, n), "input": kind, "gemms": out, "status": status}
            _row(ctx["res"], "checks", f"tcgen05 {m}x{k}x{n} {kind}", run)


def _bench_dot(x, w, ct, env, base) -> dict:
    with lab.kernel_env(env):
        fb = jax.jit(jax.value_and_grad(lab.dot_loss(), argnums=(0, 1)))
        f = jax.jit(lambda a, b: fp4jax.dot(a, b, key=jax.random.key(1)))
        t = {"fwd": lab.time_fn(f, x, w), "fwd+bwd": lab.time_fn(fb, x, w, ct)}
        mode = dispatch.native_mode()
    return {"shape": (x.shape[0], x.shape[1], w.shape[1]), "FP4JAX_KERNELS": env,
            "mode": mode, **{f"{p}_us": v["median_us"] for p, v in t.items()},
            **{f"{p}_vs_bf16": v["median_us"] / base[p] for p, v in t.items()},
            "method": t["fwd"]["method"]}


def _bench_gemm(f, qa, qb) -> dict:
    return {"us": lab.time_fn(jax.jit(f), qa, qb)["median_us"]}


@register("bench", "device time: fp4jax.dot native vs XLA emulation vs bf16; bare GEMMs")
def bench(ctx):
    from pallas_kernels.gemm import tcgen05_sm100 as tc

    shapes = [(256, 256, 256)] if ctx["dry"] else [(4096, 4096, 4096), (8192, 8192, 8192)]
    native_env = "native" if ctx["dry"] else "auto"
    fprop = LAYOUTS["fprop"]
    for m, k, n in shapes:
        x, w, ct = lab.dot_problem(m, k, n, ctx["seed"])
        bf16_fb = jax.jit(jax.value_and_grad(
            lambda a, b, c: (jnp.dot(a, b).astype(jnp.float32) * c).sum(), argnums=(0, 1)))
        base = {"fwd": lab.time_fn(jax.jit(jnp.dot), x, w)["median_us"],
                "fwd+bwd": lab.time_fn(bf16_fb, x, w, ct)["median_us"]}
        _row(ctx["res"], "bench", f"bf16 {m}x{k}x{n}", lambda **kw: kw,
             shape=(m, k, n), fwd_us=base["fwd"], fwd_bwd_us=base["fwd+bwd"])
        for env in (native_env, "off"):
            _row(ctx["res"], "bench", f"fp4jax.dot nvfp4 {env} {m}x{k}x{n}", _bench_dot,
                 x=x, w=w, ct=ct, env=env, base=base)
        qa, qb = _operands(m, k, n, "normal", True, ctx["seed"])["fprop"]
        _row(ctx["res"], "bench", f"gemm scaled_matmul+alpha {m}x{k}x{n}", _bench_gemm,
             f=lambda a, b: bs.gemm(fprop, a, b, jnp.bfloat16), qa=qa, qb=qb)
        if "tcgen05" in ctx["names"] and not ctx["dry"]:
            _row(ctx["res"], "bench", f"gemm tcgen05 {m}x{k}x{n}", _bench_gemm,
                 f=lambda a, b: tc.gemm(fprop, a, b), qa=qa, qb=qb)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = lab.arg_parser(__doc__, "blackwell_check.json", "check",
                        "checks to run (default: all but tcgen05)")
    ap.add_argument("--dry-run", action="store_true",
                    help="any device: small shapes, the backend forced, the kernel lowered")
    ap.add_argument("--seed", type=int, default=None, help="input seed (default: clock)")
    args = ap.parse_args(argv)
    if args.list:
        for name, (_, doc) in CHECKS.items():
            print(f"{name:9} {doc}")
        return 0
    default = [c for c in CHECKS if c != "tcgen05"]
    names = list(dict.fromkeys(
        c for a in (args.names or ["all"]) for c in (default if a == "all" else [a])))
    unknown = [c for c in names if c not in CHECKS]
    if unknown:
        ap.error(f"unknown check(s) {unknown}: use {', '.join(CHECKS)} or all")
    if not args.dry_run and not dispatch.on_sm100():
        print(f"blackwell_check: no sm_100+ GPU ({jax.devices()[0].device_kind}); "
              "use --dry-run for a check of this script", file=sys.stderr)
        return 2
    if args.dry_run:
        os.environ["FP4JAX_KERNELS"] = "native"
    seed = args.seed if args.seed is not None else int(time.time() * 1000) % 2**30
    meta = lab.run_info(__file__, argv, args.commit) | {
        "seed": seed, "dry_run": args.dry_run, "selected": names,
        "native_mode": dispatch.native_mode(),
        "jax_lowers_scaled_matmul": bs.jax_lowers_on(jax.default_backend()),
        "criterion": f"|got - ref| <= half ulp(out dtype) |ref| + {GEMM_TOL} max|ref|, "
                     "NaN/Inf positions equal"}
    res = lab.Results(args.out or lab.default_out("blackwell_check.json"), meta)
    print(f"blackwell_check on {meta['device']} (jax {meta['jax']}, commit "
          f"{meta['commit']}) -> {res.path}", flush=True)
    ctx = {"res": res, "dry": args.dry_run, "seed": seed, "names": names}
    for name in names:
        CHECKS[name][0](ctx)
    rows = res.data.get("checks", [])
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "error", "skip")}
    res.finish(summary=counts)
    print(f"summary: {counts}", flush=True)
    return 1 if counts["fail"] or counts["error"] or any(
        r.get("status") == "error" for r in res.data.get("bench", [])) else 0


if __name__ == "__main__":
    sys.exit(main())
