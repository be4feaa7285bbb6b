"""Language models written as a user writes them, with no fp4jax in them, for the harness's
``--model MODULE:FACTORY`` tests (``tests/train/test_harness.py``): a linen model with
``DenseGeneral`` attention projections and ``nn.Einsum`` MLPs, and an NNX model with
``nnx.Linear`` attention and ``nnx.Einsum`` MLPs. Each factory follows the protocol of
``fp4jax.train.models.FACTORY_PROTOCOL``: ``factory(vocab_size, seq_len, **kwargs)``
(NNX: and ``rngs``)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``q, k, v (B, T, H, hd)`` -> ``(B, T, H, hd)``: softmax attention, causal."""
    T, hd = q.shape[1], q.shape[-1]
    s = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(hd).astype(q.dtype)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


class LinenBlock(nn.Module):
    d_model: int
    n_heads: int
    d_ff: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        hd = self.d_model // self.n_heads
        h = nn.LayerNorm(name="ln_attn")(x)
        q, k, v = (nn.DenseGeneral((self.n_heads, hd), use_bias=False, name=n)(h)
                   for n in ("query", "key", "value"))
        a = causal_attention(q, k, v)
        x = x + nn.DenseGeneral(self.d_model, axis=(-2, -1), use_bias=False, name="out")(a)
        h = nn.LayerNorm(name="ln_mlp")(x)
        h = nn.Einsum((self.d_model, self.d_ff), "btd,df->btf", use_bias=False, name="wi")(h)
        h = nn.Einsum((self.d_ff, self.d_model), "btf,fd->btd", use_bias=False,
                      name="wo")(nn.gelu(h))
        return x + h


class LinenLM(nn.Module):
    vocab_size: int
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 2
    d_ff: int = 64

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab_size, self.d_model, name="embed")(tokens)
        for i in range(self.n_layers):
            x = LinenBlock(self.d_model, self.n_heads, self.d_ff, name=f"layers_{i}")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        return nn.Dense(self.vocab_size, use_bias=False, name="lm_head")(x)


def linen_lm(vocab_size: int, seq_len: int, **kwargs) -> LinenLM:
    """A linen language model (``DenseGeneral`` attention, ``nn.Einsum`` MLP)."""
    return LinenLM(vocab_size, **kwargs)


class NnxBlock(nnx.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, *, rngs: nnx.Rngs) -> None:
        self.n_heads = n_heads
        self.ln_attn = nnx.LayerNorm(d_model, rngs=rngs)
        self.q = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)
        self.ln_mlp = nnx.LayerNorm(d_model, rngs=rngs)
        self.up = nnx.Einsum("btd,df->btf", (d_model, d_ff), rngs=rngs)
        self.down = nnx.Einsum("btf,fd->btd", (d_ff, d_model), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        B, T, D = x.shape
        h = self.ln_attn(x)
        q, k, v = (f(h).reshape(B, T, self.n_heads, -1) for f in (self.q, self.k, self.v))
        x = x + self.o(causal_attention(q, k, v).reshape(B, T, D))
        return x + self.down(nnx.gelu(self.up(self.ln_mlp(x))))


def _module_list(items: list) -> list:
    return nnx.List(items) if hasattr(nnx, "List") else items


class NnxLM(nnx.Module):
    def __init__(self, vocab_size: int, d_model: int = 32, n_layers: int = 2,
                 n_heads: int = 2, d_ff: int = 64, *, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs)
        self.layers = _module_list([NnxBlock(d_model, n_heads, d_ff, rngs=rngs)
                                    for _ in range(n_layers)])
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.lm_head = nnx.Linear(d_model, vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


def nnx_lm(vocab_size: int, seq_len: int, *, rngs: nnx.Rngs, **kwargs) -> NnxLM:
    """An NNX language model (``Linear`` attention, ``nnx.Einsum`` MLP)."""
    return NnxLM(vocab_size, **kwargs, rngs=rngs)
