"""Which operand of a product is a module's weight, on models written outside the project
(issue 34): the parameter itself or a cast copy of it is; an activation that merely has a
parameter's shape is not (it used to be taken for one: a layer left unquantized when its
input had the shape of its transposed kernel, a product of two activations quantized);
NNX methods besides ``__call__`` (``nnx.Embed.attend``) run under the rules; an NNX model
cannot be quantized twice; ``report`` names NNX modules and tells activation products from
uncovered layers by the traced operands' provenance."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp4jax
from fp4jax.nn import Rule, quantize_model, report
from fp4jax.nn import linen as fnn

NV = fp4jax.recipes.nvfp4()


def _grads(model, params, x, key):
    def loss(p):
        return jnp.sum(model.apply(p, x, rngs={"fp4": key}) ** 2)
    return jax.jit(jax.value_and_grad(loss))(params)


class MLP(nn.Module):
    """Two Dense layers; ``wired``: fc1 hand-wired with fp4jax's product (the twin)."""

    dtype: jnp.dtype | None = None
    wired: bool = False

    @nn.compact
    def __call__(self, x):
        kw = ({"dot_general_cls": functools.partial(fnn.DotGeneral, recipe=NV)}
              if self.wired else {})
        h = nn.relu(nn.Dense(32, dtype=self.dtype, name="fc1", **kw)(x))
        return nn.Dense(16, dtype=self.dtype, name="fc2")(h)


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_a_layer_whose_input_has_its_transposed_kernels_shape_is_quantized(dtype):
    # 32 rows of 16 features into Dense(32): the input (32, 16) has the shape of fc1's
    # kernel (16, 32) transposed; with dtype=bfloat16 the kernel reaches the product as a
    # cast copy (Flax's promote_dtype), so only its dtype tells it from the input
    x = jax.random.normal(jax.random.key(0), (32, 16))
    plain = MLP(dtype=dtype)
    params = plain.init(jax.random.key(1), x)
    q = quantize_model(plain, [Rule("fc1", NV), Rule(".*", None)])
    got = _grads(q, params, x, jax.random.key(2))
    np.testing.assert_array_equal(got[0], _grads(MLP(dtype=dtype, wired=True), params, x,
                                                 jax.random.key(2))[0])
    jax.tree.map(np.testing.assert_array_equal, got[1],
                 _grads(MLP(dtype=dtype, wired=True), params, x, jax.random.key(2))[1])
    assert got[0] != _grads(plain, params, x, jax.random.key(2))[0]
    rep = report(q, x)
    assert rep.layers["fc1"]["recipe"] == "nvfp4" and not rep.uncovered
    assert not rep.unused_rules


class Mix(nn.Module):
    """A (T, T) parameter (a learned bias of the attention scores) beside a product of two
    activations of the same (T, T) shape: softmax scores times the values."""

    @nn.compact
    def __call__(self, x):  # x (T=16, D=32): one example, unbatched
        bias = self.param("bias", nn.initializers.normal(0.1), (16, 16))
        s = jax.nn.softmax(jnp.einsum("td,sd->ts", x, x) + bias)
        return jnp.einsum("ts,sd->td", s, x)


def test_an_activation_shaped_like_a_parameter_is_not_a_weight():
    x = jax.random.normal(jax.random.key(0), (16, 32))
    plain = Mix()
    params = plain.init(jax.random.key(1), x)
    q = quantize_model(plain, [Rule(".*", "nvfp4")])
    np.testing.assert_array_equal(q.apply(params, x, rngs={"fp4": jax.random.key(2)}),
                                  plain.apply(params, x))
    rep = report(q, x)
    assert rep.layers == {}
    assert rep.uncovered == ["/: einsum (16, 16) x (16, 32) (an operand has the shape and "
                             "dtype of the module's parameter but is not it: not quantized)"]
    assert rep.activation_products == ["/: einsum (16, 32) x (16, 32)"]


class Tied(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(64, 32, rngs=rngs)

    def __call__(self, t):
        return self.embed.attend(self.embed(t))


def test_nnx_embed_attend_runs_under_the_rules():
    t = jax.random.randint(jax.random.key(3), (2, 16), 0, 64)
    base = Tied(nnx.Rngs(0))
    q = quantize_model(Tied(nnx.Rngs(0)), [Rule("embed", "nvfp4(sr=False)")],
                       rngs=nnx.Rngs(fp4=1))
    emb = base.embed.embedding[...]
    want = fp4jax.dot(base.embed(t), emb.T, recipe=fp4jax.recipes.parse("nvfp4(sr=False)"))
    np.testing.assert_array_equal(q(t), want)
    rep = report(q, t)
    assert {p: d["recipe"] for p, d in rep.layers.items()} == {"embed": "nvfp4"}
    assert rep.layers["embed"]["weight"] == (32, 64) and not rep.uncovered


def test_an_nnx_model_quantized_twice_is_refused():
    m = quantize_model(Tied(nnx.Rngs(0)), [Rule(".*", "nvfp4")], rngs=nnx.Rngs(fp4=1))
    for again in (m, nnx.clone(m)):
        with pytest.raises(ValueError, match="already quantized.*nnx.clone of the original"):
            quantize_model(again, [Rule(".*", None)], rngs=nnx.Rngs(fp4=1))


class WithAttention(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=32, decode=False,
                                           rngs=rngs)
        self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 32)))

    def __call__(self, x):
        return self.attn(x) @ self.w  # '@' is not reached by the hooks


def test_nnx_report_paths_and_activation_products():
    x = jax.random.normal(jax.random.key(0), (2, 16, 32))
    q = quantize_model(WithAttention(nnx.Rngs(0)), [Rule(".*", "nvfp4")],
                       rngs=nnx.Rngs(fp4=1))
    rep = report(q, x)
    assert sorted(rep.layers) == ["attn/key", "attn/out", "attn/query", "attn/value"]
    # the attention scores (inside jax.nn's attention, not seen by a hook) are products of
    # two activations; the '@' on the model's own parameter is an uncovered layer
    assert [a.split(":")[0] for a in rep.activation_products] == ["attn", "attn"]
    assert rep.uncovered == ["/: dot_general (2, 16, 32) x (32, 32) (not seen by a hook: "
                             "an '@', a jitted helper or lax.dot_general imported by name)"]


def test_linen_report_counts_activation_products_on_every_call():
    # the attention scores run in jnp.einsum's jit, traced once per process: the report
    # reads them from the traced program, so a second report (a cached trace) counts them
    class MHA(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(x, x)

    x = jax.random.normal(jax.random.key(7), (2, 16, 32))
    q = quantize_model(MHA(), [Rule(".*", "nvfp4")])
    first, second = report(q, x), report(q, x)
    assert len(first.activation_products) == 2
    assert second.activation_products == first.activation_products
    assert sorted(first.layers) == ["attn/key", "attn/out", "attn/query", "attn/value"]


class TwoWeightBlock(nn.Module):
    """A block that multiplies two of its own parameters: ``w_in`` first, then ``kernel``."""

    @nn.compact
    def __call__(self, x, _):
        w_in = self.param("w_in", nn.initializers.lecun_normal(), (32, 64))
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (64, 32))
        h = jax.nn.gelu(jnp.einsum("btd,df->btf", x, w_in))
        return x + jnp.einsum("btf,fd->btd", h, kernel), None


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.scan(TwoWeightBlock, variable_axes={"params": 0},
                       split_rngs={"params": True}, length=3)(name="blocks")(x, None)[0]


class MixRanks(nn.Module):
    """A 2-D and a 3-D weight in one module (the 3-D one is one layer, not a stack)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (32, 64))
        k = self.param("kernel", nn.initializers.lecun_normal(), (2, 32, 64))
        return jnp.einsum("btd,hdf->bthf", x, k) * jnp.einsum("btd,df->btf", x, w)[:, :, None]


def test_report_scan_axes_know_every_weight_of_a_module():
    x = jnp.ones((2, 16, 32))
    q = quantize_model(Stack(), [Rule(".*", "nvfp4")])
    p = q.init(jax.random.key(0), x)["params"]
    rep = report(q, x)
    assert rep.layers["blocks"]["weights"] == [(32, 64), (64, 32)]
    assert rep.scan_axes(("blocks",), p["blocks"]["kernel"].shape) == 1  # (3, 64, 32)
    assert rep.scan_axes(("params", "blocks"), p["blocks"]["w_in"].shape) == 1
    mix = report(quantize_model(MixRanks(), [Rule(".*", "nvfp4")]), x)
    assert mix.scan_axes(("",), (2, 32, 64)) == 0 and mix.scan_axes(("",), (32, 64)) == 0
