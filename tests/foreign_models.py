"""Language models in the styles of public packages nobody on fp4jax wrote, with no fp4jax in
them: weights under any name, shared scopes, remat, block-diagonal einsums, structured
outputs, a scanned pure function. For the tests of ``quantize_model``/``quantize_function``,
the harness's ``--model`` and its layer count (``tests/train/test_foreign_models.py``).

* ``SharedScopeLM`` (linen): a tied embedding / LM head (``Embed.attend``); an FFN whose
  up projection (``nn.Dense``) shares the FFN's scope (``nn.share_scope``), its down
  projection the FFN's own parameter ``w_down`` through ``jnp.einsum``; attention
  projections ``DenseGeneral``. Linear products per block: q, k, v, o, up, down (6).
* ``BlockDiagLM`` (linen): blocks under ``nn.remat``, each a setup-style module whose gate is
  a block-diagonal einsum with a batch axis on the weight (``"btgi,gio->btgo"``, weight
  ``(G, d/G, d/G)`` named ``gates``) and a ``nn.Einsum`` projection; returns an ``Output``
  dataclass and needs positions (``(model, call)`` factory: ``block_diag_lm``).
* ``NnxPosLM`` (NNX): needs positions and returns an ``Output``; its factory takes ``rngs``
  and returns ``(model, call)`` (``nnx_pos_lm``).
* ``scanned_mlp``: an Equinox-style pure function, ``fn(params, tokens)`` whose layers are
  stacked ``(L, ...)`` and run by ``lax.scan`` (for ``fp4jax.nn.quantize_function``).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from tests.harness_models import causal_attention


class SharedFFN(nn.Module):
    d_model: int
    d_ff: int

    def setup(self) -> None:
        self.up = nn.Dense(self.d_ff, use_bias=False)
        nn.share_scope(self, self.up)  # up's kernel lives in this module's scope
        self.w_down = self.param("w_down", nn.initializers.lecun_normal(),
                                 (self.d_ff, self.d_model))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("btf,fd->btd", nn.gelu(self.up(x)), self.w_down)


class SharedBlock(nn.Module):
    d_model: int
    n_heads: int
    d_ff: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        hd = self.d_model // self.n_heads
        h = nn.RMSNorm(name="norm_attn")(x)
        q, k, v = (nn.DenseGeneral((self.n_heads, hd), use_bias=False, name=n)(h)
                   for n in ("q_proj", "k_proj", "v_proj"))
        x = x + nn.DenseGeneral(self.d_model, axis=(-2, -1), use_bias=False,
                                name="o_proj")(causal_attention(q, k, v))
        return x + SharedFFN(self.d_model, self.d_ff, name="ffn")(nn.RMSNorm(name="norm_ffn")(x))


class SharedScopeLM(nn.Module):
    vocab_size: int
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 2
    d_ff: int = 64

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab_size, self.d_model, name="wte")
        x = embed(tokens)
        for i in range(self.n_layers):
            x = SharedBlock(self.d_model, self.n_heads, self.d_ff, name=f"h_{i}")(x)
        return embed.attend(nn.RMSNorm(name="norm_f")(x))  # tied LM head


def shared_scope_lm(vocab_size: int, seq_len: int, **kwargs) -> SharedScopeLM:
    """``SharedScopeLM`` (6 linear products a block)."""
    return SharedScopeLM(vocab_size, **kwargs)


@dataclasses.dataclass
class Output:
    """What ``BlockDiagLM`` returns, as many public models do."""

    logits: jax.Array
    hidden: jax.Array


class BlockDiagCell(nn.Module):
    d_model: int
    n_groups: int

    def setup(self) -> None:
        g = self.n_groups
        self.gates = self.param("gates", nn.initializers.normal(0.2),
                                (g, self.d_model // g, self.d_model // g))
        self.proj = nn.Einsum((self.d_model, self.d_model), "btd,de->bte", use_bias=False)
        self.norm = nn.LayerNorm()

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.norm(x).reshape(b, t, self.n_groups, d // self.n_groups)
        gate = jnp.einsum("btgi,gio->btgo", h, self.gates).reshape(b, t, d)
        return x + self.proj(jax.nn.sigmoid(gate) * x)


class BlockDiagLM(nn.Module):
    vocab_size: int
    d_model: int = 32
    n_layers: int = 2
    n_groups: int = 4

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array) -> Output:
        x = nn.Embed(self.vocab_size, self.d_model, name="embed")(tokens)
        x = x + nn.Embed(4096, self.d_model, name="pos_embed")(positions)
        cell = nn.remat(BlockDiagCell)
        for i in range(self.n_layers):
            x = cell(self.d_model, self.n_groups, name=f"cell_{i}")(x)
        logits = nn.Dense(self.vocab_size, use_bias=False, name="lm_head")(x)
        return Output(logits=logits, hidden=x)


def call_block_diag(model: BlockDiagLM, tokens: jax.Array) -> jax.Array:
    """How the harness calls ``BlockDiagLM``: positions made here, logits taken from the
    ``Output``."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return model(tokens, positions).logits


def block_diag_lm(vocab_size: int, seq_len: int, **kwargs):
    """``(BlockDiagLM, call_block_diag)``: a model returning a dataclass and needing
    positions, with the function that calls it on token ids (``--model`` protocol)."""
    return BlockDiagLM(vocab_size, **kwargs), call_block_diag


def block_diag_lm_bare(vocab_size: int, seq_len: int, **kwargs) -> BlockDiagLM:
    """``BlockDiagLM`` alone (the harness must refuse it with a clear error)."""
    return BlockDiagLM(vocab_size, **kwargs)


class NnxPosLM(nnx.Module):
    """An NNX language model needing positions and returning an ``Output``: token and
    position embeddings, two blocks of an up and a down ``nnx.Linear``, an LM head."""

    def __init__(self, vocab_size: int, seq_len: int, d: int = 32, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab_size, d, rngs=rngs)
        self.pos = nnx.Embed(seq_len, d, rngs=rngs)
        self.ups = nnx.List([nnx.Linear(d, 2 * d, rngs=rngs) for _ in range(2)]) if hasattr(
            nnx, "List") else [nnx.Linear(d, 2 * d, rngs=rngs) for _ in range(2)]
        self.downs = nnx.List([nnx.Linear(2 * d, d, rngs=rngs) for _ in range(2)]) if hasattr(
            nnx, "List") else [nnx.Linear(2 * d, d, rngs=rngs) for _ in range(2)]
        self.lm_head = nnx.Linear(d, vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array) -> Output:
        x = self.embed(tokens) + self.pos(positions)
        for up, down in zip(self.ups, self.downs, strict=True):
            x = x + down(jax.nn.gelu(up(x)))
        return Output(logits=self.lm_head(x), hidden=x)


def call_nnx_pos(model: NnxPosLM, tokens: jax.Array) -> jax.Array:
    """How the harness calls ``NnxPosLM``: positions made here, logits taken out."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return model(tokens, positions).logits


def nnx_pos_lm(vocab_size: int, seq_len: int, *, rngs: nnx.Rngs):
    """``(NnxPosLM, call_nnx_pos)``: an NNX factory (it takes ``rngs``) returning the model
    and the function that calls it on token ids (``--model`` protocol)."""
    return NnxPosLM(vocab_size, seq_len, rngs=rngs), call_nnx_pos


def nnx_pos_lm_bare(vocab_size: int, seq_len: int, *, rngs: nnx.Rngs) -> NnxPosLM:
    """``NnxPosLM`` alone (the harness must refuse it with a clear error)."""
    return NnxPosLM(vocab_size, seq_len, rngs=rngs)


class TupleLM(nn.Module):
    """``SharedScopeLM``'s logits in a ``(logits, aux)`` tuple."""

    vocab_size: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = SharedScopeLM(self.vocab_size, n_layers=1, name="lm")(tokens)
        return logits, jnp.zeros(())


def tuple_lm(vocab_size: int, seq_len: int):
    """``(TupleLM, call)``: the logits are the tuple's first element."""
    return TupleLM(vocab_size), lambda m, tokens: m(tokens)[0]


def scanned_mlp_params(key: jax.Array, vocab: int = 64, d: int = 32, f: int = 64,
                       n_layers: int = 3) -> dict:
    """Parameters of ``scanned_mlp``: the layers' weights stacked ``(n_layers, ...)``."""
    k = jax.random.split(key, 4)
    return {"embed": jax.random.normal(k[0], (vocab, d)) * 0.5,
            "layers": {"w_in": jax.random.normal(k[1], (n_layers, d, f)) / d ** 0.5,
                       "w_out": jax.random.normal(k[2], (n_layers, f, d)) / f ** 0.5},
            "head": jax.random.normal(k[3], (d, vocab)) / d ** 0.5}


def scanned_mlp(params: dict, tokens: jax.Array) -> jax.Array:
    """An Equinox-style model as a pure function: embedding, ``lax.scan`` over the stacked
    residual MLP layers (scopes ``layers/mlp_in``, ``layers/mlp_out``), LM head
    (``head``)."""
    x = params["embed"][tokens]

    def layer(h, w):
        with jax.named_scope("mlp_in"):
            u = jax.nn.gelu(h @ w["w_in"])
        with jax.named_scope("mlp_out"):
            return h + u @ w["w_out"], None

    with jax.named_scope("layers"):
        x, _ = jax.lax.scan(layer, x, params["layers"])
    with jax.named_scope("head"):
        return x @ params["head"]
