"""Shared inputs and comparisons of the kernel tests (interpret mode vs the XLA path)."""

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
               mx_extremes: bool = False) -> jnp.ndarray:
    """A bf16 (rows >= 8, or >= 10 with ``mx_extremes``; cols >= 71) input over ~17 binades
    per row: a zero and a negative-zero first block of ``block`` elements, NaN, +-Inf,
    1e-30, a row times 1e4; with ``mx_extremes`` also a row at +-3e38 (an MX scale of
    2**126, whose 4 * 2**126 saturates to bf16's max) and a row times 1e-36."""
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
    return jnp.asarray(x.astype(np.float32)).astype(jnp.bfloat16)
