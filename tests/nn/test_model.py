"""Tests of the Llama-style model: shapes, dtypes, parameter count, causality, options."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax.models import PRESETS, LlamaConfig, get_preset, quantized_llama
from fp4jax.nn import PrecisionPolicy

CFG = LlamaConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64)
TOKENS = jax.random.randint(jax.random.key(0), (2, 16), 0, 256, dtype=jnp.int32)
RTN = fp4jax.recipes.nvfp4().replace(sr=False)


def _init(model):
    return jax.jit(model.init)(jax.random.key(1), TOKENS)


@pytest.mark.parametrize("ffn", ["relu2", "swiglu"])
def test_shapes_dtypes_param_count(ffn):
    cfg = CFG.replace(ffn=ffn)
    model = quantized_llama(cfg, PrecisionPolicy(RTN))
    variables = jax.eval_shape(model.init, jax.random.key(1), TOKENS)  # shapes only: no compute
    leaves = jax.tree.leaves(variables)
    assert all(x.dtype == jnp.float32 for x in leaves)  # FP32 master weights
    assert sum(x.size for x in leaves) == cfg.num_params()
    p = variables["params"]
    assert "bias" not in str(jax.tree.structure(p))
    assert p["embed"]["embedding"].shape == (256, 32) and p["lm_head"]["kernel"].shape == (32, 256)
    blk = p["block_0"]
    assert blk["q"]["kernel"].shape == (32, 32) and blk["k"]["kernel"].shape == (32, 16)
    assert ("gate" in blk) == (ffn == "swiglu")
    logits = jax.eval_shape(model.apply, variables, TOKENS)
    assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32


def test_causal():
    # BF16: under NVFP4 the per-tensor amax (global scale) spans all tokens, so a future token
    # can change the quantization of earlier ones (a property of the recipe, not a mask bug).
    model = quantized_llama(CFG, PrecisionPolicy(fp4jax.recipes.bf16()))
    variables = _init(model)
    f = jax.jit(model.apply)
    a = f(variables, TOKENS)
    b = f(variables, TOKENS.at[:, 10].set((TOKENS[:, 10] + 1) % 256))
    np.testing.assert_array_equal(np.asarray(a[:, :10]), np.asarray(b[:, :10]))
    assert not np.allclose(a[:, 10:], b[:, 10:])
    assert np.isfinite(np.asarray(a)).all()


def test_presets_and_errors():
    sizes = {k: c.num_params() for k, c in PRESETS.items()}
    assert 0.5e6 < sizes["tiny"] < 1.5e6 and 80e6 < sizes["100m"] < 120e6
    c = PRESETS["1b"]  # NVIDIA paper's 1.2B ablation model, Appendix (byte vocabulary)
    assert (c.n_layers, c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.ffn) == (
        20, 2048, 6144, 16, 8, "relu2")
    assert sizes["1b"] == 20 * (2 * 2048 * 2048 + 2 * 2048 * 1024 + 2 * 2048 * 6144
                                + 2 * 2048) + 2 * 256 * 2048 + 2048
    with pytest.raises(ValueError, match="valid presets: .*tiny"):
        get_preset("huge")
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="ffn"):
        LlamaConfig(ffn="gelu")
    model = quantized_llama(CFG, PrecisionPolicy(RTN))
    with pytest.raises(ValueError, match="max_seq_len"):
        model.init(jax.random.key(0), jnp.zeros((1, 65), jnp.int32))


def test_scan_layers_is_the_same_function():
    """``scan_layers`` stacks each run of same-recipe blocks (here blocks 1-2 in NVFP4,
    blocks 0 and 3 in BF16) under one flax scan; with the scanned model's weights moved
    into the unrolled model's layout (the same parameter tree as its own init) both compute
    the same logits, and the NVFP4 forward quantizes the same weights (no stochastic
    rounding in fprop). ``scan_remat`` changes no bit."""
    cfg = LlamaConfig(d_model=64, n_layers=4, n_heads=2, n_kv_heads=1, d_ff=128,
                      dtype="float32")
    pol = PrecisionPolicy(fp4jax.recipes.nvfp4(), first_high_precision=1,
                          last_high_precision=1)
    tok = jax.random.randint(jax.random.key(1), (2, 32), 0, 256)
    m0, m1 = quantized_llama(cfg, pol), quantized_llama(cfg.replace(scan_layers=True), pol)
    # jitted (one program, the init's unused forward pass pruned): the same values as eager
    # execution, without dispatching every quantization op one by one
    p1 = jax.jit(m1.init)(jax.random.key(0), tok)["params"]
    assert sorted(p1) == ["block_0", "block_3", "blocks_1_2", "embed", "final_norm", "lm_head"]
    assert p1["blocks_1_2"]["block"]["q"]["kernel"].shape == (2, 64, 64)
    # the scanned blocks get different initial weights (split RNGs)
    k = p1["blocks_1_2"]["block"]["q"]["kernel"]
    assert not np.allclose(k[0], k[1])
    p0 = {n: v for n, v in p1.items() if n != "blocks_1_2"}
    for i in (1, 2):
        p0[f"block_{i}"] = jax.tree.map(lambda a, i=i: a[i - 1], p1["blocks_1_2"]["block"])
    # the unrolled model's own parameters: the same tree, shapes and dtypes (traced only)
    own = jax.eval_shape(m0.init, jax.random.key(0), tok)["params"]
    assert jax.tree.structure(own) == jax.tree.structure(p0)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), own) == jax.tree.map(
        lambda a: (a.shape, a.dtype), p0)
    key = jax.random.key(3)
    want = jax.jit(m0.apply)({"params": p0}, tok, rngs={"fp4": key})

    @jax.jit
    def logits_and_grad(p):  # the scanned model's logits and the gradient of their sum
        out, vjp = jax.vjp(lambda p: m1.apply({"params": p}, tok, rngs={"fp4": key}), p)
        return out, vjp(jnp.ones_like(out))[0]

    got, g = logits_and_grad(p1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # the scanned blocks recompute what they do not save (scan_remat "dots", the default;
    # "full" is the same remat with another policy): the same logits and gradients, bit for
    # bit, as with every residual saved ("none"), SR keys of the backward GEMMs included
    assert m1.cfg.scan_remat == "dots"
    m_none = quantized_llama(cfg.replace(scan_layers=True, scan_remat="none"), pol)
    got_n, g_n = jax.jit(lambda p: (lambda o, f: (o, f(jnp.ones_like(o))[0]))(
        *jax.vjp(lambda p: m_none.apply({"params": p}, tok, rngs={"fp4": key}), p)))(p1)
    for a, b in zip(jax.tree.leaves((got, g)), jax.tree.leaves((got_n, g_n)), strict=True):
        assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
    for remat in ("none", "dots", "full"):  # a remat in the program exactly when asked
        m = quantized_llama(cfg.replace(scan_layers=True, scan_remat=remat), pol)
        jaxpr = jax.make_jaxpr(partial(m.apply, rngs={"fp4": key}))({"params": p1}, tok)
        assert ("remat" in str(jaxpr)) == (remat != "none"), remat
    with pytest.raises(ValueError, match="scan_remat must be one of"):
        cfg.replace(scan_remat="some")
    # gradients flow into every scanned block, and SR keys differ per scanned block
    gk = g["blocks_1_2"]["block"]["up"]["kernel"]
    assert all(float(jnp.abs(gk[i]).sum()) > 0 for i in range(2))
    # a policy with every block in one recipe scans all of them (parameter shapes suffice)
    m2 = quantized_llama(cfg.replace(scan_layers=True), PrecisionPolicy(fp4jax.recipes.nvfp4()))
    assert "blocks_0_3" in jax.eval_shape(m2.init, jax.random.key(0), tok)["params"]


def test_attention_implementations_agree():
    # the cudnn option calls jax.nn.dot_product_attention; its XLA implementation (CPU) must
    # read the same key/value head for each query head and mask the same positions as the
    # einsum path, up to the bf16 rounding of the probabilities (float32 inputs here)
    from fp4jax.models.llama import causal_attention

    ks = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(ks[0], (2, 16, 8, 16))
    k, v = (jax.random.normal(kk, (2, 16, 2, 16)) for kk in ks[1:])
    want = causal_attention(q, k, v)
    got = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # a head mapping off by one group, or no mask, is far away
    swapped = causal_attention(q, k[:, :, ::-1], v[:, :, ::-1])
    assert np.abs(np.asarray(swapped) - np.asarray(want)).max() > 0.1
    with pytest.raises(ValueError, match="attention must be one of"):
        LlamaConfig(attention="flash")
