"""Comparisons and expected values shared by the layers' tests (one definition each).

* ``FTZ``: whether XLA flushes float32 subnormals on this backend.
* ``bits_equal``: two arrays equal bit for bit (NaN equals NaN, the sign of zero counts).
* ``packed_bits`` / ``assert_packed_equal``: a ``QuantizedArray`` as the packed kernels
  write it (packed E2M1 codes, E4M3 scale bytes, float32 ``dec``) and its comparison.
* ``bf16_bits``: a bf16 array's 16-bit patterns.
* ``run_records``: a training run's ``metrics.jsonl`` records.
* ``export_cuda``: a function exported for CUDA (lowering tests, no GPU needed).
* ``dequantized`` / ``recipe_grads``: a recipe's operands and round-to-nearest gradients
  rebuilt from the public quantizer in float64 (the expected values of ``fp4jax.dot``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fp4jax

FTZ = jax.default_backend() == "cpu"
"""XLA:CPU flushes float32 subnormals to zero (the NumPy references' ``ftz=``)."""


def bits_equal(got: Any, want: Any) -> None:
    """Assert equal shapes and equal values read as float64: NaN equals NaN, -0 differs
    from +0 (every float format of the library widens to float64 exactly)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{(~same).sum()} mismatches: got {got[~same][:6]} want {want[~same][:6]}"
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def packed_bits(q: fp4jax.QuantizedArray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """(packed codes uint8 (..., K/2), scale bits uint8, dec float32) of ``q``: what the
    packed kernels return."""
    return (np.asarray(fp4jax.pack_e2m1(q.data)),
            np.asarray(jax.lax.bitcast_convert_type(q.scale, jnp.uint8)),
            np.float32(q.global_scale))


def assert_packed_equal(got: tuple, want: tuple, finite_mask: Any = None,
                        finite_scales: Any = None) -> None:
    """``got`` and ``want`` (each ``(packed, scale bits, dec)``) equal bit for bit: shapes,
    every scale byte (or those where ``finite_scales`` is True), every packed byte (or those
    where ``finite_mask`` is True: NaN/Inf blocks' codes are unspecified) and ``dec``'s
    float32 bits."""
    p, s, d = (np.asarray(a) for a in got)
    wp, ws, wd = (np.asarray(a) for a in want)
    assert p.shape == wp.shape and s.shape == ws.shape, (p.shape, wp.shape, s.shape, ws.shape)
    if finite_scales is None:
        np.testing.assert_array_equal(s, ws)
    else:
        np.testing.assert_array_equal(s[finite_scales], ws[finite_scales])
    if finite_mask is None:
        np.testing.assert_array_equal(p, wp)
    else:
        np.testing.assert_array_equal(p[finite_mask], wp[finite_mask])
    assert np.float32(d).view(np.uint32) == np.float32(wd).view(np.uint32), (d, wd)


def bf16_bits(x: Any) -> np.ndarray:
    """The uint16 bit patterns of a bf16 array (same shape)."""
    x = jnp.asarray(x)
    assert x.dtype == jnp.bfloat16, x.dtype
    return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))


def export_cuda(f, *avals: jax.ShapeDtypeStruct) -> jax.export.Exported:
    """``jax.jit(f)`` exported for CUDA at ``avals`` (lowers Mosaic GPU kernels on a CPU)."""
    return jax.export.export(jax.jit(f), platforms=["cuda"])(*avals)


def dequantized(x: Any, spec: Any, axis: int) -> np.ndarray:
    """``x`` as the operand spec ``spec`` (a ``QuantSpec``) quantizes it along ``axis``
    (round to nearest), dequantized to float64; ``x`` itself when ``spec`` is not
    quantized."""
    if not spec.quantized:
        return np.asarray(x, np.float64)
    q = fp4jax.quantize(x, spec.fmt, axis=axis, block_2d=spec.block_2d)
    return np.asarray(fp4jax.dequantize(q), np.float64)


def recipe_grads(r: Any, x: Any, w: Any, g: Any) -> tuple[np.ndarray, np.ndarray]:
    """The recipe's dgrad (M, K) and wgrad (K, N) of ``x @ w`` (x (M, K), w (K, N), cotangent
    g (M, N)) rebuilt from dequantized operands (round-to-nearest recipes), float64:
    ``Q(dy) @ Q(w).T`` and ``Q(Hx).T @ Q(H dy)`` (H: the wgrad's RHT, if any)."""
    hx, hg = x, g
    if r.wgrad.hadamard:
        hx = fp4jax.random_hadamard_transform(x, axis=0, size=r.wgrad.hadamard)
        hg = fp4jax.random_hadamard_transform(g, axis=0, size=r.wgrad.hadamard)
    want_dx = dequantized(g, r.dgrad.lhs, -1) @ dequantized(w, r.dgrad.rhs, -1).T
    want_dw = dequantized(hx, r.wgrad.lhs, 0).T @ dequantized(hg, r.wgrad.rhs, 0)
    return want_dx, want_dw


def run_records(out: str | Path) -> list[dict]:
    """The records of the run folder ``out``'s ``metrics.jsonl``, in order."""
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def patch_train_step(monkeypatch: Any, change: Any) -> None:
    """Make the harness's train step pass each step's result through ``change(s, new,
    metrics) -> (new, metrics)`` (``s``: the step index the state entered with): how the
    safety tests poison a run's parameters or losses from a chosen step on. Patched where
    ``fp4jax.train.loop.train`` looks it up; it wraps the real step (``steps``), so a
    second call replaces the first change instead of stacking on it."""
    from fp4jax.train import loop, steps

    real = steps.make_train_step

    def patched(*args: Any, **kwargs: Any):
        step = real(*args, **kwargs)

        def wrapped(state, batch, *key):
            s = int(state["step"])
            new, m = step(state, batch, *key)
            return change(s, new, m)

        return wrapped

    monkeypatch.setattr(loop, "make_train_step", patched)


def nan_loss_from(monkeypatch: Any, first: int) -> None:
    """From step ``first`` on, every step reports a NaN loss (``patch_train_step``)."""
    patch_train_step(monkeypatch, lambda s, new, m: (
        new, dict(m, loss=m["loss"] * np.nan) if s >= first else m))
