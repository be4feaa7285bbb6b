"""The 2026 recipe knobs of issue 37 item 4, each against an independent NumPy reference:
the deterministic (unsigned) Hadamard (``hadamard_signs="ones"``, AMD arXiv 2605.09825)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax.hadamard import random_hadamard_transform, unsigned_signs
from pallas_kernels import dispatch
from tests.reference import ref_fwht_f32, ref_hadamard

# --------------------------------------------------------------------------------------
# 1. The deterministic (unsigned) Hadamard: hadamard_signs="ones"
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [16, 32])
def test_unsigned_hadamard_is_sylvester_matrix(size):
    """``signs="ones"`` rotates each tile by ``H / sqrt(n)`` itself: bit for bit the NumPy
    float32 butterfly, and within float32 rounding of the Walsh-formula matrix product."""
    assert np.array_equal(unsigned_signs(size), np.ones(size, np.float32))
    x = np.asarray(jax.random.normal(jax.random.key(0), (3 * size, 5)), np.float32)
    got = np.asarray(random_hadamard_transform(x, axis=0, size=size, signs="ones"))
    tiles = np.moveaxis(x.reshape(3, size, 5), 1, -1)  # (3, 5, size): the rotated axis last
    want = np.moveaxis(ref_fwht_f32(tiles, size).reshape(3, 5, size), -1, 1).reshape(x.shape)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    mat = np.einsum("tij,ik->tkj", x.reshape(3, size, 5).astype(np.float64), ref_hadamard(size))
    np.testing.assert_allclose(got, mat.reshape(x.shape), rtol=0, atol=1e-5)
    te = np.asarray(random_hadamard_transform(x, axis=0, size=size))  # TE's signs differ
    assert not np.array_equal(got, te)


def _dw(recipe):
    x = jax.random.normal(jax.random.key(1), (64, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (32, 16), jnp.float32)
    f = jax.grad(lambda w: jnp.sum(jnp.sin(fp4jax.dot(x, w, recipe=recipe))))
    return np.asarray(jax.jit(f)(w))


# only Wgrad quantized (NVFP4, RtN): the cheapest recipe whose result depends on the signs
_WGRAD = "bf16(wgrad.hadamard=16, wgrad.lhs.fmt=nvfp4, wgrad.rhs.fmt=nvfp4, {})"


def test_ones_policy_in_a_recipe_is_the_all_ones_tuple():
    """``wgrad.hadamard_signs=ones`` is the recipe with the sign vector spelled out as a
    tuple of +1 (the tuple path is the one tested against the NumPy RHT), needs no key,
    and round-trips through the spec string."""
    r = fp4jax.recipes.parse("mxfp4(sr=False, wgrad.hadamard_signs=ones)")
    assert r.wgrad.hadamard_signs == "ones" and not r.needs_key
    assert fp4jax.recipes.parse(fp4jax.recipes.spec(r)) == r
    assert "signs='ones'" in str(r)
    got = _dw(fp4jax.recipes.parse(_WGRAD.format("wgrad.hadamard_signs=ones")))
    tup = _dw(fp4jax.recipes.parse(_WGRAD.format(f"wgrad.hadamard_signs={(1,) * 16}")))
    assert np.array_equal(got.view(np.uint32), tup.view(np.uint32))
    te = _dw(fp4jax.recipes.parse(_WGRAD.format("wgrad.hadamard_signs=None")))
    assert not np.array_equal(got, te)  # dW: the rotation's signs matter


def test_bad_sign_policy_names_the_argument():
    with pytest.raises(ValueError, match="hadamard_signs='one'.*'ones'"):
        fp4jax.recipes.GemmSpec(hadamard=16, hadamard_signs="one")
    with pytest.raises(ValueError, match="wgrad.hadamard_signs"):
        fp4jax.recipes.parse("nvfp4(wgrad.hadamard_signs=unsigned)")
    with pytest.raises(ValueError, match="'ones'"):
        random_hadamard_transform(jnp.ones((16,)), size=16, signs="unsigned")


def test_kernel_path_gets_the_unsigned_vector(monkeypatch):
    """The sm_90 operand kernels take the sign vector as data (``dispatch.make_operands``'s
    ``signs``), so "ones" needs no refusal: the kernel path receives the all-ones vector
    (recorded at run time; the kernels themselves are stood in for by zeros, so nothing is
    interpreted)."""
    monkeypatch.setenv("FP4JAX_KERNELS", "interpret")
    seen = []

    def spy(x, kinds, sr_keys, signs, *a, **k):
        for s in signs:
            if s is not None:
                jax.debug.callback(lambda v: seen.append(np.asarray(v)), s)
        return [(jnp.zeros(x.shape, jnp.bfloat16), jnp.float32(1)) for _ in kinds]

    monkeypatch.setattr(dispatch, "make_operands", spy)
    x = jax.random.normal(jax.random.key(1), (32, 256)).astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(jax.random.key(2), (256, 256))).astype(jnp.bfloat16)
    r = fp4jax.recipes.parse("mxfp4(sr=False, wgrad.hadamard_signs=ones)")
    f = jax.grad(lambda x, w: jnp.sum(fp4jax.dot(x, w, recipe=r).astype(jnp.float32)), (0, 1))
    jax.block_until_ready(f(x, w))
    assert len(seen) == 2  # x and dy of wgrad, 32x1 columns after the RHT-32
    assert all(np.array_equal(s, np.ones(32, np.float32)) for s in seen)
