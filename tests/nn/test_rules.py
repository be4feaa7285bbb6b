"""Precision rules by module path (issue 34): ``fp4jax.nn.quantize_model`` on unedited linen
and NNX models, bit for bit against the same models hand-wired with fp4jax layers."""

from __future__ import annotations

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp4jax
from fp4jax.nn import Rule, layer_key, load_rules, quantize_model, report
from fp4jax.nn import linen as fnn
from fp4jax.nn import nnx as fnnx

B, T, D, H, HD, F, V = 2, 8, 32, 2, 16, 64, 64
NV = fp4jax.recipes.nvfp4()
NV_RN = fp4jax.recipes.parse("nvfp4(sr=False)")
NV_LAYER = fp4jax.recipes.parse("nvfp4(wgrad.hadamard_signs='layer')")  # per-layer RHT key


def _close(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def _differs(a, b) -> bool:
    return any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                         strict=True))


# ---------------------------------------------------------------------------
# a linen LM in the style of the Flax examples: DenseGeneral attention projections
# (features (heads, head_dim), an output projection contracting two axes), an nn.Einsum
# FFN layer, raw einsums for the attention scores. ``wired`` ((path, recipe) pairs) builds
# the hand-wired twin: fp4jax.nn.linen.DotGeneral in the same places.
# ---------------------------------------------------------------------------

def _dg(wired, path):
    r = dict(wired or ()).get(path)
    return {} if r is None else {"dot_general_cls": functools.partial(fnn.DotGeneral, recipe=r)}


class WiredEinsum(nn.Module):
    """Hand-wired ``nn.Einsum("btd,df->btf")``: the same parameter, fp4jax's product."""

    shape: tuple[int, ...]
    recipe: fp4jax.Recipe

    @nn.compact
    def __call__(self, x):
        k = self.param("kernel", nn.initializers.lecun_normal(), self.shape)
        return fnn.DotGeneral(recipe=self.recipe)(x, k, (((2,), (0,)), ((), ())))


class Attention(nn.Module):
    wired: tuple = ()

    @nn.compact
    def __call__(self, x):
        p = "/".join(self.path)
        q = nn.DenseGeneral((H, HD), name="query", **_dg(self.wired, p + "/query"))(x)
        k = nn.DenseGeneral((H, HD), name="key", **_dg(self.wired, p + "/key"))(x)
        v = nn.DenseGeneral((H, HD), name="value", **_dg(self.wired, p + "/value"))(x)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / HD**0.5
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
        return nn.DenseGeneral(D, axis=(-2, -1), name="out",
                               **_dg(self.wired, p + "/out"))(a)


class Block(nn.Module):
    wired: tuple = ()

    @nn.compact
    def __call__(self, x, _=None):
        p = "/".join(self.path)
        x = x + Attention(self.wired, name="attn")(nn.LayerNorm(name="ln1")(x))
        h = nn.LayerNorm(name="ln2")(x)
        r = dict(self.wired).get(p + "/up")
        if r is None:
            h = nn.Einsum((D, F), "btd,df->btf", use_bias=False, name="up")(h)
        else:
            h = WiredEinsum((D, F), r, name="up")(h)
        h = nn.Dense(D, name="down", **_dg(self.wired, p + "/down"))(nn.gelu(h))
        return x + h, None


class LM(nn.Module):
    n_blocks: int = 2
    scan: bool = False
    wired: tuple = ()

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D, name="embed")(tokens)
        if self.scan:
            stack = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                            split_rngs={"params": True, "fp4": True},
                            length=self.n_blocks)
            x, _ = stack(self.wired, name="blocks")(x, None)
        else:
            for i in range(self.n_blocks):
                x, _ = Block(self.wired, name=f"block_{i}")(x)
        return nn.Dense(V, name="lm_head", **_dg(self.wired, "lm_head"))(x)


LAYERS = ("attn/query", "attn/key", "attn/value", "attn/out", "up", "down")
# few quantized layers (each costs seconds of CPU compile time), one of each kind:
# DenseGeneral with two feature axes (query) and two contracting axes (out), nn.Einsum (up);
# nn.Dense is the Llama test's
RULES = [Rule(r".*(embed|lm_head).*", None),
         Rule(r"block_0/attn/query", NV_RN),        # first match wins over the next rule
         Rule(r"block_0/attn/(query|out)", NV_LAYER),
         Rule(r"block_1/up", "nvfp4")]


def _wired_for(rules, paths):
    out = []
    for p in paths:
        i = fp4jax.nn.match_rule(rules, p)
        if i is not None and rules[i].recipe is not None:
            out.append((p, rules[i].recipe))
    return tuple(out)


def _tokens(seed=0):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, V)


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grads(model, params, tokens, key):
    def loss(p):
        logits = model.apply(p, tokens, rngs={"fp4": key, "fp4_layer": jax.random.key(9)})
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits
    return jax.value_and_grad(loss, has_aux=True)(params)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "nn.scan"])
def test_linen_bit_identical_to_hand_wired(scan):
    tokens, key = _tokens(), jax.random.key(5)
    if scan:
        rules = [Rule(r"lm_head", None), Rule(r"blocks/attn/out", NV_RN),
                 Rule(r"blocks/(attn/out|up)", NV)]
        paths = ["blocks/" + layer for layer in LAYERS] + ["lm_head"]
    else:
        rules = RULES
        paths = [f"block_{i}/{layer}" for i in range(2) for layer in LAYERS] + ["lm_head"]
    plain = LM(scan=scan)
    qmodel = quantize_model(plain, rules)
    hand = LM(scan=scan, wired=_wired_for(rules, paths))
    assert isinstance(qmodel, LM) and qmodel.scan == scan
    params = plain.init(jax.random.key(0), tokens)
    # the same parameter tree and values as the unedited model's init
    _close(qmodel.init(jax.random.key(0), tokens), params)
    assert jax.tree.structure(hand.init(jax.random.key(0), tokens)) == jax.tree.structure(params)

    assert len(hand.wired) == (2 if scan else 3)  # the twin runs fp4jax: equal bits are FP4
    (lq, yq), gq = _loss_and_grads(qmodel, params, tokens, key)
    (lh, yh), gh = _loss_and_grads(hand, params, tokens, key)
    _close((yq, gq), (yh, gh))
    # another step's key: other stochastic-rounding draws, same forward (RN fprop)
    (_, yq2), gq2 = _loss_and_grads(qmodel, params, tokens, jax.random.key(6))
    _close(yq2, yq)
    assert _differs(gq2, gq)


def test_none_rules_keep_the_model_bit_for_bit():
    tokens = _tokens()
    plain = LM()
    params = plain.init(jax.random.key(0), tokens)
    for rules in ([Rule(".*", None)], [Rule("nothing", "nvfp4")], []):
        q = quantize_model(plain, rules)
        _close(_loss_and_grads(q, params, tokens, jax.random.key(1)),
               _loss_and_grads(plain, params, tokens, jax.random.key(1)))


def test_report_lists_layers_unused_rules_and_uncovered():
    class Raw(nn.Module):
        """A module with its own parameter in a raw einsum (weight as the LHS) and in an
        '@' no hook sees."""

        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.lecun_normal(), (D, D))
            y = jnp.einsum("de,bte->btd", w, x)
            return y + x @ self.param("v", nn.initializers.lecun_normal(), (D, D))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = LM(name="lm")(tokens)
            return Raw(name="raw")(x[..., :D])

    rules = [Rule(r"lm/lm_head", None), Rule(r"lm/block_0/up", "nvfp4(sr=False)"),
             Rule(r"lm/block_0/.*", "nvfp4"), Rule(r"block_0/.*", "mxfp4"),  # never full
             Rule(r"lm/.*/attn/.*", "nvfp4"), Rule(r"raw", "nvfp4")]
    rep = report(quantize_model(Model(), rules), _tokens())
    layers = rep.layers
    assert set(layers) == ({f"lm/block_{i}/{n}" for i in range(2) for n in LAYERS}
                           | {"lm/lm_head", "raw"})
    assert layers["lm/lm_head"]["recipe"] is None and layers["lm/lm_head"]["rule"] == 0
    assert layers["lm/block_0/up"]["rule"] == 1 and layers["lm/block_0/up"]["op"] == "einsum"
    assert layers["lm/block_0/attn/query"]["rule"] == 2
    assert layers["lm/block_1/attn/out"]["rule"] == 4
    assert layers["lm/block_1/attn/out"]["weight"] == (H, HD, D)
    assert layers["lm/block_1/up"]["rule"] is None and layers["lm/block_1/down"]["rule"] is None
    assert layers["raw"]["op"] == "einsum" and layers["raw"]["recipe"] == "nvfp4"
    assert [i for i, _ in rep.unused_rules] == [3]
    assert len(rep.activation_products) == 4  # the attention scores and values, 2 blocks
    assert len(rep.uncovered) == 1 and rep.uncovered[0].startswith("raw: dot_general")
    text = str(rep)
    assert "lm/block_0/attn/query" in text and "block_0/.*" in text and "raw:" in text


def test_weight_as_lhs_and_setup_style_modules():
    """A raw einsum with the parameter as its LHS, and a setup-style module's jnp.dot:
    the parameter takes the weight role; keys from the layer's DotGeneral_0 (compact) or
    from the layer's own scope (setup)."""

    class RawLhs(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.lecun_normal(), (F, D))
            return jnp.einsum("fd,btd->btf", w, x)

    class SetupDot(nn.Module):
        def setup(self):
            self.w = self.param("w", nn.initializers.lecun_normal(), (F, D))

        def __call__(self, x):
            return jnp.dot(x, self.w)

    class HandLhs(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.lecun_normal(), (F, D))
            return fnn.DotGeneral(recipe=NV)(x, w, (((2,), (1,)), ((), ())))

    class HandSetup(nn.Module):
        def setup(self):
            self.w = self.param("w", nn.initializers.lecun_normal(), (F, D))

        def __call__(self, x):
            return fp4jax.dot_general(x, self.w, (((2,), (0,)), ((), ())), recipe=NV,
                                      key=self.make_rng("fp4"))

    x = jax.random.normal(jax.random.key(1), (B, T, D))
    xs = jax.random.normal(jax.random.key(1), (B, T, F))
    for plain, hand, inp in ((RawLhs(), HandLhs(), x), (SetupDot(), HandSetup(), xs)):
        params = plain.init(jax.random.key(0), inp)
        q = quantize_model(plain, [Rule(".*", NV)])

        def run(m, p, inp=inp):
            return jax.value_and_grad(lambda p, x: jnp.sum(
                m.apply(p, x, rngs={"fp4": jax.random.key(3)}) ** 2), argnums=(0, 1))(p, inp)
        _close(run(q, params), run(hand, params))
        assert _differs(run(q, params), run(plain, params))


# ---------------------------------------------------------------------------
# NNX: nnx.Einsum, nnx.LinearGeneral and nnx.Linear in a list
# ---------------------------------------------------------------------------

class NnxBlock(nnx.Module):
    def __init__(self, rngs, dots=None):
        d = dots or {}
        self.mix = nnx.Einsum("btd,dhk->bthk", (D, H, HD), rngs=rngs,
                              **({"einsum_op": d["mix"]} if "mix" in d else {}))
        self.out = nnx.LinearGeneral((H, HD), D, axis=(-2, -1), rngs=rngs,
                                     **({"dot_general": d["out"]} if "out" in d else {}))
        self.mlp = nnx.List([
            nnx.Linear(D, F, rngs=rngs, **({"dot_general": d["mlp/0"]} if "mlp/0" in d else {})),
            nnx.Linear(F, D, rngs=rngs, **({"dot_general": d["mlp/1"]} if "mlp/1" in d else {}))])

    def __call__(self, x):
        x = x + self.out(self.mix(x))
        return x + self.mlp[1](jax.nn.gelu(self.mlp[0](x)))


class NnxLM(nnx.Module):
    def __init__(self, rngs, dots=None):
        dots = dots or {}
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(rngs, {k.split("/", 2)[2]: v for k, v in dots.items()
                                                if k.startswith(f"blocks/{i}/")})
                                for i in range(2)])
        self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class HandEinsum(nnx.Module):
    """Hand-wired ``einsum_op`` of ``nnx.Einsum("btd,dhk->bthk")``: K = d, N = (h, k)."""

    def __init__(self, dg):
        self.dg = dg

    def __call__(self, subscripts, x, kernel, **kw):
        return self.dg(x, kernel, (((2,), (0,)), ((), ())))


def _nnx_hand_dots(rules, base):
    """The hand-wired twin's products: fp4jax.nn.nnx.DotGeneral per layer, keyed
    ``layer_key(base, path)`` (the documented quantize_model keys)."""
    dots = {}
    for i in range(2):
        for name in ("mix", "out", "mlp/0", "mlp/1"):
            path = f"blocks/{i}/{name}"
            j = fp4jax.nn.match_rule(rules, path)
            r = rules[j].recipe if j is not None else None
            if r is None:
                continue
            rht = layer_key(base[1], path) if r.needs_layer_key else None
            dg = fnnx.DotGeneral(r, rngs=nnx.Rngs(fp4=layer_key(base[0], path)), rht_key=rht)
            dots[path] = HandEinsum(dg) if name == "mix" else dg
    return dots


def test_nnx_bit_identical_to_hand_wired():
    tokens = _tokens()
    rules = [Rule(r"head", None), Rule(r"blocks/0/out", NV_RN),
             Rule(r"blocks/0/(mix|out)|blocks/1/mlp/0", NV_LAYER)]
    plain = NnxLM(nnx.Rngs(0))
    q = quantize_model(nnx.clone(plain), rules, rngs=nnx.Rngs(fp4=7, fp4_layer=8))
    base = nnx.Rngs(fp4=7)["fp4"](), nnx.Rngs(fp4_layer=8)["fp4_layer"]()
    dots = _nnx_hand_dots(rules, base)
    assert len(dots) == 3  # the twin runs fp4jax: equal bits are FP4 bits
    hand = NnxLM(nnx.Rngs(0), dots)
    _close(nnx.state(hand, nnx.Param), nnx.state(plain, nnx.Param))
    _close(nnx.state(q, nnx.Param), nnx.state(plain, nnx.Param))

    def loss(m, t):
        return jnp.mean(jax.nn.log_softmax(m(t))[..., 0])

    step = nnx.jit(nnx.value_and_grad(loss))
    for _ in range(2):  # two steps: the per-layer streams advance alike
        lq, gq = step(q, tokens)
        lh, gh = step(hand, tokens)
        _close((lq, nnx.state(gq, nnx.Param)), (lh, nnx.state(gh, nnx.Param)))
    rep = report(q, tokens)
    assert rep.layers["blocks/0/out"]["rule"] == 1 and rep.layers["head"]["recipe"] is None
    assert rep.layers["blocks/1/mlp/0"]["rule"] == 2 and rep.layers["blocks/1/mix"]["rule"] is None
    assert rep.layers["blocks/0/mix"]["op"] == "einsum"
    assert len(rep.layers) == 9 and not rep.unused_rules and not rep.uncovered


def test_nnx_none_rules_keep_bits():
    tokens = _tokens()
    plain = NnxLM(nnx.Rngs(0))
    q = quantize_model(nnx.clone(plain), [Rule(".*", None)])
    _close(nnx.jit(lambda m, t: m(t))(q, tokens), nnx.jit(lambda m, t: m(t))(plain, tokens))


# ---------------------------------------------------------------------------
# rules, files, bad inputs
# ---------------------------------------------------------------------------

def test_rule_fullmatch_and_first_wins():
    rules = [Rule("block_0", None), Rule(r"query", None), Rule(r".*/query", "nvfp4"),
             Rule(r".*", "mxfp4")]
    assert fp4jax.nn.match_rule(rules, "block_0") == 0
    assert fp4jax.nn.match_rule(rules, "block_0/attn/query") == 2  # not 0 nor 1
    assert fp4jax.nn.match_rule(rules, "block_0/attn/key") == 3
    assert fp4jax.nn.match_rule(rules[:2], "block_0/x") is None
    assert Rule(".*", "nvfp4(sr=False)").recipe == NV_RN
    assert Rule(".*", "none").recipe is None and Rule(".*", NV).recipe is NV


def test_load_rules_json_and_toml(tmp_path):
    j = tmp_path / "r.json"
    j.write_text(json.dumps([{"pattern": ".*embed.*", "recipe": None}, [".*", "nvfp4"]]))
    t = tmp_path / "r.toml"
    t.write_text('[[rules]]\npattern = ".*embed.*"\nrecipe = "none"\n'
                 '[[rules]]\npattern = ".*"\nrecipe = "nvfp4"\n')
    want = [Rule(".*embed.*", None), Rule(".*", NV)]
    assert load_rules(j) == want and load_rules(t) == want
    t2 = tmp_path / "pairs.toml"
    t2.write_text('rules = [[".*embed.*", "none"], [".*", "nvfp4"]]\n')
    assert load_rules(t2) == want


@pytest.mark.parametrize("content,needle", [
    ('[{"pattern": "(", "recipe": "nvfp4"}]', r"rules\[0\].*not a valid regular"),
    ('[[".*", "none"], [".*", "nvfp5"]]', r"rules\[1\].*bad recipe spec 'nvfp5'"),
    ('[{"pattern": ".*", "recipes": "nvfp4"}]', r"rules\[0\].*'pattern' and 'recipe'"),
    ('{"layers": []}', r"'rules' key"),
    ('[1, 2', r"not valid JSON"),
])
def test_load_rules_errors_name_file_and_entry(tmp_path, content, needle):
    f = tmp_path / "bad.json"
    f.write_text(content)
    with pytest.raises(ValueError, match=needle) as e:
        load_rules(f)
    assert "bad.json" in str(e.value)


def test_rules_address_the_blocks_of_a_scanned_stack():
    """Inside ``nn.scan`` (linen) and an ``nnx.vmap``-stacked layer, a rule may name blocks
    by index (``blocks/3/attn/query``: the stack's path, the block's index, the path in the
    block); one traced body runs every block, so rules that give the blocks of a stack
    different recipes are refused (naming the rules, the blocks and the fix) instead of one
    recipe silently applying to all of them."""
    tokens = _tokens()
    q = quantize_model(LM(scan=True), [Rule(r".*(embed|lm_head)", None),
                                       Rule(r"blocks/\d+/up", NV_RN), Rule(".*", None)])
    got = {p: d["recipe"] for p, d in report(q, tokens).layers.items()}
    assert got["blocks/up"] == NV_RN.name and got["blocks/attn/query"] is None
    mixed = quantize_model(LM(scan=True), [Rule(r"blocks/1/.*", None), Rule(".*", NV_RN)])
    with pytest.raises(ValueError, match=r"'blocks/attn/query' runs in a scanned stack of 2 "
                       r"blocks at 'blocks'.*blocks 0 rule \[1\].*blocks 1 rule \[0\].*Unroll"):
        report(mixed, tokens)
    with pytest.raises(ValueError, match="scanned stack"):
        jax.eval_shape(mixed.init, jax.random.key(0), tokens)

    class Blk(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(D, D, use_bias=False, rngs=rngs)

    class Stacked(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Blk(rngs)
            self.blocks = make(rngs)
            self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    with pytest.raises(ValueError, match=r"'blocks/up' runs in a scanned stack of 3 blocks "
                       r"at 'blocks'.*blocks 0,2 rule \[0\]"):
        quantize_model(Stacked(nnx.Rngs(0)), [Rule(r"blocks/(0|2)/up", None),
                                               Rule(".*", NV_RN)])
    ok = quantize_model(Stacked(nnx.Rngs(0)), [Rule(r"blocks/\d+/up", NV_RN)])
    assert isinstance(ok.blocks.up.dot_general.dot, fnnx.DotGeneral)
    assert not isinstance(ok.head.dot_general, fnnx.DotGeneral)


def test_bad_inputs():
    with pytest.raises(ValueError, match="pattern"):
        Rule("(", "nvfp4")
    with pytest.raises(ValueError, match="pattern"):
        Rule(3, "nvfp4")
    with pytest.raises(ValueError, match="recipe"):
        Rule(".*", "nvfp5")
    with pytest.raises(ValueError, match="recipe"):
        Rule(".*", 4)
    with pytest.raises(ValueError, match="model"):
        quantize_model(object(), [Rule(".*", "nvfp4")])
    with pytest.raises(ValueError, match=r"rules\[1\]"):
        quantize_model(LM(), [Rule(".*", None), ("(", "nvfp4")])
    with pytest.raises(ValueError, match="rules"):
        quantize_model(LM(), "nvfp4")
    with pytest.raises(ValueError, match="rngs"):
        quantize_model(NnxLM(nnx.Rngs(0)), [Rule(".*", "nvfp4")])
    with pytest.raises(ValueError, match="rng_collection"):
        quantize_model(LM(), [], rng_collection="")
    with pytest.raises(ValueError, match="qmodel"):
        report(LM(), _tokens())


# ---------------------------------------------------------------------------
# PrecisionPolicy as rules (fp4jax's own Llama under them: test_llama_rules.py)
# ---------------------------------------------------------------------------

def test_policy_rules_agree_with_recipe_for():
    from fp4jax.nn import PrecisionPolicy

    names = ("attn.q", "attn.k", "attn.o", "mlp.up", "mlp.down")
    layers = {n: n.replace(".", "/") for n in names}
    for pol in (PrecisionPolicy(NV, 1, 2, ("mlp.*", "block_2/attn.q")),
                PrecisionPolicy(NV, high_precision_layers=("block_*/attn.o",),
                                high_precision=fp4jax.recipes.bf16()),
                PrecisionPolicy(None, 1), PrecisionPolicy(fp4jax.recipes.bf16(), 0, 1)):
        rules = pol.rules(6, "decoder/layers_{i}", layers)
        for i in range(6):
            for n in names:
                j = fp4jax.nn.match_rule(rules, f"decoder/layers_{i}/{layers[n]}")
                assert rules[j].recipe == pol.recipe_for(i, 6, n), (pol, i, n)
        assert fp4jax.nn.match_rule(rules, "decoder/embed") is None
        assert fp4jax.nn.match_rule(rules, "decoder/layers_1x/attn/q") is None
    glob = PrecisionPolicy(NV, high_precision_layers=("mlp/*",)).rules(2)
    assert [fp4jax.nn.match_rule(glob, p) for p in ("block_1/mlp/up", "block_1/q")] == [0, 1]
    with pytest.raises(ValueError, match="block"):
        PrecisionPolicy(NV).rules(2, "layers")


def test_one_quantize_predicate_and_the_rule_builders():
    from fp4jax import rules as R
    from fp4jax.recipes import recipe_quantizes

    assert fp4jax.nn.recipe_quantizes is recipe_quantizes  # one predicate, re-exported
    assert fp4jax.nn.policy.recipe_quantizes is recipe_quantizes
    assert [recipe_quantizes(r) for r in (None, fp4jax.recipes.bf16(), NV,
                                          fp4jax.recipes.get_attention("attn_nvfp4"))] == [
        False, False, True, True]
    rules = (*R.high_precision_rules(["a.b/q"]), R.block_rule("layers/", [0, 2]),
             Rule(".*", NV))
    assert R.block_rule("layers_", []) is None
    assert [R.rule_recipe(rules, p) for p in ("a.b/q", "axb/q", "layers/2/up", "layers/1/up")
            ] == [None, NV, None, NV]
    assert R.rules_quantize(rules) and not R.rules_quantize(rules[:2])
    sw = R.replace_quantizing(rules, lambda r: fp4jax.recipes.bf16())
    assert sw[:2] == rules[:2] and sw[2].recipe.name == "bf16" and not R.rules_quantize(sw)
    attn = Rule("block_0/attn", "attn_nvfp4")  # attention rules are not switched
    assert R.replace_quantizing((attn,), lambda r: None) == (attn,)


def test_the_harness_counts_a_llama_from_its_rules():
    from fp4jax.models.llama import get_preset, policy_rules
    from fp4jax.nn import PrecisionPolicy
    from fp4jax.train import precision

    mc = get_preset("micro")
    for pol in (PrecisionPolicy(NV, 1, 0, ("block_1/attn.q",)), PrecisionPolicy(NV),
                PrecisionPolicy(fp4jax.recipes.bf16(), 0, 1)):
        rules = policy_rules(mc, pol)
        assert isinstance(rules, tuple) and all(isinstance(r, Rule) for r in rules)
        assert precision.fp4_layer_names(mc, rules) == precision.fp4_layer_names(mc, pol)
        assert precision.gemm_work(mc, rules) == precision.gemm_work(mc, pol)
        assert len(precision.fp4_layer_names(mc, rules)) == pol.count(
            mc.n_layers, mc.linear_layers)[0]


# ---------------------------------------------------------------------------
# diagnostics on a foreign model
# ---------------------------------------------------------------------------

def test_gradient_noise_unboxes_and_splits_only_scans():
    from fp4jax.diagnostics import gradient_noise

    class Body(nn.Module):
        @nn.compact
        def __call__(self, c, _):
            return nn.Dense(D, name="dense")(c), None

    class Boxed(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                ("embed", "heads", "kv"))
            q = nn.DenseGeneral((H, HD), kernel_init=init, name="query")(x)
            stack = nn.scan(Body, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=3)(name="stack")
            return jnp.sum(q) + jnp.sum(stack(x, None)[0])

    x = jnp.ones((B, T, D))
    q = quantize_model(Boxed(), [Rule(".*", None)])
    params = q.init(jax.random.key(0), x)
    assert type(params["params"]["query"]["kernel"]).__name__ == "LogicallyPartitioned"
    rep = report(q, x)
    assert rep.scan_axes(("query",), (D, H, HD)) == 0
    assert rep.scan_axes(("params", "stack", "dense"), (3, D, D)) == 1
    g = jax.tree.map(jnp.ones_like, params)
    gq = jax.tree.map(lambda a: a * 2, g)
    noise = gradient_noise(g, gq, scan_axes=rep.scan_axes)["layers"]
    # a variables dict's layers are named as its parameters' (report's and the rules' paths)
    assert sorted(noise) == ["query", "stack/dense[0]", "stack/dense[1]", "stack/dense[2]"]
    assert int(noise["query"]["d"]) == D * H * HD
    assert len(gradient_noise(g, gq)["layers"]) == 32 + 3  # the old rule: 3-D = a stack


def test_recommend_returns_rules():
    from fp4jax.diagnostics import recommend_high_precision_layers

    def st(e):
        return {g: {"rel_error": e} for g in ("fprop", "dgrad", "wgrad")}
    stats = {"block_0/attn/out": st(0.3), "blocks/up[1]": st(0.5), "blocks/up[0]": st(0.4),
             "a.b": st(0.1)}
    rules = recommend_high_precision_layers(stats, 0.75, rules=True)
    assert rules == [Rule(r"blocks/up", None), Rule(r"block_0/attn/out", None)]
    assert recommend_high_precision_layers(stats, 0.25) == ["blocks/up[1]"]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a.reshape(b.shape) - b) / np.linalg.norm(b)


def test_layer_stats_of_an_nnx_layer_are_its_own_gemms():
    """An NNX ``LinearGeneral`` with two output axes under an SR recipe: layer_stats
    measures its flattened product ``x (B, T, D) @ w (D, H*HD)`` with the keys the model's
    own call draws: its wgrad/dgrad/fprop errors are those of the gradients and output that
    a plain call of the quantized model computes (independently, from the same state)."""
    from fp4jax.diagnostics import layer_stats

    class Two(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.LinearGeneral(D, (H, HD), use_bias=False, rngs=rngs)
            self.b = nnx.Einsum("bthk,hkd->btd", (H, HD, D), rngs=rngs)

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    x = jax.random.normal(jax.random.key(1), (B, T, D))
    tgt = jax.random.normal(jax.random.key(2), (B, T, D))

    def loss(out):
        return jnp.mean(jnp.square(out - tgt))

    sr = fp4jax.recipes.parse("nvfp4(rht=0)")  # SR on dy (keys matter), no RHT: fast
    assert sr.needs_key
    q = quantize_model(Two(nnx.Rngs(0)), [Rule("a", sr)], rngs=nnx.Rngs(fp4=3))
    stats = jax.jit(lambda: layer_stats(q, None, x, loss=loss, unmeasured="raise"))()
    assert sorted(stats) == ["a"]  # b runs in high precision: not measured
    graphdef, params, rest = nnx.split(q, nnx.Param, ...)

    @jax.jit
    def reference(params, rest):
        def model(params):  # a copy of the model's state: the keys of one call
            return nnx.merge(graphdef, params, jax.tree.map(lambda a: a, rest))

        dp, dx = jax.grad(lambda p, x_: loss(model(p)(x_)), argnums=(0, 1))(params, x)
        m = model(params)
        h = m.a(x)
        dy = jax.grad(lambda h: loss(m.b(jnp.tanh(h))))(h)
        return h, dy, dp["a"]["kernel"][...], dx

    h, dy, dw, dx = reference(params, rest)
    w = np.asarray(params["a"]["kernel"][...]).reshape(D, H * HD)
    x2, dy2 = np.asarray(x).reshape(-1, D), np.asarray(dy).reshape(-1, H * HD)
    st = stats["a"]
    np.testing.assert_allclose(float(st["wgrad"]["rel_error"]),
                               _rel(dw, (x2.T @ dy2).reshape(D, H, HD)), rtol=1e-4)
    np.testing.assert_allclose(float(st["dgrad"]["rel_error"]),
                               _rel(dx, (dy2 @ w.T).reshape(B, T, D)), rtol=1e-4)
    np.testing.assert_allclose(float(st["fprop"]["rel_error"]),
                               _rel(h, (x2 @ w).reshape(B, T, H, HD)), rtol=1e-4)
    assert 0.01 < float(st["wgrad"]["rel_error"]) < 1.0
    np.testing.assert_allclose(float(st["fprop"]["rhs"]["amax"]), np.abs(w).max(), rtol=1e-6)


def test_layer_stats_name_every_quantized_layer_of_foreign_models():
    """Every quantized layer of the harness's linen (DenseGeneral, nn.Einsum) and NNX
    (Linear, nnx.Einsum) models measured, by its module path; a scanned stack whose
    nn.scan does not carry the statistics collections, and a product with a batch
    dimension on the weight, named as not measured."""
    from fp4jax.diagnostics import UnmeasuredLayerWarning, layer_stats
    from tests import harness_models as hm

    rules = [Rule(".*(lm_head|key|value|wo|/(q|k|v|down))", None), Rule(".*", NV_RN)]
    tokens = _tokens()
    small = {"d_model": D, "n_layers": 1, "n_heads": H, "d_ff": F}

    def loss(logits):
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    lin = quantize_model(hm.linen_lm(V, T, **small), rules)
    params = jax.eval_shape(lin.init, jax.random.key(0), tokens)  # shapes only: traced
    got = jax.eval_shape(lambda p: layer_stats(lin, p, tokens, loss=loss,
                                               unmeasured="raise"), params)
    quantized = sorted(p for p, d in report(lin, tokens).layers.items() if d["recipe"])
    assert sorted(got) == quantized == ["layers_0/out", "layers_0/query", "layers_0/wi"]
    nm = quantize_model(hm.nnx_lm(V, T, **small, rngs=nnx.Rngs(0)), rules)
    got = jax.eval_shape(lambda: layer_stats(nm, None, tokens, loss=loss, unmeasured="raise"))
    quantized = sorted(p for p, d in report(nm, tokens).layers.items() if d["recipe"])
    assert sorted(got) == quantized == ["layers/0/o", "layers/0/up"]

    class Experts(nn.Module):  # one weight matrix per head: a batched product
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.lecun_normal(), (H, D, D))
            return jnp.einsum("bthd,hde->bthe", x, w)

    class Wrap(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Experts(name="experts")(x)

    xe = jnp.ones((B, T, H, D))
    qe = quantize_model(Wrap(), [Rule(".*", NV_RN)])
    pe = jax.eval_shape(qe.init, jax.random.key(0), xe)
    with pytest.warns(UnmeasuredLayerWarning, match=r"not measured: experts: not an x"):
        assert jax.eval_shape(lambda p: layer_stats(qe, p, xe, loss=jnp.sum), pe) == {}
    scanned = quantize_model(LM(scan=True), [Rule("blocks/attn/query", NV_RN)])
    ps = jax.eval_shape(scanned.init, jax.random.key(0), tokens)
    with pytest.raises(ValueError, match=r"blocks/attn/query: inside a linen transform.*"
                                         r"variable_axes"):
        jax.eval_shape(lambda p: layer_stats(scanned, p, tokens, loss=loss,
                                             unmeasured="raise"), ps)

    class Body(nn.Module):
        @nn.compact
        def __call__(self, c, _):
            return c + nn.DenseGeneral((H, D // H), name="q")(c).reshape(c.shape), None

    class Carried(nn.Module):  # the nn.scan carries the statistics collections
        @nn.compact
        def __call__(self, x):
            from fp4jax import diagnostics as Dg
            axes = {"params": 0, Dg.PERTURB_COLLECTION: 0, Dg.COTANGENT_COLLECTION: 0,
                    Dg.STATS_COLLECTION: 0}
            return nn.scan(Body, variable_axes=axes, split_rngs={"params": True},
                           length=3)(name="blocks")(x, None)[0]

    qc = quantize_model(Carried(), [Rule(".*", NV_RN)])
    xc = jnp.ones((B, T, D))
    pc = jax.eval_shape(qc.init, jax.random.key(0), xc)
    assert sorted(jax.eval_shape(lambda p: layer_stats(qc, p, xc, loss=jnp.sum,
                                                       unmeasured="raise"), pc)) == [
        "blocks/q[0]", "blocks/q[1]", "blocks/q[2]"]


def test_nnx_report_counts_a_parameter_free_blocks_products_as_activations():
    """The attention scores of an NNX block that holds layers but no parameter of its own
    (``tests/harness_models.NnxBlock``) are activation products, not uncovered ones; a
    product on a submodule's parameter is uncovered."""
    from tests import harness_models as hm

    tokens = _tokens()
    m = quantize_model(hm.nnx_lm(V, T, d_model=D, n_layers=2, n_heads=H, d_ff=F,
                                 rngs=nnx.Rngs(0)), [Rule(".*", None)])
    rep = report(m, tokens)
    assert not rep.uncovered and len(rep.layers) == 2 * 6 + 1
    q, p = (B, T, H, D // H), (B, H, T, T)  # queries/keys/values; attention weights
    assert sorted(rep.activation_products) == [
        f"layers/{i}: einsum {a} x {b}" for i in range(2) for a, b in ((p, q), (q, q))]

    class Reach(nnx.Module):  # uses its child's kernel itself: not the module's own
        def __init__(self, rngs):
            self.lin = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, x):
            return jnp.einsum("btd,de->bte", x, self.lin.kernel[...])

    rep = report(quantize_model(Reach(nnx.Rngs(0)), [Rule(".*", None)]), jnp.ones((B, T, D)))
    assert len(rep.uncovered) == 1 and "a submodule's parameter" in rep.uncovered[0]


def test_quantize_model_under_data_parallel_equals_one_device(mesh):
    """A foreign linen model (DenseGeneral, nn.Einsum) under quantize_model and nvfp4 (SR,
    RHT), its batch split over 4 devices in ``jax.shard_map`` with
    ``fp4jax.sharding.data_parallel``: the logits are the single-device bits; the loss and
    the gradients (pmean of the devices' own) agree up to float32 summation order (each
    device sums its rows, then the mean over devices; the wgrad contractions are split
    over tokens as ``fp4jax.sharding`` documents), so to 1e-6 relative."""
    import optax
    from jax.sharding import PartitionSpec as P

    from fp4jax import sharding
    from tests import harness_models as hm

    T16 = 16  # one example of 16 tokens per device: nvfp4's 16-row blocks and RHT
    model = quantize_model(hm.linen_lm(V, T16, d_model=D, n_layers=1, n_heads=H, d_ff=F),
                           [Rule("lm_head", None), Rule(".*", NV)])
    batch = jax.random.randint(jax.random.key(4), (4, T16 + 1), 0, V)
    params = jax.jit(model.init)(jax.random.key(0), batch[:, :-1])
    rngs = {"fp4": jax.random.key(5)}

    def loss(p, b):
        logits = model.apply(p, b[:, :-1], rngs=rngs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b[:, 1:]).mean(), logits

    grad = jax.value_and_grad(loss, has_aux=True)
    (l1, y1), g1 = jax.jit(grad)(params, batch)

    def local(p, b):
        with sharding.data_parallel("data"):
            (lo, y), g = grad(p, b)
        return jax.lax.pmean(lo, "data"), y, jax.lax.pmean(g, "data")

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")),
                              out_specs=(P(), P("data"), P()), check_vma=False))
    l2, y2, g2 = f(params, batch)
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y1))
    np.testing.assert_allclose(float(l2), float(l1), rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g2), jax.tree.leaves(g1),
                            strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max(), jax.tree_util.keystr(path)
    plain = hm.linen_lm(V, T16, d_model=D, n_layers=1, n_heads=H, d_ff=F)
    y0 = jax.jit(plain.apply)(params, batch[:, :-1])
    assert _differs(y0, y1)  # the quantized model: FP4 bits, not the model's own


def test_scanned_stack_shares_one_path_and_a_split_stack_selects_first_and_last():
    """``nn.scan``: every block of the stack is one module path (a rule naming a block
    index matches nothing); the documented way to keep the first and last blocks in high
    precision: unroll them around a scan of the middle blocks."""

    class Split(nn.Module):
        n_blocks: int = 4

        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(V, D, name="embed")(tokens)
            x, _ = Block(name="blocks_first")(x)
            mid = nn.scan(Block, variable_axes={"params": 0},
                          split_rngs={"params": True, "fp4": True}, length=self.n_blocks - 2)
            x, _ = mid(name="blocks")(x, None)
            x, _ = Block(name="blocks_last")(x)
            return nn.Dense(V, name="lm_head")(x)

    tokens = _tokens()
    rep = report(quantize_model(LM(scan=True), [Rule(r"blocks_0/.*", None),
                                                Rule(r"blocks/.*", "nvfp4")]), tokens)
    assert [i for i, _ in rep.unused_rules] == [0]
    assert all(d["recipe"] == "nvfp4" for p, d in rep.layers.items() if p != "lm_head")
    rules = [Rule(r"lm_head|blocks_(first|last)/.*", None), Rule(r".*", "nvfp4")]
    rep = report(quantize_model(Split(), rules), tokens)
    hp = sorted(p for p, d in rep.layers.items() if d["recipe"] is None)
    assert hp == sorted(["lm_head"] + [f"blocks_{b}/{n}" for b in ("first", "last")
                                       for n in LAYERS])
    assert sorted(p for p, d in rep.layers.items() if d["recipe"]) == sorted(
        f"blocks/{n}" for n in LAYERS)
    kernel = jax.eval_shape(Split().init, jax.random.key(0), tokens)["params"]["blocks"]
    assert kernel["down"]["kernel"].shape == (2, F, D)  # the middle: one (n - 2)-stack
    assert rep.scan_axes(("blocks", "down"), (2, F, D)) == 1
