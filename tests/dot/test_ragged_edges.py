"""fp4jax.ragged_dot at the edges of its group sizes: no expert at all (G = 0) gives what
jax.lax.ragged_dot gives (zeros, zero gradients) under every recipe, eagerly and under jit;
negative sizes, which jax.lax.ragged_dot does not define, are refused when concrete and
turn the output and both gradients into NaN when traced (the docstring's rule)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax

RECIPES = ["bf16", "nvfp4", "mxfp4", "fp4_all_the_way", "nvfp4(wgrad.hadamard_signs='layer')"]
M, K, N = 24, 32, 16
KEY, RHT = jax.random.key(1), jax.random.key(2)


def _xw(G, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((M, K)), jnp.float32),
            jnp.asarray(rng.standard_normal((G, K, N)), jnp.float32))


def _loss_grads(recipe, jit):
    def f(x, w, sizes):
        y, vjp = jax.vjp(lambda a, b: fp4jax.ragged_dot(a, b, sizes, recipe=recipe, key=KEY,
                                                        rht_key=RHT), x, w)
        return (y, *vjp(jnp.ones_like(y)))
    return jax.jit(f) if jit else f


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("recipe", RECIPES)
def test_no_expert_is_lax_ragged_dot(recipe, jit):
    x, w = _xw(0)
    sizes = jnp.zeros((0,), jnp.int32)
    want = jax.lax.ragged_dot(x, w, sizes)
    y, dx, dw = _loss_grads(recipe, jit)(x, w, sizes)
    assert y.shape == want.shape == (M, N) and y.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    assert dx.shape == (M, K) and not np.asarray(dx).any()
    assert dw.shape == (0, K, N)


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4"])
def test_negative_concrete_sizes_refused(recipe):
    x, w = _xw(3)
    for sizes in ([3, -2, 4], [-1, 0, 0], np.array([0, 0, -24], np.int64)):
        with pytest.raises(ValueError, match=r"group_sizes must be >= 0.*negative: \[-"):
            fp4jax.ragged_dot(x, w, jnp.asarray(sizes), recipe=recipe, key=KEY)


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4", "fp4_all_the_way"])
def test_negative_traced_sizes_give_nan(recipe):
    x, w = _xw(3)
    f = _loss_grads(recipe, jit=True)
    for sizes in ([3, -2, 4], [30, -6, 0]):  # the second sums to M: no row would be zero
        for t in f(x, w, jnp.asarray(sizes, jnp.int32)):
            assert np.isnan(np.asarray(t, np.float32)).all()
    # the same compiled function with valid sizes: finite, the per-row rule (rows past the
    # sum zero) as jax.lax.ragged_dot
    y, dx, dw = f(x, w, jnp.asarray([3, 0, 4], jnp.int32))
    assert np.isfinite(np.asarray(y)).all() and np.isfinite(np.asarray(dw)).all()
    assert not np.asarray(y[7:]).any() and np.asarray(y[:7]).all(axis=1).any()
    if recipe == "bf16":
        want = jax.lax.ragged_dot(x, w, jnp.asarray([3, 0, 4], jnp.int32))
        np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
