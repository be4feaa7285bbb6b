"""Flax linen integration: a quantized ``dot_general`` module and a ``Dense`` layer.

``DotGeneral`` plugs into any linen layer that takes ``dot_general_cls`` (the pattern of
``flax/linen/fp8_ops.py``)::

    import functools, flax.linen as nn, fp4jax
    from fp4jax.nn import linen as fnn

    dg = functools.partial(fnn.DotGeneral, recipe=fp4jax.recipes.nvfp4())
    layer = nn.Dense(512, use_bias=False, dot_general_cls=dg)
    params = layer.init(jax.random.key(0), x)
    y = layer.apply(params, x, rngs={"fp4": jax.random.fold_in(key, step)})

Stochastic-rounding keys come from the linen RNG stream ``rng_collection`` (default
``"fp4"``): ``make_rng`` folds in the module path and a per-call counter, so every layer gets a
different key, and passing ``jax.random.fold_in(seed_key, step)`` makes keys differ per step
while staying reproducible from the seed.

Recipes whose RHT signs are drawn per layer (``hadamard_signs="layer"``, torchao's policy)
also need a key that is the same at every step: it comes from the stream
``layer_rng_collection`` (default ``"fp4_layer"``), e.g. ``rngs={"fp4": fold_in(key, step),
"fp4_layer": layer_key}`` with one fixed ``layer_key`` per run; ``make_rng`` gives each layer
its own.

Per-layer quantization statistics (``fp4jax.diagnostics.layer_stats``, ``fp4jax-train
--stats-every``) use three variable collections that ``DotGeneral`` only touches when a
caller asks for them (never in ``init``, nor in a plain ``apply``, whose computation is
unchanged):

* ``PERTURB_COLLECTION`` (``"fp4_perturbations"``): when it is passed in or mutable (by
  name, or by ``mutable=True``; outside ``init``), the layer adds the variable ``y`` (zeros
  of the output's shape and dtype) to its output (``flax.linen.Module.perturb``): the
  gradient of a loss with respect to it is ``dy``, the cotangent of the layer's output;
* ``COTANGENT_COLLECTION`` (``"fp4_cotangents"``) in, ``STATS_COLLECTION`` (``"fp4_stats"``)
  out: given ``dy`` as the variable ``y`` (the gradient of the perturbations, as they come)
  and ``STATS_COLLECTION`` mutable, the layer sows
  ``fp4jax.diagnostics.gemm_stats(x, w, dy, recipe, key, rht_key)`` of its own operands, with
  the stochastic-rounding and RHT keys its GEMMs use in that call, as ``stats``.

Only the dense contraction ``x (..., K) @ w (K, N)`` (what ``Dense``, ``nn.Dense`` and the
Llama model use) is measured; other dimension numbers are left alone.

TetraJet-v2's OutControl (``fp4jax.outcontrol``) uses two more collections, on the same
dense products only:

* ``CHANNEL_NORM_COLLECTION`` (``"fp4_channel_sq"``) out: when it is mutable (by name, or
  by ``mutable=True``), the layer sows the float32 sum over its call's tokens of each
  input channel's square, ``(K,)``, as ``sq`` (appended to a tuple per call, as ``sow``
  does; the harness adds the square root of each step's, over the whole batch);
* ``OUTCONTROL_COLLECTION`` (``"fp4_outcontrol"``) in: given the int32 channel indices
  ``hi`` and ``lo`` (``fp4jax.outcontrol.select_channels``), the layer computes
  ``fp4jax.outcontrol.split_dot``: ``lo``'s channels in its recipe, ``hi``'s in MXFP8.

Both only where the layer's recipe quantizes some operand (a ``bf16`` layer is left alone).

The statistics and OutControl are product taps (``fp4jax.nn.taps``): ``DotGeneral`` draws
the keys, then runs its ``taps`` (default ``fp4jax.nn.taps.DEFAULT_TAPS``) around
``fp4jax.dot_general``; pass others (``DotGeneral(taps=...)``,
``quantize_model(..., taps=...)``) to add a measurement or replace a product.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp4jax.diagnostics import (  # noqa: F401 (re-exported: the statistics collections)
    COTANGENT_COLLECTION,
    PERTURB_COLLECTION,
    STATS_COLLECTION,
    is_dense_product,
)
from fp4jax.nn.taps import DEFAULT_TAPS, ProductCall, check_taps, run_taps
from fp4jax.outcontrol import (  # noqa: F401 (re-exported: OutControl's collections)
    CHANNEL_NORM_COLLECTION,
    OUTCONTROL_COLLECTION,
)
from fp4jax.quantized_ragged_dot import ragged_dot
from fp4jax.recipes import recipe_quantizes

if TYPE_CHECKING:  # pragma: no cover
    from fp4jax import Recipe

DEFAULT_RNG_STREAM = "fp4"
DEFAULT_LAYER_RNG_STREAM = "fp4_layer"


def _recipe(recipe: Any) -> Recipe:
    import fp4jax

    return fp4jax.recipes.nvfp4() if recipe is None else fp4jax.recipes.get(recipe)


def needs_key(recipe: Any) -> bool:
    """Whether ``recipe`` (a ``Recipe``, a recipe name or ``None`` = NVFP4) needs SR keys."""
    return _recipe(recipe).needs_key


def needs_layer_key(recipe: Any) -> bool:
    """Whether ``recipe`` draws RHT signs per layer (needs a key constant over steps)."""
    return _recipe(recipe).needs_layer_key


def fp4_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any,
                    preferred_element_type: Any, out_sharding: Any, *, recipe: Any,
                    key: jax.Array | None, rht_key: jax.Array | None = None) -> jax.Array:
    """``fp4jax.dot_general`` plus the ``out_sharding`` constraint newer flax layers pass
    (shared by the linen and NNX modules)."""
    import fp4jax

    out = fp4jax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                             recipe=recipe, key=key, rht_key=rht_key)
    if out_sharding is not None:
        out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out


class DotGeneral(nn.Module):
    """A linen module with ``jax.lax.dot_general``'s call signature, computed by fp4jax.

    Use it as ``nn.Dense(..., dot_general_cls=functools.partial(DotGeneral, recipe=r))`` (or
    ``nn.DenseGeneral``). It has no parameters.

    Attributes:
      recipe: the fp4jax recipe (``None``: fp4jax's default, NVFP4).
      rng_collection: name of the linen RNG stream that stochastic rounding draws keys from.
        While initializing, when that stream is absent, keys come from ``"params"`` instead.
      layer_rng_collection: the stream of the layer's constant RHT key (recipes with
        ``hadamard_signs="layer"``); pass the same key at every step.
      taps: the product taps run around the product, outermost first
        (``fp4jax.nn.taps``; default: the statistics and OutControl's, inert unless their
        collections are passed).
    """

    recipe: Recipe | None = None
    rng_collection: str = DEFAULT_RNG_STREAM
    layer_rng_collection: str = DEFAULT_LAYER_RNG_STREAM
    taps: tuple[Any, ...] = DEFAULT_TAPS

    @nn.nowrap
    def _draw(self, needed: bool, stream: str, why: str) -> jax.Array | None:
        """A key from ``stream`` when ``needed`` (while initializing, from ``"params"`` if
        ``stream`` is absent); else a ValueError: the recipe ``why`` (which names the
        stream to pass)."""
        if not needed:
            return None
        if self.has_rng(stream):
            return self.make_rng(stream)
        if self.is_initializing() and self.has_rng("params"):
            return self.make_rng("params")
        name = getattr(self.recipe, "name", "default")
        raise ValueError(f"fp4jax recipe {name!r} {why}")

    @nn.nowrap
    def _key(self) -> jax.Array | None:
        return self._draw(
            needs_key(self.recipe), self.rng_collection,
            f"uses stochastic rounding and needs a PRNG key: pass "
            f"rngs={{{self.rng_collection!r}: key}} to Module.apply (e.g. "
            "jax.random.fold_in(seed_key, step)).")

    @nn.nowrap
    def _rht_key(self) -> jax.Array | None:
        return self._draw(
            needs_layer_key(self.recipe), self.layer_rng_collection,
            "draws its RHT signs per layer (hadamard_signs='layer') and needs a key that "
            f"stays the same at every step: pass rngs={{..., {self.layer_rng_collection!r}: "
            "layer_key} to Module.apply, with one fixed layer_key per run (e.g. "
            "jax.random.fold_in(seed_key, 2**31 - 2)).")

    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> jax.Array:
        """``jax.lax.dot_general(lhs, rhs, dimension_numbers)`` with FP4 numerics.

        Shapes and dtypes are those of ``jax.lax.dot_general``; ``out_sharding`` (passed by
        newer flax layers) is applied as a sharding constraint when not ``None``.
        """
        key, rht_key = self._key(), self._rht_key()
        taps = self.taps if self.taps is DEFAULT_TAPS else check_taps(self.taps, "DotGeneral")
        recipe = _recipe(self.recipe)
        path = tuple(self.path)
        if path and path[-1].startswith("DotGeneral_"):
            path = path[:-1]
        call = ProductCall(
            path=path, lhs=lhs, rhs=rhs, dimension_numbers=dimension_numbers,
            precision=precision, preferred_element_type=preferred_element_type,
            out_sharding=out_sharding, recipe=recipe, key=key, rht_key=rht_key,
            dense=is_dense_product(lhs, rhs, dimension_numbers),
            quantized=recipe_quantizes(recipe))
        return run_taps(taps, call, self, lambda c: fp4_dot_general(
            c.lhs, c.rhs, c.dimension_numbers, c.precision, c.preferred_element_type,
            c.out_sharding, recipe=self.recipe, key=c.key, rht_key=c.rht_key))


class RaggedDot(DotGeneral):
    """A linen module with ``jax.lax.ragged_dot``'s call signature (grouped GEMM: ``lhs (M,
    K)`` rows sorted by group, ``rhs (G, K, N)`` one weight per group, ``group_sizes (G,)``),
    computed by ``fp4jax.ragged_dot`` (each group, an expert, runs the recipe as its own
    ``fp4jax.dot``). Keys as :class:`DotGeneral`'s: one draw of each stream per call
    (expert ``g`` runs with ``fold_in(key, g)``). No parameters; the per-layer statistics
    collections are not touched (grouped products are not measured)."""

    def __call__(  # type: ignore[override]
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        group_sizes: jax.Array,
        precision: Any = None,
        preferred_element_type: Any = None,
    ) -> jax.Array:
        """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` with FP4 numerics: ``(M, N)``."""
        key, rht_key = self._key(), self._rht_key()
        return ragged_dot(lhs, rhs, group_sizes, recipe=self.recipe, key=key,
                                 rht_key=rht_key, precision=precision,
                                 preferred_element_type=preferred_element_type)


class Dense(nn.Module):
    """A linear layer ``y = x @ kernel (+ bias)`` whose matmul runs in an fp4jax recipe.

    Same parameters as ``flax.linen.Dense`` (``{"kernel": (in, features)}``, plus ``"bias"``
    when ``use_bias``), so checkpoints are interchangeable.

    Attributes:
      features: output size N.
      recipe: fp4jax recipe; ``None`` is fp4jax's default (NVFP4).
      use_bias: add a bias (default ``False``, as in Llama).
      dtype: compute dtype of inputs and kernel (e.g. ``jnp.bfloat16``); ``None`` keeps the
        promoted dtype of the input and the parameters.
      param_dtype: dtype of the master weights (default float32).
      kernel_init, bias_init: initializers.
      rng_collection: RNG stream for stochastic rounding (see :class:`DotGeneral`).
      layer_rng_collection: RNG stream of the layer's constant RHT key (see
        :class:`DotGeneral`).
    """

    features: int
    recipe: Recipe | None = None
    use_bias: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()
    rng_collection: str = DEFAULT_RNG_STREAM
    layer_rng_collection: str = DEFAULT_LAYER_RNG_STREAM

    @nn.compact
    def __call__(self, x: jax.Array, channel_scale: jax.Array | None = None) -> jax.Array:
        """Applies the layer: ``x (..., K)`` -> ``(..., features)`` in the compute dtype.

        ``channel_scale`` (float32 ``(K,)``, optional): multiply ``x``'s input channels by it
        and divide the kernel's rows by it before the quantized matmul, ``(x * s) @ (kernel
        / s[:, None])``, the same product in exact arithmetic (exact in floating point for
        powers of two): Smooth-SwiGLU's down projection
        (``fp4jax.models.llama.smooth_swiglu_scale``)."""
        kernel = self.param(
            "kernel", self.kernel_init, (jnp.shape(x)[-1], self.features), self.param_dtype
        )
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        if channel_scale is not None:
            s = jnp.asarray(channel_scale, jnp.float32)
            if s.shape != (jnp.shape(x)[-1],):
                raise ValueError(f"Dense: channel_scale must have shape ({jnp.shape(x)[-1]},) "
                                 f"(one per input channel), got {s.shape}")
            x = x * s.astype(x.dtype)
            kernel = kernel / s[:, None].astype(kernel.dtype)
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        dot = DotGeneral(recipe=self.recipe, rng_collection=self.rng_collection,
                         layer_rng_collection=self.layer_rng_collection)
        y = dot(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        if bias is not None:
            y = y + bias
        return y
