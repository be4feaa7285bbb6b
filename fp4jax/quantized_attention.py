"""``fp4jax.attention``: dot-product attention whose two products run under a recipe.

::

    o = fp4jax.attention(q, k, v, "attn_nvfp4", causal=True)      # q (B, T, H, hd)

The computation (``attention``'s docstring has the details)::

    S = q @ k.T                 fp4jax.dot_general under recipe.qk (contracting hd)
    S = S * scale; S[~mask] = finfo.min          float32
    P = softmax(S); P[~mask] = 0                 float32
    O = P @ v                   fp4jax.dot_general under recipe.pv (contracting the keys)

Gradients flow through the two ``dot_general`` custom VJPs (their dgrad and wgrad GEMMs:
``dq, dk`` and ``dP, dv`` under the recipes' backward specs) and JAX's autodiff of the
float32 mask and softmax. Each sequence (batch element, all its heads) is one call of the
two products (``jax.vmap`` over the batch), so the tensor scales of q, k, P, v and of the
gradients are per sequence: a sequence's quantization does not depend on the others in its
batch or on how a batch is split over devices.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fp4jax import quantization as qz
from fp4jax import sharding
from fp4jax.quantized_dot import dot_general
from fp4jax.recipes import AttentionRecipe, Recipe, get_attention

__all__ = ["attention"]


def _sequence_offset(batch: int) -> Any:
    """The index of this call's first sequence in the whole batch: inside
    ``fp4jax.sharding.data_parallel`` (each device holds ``batch`` sequences of a batch
    split along its leading axis) ``axis_index * batch``, else 0."""
    axes = sharding.data_axis()
    if axes is None:
        return 0
    return jax.lax.axis_index(axes) * batch


def attention(q: jax.Array, k: jax.Array, v: jax.Array,
              recipe: AttentionRecipe | Recipe | str | None = "attn_nvfp4", *,
              causal: bool = True, mask: jax.Array | None = None,
              scale: float | None = None, key: jax.Array | None = None,
              implementation: str | None = "xla") -> jax.Array:
    """Grouped-query dot-product attention with quantized products.

    ``S = Qqk(q) Qqk(k)^T * scale`` (float32 accumulation), masked (``causal`` and
    ``mask``: masked scores are ``finfo(float32).min`` before the float32 softmax, and the
    probabilities there are set to exactly 0 after it, so masked scores never enter P's
    scales or the output, and a row with no visible key outputs 0; masked *keys and
    queries* do enter q's, k's and v's scales: their tensor amaxes span the whole sequence,
    padded positions included, and v's blocks of keys mix masked with visible keys), ``P =
    softmax(S)`` in float32, ``O = Qpv(P) Qpv(v)`` (float32 accumulation) returned in
    ``q.dtype``. ``Qqk``, ``Qpv``: the recipe's forward operand specs (blocks along the
    contraction axis: ``hd`` for q and k, the keys for P and v); the backward runs each
    product's dgrad and wgrad (``fp4jax.dot_general``), the mask and softmax gradients in
    float32. Where the P operand is not quantized (``recipe.pv.fprop.lhs``), P is rounded
    to ``q.dtype`` for the product, as ``fp4jax.models.llama.causal_attention`` does (so
    ``"attn_bf16"`` is that function's XLA attention).

    Each sequence is one pair of ``dot_general`` calls (``jax.vmap`` over the batch): the
    tensor scales are per sequence (over its heads), and its stochastic-rounding key is
    ``fold_in(key, b)`` for its index ``b`` in the batch (inside
    ``fp4jax.sharding.data_parallel``, its index in the whole batch, the batch split along
    its leading axis in the order of the data-parallel axes), then ``fold_in(., 0)`` for
    the qk product and ``fold_in(., 1)`` for pv. So a data-parallel run quantizes each
    sequence as one device does: the forward bits are one device's, and the backward's
    quantized operands too (unquantized float32 sums may round differently in the
    per-device program).

    This is an XLA computation with the (B, H, T, S) scores in memory: cuDNN's fused
    attention (``jax.nn.dot_product_attention(implementation="cudnn")``) takes no FP4
    operands, so a model layer that turns FP4 attention on runs this instead of cuDNN.

    Args:
      q: queries ``(B, T, H, hd)``, float (bf16/f16/f32).
      k, v: keys and values ``(B, S, KV, hd)``, same dtype; ``KV`` divides ``H`` (query head
        ``h`` reads key/value head ``h // (H // KV)``).
      recipe: an ``fp4jax.recipes.AttentionRecipe``, its name (``"attn_nvfp4"``,
        ``"attn_mxfp4"``, ``"attn_nvfp4_all"``, ``"attn_bf16"``), or a linear ``Recipe``
        (or name/spec) used for both products; None: ``"attn_bf16"``.
      causal: mask key ``j > i`` for query ``i`` (top-left aligned when ``T != S``, as
        ``jax.nn.dot_product_attention``).
      mask: optional boolean, broadcastable to ``(B, H, T, S)``; True attends.
      scale: score scale; default ``hd ** -0.5``.
      key: ``jax.random`` key, required when the recipe draws random bits.
      implementation: ``fp4jax.dot_general``'s backend for the products (default
        ``"xla"``: the reference; the Hopper kernels take unbatched calls only).

    Returns:
      ``(B, T, H, hd)`` in ``q.dtype``.

    Raises:
      ValueError / TypeError: shapes, dtypes, mask, recipe or key that do not fit (naming
        the argument).

    Example:
      >>> o = fp4jax.attention(q, k, v, "attn_nvfp4", causal=True)

    References:
      Attn-QAT (Zhang et al., 2026, arXiv 2603.00040; hao-ai-lab/FastVideo
      ``fastvideo-kernel``): FP4 q, k, v and P in the forward, a high-precision backward
      whose softmax gradient takes its row sum from the high-precision ``P v``; the
      composition above is fp4jax's, its differences from their kernels are in
      ``fp4jax.recipes.attn_nvfp4`` and docs/recipes.md ("Attention").
    """
    where = "fp4jax.attention"
    q = qz.check_float(q, "q", where)
    k = qz.check_float(k, "k", where)
    v = qz.check_float(v, "v", where)
    r = get_attention("attn_bf16" if recipe is None else recipe)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"{where}: q, k and v must be 4-D (batch, seq, heads, head_dim), got "
                         f"shapes {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"{where}: k and v must have the same shape, got {k.shape} and "
                         f"{v.shape}")
    B, T, H, hd = q.shape
    _, S, KV, _ = k.shape
    if k.shape[0] != B or k.shape[3] != hd:
        raise ValueError(f"{where}: k/v shape {k.shape} does not fit q shape {q.shape}: "
                         "batch and head_dim must agree")
    if KV == 0 or H % KV:
        raise ValueError(f"{where}: the query heads ({H}) must be a multiple of the key/value "
                         f"heads ({KV})")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{where}: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if not isinstance(causal, bool):
        raise TypeError(f"{where}: causal must be True or False, got {causal!r}")
    G = H // KV
    full = jnp.ones((T, S), bool)
    if causal:
        full = jnp.tril(full)
    m = jnp.broadcast_to(full, (B, H, T, S))
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise TypeError(f"{where}: mask must be boolean (True attends), got {mask.dtype}")
        try:
            mask = jnp.broadcast_to(mask, (B, H, T, S))
        except ValueError:
            raise ValueError(f"{where}: mask shape {mask.shape} does not broadcast to (batch, "
                             f"heads, q_len, kv_len) = {(B, H, T, S)}") from None
        m = m & mask
    if scale is None:
        scale = hd ** -0.5
    if r.needs_key:
        if key is None:
            raise ValueError(f"{where}: recipe {r.name!r} draws random bits (stochastic "
                             "rounding or random RHT signs): pass key=jax.random.key(seed), "
                             "a fresh key per step and layer")
        key = qz.normalize_key(key)
    else:
        key = jax.random.key(0) if key is None else qz.normalize_key(key)
    offset = _sequence_offset(B)
    keys = jax.vmap(lambda i: jax.random.fold_in(key, offset + i))(jnp.arange(B))
    m = m.reshape(B, KV, G, T, S)
    p_dtype = jnp.float32 if r.pv.fprop.lhs.quantized else q.dtype

    def one(qb, kb, vb, mb, kk):
        """One sequence: qb (T, H, hd), kb/vb (S, KV, hd), mb (KV, G, T, S)."""
        qg = qb.reshape(T, KV, G, hd).transpose(1, 2, 0, 3)  # (KV, G, T, hd)
        s = dot_general(qg, kb, (((3,), (2,)), ((0,), (1,))), recipe=r.qk,
                        preferred_element_type=jnp.float32, key=jax.random.fold_in(kk, 0),
                        implementation=implementation)  # (KV, G, T, S)
        s = jnp.where(mb, s * jnp.float32(scale), jnp.finfo(jnp.float32).min)
        p = jnp.where(mb, jax.nn.softmax(s, axis=-1), 0.0).astype(p_dtype)
        o = dot_general(p, vb, (((3,), (0,)), ((0,), (1,))), recipe=r.pv,
                        preferred_element_type=jnp.float32, key=jax.random.fold_in(kk, 1),
                        implementation=implementation)  # (KV, G, T, hd)
        return o.transpose(2, 0, 1, 3).reshape(T, H, hd)

    # the sequences' calls are unbatched over the data-parallel axes: each device attends
    # over its own sequences (their scales are per sequence anyway)
    with sharding.data_parallel(None):
        out = jax.vmap(one)(q, k, v, m, keys)
    return out.astype(q.dtype)
