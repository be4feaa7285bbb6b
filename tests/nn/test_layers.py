"""Tests of fp4jax.nn: linen and NNX layers agree with fp4jax.dot; SR keys; policies."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp4jax
from fp4jax.nn import PrecisionPolicy
from fp4jax.nn import linen as fl
from fp4jax.nn import nnx as fn
from tests.checks import bits_equal

RTN = fp4jax.recipes.nvfp4().replace(sr=False, name="nvfp4-rtn")  # deterministic gradients
SR = fp4jax.recipes.nvfp4()
X = jax.random.normal(jax.random.key(0), (2, 16, 64), jnp.float32)
DN = (((2,), (0,)), ((), ()))


C = jnp.cos(jnp.arange(32.0))


def _fwd_bwd(fn, *args):
    """``fn(*args)`` and the gradient of ``sum(fn(*args) * C)`` in one compiled call."""
    return jax.jit(lambda *a: (fn(*a), jax.grad(lambda *b: jnp.sum(fn(*b) * C),
                                                argnums=tuple(range(len(a))))(*a)))(*args)


def _fwd_bwd_raw(fn, *args):
    return fn(*args), jax.grad(lambda *b: jnp.sum(fn(*b) * C), argnums=tuple(range(len(args))))(
        *args)


def _direct(x, w, recipe, key=None):
    """Output and (dx, dw) computed by fp4jax.dot directly."""
    return _fwd_bwd(lambda x, w: fp4jax.dot(x, w, recipe=recipe, key=key), x, w)


def test_linen_dense_and_dot_general_cls_match_direct():
    dense = nn.Dense(32, use_bias=False, dot_general_cls=functools.partial(fl.DotGeneral,
                                                                            recipe=RTN))
    mine = fl.Dense(32, recipe=RTN)
    params = dense.init(jax.random.key(1), X)
    assert jax.tree.structure(params) == jax.tree.structure(mine.init(jax.random.key(1), X))
    w = params["params"]["kernel"]

    def all_three(x, p):  # one compiled program for the three paths
        return (_fwd_bwd_raw(lambda x, w: fp4jax.dot(x, w, recipe=RTN), x, p["params"]["kernel"]),
                _fwd_bwd_raw(lambda x, p: dense.apply(p, x), x, p),
                _fwd_bwd_raw(lambda x, p: mine.apply(p, x), x, p))

    (y_ref, (dx_ref, dw_ref)), *layers = jax.jit(all_three)(X, params)
    assert not np.allclose(y_ref, X @ w, atol=1e-3)  # really quantized
    for y, (dx, dp) in layers:
        bits_equal(y, y_ref)
        bits_equal(dx, dx_ref)
        bits_equal(dp["params"]["kernel"], dw_ref)


def test_nnx_linear_and_dot_general_match_direct():
    rngs = nnx.Rngs(params=1, fp4=2)
    a = nnx.Linear(64, 32, use_bias=False, dot_general=fn.DotGeneral(RTN, rngs=rngs), rngs=rngs)
    b = fn.Linear(64, 32, recipe=RTN, rngs=nnx.Rngs(params=1, fp4=2))
    bits_equal(a.kernel[...], b.kernel[...])
    (ga, sa), (gb, sb) = nnx.split(a), nnx.split(b)

    def all_three(x, sa, sb):
        return (_fwd_bwd_raw(lambda x, w: fp4jax.dot(x, w, recipe=RTN), x, sa["kernel"][...]),
                _fwd_bwd_raw(lambda x, s: nnx.merge(ga, s)(x), x, sa),
                _fwd_bwd_raw(lambda x, s: nnx.merge(gb, s)(x), x, sb))

    (y_ref, (dx_ref, dw_ref)), *layers = jax.jit(all_three)(X, sa, sb)
    for y, (dx, ds) in layers:
        bits_equal(y, y_ref)
        bits_equal(dx, dx_ref)
        bits_equal(ds["kernel"][...], dw_ref)
    bits_equal(b(X), y_ref)  # and eagerly, through the module itself


def test_linen_sr_keys_per_layer_and_step_reproducible():
    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            # two layers with identical weights and inputs: only their SR keys differ
            init = nn.initializers.constant(0.01)
            return (fl.Dense(32, recipe=SR, kernel_init=init, name="a")(x),
                    fl.Dense(32, recipe=SR, kernel_init=init, name="b")(x))

    m = Two()
    params = m.init(jax.random.key(0), X)

    @jax.jit
    def grads(key):
        def f(p):
            ya, yb = m.apply(p, X, rngs={"fp4": key})
            return jnp.sum(ya * C) + jnp.sum(yb * C) * 2.0
        g = jax.grad(f)(params)["params"]
        return g["a"]["kernel"], g["b"]["kernel"] / 2.0

    k0 = jax.random.key(7)
    ga, gb = grads(k0)
    assert not np.array_equal(ga, gb)  # different layers, different keys
    ga2, _ = grads(k0)
    bits_equal(ga, ga2)  # reproducible
    ga3, _ = grads(jax.random.fold_in(k0, 1))
    assert not np.array_equal(ga, ga3)  # different step, different key

    # the layer's gradient is fp4jax.dot's with the key drawn from the stream at its path
    class Probe(nn.Module):
        @nn.compact
        def __call__(self):
            return _KeyOf(name="DotGeneral_0")()

    class ProbeTwo(nn.Module):
        @nn.compact
        def __call__(self):
            return Probe(name="a")()

    key_a = ProbeTwo().apply({}, rngs={"fp4": k0})
    w = params["params"]["a"]["kernel"]
    _, (_, dw) = _direct(X, w, SR, key_a)
    bits_equal(ga, dw)
    with pytest.raises(ValueError, match="rngs="):
        m.apply(params, X)


class _KeyOf(nn.Module):
    def __call__(self):
        return self.make_rng("fp4")


def test_nnx_sr_keys_advance():
    layer = fn.Linear(64, 32, recipe=SR, rngs=nnx.Rngs(params=0, fp4=5))
    grad = nnx.jit(lambda m: nnx.grad(lambda m: jnp.sum(m(X) * C))(m).kernel[...])
    g1 = grad(layer)
    g2 = grad(layer)
    assert not np.array_equal(g1, g2)  # the stream's counter advanced between calls
    again = fn.Linear(64, 32, recipe=SR, rngs=nnx.Rngs(params=0, fp4=5))
    bits_equal(grad(again), g1)
    with pytest.raises(ValueError, match="rngs"):
        fn.DotGeneral(SR)


def test_policy_counts_and_summary():
    layers = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")
    pol = PrecisionPolicy(SR, first_high_precision=2, last_high_precision=8)
    assert pol.count(62, layers) == (52 * 7, 62 * 7 + 1)
    assert pol.summary(62, layers).startswith("364 of 435 linear layers in NVFP4 (84%)")
    assert pol.recipe_for(0, 62, "attn.q") is None
    assert pol.recipe_for(2, 62, "attn.q") == SR
    assert pol.recipe_for(53, 62, "attn.q") == SR and pol.recipe_for(54, 62, "attn.q") is None
    pol2 = PrecisionPolicy(SR, high_precision_layers=("mlp.*",))
    assert pol2.count(4, layers) == (16, 29)
    assert PrecisionPolicy(fp4jax.recipes.bf16()).count(4, layers) == (0, 29)
    assert "all high precision" in PrecisionPolicy(fp4jax.recipes.bf16()).summary(4, layers)
    with pytest.raises(ValueError):
        PrecisionPolicy(SR, first_high_precision=-1)


def test_policy_counts_match_model():
    """The summary's count equals the number of quantizing matmuls the model really runs."""
    from fp4jax.models import LlamaConfig, quantized_llama

    for ffn, first, last in (("relu2", 1, 1), ("swiglu", 0, 2)):
        cfg = LlamaConfig(d_model=32, n_layers=5, n_heads=2, n_kv_heads=1, d_ff=64, ffn=ffn)
        pol = PrecisionPolicy(RTN, first_high_precision=first, last_high_precision=last)
        model = quantized_llama(cfg, pol)
        seen = []

        def spy(next_fun, args, kwargs, context, seen=seen):
            if isinstance(context.module, fl.DotGeneral) and context.method_name == "__call__":
                seen.append(context.module.recipe)
            return next_fun(*args, **kwargs)

        tokens = jnp.zeros((1, 8), jnp.int32)
        params = jax.eval_shape(model.init, jax.random.key(0), tokens)
        with nn.intercept_methods(spy):  # tracing runs the modules' Python: no compute needed
            jax.eval_shape(model.apply, params, tokens)
        q, total = pol.count(cfg.n_layers, cfg.linear_layers)
        assert len(seen) == q == (cfg.n_layers - first - last) * len(cfg.linear_layers)
        assert all(r == RTN for r in seen)
        assert pol.summary(cfg.n_layers, cfg.linear_layers).startswith(
            f"{q} of {total} linear layers")


def test_recipe_by_name_and_missing_rng_stream():
    x = jnp.ones((4, 64))
    m = fl.Dense(32, recipe="nvfp4")  # a name, resolved like fp4jax.dot does
    p = m.init({"params": jax.random.key(0), "fp4": jax.random.key(1)}, x)
    assert m.apply(p, x, rngs={"fp4": jax.random.key(2)}).shape == (4, 32)
    with pytest.raises(ValueError, match="needs the RNG stream 'fp4'"):
        fn.Linear(64, 32, recipe="nvfp4", rngs=nnx.Rngs(params=0))
    with pytest.raises(ValueError, match="valid names"):
        fl.Dense(32, recipe="nvfp5").init({"params": jax.random.key(0)}, x)
