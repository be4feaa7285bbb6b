"""``fp4jax-train --model`` on models in the styles of public packages
(``tests/foreign_models.py``): the layer count, the run's ``"precision"`` record and the
GEMM share come from what ``fp4jax.nn.report`` found quantized, whatever the weights are
called; a factory may return ``(model, call)`` for a model returning a structure or
needing positions; the gradient-to-noise ratio covers every weight."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp4jax
from fp4jax import diagnostics as D
from fp4jax import train as T
from fp4jax.train import models
from tests import foreign_models as fm

VOCAB, SEQ = 64, 16


def _run_models(name: str, tmp_path, rules: list | None = None, recipe: str = "nvfp4"):
    kw = {}
    if rules is not None:
        path = tmp_path / "rules.json"
        path.write_text(json.dumps(rules))
        kw["rules"] = str(path)
    cfg = T.TrainConfig(model=f"tests.foreign_models:{name}", recipe=recipe, seq_len=SEQ,
                        first_bf16=0, last_bf16=0, **kw)
    return models.foreign_models(cfg, cfg, T.run_recipe(cfg)[1], VOCAB)


def test_shared_scope_and_tied_head_are_counted_from_the_report(tmp_path):
    """SharedScopeLM multiplies 6 weights a block (q, k, v, o; the FFN's up kernel and its
    w_down, one shared scope) and the tied embedding: the header counts 13 linear layers,
    12 in NVFP4 with the embedding kept by a rule, where the parameters named "kernel"
    alone gave 10 of 10."""
    rm = _run_models("shared_scope_lm", tmp_path, [{"pattern": "wte", "recipe": None}])
    blocks = [f"h_{i}/{n}" for i in range(2) for n in ("q_proj", "k_proj", "v_proj",
                                                         "o_proj", "ffn")]
    assert set(rm.layers) == {*blocks, "wte"}
    nv = fp4jax.recipes.spec(fp4jax.recipes.nvfp4())
    assert rm.layers == {**{b: nv for b in blocks}, "wte": None}
    assert rm.summary.startswith("12 of 13 linear layers in NVFP4 (92%); high precision: wte")
    assert rm.fp4_names == blocks
    # the GEMM share in high precision: the embedding's elements of all weights' elements
    d, f = 32, 64
    per_block = 4 * d * d + 2 * d * f
    assert rm.gemm_fraction(10, None) == pytest.approx(VOCAB * d / (2 * per_block + VOCAB * d))


def test_bf16_recipe_counts_the_same_layers(tmp_path):
    rm = _run_models("shared_scope_lm", tmp_path, recipe="bf16")
    assert len(rm.layers) == 11 and set(rm.layers.values()) == {"bf16"}
    assert rm.summary.startswith("0 of 13 linear layers quantized")


@pytest.mark.slow
def test_factory_returning_model_and_call(tmp_path):
    """BlockDiagLM returns an Output dataclass and needs positions: its factory returns
    (model, call). Its layers (the block-diagonal gate einsums, a weight named "gates" with
    a batch axis, under nn.remat; the nn.Einsum projections) are counted; the parameters
    and the logits are the model's own (bf16: bit for bit)."""
    rm = _run_models("block_diag_lm", tmp_path)
    assert set(rm.layers) == {"cell_0", "cell_0/proj", "cell_1", "cell_1/proj", "lm_head"}
    assert rm.summary.startswith("4 of 5 linear layers in NVFP4 (80%); high precision: "
                                 "lm_head")
    hp = _run_models("block_diag_lm", tmp_path, recipe="bf16").models[False]
    tokens = jax.random.randint(jax.random.key(1), (2, SEQ), 0, VOCAB)
    v = jax.jit(hp.init)({"params": jax.random.key(0)}, tokens)
    plain, call = fm.block_diag_lm(VOCAB, SEQ)
    pos = jnp.broadcast_to(jnp.arange(SEQ), tokens.shape)
    v0 = jax.jit(plain.init)({"params": jax.random.key(0)}, tokens, pos)
    assert jax.tree.structure(v) == jax.tree.structure(v0)
    jax.tree.map(np.testing.assert_array_equal, v, v0)
    want = jax.jit(lambda v: plain.apply(v, tokens, pos).logits)(v0)
    np.testing.assert_array_equal(jax.jit(hp.apply)(v, tokens), want)
    # the quantized model trains on the same parameters
    q = rm.models[False]
    k = jax.random.key(2)
    out = jax.jit(lambda v: q.apply(v, tokens, rngs={"fp4": k, "fp4_layer": k}))(v)
    assert out.shape == (2, SEQ, VOCAB) and bool(jnp.all(jnp.isfinite(out)))
    assert not np.array_equal(out, want)

    rm = _run_models("tuple_lm", tmp_path)
    assert "lm/h_0/ffn" in rm.layers and rm.summary.startswith("7 of 7 linear layers")


def test_nnx_factory_returning_model_and_call(tmp_path):
    """An NNX factory (taking rngs) returns (model, call): the model needs positions and
    returns an Output. Its layers are counted from the report traced through call; the
    high-precision model's logits are the NNX model's own, bit for bit; NVFP4 changes
    them."""
    rm = _run_models("nnx_pos_lm", tmp_path)
    want_layers = {"ups/0", "ups/1", "downs/0", "downs/1", "lm_head"}
    assert set(rm.layers) == want_layers, rm.layers
    assert rm.summary.startswith("4 of 5 linear layers in NVFP4 (80%); high precision: "
                                 "lm_head"), rm.summary
    tokens = jax.random.randint(jax.random.key(1), (2, SEQ), 0, VOCAB)
    hp = _run_models("nnx_pos_lm", tmp_path, recipe="bf16").models[False]
    v = hp.init(jax.random.key(0), tokens)  # op by op, as the model built below
    model, call = fm.nnx_pos_lm(VOCAB, SEQ, rngs=nnx.Rngs(params=jax.random.key(0)))
    want = call(model, tokens)
    np.testing.assert_array_equal(hp.apply(v, tokens), want)  # both op by op
    k = jax.random.key(2)
    q = rm.models[False]
    out = jax.jit(lambda v: q.apply(v, tokens, rngs={"fp4": k, "fp4_layer": k}))(v)
    assert out.shape == (2, SEQ, VOCAB) and bool(jnp.all(jnp.isfinite(out)))
    assert not np.array_equal(out, want)
    with pytest.raises(ValueError, match=r"nnx_pos_lm_bare: the model does not run on token "
                                         r"ids.*return \(model, call\)"):
        _run_models("nnx_pos_lm_bare", tmp_path)


def test_a_model_needing_other_inputs_is_refused_naming_the_way_out(tmp_path):
    with pytest.raises(ValueError, match=r"block_diag_lm_bare: the model does not run on token "
                                         r"ids.*positions.*return \(model, call\)"):
        _run_models("block_diag_lm_bare", tmp_path)


def test_gradient_noise_measures_every_reported_weight():
    """With the report's layers, gradient_noise measures the weights not named "kernel"
    (the shared scope's w_down, the tied embedding) and leaves biases and norms out."""
    tokens = jax.random.randint(jax.random.key(1), (2, SEQ), 0, VOCAB)
    q = fp4jax.nn.quantize_model(fm.shared_scope_lm(VOCAB, SEQ), [(".*", "nvfp4")])
    rep = fp4jax.nn.report(q, tokens)
    params = jax.eval_shape(q.init, {"params": jax.random.key(0)}, tokens)["params"]
    g = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), params)
    gq = jax.tree.map(lambda a: jnp.full(a.shape, 3.0, a.dtype), params)
    got = D.gradient_noise(g, gq, scan_axes=rep.scan_axes, layers=rep.layers)["layers"]
    names = {f"h_{i}/{n}" for i in range(2) for n in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                      "ffn", "ffn:w_down")} | {"wte:embedding"}
    assert set(got) == names
    for n, e in got.items():  # ||g|| / ||gq - g|| = 1 / 2 for every layer
        assert float(e["ratio"]) == pytest.approx(0.5), n
    assert float(got["h_0/ffn:w_down"]["d"]) == 64 * 32
    kernels_only = D.gradient_noise(g, gq, scan_axes=rep.scan_axes)["layers"]
    assert set(kernels_only) == {n for n in names if ":" not in n}


def _stats_names(qmodel, tokens, **kw):
    """The layers ``layer_stats`` measures (shapes only) and its warnings."""
    import warnings

    k = jax.random.key(1)
    v = jax.eval_shape(qmodel.init, {"params": jax.random.key(0)}, tokens)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        st = jax.eval_shape(lambda v: D.layer_stats(
            qmodel, v, tokens, loss=lambda y: jnp.mean(jnp.square(y)),
            rngs={"fp4": k, "fp4_layer": k}, **kw), v)
    return set(st), [str(x.message) for x in w]


@pytest.mark.slow
def test_layer_stats_measures_both_weights_of_a_shared_scope():
    """The shared scope's up (a linen Dense) and down (its own einsum) products are two
    measurements, ``h_i/ffn`` and ``h_i/ffn#2``; every reported product is measured."""
    tokens = jnp.zeros((2, SEQ), jnp.int32)
    q = fp4jax.nn.quantize_model(fm.shared_scope_lm(VOCAB, SEQ), [(".*", "nvfp4")])
    names, warned = _stats_names(q, tokens)
    rep = fp4jax.nn.report(q, tokens)
    products = sum(len(d["weights"]) for d in rep.layers.values())
    assert len(names) == products == 13 and warned == []
    assert {"h_0/ffn", "h_0/ffn#2", "h_1/ffn", "h_1/ffn#2", "wte"} <= names


@pytest.mark.slow
def test_layer_stats_names_what_it_cannot_measure_and_why():
    """Under nn.remat the setup-style block-diagonal gates cannot be measured: each is
    named with its reason and the way around it; a quantize_function model is refused
    with a ValueError naming function_report and gemm_stats."""
    tokens = jnp.zeros((2, SEQ), jnp.int32)
    q = fp4jax.nn.quantize_model(models.CalledModel(*fm.block_diag_lm(VOCAB, SEQ)),
                                 [(".*", "nvfp4")])
    names, warned = _stats_names(q, tokens)
    assert names == {"cell_0/proj", "cell_1/proj", "lm_head"}
    assert len(warned) == 1
    for cell in ("cell_0", "cell_1"):
        assert f"{cell}: runs inside a transform of the model" in warned[0]
    assert "without that transform" in warned[0]

    qfn = fp4jax.nn.quantize_function(fm.scanned_mlp, [(".*", "nvfp4")])
    params = fm.scanned_mlp_params(jax.random.key(0))
    with pytest.raises(ValueError, match="quantize_function.*function_report.*gemm_stats"):
        D.layer_stats(qfn, {"params": params}, tokens, loss=jnp.sum)
