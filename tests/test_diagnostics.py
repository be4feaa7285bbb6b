"""fp4jax.diagnostics: per-GEMM quantization error and format usage of one layer, checked
against NumPy computations from the public quantizer (float64 products)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import diagnostics as D

RTN = fp4jax.recipes.nvfp4().replace(sr=False)
X = jax.random.normal(jax.random.key(1), (2, 48, 64)) * jnp.exp(
    jax.random.normal(jax.random.key(4), (2, 48, 1)))  # rows of different magnitudes
W = jax.random.normal(jax.random.key(2), (64, 40)) * 0.05
DY = jax.random.normal(jax.random.key(3), (2, 48, 40)) * 1e-3


def _np(q):
    return np.asarray(fp4jax.dequantize(q), np.float64)


def _usage(t, q):
    """underflow, saturation, scale range and amax of operand t (NumPy) given its quantized q."""
    t = np.asarray(t, np.float64)
    data = np.asarray(q.data.astype(jnp.float32))
    s = np.asarray(q.scale.astype(jnp.float32), np.float64)
    b = q.fmt.block_size
    if q.block_2d:  # one scale per b x b tile
        s = np.repeat(np.repeat(s, b, axis=-2), b, axis=-1)[: t.shape[0], : t.shape[1]]
    else:
        ax = q.axis % t.ndim
        s = np.take(np.repeat(s, b, axis=ax), np.arange(t.shape[ax]), axis=ax)
    dec = s * float(q.global_scale)
    nz = np.isfinite(t) & (t != 0)
    blocks = np.asarray(q.scale.astype(jnp.float32), np.float64) * float(q.global_scale)
    # elements within 1e-6 of the block maximum 6 * dec may go either way (float32 encode
    # scale vs this float64 product): the count must lie between the two
    lo = np.sum(nz & (np.abs(t) > 6 * dec * (1 + 1e-6))) / nz.sum()
    hi = np.sum(nz & (np.abs(t) > 6 * dec * (1 - 1e-6))) / nz.sum()
    return {"underflow": np.sum(nz & (data == 0)) / nz.sum(), "saturation": (lo, hi),
            "scale_min": blocks[blocks > 0].min(), "scale_max": blocks.max(),
            "amax": np.abs(t).max()}


def _check(got, want, rtol=1e-6):
    for k, v in want.items():
        if isinstance(v, tuple):
            assert v[0] <= float(got[k]) <= v[1], (k, float(got[k]), v)
        else:
            np.testing.assert_allclose(float(got[k]), v, rtol=rtol, atol=1e-12, err_msg=k)
    assert want["saturation"][1] > 0  # the inputs do saturate some elements


@pytest.fixture(scope="module")
def stats():
    return jax.jit(lambda x, w, dy: D.gemm_stats(x, w, dy, recipe=RTN))(X, W, DY)


def test_fprop_error_and_usage_match_numpy(stats):
    x2 = np.asarray(X, np.float64).reshape(-1, 64)
    qx = fp4jax.quantize(X.reshape(-1, 64), axis=-1)
    qw = fp4jax.quantize(W, block_2d=True)
    y = x2 @ np.asarray(W, np.float64)
    yq = _np(qx) @ _np(qw)
    np.testing.assert_allclose(float(stats["fprop"]["rel_error"]),
                               np.linalg.norm(yq - y) / np.linalg.norm(y), rtol=1e-4)
    _check(stats["fprop"]["lhs"], _usage(x2, qx))
    _check(stats["fprop"]["rhs"], _usage(W, qw))


def test_wgrad_operands_are_the_rht_rotated_token_blocks(stats):
    x2, g2 = X.reshape(-1, 64), DY.reshape(-1, 40)
    rx = fp4jax.random_hadamard_transform(x2, axis=0)
    rg = fp4jax.random_hadamard_transform(g2, axis=0)
    qx, qg = fp4jax.quantize(rx, axis=0), fp4jax.quantize(rg, axis=0)
    _check(stats["wgrad"]["lhs"], _usage(rx, qx))
    _check(stats["wgrad"]["rhs"], _usage(rg, qg))
    dw = np.asarray(x2, np.float64).T @ np.asarray(g2, np.float64)
    dwq = _np(qx).T @ _np(qg)  # the RHT cancels in the product (orthogonal)
    np.testing.assert_allclose(float(stats["wgrad"]["rel_error"]),
                               np.linalg.norm(dwq - dw) / np.linalg.norm(dw), rtol=1e-3)


def test_dgrad_error_matches_numpy(stats):
    g2 = np.asarray(DY, np.float64).reshape(-1, 40)
    qg = fp4jax.quantize(DY.reshape(-1, 40), axis=-1)
    qw = fp4jax.quantize(W, block_2d=True)  # dgrad reuses the 2D weight tiles
    dx = g2 @ np.asarray(W, np.float64).T
    dxq = _np(qg) @ _np(qw).T
    np.testing.assert_allclose(float(stats["dgrad"]["rel_error"]),
                               np.linalg.norm(dxq - dx) / np.linalg.norm(dx), rtol=1e-4)


def test_unquantized_recipe_and_mxfp4_order():
    s = D.gemm_stats(X, W, DY, recipe="bf16")
    assert all(float(s[g]["rel_error"]) < 1e-6 for g in ("fprop", "dgrad", "wgrad"))
    assert set(s["fprop"]["lhs"]) == {"amax"}
    m = D.gemm_stats(X, W, DY, recipe=fp4jax.recipes.mxfp4().replace(sr=False))
    n = D.gemm_stats(X, W, DY, recipe=RTN)
    # power-of-two scales round the block max up (never saturate) and lose more accuracy
    assert float(m["fprop"]["lhs"]["saturation"]) == 0.0
    assert float(m["fprop"]["rel_error"]) > float(n["fprop"]["rel_error"])


def test_sr_recipe_needs_key_and_bad_shapes_are_named():
    with pytest.raises(ValueError, match="pass key="):
        D.gemm_stats(X, W, DY)
    with pytest.raises(ValueError, match="dy must have shape"):
        D.gemm_stats(X, W, DY[:, :, :8], recipe=RTN)
    with pytest.raises(ValueError, match=r"need x \(\.\.\., K\) and w \(K, N\)"):
        D.gemm_stats(X, W.T, DY, recipe=RTN)
    s = D.gemm_stats(X, W, DY, key=jax.random.key(0))  # SR recipe with its key
    assert np.isfinite(float(s["wgrad"]["rel_error"]))
    layer = RTN.replace(**{"wgrad.hadamard_signs": "layer"})
    with pytest.raises(ValueError, match="rht_key="):
        D.gemm_stats(X, W, DY, recipe=layer)
    a = D.gemm_stats(X, W, DY, recipe=layer, rht_key=jax.random.key(5))
    b = D.gemm_stats(X, W, DY, recipe=layer, rht_key=jax.random.key(6))
    assert float(a["wgrad"]["lhs"]["amax"]) != float(b["wgrad"]["lhs"]["amax"])  # signs


def test_recommend_ranks_by_wgrad_then_dgrad_within_budget():
    mk = lambda f, d, w: {"fprop": {"rel_error": f}, "dgrad": {"rel_error": d},  # noqa: E731
                          "wgrad": {"rel_error": w}}
    stats = {"attn.q": mk(0.1, 0.1, 0.10), "mlp.down": mk(0.1, 0.2, 0.30),
             "mlp.up": mk(0.9, 0.3, 0.20), "attn.o": mk(0.1, 0.4, 0.20),
             "attn.k": mk(0.2, 0.1, 0.05), "attn.v": mk(0.2, 0.1, 0.05)}
    assert D.recommend_high_precision_layers(stats, budget=0.5) == [
        "mlp.down", "attn.o", "mlp.up"]
    assert D.recommend_high_precision_layers(stats, budget=0.15) == []  # floor(0.9) = 0
    assert D.recommend_high_precision_layers(stats, budget=1.0)[-2:] == ["attn.k", "attn.v"]
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="budget"):
            D.recommend_high_precision_layers(stats, budget=bad)
