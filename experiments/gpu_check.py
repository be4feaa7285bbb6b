"""The one exactness checker of the Hopper kernels: each kernel that ``pallas_kernels``
ships against the core XLA function that defines it (``fp4jax.quantize``,
``fp4jax.quantization.scaled_data``, ``fp4jax.dequantize``, ``fp4jax.dot`` with
``FP4JAX_KERNELS=off``), on fresh inputs that include the hard cases (NaN/Inf/-0, 40 binades,
a tiny tensor, odd and large shapes): bit for bit for quantization (NaN equals NaN), to
float32 accumulation order for the GEMMs (max relative error and bitwise equality both
reported), bit for bit for ``fp4jax.dot``'s forward and backward.

    PYTHONPATH=$PWD python3 experiments/gpu_check.py [CHECK ...] [--list] [--interpret]
        [--full] [--out PATH] [--commit SHA] [--seed N] [--jobs N]

``CHECK``: names from ``--list`` (default ``all``). Writes ``$OUT/gpu_check.json`` (or
``--out``): device, JAX version, git commit, the command, the seed, then one row per case
(check, case, shapes, input, mismatch counts, ``status`` pass/fail/skip/error, seconds)
and a summary; prints each row as it finishes. Exit status 1 if any case failed or raised,
2 for a usage error (or no sm_90 GPU without ``--interpret``). ``--interpret`` is the CPU
dry run: small shapes, the kernels in Mosaic GPU interpret mode (``gemm_alpha`` and the
W4A16 kernel have none: skipped). On an H200 ``all`` took about 5 minutes (316 s in run 42,
most of it compiling; before ``dot_recipes``, which adds 20 programs of its own), so that it
fits one device call with ``bench_kernels.py dotkern1``;
``--full`` adds inputs and GEMM shapes (a call of its own, ~8 minutes).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import lab  # before fp4jax: puts the repository root on sys.path
import ml_dtypes
import numpy as np

import fp4jax
from fp4jax import quantization as qz
from fp4jax.hadamard import default_signs, random_hadamard_transform
from pallas_kernels import dispatch
from pallas_kernels import reference as npref
from pallas_kernels.gemm import alpha_sm90 as ga
from pallas_kernels.gemm import w4a4_sm90 as w4
from pallas_kernels.quantize import common_sm90 as cm
from pallas_kernels.quantize import operand_sm90 as fq
from pallas_kernels.quantize import packed_sm90 as qk

F32 = jnp.float32
BF16 = jnp.bfloat16
GEMM_TOL = 1e-5  # accumulation-order error allowed, relative to the output's max |value|


class Skip(Exception):
    """A case that does not apply here (unsupported shape, no interpret mode)."""


# ---------------------------------------------------------------------------
# Inputs (GPU, interpret dry run) and the run context.
# ---------------------------------------------------------------------------

# Inputs and shapes by run size: "interpret" (the CPU dry run), "gpu" (the default: fits one
# device call with bench_kernels.py dotkern1) and "full" (--full: a call of its own).
_OPERAND_GPU = [((48, 2048), "wild"), ((1024, 3072), "tiny"), ((4096, 14336), "wide40"),
                ((8192, 8192), "normal"),  # 3072 columns: SR rows tiles of 64 blocks
                # a small model's widths: column strips of 48 and 16 blocks (strided layout)
                # (SR rows: the flat quad layout, 4 and 8 quads a CTA, 64-block tiles)
                ((16384, 768), "wild"), ((2048, 256), "wide40"), ((4096, 512), "normal"),
                # 81 blocks a row: SR rows tiles of 64 blocks, the second overhangs the row
                ((1024, 1296), "wild")]
OPERAND_INPUTS = {  # (shape, input kind) for the quantization kernels
    "interpret": [((48, 2048), "wild"), ((32, 1024), "wide40"), ((32, 1024), "tiny")],
    "gpu": _OPERAND_GPU,
    "full": _OPERAND_GPU + [((2048, 1024), "wild"), ((2048, 4096), "wide40"),
                            ((16384, 4096), "wild")],
}
NUMPY_INPUT = {"interpret": (32, 1024), "gpu": (1024, 4096), "full": (1024, 4096)}
GEMM_ALPHA_SHAPES = ((8192, 8192, 8192), (1024, 512, 768), (2048, 1024, 3072),
                     (16384, 512, 256))
LAYOUTS = {"fprop NN": (False, False), "dgrad NT": (False, True), "wgrad TN": (True, False)}
_W4A16_GPU = [(16, 8192, 8192, False), (64, 8192, 8192, True), (16, 14336, 4096, True),
              (3, 1024, 320, False), (200, 2048, 512, False), (33, 512, 128, True)]
W4A16_CASES = {"interpret": [], "gpu": _W4A16_GPU,  # (M, K, N, 16x16 weight)
               "full": _W4A16_GPU + [(16, 8192, 8192, True), (1, 8192, 8192, False),
                                     (16, 4096, 14336, False)]}
_W4A4_GPU = [("nvfp4", "nvfp4", 8192, 8192, 8192, "rows"),
             ("mxfp4", "mxfp4", 4096, 14336, 4096, "wide"),
             ("nvfp4", "mxfp4", 1024, 4096, 2048, "wide")]
W4A4_CASES = {  # (format of A, of B, M, K, N, A's magnitudes)
    "interpret": [("nvfp4", "nvfp4", 64, 256, 64, "rows"), ("mxfp4", "mxfp4", 64, 256, 64, "wide"),
                  ("nvfp4", "mxfp4", 64, 256, 128, "wide")],
    "gpu": _W4A4_GPU,
    "full": _W4A4_GPU + [("nvfp4", "nvfp4", 256, 512, 384, "rows"),
                         ("mxfp4", "mxfp4", 8192, 8192, 8192, "normal"),
                         ("mxfp4", "mxfp4", 1024, 4096, 2048, "wide")],
}
DOT_SHAPES = {"interpret": ((16, 1024, 1024),),
              # 16384 x 768 x 256: a small model's GEMM, wgrad operands on narrow strips
              "gpu": ((8192, 8192, 8192), (1000, 4096, 4096), (16384, 768, 256)),
              "full": ((8192, 8192, 8192), (1000, 4096, 4096), (4096, 4096, 4096))}
# dot_recipes: a small model's k/v projection (the wgrad operands on narrow strips) and a
# GEMM large enough for gemm_alpha on the quantized GEMMs (M*K*N = alpha_sm90.MIN_MKN)
DOT_RECIPE_SHAPES = {"interpret": ((16, 256, 256),),
                     "gpu": ((16384, 768, 256), (4096, 4096, 4096)),
                     "full": ((16384, 768, 256), (4096, 4096, 4096), (8192, 8192, 8192))}


def dot_recipes() -> dict:
    """The recipes of ``dot_recipes`` (issue 35): the kernel path with unquantized operands.
    ``switch_fwd`` / ``switch_bwd``: ``fp4jax-train --switch fwd|bwd``'s recipes
    (``switched_recipe(nvfp4(), ...)``; ``bwd`` is ``nvfp4_fwd_only`` but for its name);
    ``mxfp8_fwd_nvfp4_bwd``: MXFP8 operands from the XLA quantizer inside the kernel path;
    ``mixed``: row-scaled x and MXFP8 w in fprop, NVFP4 dgrad, wgrad with dy unquantized
    (x quantized after the RHT into a float32 GEMM); ``frontier_2026`` (issue 37 item 4):
    MXFP4 with the unsigned Hadamard on Wgrad (``hadamard_signs=ones``, its x and dy from
    the kernels), an Overflow-Aware-Scaling x in fprop and an E1M2 dy in dgrad (both from
    the XLA quantizer: the kernels refuse them)."""
    from fp4jax.train import switched_recipe

    r = fp4jax.recipes
    return {"switch_fwd": switched_recipe(r.nvfp4(), "fwd"),
            "switch_bwd": switched_recipe(r.nvfp4(), "bwd"),
            "mxfp8_fwd_nvfp4_bwd": r.mxfp8_fwd_nvfp4_bwd(),
            "mixed": r.mxfp8_fwd_nvfp4_bwd().replace(
                name="mixed", **{"wgrad.rhs.fmt": None,
                                 "fprop.lhs": r.QuantSpec(row_scaled=True)}),
            "frontier_2026": r.parse("mxfp4(wgrad.hadamard_signs=ones, fprop.lhs.fmt=mxfp4_oas, "
                                     "dgrad.lhs.fmt=nvfp4_e1m2, name='frontier_2026')")}


@dataclasses.dataclass
class Case:
    """One case of a check as programs to compile (``name -> (function, args)``) and a
    ``judge(outputs by name) -> fields with ok``; or a case to skip (``skip``: why)."""

    check: str
    case: str
    meta: dict
    programs: dict = dataclasses.field(default_factory=dict)
    judge: Callable | None = None
    skip: str | None = None


class Ctx:
    """One run: interpret mode or not, the seed, the kernels' keyword arguments, the inputs
    (made once, shared by the checks) and the result file."""

    def __init__(self, interpret: bool, seed: int, results: lab.Results, jobs: int = 1,
                 full: bool = False) -> None:
        self.interpret = interpret
        self.size = "interpret" if interpret else "full" if full else "gpu"
        self.jobs = jobs
        self.seed = seed
        self.res = results
        self.kw = {}
        if interpret:
            from pallas_kernels.support import interpret_params

            self.kw = interpret_params("interpret")
        self.key = jax.random.key(seed + 1)
        self.signs = jnp.asarray(default_signs(16), F32)
        self._inputs: dict = {}

    def input(self, shape, kind):
        if (shape, kind) not in self._inputs:
            self._inputs[(shape, kind)] = lab.make_input(shape, kind,
                                                         self.seed + 7 * len(self._inputs))
        return self._inputs[(shape, kind)]

    def operand_inputs(self):
        for shape, kind in OPERAND_INPUTS[self.size]:
            yield shape, kind, self.input(shape, kind)

    def case(self, check: str, case: str, fn, **meta) -> None:
        """Run one case: ``fn()`` returns its fields with ``ok``; the row gets a status."""
        row = {"check": check, "case": case, **meta}
        t0 = time.perf_counter()
        try:
            out = fn()
            row["status"] = "pass" if out.pop("ok") else "fail"
            row.update(out)
        except Skip as e:
            row.update(status="skip", reason=str(e))
        except Exception as e:  # noqa: BLE001
            row.update(status="error", error=lab.error_text(e, 800),
                       traceback=traceback.format_exc()[-2000:])
        row["seconds"] = round(time.perf_counter() - t0, 2)
        self.res.add("checks", row, echo=False)
        brief = {k: v for k, v in row.items()
                 if k not in ("check", "case", "status", "traceback")}
        print(f"{row['status'].upper():5} {check:10} {case:24} {brief}", flush=True)

    def run(self, cases: list[Case]) -> None:
        """Lower every case's programs here, compile them on a thread pool, then run and
        judge the cases in order, each as soon as its programs are compiled. (On the H200
        Mosaic GPU compiles a kernel while lowering, 1-7 s a program, under the GIL: lowering
        on threads too made it slower; the XLA compile, 2-4 s a program, overlaps.)"""
        def compile_timed(lowered):
            t0 = time.perf_counter()
            return lowered.compile(), time.perf_counter() - t0

        def submit(pool, c):
            if c.skip:
                return None
            try:
                t0 = time.perf_counter()
                lowered = {n: jax.jit(f).lower(*a) for n, (f, a) in c.programs.items()}
                return time.perf_counter() - t0, {n: pool.submit(compile_timed, lo)
                                                  for n, lo in lowered.items()}
            except Exception as e:  # noqa: BLE001  (reported by its case)
                return e

        def finish(c, job):
            if c.skip:
                raise Skip(c.skip)
            if isinstance(job, Exception):
                raise job
            lower_s, futures = job
            done = {n: fut.result() for n, fut in futures.items()}
            out = {n: exe(*c.programs[n][1]) for n, (exe, _) in done.items()}
            return c.judge(out) | {"lower_s": round(lower_s, 2),
                                   "compile_s": round(sum(t for _, t in done.values()), 2)}

        with ThreadPoolExecutor(self.jobs) as pool:
            jobs = [submit(pool, c) for c in cases]
            for c, job in zip(cases, jobs, strict=True):
                self.case(c.check, c.case, functools.partial(finish, c, job), **c.meta)

    def gpu_only(self, check: str, why: str) -> bool:
        """In interpret mode: one skip row saying why, and True (the caller returns)."""
        def skip():
            raise Skip(why)

        if self.interpret:
            self.case(check, "all", skip)
        return self.interpret


CHECKS, check = lab.registry()  # name -> (check(ctx), description)


# ---------------------------------------------------------------------------
# Comparisons.
# ---------------------------------------------------------------------------


def finite_amax(v):
    a = jnp.abs(v.astype(F32))
    return jnp.max(jnp.where(jnp.isfinite(a), a, 0.0))


UNSUPPORTED = "shape not supported by the kernel (XLA path)"


def _input_cases(ctx: Ctx, check: str, variants, inputs=None) -> None:
    """Run ``check`` on every input ``(shape, kind, x)`` (default: the operand inputs) and
    variant ``(case, supported(x), build(x) -> (programs, judge))``; unsupported shapes are
    skipped (the XLA path takes them)."""
    cases = []
    for shape, kind, x in ctx.operand_inputs() if inputs is None else inputs:
        for case, supported, build in variants:
            meta = dict(shape=list(shape), input=kind)
            cases.append(Case(check, case, meta, *build(x)) if supported(x)
                         else Case(check, case, meta, skip=UNSUPPORTED))
    ctx.run(cases)


def _operand(kernel, **ref):
    """``build`` of a bf16-operand kernel ``kernel(x) -> (scaled, dec)`` against
    ``lab.xla_operand(x, **ref)``: bit for bit (NaN equals NaN), equal tensor scales."""
    def build(x):
        def judge(out):
            (got, dec), (want, wdec) = out["kernel"], out["xla"]
            bad = lab.mismatches(got, want)
            dec_ok = lab.mismatches(dec, wdec) == 0
            return dict(mismatch=bad, n=int(x.size), dec_equal=dec_ok, ok=bad == 0 and dec_ok)

        return {"kernel": (kernel, (x,)),
                "xla": (functools.partial(lab.xla_operand, **ref), (x,))}, judge
    return build


@functools.partial(jax.jit, static_argnames="tile")
def _packed_stats(x, p, s, rp, rs, tile):
    """Packed codes (R, C/2) and scale bits vs the reference's: codes compared in blocks
    without NaN/Inf (their codes are unspecified: the NaN scale carries the NaN), scale bits
    everywhere; a NaN/Inf block must get the NaN scale (0x7F/0xFF)."""
    r, c = x.shape
    tr, tc = tile
    fin = jnp.isfinite(x.astype(F32)).reshape(r // tr, tr, c // tc, tc).all(axis=(1, 3))
    byte_fin = jnp.repeat(jnp.repeat(fin, tr, 0), tc // 2, 1)
    s_bad = s != rs
    return dict(codes_differ=jnp.sum((p != rp) & byte_fin),
                codes_differ_nonfinite_blocks=jnp.sum((p != rp) & ~byte_fin),
                scales_differ=jnp.sum(s_bad), scales_differ_finite_blocks=jnp.sum(s_bad & fin),
                nonfinite_blocks=jnp.sum(~fin),
                nonfinite_without_nan_scale=jnp.sum(~fin & ((s & 0x7F) != 0x7F)))


def _packed_case(x, got, q, tile, numpy_ref=None):
    """Kernel ``(packed, scale bits, dec)`` vs the ``QuantizedArray`` ``q`` of
    ``fp4jax.quantize`` (and vs a NumPy reference ``(codes, scale bits, dec)``)."""
    p, s, d = got
    st = {k: int(v) for k, v in _packed_stats(
        x, p, s, fp4jax.pack_e2m1(q.data), jax.lax.bitcast_convert_type(q.scale, jnp.uint8),
        tile).items()}
    st["dec_equal"] = lab.mismatches(d, q.global_scale) == 0
    st["ok"] = (st["codes_differ"] == 0 and st["scales_differ_finite_blocks"] == 0
                and st["nonfinite_without_nan_scale"] == 0 and st["dec_equal"])
    if numpy_ref is not None:  # inputs without NaN/Inf: every byte
        codes, sbits, dec = numpy_ref
        st["numpy_codes_differ"] = int((np.asarray(p) != npref.pack_codes(codes)).sum())
        st["numpy_scales_differ"] = int((np.asarray(s) != sbits).sum())
        st["numpy_dec_equal"] = bool(np.float32(d) == np.float32(dec))
        st["ok"] = st["ok"] and st["numpy_codes_differ"] == 0 and (
            st["numpy_scales_differ"] == 0 and st["numpy_dec_equal"])
    return st


@functools.partial(jax.jit, static_argnames="ulp")
def _gemm_stats(got, want, ulp):
    """Elementwise |got - want| <= ulp |want| + GEMM_TOL max|want| where both are finite
    (``ulp``: the output dtype's half ulp, 0 for float32), else the same non-finite value
    (NaN equals NaN)."""
    g, w = got.astype(F32), want.astype(F32)
    fin = jnp.isfinite(g) & jnp.isfinite(w)
    scale = jnp.max(jnp.where(jnp.isfinite(w), jnp.abs(w), 0.0))
    err = jnp.where(fin, jnp.abs(g - w), 0.0)
    bad = jnp.where(fin, err > ulp * jnp.abs(w) + GEMM_TOL * scale,
                    ~((jnp.isnan(g) & jnp.isnan(w)) | (g == w)))
    return dict(bad=jnp.sum(bad), max_rel_err=jnp.where(scale > 0, jnp.max(err) / scale, 0.0),
                nan_got=jnp.sum(jnp.isnan(g)), nan_want=jnp.sum(jnp.isnan(w)))


def _gemm_case(got, want_f32, prefix=""):
    """A GEMM output vs the float32 reference: elements out of tolerance, max relative error
    (to max |reference|), and bitwise equality with the reference rounded to got's dtype."""
    ulp = 2.0**-8 if got.dtype == BF16 else 0.0
    st = {prefix + k: (float(v) if k == "max_rel_err" else int(v))
          for k, v in _gemm_stats(got, want_f32, ulp).items()}
    differ = lab.mismatches(got, want_f32.astype(got.dtype))
    st.update({prefix + "differ_vs_rounded_ref": differ, prefix + "bitwise_equal": differ == 0,
               prefix + "ok": st[prefix + "bad"] == 0})
    return st


def _hi_dot(a, b):
    return jnp.dot(a.astype(F32), b.astype(F32), precision=jax.lax.Precision.HIGHEST)


# ---------------------------------------------------------------------------
# The checks.
# ---------------------------------------------------------------------------


@check("recip", "the kernels' reciprocals (run by XLA on this device) vs IEEE float32 1/(s*dec) "
       "(NumPy): recip_rn over all E4M3 scales x random decode scales, the table reciprocal "
       "over its safe range; XLA's own 1/p mismatches reported (not a failure)")
def check_recip(ctx: Ctx) -> None:
    rng = np.random.default_rng(ctx.seed)
    e4m3 = np.arange(127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    n_dec = 500 if ctx.interpret else 8000

    def recip_rn():
        dec = np.exp2(rng.uniform(-30, 30, n_dec)).astype(np.float32)
        p = (e4m3[1:, None] * dec[None, :]).ravel()
        want = (1.0 / p.astype(np.float64)).astype(np.float32)
        res, ok = map(np.asarray, jax.jit(cm.recip_rn)(jnp.asarray(p)))
        xla = np.asarray(jax.jit(lambda v: 1.0 / v)(jnp.asarray(p)))
        bad = int(((res != want) & ok).sum())
        return dict(n=int(p.size), mismatch=bad, not_ok=int((~ok).sum()),
                    xla_div_mismatch=int((xla != want).sum()), ok=bad == 0 and bool(ok.all()))

    def table():
        dec = np.concatenate([np.exp2(rng.uniform(-126, 127.9, n_dec // 2)),
                              np.exp2(rng.uniform(-118, -116, n_dec // 8)),
                              np.exp2(rng.uniform(116, 118, n_dec // 8))]).astype(np.float32)
        with np.errstate(all="ignore"):
            want = np.minimum(np.float32(1) / (e4m3[:, None] * dec[None, :]),
                              np.finfo(np.float32).max).astype(np.float32)
        # s == 0: 1/0 clamped to FLT_MAX, Transformer Engine's rule (since 4842a32; this
        # check still wanted 0 there and failed every safe dec until 2026-11-28)

        def one(d):
            safe, tab = cm.recip_table(d)
            return safe, cm.table_recip(jnp.arange(127, dtype=jnp.int32), list(tab))

        safe, got = jax.jit(jax.vmap(one))(jnp.asarray(dec))
        safe, got = np.asarray(safe), np.asarray(got).T
        exact = (got.view(np.int32) == want.view(np.int32)).all(axis=0)
        bad = int((safe & ~exact).sum())
        return dict(n_dec=int(dec.size), n_safe=int(safe.sum()), safe_dec_inexact=bad, ok=bad == 0)

    ctx.case("recip", "recip_rn", recip_rn)
    ctx.case("recip", "table", table)


@check("rows", "operand kernel fq_rows (1x16 along the last axis), round-to-nearest and "
       "stochastic, vs the XLA path's bf16 scaled_data(quantize(x)) and tensor scale, bit for bit")
def check_rows(ctx: Ctx) -> None:
    key, kw = ctx.key, ctx.kw
    _input_cases(ctx, "rows", [
        ("RtN", lambda x: fq.supported_rows(x.shape, x.dtype),
         _operand(lambda x: fq.fq_rows(x, **kw), axis=-1)),
        ("SR", lambda x: fq.supported_rows(x.shape, x.dtype, True, padded=True),
         _operand(lambda x: fq.fq_rows(x, key, **kw), axis=-1, key=key))])


@check("cols", "operand kernel fq_cols (16x1 along the token axis): RtN, SR, after the "
       "16-point RHT RtN and SR, vs the XLA path (RHT, then quantize(axis=0)), bit for bit")
def check_cols(ctx: Ctx) -> None:
    def variant(name, key, sg):
        return (name, lambda x: fq.supported_cols(x.shape, x.dtype), _operand(
            lambda x: fq.fq_cols(x, key, signs=sg, **ctx.kw), axis=0, key=key, signs=sg))

    _input_cases(ctx, "cols", [variant("RtN", None, None), variant("SR", ctx.key, None),
                               variant("RHT RtN", None, ctx.signs),
                               variant("RHT SR", ctx.key, ctx.signs)])


@check("rowscols", "one-read rows + cols kernel fq_rows_cols (make_operands' default "
       "for NVFP4 x and dy): x's 1x16 rows and RHT-16 16x1 cols operands (RtN; SR "
       "with two keys) vs the XLA path's two operands and tensor scales, bit for bit")
def check_rowscols(ctx: Ctx) -> None:
    sg = ctx.signs
    k2 = jax.random.fold_in(ctx.key, 1)

    def variant(name, kr, kc):
        def build(x):
            def judge(out):
                ((gr, dr), (gc, dc)), ((wr, wdr), (wc, wdc)) = out["kernel"], out["xla"]
                bad_r, bad_c = lab.mismatches(gr, wr), lab.mismatches(gc, wc)
                dec_ok = lab.mismatches(dr, wdr) == 0 and lab.mismatches(dc, wdc) == 0
                return dict(mismatch_rows=bad_r, mismatch_cols=bad_c, n=int(x.size),
                            dec_equal=dec_ok, ok=bad_r == 0 and bad_c == 0 and dec_ok)

            def kernel(x):
                return fq.fq_rows_cols(x, kr, kc, signs=sg, **ctx.kw)

            def xla(x):
                return (lab.xla_operand(x, axis=-1, key=kr),
                        lab.xla_operand(x, axis=0, key=kc, signs=sg))

            return {"kernel": (kernel, (x,)), "xla": (xla, (x,))}, judge

        return (name, lambda x: fq.supported_rows_cols(x.shape, x.dtype, kr is not None),
                build)

    _input_cases(ctx, "rowscols", [variant("RtN", None, None),
                                   variant("SR", ctx.key, k2)])


@check("2d", "operand kernel fq_2d (16x16 tiles, round-to-nearest; bf16 and float32 "
       "inputs) vs the XLA path's scaled_data(quantize(x, block_2d=True)), bit for bit")
def check_2d(ctx: Ctx) -> None:
    variants = [("RtN", lambda x: fq.supported_2d(x.shape, x.dtype),
                 _operand(lambda x: fq.fq_2d(x, **ctx.kw), block_2d=True))]
    _input_cases(ctx, "2d", variants)
    # float32 inputs (a float32 master weight, quantized from its float32 values)
    f32 = [(shape, f"{kind}/f32", lab.make_input(shape, kind, ctx.seed + 1000 + i, jnp.float32))
           for i, (shape, kind, _) in enumerate(ctx.operand_inputs())]
    _input_cases(ctx, "2d", variants, inputs=f32)


@check("amax", "the amax passes: cols_amaxes (finite amax of x and of its 16-point RHT along "
       "the token axis, one read) and rht_cols_amax vs XLA reductions, bit for bit")
def check_amax(ctx: Ctx) -> None:
    sg = ctx.signs

    def kernels(x):
        return (*fq.cols_amaxes(x, sg, **ctx.kw), fq.rht_cols_amax(x, sg, **ctx.kw))

    def xla(x):
        return finite_amax(x), finite_amax(random_hadamard_transform(x, axis=0, size=16,
                                                                       signs=sg))

    def judge(out):
        (plain, rot, rot1), (want_p, want_r) = out["kernels"], out["xla"]
        st = dict(cols_amaxes_plain_equal=lab.mismatches(plain, want_p) == 0,
                  cols_amaxes_rht_equal=lab.mismatches(rot, want_r) == 0,
                  rht_cols_amax_equal=lab.mismatches(rot1, want_r) == 0,
                  amax=float(want_p), rht_amax=float(want_r))
        return st | {"ok": all(v for k, v in st.items() if k.endswith("equal"))}

    _input_cases(ctx, "amax", [("cols_amaxes+rht_cols_amax",
                                lambda x: fq.supported_cols(x.shape, x.dtype),
                                lambda x: ({"kernels": (kernels, (x,)), "xla": (xla, (x,))},
                                           judge))])


@check("shards", "data-parallel operands: fq_rows / fq_cols (RHT too) with stochastic rounding "
       "on each of 4 (or 2) row shards, given the whole tensor's amax and the shard's first "
       "draw (numerics.row_shard_draw_offset), concatenated vs the XLA path on the whole "
       "tensor, bit for bit (what fp4jax.sharding.data_parallel asks of the kernels)")
def check_shards(ctx: Ctx) -> None:
    from fp4jax.numerics import row_shard_draw_offset

    key, kw = ctx.key, ctx.kw

    def n_shards(x):
        return 4 if x.shape[0] % 64 == 0 else 2

    def sharded(kernel, rotated):
        def run(x):
            n = n_shards(x)
            rows = x.shape[0] // n
            amax = (fq.rht_cols_amax(x, ctx.signs, **kw) if rotated else finite_amax(x))
            parts = [kernel(x[i * rows:(i + 1) * rows], amax=amax,
                            offset=row_shard_draw_offset((rows, x.shape[1]), i))
                     for i in range(n)]
            return jnp.concatenate([p[0] for p in parts]), parts[-1][1]
        return run

    def ok_shape(supported):
        def f(x):
            n = n_shards(x)
            return x.shape[0] % (16 * n) == 0 and supported((x.shape[0] // n, x.shape[1]),
                                                            x.dtype)
        return f

    def rows_sr(m, **k):
        return fq.fq_rows(m, key, **kw, **k)

    def cols(sg):
        def f(m, **k):
            return fq.fq_cols(m, key, signs=sg, **kw, **k)
        return f

    _input_cases(ctx, "shards", [
        ("rows SR", ok_shape(lambda s, d: fq.supported_rows(s, d, True, padded=True)),
         _operand(sharded(rows_sr, False), axis=-1, key=key)),
        ("cols SR", ok_shape(fq.supported_cols),
         _operand(sharded(cols(None), False), axis=0, key=key)),
        ("cols RHT SR", ok_shape(fq.supported_cols),
         _operand(sharded(cols(ctx.signs), True), axis=0, key=key, signs=ctx.signs))])


def _packed_check(ctx: Ctx, name: str, case: str, supported, kernel, reference, tile,
                  numpy_kind=None, numpy_fn=None) -> None:
    """Run ``kernel(x) -> (packed, scale bits, dec)`` against ``reference(x)`` (a
    QuantizedArray) on the operand inputs and on a blocks/tiles input also vs NumPy."""
    def build(x, np_fn=None):
        def judge(out):
            ref = np_fn(np.asarray(x.astype(F32))) if np_fn is not None else None
            return _packed_case(x, out["kernel"], out["fp4jax"], tile, ref)

        return {"kernel": (kernel, (x,)), "fp4jax": (reference, (x,))}, judge

    def ok(x):
        return supported(x.shape, x.dtype)

    _input_cases(ctx, name, [(case, ok, build)])
    if numpy_fn is not None:  # every E4M3 scale code, also against the NumPy reference
        shape = NUMPY_INPUT[ctx.size]
        _input_cases(ctx, name, [(case, ok, functools.partial(build, np_fn=numpy_fn))],
                     [(shape, numpy_kind, ctx.input(shape, numpy_kind))])


@check("packed", "packed quantize kernel quantize_nvfp4_1x16 (codes + E4M3 scale bits, "
       "round-to-nearest) vs fp4jax.quantize + pack_e2m1 (and the NumPy reference)")
def check_packed(ctx: Ctx) -> None:
    _packed_check(ctx, "packed", "1x16 RtN", qk.supported,
                  lambda x: qk.quantize_nvfp4_1x16(x, **ctx.kw),
                  lambda x: fp4jax.quantize(x, fp4jax.NVFP4), (1, 16), "blocks",
                  npref.quantize_nvfp4_1x16)


@check("packed_sr", "packed quantize kernel quantize_nvfp4_1x16_sr (stochastic rounding) vs "
       "fp4jax.quantize(rounding='stochastic', same key) + pack_e2m1")
def check_packed_sr(ctx: Ctx) -> None:
    key = ctx.key
    _packed_check(ctx, "packed_sr", "1x16 SR", qk.supported_sr,
                  lambda x: qk.quantize_nvfp4_1x16_sr(x, key, **ctx.kw),
                  lambda x: fp4jax.quantize(x, fp4jax.NVFP4, rounding="stochastic", key=key),
                  (1, 16))


@check("packed_2d", "packed quantize kernel quantize_nvfp4_2d (16x16 tiles) vs "
       "fp4jax.quantize(block_2d=True) + pack_e2m1 (and the NumPy reference)")
def check_packed_2d(ctx: Ctx) -> None:
    _packed_check(ctx, "packed_2d", "16x16 RtN", qk.supported_2d,
                  lambda x: qk.quantize_nvfp4_2d(x, **ctx.kw),
                  lambda x: fp4jax.quantize(x, fp4jax.NVFP4, block_2d=True), (16, 16),
                  "tiles", npref.quantize_nvfp4_16x16)


@check("gemm_alpha", "the bf16 GEMM with alpha in its epilogue (gemm/alpha_sm90), layouts NN, "
       "NT, TN, vs XLA's float32 dot (HIGHEST) times alpha: within one bf16 rounding, and "
       "bitwise vs that product rounded once to bf16")
def check_gemm_alpha(ctx: Ctx) -> None:
    if ctx.gpu_only("gemm_alpha", "gemm_alpha has no interpret mode (warp-specialized); "
                    "tests/kernels/test_gemm_alpha.py lowers it for CUDA"):
        return
    alpha = jnp.float32(3.7e-3)
    cases = []
    for i, (m, k, n) in enumerate(GEMM_ALPHA_SHAPES):
        for layout, (ta, tb) in LAYOUTS.items():
            ka, kb = jax.random.split(jax.random.key(ctx.seed + 100 + 3 * i + ta + 2 * tb))
            a = jax.random.normal(ka, (k, m) if ta else (m, k), F32).astype(BF16)
            b = jax.random.normal(kb, (n, k) if tb else (k, n), F32).astype(BF16)
            progs = {"kernel": (functools.partial(ga.gemm_alpha, trans_a=ta, trans_b=tb),
                                (a, b, alpha)),
                     "xla": (functools.partial(ga.reference, trans_a=ta, trans_b=tb,
                                               out_dtype=F32), (a, b, alpha))}
            cases.append(Case("gemm_alpha", layout, dict(shape=[m, k, n]), progs,
                              lambda out: _gemm_case(out["kernel"], out["xla"])))
    ctx.run(cases)


@check("w4a16", "W4A16 GEMM (dispatch.w4a16_matmul, backend='pallas') vs x @ dequantize(W) "
       "in float32 (HIGHEST): f32 and bf16 outputs, 1x16 and 16x16 weights over six decades "
       "(E4M3-subnormal scales), a NaN row in x")
def check_w4a16(ctx: Ctx) -> None:
    if ctx.gpu_only("w4a16", "the W4A16 kernel cannot run in interpret mode (register-level "
                    "inline_mgpu); tests/kernels/test_w4a16.py lowers it for CUDA"):
        return

    def xla(x, q):
        return _hi_dot(x, fp4jax.dequantize(q, F32))

    def judge(out):
        st = _gemm_case(out["f32"], out["xla"]) | _gemm_case(out["bf16"], out["xla"], "bf16_")
        st["bf16_equals_f32_rounded"] = lab.mismatches(out["bf16"],
                                                       out["f32"].astype(BF16)) == 0
        return st | {"ok": st.pop("ok") and st["bf16_ok"]}

    cases = []
    for i, (m, k, n, b2) in enumerate(W4A16_CASES[ctx.size]):
        kx, kw = jax.random.split(jax.random.key(ctx.seed + 200 + i))
        x = jax.random.normal(kx, (m, k), F32).astype(BF16)
        if m >= 3:
            x = x.at[1].set(jnp.nan)
        w = jax.random.normal(kw, (k, n), F32) * 0.02 * jnp.logspace(-6, 0, n, dtype=F32)
        args = (x, fp4jax.quantize(w, fp4jax.NVFP4, axis=0, block_2d=b2))
        progs = {"f32": (functools.partial(dispatch.w4a16_matmul, out_dtype=F32,
                                           backend="pallas"), args),
                 "bf16": (functools.partial(dispatch.w4a16_matmul, backend="pallas"), args),
                 "xla": (xla, args)}
        cases.append(Case("w4a16", "2d" if b2 else "1x16", dict(shape=[m, k, n]), progs, judge))
    ctx.run(cases)


def _w4a4_operands(fa, fb, m, k, n, kind, seed):
    ka, kb, kc = jax.random.split(jax.random.key(seed), 3)
    a = jax.random.normal(ka, (m, k), F32)
    if kind == "rows":  # per-row binades: block scales over E4M3 normals and subnormals
        a = a * jnp.exp2(jax.random.randint(kc, (m, 1), -10, 6).astype(F32))
    elif kind == "wide":  # each 32-block of a row its own magnitude, 2^-40 .. 2^40
        mag = jnp.exp2(jax.random.uniform(kc, (m, k // 32, 1), minval=-40.0, maxval=40.0))
        a = a * jnp.broadcast_to(mag, (m, k // 32, 32)).reshape(m, k)
    b = jax.random.normal(kb, (k, n), F32) * 0.02
    fmts = {"nvfp4": fp4jax.NVFP4, "mxfp4": fp4jax.MXFP4}
    return (fp4jax.quantize(a.astype(BF16), fmts[fa], axis=1),
            fp4jax.quantize(b.astype(BF16), fmts[fb], axis=0))


@check("w4a4", "W4A4 GEMM from packed NVFP4/MXFP4 (mixed too): the decode kernel vs "
       "scaled_data(q) bit for bit, the two-pass GEMM (dispatch.w4a4_matmul) vs "
       "dequantize(A) @ dequantize(B) in float32 (HIGHEST), f32 and bf16 outputs")
def check_w4a4(ctx: Ctx) -> None:
    def decode(qa, qb):  # the decode kernel on each operand's kernel layout
        return tuple(w4.decode_operand(c, s, scale_fmt=w4.scale_format(q.fmt), **ctx.kw)
                     for (c, s, _), q in ((w4.prepare_a(qa), qa), (w4.prepare_b(qb), qb)))

    def scaled(qa, qb):  # q * s in the kernel layout: A (M, K), B^T (N, K)
        return qz.scaled_data(qa, BF16), qz.scaled_data(qb, BF16).T

    def gemm(qa, qb, out_dtype):
        if ctx.interpret:  # dispatch's kernel path, the decode kernels interpreted
            return w4.w4a4_matmul_two_pass(
                *w4.prepare_a(qa), *w4.prepare_b(qb), out_dtype=out_dtype,
                scale_a=w4.scale_format(qa.fmt), scale_b=w4.scale_format(qb.fmt), **ctx.kw)
        return dispatch.w4a4_matmul(qa, qb, out_dtype=out_dtype, backend="pallas")

    def xla(qa, qb):
        return _hi_dot(fp4jax.dequantize(qa, F32), fp4jax.dequantize(qb, F32))

    def judge(out):
        bad = sum(lab.mismatches(g, w) for g, w in zip(out["decode"], out["scaled"],
                                                          strict=True))
        st = ({"decode_mismatch": bad} | _gemm_case(out["f32"], out["xla"])
              | _gemm_case(out["bf16"], out["xla"], "bf16_"))
        return st | {"ok": bad == 0 and st.pop("ok") and st["bf16_ok"]}

    cases = []
    for i, (fa, fb, m, k, n, kind) in enumerate(W4A4_CASES[ctx.size]):
        args = _w4a4_operands(fa, fb, m, k, n, kind, ctx.seed + 300 + i)
        progs = {"decode": (decode, args), "scaled": (scaled, args), "xla": (xla, args),
                 "f32": (functools.partial(gemm, out_dtype=F32), args),
                 "bf16": (functools.partial(gemm, out_dtype=BF16), args)}
        cases.append(Case("w4a4", f"{fa} x {fb}", dict(shape=[m, k, n], input=kind), progs,
                          judge))
    ctx.run(cases)


def _dot_on_vs_off(ctx: Ctx, m: int, k: int, n: int, seed: int, recipe=None, key=None,
                   off_has_no_kernels: bool = False) -> dict:
    """``fp4jax.dot`` forward + backward (``lab.dot_loss``) with the kernels (``on``, or
    ``interpret``) and with ``FP4JAX_KERNELS=off``: the mismatches of y, loss, dx and dw, the
    kernel calls in the kernel lowering (> 0 required) and, with ``off_has_no_kernels``,
    none in the XLA lowering."""
    setting = "interpret" if ctx.interpret else "on"
    x, w, ct = lab.dot_problem(m, k, n, seed=seed)
    outs, calls = {}, {}
    for s in ("off", setting):
        with lab.kernel_env(s):
            f = jax.jit(jax.value_and_grad(lab.dot_loss(recipe, key=key, with_y=True),
                                           argnums=(0, 1), has_aux=True))
            text = f.lower(x, w, ct).as_text()
            calls[s] = text.count("mosaic_gpu") + text.count("callback")
            (v, y), (dx, dw) = f(x, w, ct)
            outs[s] = (y, v, dx, dw)
    st = {f"{name}_mismatch": lab.mismatches(a, b) for name, a, b in zip(
        ("y", "loss", "dx", "dw"), outs["off"], outs[setting], strict=True)}
    ok = calls[setting] > 0 and not any(st.values())
    if off_has_no_kernels:
        ok = ok and calls["off"] == 0
    return st | {"kernel_calls_in_lowering": calls[setting], "ok": ok}


@check("dot", "fp4jax.dot, NVFP4 recipe, forward + backward (value_and_grad of sum(y * ct), "
       "random cotangent): y, loss, dx, dw with the kernels vs FP4JAX_KERNELS=off, bit for bit; "
       "the kernel lowering must contain kernel calls")
def check_dot(ctx: Ctx) -> None:
    setting = "interpret" if ctx.interpret else "on"
    for i, (m, k, n) in enumerate(DOT_SHAPES[ctx.size]):
        def run(m=m, k=k, n=n, i=i):
            return _dot_on_vs_off(ctx, m, k, n, ctx.seed + 400 + i)
        ctx.case("dot", f"fwd+bwd {setting} vs off", run, shape=[m, k, n])


@check("mxfp4", "fp4jax.dot, MXFP4 recipe (the MX operand kernels: 1x32 rows, RHT-32 32x1 "
       "cols), forward + backward: y, loss, dx, dw with the kernels vs FP4JAX_KERNELS=off, bit "
       "for bit (was experiments/mxfp4_check.py's dot check); the kernel lowering must "
       "contain kernel calls")
def check_mxfp4(ctx: Ctx) -> None:
    setting = "interpret" if ctx.interpret else "on"
    for i, (m, k, n) in enumerate(DOT_SHAPES[ctx.size]):
        def run(m=m, k=k, n=n, i=i):
            return _dot_on_vs_off(ctx, m, k, n, ctx.seed + 700 + i, fp4jax.recipes.mxfp4(),
                                  ctx.key)
        ctx.case("mxfp4", f"fwd+bwd {setting} vs off", run, shape=[m, k, n], recipe="mxfp4")


@check("dot_recipes", "fp4jax.dot forward + backward for recipes with unquantized GEMMs or "
       "operands the kernels do not implement (the precision switch fwd and bwd, "
       "mxfp8_fwd_nvfp4_bwd, a mixed one; issue 35; the 2026 knobs, issue 37): y, loss, dx, "
       "dw with the kernels vs FP4JAX_KERNELS=off, bit for bit, at 2 shapes; the kernel "
       "lowering must contain kernel calls")
def check_dot_recipes(ctx: Ctx) -> None:
    setting = "interpret" if ctx.interpret else "on"
    for name, recipe in dot_recipes().items():
        for i, (m, k, n) in enumerate(DOT_RECIPE_SHAPES[ctx.size]):
            def run(m=m, k=k, n=n, i=i, recipe=recipe):
                return _dot_on_vs_off(ctx, m, k, n, ctx.seed + 600 + i, recipe, ctx.key,
                                      off_has_no_kernels=True)
            ctx.case("dot_recipes", f"{name} {setting} vs off", run, shape=[m, k, n],
                     recipe=fp4jax.recipes.spec(recipe))


@check("threefry", "jax.random's Threefry lowered as one CUDA kernel per hash "
       "(fp4jax-train --threefry kernel, the default) vs JAX's unrolled HLO (--threefry xla): "
       "fold_in, bits, Rademacher signs and an NVFP4 fp4jax.dot forward + backward with "
       "stochastic rounding and per-call random RHT signs, bit for bit")
def check_threefry(ctx: Ctx) -> None:
    if ctx.gpu_only("threefry", "JAX lowers Threefry to a kernel only on GPUs"):
        return
    recipe = fp4jax.recipes.parse("nvfp4(wgrad.hadamard_signs='random')")
    m, k, n = DOT_SHAPES[ctx.size][-1]

    def run():
        x, w, ct = lab.dot_problem(m, k, n, seed=ctx.seed + 500)
        key = jax.random.key(ctx.seed)

        def prog(x, w, ct, key):
            def loss(x, w):
                y = fp4jax.dot(x, w, recipe=recipe, key=jax.random.fold_in(key, 7))
                return jnp.sum(y.astype(F32) * ct), y
            (v, y), (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
            k2 = jax.random.fold_in(key, 3)
            return (jax.random.key_data(k2), jax.random.bits(k2, (4096,)),
                    jax.random.rademacher(k2, (256,), F32), y, v, dx, dw)

        outs, calls = {}, {}
        before = jax.config.jax_threefry_gpu_kernel_lowering
        try:
            for mode in ("xla", "kernel"):  # the flag is part of jit's cache key
                jax.config.update("jax_threefry_gpu_kernel_lowering", mode == "kernel")
                f = jax.jit(prog)
                calls[mode] = len(re.findall(r"custom_call @\w*threefry",
                                             f.lower(x, w, ct, key).as_text()))
                outs[mode] = f(x, w, ct, key)
        finally:
            jax.config.update("jax_threefry_gpu_kernel_lowering", before)
        names = ("key", "bits", "signs", "y", "loss", "dx", "dw")
        st = {f"{nm}_mismatch": lab.mismatches(a, b) for nm, a, b in zip(
            names, outs["xla"], outs["kernel"], strict=True)}
        st |= {"kernel_threefry_calls": calls["kernel"], "xla_threefry_calls": calls["xla"]}
        return st | {"ok": calls["kernel"] > 0 and calls["xla"] == 0 and not any(
            v for kk, v in st.items() if kk.endswith("mismatch"))}

    ctx.case("threefry", "kernel vs xla lowering", run, shape=[m, k, n])


# ---------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------


def _summary(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        c = out.setdefault(r["check"], {"pass": 0, "fail": 0, "skip": 0, "error": 0})
        c[r["status"]] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = lab.arg_parser(__doc__, "gpu_check.json", "check", "checks to run (default: all)")
    ap.add_argument("--interpret", action="store_true",
                    help="CPU dry run: small shapes, kernels in Mosaic GPU interpret mode")
    ap.add_argument("--seed", type=int, default=None,
                    help="input seed (default: from the clock, recorded in the JSON)")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                    help="programs compiled at once (default: min(8, CPUs))")
    ap.add_argument("--full", action="store_true",
                    help="more inputs and GEMM shapes (a call of its own: ~8 min on an H200)")
    args = ap.parse_args(argv)
    if args.list:
        for name, (_, doc) in CHECKS.items():
            print(f"{name:11} {doc}")
        return 0
    names = list(CHECKS) if not args.names or "all" in args.names else args.names
    unknown = [c for c in names if c not in CHECKS]
    if unknown:
        ap.error(f"unknown check(s) {unknown}: use {', '.join(CHECKS)} or all")
    if not args.interpret and not dispatch.on_sm90():
        print(f"gpu_check: no sm_90 GPU ({jax.devices()[0].device_kind}); use --interpret for "
              "a CPU dry run", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else int(time.time() * 1000) % 2**30
    meta = lab.run_info(__file__, argv, args.commit) | {
        "seed": seed, "interpret": args.interpret, "full": args.full, "selected": names,
        "jobs": args.jobs,
        "gemm_tolerance": f"|got - ref| <= half ulp(out dtype) |ref| + {GEMM_TOL} max|ref|"}
    res = lab.Results(args.out or lab.default_out("gpu_check.json"), meta)
    ctx = Ctx(args.interpret, seed, res, max(1, args.jobs), args.full)
    print(f"gpu_check on {meta['device']} (jax {meta['jax']}, commit {meta['commit']}, "
          f"seed {seed}) -> {res.path}", flush=True)
    wall = {}
    for name in names:
        t0 = time.perf_counter()
        CHECKS[name][0](ctx)
        wall[name] = round(time.perf_counter() - t0, 1)
    summary = _summary(res.data.get("checks", []))
    for name, c in summary.items():
        c["wall_s"] = wall.get(name)
    ok = all(c["fail"] == 0 and c["error"] == 0 for c in summary.values())
    res.finish(summary=summary, ok=ok)
    print("\n==== summary (pass / fail / skip / error, wall seconds) ====")
    for name, c in summary.items():
        print(f"{name:11} {c['pass']:3} / {c['fail']:3} / {c['skip']:3} / {c['error']:3}"
              f"  {c['wall_s']:7.1f} s")
    print("ALL PASS" if ok else "FAILURES: see the FAIL/ERROR rows above", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
