"""A mixture-of-experts FFN for the Llama (``LlamaConfig(n_experts=G, top_k=k)``).

Token-choice top-k routing, dropless (every token reaches its k experts; no capacity
factor): a float32 router ``h @ W_r`` -> softmax -> the k most probable experts per token
(``route``); the token copies are sorted by expert and run through the experts' FFN as
grouped GEMMs, ``jax.lax.ragged_dot`` over weights ``(G, K, N)`` (``Experts``: SwiGLU
``down(silu(gate(x)) * up(x))`` or squared ReLU, as the dense blocks); each token's output
is the gate-weighted sum of its k experts' outputs. A load-balancing auxiliary loss
(``load_balancing_loss``, Switch Transformer's) is sown into the collection
``AUX_COLLECTION``; add it to the training loss (``aux_loss``).

Precision: the experts' weights are module parameters used by ``jax.lax.ragged_dot``, so
precision rules reach them like any linear layer (``fp4jax.nn.quantize_model``: the weight
role of every expert, ``fp4jax.ragged_dot``); with the Llama they sit at the dense FFN's
paths, ``block_{i}/gate``, ``block_{i}/up``, ``block_{i}/down``, so a ``PrecisionPolicy``
applies unchanged. The router (``block_{i}/router``) stays in high precision under the
Llama's policy rules (``ROUTER_RULE``); routing decisions are discrete, and ST-MoE (Zoph et
al. 2022, arXiv 2202.08906, sec. 3 "selective precision") keeps the router in float32 for
stability.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["AUX_COLLECTION", "Experts", "Router", "aux_loss", "load_balancing_loss",
           "moe_ffn", "route"]

AUX_COLLECTION = "moe_losses"
"""The variable collection the routers sow their weighted load-balancing losses into."""


def route(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k routing with softmax gates.

    ``probs = softmax(logits)`` over the experts (float32); each token's ``top_k`` most
    probable experts ``idx``; gates: for ``top_k == 1`` the probability itself (Switch
    Transformer, Fedus et al. 2021, arXiv 2101.03961, sec. 2.1: ``y = p_i(x) E_i(x)``, so
    the router is trained through the output), for ``top_k > 1`` the k probabilities
    renormalized to sum to 1 (Mixtral, Jiang et al. 2024, arXiv 2401.04088, sec. 2.1:
    ``Softmax(TopK(x W_g))``, the same values).

    Args:
      logits: ``(S, G)`` router logits (float32).
      top_k: experts per token, ``1 <= top_k <= G``.
    Returns:
      ``(gates (S, k) float32, idx (S, k) int32, probs (S, G) float32)``.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    vals, idx = jax.lax.top_k(probs, top_k)
    gates = vals if top_k == 1 else vals / jnp.sum(vals, axis=-1, keepdims=True)
    return gates, idx.astype(jnp.int32), probs


def load_balancing_loss(probs: jax.Array, idx: jax.Array) -> jax.Array:
    """Switch Transformer's auxiliary load-balancing loss (Fedus et al. 2021, arXiv
    2101.03961, sec. 2.2, eq. 4-6): ``G * sum_i f_i * P_i`` with ``f_i`` the fraction of
    routing assignments that go to expert ``i`` (of the ``S * k`` assignments, so top-k
    counts each of a token's k choices, as GShard's and Mixtral's implementations do) and
    ``P_i`` the mean router probability of expert ``i`` over the ``S`` tokens. 1 at a
    uniform load; gradients flow through ``P`` only (``f`` counts).

    Args:
      probs: ``(S, G)`` router probabilities; idx: ``(S, k)`` chosen experts.
    Returns:
      float32 scalar (unweighted: multiply by the coefficient, ``alpha = 0.01`` in Switch).
    """
    G = probs.shape[-1]
    f = jnp.bincount(idx.reshape(-1), length=G).astype(jnp.float32) / idx.size
    return G * jnp.sum(f * jnp.mean(probs, axis=0))


class Router(nn.Module):
    """The router: float32 logits ``h @ kernel``, ``kernel (D, G)``; routes (``route``) and
    sows ``aux_weight * load_balancing_loss`` as ``AUX_COLLECTION/aux`` (when that collection
    is mutable). ``__call__(h (S, D)) -> (gates (S, k), idx (S, k))``."""

    n_experts: int
    top_k: int
    aux_weight: float = 0.01
    init_std: float = 0.02

    @nn.compact
    def __call__(self, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        kernel = self.param("kernel", nn.initializers.normal(self.init_std),
                            (h.shape[-1], self.n_experts), jnp.float32)
        logits = jax.lax.dot_general(h.astype(jnp.float32), kernel, (((1,), (0,)), ((), ())))
        gates, idx, probs = route(logits, self.top_k)
        self.sow(AUX_COLLECTION, "aux", self.aux_weight * load_balancing_loss(probs, idx))
        return gates, idx


class Experts(nn.Module):
    """``n_experts`` linear layers of one FFN projection as one parameter ``kernel (G, K,
    features)`` (float32 master weights) and one grouped GEMM:
    ``jax.lax.ragged_dot(x (M, K), kernel, group_sizes) -> (M, features)`` in ``dtype``,
    ``x``'s rows sorted by expert. Precision rules quantize it (``fp4jax.ragged_dot``)."""

    n_experts: int
    features: int
    init_std: float = 0.02
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        kernel = self.param("kernel", nn.initializers.normal(self.init_std),
                            (self.n_experts, x.shape[-1], self.features), jnp.float32)
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        return jax.lax.ragged_dot(x, kernel, group_sizes)


def moe_ffn(h: jax.Array, *, n_experts: int, top_k: int, d_ff: int, gated: bool,
            dtype: Any, init_std: float, out_std: float, aux_weight: float) -> jax.Array:
    """The mixture-of-experts FFN of ``h (B, T, D)`` -> ``(B, T, D)`` in ``dtype``, its modules
    (``router``, ``up``, ``gate`` when ``gated``, ``down``) created in the calling module's
    scope (call it from a compact method: the Llama's ``Block``).

    Dropless token-choice routing: the ``S * k`` (token, expert) assignments are sorted by
    expert (stable: tokens in order within an expert), gathered, run through the experts
    (``group_sizes`` = assignments per expert), put back in token order and combined with
    the gates in float32."""
    B, T, D = h.shape
    x = h.reshape(B * T, D)
    gates, idx = Router(n_experts, top_k, aux_weight, init_std, name="router")(x)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x[order // top_k]
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    up = Experts(n_experts, d_ff, init_std, dtype, name="up")(xs, sizes)
    if gated:
        f = nn.silu(Experts(n_experts, d_ff, init_std, dtype, name="gate")(xs, sizes)) * up
    else:
        f = jnp.square(nn.relu(up))
    out = Experts(n_experts, D, out_std, dtype, name="down")(f, sizes)
    out = out[jnp.argsort(order)].reshape(B * T, top_k, D)
    y = jnp.sum(out.astype(jnp.float32) * gates[..., None], axis=1)
    return y.astype(dtype).reshape(B, T, D)


def aux_loss(state: Any) -> jax.Array:
    """The sum of the load-balancing losses sown into ``AUX_COLLECTION`` (the mutable state
    ``model.apply(..., mutable=[AUX_COLLECTION])`` returns, or its ``AUX_COLLECTION`` entry);
    0.0 when there are none (a dense model)."""
    if isinstance(state, dict) and AUX_COLLECTION in state:
        state = state[AUX_COLLECTION]
    leaves = jax.tree.leaves(state)
    return sum((jnp.sum(v) for v in leaves), jnp.float32(0.0))
