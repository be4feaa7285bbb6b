"""The training harness in its parts (data, model and rules, state, step, evaluation,
checkpoints, logging), each alone, and ``fp4jax-train --model MODULE:FACTORY`` on models
written as users write them (``tests/harness_models.py``: linen ``DenseGeneral`` attention
and ``nn.Einsum``; NNX ``Linear`` and ``nnx.Einsum``), a few CPU steps each."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax.recipes
import fp4jax.sharding
from fp4jax import train as T
from fp4jax.rules import Rule, rule_recipe
from fp4jax.train import checkpoint, config, models, runlog, steps
from tests import harness_models as hm
from tests.checks import run_records
from tests.textdata import write_text

SMALL = {"d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32}
CLI = ["--steps", "4", "--lr", "0.01", "--warmup-steps", "1", "--batch-size", "4",
       "--seq-len", "32", "--eval-every", "2", "--eval-batches", "1", "--log-every", "1",
       "--no-progress", "--compile-cache", "auto", "--devices", "1",
       "--model-args", json.dumps(SMALL)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return str(write_text(tmp_path_factory.mktemp("harness") / "c.txt", 20_000))


def _losses(out: Path) -> dict[tuple[str, int], float]:
    return {(r["type"], r["step"]): r.get("loss", r.get("val_loss")) for r in run_records(out)
            if r["type"] in ("train", "eval")}


# --- the parts alone -------------------------------------------------------------------


def test_find_blocks_and_default_rules():
    linen = ["layers_0/query", "layers_0/wo", "layers_1/query", "layers_1/wo", "lm_head"]
    assert models.find_blocks(linen) == ("layers_", 2)
    nnx_paths = ["layers/0/q", "layers/1/q", "layers/2/q", "lm_head"]
    assert models.find_blocks(nnx_paths) == ("layers/", 3)
    assert models.find_blocks(["decoder/blocks/q", "lm_head"]) is None  # a scanned stack
    assert models.find_blocks(["layers_0/q", "layers_2/q"]) is None  # not 0..n-1

    nv = T.run_recipe(T.TrainConfig(recipe="nvfp4"))[1]
    rcfg = T.TrainConfig(model="m:f", first_bf16=1, last_bf16=0, bf16_layers="layers/1/q")
    rules, notes = models.default_rules(nv, nnx_paths, rcfg)
    got = models.layer_recipes(rules, nnx_paths)
    assert {n: r is not None for n, r in got.items()} == {
        "layers/0/q": False, "layers/1/q": False, "layers/2/q": True, "lm_head": False}
    assert notes == []
    # the default last ~15% of the blocks: ceil(0.15 * 3) = 1
    rules, _ = models.default_rules(nv, nnx_paths, T.TrainConfig(model="m:f"))
    assert [rule_recipe(rules, n) is None for n in nnx_paths] == [
        False, False, True, True]
    # unrecognized blocks: the default is dropped (said), an explicit count refused
    rules, notes = models.default_rules(nv, ["blocks/q", "head"], T.TrainConfig(model="m:f"))
    assert notes and rule_recipe(rules, "blocks/q") is nv
    with pytest.raises(ValueError, match="--first-bf16 2.*not recognized"):
        models.default_rules(nv, ["blocks/q"], T.TrainConfig(model="m:f", first_bf16=2))
    with pytest.raises(ValueError, match="--bf16-layers.*not linear layers"):
        models.default_rules(nv, nnx_paths, T.TrainConfig(model="m:f", bf16_layers="nope"))
    # the switched model: every quantizing rule switched, high precision kept
    sw = models.switched_rules([("a", nv), ("b", None)], "bwd")
    assert sw[0].recipe == T.switched_recipe(nv, "bwd") and sw[1].recipe is None
    assert all(isinstance(r, Rule) for r in rules + sw)  # the one currency
    with pytest.warns(DeprecationWarning, match="rule_recipe"):  # for one release
        assert models.first_match(rules, "blocks/q") == (len(rules) - 1, nv)


def test_linear_layers_and_gemm_fraction():
    params = jax.eval_shape(hm.linen_lm(256, 8, **SMALL).init, jax.random.key(0),
                            jnp.zeros((1, 8), jnp.int32))["params"]
    shapes = models.linear_layers(params)
    assert shapes["layers_0/query"] == (16, 2, 8)  # DenseGeneral (D, H, hd)
    assert shapes["layers_1/wo"] == (32, 16) and shapes["lm_head"] == (16, 256)
    assert "embed" not in shapes and len(shapes) == 13
    nv = T.run_recipe(T.TrainConfig())[1]
    rec = {n: (None if n == "lm_head" else nv) for n in shapes}
    frac = models.rules_gemm_fraction(shapes, {False: rec, True: {n: None for n in shapes}})
    total = sum(math.prod(s) for s in shapes.values())
    assert frac(10, None) == pytest.approx(16 * 256 / total)
    assert frac(10, 5) == pytest.approx((5 * 16 * 256 / total + 5) / 10)


def test_load_factory_forms_and_errors(tmp_path):
    assert models.load_factory("tests.harness_models:linen_lm") is hm.linen_lm
    f = models.load_factory(str(Path(hm.__file__)) + ":nnx_lm")
    assert f.__name__ == "nnx_lm" and models.takes_rngs(f)
    assert not models.takes_rngs(hm.linen_lm)
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        models.load_factory("tests.harness_models")
    with pytest.raises(ValueError, match="no callable 'nope'"):
        models.load_factory("tests.harness_models:nope")
    with pytest.raises(ValueError, match="does not import"):
        models.load_factory("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no file"):
        models.load_factory(str(tmp_path / "none.py") + ":f")
    assert models.model_kwargs('{"d_model": 8}') == {"d_model": 8}
    with pytest.raises(ValueError, match="JSON object"):
        models.model_kwargs("[1]")


def test_config_refuses_what_a_foreign_model_cannot_take():
    with pytest.raises(T.ConfigError, match="--model.*MODULE:FACTORY"):
        T.TrainConfig(model="nocolon")
    with pytest.raises(T.ConfigError, match=r"--ffn.*built-in Llama"):
        T.TrainConfig(model="m:f", ffn="swiglu")
    T.TrainConfig(model="m:f", stats_every=2, bf16_layers="auto")  # measured on any model
    with pytest.raises(T.ConfigError, match=r"--rules.*--model"):
        T.TrainConfig(rules="r.json")
    with pytest.raises(T.ConfigError, match=r"--model-args.*JSON object"):
        T.TrainConfig(model="m:f", model_args="3")
    T.TrainConfig(model="m:f", bf16_layers="layers_0/query")  # names: checked by the run


def test_nnx_model_as_a_pure_function():
    """``NnxModel``: init gives the NNX model's own parameters (string keys), apply its
    logits, and gradients flow to every parameter."""
    from flax import nnx

    build = lambda rngs: hm.nnx_lm(64, 8, rngs=rngs, **SMALL)  # noqa: E731
    m = models.NnxModel(build)
    key = jax.random.key(3)
    params = jax.jit(m.init)(key, jnp.zeros((1, 8), jnp.int32))["params"]
    ref = build(nnx.Rngs(params=key))
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 64
    np.testing.assert_array_equal(params["layers"]["1"]["up"]["kernel"],
                                  ref.layers[1].up.kernel[...])
    np.testing.assert_array_equal(m.apply({"params": params}, tokens), ref(tokens))
    g = jax.grad(lambda p: m.apply({"params": p}, tokens).sum())(params)
    assert all(float(jnp.abs(x).sum()) > 0 for x in jax.tree.leaves(g["layers"]))


def test_train_step_and_eval_step_on_a_tiny_model(monkeypatch):
    """The step alone: one AdamW step of a foreign linen model on one device; its loss is
    ``loss_fn``'s, the step counter advances, eval gives the loss of the new parameters.
    On a one-device mesh of this 4-device host the steps trace their loss inside
    ``fp4jax.sharding.one_device()`` (the Hopper kernels' automatic choice as on a one-GPU
    host); on the 4-device mesh not (there ``shard_map`` and ``data_parallel`` decide)."""
    cfg = T.TrainConfig(model="m:f", seq_len=8, batch_size=2, warmup_steps=0)
    model = hm.linen_lm(64, 8, **SMALL)
    tx = T.make_optimizer(cfg)
    state = jax.jit(steps.make_init_state(model, tx, cfg))(jax.random.key(0))
    mesh = T.make_mesh(1)
    batch = jnp.arange(18, dtype=jnp.int32).reshape(2, 9) % 64
    base = jax.random.key(1)
    # jitted: one program, not the ~50 eager ops' programs of the un-jitted loss
    want = jax.jit(lambda p, b, k, lk: steps.loss_fn(model, p, b, k, lk))(
        state["params"], batch, jax.random.fold_in(base, 0),
        jax.random.fold_in(base, steps.LAYER_KEY_INDEX))
    seen, loss_fn = [], steps.loss_fn

    def spy(*args, **kwargs):
        seen.append(fp4jax.sharding.on_one_device())
        return loss_fn(*args, **kwargs)

    monkeypatch.setattr(steps, "loss_fn", spy)
    new, m = steps.make_train_step(model, tx, None, mesh)(state, batch, base)
    assert float(m["loss"]) == pytest.approx(float(want), rel=1e-6)
    assert int(new["step"]) == 1 and math.isfinite(float(m["grad_norm"]))
    ev = steps.make_eval_step(model, None, mesh)(new["params"], batch, base)
    assert float(ev) < float(want)
    assert seen == [True, True] and not fp4jax.sharding.on_one_device()
    batch4 = jnp.tile(batch, (2, 1))  # 4 devices: one row each
    jax.eval_shape(steps.make_eval_step(model, None, T.make_mesh(4)), new["params"], batch4,
                   base)
    assert seen == [True, True, False]


def test_runlog_records_and_divergence(tmp_path):
    notes = []
    log = runlog.RunLog(tmp_path / "metrics.jsonl", runlog.Progress(3, 0, False, "x"), "x",
                        tokens_per_step=8, log_every=2, end=3, lr=lambda s: 0.5 * s,
                        recipe_name=lambda s: f"r{s}",
                        diverged_note=lambda s: notes.append(s) or "kept 0.")
    log.dispatched(0, {"loss": jnp.float32(2.0), "grad_norm": jnp.float32(1.0)})
    log.dispatched(1, {"loss": jnp.float32(1.5), "grad_norm": jnp.float32(1.0)})
    log.flush()
    log.val_loss(2, 1.25)
    log.dispatched(2, {"loss": jnp.float32(np.nan), "grad_norm": jnp.float32(1.0)})
    with pytest.raises(T.TrainingDiverged, match=r"\[x\] loss became nan .* step 2 "
                       r"\(0-based\); stopped. kept 0.") as e:
        log.flush()
    assert e.value.step == 2 and notes == [2]
    log.close()
    recs = run_records(tmp_path)
    assert [(r["type"], r["step"]) for r in recs] == [("train", 0), ("eval", 2),
                                                      ("diverged", 2)]
    assert recs[0]["recipe"] == "r0" and recs[0]["lr"] == 0.0
    assert log.history == {"step": [0, 1], "loss": [2.0, 1.5], "val_step": [2],
                           "val_loss": [1.25]}


def test_checkpoints_save_resume_round_trip(tmp_path):
    """``RunCheckpoints`` alone: a state saved at step 2 resumes bit for bit with its meta;
    a non-finite state is refused; a divergence at step 2 drops checkpoint 2."""
    cfg = T.TrainConfig(out=str(tmp_path / "run"), keep_checkpoints=2)
    cfg_dict = config.dataclasses.asdict(cfg)
    ck = checkpoint.RunCheckpoints(tmp_path / "run", 2, main=True)
    ck.open(cfg)
    log = runlog.RunLog(tmp_path / "run" / "metrics.jsonl", runlog.Progress(1, 0, False, "x"),
                        "x", 1, 1, 1, lambda s: 0.0, str, ck.drop_bad)
    state = {"step": jnp.int32(2), "params": {"w": jnp.arange(6.0).reshape(2, 3)},
             "opt_state": {"mu": jnp.ones(3, jnp.bfloat16)}}
    ck.save(2, state, {"config": cfg_dict, "step": 2, "data_sha256": "ab" * 32}, log)
    bad = {**state, "step": jnp.int32(3), "params": {"w": jnp.full((2, 3), jnp.nan)}}
    with pytest.raises(T.TrainingDiverged, match="non-finite in step 2.*not checkpointed"):
        ck.save(3, bad, {"config": cfg_dict, "step": 3, "data_sha256": "ab" * 32}, log)
    ck.close()

    ck = checkpoint.RunCheckpoints(tmp_path / "run", 2, main=True)
    ck.open(cfg.replace(resume=True))
    template = jax.tree.map(jnp.zeros_like, state)
    seen = []
    got = ck.resume(template, cfg_dict, [], "ab" * 32, seen.append)
    assert got.step == 2 and seen and seen[0]["step"] == 2
    for a, b in zip(jax.tree.leaves(got.state), jax.tree.leaves(state), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="training data differ"):
        ck.resume(template, cfg_dict, [], "cd" * 32, seen.append)
    assert "deleted checkpoint 2" in ck.drop_bad(2) and ck.ckpt.all_steps() == []
    ck.close()
    assert [r["type"] for r in run_records(tmp_path / "run")] == ["checkpoint", "diverged"]


def test_precision_switch_alone():
    sw = models.PrecisionSwitch(T.TrainConfig(steps=10, switch_at=0.5, switch="fwd"), 10)
    assert (sw(4), sw(5)) == (False, True) and "at step 5" in sw.describe()
    auto = models.PrecisionSwitch(T.TrainConfig(steps=10, switch_at="auto",
                                                grad_noise_every=1, switch_window=1), 10)
    assert not auto(9) and auto.state()["switched_at"] is None

    class Log:
        def __init__(self):
            self.recs, self.lines = [], []

        def write(self, r):
            self.recs.append(r)

        def say(self, m):
            self.lines.append(m)

    log = Log()
    assert not auto.observe(2, 0.5, log) and auto.observe(3, 0.5, log)
    assert auto(3) and not auto(2) and log.recs[0]["type"] == "switch"
    again = models.PrecisionSwitch(T.TrainConfig(steps=10, switch_at="auto",
                                                 grad_noise_every=1, switch_window=1), 10)
    again.restore({"auto_switch": auto.state(), "step": 4}, None)
    assert again.step == 3


# --- fp4jax-train --model on a user's model ----------------------------------------------


def _write_rules(path: Path) -> str:
    path.write_text(json.dumps([{"pattern": r".*/wo", "recipe": None},
                                [r".*query", "nvfp4(sr=False)"]]))
    return str(path)


def test_cli_trains_a_linen_model_with_rules_and_resumes_exactly(corpus, tmp_path, capsys):
    """A linen model (DenseGeneral attention, nn.Einsum MLP) under --rules and the nvfp4
    recipe: 4 steps straight, and 2 + 2 through a checkpoint: the same losses, bit for
    bit; the run says which layers are quantized."""
    rules = _write_rules(tmp_path / "rules.json")
    args = [*CLI, "--model", "tests.harness_models:linen_lm", "--rules", rules,
            "--recipe", "nvfp4", "--data", corpus]
    assert T.main([*args, "--out", str(tmp_path / "full")]) == 0
    err = capsys.readouterr().err
    assert "tests.harness_models:linen_lm, linen" in err and "linear layers in" in err
    prec = next(r for r in run_records(tmp_path / "full") if r["type"] == "precision")["layers"]
    assert prec["layers_0/wo"] is None and prec["lm_head"] is None  # the file; the default
    spec = fp4jax.recipes.spec
    assert prec["layers_0/query"] == spec(fp4jax.recipes.parse("nvfp4(sr=False)"))
    assert prec["layers_0/key"] == spec(fp4jax.recipes.nvfp4())
    assert prec["layers_1/key"] is None  # the last ~15% of the blocks (1 of 2)
    part = ["--out", str(tmp_path / "part"), "--checkpoint-every", "2"]
    assert T.main([*args, *part, "--stop-at", "2"]) == 0
    assert T.main([*args, *part, "--resume"]) == 0
    full, resumed = _losses(tmp_path / "full"), _losses(tmp_path / "part")
    assert full == resumed and len(full) == 4 + 3, (full, resumed)
    assert all(math.isfinite(v) for v in full.values())


def test_cli_trains_an_nnx_model_from_a_file(corpus, tmp_path, capsys):
    """An NNX model (Linear attention, nnx.Einsum MLP) named by its file, nvfp4 with
    stochastic rounding, its state sharded over 2 devices (--fsdp 2): finite losses that
    fall."""
    spec = f"{Path(hm.__file__)}:nnx_lm"
    args = [*CLI, "--model", spec, "--recipe", "nvfp4", "--data", corpus, "--lr", "0.02"]
    args[args.index("--devices") + 1] = "2"
    assert T.main([*args, "--fsdp", "2", "--out", str(tmp_path / "fsdp")]) == 0
    assert "nnx_lm, nnx" in capsys.readouterr().err
    got = _losses(tmp_path / "fsdp")
    assert all(math.isfinite(v) for v in got.values()) and len(got) == 4 + 3
    assert got["eval", 4] < got["eval", 0]


def test_cli_compares_recipes_on_a_foreign_model(corpus, tmp_path):
    """``--compare bf16,nvfp4`` on a foreign linen model: two runs, the summary written."""
    out = tmp_path / "cmp"
    args = list(CLI)
    args[args.index("--eval-every") + 1] = "4"
    assert T.main([*args, "--model", "tests.harness_models:linen_lm",
                   "--compare", "bf16,nvfp4", "--data", corpus, "--out", str(out)]) == 0
    res = {json.loads((out / d / "result.json").read_text())["recipe"]: d
           for d in ("bf16", "nvfp4")}
    assert set(res) == {"bf16", "nvfp4"}
    assert (out / "compare.md").read_text().count("nvfp4") >= 1


def test_cli_grad_noise_and_auto_switch_on_a_foreign_model(corpus, tmp_path):
    """``--switch-at auto`` on a foreign model: the gradient-to-noise ratio measured (one
    entry per kernel, DenseGeneral kernels not split), the switch fires, the switched
    steps run BF16."""
    out = tmp_path / "auto"
    assert T.main([*CLI, "--model", "tests.harness_models:linen_lm", "--data", corpus,
                   "--recipe", "nvfp4", "--switch-at", "auto", "--grad-noise-every", "1",
                   "--switch-window", "1", "--switch-threshold", "1e9",
                   "--out", str(out)]) == 0
    recs = run_records(out)
    noise = [r for r in recs if r["type"] == "grad_noise"]
    assert "layers_0/query" in noise[0]["layers"] and len(noise[0]["layers"]) == 13
    sw = next(r for r in recs if r["type"] == "switch")
    assert sw["step"] == 1
    assert [r["recipe"] for r in recs if r["type"] == "train"] == ["nvfp4"] + ["bf16"] * 3


def test_cli_bf16_layers_auto_and_stats_on_a_linen_model(corpus, tmp_path):
    """``--bf16-layers auto`` on a foreign linen model: the FP4 warm-up measures every
    quantized layer (DenseGeneral with two feature axes, with two contracting axes,
    nn.Einsum) by its module path, the worst becomes a high-precision rule that the run
    keeps (its stats, step 0, measure the others)."""
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([[r".*/(key|value|wo)", None]]))
    out = tmp_path / "auto"
    assert T.main([*CLI, "--model", "tests.harness_models:linen_lm", "--data", corpus,
                   "--model-args", json.dumps({**SMALL, "n_layers": 1}),
                   "--rules", str(rules), "--recipe", "nvfp4(sr=False)",
                   "--bf16-layers", "auto", "--bf16-warmup", "2", "--bf16-budget", "0.34",
                   "--stats-every", "2", "--stop-at", "1", "--out", str(out)]) == 0
    quantized = {"layers_0/query", "layers_0/out", "layers_0/wi"}
    warm = [r for r in run_records(out / "bf16_warmup") if r["type"] == "stats"]
    assert warm and all(set(r["layers"]) == quantized and "unmeasured" not in r
                        for r in warm)
    rec = json.loads((out / "bf16_layers.json").read_text())
    assert len(rec["layers"]) == 1 and rec["layers"][0] in quantized
    (bf16,) = rec["layers"]
    assert rec["rules"] == [re.escape(bf16)] and rec["measured_layers"] == 3
    recs = run_records(out)
    assert next(r for r in recs if r["type"] == "precision")["layers"][bf16] is None
    stats = [r for r in recs if r["type"] == "stats"]
    assert [r["step"] for r in stats] == [0]
    assert all(set(r["layers"]) == quantized - {bf16} and "unmeasured" not in r
               for r in stats)
    assert all(0 < r["layers"][n]["wgrad"]["rel_error"] < 1 for r in stats for n in r["layers"])


def test_cli_stats_on_an_nnx_model(corpus, tmp_path):
    """``--stats-every`` on a foreign NNX model: every quantized layer (Linear,
    nnx.Einsum) measured by its attribute path."""
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([[r".*/(k|v|o|down)", None]]))
    out = tmp_path / "nnx"
    assert T.main([*CLI, "--model", "tests.harness_models:nnx_lm", "--data", corpus,
                   "--model-args", json.dumps({**SMALL, "n_layers": 1}),
                   "--rules", str(rules), "--recipe", "nvfp4", "--stop-at", "1",
                   "--stats-every", "1", "--out", str(out)]) == 0
    (st,) = [r for r in run_records(out) if r["type"] == "stats"]
    assert set(st["layers"]) == {"layers/0/q", "layers/0/up"} and "unmeasured" not in st
    assert all(0 < st["layers"][n]["wgrad"]["rel_error"] < 1 for n in st["layers"])
