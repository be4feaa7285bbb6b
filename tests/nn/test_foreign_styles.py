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
