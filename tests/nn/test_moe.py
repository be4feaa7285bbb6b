"""The mixture-of-experts Llama (fp4jax.models.moe): routing and the load-balancing loss
against NumPy, the experts' FFN against a per-token loop, precision rules reaching the
expert weights (fp4jax.ragged_dot) with the router in high precision, linen and NNX, and a
few training steps."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp4jax
from fp4jax.models import llama
from fp4jax.models.moe import (
    AUX_COLLECTION,
    Experts,
    aux_loss,
    load_balancing_loss,
    moe_ffn,
    route,
)
from fp4jax.nn import PrecisionPolicy, Rule, quantize_model
from tests.checks import bits_equal

CFG = llama.LlamaConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=48,
                        ffn="swiglu", dtype="float32", n_experts=4, top_k=2)
TOKENS = jax.random.randint(jax.random.key(0), (2, 17), 0, 256, dtype=jnp.int32)


def _np_softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("k", [1, 2])
def test_route_and_load_balancing_loss_against_numpy(k):
    rng = np.random.default_rng(k)
    logits = rng.standard_normal((40, 5)).astype(np.float32)
    gates, idx, probs = route(jnp.asarray(logits), k)
    p = _np_softmax(logits)
    want_idx = np.argsort(-p, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(idx, want_idx)
    top = np.take_along_axis(p, want_idx, 1)
    want_gates = top if k == 1 else top / top.sum(1, keepdims=True)  # Switch / Mixtral
    np.testing.assert_allclose(gates, want_gates, rtol=1e-6)
    # Switch Transformer eq. 4-6: G * sum_i f_i P_i, f over the S * k assignments
    f = np.bincount(want_idx.ravel(), minlength=5) / want_idx.size
    np.testing.assert_allclose(load_balancing_loss(probs, idx), 5 * np.sum(f * p.mean(0)),
                               rtol=1e-6)
    # a perfectly balanced router scores 1
    uniform = jnp.full((8, 4), 0.25)
    assert float(load_balancing_loss(uniform, jnp.arange(8)[:, None] % 4)) == pytest.approx(1)


class _Ffn(nn.Module):
    @nn.compact
    def __call__(self, h):
        return moe_ffn(h, n_experts=4, top_k=2, d_ff=24, gated=True, dtype=jnp.float32,
                       init_std=0.3, out_std=0.3, aux_weight=0.01)


def test_moe_ffn_is_the_gate_weighted_sum_of_its_experts():
    """Per token: sum over its k experts of gate * down_e(silu(gate_e(x)) * up_e(x)), in
    NumPy float64 from the parameters, against the sorted, grouped-GEMM version."""
    h = jax.random.normal(jax.random.key(1), (2, 9, 16))
    m = _Ffn()
    v = m.init(jax.random.key(2), h)
    y, st = m.apply({"params": v["params"]}, h, mutable=[AUX_COLLECTION])
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), v["params"])
    x = np.asarray(h, np.float64).reshape(-1, 16)
    gates, idx, probs = route(jnp.asarray(x @ p["router"]["kernel"], jnp.float32), 2)
    want = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(2):
            e = int(idx[t, j])
            g = x[t] @ p["gate"]["kernel"][e]
            f = g / (1 + np.exp(-g)) * (x[t] @ p["up"]["kernel"][e])
            want[t] += float(gates[t, j]) * (f @ p["down"]["kernel"][e])
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 16), want, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(aux_loss(st), 0.01 * load_balancing_loss(probs, idx),
                               rtol=1e-6)


class _Experts(nn.Module):
    @nn.compact
    def __call__(self, x, sizes):
        return Experts(3, 24, 0.5, jnp.float32, name="up")(x, sizes)


class _HandWired(nn.Module):
    """The same layer wired by hand: fp4jax.nn.linen.RaggedDot in the layer's scope."""

    recipe: fp4jax.Recipe

    @nn.compact
    def __call__(self, x, sizes):
        class Up(nn.Module):
            recipe: fp4jax.Recipe

            @nn.compact
            def __call__(self, x, sizes):
                k = self.param("kernel", nn.initializers.normal(0.5), (3, 40, 24))
                return fp4jax.nn.linen.RaggedDot(recipe=self.recipe)(x, k, sizes)
        return Up(self.recipe, name="up")(x, sizes)


def test_rules_put_linen_experts_on_ragged_dot():
    """quantize_model: the experts' (G, K, N) kernel takes the recipe's weight role through
    fp4jax.ragged_dot, its keys drawn as a hand-wired RaggedDot submodule draws them (same
    bits, forward and gradients); the forward is fp4jax.ragged_dot's."""
    r = fp4jax.recipes.fp4_all_the_way()  # stochastic rounding in dgrad and wgrad
    x = jax.random.normal(jax.random.key(3), (20, 40))
    sizes = jnp.asarray([7, 0, 11], jnp.int32)
    q = quantize_model(_Experts(), [Rule(".*", r)])
    params = _Experts().init(jax.random.key(4), x, sizes)
    rngs = {"fp4": jax.random.key(5)}

    def grads(model):
        def f(p, x):
            y = model.apply(p, x, sizes, rngs=rngs)
            return jnp.sum(y ** 2), y
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(params, x)

    ((lq, y), (gq, gxq)), ((lh, _), (gh, gxh)) = grads(q), grads(_HandWired(r))
    bits_equal(lq, lh)
    bits_equal(gq["params"]["up"]["kernel"], gh["params"]["up"]["kernel"])
    bits_equal(gxq, gxh)
    kernel = params["params"]["up"]["kernel"]
    bits_equal(y, fp4jax.ragged_dot(x, kernel, sizes, recipe=r, key=jax.random.key(9)))
    plain = _Experts().apply(params, x, sizes)
    assert not np.allclose(y, plain, rtol=1e-3)  # quantized
    rep = fp4jax.nn.report(q, x, sizes)
    assert rep.layers["up"]["op"] == "ragged_dot"
    assert rep.layers["up"]["recipe"] == "fp4_all_the_way"


class _NnxExperts(nnx.Module):
    def __init__(self, rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (3, 40, 24)) * 0.5)

    def __call__(self, x, sizes):
        return jax.lax.ragged_dot(x, self.kernel[...], sizes)


def test_rules_put_nnx_experts_on_ragged_dot():
    x = jax.random.normal(jax.random.key(3), (20, 40))
    sizes = jnp.asarray([7, 0, 11], jnp.int32)
    model = _NnxExperts(nnx.Rngs(params=0))
    w = model.kernel[...]
    plain = model(x, sizes)
    q = quantize_model(model, [Rule(".*", "nvfp4")], rngs=nnx.Rngs(fp4=1))
    y = q(x, sizes)  # NVFP4's forward rounds to nearest: no key enters it
    bits_equal(y, fp4jax.ragged_dot(x, w, sizes, recipe="nvfp4", key=jax.random.key(0)))
    assert not np.allclose(y, plain, rtol=1e-3)


def test_moe_llama_policy_quantizes_experts_and_keeps_the_router():
    """A PrecisionPolicy reaches the experts at the dense FFN's paths (gate, up, down as
    ragged_dot layers) and leaves the router in high precision (ROUTER_RULE)."""
    cfg = CFG.replace(n_layers=1)
    model = llama.quantized_llama(cfg, PrecisionPolicy(fp4jax.recipes.nvfp4()))
    rep = fp4jax.nn.report(model, TOKENS[:, :-1])
    for name in ("gate", "up", "down"):
        layer = rep.layers[f"block_0/{name}"]
        assert (layer["op"], layer["recipe"]) == ("ragged_dot", "nvfp4")
        assert len(layer["weight"]) == 3 and layer["weight"][0] == 4
    assert rep.layers["block_0/router"]["recipe"] is None
    assert rep.layers["block_0/q"]["recipe"] == "nvfp4"
    variables = jax.eval_shape(model.init, jax.random.key(1), TOKENS[:, :-1])
    assert sum(a.size for a in jax.tree.leaves(variables["params"])) == cfg.num_params()


def test_moe_config_errors():
    with pytest.raises(ValueError, match="top_k"):
        CFG.replace(top_k=5)
    with pytest.raises(ValueError, match="smooth_swiglu"):
        CFG.replace(ffn="smooth_swiglu")


def test_moe_llama_trains_with_the_aux_loss():
    """A few Adam steps of the (float32, unquantized) MoE Llama on cross-entropy plus the
    routers' sown load-balancing losses: the loss falls, each router's aux term is near its
    balanced value (alpha * 1) and the router kernels get gradients."""
    model = llama.Llama(CFG.replace(n_layers=1))
    params = model.init(jax.random.key(0), TOKENS[:, :-1])["params"]
    opt = optax.adam(3e-3)
    state = opt.init(params)

    def loss(p):
        logits, st = model.apply({"params": p}, TOKENS[:, :-1], mutable=[AUX_COLLECTION])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()
        return ce + aux_loss(st), aux_loss(st)

    @jax.jit
    def step(p, s):
        (total, aux), g = jax.value_and_grad(loss, has_aux=True)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, total, aux, g

    losses = []
    for _ in range(4):
        params, state, total, aux, g = step(params, state)
        losses.append(float(total))
    assert losses[-1] < losses[0] - 0.2, losses
    assert 0.01 <= float(aux) < 0.015  # alpha = 0.01 times ~1 (near-uniform load)
    assert float(jnp.abs(g["block_0"]["router"]["kernel"]).max()) > 0


def test_harness_loss_adds_the_moe_aux_loss():
    """fp4jax-train's loss_fn: the cross-entropy plus the routers' sown losses for an MoE
    Llama (a dense one's is the cross-entropy alone, bit for bit: the golden step of
    tests/nn/test_llama_rules.py); the --n-experts/--top-k config."""
    from fp4jax.train import ConfigError, TrainConfig, loss_fn
    from fp4jax.train.config import model_config, validate_config

    model = llama.Llama(CFG.replace(n_layers=1))
    params = jax.jit(model.init)(jax.random.key(1), TOKENS[:, :-1])["params"]

    @jax.jit
    def both(p):
        logits, st = model.apply({"params": p}, TOKENS[:, :-1], mutable=[AUX_COLLECTION])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()
        return loss_fn(model, p, TOKENS, jax.random.key(0)), ce, aux_loss(st)

    got, ce, aux = both(params)
    assert float(aux) > 0
    np.testing.assert_allclose(got, ce + aux, rtol=1e-6)
    mc = model_config(TrainConfig(preset="micro", ffn="swiglu", n_experts=4, top_k=1))
    assert (mc.n_experts, mc.top_k, mc.ffn) == (4, 1, "swiglu")
    for bad in ({"n_experts": -1}, {"n_experts": 2, "top_k": 3}, {"top_k": 0},
                {"n_experts": 2, "ffn": "smooth_swiglu"}):
        with pytest.raises(ConfigError):
            validate_config(TrainConfig(**bad))
