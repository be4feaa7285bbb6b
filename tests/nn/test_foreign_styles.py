"""``quantize_model`` and ``quantize_function`` on models in the styles of public packages
(``tests/foreign_models.py``: a shared scope and a tied head, ``nn.remat`` blocks with
block-diagonal einsums, a scanned Equinox-style pure function): with every rule ``None``
the original function bit for bit; ``report``/``function_report`` list every product of
a weight, whatever its name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.nn import function_report, quantize_function, quantize_model, report
from fp4jax.train.models import CalledModel
from tests import foreign_models as fm

VOCAB, SEQ = 64, 16
TOKENS = jax.random.randint(jax.random.key(3), (2, SEQ), 0, VOCAB)


def test_linen_styles_all_none_are_the_original_and_every_weight_is_reported():
    for model, want in (
            (fm.shared_scope_lm(VOCAB, SEQ),
             {f"h_{i}/{n}": 1 for i in range(2) for n in ("q_proj", "k_proj", "v_proj",
                                                           "o_proj")}
             | {"h_0/ffn": 2, "h_1/ffn": 2, "wte": 1}),
            (CalledModel(*fm.block_diag_lm(VOCAB, SEQ)),
             {"cell_0": 1, "cell_0/proj": 1, "cell_1": 1, "cell_1/proj": 1, "lm_head": 1})):
        v = jax.jit(model.init)({"params": jax.random.key(0)}, TOKENS)
        hp = quantize_model(model, [(".*", None)])
        np.testing.assert_array_equal(jax.jit(hp.apply)(v, TOKENS),
                                      jax.jit(model.apply)(v, TOKENS))
        rep = report(quantize_model(model, [(".*", "nvfp4")]), TOKENS)
        assert {p: len(d["weights"]) for p, d in rep.layers.items()} == want
        assert rep.uncovered == []
        assert all(d["recipe"] == "nvfp4" for d in rep.layers.values())


@pytest.mark.slow
def test_scanned_pure_function_under_quantize_function():
    """The Equinox-style model: its scanned layers' products are found by scope
    (``layers/mlp_in``, ``layers/mlp_out``) and by parameter path (``layers/w_in``, ...)
    on every supported JAX (0.12's scan equation has other parameters); with rules
    ``None`` it is the original bit for bit; quantized, its gradients reach every weight."""
    params = fm.scanned_mlp_params(jax.random.key(0))
    want = {"layers/mlp_in": (32, 64), "layers/mlp_out": (64, 32), "head": (32, 64)}
    for paths, names in (("scope", want),
                         ("params", {"layers/w_in": (32, 64), "layers/w_out": (64, 32),
                                     "head": (32, 64)})):
        q = quantize_function(fm.scanned_mlp, [(".*", "nvfp4")], paths=paths)
        rep = function_report(q, params, TOKENS)
        assert {p: d["weight"] for p, d in rep.layers.items()} == names
        assert rep.uncovered == [] and rep.unused_rules == []
    none = quantize_function(fm.scanned_mlp, [(".*", None)])
    np.testing.assert_array_equal(jax.jit(none)(params, TOKENS),
                                  jax.jit(fm.scanned_mlp)(params, TOKENS))

    q = quantize_function(fm.scanned_mlp, [("head", None), (".*", "nvfp4")])
    k = jax.random.key(7)

    def loss(p, fn):
        return jnp.mean(jnp.square(fn(p)))

    g_q = jax.jit(jax.grad(lambda p: loss(p, lambda p: q(p, TOKENS, fp4_key=k,
                                                         fp4_layer_key=k))))(params)
    g = jax.jit(jax.grad(lambda p: loss(p, lambda p: fm.scanned_mlp(p, TOKENS))))(params)
    for name in ("w_in", "w_out"):  # every block's weights: FP4 gradients, near the exact
        a, b = g_q["layers"][name], g["layers"][name]
        assert bool(jnp.all(jnp.isfinite(a))) and not np.array_equal(a, b)
        for i in range(a.shape[0]):
            rel = float(jnp.linalg.norm(a[i] - b[i]) / jnp.linalg.norm(b[i]))
            assert 0 < rel < 0.5, (name, i, rel)


def test_attention_scores_of_biased_projections_are_activation_products():
    """q.k and p.v, whose operands are projections with a bias added (computed from an
    activation and a parameter), are products of two activations, left alone, not "not
    covered"; a weight scaled by a constant still is named as not covered."""
    def attn(p, x):
        with jax.named_scope("attn"):
            with jax.named_scope("query_proj"):
                q = x @ p["wq"] + p["bq"]
            with jax.named_scope("key_proj"):
                k = x @ p["wk"] + p["bk"]
            with jax.named_scope("scores"):
                s = jax.nn.softmax(q @ k.T)
            with jax.named_scope("pv"):
                o = s @ k
            with jax.named_scope("scaled"):
                return o + x @ (p["wq"] * 0.5)

    ks = jax.random.split(jax.random.key(0), 4)
    p = {"wq": jax.random.normal(ks[0], (32, 32)), "bq": jax.random.normal(ks[1], (32,)),
         "wk": jax.random.normal(ks[2], (32, 32)), "bk": jax.random.normal(ks[3], (32,))}
    rep = function_report(quantize_function(attn, [(".*", "nvfp4")]), p,
                          jnp.ones((16, 32)))
    assert set(rep.layers) == {"attn/query_proj", "attn/key_proj"}
    assert sorted(a.split(":")[0] for a in rep.activation_products) == ["attn/pv",
                                                                        "attn/scores"]
    assert len(rep.uncovered) == 1 and rep.uncovered[0].startswith("attn/scaled")
    assert "computed from the parameter wq (mul)" in rep.uncovered[0]
