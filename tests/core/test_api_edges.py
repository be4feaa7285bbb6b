"""Bad input at the API's edges gets a short, clear error, and finite input never
dequantizes to Inf (issue 16's probe: QuantizedArray operands, batches of keys,
mismatched unpack lengths, MXFP4 near the float32 maximum)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
import fp4jax  # noqa: E402
from fp4jax import recipes  # noqa: E402
from fp4jax.quantization import scaled_data  # noqa: E402


def _x(shape=(32, 64), seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.parametrize("which", ["lhs", "rhs"])
def test_quantized_array_operands_get_a_short_type_error(which):
    x, w = _x((32, 64)), _x((64, 32), 1)
    q = fp4jax.quantize(x if which == "lhs" else w, fp4jax.NVFP4)
    args = (q, w) if which == "lhs" else (x, q)
    for f in (lambda a, b: fp4jax.dot(a, b, recipe="bf16"),
              lambda a, b: fp4jax.dot_general(a, b, (((1,), (0,)), ((), ())), recipe="nvfp4",
                                               key=jax.random.key(0))):
        with pytest.raises(TypeError, match="QuantizedArray") as e:
            f(*args)
        msg = str(e.value)
        assert "dequantize" in msg and len(msg) < 300 and "Array(" not in msg
    with pytest.raises(TypeError, match="QuantizedArray"):
        fp4jax.quantize(q, fp4jax.NVFP4)


@pytest.mark.parametrize("make", [lambda: jax.random.split(jax.random.key(0)),
                                  lambda: jax.random.split(jax.random.PRNGKey(0), 3),
                                  lambda: jax.random.split(jax.random.key(0), (2, 2))])
def test_a_batch_of_keys_is_refused(make):
    keys = make()
    x, w = _x((32, 64)), _x((64, 32), 1)
    with pytest.raises(ValueError, match="one PRNG key"):
        fp4jax.dot(x, w, recipe=recipes.nvfp4(), key=keys)
    with pytest.raises(ValueError, match="one PRNG key"):
        fp4jax.quantize(x, fp4jax.NVFP4, rounding="stochastic", key=keys)


def test_a_raw_key_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="one jax PRNG key"):
        fp4jax.quantize(_x(), fp4jax.NVFP4, rounding="stochastic",
                        key=jnp.zeros((3,), jnp.uint32))


def test_one_key_still_works_typed_raw_and_under_vmap():
    x, w = _x((32, 64)), _x((64, 32), 1)
    y1 = fp4jax.dot(x, w, key=jax.random.key(5))
    y2 = fp4jax.dot(x, w, key=jax.random.wrap_key_data(jax.random.key_data(jax.random.key(5))))
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    keys = jax.random.split(jax.random.key(1), 2)
    ys = jax.vmap(lambda k: fp4jax.dot(x, w, key=k))(keys)
    assert ys.shape == (2, 32, 32)


@pytest.mark.parametrize("n", [1, 2, 15, 16, 31])
def test_unpack_length_must_match(n):
    data = fp4jax.quantize(jnp.full((3, n), 1.5, jnp.float32), fp4jax.NVFP4).data
    for axis in (-1, 1):
        p = fp4jax.pack_e2m1(data, axis=axis)
        np.testing.assert_array_equal(
            np.asarray(fp4jax.unpack_e2m1(p, n, axis=axis), np.float32),
            np.asarray(data, np.float32))
        nbytes = (n + 1) // 2
        for bad in {n + 2, n - 2 if n > 2 else 2 * nbytes + 1, 2 * nbytes + 1, 0}:
            if (bad + 1) // 2 == nbytes:
                continue
            with pytest.raises(ValueError, match=f"length={bad}"):
                fp4jax.unpack_e2m1(p, bad, axis=axis)
    with pytest.raises(ValueError, match="length"):
        fp4jax.unpack_e2m1(fp4jax.pack_e2m1(data), float(n))
    with pytest.raises(ValueError, match="axis"):
        fp4jax.unpack_e2m1(fp4jax.pack_e2m1(data), n, axis=2)
    with pytest.raises(TypeError, match="uint8"):
        fp4jax.unpack_e2m1(np.zeros((2, 2), np.int32), 4)


E8M0_B16 = fp4jax.BlockFormat("e8m0-b16", 16, scale_exp_bits=8, scale_man_bits=0,
                              tensor_scale=False, scale_rule="up")


@pytest.mark.parametrize("fmt", [fp4jax.MXFP4, fp4jax.MXFP4_OCP, E8M0_B16, fp4jax.NVFP4])
def test_finite_input_never_dequantizes_to_inf(fmt):
    fmax = np.finfo(np.float32).max
    rng = np.random.default_rng(0)
    # rows of magnitudes up to the float32 maximum, each block with one huge value
    x = rng.standard_normal((64, 128)).astype(np.float32)
    x *= np.float32(10.0) ** rng.uniform(-30, 38, (64, 1)).astype(np.float32)
    x[:, ::16] = np.sign(x[:, ::16] + 0.5) * fmax * rng.uniform(0.5, 1.0, (64, 8))
    x[0, 0], x[1, 0] = fmax, -fmax
    x = np.clip(x, -fmax, fmax)
    q = fp4jax.quantize(jnp.asarray(x), fmt)
    for dtype, lim in ((jnp.float32, fmax), (jnp.bfloat16, float(jnp.finfo(jnp.bfloat16).max)),
                       (jnp.float16, 65504.0)):
        y = np.asarray(fp4jax.dequantize(q, dtype)).astype(np.float32)
        assert np.isfinite(y).all(), (fmt.name, dtype)
        assert np.abs(y).max() <= lim
        assert np.isfinite(np.asarray(scaled_data(q, dtype)).astype(np.float32)).all()


def test_saturation_keeps_nan_blocks_and_in_range_values():
    x = np.full((2, 32), 0.75, np.float32)
    x[0, 3] = np.nan
    x[1, 0] = 3.0e38  # rounds up to 2^128 under MXFP4's rounded-up scale
    q = fp4jax.quantize(jnp.asarray(x), fp4jax.MXFP4)
    y = np.asarray(fp4jax.dequantize(q))
    assert np.isnan(y[0]).all()  # a NaN block stays NaN
    assert y[1, 0] == np.finfo(np.float32).max  # saturated, not Inf
    assert np.isfinite(np.asarray(scaled_data(q, jnp.bfloat16), np.float32)[1]).all()
    # in-range values are untouched: dequantize equals data * scale exactly
    q2 = fp4jax.quantize(jnp.asarray(np.linspace(-3, 3, 64, dtype=np.float32)), fp4jax.MXFP4)
    d = np.asarray(q2.data, np.float32) * np.repeat(
        np.asarray(q2.scale).astype(ml_dtypes.float8_e8m0fnu).astype(np.float32), 32)
    np.testing.assert_array_equal(np.asarray(fp4jax.dequantize(q2)), d)


def test_dequantize_order_is_pinned_under_jit_and_vmap():
    """``(q * s) * dec`` in that order everywhere: XLA may not reassociate it to
    ``q * (s * dec)`` inside jit + vmap (it did, one ulp off, before the saturation step)."""
    x = jax.random.normal(jax.random.key(2), (4, 8, 64)) * 3
    plain = np.stack([np.asarray(fp4jax.dequantize(fp4jax.quantize(xi))) for xi in x])
    f = jax.jit(jax.vmap(lambda xi: fp4jax.dequantize(fp4jax.quantize(xi))))
    np.testing.assert_array_equal(np.asarray(f(x)).view(np.uint32), plain.view(np.uint32))
