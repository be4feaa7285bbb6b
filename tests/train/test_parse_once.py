"""The harness parses a recipe spec once (issue 55, item 4): the CLI's parser reads no spec,
``TrainConfig(...)`` parses each spec it holds once, and what runs below it (the run's plan,
``train``'s set-up, a sweep's sub-runs and their checks) takes the parsed objects instead of
parsing the strings again.

A parse is a call of ``fp4jax.recipes.parse`` with a string or of
``fp4jax.recipes.parse_run_spec``; the split of a spec into its name and items
(``fp4jax.recipes.split_spec``) is counted beside it."""

from __future__ import annotations

import collections

import pytest

import fp4jax.recipes


class _Stop(Exception):
    """Raised by a patched function to end a run where the count is taken."""


@pytest.fixture
def counts(monkeypatch):
    """Counts of the calls of the spec grammar's public functions, by name."""
    n: collections.Counter = collections.Counter()
    for name in ("parse", "parse_run_spec", "split_spec"):
        fn = getattr(fp4jax.recipes, name, None)
        if fn is None:
            continue

        def counted(*args, _fn=fn, _name=name, **kwargs):
            if _name != "parse" or isinstance(args[0], str):
                n[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(fp4jax.recipes, name, counted)
    return n


def _parses(n: collections.Counter) -> int:
    return n["parse"] + n["parse_run_spec"]


def test_build_parser_parses_no_spec(counts):
    """``fp4jax-train``'s parser reads the defaults without building (and validating) a
    ``TrainConfig``: no spec is parsed."""
    from fp4jax.train import cli

    cli.build_parser()
    assert _parses(counts) == 0 and counts["split_spec"] == 0, counts


@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4(sr=False, last_bf16=0, switch_at=0.5)"])
def test_train_config_parses_its_spec_once(counts, spec):
    """``TrainConfig(recipe=spec)``: one parse and one split, with run-level keys or without;
    its plan costs no more."""
    from fp4jax.train import TrainConfig
    from fp4jax.train.plan import plan_runs

    cfg = TrainConfig(preset="micro", recipe=spec)
    assert (_parses(counts), counts["split_spec"]) == (1, 1), counts
    (plan,) = plan_runs(cfg)
    assert (_parses(counts), counts["split_spec"]) == (1, 1), counts
    assert plan.recipe == fp4jax.recipes.parse(spec.replace(", last_bf16=0, switch_at=0.5",
                                                            ""))


def test_train_parses_nothing_before_the_model(counts, monkeypatch, tmp_path):
    """A plain ``fp4jax-train --recipe nvfp4``: the CLI's parser, the config and ``train``'s
    set-up up to loading the data parse the spec once in all."""
    from fp4jax.train import TrainConfig, cli, loop

    def stop(*a, **k):
        raise _Stop

    monkeypatch.setattr(loop, "load_data", stop)
    cli.build_parser()
    cfg = TrainConfig(preset="micro", recipe="nvfp4", out=str(tmp_path / "run"), devices=1)
    with pytest.raises(_Stop):
        loop.train(cfg)
    assert (_parses(counts), counts["split_spec"]) == (1, 1), counts


def test_compare_parses_each_spec_once(counts, monkeypatch, tmp_path):
    """``--compare bf16,nvfp4(sr=False, last_bf16=0)``: each spec is parsed once (and the
    config's own ``recipe``, as it is checked too), also through the sweep's sub-runs, two
    seeds each, and the checks of a sub-run before the sweep starts."""
    from fp4jax.train import TrainConfig, comparison
    from fp4jax.train.config import compare_names

    def stop(*a, **k):
        raise _Stop

    monkeypatch.setattr(comparison, "load_dataset", lambda *a, **k: None)
    monkeypatch.setattr(comparison, "build_models", stop)
    cfg = TrainConfig(preset="micro", compare="bf16,nvfp4(sr=False, last_bf16=0)",
                      out=str(tmp_path / "sweep"), devices=1)
    assert (_parses(counts), counts["split_spec"]) == (3, 3), counts
    with pytest.raises(_Stop):
        comparison.compare(cfg, compare_names(cfg.compare), "0,1")
    assert (_parses(counts), counts["split_spec"]) == (3, 3), counts


def test_warmup_config_does_not_parse_its_recipe_back(counts):
    """The FP4 warm-up of ``--bf16-layers auto`` records its recipe as a spec string
    (``fp4jax.recipes.spec``) but takes the parsed recipe itself: no parse."""
    from fp4jax.train import TrainConfig
    from fp4jax.train.config import model_config
    from fp4jax.train.plan import plan_run
    from fp4jax.train.precision import warmup_config

    cfg = TrainConfig(preset="micro", recipe="nvfp4(sr=False, last_bf16=0)",
                      bf16_layers="auto", bf16_warmup=4, steps=8)
    plan = plan_run(cfg)
    counts.clear()
    wcfg = warmup_config(cfg, plan.run_config, plan.recipe, model_config(cfg))
    wplan = plan_run(wcfg)
    assert _parses(counts) == 0 and counts["split_spec"] == 0, counts
    assert wcfg.recipe == fp4jax.recipes.spec(plan.recipe)
    assert wplan.recipe == plan.recipe == fp4jax.recipes.parse(wcfg.recipe)


def test_token_row_check_reads_a_foreign_models_recipes_not_their_specs(counts, tmp_path):
    """A ``--model``'s layers: ``RunModels.layers`` records each layer's recipe as a spec,
    ``RunModels.layer_recipes`` holds the recipe objects; the multi-device token-row check
    reads the objects (parses nothing) and refuses a rules recipe whose blocks the rows
    straddle."""
    import json

    import jax

    from fp4jax.train import TrainConfig, loop, models
    from fp4jax.train.plan import plan_run

    if len(jax.devices()) < 4:
        pytest.skip("needs the 4 virtual CPU devices of conftest.py")
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"pattern": "h_0/ffn", "recipe": "quartet2(name=q2)"}]))
    cfg = TrainConfig(model="tests.foreign_models:shared_scope_lm", recipe="nvfp4(sr=False)",
                      seq_len=16, batch_size=16, first_bf16=0, last_bf16=0, devices=4,
                      rules=str(rules))
    plan = plan_run(cfg)
    rm = models.foreign_models(cfg, plan.run_config, plan.recipe, 64)
    assert rm.layers == {n: None if r is None else fp4jax.recipes.spec(r)
                         for n, r in rm.layer_recipes.items()}
    assert rm.layer_recipes["h_0/ffn"] == fp4jax.recipes.parse("quartet2(name=q2)")
    mesh = loop.run_mesh(cfg, plan.run_config)
    counts.clear()
    with pytest.raises(ValueError, match=r"64 token rows a device; recipe 'q2'"):
        loop.check_token_rows(cfg, rm, mesh)
    assert _parses(counts) == 0 and counts["split_spec"] == 0, counts


def test_resume_config_check_parses_no_spec(counts):
    """A resume's config check (``checkpoint.config_diff``) takes the run-level keys the run
    parsed (``RunPlan.run_keys``): a saved spec of the same text is not parsed again, and a
    run-level key is still applied to both sides (a flag the spec overrides is no
    difference); a saved spec of another text is parsed (it is new text)."""
    import dataclasses

    from fp4jax.train import TrainConfig
    from fp4jax.train.checkpoint import config_diff
    from fp4jax.train.plan import plan_run

    spec = "nvfp4(sr=False, last_bf16=0)"
    plan = plan_run(TrainConfig(preset="micro", recipe=spec))
    n0 = _parses(counts)
    cur = dataclasses.asdict(plan.config)
    saved = {**cur, "last_bf16": 3}  # the flag differs; the spec sets last_bf16=0 for both
    assert config_diff(saved, cur, plan.run_keys) == []
    assert _parses(counts) == n0, counts
    assert config_diff({**cur, "lr": 1.0}, cur, plan.run_keys) == [
        f"lr: 1.0 -> {cur['lr']!r}"]
    assert _parses(counts) == n0, counts
    other = config_diff({**cur, "recipe": "nvfp4(sr=False, last_bf16=2)"}, cur,
                        plan.run_keys)
    assert _parses(counts) == n0 + 1, counts
    assert other == ["last_bf16: 2 -> 0", f"recipe: 'nvfp4(sr=False, last_bf16=2)' -> {spec!r}"]
    assert config_diff(saved, cur) == []  # without the keys: parsed, the same answer
