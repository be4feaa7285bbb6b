"""Flax NNX integration: a quantized ``dot_general`` for ``nnx.Linear`` and a thin ``Linear``.

::

    from flax import nnx
    import fp4jax
    from fp4jax.nn import nnx as fnnx

    rngs = nnx.Rngs(params=0, fp4=1)
    dg = fnnx.DotGeneral(fp4jax.recipes.nvfp4(), rngs=rngs)
    layer = nnx.Linear(256, 512, use_bias=False, dot_general=dg, rngs=rngs)
    # or: layer = fnnx.Linear(256, 512, recipe=fp4jax.recipes.nvfp4(), rngs=rngs)

Stochastic-rounding keys are drawn from the NNX RNG stream ``rng_stream`` (default ``"fp4"``;
NNX falls back to ``"default"`` when absent). Each draw advances the stream's counter, so
layers and steps get distinct keys, all reproducible from the stream's seed. The counter is
NNX state: under ``nnx.jit`` it is carried automatically; with ``nnx.split``/``merge`` keep the
``RngState`` with the model.

Recipes whose RHT signs are drawn per layer (``hadamard_signs="layer"``, torchao's policy)
draw each layer's key once, at construction, from the ``params`` stream, and keep it as an
``RHTKey`` variable (state, saved with the model, not a parameter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from fp4jax.diagnostics import observe_product
from fp4jax.nn.linen import DEFAULT_RNG_STREAM, fp4_dot_general, needs_key, needs_layer_key
from fp4jax.quantized_ragged_dot import ragged_dot

if TYPE_CHECKING:  # pragma: no cover
    from fp4jax import Recipe


class RHTKey(nnx.Variable):
    """A layer's constant RHT key (raw uint32 key data) for ``hadamard_signs="layer"``."""


class DotGeneral(nnx.Module):
    """A callable with ``jax.lax.dot_general``'s signature, computed by fp4jax.

    Args:
      recipe: fp4jax recipe (``None``: fp4jax's default, NVFP4).
      rngs: ``nnx.Rngs``; required when the recipe uses stochastic rounding or per-layer
        RHT signs (the layer's key is drawn from its ``params`` stream).
      rng_stream: name of the stream keys are drawn from.
      rht_key: the layer's constant RHT key for ``hadamard_signs="layer"`` recipes (a
        ``jax.random`` key, or an array of them for a stack of layers); default: drawn once
        from ``rngs``' ``params`` stream. Ignored by other recipes.
      layer_path: the name ``fp4jax.diagnostics.layer_stats`` gives the layer (default:
        the path of the module holding this one, e.g. ``"blocks/0/q"`` for
        ``blocks[0].q.dot_general``; ``fp4jax.nn.quantize_model`` sets its rules' path).
    """

    def __init__(
        self,
        recipe: Recipe | None = None,
        *,
        rngs: nnx.Rngs | None = None,
        rng_stream: str = DEFAULT_RNG_STREAM,
        rht_key: jax.Array | None = None,
        layer_path: str | None = None,
    ) -> None:
        self.recipe = recipe
        self.layer_path = layer_path
        self.rng_stream = rng_stream
        if needs_key(recipe):
            if rngs is None:
                name = getattr(recipe, "name", "default")
                raise ValueError(
                    f"fp4jax recipe {name!r} uses stochastic rounding: pass rngs=nnx.Rngs(..., "
                    f"{rng_stream}=seed) to DotGeneral."
                )
            try:
                self.rng = rngs[rng_stream]
            except (KeyError, AttributeError) as e:
                name = getattr(recipe, "name", recipe)
                raise ValueError(
                    f"fp4jax recipe {name!r} uses stochastic rounding and needs the RNG stream "
                    f"{rng_stream!r}: pass rngs=nnx.Rngs(..., {rng_stream}=seed)"
                ) from e
        else:
            self.rng = None
        if not needs_layer_key(recipe):
            self.rht_key = None
        elif rht_key is not None:
            self.rht_key = RHTKey(jax.random.key_data(rht_key))
        else:
            if rngs is None:
                name = getattr(recipe, "name", "default")
                raise ValueError(
                    f"fp4jax recipe {name!r} draws its RHT signs per layer: pass "
                    "rngs=nnx.Rngs(params=seed, ...) to DotGeneral (the layer's key is drawn "
                    "once from the params stream)."
                )
            self.rht_key = RHTKey(jax.random.key_data(rngs.params()))

    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> jax.Array:
        """``jax.lax.dot_general(lhs, rhs, dimension_numbers)`` with FP4 numerics."""
        key, rht_key = self._keys()
        y = fp4_dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                            out_sharding, recipe=self.recipe, key=key, rht_key=rht_key)
        # fp4jax.diagnostics.layer_stats: this product's operands and keys (y unchanged
        # outside it)
        return observe_product(self, self.layer_path, lhs, rhs, dimension_numbers, y,
                               recipe=self.recipe, key=key, rht_key=rht_key)

    def _keys(self) -> tuple[jax.Array | None, jax.Array | None]:
        """One call's keys: a draw of the SR stream (None without one) and the layer's
        constant RHT-sign key (None without one)."""
        key = self.rng() if self.rng is not None else None
        rht_key = (None if self.rht_key is None
                   else jax.random.wrap_key_data(self.rht_key[...]))
        return key, rht_key

    def ragged_dot(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                   precision: Any = None, preferred_element_type: Any = None) -> jax.Array:
        """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` (grouped GEMM, ``rhs (G, K, N)``)
        by ``fp4jax.ragged_dot``, with this layer's keys (one draw per call; expert ``g``
        runs with ``fold_in(key, g)``). Not measured by ``layer_stats``."""
        key, rht_key = self._keys()
        return ragged_dot(lhs, rhs, group_sizes, recipe=self.recipe, key=key,
                                 rht_key=rht_key, precision=precision,
                                 preferred_element_type=preferred_element_type)


class Linear(nnx.Linear):
    """``nnx.Linear`` whose matmul runs in an fp4jax recipe (bias off by default).

    Args:
      in_features, out_features: K and N; the kernel is ``(K, N)`` float32 by default.
      recipe: fp4jax recipe (``None``: fp4jax's default, NVFP4).
      rngs: ``nnx.Rngs`` for parameter init and (stream ``rng_stream``) stochastic rounding.
      use_bias, dtype, param_dtype, **kwargs: as ``nnx.Linear``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        recipe: Recipe | None = None,
        rngs: nnx.Rngs,
        use_bias: bool = False,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        rng_stream: str = DEFAULT_RNG_STREAM,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            in_features,
            out_features,
            use_bias=use_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            dot_general=DotGeneral(recipe, rngs=rngs, rng_stream=rng_stream),
            rngs=rngs,
            **kwargs,
        )
