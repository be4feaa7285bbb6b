"""OutControl in the linen layers (fp4jax.nn.linen.DotGeneral): the channel statistic a
layer sows and the channel split it runs, on a plain ``nn.Dense`` and on fp4jax's Llama
(blocks unrolled and scanned)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from fp4jax import outcontrol as oc
from fp4jax.models.llama import get_preset, quantized_llama
from fp4jax.nn import linen as fnn
from tests.checks import bits_equal

K, N = 256, 64


def test_dense_sows_channel_squares_and_runs_the_split():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 24, K)) * np.exp(rng.uniform(-2, 2, K)),
                    jnp.bfloat16)
    layer = nn.Dense(N, use_bias=False, dtype=jnp.bfloat16, dot_general_cls=functools.partial(
        fnn.DotGeneral, recipe="nvfp4"))
    params = layer.init(jax.random.key(0), x)
    rngs = {"fp4": jax.random.key(1)}
    y0, state = layer.apply(params, x, rngs=rngs, mutable=[fnn.CHANNEL_NORM_COLLECTION])
    (sq,) = state[fnn.CHANNEL_NORM_COLLECTION]["DotGeneral_0"]["sq"]
    xn = np.asarray(x, np.float64).reshape(-1, K)
    np.testing.assert_allclose(sq, (xn ** 2).sum(0), rtol=1e-6)
    bits_equal(layer.apply(params, x, rngs=rngs), y0)  # the statistic changes nothing
    hi, lo = oc.select_channels(jnp.sqrt(sq), oc.outcontrol_count(K))
    split = {fnn.OUTCONTROL_COLLECTION: {"DotGeneral_0": {"hi": hi, "lo": lo}}}
    y = layer.apply({**params, **split}, x, rngs=rngs)
    # the forward GEMMs round to nearest: the key does not enter, so split_dot's bits
    w = params["params"]["kernel"].astype(jnp.bfloat16)
    bits_equal(y, oc.split_dot(x, w, hi, lo, recipe="nvfp4", key=jax.random.key(9),
                               preferred_element_type=jnp.bfloat16))
    assert not np.array_equal(np.asarray(y, np.float32), np.asarray(y0, np.float32))


@pytest.mark.parametrize("scan", [False, True])
def test_llama_layers_carry_the_collections(scan):
    """Every quantized block linear sows its statistic under its own path (scanned: one
    row per block) and takes a split; a split of every layer changes the logits."""
    cfg = get_preset("micro").replace(scan_layers=scan)
    model = quantized_llama(cfg, [(r"block_[0-9]+/.*", "nvfp4"), (".*", None)])
    tokens = jnp.arange(2 * 16, dtype=jnp.int32).reshape(2, 16) % 256
    params = model.init(jax.random.key(0), tokens)
    rngs = {"fp4": jax.random.key(1), "fp4_layer": jax.random.key(2)}
    y0, state = model.apply(params, tokens, rngs=rngs, mutable=[fnn.CHANNEL_NORM_COLLECTION])
    flat = traverse_util.flatten_dict(state[fnn.CHANNEL_NORM_COLLECTION], sep="/")
    assert flat and all(k.endswith("DotGeneral_0/sq") for k in flat)
    lead = (cfg.n_layers,) if scan else ()
    assert all(v[0].shape[:-1] == lead for v in flat.values())
    split = {}
    for k, (sq,) in flat.items():
        n = 16  # micro's K is 64 or 128: a 16-channel split for the test
        order = jnp.argsort(-sq, axis=-1, stable=True).astype(jnp.int32)
        split[k[:-len("sq")] + "hi"], split[k[:-len("sq")] + "lo"] = order[..., :n], order[..., n:]
    y = model.apply({**params, fnn.OUTCONTROL_COLLECTION: traverse_util.unflatten_dict(
        split, sep="/")}, tokens, rngs=rngs)
    assert y.shape == y0.shape and bool(jnp.all(jnp.isfinite(y)))
    assert not np.array_equal(np.asarray(y, np.float32), np.asarray(y0, np.float32))


def test_scanned_blocks_take_each_blocks_own_split():
    """The scanned Llama with the unrolled one's weights and the same per-block split (row
    ``i`` of each stacked split is block ``i``'s) computes the unrolled model's logits; the
    blocks' splits swapped, it does not (so each block runs its own split)."""
    cfg = get_preset("micro").replace(dtype="float32")
    rules = [(r"block_[0-9]+/.*", "nvfp4"), (".*", None)]
    m0 = quantized_llama(cfg, rules)
    m1 = quantized_llama(cfg.replace(scan_layers=True), rules)
    tokens = jnp.arange(2 * 32, dtype=jnp.int32).reshape(2, 32) % 256
    rngs = {"fp4": jax.random.key(1), "fp4_layer": jax.random.key(2)}
    p0 = jax.jit(m0.init)(jax.random.key(0), tokens)["params"]
    blocks = [f"block_{i}" for i in range(cfg.n_layers)]
    moved = {k: v for k, v in p0.items() if k not in blocks}
    moved["blocks_0_1"] = {"block": jax.tree.map(lambda *a: jnp.stack(a),
                                                 *[p0[b] for b in blocks])}
    _, state = jax.jit(lambda p: m0.apply({"params": p}, tokens, rngs=rngs, mutable=[
        fnn.CHANNEL_NORM_COLLECTION]))(p0)
    flat = traverse_util.flatten_dict(state[fnn.CHANNEL_NORM_COLLECTION], sep="/")
    split0, rows = {}, {}
    for k, (sq,) in flat.items():
        order = jnp.argsort(-sq, stable=True).astype(jnp.int32)
        block, rest = k.split("/", 1)
        stem = rest[:-len("sq")]
        split0[f"{block}/{stem}hi"], split0[f"{block}/{stem}lo"] = order[:16], order[16:]
        rows.setdefault(stem, {})[block] = order
    assert len(rows) == 6 and all(len(v) == cfg.n_layers for v in rows.values())

    def stacked(perm):
        out = {}
        for stem, by in rows.items():
            orders = jnp.stack([by[blocks[i]] for i in perm])
            out[f"blocks_0_1/block/{stem}hi"] = orders[:, :16]
            out[f"blocks_0_1/block/{stem}lo"] = orders[:, 16:]
        return {fnn.OUTCONTROL_COLLECTION: traverse_util.unflatten_dict(out, sep="/")}

    want = jax.jit(lambda p: m0.apply({"params": p, fnn.OUTCONTROL_COLLECTION:
                                       traverse_util.unflatten_dict(split0, sep="/")},
                                      tokens, rngs=rngs))(p0)
    scanned = jax.jit(lambda p, s: m1.apply({"params": p, **s}, tokens, rngs=rngs))
    got = scanned(moved, stacked([0, 1]))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    swapped = scanned(moved, stacked([1, 0]))
    assert np.abs(np.asarray(swapped) - np.asarray(want)).max() > 1e-3
