"""fp4jax.diagnostics: per-GEMM quantization error and format usage of one layer, checked
against NumPy computations from the public quantizer (float64 products)."""

from __future__ import annotations

import json

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
        if isinstance(v, tuple):  # a float32 fraction: within its rounding of the bounds
            ulp = 2.0 ** -23
            assert v[0] * (1 - ulp) <= float(got[k]) <= v[1] * (1 + ulp), (k, float(got[k]), v)
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


# -- the gradient-to-noise monitor and the automatic switch's decision (FP4-all-the-way 4) --

def test_gradient_noise_matches_a_numpy_hand_computation():
    """``r = ||g|| / (sigma_q sqrt(d))``, ``sigma_q^2 = mean(eps^2)``, ``eps = g_q - g``:
    globally over every parameter, and per ``kernel`` (a scanned kernel split per layer)."""
    rng = np.random.default_rng(0)
    g = {"embed": {"embedding": rng.normal(size=(10, 4))},
         "blocks": {"mix": {"kernel": rng.normal(size=(3, 4, 6)) * [[[1.0]], [[0.1]], [[5.0]]],
                            "bias": rng.normal(size=(3, 6))}},
         "head": {"kernel": rng.normal(size=(6, 2)) * 0.01}}
    eps = jax.tree.map(lambda a: rng.normal(size=a.shape) * 0.05, g)
    eps["head"]["kernel"] = np.zeros((6, 2))  # a high-precision layer: no noise
    g_q = jax.tree.map(lambda a, e: a + e, g, eps)
    got = jax.jit(D.gradient_noise)(*jax.tree.map(jnp.float32, (g, g_q)))

    def want(gs, es):
        gv = np.concatenate([np.ravel(a) for a in gs]).astype(np.float32).astype(np.float64)
        ev = np.concatenate([np.ravel(a) for a in es])
        d = gv.size
        sigma = np.sqrt(np.mean(ev**2))
        return {"d": d, "sigma_q": sigma, "grad_norm": np.linalg.norm(gv),
                "ratio": np.linalg.norm(gv) / (sigma * np.sqrt(d))}

    cases = {"global": want(jax.tree.leaves(g), jax.tree.leaves(eps)),
             "blocks/mix[1]": want([g["blocks"]["mix"]["kernel"][1]],
                                   [eps["blocks"]["mix"]["kernel"][1]])}
    flat = D.flatten_noise(jax.device_get(got))
    assert sorted(flat["layers"]) == ["blocks/mix[0]", "blocks/mix[1]", "blocks/mix[2]", "head"]
    for name, w in cases.items():
        e = flat if name == "global" else flat["layers"][name]
        assert e["d"] == w["d"] and isinstance(e["d"], int)
        for k in ("sigma_q", "grad_norm", "ratio"):
            np.testing.assert_allclose(e[k], w[k], rtol=2e-5, err_msg=f"{name} {k}")
    # the three scanned layers differ by their gradient's scale: 1, 0.1, 5
    r = [flat["layers"][f"blocks/mix[{i}]"]["ratio"] for i in range(3)]
    assert r[1] < r[0] < r[2]
    assert flat["layers"]["head"]["ratio"] == np.inf  # no noise
    np.testing.assert_allclose(flat["grad_q_norm"], np.linalg.norm(np.concatenate(
        [np.ravel(a) for a in jax.tree.leaves(g_q)])), rtol=2e-5)
    with pytest.raises(ValueError, match="same structure"):
        D.gradient_noise(g, {"embed": g["embed"]})


def test_auto_switch_fires_exactly_after_its_window():
    """The ratio must stay below the threshold at every measurement over ``window`` steps:
    a dip shorter than the window, or one interrupted by a measurement above (or NaN),
    does not fire; the step it fires at is the first with ``s - first_below >= window``."""
    t = D.SQRT3
    assert t == pytest.approx(1.7320508)
    steps = list(range(0, 200, 10))
    ratios = [9.0, 5.0, 1.7, 1.6, 2.0, 1.0, float("nan"), 1.5, 1.4, 1.3, 1.2, 1.1,
              1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    trace = list(zip(steps, ratios, strict=True))
    # below from step 20 (broken at 40 by 2.0, at 60 by NaN), then from 70 on
    assert D.auto_switch_step(trace, t, window=0) == 20
    assert D.auto_switch_step(trace, t, window=10) == 30
    assert D.auto_switch_step(trace, t, window=20) == 90  # 70, 80, 90: 90 - 70 = 20
    assert D.auto_switch_step(trace, t, window=25) == 100  # not at 90 (20 < 25)
    assert D.auto_switch_step(trace, t, window=120) == 190
    assert D.auto_switch_step(trace, t, window=121) is None
    assert D.auto_switch_step(trace, 0.3, window=0) is None  # never strictly below 0.3
    # fed one at a time, with the state saved and restored between any two measurements
    # (a resumed run), it fires at the same step, once
    for cut in range(len(trace) + 1):
        m = D.SwitchMonitor(t, 20)
        fired = [s for s, r in trace[:cut] if m.update(s, r)]
        m = D.SwitchMonitor.from_state(json.loads(json.dumps(m.state())))
        fired += [s for s, r in trace[cut:] if m.update(s, r)]
        assert fired == [90] and m.switched_at == 90, cut
    with pytest.raises(ValueError, match="not after"):
        D.SwitchMonitor(last_step=5).update(5, 1.0)
    for bad in (dict(threshold=0.0), dict(threshold=float("inf")), dict(window=-1),
                dict(window=1.5)):
        with pytest.raises(ValueError):
            D.SwitchMonitor(**bad)


def test_mean_layer_stats_leaves_out_the_initialization():
    rec = lambda s, w: {"type": "stats", "step": s,  # noqa: E731
                        "layers": {"a": {"wgrad": {"rel_error": w}}}}
    m = D.mean_layer_stats([rec(0, 9.0), rec(5, 0.2), rec(10, 0.4), rec(15, float("nan"))])
    assert m["a"]["wgrad"]["rel_error"] == pytest.approx(0.3)
    assert D.mean_layer_stats([rec(0, 9.0)])["a"]["wgrad"]["rel_error"] == 9.0
    with pytest.raises(ValueError, match="--stats-every"):
        D.mean_layer_stats([])


def test_gradient_noise_names_a_variables_dicts_layers_as_its_params():
    """The gradients of a whole variables dict ({"params": ...}) name their layers as the
    parameters' (the names of layer_stats, report and the rules), not "params/...";
    layer_stats on a model that quantizes nothing warns instead of returning {} silently."""
    import flax.linen as nn

    m = nn.Dense(8, name="fc")
    v = m.init(jax.random.key(0), jnp.ones((2, 16)))
    g = jax.tree.map(jnp.ones_like, v)
    assert list(D.gradient_noise(g, g)["layers"]) == list(
        D.gradient_noise(g["params"], g["params"])["layers"]) == [""]
    with pytest.warns(D.UnmeasuredLayerWarning, match="ran no quantized linear layer"):
        assert D.layer_stats(m, v, jnp.ones((2, 16)), loss=jnp.sum) == {}
    with pytest.raises(ValueError, match="ran no quantized linear layer"):
        D.layer_stats(m, v, jnp.ones((2, 16)), loss=jnp.sum, unmeasured="raise")
