"""A refused ``quantize_model`` call leaves its arguments as they were: the NNX model (its
modules' classes, attributes and state) and the ``rngs`` streams (no key drawn), so that
the corrected call then succeeds and computes what a first call on a fresh model does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp4jax

SR = "nvfp4"  # stochastic rounding: draws from the "fp4" stream
LAYER = "nvfp4(wgrad.hadamard_signs='layer')"  # per-layer RHT signs: the "fp4_layer" stream


class Net(nnx.Module):
    """A parameter-free root (intercepted by quantize_model) holding two covered layers and
    one uncovered module with its own parameter."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(32, 64, rngs=rngs)
        self.down = nnx.Linear(64, 32, rngs=rngs)
        self.gain = Gain(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.gain(self.down(jax.nn.relu(self.up(x))))


class Gain(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.w = nnx.Param(jnp.ones((32,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * self.w[...]


def snapshot(m: nnx.Module) -> tuple:
    """Everything quantize_model could change: each node's class and attribute names, and
    every state leaf's bits."""
    nodes = [(tuple(p), type(n), tuple(sorted(vars(n)))) for p, n in nnx.iter_graph(m)
             if isinstance(n, nnx.Module)]
    leaves = [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                         else x) for x in jax.tree.leaves(nnx.state(m))]
    return nodes, leaves


def same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def rng_counts(rngs: nnx.Rngs) -> list[int]:
    return [int(np.asarray(x)) for x in jax.tree.leaves(nnx.state(rngs, nnx.RngCount))]


@pytest.mark.parametrize("recipe, rngs, match", [
    (SR, None, "pass rngs=nnx.Rngs"),
    (LAYER, None, "pass rngs=nnx.Rngs"),
    # the first stream exists: nothing may be drawn from it before the second is refused
    (LAYER, nnx.Rngs(fp4=1), "no stream 'fp4_layer'"),
    (SR, nnx.Rngs(other=1), "no stream 'fp4'"),
    (SR, {"fp4": 1}, "no stream 'fp4'"),  # not a stream: refused, nothing changed
])
def test_refused_nnx_call_changes_nothing(recipe, rngs, match):
    rules = [fp4jax.nn.Rule(".*", recipe)]
    m = Net(nnx.Rngs(0))
    before = snapshot(m)
    counts = rng_counts(rngs) if isinstance(rngs, nnx.Rngs) else None
    with pytest.raises(ValueError, match=match):
        fp4jax.nn.quantize_model(m, rules, rngs=rngs)
    assert same(snapshot(m), before), "a refused quantize_model changed the model"
    if counts is not None:
        assert rng_counts(rngs) == counts, "a refused quantize_model drew from rngs"
    # the corrected call is accepted, and computes what a fresh model's first call does
    good = dict(fp4=7, fp4_layer=8)
    q = fp4jax.nn.quantize_model(m, rules, rngs=nnx.Rngs(**good))
    fresh = fp4jax.nn.quantize_model(Net(nnx.Rngs(0)), rules, rngs=nnx.Rngs(**good))
    x = jax.random.normal(jax.random.key(3), (16, 32))
    np.testing.assert_array_equal(np.asarray(q(x)), np.asarray(fresh(x)))
    assert not np.array_equal(np.asarray(q(x)), np.asarray(Net(nnx.Rngs(0))(x)))


def test_refused_linen_call_changes_nothing():
    """linen: quantize_model returns a copy; a refusal (rngs given to a linen model) leaves
    the model's class and fields as they were."""
    import flax.linen as nn

    m = nn.Dense(8)
    cls, fields = type(m), (m.features, m.use_bias)
    with pytest.raises(ValueError, match="rngs is for NNX models"):
        fp4jax.nn.quantize_model(m, [(".*", SR)], rngs=nnx.Rngs(fp4=0))
    assert type(m) is cls and (m.features, m.use_bias) == fields
    q = fp4jax.nn.quantize_model(m, [(".*", SR)])
    assert type(m) is cls and type(q) is not cls


class Blk(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(32, 32, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.up(x)


class Act(nnx.Module):
    """A parameter-free module (run under the hooks once quantized)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(x)


class Stacked(nnx.Module):
    """A parameter-free root over a parameter-free activation, three ``nnx.vmap``-stacked
    blocks and a head."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.act = Act()
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Blk(rngs)
        self.blocks = make(rngs)
        self.head = nnx.Linear(32, 8, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.act(x))


def test_refused_stack_rules_change_nothing():
    """Rules that split one stacked layer's blocks between recipes are refused while the
    rules are resolved, before any module (the root included) is changed."""
    m = Stacked(nnx.Rngs(0))
    before = snapshot(m)
    with pytest.raises(ValueError, match="scanned stack of 3 blocks"):
        fp4jax.nn.quantize_model(m, [fp4jax.nn.Rule(r"blocks/(0|2)/up", None),
                                     fp4jax.nn.Rule(".*", SR)], rngs=nnx.Rngs(fp4=0))
    assert same(snapshot(m), before)
    q = fp4jax.nn.quantize_model(m, [fp4jax.nn.Rule(r"head", SR)], rngs=nnx.Rngs(fp4=0))
    assert q is m and type(m) is not Stacked  # quantized now (the root runs under the hooks)
