"""Quantization diagnostics of one linear layer (issue 19, first part): how much error each
of its three quantized GEMMs adds on a given batch, and how its operands use the format.

``gemm_stats(x, w, dy, recipe=..., key=...)`` returns, for each GEMM of the recipe
(``fprop`` ``y = x @ w``, ``dgrad`` ``dx = dy @ w.T``, ``wgrad`` ``dw = x.T @ dy``):

* ``rel_error``: ``||P_q - P||_F / ||P||_F``, ``P_q`` the product ``fp4jax.dot`` computes
  (forward, or its VJP with cotangent ``dy``: the recipe's own code path, SR draws included)
  and ``P`` the product of the unquantized float32 tensors (``Precision.HIGHEST``);
  0 for a GEMM the recipe leaves unquantized;
* per operand (``lhs``/``rhs`` in the GEMM's order: fprop ``x, w``; dgrad ``dy, w``; wgrad
  ``x, dy``), as the recipe quantizes it (after the GEMM's RHT, along its blocked axis):
  ``underflow`` (fraction of the nonzero finite elements that quantize to 0),
  ``saturation`` (fraction whose encoded magnitude, times the quantizer's element encode
  scale, exceeds 6, the largest E2M1 value: rounding clips them; with NVFP4's
  round-to-nearest block scales, the block maxima whose scale rounded down),
  ``scale_min``/``scale_max`` (range of the nonzero block decode scales times the tensor
  decode scale: the magnitudes the blocks resolve) and ``amax`` (of the tensor as
  quantized). Unquantized operands have only ``amax``.

All values are float32 scalars (a pytree of dicts), cheap enough to compute every N steps
inside a jitted step.

``recommend_high_precision_layers(stats, budget)`` ranks layers by their measured wgrad
error (then dgrad, then fprop: the order NVIDIA's Appendix E.2 observed to matter) and
returns the names to keep in BF16, at most ``budget`` of them (a fraction of the layers).
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import jax
import jax.numpy as jnp

from fp4jax.dot import _call_key, _quant, _rht, _subkey, dot
from fp4jax.recipes import GemmSpec, QuantSpec, Recipe, get, nvfp4

qz = importlib.import_module("fp4jax.quantize")  # the module (fp4jax.quantize is a function)

__all__ = ["gemm_stats", "recommend_high_precision_layers"]

E2M1_MAX = 6.0  # largest E2M1 magnitude (NVFP4 paper Appendix B)


def _operand_stats(t: jax.Array, g: GemmSpec, spec: QuantSpec, axis: int, key: jax.Array,
                   gemm: str, which: str) -> dict[str, jax.Array]:
    """Format usage of one operand ``t`` (canonical 3D ``(1, R, C)``, blocked along
    ``axis``) as the GEMM quantizes it."""
    r = _rht(t.astype(jnp.float32), g, axis, key, gemm)
    amax = qz._finite_amax(r)
    if not spec.quantized:
        return {"amax": amax}
    q = _quant(r, spec, axis, _subkey(key, gemm, which))
    # each element in the quantizer's encoded domain (its encode scale, Eq. 4): beyond the
    # E2M1 maximum there, rounding clipped it
    enc = qz.element_encode_scale(qz._expand_scale(q), q.global_scale)
    finite_nz = jnp.isfinite(r) & (r != 0)
    n_nz = jnp.maximum(jnp.sum(finite_nz), 1)
    under = jnp.sum(finite_nz & (q.data.astype(jnp.float32) == 0)) / n_nz
    sat = jnp.sum(finite_nz & (jnp.abs(r * enc) > E2M1_MAX)) / n_nz
    dec = q.scale.astype(jnp.float32) * q.global_scale
    used = jnp.isfinite(dec) & (dec > 0)
    return {"underflow": under.astype(jnp.float32), "saturation": sat.astype(jnp.float32),
            "scale_min": jnp.min(jnp.where(used, dec, jnp.inf)),
            "scale_max": jnp.max(jnp.where(used, dec, 0.0)), "amax": amax}


def _rel(a: jax.Array, b: jax.Array) -> jax.Array:
    """``||a - b||_F / ||b||_F`` in float32 (0 when both are 0)."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    num = jnp.sqrt(jnp.sum(jnp.square(a - b)))
    den = jnp.sqrt(jnp.sum(jnp.square(b)))
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.where(num > 0, jnp.inf, 0.0))


def gemm_stats(x: jax.Array, w: jax.Array, dy: jax.Array, *,
               recipe: Recipe | str | None = None, key: jax.Array | None = None,
               rht_key: jax.Array | None = None) -> dict[str, dict[str, Any]]:
    """Quantization statistics of the layer ``y = x @ w`` on one batch (see the module doc).

    Args:
      x: activations ``(..., K)`` (leading dims are tokens, as in ``fp4jax.dot``).
      w: weight ``(K, N)``.
      dy: cotangent of ``y``, ``(..., N)`` with ``x``'s leading dims.
      recipe, key, rht_key: as for ``fp4jax.dot`` (``key`` required when the recipe
        draws random bits; ``rht_key`` for per-layer RHT signs).

    Returns:
      ``{"fprop"|"dgrad"|"wgrad": {"rel_error": f32, "lhs": {...}, "rhs": {...}}}``.
    """
    recipe = nvfp4() if recipe is None else get(recipe)
    x, w, dy = (qz._check_float(a, n, "fp4jax.diagnostics.gemm_stats")
                for a, n in ((x, "x"), (w, "w"), (dy, "dy")))
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"gemm_stats: need x (..., K) and w (K, N), got {x.shape} and {w.shape}")
    if dy.shape != x.shape[:-1] + (w.shape[1],):
        raise ValueError(f"gemm_stats: dy must have shape {x.shape[:-1] + (w.shape[1],)} "
                         f"(y's), got {dy.shape}")
    k = _call_key(recipe, key, rht_key)  # fp4jax.dot's checks and key packing

    def f(a, b):
        return dot(a, b, recipe=recipe, key=key, rht_key=rht_key,
                   preferred_element_type=jnp.float32)

    y_q, vjp = jax.vjp(f, x, w)
    dx_q, dw_q = vjp(dy.astype(y_q.dtype))
    hi = jax.lax.Precision.HIGHEST
    x32, w32, dy32 = (a.astype(jnp.float32) for a in (x, w, dy))
    y = jnp.matmul(x32, w32, precision=hi)
    dx = jnp.matmul(dy32, w32.T, precision=hi)
    x2, dy2 = x32.reshape(-1, x.shape[-1]), dy32.reshape(-1, w.shape[1])
    dw = jnp.matmul(x2.T, dy2, precision=hi)

    # canonical operands (1, M, K), (1, K, N), (1, M, N) and their blocked axes (fp4jax.dot)
    xc, wc, gc = x2[None], w32[None], dy2[None]
    fp, dg, wg = recipe.fprop, recipe.dgrad, recipe.wgrad
    return {
        "fprop": {"rel_error": _rel(y_q, y),
                  "lhs": _operand_stats(xc, fp, fp.lhs, 2, k, "fprop", "lhs"),
                  "rhs": _operand_stats(wc, fp, fp.rhs, 1, k, "fprop", "rhs")},
        "dgrad": {"rel_error": _rel(dx_q, dx),
                  "lhs": _operand_stats(gc, dg, dg.lhs, 2, k, "dgrad", "lhs"),
                  "rhs": _operand_stats(wc, dg, dg.rhs, 2, k, "dgrad", "rhs")},
        "wgrad": {"rel_error": _rel(dw_q, dw),
                  "lhs": _operand_stats(xc, wg, wg.lhs, 1, k, "wgrad", "lhs"),
                  "rhs": _operand_stats(gc, wg, wg.rhs, 1, k, "wgrad", "rhs")},
    }


def recommend_high_precision_layers(stats: dict[str, dict], budget: float = 0.15
                                    ) -> list[str]:
    """The layers to keep in high precision: the ``floor(budget * len(stats))`` layers with
    the largest measured error, ranked by wgrad error, then dgrad, then fprop.

    Args:
      stats: ``{layer name: gemm_stats(...) result}`` (values may be arrays or floats).
      budget: the fraction of layers that may stay in high precision, in [0, 1].

    Returns:
      layer names, largest error first (the form ``PrecisionPolicy.high_precision_layers``
      takes for names inside a block, e.g. ``"mlp.down"``).
    """
    if not 0.0 <= budget <= 1.0 or math.isnan(budget):
        raise ValueError(f"budget must be a fraction in [0, 1], got {budget!r}")
    n = math.floor(budget * len(stats) + 1e-9)

    def rank(name: str) -> tuple[float, ...]:
        s = stats[name]
        return tuple(-float(s[g]["rel_error"]) for g in ("wgrad", "dgrad", "fprop"))

    return sorted(stats, key=lambda name: (rank(name), name))[:n]
