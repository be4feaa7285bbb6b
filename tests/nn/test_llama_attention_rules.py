"""FP4 attention in the built-in Llama by rule (issue 37 item 3): attention rules (a
``Rule`` whose recipe is an ``AttentionRecipe`` or its name) match ``block_{i}/attn`` only,
linear rules never do, so the dense model is unchanged unless one is given (its bits:
``test_llama_rules.py``'s golden steps); a block with FP4 attention calls
``fp4jax.attention`` (the XLA path, never cuDNN) with its recipe and an ``"fp4"`` key."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax.models import llama
from fp4jax.nn import Rule, load_rules, match_rule, report
from fp4jax.recipes import AttentionRecipe, attn_nvfp4, attn_nvfp4_all

CFG = llama.LlamaConfig(d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=64,
                        max_seq_len=16, dtype="float32")
TOKENS = jnp.zeros((2, 16), jnp.int32)


def test_attention_rules_reach_attention_sites_only():
    r = Rule(r"block_1/attn", "attn_nvfp4")
    assert r.attention and r.recipe == attn_nvfp4() and r.spec == "attn_nvfp4"
    assert not Rule(".*", "nvfp4").attention
    rules = [Rule(".*(embed|lm_head)", None), r, Rule(".*", "nvfp4")]
    assert match_rule(rules, "block_1/attn", attention=True) == 1
    assert match_rule(rules, "block_1/attn") == 2  # a linear layer there would take nvfp4
    assert match_rule(rules, "block_0/attn", attention=True) is None
    assert llama.attention_recipes(CFG, rules) == (None, attn_nvfp4(), None)
    # a catch-all linear rule never turns attention on: the dense model's attention
    assert llama.attention_recipes(CFG, [Rule(".*", "nvfp4")]) == (None,) * 3
    # rules files name attention recipes too
    assert Rule("x", "attn-nvfp4-all").recipe == attn_nvfp4_all()
    with pytest.raises(ValueError, match="attention recipe"):
        Rule("x", 3)


def test_rules_file_turns_attention_on(tmp_path):
    f = tmp_path / "rules.json"
    f.write_text(json.dumps([{"pattern": "block_[02]/attn", "recipe": "attn_mxfp4"},
                             {"pattern": ".*", "recipe": "none"}]))
    rules = load_rules(f)
    got = llama.attention_recipes(CFG, rules)
    assert [getattr(a, "name", None) for a in got] == ["attn_mxfp4", None, "attn_mxfp4"]


def _spy(monkeypatch):
    calls = []
    real = llama.quantized_attention

    def spy(q, k, v, recipe, **kw):
        calls.append((recipe.name, kw.get("causal"), kw.get("key") is not None, q.shape))
        return real(q, k, v, recipe, **kw)

    monkeypatch.setattr(llama, "quantized_attention", spy)
    return calls


def test_quantized_llama_runs_fp4_attention_where_a_rule_says(monkeypatch):
    calls = _spy(monkeypatch)
    dense_calls = []
    real = llama.causal_attention
    monkeypatch.setattr(llama, "causal_attention", lambda q, k, v, impl: (
        dense_calls.append(impl), real(q, k, v, "xla"))[1])
    rules = [Rule("block_1/attn", "attn_nvfp4_all"), Rule(".*(embed|lm_head)", None),
             Rule(".*", "nvfp4")]
    model = llama.quantized_llama(CFG.replace(attention="cudnn"), rules)
    rngs = {"params": jax.random.key(0), "fp4": jax.random.key(1)}
    shapes = jax.eval_shape(lambda: model.init(rngs, TOKENS))
    # one block with FP4 attention (its recipe stochastic: a key drawn); cuDNN is asked for
    # the other two blocks only
    assert calls == [("attn_nvfp4_all", True, True, (2, 16, 2, 16))]
    assert dense_calls == ["cudnn", "cudnn"]
    # the parameter tree is the dense model's
    dense = jax.eval_shape(lambda: llama.quantized_llama(CFG, rules[1:]).init(rngs, TOKENS))
    assert jax.tree.map(lambda a: a.shape, shapes) == jax.tree.map(lambda a: a.shape, dense)
    # report: attention rules are not "unused" linear rules
    assert all(not r.attention for _, r in report(model, TOKENS).unused_rules)
    # without an attention rule nothing calls it
    calls.clear()
    jax.eval_shape(lambda: llama.quantized_llama(CFG, rules[1:]).init(rngs, TOKENS))
    assert calls == []


def test_scanned_runs_split_where_attention_recipes_differ(monkeypatch):
    calls = _spy(monkeypatch)
    cfg = CFG.replace(scan_layers=True)
    rules = [Rule("block_[12]/attn", attn_nvfp4()), Rule(".*", None)]
    assert llama.scan_runs(cfg, rules) == (1, 2)
    model = llama.quantized_llama(cfg, rules)
    jax.eval_shape(lambda: model.init({"params": jax.random.key(0)}, TOKENS))
    # the scanned body (blocks 1, 2; traced more than once by scan and remat) only
    assert calls and set(calls) == {("attn_nvfp4", True, False, (2, 16, 2, 16))}
    with pytest.raises(ValueError, match="different attention recipes"):
        jax.eval_shape(lambda: llama.Llama(cfg, (3,), (None, attn_nvfp4(), None)).init(
            jax.random.key(0), TOKENS))
    with pytest.raises(ValueError, match="one attention recipe"):
        llama.Llama(cfg, None, (attn_nvfp4(),))


def test_fp4_attention_changes_the_logits_a_little():
    """A one-block model under FP4 attention: the dense model's parameters give other
    logits, close to the dense ones."""
    cfg = CFG.replace(n_layers=1)
    tokens = jax.random.randint(jax.random.key(4), (1, 16), 0, 256)
    dense = llama.Llama(cfg)
    fp4 = llama.Llama(cfg, attn_recipes=("attn_nvfp4",))
    assert isinstance(fp4.attn_recipes[0], AttentionRecipe)
    params = dense.init(jax.random.key(0), tokens)
    a = np.asarray(dense.apply(params, tokens))
    b = np.asarray(fp4.apply(params, tokens))
    assert a.shape == b.shape and not np.array_equal(a, b)
    assert np.abs(a - b).max() < 0.1 * np.abs(a).max()
    assert fp4jax.recipes.get_attention("attn_nvfp4") == fp4.attn_recipes[0]


def test_attention_argument_and_the_harness_flag(monkeypatch):
    """``quantized_llama(cfg, policy, attention=...)`` adds FP4 attention in every block to
    a policy (``fp4jax-train --attn-recipe``); the config checks the name and refuses it
    with ``--model``."""
    from fp4jax.nn import PrecisionPolicy
    from fp4jax.train.config import ConfigError, TrainConfig

    calls = _spy(monkeypatch)
    pol = PrecisionPolicy(fp4jax.recipes.nvfp4())
    model = llama.quantized_llama(CFG, pol, attention="attn_nvfp4")
    jax.eval_shape(lambda: model.init({"params": jax.random.key(0)}, TOKENS))
    assert [c[0] for c in calls] == ["attn_nvfp4"] * 3
    assert llama.every_block_attention(None) == []
    with pytest.raises(ValueError, match="attention takes attention rules"):
        llama.quantized_llama(CFG, pol, attention=[Rule(".*", "nvfp4")])
    assert TrainConfig(attn_recipe="attn_mxfp4").attn_recipe == "attn_mxfp4"
    with pytest.raises(ConfigError, match="unknown attention recipe"):
        TrainConfig(attn_recipe="attn_fp3")
    with pytest.raises(ConfigError, match="attn_recipe"):
        TrainConfig(model="m:f", attn_recipe="attn_nvfp4")
    # a run-level key of a spec, so one --compare pairs it with the plain run
    from fp4jax.train.config import run_recipe

    rcfg, r = run_recipe(TrainConfig(recipe="nvfp4(sr=False, attn_recipe=attn_mxfp4)"))
    assert rcfg.attn_recipe == "attn_mxfp4" and r == fp4jax.recipes.nvfp4().replace(sr=False)
    TrainConfig(compare="nvfp4,nvfp4(attn_recipe=attn_nvfp4)")
    with pytest.raises(ConfigError, match="attn_recipe=attn_fp3: attn_recipe is FP4"):
        TrainConfig(recipe="nvfp4(attn_recipe=attn_fp3)")
    with pytest.raises(ConfigError, match="attn_recipe sets the built-in"):
        TrainConfig(model="m:f", compare="nvfp4,nvfp4(attn_recipe=attn_nvfp4)")
