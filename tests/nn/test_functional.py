"""``fp4jax.nn.quantize_function``: precision rules on plain JAX functions by named scope,
checked bit for bit against the same model wired by hand with ``fp4jax.dot_general``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax.nn import Rule, function_report, layer_key, quantize_function

DN = (((1,), (0,)), ((), ()))
REC = fp4jax.recipes.get("nvfp4")


def _params():
    ks = jax.random.split(jax.random.key(0), 4)
    return {"up": jax.random.normal(ks[0], (64, 128)) * 0.2,
            "down": jax.random.normal(ks[1], (128, 64)) * 0.1,
            "stack": jax.random.normal(ks[2], (3, 64, 64)) * 0.1}


X = jax.random.normal(jax.random.key(5), (32, 64))


def model(p, x):
    """Products written four ways: ``@``, a jitted einsum helper, a scanned stack and an
    activation x activation product."""
    with jax.named_scope("block_0"):
        with jax.named_scope("up"):
            h = jax.nn.gelu(x @ p["up"])

        @jax.jit
        def down(h, w):
            with jax.named_scope("down"):
                return jnp.einsum("tk,kn->tn", h, w)
        y = down(h, p["down"])

    def body(c, w):
        with jax.named_scope("layer"):
            return jnp.tanh(jax.lax.dot_general(c, w, DN)) + c, None
    with jax.named_scope("stack"):
        y, _ = jax.lax.scan(body, y, p["stack"])
    with jax.named_scope("scores"):
        s = y @ y.T
    return jnp.sum(y * y) + 1e-3 * jnp.sum(s)


def by_hand(p, x, key, recipe=REC, down_recipe=REC):
    """``model`` with every weight product through ``fp4jax.dot_general``, keys as the
    module docstring defines them."""
    def q(a, w, path, rec, n=0, idx=()):
        if rec is None:
            return jax.lax.dot_general(a, w, DN)
        k = jax.random.fold_in(layer_key(key, path), n)
        for i in idx:
            k = jax.random.fold_in(k, i)
        return fp4jax.dot_general(a, w, DN, recipe=rec, key=k)

    h = jax.nn.gelu(q(x, p["up"], "block_0/up", recipe))
    y = q(h, p["down"], "block_0/down", down_recipe)

    def body(c, wi):
        w, i = wi
        return jnp.tanh(q(c, w, "stack/layer", recipe, idx=(i,))) + c, None
    y, _ = jax.lax.scan(body, y, (p["stack"], jnp.arange(3, dtype=jnp.uint32)))
    s = y @ y.T
    return jnp.sum(y * y) + 1e-3 * jnp.sum(s)


def _bits(tree):
    return [np.asarray(v, np.float32).view(np.uint32) for v in jax.tree_util.tree_leaves(tree)]


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(_bits(a), _bits(b), strict=True))


def test_loss_and_gradients_equal_the_hand_wired_model():
    p, key = _params(), jax.random.key(7)
    qm = quantize_function(model, [Rule(r".*", "nvfp4")])
    got = jax.jit(jax.value_and_grad(lambda p: qm(p, X, fp4_key=key)))(p)
    want = jax.jit(jax.value_and_grad(lambda p: by_hand(p, X, key)))(p)
    assert _same(got, want)
    plain = jax.value_and_grad(lambda p: model(p, X))(p)
    assert not _same(got, plain)  # the rules did quantize


def test_first_match_wins_and_none_keeps_high_precision():
    p, key = _params(), jax.random.key(3)
    rules = [(r"block_0/down", None), (r".*", "nvfp4")]
    qm = quantize_function(model, rules)
    got = jax.jit(lambda p: qm(p, X, fp4_key=key))(p)  # the forward shows which ran
    assert _same(got, jax.jit(lambda p: by_hand(p, X, key, down_recipe=None))(p))
    assert not _same(got, jax.jit(lambda p: by_hand(p, X, key))(p))
    rep = function_report(qm, p, X)
    assert rep.layers["block_0/down"]["recipe"] is None
    assert rep.layers["block_0/up"]["recipe"] == REC.name
    assert rep.layers["stack/layer"]["weight"] == (64, 64)
    assert len(rep.activation_products) == 1 and rep.activation_products[0].startswith("scores")
    assert not rep.unused_rules


def test_unmatched_function_is_unchanged_and_unused_rules_are_listed():
    p = _params()
    qm = quantize_function(model, [Rule(r"nothing/.*", "nvfp4")])
    assert _same(jax.grad(lambda p: qm(p, X))(p), jax.grad(lambda p: model(p, X))(p))
    rep = function_report(qm, p, X)
    assert [i for i, _ in rep.unused_rules] == [0]
    assert all(d["recipe"] is None for d in rep.layers.values())


def test_weight_on_the_left_takes_the_weight_role():
    """Equinox's ``Linear`` computes ``weight @ x`` per example (weight ``(out, in)``)."""
    w = jax.random.normal(jax.random.key(1), (48, 64)) * 0.1
    key = jax.random.key(2)

    def linear(w, x):
        with jax.named_scope("proj"):
            return jax.vmap(lambda xi: w @ xi)(x)
    qlin = quantize_function(linear, [(r"proj", "nvfp4")])
    got = jax.value_and_grad(lambda w, x: qlin(w, x, fp4_key=key).sum(), (0, 1))(w, X)
    k = jax.random.fold_in(layer_key(key, "proj"), 0)
    want = jax.value_and_grad(
        lambda w, x: fp4jax.dot_general(x, w.T, DN, recipe=REC, key=k).sum(), (0, 1))(w, X)
    assert _same(got, want)


def test_checkpointed_body_keeps_its_bits():
    """A ``jax.checkpoint`` around a product is rebuilt around the rewritten body."""
    w, key = _params()["up"], jax.random.key(4)

    def fn(w, x):
        @jax.checkpoint
        def layer(w, x):
            with jax.named_scope("ck"):
                return jnp.tanh(x @ w)
        return layer(w, x).sum()
    qf = quantize_function(fn, [(r"ck", "nvfp4")])
    k = jax.random.fold_in(layer_key(key, "ck"), 0)
    got = jax.value_and_grad(lambda w: qf(w, X, fp4_key=key))(w)
    want = jax.value_and_grad(
        lambda w: jnp.tanh(fp4jax.dot_general(X, w, DN, recipe=REC, key=k)).sum())(w)
    assert _same(got, want)
    assert "prevent_cse" in str(jax.make_jaxpr(lambda w: qf(w, X, fp4_key=key))(w))


def test_custom_vjp_products_are_reported_not_rewritten():
    @jax.custom_vjp
    def f(x, w):
        return x @ w
    f.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))

    def fn(w, x):
        with jax.named_scope("custom"):
            return f(x, w)
    w = jnp.ones((64, 16))
    qf = quantize_function(fn, [(r".*", "nvfp4")])
    assert _same(qf(w, X), fn(w, X))
    rep = function_report(qf, w, X)
    assert any("custom" in u and "not rewritten" in u for u in rep.uncovered)


def test_bad_input_errors():
    p = _params()
    qm = quantize_function(model, [(r".*", "nvfp4")])
    with pytest.raises(ValueError, match="fp4_key"):
        qm(p, X)
    with pytest.raises(ValueError, match="params_argnums"):
        quantize_function(model, [(r".*", "nvfp4")], params_argnums=3)(p, X)
    with pytest.raises(TypeError, match="params_argnums"):
        quantize_function(model, [], params_argnums="0")
    with pytest.raises(ValueError):
        quantize_function(model, [(r".*", "no_such_recipe")])
    with pytest.raises(ValueError, match="quantize_function"):
        function_report(model, p, X)


def test_rules_on_parameter_paths():
    """``paths="params"``: an Equinox-style model (a pytree of layers, no scopes) addressed
    by its weights' pytree paths."""
    import dataclasses

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Linear:
        weight: jax.Array

        def __call__(self, x):
            return self.weight @ x

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class MLP:
        layers: list

        def __call__(self, x):
            for layer in self.layers:
                x = jnp.tanh(layer(x))
            return x

    ks = jax.random.split(jax.random.key(0), 2)
    m = MLP([Linear(jax.random.normal(ks[0], (64, 64)) * 0.1),
             Linear(jax.random.normal(ks[1], (32, 64)) * 0.1)])
    key = jax.random.key(9)
    fn = lambda m, x: jax.vmap(m)(x)  # noqa: E731
    qf = quantize_function(fn, [(r"layers/1/weight", None), (r"layers/.*", "nvfp4")],
                           paths="params")
    rep = function_report(qf, m, X)
    assert {p: d["recipe"] for p, d in rep.layers.items()} == {
        "layers/0/weight": REC.name, "layers/1/weight": None}
    k = jax.random.fold_in(layer_key(key, "layers/0/weight"), 0)

    def want(m):
        h = jnp.tanh(fp4jax.dot_general(X, m.layers[0].weight.T, DN, recipe=REC, key=k))
        return jnp.tanh(jax.vmap(lambda hi: m.layers[1].weight @ hi)(h))  # as written
    assert _same(jax.jit(lambda m: qf(m, X, fp4_key=key))(m), jax.jit(want)(m))
    with pytest.raises(ValueError, match="paths"):
        quantize_function(fn, [], paths="module")


def test_keyword_parameters_and_what_is_not_a_weight_are_reported():
    w = jax.random.normal(jax.random.key(1), (64, 32)) * 0.1

    def f(x, *, params):
        with jax.named_scope("kw"):
            y = x @ params["w"]
        with jax.named_scope("masked"):
            z = x @ (params["w"] * 0.5)  # computed from the weight: not a weight
        return y, z
    rules = [(r".*", "nvfp4")]
    rep = function_report(quantize_function(f, rules, params_argnums=None,
                                            params_argnames="params"), X, params={"w": w})
    assert list(rep.layers) == ["kw"] and rep.layers["kw"]["weight"] == (64, 32)
    assert any(u.startswith("masked") and "computed from the parameter params/w (mul)" in u
               for u in rep.uncovered), rep.uncovered
    with pytest.raises(ValueError, match="params_argnames"):
        quantize_function(f, rules, params_argnums=None, params_argnames="p")(X, params={})
    with pytest.raises(ValueError, match="no parameters"):
        quantize_function(f, rules, params_argnums=None)


def test_products_in_a_shard_map_are_reported_not_rewritten():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    w = jnp.ones((64, 16))

    def fn(w, x):
        with jax.named_scope("sm"):
            return jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(P("d"), P()),
                                 out_specs=P("d"))(x, w)
    qf = quantize_function(fn, [(r".*", "nvfp4")])
    assert _same(qf(w, X), fn(w, X))
    assert any("shard_map" in u for u in function_report(qf, w, X).uncovered)
