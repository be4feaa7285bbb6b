"""TetraJet-v2's OutControl (fp4jax.outcontrol): the channel count, norms and selection
against NumPy transcriptions of the authors' rules, and split_dot's three GEMMs rebuilt in
NumPy (tests/reference.py) from the channel split."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import outcontrol as oc
from fp4jax import recipes
from fp4jax.quantized_dot import operand_key
from tests import reference as ref
from tests.checks import bits_equal

M, K, N = 48, 256, 32
MX = dict(exp_bits=8, man_bits=0, block=32, tensor_scale=False, rule="up", elem=(4, 3))


def _np_count(d_in, ratio):
    """linear_mix.py: min(in // 128 * 128, (int(in * ratio) + 127) // 128 * 128)."""
    return min(d_in // 128 * 128, (int(d_in * ratio) + 127) // 128 * 128)


def test_count_is_the_authors_formula():
    for d_in in (256, 384, 512, 1000, 1024, 2048, 4096, 11008):
        for ratio in (0.01, 0.1, 0.25, 0.3, 0.5):
            want = _np_count(d_in, ratio)
            if 0 < want < d_in:
                assert oc.outcontrol_count(d_in, ratio) == want, (d_in, ratio)
            else:
                with pytest.raises(ValueError, match="both sides"):
                    oc.outcontrol_count(d_in, ratio)
    assert oc.outcontrol_count(512) == 128 and oc.outcontrol_count(4096) == 512


@pytest.mark.parametrize("bad", [dict(d_in=0), dict(d_in=128), dict(d_in=512.0),
                                 dict(d_in=True), dict(d_in=512, ratio=0),
                                 dict(d_in=512, ratio=1.0), dict(d_in=512, ratio="0.1"),
                                 dict(d_in=512, ratio=float("nan"))])
def test_count_refuses_bad_values(bad):
    with pytest.raises(ValueError, match="outcontrol_count"):
        oc.outcontrol_count(**bad)


def test_norms_and_selection_against_numpy():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 16, K)) * np.exp(rng.uniform(-2, 2, K))).astype(np.float32)
    x[..., 7] = x[..., 9] = 100.0  # a tie at the top
    got = np.asarray(oc.channel_norms(jnp.asarray(x, jnp.bfloat16)))
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64).reshape(-1, K)
    np.testing.assert_allclose(got, np.sqrt((xb ** 2).sum(0)), rtol=1e-6)
    hi, lo = oc.select_channels(jnp.asarray(got), 128)
    order = np.argsort(-got, kind="stable")  # descending, ties: lower index first
    assert hi.dtype == lo.dtype == jnp.int32
    np.testing.assert_array_equal(hi, order[:128])
    np.testing.assert_array_equal(lo, order[128:])
    assert list(np.asarray(hi[:2])) == [7, 9]
    for bad, match in ((dict(norm_sums=got[None], count=1), "1-D"),
                       (dict(norm_sums=got, count=0), "count"),
                       (dict(norm_sums=got, count=K), "count"),
                       (dict(norm_sums=got, count=2.0), "count")):
        with pytest.raises(ValueError, match=match):
            oc.select_channels(**bad)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)) * np.exp(rng.uniform(-2, 2, (1, K)))  # outlier channels
    w = rng.standard_normal((K, N)) * 0.05
    dy = rng.standard_normal((M, N)) * np.exp(rng.uniform(-1, 1, (M, 1)))
    return tuple(jnp.asarray(a, jnp.float32) for a in (x, w, dy))


def _split(recipe, x, w, dy, hi, lo, key):
    y, vjp = jax.vjp(lambda a, b: oc.split_dot(a, b, hi, lo, recipe=recipe, key=key), x, w)
    return (y, *vjp(dy))


def test_split_dot_three_gemms_against_numpy():
    """NVFP4 on the FP4 channels (x 1x16, w 16x16, dy SR, 16-point RHT along the tokens in
    wgrad), MXFP8 E4M3 with rounded-up scales on the others' forward and wgrad, the NVFP4
    dgrad on all: rebuilt in NumPy channel set by channel set, the gradients put back at
    the channels' own positions."""
    x, w, dy = _data()
    hi, lo = oc.select_channels(oc.channel_norms(x), oc.outcontrol_count(K))
    key = jax.random.key(5)
    y, dx, dw = jax.jit(_split, static_argnums=0)(recipes.nvfp4(), x, w, dy, hi, lo, key)
    hi, lo = np.asarray(hi), np.asarray(lo)
    xn, wn, dyn = (np.asarray(a, np.float64) for a in (x, w, dy))

    def words(gemm, which):
        return tuple(int(v) for v in jax.random.key_data(operand_key(key, gemm, which)))

    fq = ref.np_fake_quant
    w_lo, w_hi = fq(wn[lo], -1, block_2d=True), fq(wn[hi], -1, block_2d=True)
    want_y = fq(xn[:, lo], -1) @ w_lo + fq(xn[:, hi], -1, **MX) @ fq(wn[hi], 0, **MX)
    dyq = fq(dyn, -1, sr=words("dgrad", "lhs"))
    want_dx = np.zeros((M, K))
    want_dx[:, lo], want_dx[:, hi] = dyq @ w_lo.T, dyq @ w_hi.T
    want_dw = np.zeros((K, N))
    want_dw[lo] = (fq(ref.np_rht_rows(xn[:, lo]), 0).T
                   @ fq(ref.np_rht_rows(dyn), 0, sr=words("wgrad", "rhs")))
    want_dw[hi] = fq(xn[:, hi], 0, **MX).T @ fq(dyn, 0, **MX)
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
    # the split matters: the plain NVFP4 product differs
    plain = fp4jax.dot(x, w, recipe="nvfp4", key=key)
    assert np.abs(np.asarray(plain) - want_y).max() > 1e-3 * np.abs(want_y).max()


def test_split_dot_is_two_dots_bit_for_bit():
    """The definition: fp4jax.dot of each channel set (the same key), float32 sum, one cast
    to bf16; for bf16 inputs and a layer RHT key too."""
    x, w, dy = (a.astype(jnp.bfloat16) for a in _data(1))
    r = recipes.nvfp4().replace(**{"wgrad.hadamard_signs": "layer"})
    hi, lo = oc.select_channels(oc.channel_norms(x), 128)
    key, rk = jax.random.key(2), jax.random.key(3)

    def two(a, b):
        f32 = jnp.float32
        y1 = fp4jax.dot(a[:, lo], b[lo], recipe=r, key=key, rht_key=rk,
                        preferred_element_type=f32)
        y2 = fp4jax.dot(a[:, hi], b[hi], recipe=oc.outcontrol_recipe(r), key=key,
                        rht_key=rk, preferred_element_type=f32)
        return (y1 + y2).astype(jnp.bfloat16)

    def split(a, b):
        return oc.split_dot(a, b, hi, lo, recipe=r, key=key, rht_key=rk)

    got = jax.jit(lambda a, b: (lambda yv: (yv[0], *yv[1](dy)))(jax.vjp(split, a, b)))(x, w)
    want = jax.jit(lambda a, b: (lambda yv: (yv[0], *yv[1](dy)))(jax.vjp(two, a, b)))(x, w)
    assert got[0].dtype == jnp.bfloat16
    for g, v in zip(got, want, strict=True):
        bits_equal(g, v)


def test_outcontrol_recipe_and_errors():
    r = oc.outcontrol_recipe("nvfp4")
    for spec in (r.fprop.lhs, r.fprop.rhs, r.wgrad.lhs, r.wgrad.rhs):
        assert spec.fmt == fp4jax.formats.MXFP8_E4M3_UP and spec.rounding == "nearest"
    assert r.wgrad.hadamard == 0 and r.dgrad == recipes.nvfp4().dgrad
    # operands the recipe keeps in high precision stay so: the outlier channels never lose
    # precision (bf16 stays bf16; nvfp4_fwd_only's backward stays high precision)
    for name in ("bf16", "nvfp4_fwd_only"):
        base, hi = recipes.get(name), oc.outcontrol_recipe(name)
        for g in ("fprop", "dgrad", "wgrad"):
            for side in ("lhs", "rhs"):
                b, h = getattr(getattr(base, g), side), getattr(getattr(hi, g), side)
                assert h.quantized == b.quantized, (name, g, side)
    x, w, _ = _data()
    hi, lo = jnp.arange(128), jnp.arange(128, K)
    with pytest.raises(ValueError, match="x \\(..., K\\) and w"):
        oc.split_dot(x, w.T, hi, lo)
    with pytest.raises(ValueError, match="cover K=256"):
        oc.split_dot(x, w, hi, lo[:-1])
    with pytest.raises(ValueError, match="integer"):
        oc.split_dot(x, w, hi.astype(jnp.float32), lo)
