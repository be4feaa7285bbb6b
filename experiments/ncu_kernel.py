"""Run one kernel a few times so that Nsight Compute can profile a single launch of it.

    ncu --clock-control none -k regex:mosaic --launch-skip 2 --launch-count 1 \\
        --section WarpStateStats ... python3 experiments/ncu_kernel.py w4a16 '{"k_wgs": 3}'

Subjects: ``w4a16`` (M=16, K=N=8192, config as JSON keyword arguments of
``pallas_kernels/gemm/w4a16_sm90.w4a16_matmul``); on bf16 8192x8192 with the tensor amax
given, the operand kernels of ``pallas_kernels/quantize/operand_sm90``: ``fq_rows`` (1x16,
round-to-nearest), ``fq_rows_sr`` (stochastic rounding), ``fq_cols_rht`` (16x1 after the
RHT) and ``fq_cols_rht_sr``. Inputs are random (never zeros).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import lab  # noqa: F401  (before fp4jax: puts the repository root on sys.path)

import fp4jax


def main() -> None:
    what = sys.argv[1]
    cfg = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    kx, kw = jax.random.split(jax.random.key(0))
    if what == "w4a16":
        from pallas_kernels.gemm import w4a16_sm90 as wk

        x = jax.random.normal(kx, (16, 8192), jnp.float32).astype(jnp.bfloat16)
        w = jax.random.normal(kw, (8192, 8192), jnp.float32) * 0.02
        q = fp4jax.quantize(w, fp4jax.NVFP4, block_2d=True, axis=0)
        args = jax.block_until_ready(jax.jit(wk.prepare_weight)(q))
        f = jax.jit(lambda x, *a: wk.w4a16_matmul(x, *a, **cfg))
        for _ in range(4):
            jax.block_until_ready(f(x, *args))
    elif what in ("fq_rows", "fq_rows_sr", "fq_cols_rht", "fq_cols_rht_sr"):
        from fp4jax.hadamard import default_signs
        from pallas_kernels.quantize import operand_sm90 as fq

        x = jax.random.normal(kx, (8192, 8192), jnp.float32).astype(jnp.bfloat16)
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)))  # (a stand-in: timing only)
        key = jax.random.key(3) if what.endswith("_sr") else None
        if what.startswith("fq_rows"):
            f = jax.jit(lambda x, a: fq.fq_rows(x, key, amax=a, **cfg))
        else:
            signs = jnp.asarray(default_signs(16))
            f = jax.jit(lambda x, a: fq.fq_cols(x, key, signs=signs, amax=a, **cfg))
        for _ in range(4):
            jax.block_until_ready(f(x, amax))
    else:
        raise SystemExit(f"unknown subject {what!r}: w4a16, fq_rows, fq_rows_sr, fq_cols_rht, "
                         "fq_cols_rht_sr")
    print("done", what, cfg, jax.devices()[0].device_kind)


if __name__ == "__main__":
    main()
