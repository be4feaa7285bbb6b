"""Shared inputs of the kernel and data-parallel tests (interpret mode vs the XLA path, sharded
vs one device)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def mismatches(got, want) -> int:
    """Mismatching elements of two arrays read as float32 bits (any NaN equals any NaN)."""
    g = np.asarray(jnp.asarray(got, jnp.float32))
    w = np.asarray(jnp.asarray(want, jnp.float32))
    ok = (g.view(np.uint32) == w.view(np.uint32)) | (np.isnan(g) & np.isnan(w))
    return int((~ok).sum())


def wild_input(shape: tuple[int, int], seed: int, block: int = 16,
               mx_extremes: bool = False, zero_column_block: bool = False) -> jnp.ndarray:
    """A bf16 (rows >= 8, or >= 10 with ``mx_extremes``; cols >= 71) input over ~17 binades
    per row: a zero and a negative-zero first block of ``block`` elements, NaN, +-Inf,
    1e-30, a row times 1e4; with ``mx_extremes`` also a row at +-3e38 (an MX scale of
    2**126, whose 4 * 2**126 saturates to bf16's max) and a row times 1e-36; with
    ``zero_column_block`` also zeros in rows 20..35 of column 100 (a zero 16x1 column block
    of the token-axis layout, where there are such rows)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, (shape[0], 1)))
    x[0, :block] = 0.0
    x[1, :block] = -0.0
    x[2, 5] = np.nan
    x[3, 40] = np.inf
    x[5, 70] = -np.inf
    x[6, 3] = 1e-30
    x[7, :] *= 1e4
    if mx_extremes:
        x[8, :] = 3e38 * np.sign(x[8, :])
        x[9, :] *= 1e-36
    if zero_column_block:
        x[20:36, 100] = 0.0
    return jnp.asarray(x.astype(np.float32)).astype(jnp.bfloat16)


def shard_gemm_operands(m: int, k: int, n: int, dtype_w=jnp.float32, dtype_g=jnp.float32,
                        seed: int = 0) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """x (m, k) bf16, w (k, n) (bf16 values in ``dtype_w``) and dy (m, n) ``dtype_g`` of a
    GEMM whose amaxes sit on different row shards: x's tensor amax (60) in row m - 5 (the
    last shard), dy's (30) in row 3 (the first)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)) * 2, jnp.bfloat16)
    x = x.at[m - 5, 7].set(60.0)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.bfloat16).astype(dtype_w)
    g = jnp.asarray(rng.standard_normal((m, n)), dtype_g)
    g = g.at[3, 1].set(30.0)
    return x, w, g
