"""Tiling sweep of the 1x16 rows and 16x1 RHT cols operand kernels (round-to-nearest) on
bf16 8192x8192: each variant's output is compared bit for bit with the XLA path
(``scaled_data(quantize(...))``) and timed with its amax pass (CUPTI, medians), as a
fraction of the copy bandwidth measured in the same process (bytes: read x twice, write
the bf16 output once; ``bench_kernels.py fakequant1`` counts the same way).

    PYTHONPATH=$PWD python3 experiments/gpu_tune_quant.py [rows] [rows2] [cols] [packed] [exact]

Exactness also on fresh hard inputs (NaN/Inf/-0, 40 binades, and a tiny tensor whose
decode scale is outside the table reciprocal's exact range); NaN outputs count as equal
to NaN (the XLA path's NaN payloads vary on the GPU). ``packed``: the packed 1x16 quantize
kernel (codes + scale bits, 4.5625 bytes per element with its amax pass). ``exact``: all six
operand kernels of ``fp4jax.dot`` (default configurations) on those inputs, with counts.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.kernel_timing import time_fn  # noqa: E402
from fp4jax.formats import NVFP4  # noqa: E402
from fp4jax.hadamard import default_signs, random_hadamard_transform  # noqa: E402
from pallas_kernels import fakequant_nvfp4_sm90 as fq  # noqa: E402

qz = importlib.import_module("fp4jax.quantize")
RES = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
       "started": time.strftime("%Y-%m-%d %H:%M:%S"),
       "command": "PYTHONPATH=$PWD python3 experiments/gpu_tune_quant.py "
                  + " ".join(sys.argv[1:]), "rows": []}


def rec(**row):
    RES["rows"].append(row)
    print(json.dumps(row), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_tune_quant.json"), "w") as f:
        json.dump(RES, f, indent=1)


def timed(f, *args):
    t = time_fn(jax.jit(f), *args, iterations=50, warmup=3)
    return t["median_us"]


def hard_inputs():
    """Exactness inputs (fresh, not the timing tensor): a wide-range tensor with NaN, +-Inf
    and -0 planted, and a tiny tensor (amax ~1e-33: the table reciprocal is not exact
    for its decode scale, so "auto" must branch and "rn" must hold on its own)."""
    k1, k2 = jax.random.split(jax.random.key(int(time.time()) % 2**31))
    n = min(int(os.environ.get("TUNE_N", "8192")), 2048)
    a = (jax.random.normal(k1, (n, 2 * n), jnp.float32)
         * jnp.exp(jax.random.uniform(k2, (n, 2 * n), minval=-20.0, maxval=20.0)))
    a = a.at[3, 17].set(jnp.nan).at[100, 1000].set(jnp.inf).at[n - 48, 5].set(-jnp.inf)
    a = a.at[7, 64:80].set(-0.0)
    tiny = jax.random.normal(k1, (n // 2, n), jnp.float32) * 1e-33
    return [a.astype(jnp.bfloat16), tiny.astype(jnp.bfloat16)]


def _bits_equal(u, v) -> np.ndarray:
    """Elementwise: same bytes, or both NaN (XLA's float multiply on the GPU does not keep
    a NaN's payload and sign, so the XLA path's NaN blocks are not one bit pattern)."""
    u, v = np.asarray(u), np.asarray(v)
    if u.dtype.itemsize == 1:
        return u.view(np.uint8) == v.view(np.uint8)
    same = u.view(np.uint16) == v.view(np.uint16)
    return same | (np.isnan(u.astype(np.float32)) & np.isnan(v.astype(np.float32)))


def same_bits(a, b) -> bool:
    """Every leaf of ``a`` equals the matching leaf of ``b`` bit for bit (NaN = NaN)."""
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(a) == len(b) and all(
        u.shape == v.shape and bool(np.all(_bits_equal(u, v)))
        for u, v in zip(a, b, strict=True))


def mismatches(got, want, x) -> dict:
    """How many outputs differ (NaN = NaN) and the first few, with their inputs."""
    eq = _bits_equal(got, want)
    idx = np.argwhere(~eq)[:4]
    g, w, xv = (np.asarray(a).astype(np.float32) for a in (got, want, x))
    return {"n_diff": int((~eq).sum()), "n": int(eq.size),
            "first": [[int(i) for i in ij] + [float(xv[tuple(ij)]), float(g[tuple(ij)]),
                                               float(w[tuple(ij)])] for ij in idx]}


def main() -> None:
    from pallas_kernels import dispatch
    from pallas_kernels import quantize_nvfp4_sm90 as qk

    which = sys.argv[1:] or ["rows", "cols", "packed"]
    r = c = int(os.environ.get("TUNE_N", "8192"))  # smaller only for dry runs
    x = (jax.random.normal(jax.random.key(1), (r, c), jnp.float32)
         * jnp.logspace(-3, 1, c, dtype=jnp.float32)[None, :]).astype(jnp.bfloat16)
    copy_us = timed(lambda a: a * 2, x)
    copy_gbps = 2 * x.size * 2 / copy_us / 1e3
    rec(name="copy bf16 x*2", us=copy_us, gbps=copy_gbps)
    signs = jnp.asarray(default_signs(16))
    checks = hard_inputs()

    key = jax.random.key(5)

    def xla(axis, rht=False, sr=False, block_2d=False):
        """The XLA path's bf16 ``data * scale`` (the reference every kernel is held to)."""
        def f(a):
            xin = random_hadamard_transform(a, axis=0, size=16, signs=signs) if rht else a
            q = qz._quantize_impl(xin, key if sr else None, NVFP4, axis, block_2d,
                                  "stochastic" if sr else "nearest")
            return qz.scaled_data(q, jnp.bfloat16)
        return f

    def rows_kernel(a, **kw):
        return fq.fq_rows(a, **kw)[0]

    def xla_packed(a):
        p, s, _ = dispatch.quantize_packed(a, backend="xla")
        return p, s

    groups = []  # (name, reference, kernel(a, **cfg), variants, bytes per element)
    if "rows" in which:
        variants = [dict(), dict(recip="rn"), dict(recip="table")]
        variants += [dict(recip=rc, kt=1, steps=st) for rc in ("rn", "auto", "table")
                     for st in (2, 4)]
        variants += [dict(recip="rn", kt=1, chunk=128, steps=st) for st in (2, 4)]
        variants += [dict(recip="rn", kt=2, chunk=128), dict(recip="rn", kt=1, steps=8)]
        groups.append(("1x16 rows RtN", xla(-1), rows_kernel, variants, 6.0))
    if "rows2" in which:  # the default against the previous default (run 28's 159.7 us)
        groups.append(("1x16 rows RtN", xla(-1), rows_kernel,
                       [dict(), dict(kt=2, steps=1), dict(kt=1, steps=4, recip="rn")], 6.0))
    if "packed" in which:
        variants = [dict()] + [dict(recip=rc, block=kt, steps_per_cta=st)
                               for rc in ("rn", "auto") for kt, st in ((2, 1), (1, 2), (1, 4))]
        groups.append(("1x16 packed RtN", xla_packed,
                       lambda a, **kw: qk.quantize_nvfp4_1x16(a, **kw)[:2], variants,
                       4.5625))
    if "cols" in which:
        variants = [dict(), dict(g=64, steps=2)]
        groups.append(("16x1 cols RHT RtN", xla(0, rht=True),
                       lambda a, **kw: fq.fq_cols(a, signs=signs, **kw)[0], variants, 6.0))
    if "exact" in which:  # every operand kernel of dot, default configuration
        cases = [("rows RtN", xla(-1), lambda a: fq.fq_rows(a)[0]),
                 ("rows SR", xla(-1, sr=True), lambda a: fq.fq_rows(a, key)[0]),
                 ("2d RtN", xla(-1, block_2d=True), lambda a: fq.fq_2d(a)[0]),
                 ("cols RtN", xla(0), lambda a: fq.fq_cols(a)[0]),
                 ("cols RHT RtN", xla(0, rht=True), lambda a: fq.fq_cols(a, signs=signs)[0]),
                 ("cols RHT SR", xla(0, rht=True, sr=True),
                  lambda a: fq.fq_cols(a, key, signs=signs)[0])]
        for name, fx, fk in cases:
            for i, a in enumerate(checks + [x]):
                row = {"name": f"exact {name}", "input": ["wild", "tiny", "timing"][i]}
                try:
                    row.update(mismatches(jax.jit(fk)(a), jax.jit(fx)(a), a))
                    row["ok"] = row["n_diff"] == 0
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
                rec(**row)
    for name, fx, fk, variants, bpe in groups:
        want = jax.jit(fx)(x)
        # codes of NaN/Inf blocks are unspecified in the packed format (the NaN scale
        # carries the NaN; tests/test_kernel_quantize_fast.py): compare finite inputs there
        hard = [jnp.where(jnp.isfinite(a), a, 1.0) if "packed" in name else a
                for a in checks]
        wants = [jax.jit(fx)(a) for a in hard]
        tx = timed(fx, x)
        rec(name=f"XLA {name}", us=tx)
        for kw in variants:
            row = {"name": name, "cfg": kw}
            try:
                f = jax.jit(functools.partial(fk, **kw))
                row["bit_exact"] = same_bits(f(x), want)
                row["bit_exact_hard"] = [same_bits(f(a), w) for a, w in zip(hard, wants,
                                                                            strict=True)]
                row["us"] = timed(f, x)
                row["frac_copy_bw"] = bpe * x.size / row["us"] / 1e3 / copy_gbps
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            rec(**row)
    RES["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    rec(name="done")


if __name__ == "__main__":
    main()
