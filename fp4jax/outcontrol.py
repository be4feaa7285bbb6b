"""TetraJet-v2's OutControl: a linear layer's outlier input channels in MXFP8, the rest in FP4.

TetraJet-v2 (arXiv 2510.27527; the authors' code, thu-ml/TetraJet-v2-NVFP4Training at
``ca5953f``, ``olmo2-training/olmo/quantization_real/linear_mix.py`` and ``calibrate.py``,
config ``TJv2-mix_fp8.yaml``: ``X_chan_select``, ``X_top_channels_ratio: 0.1``,
``X_chan_record_start_iter: 501``, ``X_chan_record_iters: 50``) keeps the input channels
whose activations are largest out of FP4:

1. **Statistic** (``channel_norms``): while recording, every forward call of a layer adds,
   per input channel ``c``, the L2 norm over the call's tokens ``sqrt(sum_t x[t, c]**2)``
   to a float32 accumulator (``act_norm_channels_sum += x.view(-1, d_in).norm(p=2,
   dim=0)``), over 50 steps.
2. **Selection** (``outcontrol_count``, ``select_channels``): once, after the recording,
   the top ``min(d_in // 128 * 128, ceil_128(int(d_in * ratio)))`` channels by the
   accumulated norm (``torch.argsort(..., descending=True)``) become the high-precision
   channels, the rest the FP4 channels; both index lists stay **in descending-norm order**
   (not re-sorted), so the FP4 blocks along the input dimension group channels of similar
   magnitude.
3. **GEMMs** (``split_dot``): ``y = x[:, lo] @ w[lo] (FP4) + x[:, hi] @ w[hi] (MXFP8)``;
   the weight is gathered at every call, never permuted in storage.

What fp4jax runs (``split_dot``) and how it differs from the authors' kernels:

* the FP4 channels run the layer's own recipe (``fp4jax.dot``: for ``nvfp4`` a tensor
  scale, 16x16 weight blocks, SR and the wgrad RHT as that recipe has them), not
  TetraJet-v2's own NVFP4 variant (1x128 FP32 second-level scales, double quantization);
* the high-precision channels run ``outcontrol_recipe(recipe)``: forward and wgrad in MXFP8
  E4M3 with power-of-two scales rounded up (``MXFP8_E4M3_UP``: their ``cvt.rp(amax32 /
  448)``), 1x32 blocks along each GEMM's contraction axis, round-to-nearest, no RHT; dgrad
  is the recipe's own (their dgrad is NVFP4 for every channel). fp4jax quantizes the
  weight and x of these GEMMs from their high-precision values; theirs re-quantize the
  forward MXFP8 copies (and, in dgrad, the weight's tensor amax spans all channels where
  fp4jax's spans each part's);
* the two partial products are summed in float32 and rounded once to the output dtype
  (theirs: a bf16 product reduce-added into the other bf16 product);
* the statistic is the norm over the whole batch of the step (on several devices the
  devices' sums of squares are added first: the same selection on any device count);
  theirs sums per-micro-batch, per-rank norms (the same on one device without gradient
  accumulation).

Ties in the selection go to the lower channel index (a stable sort; torch's is not
stable). Tested against a NumPy transcription (``tests/dot/test_outcontrol.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from fp4jax.formats import MXFP8_E4M3_UP
from fp4jax.quantized_dot import dot
from fp4jax.recipes import GemmSpec, QuantSpec, Recipe, get

__all__ = ["CHANNEL_NORM_COLLECTION", "DEFAULT_RATIO", "OUTCONTROL_COLLECTION",
           "ChannelNormTap", "ChannelSplitTap", "channel_norms", "channel_squares",
           "outcontrol_count", "outcontrol_recipe", "select_channels", "split_dot"]

CHANNEL_NORM_COLLECTION = "fp4_channel_sq"
"""Out: each dense layer's per-input-channel sums of squares (``ChannelNormTap``)."""
OUTCONTROL_COLLECTION = "fp4_outcontrol"
"""In: each dense layer's channel split, ``hi`` and ``lo`` int32 indices
(``ChannelSplitTap``)."""

DEFAULT_RATIO = 0.1
"""TetraJet-v2's ``X_top_channels_ratio`` in every ``TJv2-mix_fp8`` config."""

CHANNEL_MULTIPLE = 128
"""The high-precision channel count is a multiple of this (their kernels' tile)."""


def outcontrol_count(d_in: int, ratio: float = DEFAULT_RATIO,
                     multiple: int = CHANNEL_MULTIPLE) -> int:
    """How many of a layer's ``d_in`` input channels run in MXFP8:
    ``min(d_in // m * m, ceil(int(d_in * ratio) / m) * m)`` with ``m = multiple``
    (TetraJet-v2, ``linear_mix.py``: ``min(in // 128 * 128, (int(in * ratio) + 127) // 128
    * 128)``, i.e. ``m = 128``, the default; a smaller ``m`` is fp4jax's knob for models
    narrower than theirs).

    Raises:
      ValueError: ``d_in`` or ``multiple`` not a positive int, ``ratio`` not in (0, 1), or
        a count that leaves no channel on one side (theirs asserts both sides > 0).
    """
    for name, v in (("d_in", d_in), ("multiple", multiple)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"outcontrol_count: {name} must be a positive int, got {v!r}")
    if (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
            or not 0 < ratio < 1):
        raise ValueError(f"outcontrol_count: ratio must be a number in (0, 1), got {ratio!r}")
    m = multiple
    n = min(d_in // m * m, (int(d_in * ratio) + m - 1) // m * m)
    if n <= 0 or n >= d_in:
        raise ValueError(
            f"outcontrol_count: a layer with {d_in} input channels has {n} MXFP8 channels at "
            f"ratio {ratio} and multiple {m}: both sides must be non-empty (OutControl needs "
            f"d_in >= {2 * m} and a ratio that selects at least one channel)")
    return n


def channel_squares(x: jax.Array) -> jax.Array:
    """Per input channel, the float32 sum over all tokens of ``x (..., K)``'s squares:
    ``(K,)`` (what a layer sows; its square root is ``channel_norms``)."""
    x2 = jnp.asarray(x).reshape(-1, jnp.shape(x)[-1]).astype(jnp.float32)
    return jnp.sum(jnp.square(x2), axis=0)


def channel_norms(x: jax.Array) -> jax.Array:
    """Per input channel, the L2 norm over all tokens of ``x (..., K)``: float32 ``(K,)``
    (``x.view(-1, K).norm(p=2, dim=0)`` in TetraJet-v2, computed here in float32)."""
    return jnp.sqrt(channel_squares(x))


def select_channels(norm_sums: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """The ``count`` channels with the largest accumulated norms and the rest.

    Args:
      norm_sums: float32 ``(K,)``, the accumulated ``channel_norms``.
      count: how many high-precision channels (``outcontrol_count``), ``0 < count < K``.
    Returns:
      ``(hi, lo)``: int32 ``(count,)`` and ``(K - count,)``, both in descending order of
      ``norm_sums`` (ties: the lower channel first), as TetraJet-v2's
      ``argsort(descending=True)`` split in two.
    """
    norm_sums = jnp.asarray(norm_sums, jnp.float32)
    if norm_sums.ndim != 1:
        raise ValueError(f"select_channels: norm_sums must be 1-D (K,), got shape "
                         f"{norm_sums.shape}")
    k = norm_sums.shape[0]
    if isinstance(count, bool) or not isinstance(count, int) or not 0 < count < k:
        raise ValueError(f"select_channels: count must be an int in (0, {k}), got {count!r}")
    order = jnp.argsort(-norm_sums, stable=True).astype(jnp.int32)
    return order[:count], order[count:]


def outcontrol_recipe(recipe: Recipe | str) -> Recipe:
    """The recipe of the high-precision channels' GEMMs: every forward and wgrad operand
    that ``recipe`` quantizes in MXFP8 E4M3 (``MXFP8_E4M3_UP``, 1x32 blocks,
    round-to-nearest), no RHT; an operand ``recipe`` keeps in high precision stays so (the
    outlier channels never lose precision: ``bf16`` stays ``bf16``); dgrad ``recipe``'s own
    (TetraJet-v2's dgrad is NVFP4 for every channel)."""
    recipe = get(recipe)
    f = QuantSpec(MXFP8_E4M3_UP, "nearest", False)

    def mx(g: GemmSpec) -> GemmSpec:
        return GemmSpec(lhs=f if g.lhs.quantized else g.lhs,
                        rhs=f if g.rhs.quantized else g.rhs)

    return recipe.replace(name=f"{recipe.name}+outcontrol_mxfp8", fprop=mx(recipe.fprop),
                          wgrad=mx(recipe.wgrad))


def split_dot(x: jax.Array, w: jax.Array, hi: jax.Array, lo: jax.Array, *,
              recipe: Recipe | str | None = None, hi_recipe: Recipe | str | None = None,
              key: jax.Array | None = None, rht_key: jax.Array | None = None,
              preferred_element_type: Any = None) -> jax.Array:
    """``x @ w`` with the input channels split (OutControl; see the module doc):
    ``dot(x[..., lo], w[lo], recipe) + dot(x[..., hi], w[hi], hi_recipe)``, both products
    in float32, summed, then cast once. Both calls take the same ``key`` and ``rht_key``
    (so the gradient ``dy``, quantized by both dgrads, is quantized alike in both, as long
    as ``hi_recipe.dgrad`` is ``recipe.dgrad``, the default's; a recipe that rounds the
    dgrad weight stochastically draws for ``w[lo]`` and ``w[hi]`` from the same key).
    Gradients flow through the gathers: ``dx``'s and ``dw``'s channels land where they
    came from.

    Args:
      x: ``(..., K)`` activations; w: ``(K, N)`` weight.
      hi, lo: int32 channel indices (``select_channels``), disjoint, together ``0..K-1``
        (not checked: traced values).
      recipe: the FP4 channels' recipe (default nvfp4); hi_recipe: the others' (default
        ``outcontrol_recipe(recipe)``).
      key, rht_key, preferred_element_type: as for ``fp4jax.dot``.
    Returns:
      ``(..., N)`` in ``preferred_element_type`` (default ``result_type(x, w)``).
    """
    recipe = get("nvfp4" if recipe is None else recipe)
    hi_recipe = outcontrol_recipe(recipe) if hi_recipe is None else get(hi_recipe)
    x, w = jnp.asarray(x), jnp.asarray(w)
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"split_dot: need x (..., K) and w (K, N), got {x.shape} and "
                         f"{w.shape}")
    hi, lo = jnp.asarray(hi), jnp.asarray(lo)
    if (hi.ndim != 1 or lo.ndim != 1 or hi.shape[0] + lo.shape[0] != w.shape[0]
            or not jnp.issubdtype(hi.dtype, jnp.integer)
            or not jnp.issubdtype(lo.dtype, jnp.integer)):
        raise ValueError(f"split_dot: hi and lo must be 1-D integer channel indices that "
                         f"together cover K={w.shape[0]}, got {hi.dtype}{hi.shape} and "
                         f"{lo.dtype}{lo.shape}")
    out = preferred_element_type or jnp.result_type(x, w)
    f32 = jnp.float32
    # one permutation of the channels (lo's, then hi's) and two slices, instead of four
    # gathers: the backward pass is the inverse permutation's gather, not a scatter-add
    n_lo = lo.shape[0]
    perm = jnp.concatenate([lo, hi]).astype(jnp.int32)
    xp, wp = _permute(x, perm, x.ndim - 1), _permute(w, perm, 0)
    y_lo = dot(xp[..., :n_lo], wp[:n_lo], recipe=recipe, key=key, rht_key=rht_key,
               preferred_element_type=f32)
    y_hi = dot(xp[..., n_lo:], wp[n_lo:], recipe=hi_recipe, key=key, rht_key=rht_key,
               preferred_element_type=f32)
    return (y_lo + y_hi).astype(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _permute(a: jax.Array, perm: jax.Array, axis: int) -> jax.Array:
    """``jnp.take(a, perm, axis)`` for a permutation ``perm`` of ``a``'s axis (exact)."""
    return jnp.take(a, perm, axis=axis, indices_are_sorted=False, unique_indices=True,
                    mode="clip")


def _permute_fwd(a: jax.Array, perm: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    return _permute(a, perm, axis), perm


def _permute_bwd(axis: int, perm: jax.Array, g: jax.Array) -> tuple[jax.Array, None]:
    # the transpose of a permutation is the inverse permutation: a gather (exact)
    inv = jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype),
                                            unique_indices=True)
    return jnp.take(g, inv, axis=axis, unique_indices=True, mode="clip"), None


_permute.defvjp(_permute_fwd, _permute_bwd)


@dataclasses.dataclass(frozen=True)
class ChannelNormTap:
    """A product tap (``fp4jax.nn.taps``) that records OutControl's statistic: on a dense
    product whose recipe quantizes, when ``CHANNEL_NORM_COLLECTION`` is mutable (outside
    ``init``), sows ``channel_squares(x)``, ``(K,)`` float32, as ``sq`` (a tuple per call,
    as ``sow`` does; the harness adds the square root of each step's, over the whole
    batch). The product itself is the rest of the chain's."""

    collections: ClassVar[tuple[str, ...]] = (CHANNEL_NORM_COLLECTION,)

    def __call__(self, call: Any, scope: Any, compute: Callable[[], jax.Array]) -> jax.Array:
        y = compute()
        if (not scope.is_initializing() and call.dense and call.quantized
                and scope.is_mutable_collection(CHANNEL_NORM_COLLECTION)):
            scope.sow(CHANNEL_NORM_COLLECTION, "sq", channel_squares(call.lhs))
        return y


@dataclasses.dataclass(frozen=True)
class ChannelSplitTap:
    """A product tap (``fp4jax.nn.taps``) that runs OutControl's split: on a dense product
    whose recipe quantizes, given ``hi`` and ``lo`` in ``OUTCONTROL_COLLECTION``, the
    product is ``split_dot(x, w, hi, lo)`` in the layer's recipe with the layer's keys
    (``lo``'s channels in the recipe, ``hi``'s in ``outcontrol_recipe``), instead of the
    rest of the chain; otherwise the rest of the chain."""

    collections: ClassVar[tuple[str, ...]] = (OUTCONTROL_COLLECTION,)

    def __call__(self, call: Any, scope: Any, compute: Callable[[], jax.Array]) -> jax.Array:
        if not (call.dense and call.quantized
                and scope.has_variable(OUTCONTROL_COLLECTION, "hi")):
            return compute()
        y = split_dot(call.lhs, call.rhs, scope.get_variable(OUTCONTROL_COLLECTION, "hi"),
                      scope.get_variable(OUTCONTROL_COLLECTION, "lo"), recipe=call.recipe,
                      key=call.key, rht_key=call.rht_key,
                      preferred_element_type=call.preferred_element_type)
        if call.out_sharding is not None:
            y = jax.lax.with_sharding_constraint(y, call.out_sharding)
        return y
