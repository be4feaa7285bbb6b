"""Tiling sweeps of the quantize kernels on bf16 8192x8192: the 1x16 rows and 16x1 RHT cols
operand kernels (round-to-nearest) and the packed 1x16 kernel. Each variant's output is
compared bit for bit with the XLA path (``lab.xla_operand``, or ``fp4jax.quantize`` packed)
on the timing tensor and on fresh hard inputs (``lab.make_input``: 40 binades with
NaN/Inf/-0, and a tiny tensor whose decode scale is outside the table reciprocal's exact
range; NaN equals NaN), then timed with its amax pass (CUPTI medians) as a fraction of the
copy bandwidth measured in the same process (bytes: read x twice, write the bf16 output
once, as ``bench_kernels.py fakequant1``; the packed kernel 4.5625 bytes per element).

    PYTHONPATH=$PWD python3 experiments/gpu_tune_quant.py [rows] [rows2] [cols] [packed] \
        [rows_sr] [cols_sr]

``rows2``: the default against the previous default (run 28's 159.7 us). ``rows_sr``,
``cols_sr``: the stochastic-rounding kernels (1x16 rows; 16x1 cols after the RHT) by
tiling (``g``, ``rq``, ``steps``, ``compact``), key fixed. ``TUNE_N`` (env)
shrinks the tensor for dry runs. Writes ``$OUT/gpu_tune_quant.json``. Exactness of the
default configurations on every input: ``gpu_check.py rows cols 2d packed``.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import lab  # before fp4jax: puts the repository root on sys.path

from fp4jax.hadamard import default_signs
from pallas_kernels import dispatch
from pallas_kernels.quantize import operand_sm90 as fq
from pallas_kernels.quantize import packed_sm90 as qk


def timed(f, *args):
    return lab.time_fn(jax.jit(f), *args, iterations=50, warmup=3)["median_us"]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    which = argv or ["rows", "cols", "packed"]
    res = lab.Results(lab.default_out("gpu_tune_quant.json"), lab.run_info(__file__, argv))
    r = c = int(os.environ.get("TUNE_N", "8192"))  # smaller only for dry runs
    x = (jax.random.normal(jax.random.key(1), (r, c), jnp.float32)
         * jnp.logspace(-3, 1, c, dtype=jnp.float32)[None, :]).astype(jnp.bfloat16)
    copy_us = timed(lambda a: a * 2, x)
    copy_gbps = 2 * x.size * 2 / copy_us / 1e3
    res.add("rows", dict(name="copy bf16 x*2", us=copy_us, gbps=copy_gbps))
    signs = jnp.asarray(default_signs(16))
    n = min(r, 2048)
    seed = int(time.time()) % 2**30
    hard = [lab.make_input((n, 2 * n), "wide40", seed), lab.make_input((n // 2, n), "tiny", seed)]

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
        groups.append(("1x16 rows RtN", lambda a: lab.xla_operand(a)[0], rows_kernel, variants,
                       6.0))
    if "rows2" in which:  # the default against the previous default (run 28's 159.7 us)
        groups.append(("1x16 rows RtN", lambda a: lab.xla_operand(a)[0], rows_kernel,
                       [dict(), dict(kt=2, steps=1), dict(kt=1, steps=4, recip="rn")], 6.0))
    if "packed" in which:
        variants = [dict()] + [dict(recip=rc, block=kt, steps_per_cta=st)
                               for rc in ("rn", "auto") for kt, st in ((2, 1), (1, 2), (1, 4))]
        groups.append(("1x16 packed RtN", xla_packed,
                       lambda a, **kw: qk.quantize_nvfp4_1x16(a, **kw)[:2], variants, 4.5625))
    if "cols" in which:
        groups.append(("16x1 cols RHT RtN", lambda a: lab.xla_operand(a, axis=0, signs=signs)[0],
                       lambda a, **kw: fq.fq_cols(a, signs=signs, **kw)[0],
                       [dict(), dict(g=64, steps=2)], 6.0))
    skey = jax.random.key(3)
    if "rows_sr" in which:
        variants = [dict(), dict(compact=True), dict(steps=2), dict(steps=4),
                    dict(compact=True, steps=4), dict(g=64), dict(g=64, compact=True),
                    dict(g=64, compact=True, steps=4), dict(g=128, rq=2, compact=True),
                    dict(g=128, rq=2, compact=True, steps=2)]
        groups.append(("1x16 rows SR", lambda a: lab.xla_operand(a, key=skey)[0],
                       lambda a, **kw: fq.fq_rows(a, skey, **kw)[0], variants, 6.0))
    if "cols_sr" in which:
        groups.append(("16x1 cols RHT SR",
                       lambda a: lab.xla_operand(a, axis=0, key=skey, signs=signs)[0],
                       lambda a, **kw: fq.fq_cols(a, skey, signs=signs, **kw)[0],
                       [dict(), dict(steps=2), dict(steps=4)], 6.0))
    for name, fx, fk, variants, bpe in groups:
        want = jax.jit(fx)(x)
        # codes of NaN/Inf blocks are unspecified in the packed format (the NaN scale
        # carries the NaN; tests/kernels/test_quantize_fast.py): compare finite inputs there
        ins = [jnp.where(jnp.isfinite(a), a, 1.0) if "packed" in name else a for a in hard]
        wants = [jax.jit(fx)(a) for a in ins]
        res.add("rows", dict(name=f"XLA {name}", us=timed(fx, x)))
        for kw in variants:
            row = {"name": name, "cfg": kw}
            try:
                f = jax.jit(functools.partial(fk, **kw))
                row["bit_exact"] = lab.same_bits(f(x), want)
                row["bit_exact_hard"] = [lab.same_bits(f(a), w) for a, w in zip(ins, wants,
                                                                                strict=True)]
                row["us"] = timed(f, x)
                row["frac_copy_bw"] = bpe * x.size / row["us"] / 1e3 / copy_gbps
            except Exception as e:  # noqa: BLE001
                row["error"] = lab.error_text(e)
            res.add("rows", row)
    res.finish()


if __name__ == "__main__":
    main()
