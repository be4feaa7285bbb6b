"""MXFP4 on the Hopper kernels, on the GPU: bit-identity of the MX operand kernels and of
``fp4jax.dot``'s ``mxfp4`` recipe (kernels vs ``FP4JAX_KERNELS=off``), and the time of
``fp4jax.dot`` forward + backward with the kernels, with the XLA path and in bf16.

    PYTHONPATH=$PWD python3 experiments/mxfp4_check.py [--out PATH] [--seed N] [--reps N]

Checks (fresh inputs from ``lab.make_input``: "wild" has NaN/Inf/-0 and 40 binades):
* ``rows``: ``fq_rows_scaled(fmt=MXFP4)`` RtN and SR, ``fmt=MXFP4_OCP`` RtN, vs
  ``scaled_data(quantize_unchecked(x, key, fmt, -1, ...), bf16)``;
* ``cols``: ``fq_cols_scaled(fmt=MXFP4)`` with the RHT-32, RtN and SR, vs the XLA path's
  ``random_hadamard_transform(x, axis=0, size=32)`` then ``quantize(axis=0)``;
* ``dot``: ``value_and_grad`` of ``sum(fp4jax.dot(x, w, recipe="mxfp4") * ct)``: y, loss, dx,
  dw with the kernels vs the XLA path, bit for bit (GEMMs on ``gemm_alpha`` where it tiles
  them: float32 accumulation order, bit for bit in every NVFP4 run so far);
* ``time``: median wall time after ``block_until_ready`` (``--reps`` calls) of the same
  fwd+bwd at the ``100m`` preset's gate/up GEMM (16,384 tokens x 768 -> 4096), kernels vs
  XLA path vs bf16 ``jnp.dot`` (the 16384 x 768 x 256 check shape is timed too).
Writes ``$OUT/mxfp4_check.json`` (or ``--out``) and prints one line a case; exit 1 if a
check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import lab  # before fp4jax: puts the repository root on sys.path

import fp4jax
from fp4jax import quantization as qz
from fp4jax.formats import MXFP4, MXFP4_OCP
from fp4jax.hadamard import default_signs, random_hadamard_transform
from pallas_kernels import dispatch
from pallas_kernels.quantize import common_sm90 as cm
from pallas_kernels.quantize import operand_sm90 as fq

SHAPES = [((16384, 768), "wild"), ((2048, 256), "wide40"), ((4096, 2048), "tiny"),
          ((4096, 512), "wild")]  # 768, 256, 512: the flat SR rows layout; 2048 the quads
TIME_SHAPES = [(16384, 768, 4096)]  # the 100m preset's gate/up GEMM at 64 x 256 tokens


def _xla(x, fmt, axis, key=None, signs=None):
    xin = random_hadamard_transform(x, axis=0, size=32, signs=signs) if signs is not None else x
    q = qz.quantize_unchecked(xin, key, fmt, axis, False,
                              "stochastic" if key is not None else "nearest")
    return qz.scaled_data(q, jnp.bfloat16)


def _timed(f, args, reps):
    out = f(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "mxfp4_check.json"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if not dispatch.on_sm90():
        print("needs an sm_90 GPU", file=sys.stderr)
        return 2
    rows, ok_all = [], True
    key = jax.random.key(args.seed + 1)
    signs = jnp.asarray(default_signs(32))
    sc1, sc32 = cm.scalars(1.0, 1.0), cm.scalars(1.0, 1.0, signs)

    def record(row):
        nonlocal ok_all
        ok_all &= row.get("ok", True)
        rows.append(row)
        print(json.dumps(row), flush=True)

    for i, (shape, kind) in enumerate(SHAPES):
        x = lab.make_input(shape, kind, args.seed + 11 * i)
        cases = [("rows RtN", MXFP4, None, "rows"), ("rows SR", MXFP4, key, "rows"),
                 ("rows OCP RtN", MXFP4_OCP, None, "rows"),
                 ("cols RHT32 RtN", MXFP4, None, "cols"), ("cols RHT32 SR", MXFP4, key, "cols")]
        for name, fmt, k, kind_ in cases:
            t0 = time.perf_counter()
            try:
                if kind_ == "rows":
                    got = fq.fq_rows_scaled(x, sc1, cm.key_words(k), sr=k is not None, fmt=fmt)
                    want = jax.jit(_xla, static_argnums=(1, 2))(x, fmt, -1, k)
                else:
                    got = fq.fq_cols_scaled(x, sc32, cm.key_words(k), sr=k is not None,
                                            rht=True, fmt=fmt)
                    want = jax.jit(_xla, static_argnums=(1, 2))(x, fmt, 0, k, signs)
                bad = lab.mismatches(got, want)
                row = dict(check="operand", case=name, shape=list(shape), input=kind,
                           mismatch=bad, ok=bad == 0)
            except Exception as e:  # noqa: BLE001
                row = dict(check="operand", case=name, shape=list(shape), input=kind, ok=False,
                           error=lab.error_text(e, 600))
            row["seconds"] = round(time.perf_counter() - t0, 2)
            record(row)

    for i, (m, k, n) in enumerate([(16384, 768, 256)] + TIME_SHAPES):
        x, w, ct = lab.dot_problem(m, k, n, seed=args.seed + 400 + i)
        outs, times, calls = {}, {}, {}
        for setting in ("off", "on"):
            with lab.kernel_env(setting):
                f = jax.jit(jax.value_and_grad(lab.dot_loss(recipe="mxfp4", key=key,
                                                            with_y=True),
                                               argnums=(0, 1), has_aux=True))
                text = f.lower(x, w, ct).as_text()
                calls[setting] = text.count("mosaic_gpu")
                (v, y), (dx, dw) = f(x, w, ct)
                outs[setting] = (y, v, dx, dw)
                times[setting] = _timed(f, (x, w, ct), args.reps)

        def bf16_loss(x, w, ct):
            return (jnp.dot(x, w).astype(jnp.float32) * ct).sum()

        times["bf16"] = _timed(jax.jit(jax.value_and_grad(bf16_loss, argnums=(0, 1))),
                               (x, w, ct), args.reps)
        st = {f"{nm}_mismatch": lab.mismatches(a, b) for nm, a, b in zip(
            ("y", "loss", "dx", "dw"), outs["off"], outs["on"], strict=True)}
        record(dict(check="dot mxfp4 fwd+bwd", shape=[m, k, n], **st,
                    kernel_calls=calls["on"], us_kernels=round(times["on"], 1),
                    us_xla=round(times["off"], 1), us_bf16=round(times["bf16"], 1),
                    speedup_vs_xla=round(times["off"] / times["on"], 3),
                    ratio_to_bf16=round(times["bf16"] / times["on"], 3),
                    ok=calls["on"] > 0 and not any(st.values())))
    info = dict(device=str(jax.devices()[0]), jax=jax.__version__, seed=args.seed,
                fp4jax=getattr(fp4jax, "__version__", None), argv=sys.argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(dict(info=info, rows=rows, ok=ok_all), fh, indent=1)
    print("ALL OK" if ok_all else "FAILURES", flush=True)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
