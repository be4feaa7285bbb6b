"""RHT, fp4jax.dot / dot_general (forward and the recipe's backward), recipes, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import recipes
from tests import reference as ref
from tests.checks import dequantized, recipe_grads

RNG = np.random.default_rng(99)


def _randn(*shape, scale=1.0):
    return jnp.asarray(RNG.standard_normal(shape) * scale, jnp.float32)


# ----------------------------------------------------------------------------- RHT


@pytest.mark.parametrize("size", [2, 4, 16, 32, 64, 128, 256])
def test_rht_is_orthogonal_and_matches_reference(size):
    x = _randn(3, size * 2)
    y = fp4jax.random_hadamard_transform(x, axis=-1, size=size)
    signs = np.asarray(fp4jax.hadamard.default_signs(size))
    mat = np.diag(signs) @ ref.ref_hadamard(size)
    want = (np.asarray(x, np.float64).reshape(3, 2, size) @ mat).reshape(3, -1)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mat.T @ mat, np.eye(size), atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(y)), np.linalg.norm(np.asarray(x)),
                               rtol=1e-5)


@pytest.mark.parametrize("size", [2, 16, 64])
@pytest.mark.parametrize("axis", [0, 1])
def test_rht_rounds_as_the_butterfly_bit_for_bit(size, axis):
    """The RHT's float32 rounding is the fixed-order butterfly (fwht_tiles), checked bit for
    bit against a loop-by-loop NumPy butterfly, along either axis, wide-range inputs."""
    rng = np.random.default_rng(size + axis)
    x = (rng.standard_normal((size * 3, size * 2)) * np.exp(rng.uniform(-20, 20, (size * 3, 1)))
         ).astype(np.float32)
    y = np.asarray(fp4jax.random_hadamard_transform(jnp.asarray(x), axis=axis, size=size))
    signs = np.asarray(fp4jax.hadamard.default_signs(size), np.float32)
    xm = np.moveaxis(x, axis, -1)
    want = ref.ref_fwht_f32(xm.reshape(-1, size) * signs, size).reshape(xm.shape)
    np.testing.assert_array_equal(y.view(np.uint32), np.moveaxis(want, -1, axis).view(np.uint32))


def test_rht_default_is_transformer_engine_vector():
    assert fp4jax.TE_SIGN_VECTOR == (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
    e0 = jnp.zeros((1, 16)).at[0, 0].set(1.0)
    y = fp4jax.random_hadamard_transform(e0, axis=-1)
    # first basis vector -> first row of diag(s) H / 4 = s_0 * ones / 4
    np.testing.assert_allclose(np.asarray(y)[0], np.full(16, 0.25), rtol=1e-6)
    e3 = jnp.zeros((1, 16)).at[0, 3].set(1.0)  # s_3 = -1
    np.testing.assert_allclose(np.asarray(fp4jax.random_hadamard_transform(e3, -1))[0],
                               -ref.ref_hadamard(16)[3], rtol=1e-6)


@pytest.mark.parametrize("signs", [None, 7, "key", "explicit"])
def test_rht_cancels_inside_a_product(signs):
    if signs == "key":
        signs = jax.random.key(5)
    elif signs == "explicit":
        signs = np.where(RNG.random(16) < 0.5, -1.0, 1.0)
    a, b = _randn(64, 8), _randn(64, 5)
    ha = fp4jax.random_hadamard_transform(a, axis=0, signs=signs)
    hb = fp4jax.random_hadamard_transform(b, axis=0, signs=signs)
    np.testing.assert_allclose(np.asarray(ha.T @ hb), np.asarray(a.T @ b), rtol=1e-4, atol=1e-4)
    assert not np.allclose(np.asarray(ha), np.asarray(a))


def test_rht_signs_variants_differ():
    x = _randn(4, 16)
    outs = [np.asarray(fp4jax.random_hadamard_transform(x, -1, signs=s))
            for s in (None, 1, 2, jax.random.key(0))]
    for i in range(len(outs)):
        for j in range(i + 1, len(outs)):
            assert not np.allclose(outs[i], outs[j])
    same = fp4jax.random_hadamard_transform(x, -1, signs=1)
    np.testing.assert_array_equal(np.asarray(same), outs[1])


def test_rht_spreads_an_outlier():
    """One outlier per 16-tile is spread over the tile: max/rms drops from ~4 to ~1."""
    x = np.asarray(_randn(256, 16)) * 0.1
    x[:, 3] = 20.0
    h = np.asarray(fp4jax.random_hadamard_transform(jnp.asarray(x), axis=-1))
    crest = lambda v: np.abs(v).max(-1) / np.sqrt((v**2).mean(-1))  # noqa: E731
    assert crest(x).min() > 3.9 and crest(h).max() < 1.2
    np.testing.assert_allclose((h**2).sum(-1), (x**2).sum(-1), rtol=1e-5)


def test_rht_errors():
    with pytest.raises(ValueError, match="multiple of size"):
        fp4jax.random_hadamard_transform(jnp.ones((3, 20)), axis=-1)
    with pytest.raises(ValueError, match="power of two"):
        fp4jax.random_hadamard_transform(jnp.ones((3, 24)), axis=-1, size=24)
    with pytest.raises(ValueError, match="power of two"):
        fp4jax.random_hadamard_transform(jnp.ones((3, 512)), axis=-1, size=512)
    with pytest.raises(ValueError, match="shape"):
        fp4jax.random_hadamard_transform(jnp.ones((3, 16)), axis=-1, signs=np.ones(8))
    with pytest.raises(TypeError, match="floating"):
        fp4jax.random_hadamard_transform(jnp.ones((3, 16), jnp.int32), axis=-1)


# ----------------------------------------------------------------------------- dot forward


@pytest.mark.parametrize("name", ["nvfp4", "fp4_all_the_way", "mxfp4", "bf16", "nvfp4_fwd_only"])
def test_dot_forward_is_matmul_of_dequantized(name):
    r = recipes.get(name)
    x, w = _randn(4, 6, 96, scale=2.0), _randn(96, 40)
    y = fp4jax.dot(x, w, recipe=r, key=jax.random.key(0))
    assert y.shape == (4, 6, 40) and y.dtype == jnp.float32
    xd = dequantized(x.reshape(-1, 96), r.fprop.lhs, -1)
    wd = dequantized(w, r.fprop.rhs, 0)
    want = (xd @ wd).reshape(4, 6, 40)
    scale = np.abs(xd) @ np.abs(wd)
    np.testing.assert_allclose(np.asarray(y), want, atol=1e-5 * scale.max())


def test_dot_forward_bf16_inputs_and_output_dtype():
    x, w = _randn(8, 64).astype(jnp.bfloat16), _randn(64, 32).astype(jnp.bfloat16)
    y = fp4jax.dot(x, w, key=jax.random.key(0))
    assert y.dtype == jnp.bfloat16
    y32 = fp4jax.dot(x, w, key=jax.random.key(0), preferred_element_type=jnp.float32)
    assert y32.dtype == jnp.float32
    fprop = recipes.nvfp4().fprop
    want = dequantized(x, fprop.lhs, -1) @ dequantized(w, fprop.rhs, 0)
    np.testing.assert_allclose(np.asarray(y32), want, rtol=1e-5, atol=1e-5)


def test_dot_general_matches_lax_shapes_and_values():
    lhs, rhs = _randn(3, 5, 32, 7), _randn(3, 32, 9)
    dn = (((2,), (1,)), ((0,), (0,)))
    y = fp4jax.dot_general(lhs, rhs, dn, recipe="bf16")
    want = jax.lax.dot_general(lhs, rhs, dn, precision=jax.lax.Precision.HIGHEST)
    assert y.shape == want.shape == (3, 5, 7, 9)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
    yq = fp4jax.dot_general(lhs, rhs, dn, recipe="nvfp4", key=jax.random.key(1))
    assert yq.shape == want.shape
    rel = float(jnp.linalg.norm(yq - want) / jnp.linalg.norm(want))
    assert 0 < rel < 0.25


def test_dot_general_works_as_flax_dot_general():
    """``fp4jax.dot_general`` as ``nn.Dense``'s ``dot_general_cls``: the forward is the
    recipe's quantized product of x and the Dense kernel, the gradients (round to nearest)
    are the recipe's dgrad and wgrad rebuilt from dequantized operands, and with stochastic
    rounding the module's ``fp4`` RNG stream reaches the backward (same stream, same bits;
    another stream, other bits)."""
    import flax.linen as nn

    def dense(recipe):
        class FP4DotGeneral(nn.Module):
            @nn.compact
            def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                         preferred_element_type=None):
                return fp4jax.dot_general(lhs, rhs, dimension_numbers, precision,
                                          preferred_element_type, recipe=recipe,
                                          key=self.make_rng("fp4"))

        return nn.Dense(24, use_bias=False, dot_general_cls=FP4DotGeneral)

    x, g = _randn(32, 48), _randn(32, 24)
    sr = recipes.get("fp4_all_the_way")
    params = dense(sr).init({"params": jax.random.key(0), "fp4": jax.random.key(1)}, x)
    kernel = params["params"]["kernel"]
    assert kernel.shape == (48, 24)

    def fwd_bwd(recipe, rng):
        m = dense(recipe)
        y, vjp = jax.vjp(lambda p, x: m.apply(p, x, rngs={"fp4": jax.random.key(rng)}),
                         params, x)
        dp, dx = vjp(g)
        return np.asarray(y), np.asarray(dx), np.asarray(dp["params"]["kernel"])

    rtn = sr.replace(sr=False)
    y, dx, dw = fwd_bwd(rtn, 2)
    want_y = dequantized(x, rtn.fprop.lhs, -1) @ dequantized(kernel, rtn.fprop.rhs, 0)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    want_dx, want_dw = recipe_grads(rtn, x, kernel, g)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-4)

    y1, dx1, dw1 = fwd_bwd(sr, 2)
    np.testing.assert_array_equal(y1, y)  # the forward rounds to nearest in both
    y2, dx2, dw2 = fwd_bwd(sr, 2)
    np.testing.assert_array_equal(dx2, dx1)
    np.testing.assert_array_equal(dw2, dw1)
    _, dx3, dw3 = fwd_bwd(sr, 3)
    assert (dx3 != dx1).mean() > 0.5 and (dw3 != dw1).mean() > 0.5


# ----------------------------------------------------------------------------- backward


def _grads(r, x, w, g, key):
    _, vjp = jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe=r, key=key), x, w)
    return vjp(g)


@pytest.mark.parametrize("name", ["bf16", "nvfp4_fwd_only"])
def test_unquantized_backward_is_exact_matmul_grads(name):
    """bf16() and nvfp4_fwd_only() leave dgrad and wgrad unquantized."""
    x, w, g = _randn(16, 32), _randn(32, 24), _randn(16, 24)
    dx, dw = _grads(recipes.get(name), x, w, g, None)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(g @ w.T), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(x.T @ g), rtol=1e-5, atol=1e-5)


def test_backward_nvfp4_matches_manual_recipe():
    """dgrad = Q_sr(dy) @ Q2d(w).T and wgrad = Q(Hx).T @ Q_sr(H dy), rebuilt by hand."""
    r = recipes.nvfp4().replace(sr=False)  # deterministic: compare bits of the recipe's steps
    x, w, g = _randn(40, 32), _randn(32, 48), _randn(40, 48)
    dx, dw = _grads(r, x, w, g, None)
    wq = fp4jax.dequantize(fp4jax.quantize(w, block_2d=True))
    gq = fp4jax.dequantize(fp4jax.quantize(g, axis=-1))
    np.testing.assert_allclose(np.asarray(dx), np.asarray(gq, np.float64) @ np.asarray(wq).T,
                               rtol=1e-5, atol=1e-4)
    pad = lambda a: jnp.pad(a, ((0, 8), (0, 0)))  # noqa: E731  40 tokens -> 48 for RHT16
    hx = fp4jax.random_hadamard_transform(pad(x), axis=0)
    hg = fp4jax.random_hadamard_transform(pad(g), axis=0)
    xq = np.asarray(fp4jax.dequantize(fp4jax.quantize(hx, axis=0)), np.float64)
    gq2 = np.asarray(fp4jax.dequantize(fp4jax.quantize(hg, axis=0)), np.float64)
    np.testing.assert_allclose(np.asarray(dw), xq.T @ gq2, rtol=1e-5, atol=1e-4)
    # and the RHT really ran: without it the result is different
    r0 = r.replace(rht=0)
    _, dw0 = _grads(r0, x, w, g, None)
    assert not np.allclose(np.asarray(dw0), np.asarray(dw))


def test_dgrad_sr_is_unbiased_over_keys():
    """E[dx] over many keys -> E[SR(dy)] @ Q(w).T; single draws differ from it and each other.

    E[SR(dy)] is dy itself except for block maxima that land above 6 after the E4M3 scale
    rounds down: those saturate to +-6 (deterministically), so the exact expectation is
    dy with them replaced by their saturated value.
    """
    r = recipes.nvfp4()
    x, w, g = _randn(8, 32), _randn(32, 32), _randn(8, 32)
    keys = jax.random.split(jax.random.key(0), 3000)
    f = jax.jit(jax.vmap(lambda k: _grads(r, x, w, g, k)[0]))
    dxs = np.asarray(f(keys), np.float64)
    wq = np.asarray(fp4jax.dequantize(fp4jax.quantize(w, block_2d=True)), np.float64)
    q = fp4jax.quantize(g)
    step = np.repeat(np.asarray(q.scale.astype(jnp.float32), np.float64), 16, -1) * float(
        q.global_scale)
    gn = np.asarray(g, np.float64)
    sat = np.abs(gn / step) > 6
    g_expected = np.where(sat, np.sign(gn) * 6 * step, gn)
    target = g_expected @ wq.T
    mean = dxs.mean(0)
    z = np.abs(mean - target) / (dxs.std(0) / np.sqrt(len(keys)))
    # |z| of an unbiased mean is half-normal: median ~0.67, max over 256 entries ~3.5
    assert np.median(z) < 1.2 and z.max() < 5.5
    rtn = np.asarray(fp4jax.dequantize(q), np.float64) @ wq.T
    assert np.abs(mean - target).mean() < 0.1 * np.abs(rtn - target).mean()
    assert not np.allclose(dxs[0], dxs[1])
    assert np.abs(dxs[0] - target).mean() > 10 * np.abs(mean - target).mean()


def test_backward_same_key_same_bits():
    r = recipes.nvfp4()
    x, w, g = _randn(16, 32), _randn(32, 16), _randn(16, 16)
    a = _grads(r, x, w, g, jax.random.key(3))
    b = _grads(r, x, w, g, jax.random.key(3))
    c = _grads(r, x, w, g, jax.random.key(4))
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    assert not np.array_equal(np.asarray(a[0]), np.asarray(c[0]))


def test_residuals_are_quantized(monkeypatch):
    """The nvfp4 forward saves FP4 tensors, not x and w, for the backward pass."""
    monkeypatch.setenv("FP4JAX_KERNELS", "off")  # the XLA path (the kernel path: bf16)
    x, w = _randn(32, 64), _randn(64, 48)
    _, res = jax.vjp(lambda x, w: fp4jax.dot(x, w, key=jax.random.key(0)), x, w)
    leaves = jax.tree_util.tree_leaves(res)
    big_f32 = [a for a in leaves if a.dtype == jnp.float32 and a.size >= 32 * 48]
    f4 = [a for a in leaves if a.dtype == jnp.float4_e2m1fn]
    assert len(f4) == 2 and not big_f32, [(a.dtype, a.shape) for a in leaves]


# ----------------------------------------------------------------------------- transforms


def test_jit_grad_vmap():
    x, w = _randn(4, 8, 32), _randn(32, 16)
    key = jax.random.key(0)
    loss = lambda x, w, k: jnp.sum(fp4jax.dot(x, w, key=k) ** 2)  # noqa: E731
    g_eager = jax.grad(loss, argnums=(0, 1))(x, w, key)
    g_jit = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, key)
    for a, b in zip(g_eager, g_jit, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    ys = jax.vmap(lambda xi: fp4jax.dot(xi, w, key=key))(x)
    assert ys.shape == (4, 8, 16)
    for i in range(4):  # vmap maps fp4jax.dot over the examples: each its own tensor scale
        np.testing.assert_allclose(np.asarray(ys[i]), np.asarray(fp4jax.dot(x[i], w, key=key)),
                                   rtol=1e-6, atol=1e-6)
    # vmapped quantize: each batch element gets its own tensor scale
    qs = jax.vmap(lambda xi: fp4jax.quantize(xi).global_scale)(x * jnp.arange(1, 5)[:, None, None])
    assert len(set(np.asarray(qs).tolist())) == 4


def test_sharded_equals_unsharded():
    devs = jax.devices()
    if len(devs) < 4:  # conftest sets 4 virtual CPU devices; a 1-GPU run has fewer
        pytest.skip(f"needs 4 devices, got {len(devs)}")
    mesh = jax.sharding.Mesh(np.array(devs[:4]), ("data",))
    P = jax.sharding.PartitionSpec
    x, w = _randn(16, 8, 64, scale=3.0), _randn(64, 32)
    x = x.at[5, 2, 7].set(40.0)  # the global amax lives on one shard
    key = jax.random.key(1)

    g = _randn(16, 8, 32)

    def fwd_bwd(x, w):
        y, vjp = jax.vjp(lambda x, w: fp4jax.dot(x, w, key=key), x, w)
        return (y, *vjp(g))

    f = jax.jit(fwd_bwd)
    y1, dx1, dw1 = f(x, w)
    xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
    ws = jax.device_put(w, jax.sharding.NamedSharding(mesh, P()))
    y2, dx2, dw2 = f(xs, ws)
    assert len(y2.sharding.device_set) == 4
    # fprop and dgrad contract over unsharded K / N: identical bits
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    np.testing.assert_array_equal(np.asarray(dx1), np.asarray(dx2))
    # wgrad contracts over the sharded tokens: the quantized operands are identical, only
    # the f32 summation order of the cross-shard reduction may differ
    np.testing.assert_allclose(np.asarray(dw1), np.asarray(dw2), rtol=1e-5, atol=1e-5)
    q1 = jax.jit(fp4jax.quantize)(x)
    q2 = jax.jit(fp4jax.quantize)(xs)
    np.testing.assert_array_equal(np.asarray(q1.scale.astype(jnp.float32)),
                                  np.asarray(q2.scale.astype(jnp.float32)))
    assert float(q1.global_scale) == float(q2.global_scale)


# ----------------------------------------------------------------------------- recipes


def test_recipe_contents():
    r = recipes.nvfp4()
    assert r.fprop.lhs == fp4jax.QuantSpec(fp4jax.NVFP4, "nearest", False)
    assert r.fprop.rhs.block_2d and r.dgrad.rhs == r.fprop.rhs
    assert r.dgrad.lhs.rounding == "stochastic" and r.wgrad.rhs.rounding == "stochastic"
    assert r.wgrad.lhs.rounding == "nearest" and r.wgrad.hadamard == 16
    assert r.fprop.hadamard == r.dgrad.hadamard == 0
    f = recipes.fp4_all_the_way()
    assert [f.fprop.lhs.rounding, f.fprop.rhs.rounding, f.dgrad.lhs.rounding,
            f.dgrad.rhs.rounding, f.wgrad.lhs.rounding, f.wgrad.rhs.rounding] == [
        "nearest", "nearest", "stochastic", "nearest", "stochastic", "stochastic"]
    assert not any(g.hadamard for g in f.gemms.values())
    assert not any(q.block_2d for g in f.gemms.values() for q in (g.lhs, g.rhs))
    m = recipes.mxfp4()
    assert m.fprop.lhs.fmt == fp4jax.MXFP4 and m.wgrad.hadamard == 32
    assert not recipes.bf16().quantized and not recipes.bf16().needs_key
    fo = recipes.nvfp4_fwd_only()
    assert fo.fprop == r.fprop and not fo.dgrad.quantized and not fo.wgrad.quantized
    assert "nvfp4" in r.describe()


def test_recipe_replace_knobs_and_hashable():
    r = recipes.nvfp4()
    assert not r.replace(sr=False).needs_key
    assert r.replace(rht=0).wgrad.hadamard == 0
    assert not r.replace(block_2d=False).fprop.rhs.block_2d
    assert r.replace(fmt=fp4jax.MXFP4).dgrad.lhs.fmt == fp4jax.MXFP4
    assert r.replace(**{"dgrad.lhs.rounding": "nearest"}).dgrad.lhs.rounding == "nearest"
    assert r.replace(**{"wgrad.hadamard": 0}).wgrad.hadamard == 0
    assert hash(r) == hash(recipes.nvfp4()) and r == recipes.nvfp4()
    assert len({r, r.replace(sr=False), recipes.bf16()}) == 3
    with pytest.raises(ValueError, match="unknown key"):
        r.replace(bogus=1)
    with pytest.raises(ValueError, match="valid names"):
        recipes.get("nvfp8")
    # usable as a static jit argument
    f = jax.jit(lambda x, w, rc: fp4jax.dot(x, w, recipe=rc), static_argnums=2)
    assert f(_randn(4, 32), _randn(32, 8), recipes.bf16()).shape == (4, 8)


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs():
    x, w = _randn(4, 32), _randn(32, 8)
    with pytest.raises(TypeError, match="floating"):
        fp4jax.quantize(jnp.ones((4, 32), jnp.int32))
    with pytest.raises(TypeError, match="floating"):
        fp4jax.dot(jnp.ones((4, 32), jnp.int8), w, recipe="bf16")
    with pytest.raises(ValueError, match=r"\(4, 32\).*\(16, 8\)"):
        fp4jax.dot(x, _randn(16, 8), recipe="bf16")
    with pytest.raises(ValueError, match="contraction sizes differ"):
        fp4jax.dot_general(x, _randn(16, 8), (((1,), (0,)), ((), ())), recipe="bf16")
    with pytest.raises(ValueError, match=r"key=jax.random.key"):
        fp4jax.quantize(x, rounding="stochastic")
    with pytest.raises(ValueError, match=r"key=jax.random.key"):
        fp4jax.dot(x, w)  # nvfp4 uses SR on gradients
    with pytest.raises(ValueError, match="valid names"):
        fp4jax.quantize(x, "nvfp5")
    with pytest.raises(ValueError, match="rounding"):
        fp4jax.quantize(x, rounding="truncate")
    with pytest.raises(ValueError, match="out of range"):
        fp4jax.quantize(x, axis=2)
    with pytest.raises(ValueError, match="block_2d"):
        fp4jax.quantize(jnp.ones(32), block_2d=True)
    with pytest.raises(ValueError, match="block_size"):
        fp4jax.BlockFormat("x", block_size=4)
    with pytest.raises(ValueError, match="E9M0"):
        fp4jax.BlockFormat("x", scale_exp_bits=9, scale_man_bits=0)
    with pytest.raises(ValueError, match="ocp"):
        fp4jax.BlockFormat("x", scale_rule="ocp")
    with pytest.raises(ValueError, match="w must be 2-D"):
        fp4jax.dot(x, _randn(32, 8, 2), recipe="bf16")
    with pytest.raises(TypeError, match="QuantizedArray"):
        fp4jax.dequantize(x)


def test_dot_general_quantized_with_batch_and_several_contracting_dims():
    """lhs (B, M, C1, C2) x rhs (B, C1, C2, N): contraction flattened to K = C1*C2 in
    order, blocks along it; the result equals the matmul of the dequantized operands."""
    lhs, rhs = _randn(2, 6, 4, 8), _randn(2, 4, 8, 5)
    dn = (((2, 3), (1, 2)), ((0,), (0,)))
    r = recipes.nvfp4().replace(sr=False)
    y = fp4jax.dot_general(lhs, rhs, dn, recipe=r)
    assert y.shape == (2, 6, 5)
    xd = dequantized(lhs.reshape(2, 6, 32), r.fprop.lhs, -1)
    wd = np.asarray(fp4jax.dequantize(fp4jax.quantize(rhs.reshape(2, 32, 5), block_2d=True)),
                    np.float64)
    want = np.einsum("bmk,bkn->bmn", xd, wd)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["fp4_all_the_way", "mxfp4"])
def test_backward_matches_manual_recipe_other_recipes(name):
    r = recipes.get(name).replace(sr=False)
    x, w, g = _randn(64, 64), _randn(64, 32), _randn(64, 32)
    dx, dw = _grads(r, x, w, g, None)

    want_dx, want_dw = recipe_grads(r, x, w, g)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-4)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype


def test_keys_of_other_prng_implementations():
    """An ``rbg`` key works everywhere a threefry key does: the forward (round to nearest)
    is the product of the dequantized operands; stochastic rounding keeps the
    round-to-nearest block scales and rounds each element to one of the two E2M1 values
    around it, drawn from the key (same key, same codes; another key, other codes); the
    gradient's SR draws come from the key too, and stay near the exact gradient."""
    x, w = _randn(16, 32), _randn(32, 8)
    k, k2 = jax.random.key(0, impl="rbg"), jax.random.key(1, impl="rbg")
    y = fp4jax.dot(x, w, key=k)
    r = recipes.nvfp4()
    want = dequantized(x, r.fprop.lhs, -1) @ dequantized(w, r.fprop.rhs, 0)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)

    q = fp4jax.quantize(x, rounding="stochastic", key=k)
    rtn = fp4jax.quantize(x)
    np.testing.assert_array_equal(np.asarray(q.scale, np.float32),
                                  np.asarray(rtn.scale, np.float32))
    assert np.float32(q.global_scale) == np.float32(rtn.global_scale)
    s = np.repeat(np.asarray(q.scale, np.float64), 16, axis=-1) * float(q.global_scale)
    a = np.abs(np.asarray(x, np.float64)) / s  # |x| on the block's E2M1 grid
    grid = ref.E2M1
    lo = grid[np.searchsorted(grid, a, side="right") - 1]
    hi = grid[np.minimum(np.searchsorted(grid, a, side="left"), len(grid) - 1)]
    got = np.abs(np.asarray(q.data, np.float64))
    assert ((got == lo) | (got == hi)).all()
    assert (got != np.abs(np.asarray(rtn.data, np.float64))).sum() >= 10  # random, not RTN
    again = fp4jax.quantize(x, rounding="stochastic", key=k)
    np.testing.assert_array_equal(np.asarray(again.data, np.float32),
                                  np.asarray(q.data, np.float32))
    other = fp4jax.quantize(x, rounding="stochastic", key=k2)
    assert (np.asarray(other.data, np.float32) != np.asarray(q.data, np.float32)).sum() >= 10

    dy = _randn(16, 8)

    def grad(key):
        return np.asarray(_grads(r, x, w, dy, key)[0])

    g1 = grad(k)
    np.testing.assert_array_equal(grad(k), g1)
    assert (grad(k2) != g1).mean() > 0.5
    exact = np.asarray(dy, np.float64) @ np.asarray(w, np.float64).T
    assert np.linalg.norm(g1 - exact) / np.linalg.norm(exact) < 0.25


def test_more_bad_inputs():
    x, w = _randn(4, 32), _randn(32, 8)
    with pytest.raises(ValueError, match="out of range"):
        fp4jax.dot_general(x, w, (((3,), (0,)), ((), ())), recipe="bf16")
    with pytest.raises(ValueError, match="repeat a dim"):
        fp4jax.dot_general(x, w, (((1,), (0,)), ((1,), (0,))), recipe="bf16")
    with pytest.raises(ValueError, match=r"\+1 and -1"):
        fp4jax.random_hadamard_transform(jnp.ones((2, 16)), -1, signs=np.full(16, 2.0))
    with pytest.raises(TypeError, match="bool"):
        fp4jax.random_hadamard_transform(jnp.ones((2, 16)), -1, signs=True)
    with pytest.raises(TypeError, match=r"key=jax.random.key"):
        fp4jax.quantize(x, rounding="stochastic", key=0)
    with pytest.raises(TypeError, match="axis must be an int"):
        fp4jax.quantize(x, axis=1.0)
    with pytest.raises(TypeError, match="float dtype"):
        fp4jax.dequantize(fp4jax.quantize(x), jnp.int8)


def test_residual_memory_is_fp4_sized(monkeypatch):
    """XLA stores float4 arrays packed: the nvfp4 backward keeps ~4.4x fewer bytes than
    the bf16 recipe, which saves x (bf16) and w (f32)."""
    monkeypatch.setenv("FP4JAX_KERNELS", "off")  # the XLA path (the kernel path: bf16)
    x = jnp.ones((512, 256), jnp.bfloat16)
    w = jnp.ones((256, 256), jnp.float32)

    def residual_bytes(name):
        f = jax.jit(lambda x, w: jax.vjp(
            lambda x, w: fp4jax.dot(x, w, recipe=name, key=jax.random.key(0)), x, w)[1])
        return f.lower(x, w).compile().memory_analysis().output_size_in_bytes

    hp = residual_bytes("bf16")
    assert hp >= 512 * 256 * 2 + 256 * 256 * 4
    # x and w as FP4 (0.5 B/element) plus E4M3 scales (1/16 B/element) and small extras
    fp4 = (512 * 256 + 256 * 256) * (0.5 + 1 / 16)
    assert residual_bytes("nvfp4") < 1.2 * fp4 < 0.3 * hp


@pytest.mark.parametrize("name", ["nvfp4", "quartet2"])
def test_reference_gemms_are_dots_forward_and_vjp_bit_for_bit(name):
    """``quantized_dot.reference_gemms`` (what ``diagnostics.gemm_stats`` measures) gives the
    bits of ``fp4jax.dot``'s forward and VJP on the XLA path: SR draws, RHT and MS-EDEN
    included, bf16 activations with a float32 weight (dx in x's dtype, dw in w's), and its
    operands are the ones ``reference_operand`` makes."""
    from fp4jax import quantized_dot as qd

    r = recipes.get(name)
    x = _randn(48, 64).astype(jnp.bfloat16)
    w, g = _randn(64, 32) * 0.1, _randn(48, 32)
    key = jax.random.key(11)

    @jax.jit
    def both(x, w, g):
        y, vjp = jax.vjp(lambda a, b: fp4jax.dot(a, b, recipe=r, key=key,
                                                 preferred_element_type=jnp.float32,
                                                 implementation="xla"), x, w)
        k = qd.call_key(r, key)
        got = qd.reference_gemms(x[None], w[None], g[None], r, k)
        wq = qd.reference_operand(w[None], r, "fprop", "rhs", k)[1]
        return (y, *vjp(g)), got, wq

    want, got, wq = both(x, w, g)
    for v, gemm, dt in zip(want, ("fprop", "dgrad", "wgrad"),
                           (jnp.float32, jnp.bfloat16, jnp.float32), strict=True):
        p = got[gemm][0]
        assert p.dtype == dt and p.shape == (1, *v.shape), gemm
        assert (np.asarray(p[0], np.float32).view(np.uint32)
                == np.asarray(v, np.float32).view(np.uint32)).all(), gemm
    np.testing.assert_array_equal(np.asarray(got["fprop"][2][1].data, np.float32),
                                  np.asarray(wq.data, np.float32))
    with pytest.raises(ValueError, match=r"need x \(B, M, K\), w \(B, K, N\)"):
        qd.reference_gemms(x, w, g, r, qd.call_key(r, key))  # not the canonical 3D form
    rotated = np.asarray(got["wgrad"][1][0], np.float32)[0]  # tokens padded to the RHT
    assert rotated.shape[0] % r.wgrad.hadamard == 0
    assert not np.allclose(rotated[:48], np.asarray(x, np.float32))  # and rotated
