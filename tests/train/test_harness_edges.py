"""``fp4jax-train --model`` at its edges, as a new user meets them: logits of the wrong
shape refused before ``--out`` is claimed (they trained on a wrong loss), a factory's
errors as one line naming ``--model``, a rule without a recipe or with an attention recipe
refused, a model file importing its sibling modules, ``--switch-at auto`` checking every
rule's recipe, ``--bf16-layers`` winning over a rules file, and a resume with edited model
code refused unless ``--resume-override model``."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from fp4jax import train as T
from fp4jax.nn import load_rules
from fp4jax.train import models
from tests.textdata import write_text

SMALL = {"d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32}
BASE = dict(steps=2, lr=0.01, warmup_steps=1, batch_size=4, seq_len=32, eval_every=0,
            eval_batches=1, log_every=1, progress=False, devices=1,
            model_args=json.dumps(SMALL))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return str(write_text(tmp_path_factory.mktemp("edges") / "c.txt", 20_000))


def _model_file(path: Path, body: str) -> str:
    path.write_text("import jax.numpy as jnp\nimport flax.linen as nn\n"
                    "from tests import harness_models as hm\n\n" + textwrap.dedent(body))
    return str(path)


def test_logits_of_the_wrong_shape_or_dtype_are_refused_before_out(corpus, tmp_path):
    f = _model_file(tmp_path / "wrong.py", """
        class Cut(nn.Module):
            inner: nn.Module
            width: int

            def __call__(self, t):
                return self.inner(t)[..., :self.width]

        class Flat(nn.Module):
            inner: nn.Module

            def __call__(self, t):
                return self.inner(t)[:, 0]

        class Ints(nn.Module):
            inner: nn.Module

            def __call__(self, t):
                return self.inner(t).astype(jnp.int32)

        def short(vocab_size, seq_len, **kw):
            return Cut(hm.linen_lm(vocab_size, seq_len, **kw), vocab_size - 1)

        def wide(vocab_size, seq_len, **kw):
            return hm.linen_lm(vocab_size + 3, seq_len, **kw)

        def flat(vocab_size, seq_len, **kw):
            return Flat(hm.linen_lm(vocab_size, seq_len, **kw))

        def ints(vocab_size, seq_len, **kw):
            return Ints(hm.linen_lm(vocab_size, seq_len, **kw))
        """)
    for name, got in (("short", r"float32 \(1, 32, 255\)"), ("wide", r"float32 \(1, 32, 259\)"),
                      ("flat", r"float32 \(1, 256\)"), ("ints", r"int32 \(1, 32, 256\)")):
        out = tmp_path / name
        with pytest.raises(ValueError, match=rf"--model .*:{name}: the model must return float "
                                             rf"logits of shape .*\(1, 32, 256\).* got {got}"):
            T.train(T.TrainConfig(**BASE, model=f"{f}:{name}", data=corpus, out=str(out)))
        assert not (out / "metrics.jsonl").exists()


def test_factory_errors_are_one_line_value_errors(corpus, tmp_path):
    f = _model_file(tmp_path / "bad.py", """
        from flax import nnx

        def not_module(vocab_size, seq_len, **kw):
            return {"a": 1}

        def raises(vocab_size, seq_len, **kw):
            raise RuntimeError("my bug")

        def one_arg(vocab_size):
            return None

        def nnx_without_rngs(vocab_size, seq_len, **kw):
            return hm.nnx_lm(vocab_size, seq_len, rngs=nnx.Rngs(0), **kw)
        """)
    for name, msg in (("not_module", "the factory must return a flax.linen.Module .* got dict"),
                      ("raises", r"factory\(vocab_size=256, seq_len=32, d_model=\.\.\., .*\) "
                                 "raised RuntimeError: my bug"),
                      ("one_arg", r"factory\(.*\) raised TypeError: one_arg\(\)"),
                      ("nnx_without_rngs", "an NNX model.s factory must take a rngs keyword")):
        with pytest.raises(ValueError, match=rf"--model .*:{name}: {msg}"):
            T.train(T.TrainConfig(**BASE, model=f"{f}:{name}", data=corpus,
                                  out=str(tmp_path / name)))


def test_a_rule_needs_its_recipe_and_a_foreign_model_no_attention_rule(tmp_path):
    p = tmp_path / "r.json"
    p.write_text('[{"pattern": ".*"}]')
    with pytest.raises(ValueError, match="needs the keys 'pattern' and 'recipe'.*\\['pattern'\\]"):
        load_rules(p)
    p.write_text('[{"pattern": ".*", "recipe": "attn_nvfp4"}]')
    assert load_rules(p)[0].attention  # valid rules: fp4jax's Llama has attention sites
    with pytest.raises(ValueError, match=r"--rules .*r.json: rule \[0\] '\.\*' -> attn_nvfp4 "
                                         "is an attention recipe"):
        models.read_rules(str(p))


def test_a_model_file_imports_its_siblings(tmp_path):
    (tmp_path / "blocks_of_mine.py").write_text("WIDTH = 7\n")
    f = tmp_path / "model_of_mine.py"
    f.write_text("import blocks_of_mine\n\ndef build(v, t):\n    return blocks_of_mine.WIDTH\n")
    assert models.load_factory(f"{f}:build")(1, 2) == 7


def test_switch_at_auto_checks_every_rules_recipe(corpus, tmp_path):
    rules = tmp_path / "rtn.json"
    rules.write_text(json.dumps([["layers_0/query", "nvfp4(sr=False)"]]))
    with pytest.raises(ValueError, match=r"--switch-at auto needs stochastically rounded FP4 "
                                         r"gradients in every quantized layer; --rules .* rule "
                                         r"\[0\] 'layers_0/query' -> nvfp4\(dgrad.lhs.rounding="):
        T.train(T.TrainConfig(**BASE, model="tests.harness_models:linen_lm", data=corpus,
                              rules=str(rules), switch_at="auto", grad_noise_every=1,
                              out=str(tmp_path / "run")))


def test_bf16_layers_win_over_a_rules_file():
    nv = T.run_recipe(T.TrainConfig(recipe="nvfp4"))[1]
    layers = ["layers_0/query", "layers_0/wo", "layers_1/query", "lm_head"]
    rcfg = T.TrainConfig(model="m:f", bf16_layers="layers_0/query", last_bf16=0)
    file_rules = [(".*/query", nv)]
    rules, _ = models.default_rules(nv, layers, rcfg, file_rules)
    got = models.layer_recipes(rules, layers)
    assert got["layers_0/query"] is None  # --bf16-layers, though the file matches it too
    assert got["layers_1/query"] is not None and got["lm_head"] is None


def test_resume_with_edited_model_code_is_refused(corpus, tmp_path):
    src = tmp_path / "edit.py"
    _model_file(src, """
        def build(vocab_size, seq_len, **kw):
            return hm.linen_lm(vocab_size, seq_len, **kw)
        """)
    cfg = T.TrainConfig(**{**BASE, "steps": 3}, model=f"{src}:build", recipe="bf16",
                        data=corpus, out=str(tmp_path / "run"), checkpoint_every=1)
    T.train(cfg.replace(stop_at=1))
    src.write_text(src.read_text() + "\n# an edit\n")
    with pytest.raises(ValueError, match="refusing to resume: the --model code or --rules "
                                         "file differs from that of checkpoint 1"):
        T.train(cfg.replace(resume=True))
    r = T.train(cfg.replace(resume=True, resume_override="model"))
    assert r["status"] == "finished" and len(r["history"]["loss"]) == 3
