"""RHT sign policies: one global vector (TE), one per layer (``hadamard_signs="layer"``,
torchao's), re-drawn every call (``"random"``, Quartet II's); through fp4jax.dot, the Flax
layers (linen, NNX, the scanned Llama) and the training step."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp4jax
from fp4jax.models.llama import get_preset, quantized_llama
from fp4jax.nn import linen as fl
from fp4jax.nn import nnx as fn

LAYER = fp4jax.recipes.parse("nvfp4(wgrad.hadamard_signs=layer)")
X = jax.random.normal(jax.random.key(1), (64, 48), jnp.float32)
W = jax.random.normal(jax.random.key(2), (48, 32), jnp.float32)
KEY, LKEY = jax.random.key(3), jax.random.key(4)


def _grads(recipe, **kw):
    f = jax.jit(jax.value_and_grad(
        lambda x, w: jnp.sum(jnp.sin(fp4jax.dot(x, w, recipe=recipe, key=KEY, **kw))), (0, 1)))
    return f(X, W)


def _layer_signs(rht_key, size=16):
    """The documented rule: the wgrad signs are Rademacher draws from
    ``fold_in(rht_key, 8)`` (8 = the wgrad RHT's fold_in index)."""
    return np.asarray(jax.random.rademacher(jax.random.fold_in(rht_key, 8), (size,),
                                            jnp.float32))


@pytest.mark.parametrize("size", [16, 128])
def test_layer_signs_are_the_fixed_vector_drawn_from_rht_key(size):
    """Bit for bit the recipe with that vector spelled out as a tuple (the tuple path is the
    one tested against the NumPy RHT reference)."""
    base = LAYER.replace(**{"wgrad.hadamard": size})
    got = _grads(base, rht_key=LKEY)
    ref = _grads(base.replace(**{"wgrad.hadamard_signs": tuple(_layer_signs(LKEY, size))}))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = _grads(base, rht_key=jax.random.key(5))
    assert not np.array_equal(np.asarray(got[1][1]), np.asarray(other[1][1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(other[0]))  # forward: no RHT


def test_rht_key_required_and_checked():
    with pytest.raises(ValueError, match="rht_key="):
        fp4jax.dot(X, W, recipe=LAYER, key=KEY)
    with pytest.raises(TypeError, match="rht_key must be a jax PRNG key"):
        fp4jax.dot(X, W, recipe=LAYER, key=KEY, rht_key=3)
    with pytest.raises(ValueError, match="rht_key must be one PRNG key"):
        fp4jax.dot(X, W, recipe=LAYER, key=KEY, rht_key=jax.random.split(LKEY))
    # recipes without per-layer signs ignore it: same bits as without
    a = _grads(fp4jax.recipes.nvfp4(), rht_key=LKEY)
    b = _grads(fp4jax.recipes.nvfp4())
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_spec_and_str():
    assert LAYER == fp4jax.recipes.nvfp4().replace(**{"wgrad.hadamard_signs": "layer"})
    assert LAYER.needs_layer_key and not fp4jax.recipes.nvfp4().needs_layer_key
    assert "signs='layer'" in str(LAYER)
    with pytest.raises(ValueError, match="'layer', 'random'"):
        fp4jax.recipes.nvfp4().replace(**{"wgrad.hadamard_signs": "per-layer"})


def _recording(monkeypatch):
    """Patch fp4jax.dot_general to record each call's rht_key data (works under jit/scan)."""
    seen: list = []
    real = fp4jax.dot_general

    def spy(*a, rht_key=None, **kw):
        if rht_key is not None:
            jax.debug.callback(lambda d: seen.append(np.asarray(d)), jax.random.key_data(rht_key))
        return real(*a, rht_key=rht_key, **kw)

    monkeypatch.setattr(fp4jax, "dot_general", spy)
    return seen


class _Two(nn.Module):
    @nn.compact
    def __call__(self, x):
        return fl.Dense(32, recipe=LAYER)(fl.Dense(48, recipe=LAYER)(x))


def test_linen_keys_differ_per_layer_and_stay_per_step(monkeypatch):
    m = _Two()
    params = m.init(jax.random.key(0), X)
    seen = _recording(monkeypatch)

    def keys(step, layer_key):
        seen.clear()
        jax.block_until_ready(m.apply(params, X, rngs={"fp4": jax.random.fold_in(KEY, step),
                                                       "fp4_layer": layer_key}))
        jax.effects_barrier()
        return [k.tobytes() for k in seen]

    k0, k1, k2 = keys(0, LKEY), keys(1, LKEY), keys(0, jax.random.key(9))
    assert len(k0) == 2 and k0[0] != k0[1]  # one key per layer
    assert k0 == k1  # the same at every step
    assert set(k0).isdisjoint(k2)  # drawn from the run's layer key
    with pytest.raises(ValueError, match="'fp4_layer': layer_key"):
        m.apply(params, X, rngs={"fp4": KEY})


# the spy records keys with jax.debug.callback, an effect: from JAX 0.12 DCE keeps it in
# flax nn.scan's broadcast pass, which then refuses the scan ("broadcasted variable has a
# data dependency on the scan body"); the model itself runs there (tests/nn/test_model.py)
@pytest.mark.skipif(tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12),
                    reason="the key spy's debug callback cannot run inside nn.scan on JAX "
                           ">= 0.12; covered on the oldest supported JAX")
def test_scanned_llama_gives_each_layer_its_own_key(monkeypatch):
    cfg = get_preset("micro").replace(n_layers=3, scan_layers=True)
    model = quantized_llama(cfg, fp4jax.nn.PrecisionPolicy(recipe=LAYER))
    tokens = jnp.zeros((2, 16), jnp.int32)
    params = model.init(jax.random.key(0), tokens)
    seen = _recording(monkeypatch)
    jax.block_until_ready(model.apply(params, tokens, rngs={"fp4": KEY, "fp4_layer": LKEY}))
    jax.effects_barrier()
    n_linear = len(seen)
    assert n_linear >= 3 * 4  # at least the attention and MLP projections of 3 blocks
    assert len({k.tobytes() for k in seen}) == n_linear  # every layer its own vector


def test_nnx_layer_key_is_state_drawn_once():
    rngs = nnx.Rngs(params=0, fp4=1)
    a = fn.Linear(48, 32, recipe=LAYER, rngs=rngs)
    b = fn.Linear(48, 32, recipe=LAYER, rngs=rngs)
    sa = jax.tree.leaves(nnx.state(a, fn.RHTKey))
    sb = jax.tree.leaves(nnx.state(b, fn.RHTKey))
    assert len(sa) == 1 and not np.array_equal(np.asarray(sa[0]), np.asarray(sb[0]))
    assert all(not isinstance(v, fn.RHTKey) for v in jax.tree.leaves(
        nnx.state(a, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable)))
    y = a(X)
    # the same bits as fp4jax.dot with that key and the stream's next SR key
    ref = fp4jax.dot(X, a.kernel[...], recipe=LAYER, key=nnx.Rngs(params=0, fp4=1).fp4(),
                     rht_key=jax.random.wrap_key_data(sa[0]))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
    with pytest.raises(ValueError, match="per layer"):
        fn.DotGeneral(LAYER.replace(sr=False))
