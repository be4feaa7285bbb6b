"""Automatic precision choices of the harness (issue 19): ``--bf16-layers auto`` (an FP4
warm-up measures the layers, the recommended set is recorded and reused on resume),
``--grad-noise-every`` (the gradient-to-noise ratio of the train step's own gradient) and
``--switch-at auto`` (the switch fires on the measured ratio and survives resume), on the
micro preset; their checks and the GEMM-work accounting."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import fp4jax
from fp4jax import diagnostics as D
from fp4jax import train as T
from fp4jax.models.llama import block_layer_names, get_preset, policy_layer_name
from fp4jax.nn.policy import PrecisionPolicy
from fp4jax.train import precision
from tests import MICRO_SCAN_NVFP4
from tests.checks import run_records
from tests.textdata import write_text

# tests/train/test_stats.py's runs: the warm-up compiles the same train and stats steps
BASE = MICRO_SCAN_NVFP4
# a warm-up of 2 steps (stats at steps 0 and 1), 3 of 12 layers in BF16; the ratio measured
# at steps 0, 2, 4 (micro: ~10) against a threshold of 1000 with a window of 2 steps: the
# switch (backward to BF16, QAF) fires at step 2 exactly
AUTO = dict(bf16_layers="auto", bf16_warmup=2, bf16_budget=0.25, switch_at="auto",
            switch="bwd", grad_noise_every=2, switch_threshold=1000.0, switch_window=2)
# K x N of the micro preset's linear layers (d 64, 2 heads of 32, 1 KV head, FFN 128, 256
# byte vocabulary), by hand
KN = {"q": 64 * 64, "k": 64 * 32, "v": 64 * 32, "o": 64 * 64, "up": 64 * 128,
      "down": 128 * 64}
LM_HEAD = 64 * 256


def _cli(args: list[str]) -> int:
    """``fp4jax-train ARGS`` in this process, on the session's compilation cache
    (``--compile-cache auto`` takes ``$JAX_COMPILATION_CACHE_DIR``, which conftest sets to
    it, and leaves the process-wide setting as it is)."""
    return T.main([*args, "--compile-cache", "auto"])


def _runs(tmp: Path) -> dict:
    """Run ``a``: 5 steps in one go, from the command line. Run ``b``: the same config
    through ``T.train`` stopped at step 2 (before the switch), resumed to step 4 (the switch
    fires after the resume), its run-dir record of the BF16 layers deleted, and resumed again
    to the end (from checkpoint 4, which holds the switched state)."""
    text = str(write_text(tmp / "corpus.txt", 30_000))
    args = ["--preset", "micro", "--steps", "5", "--lr", "0.01", "--batch-size", "8",
            "--seq-len", "64", "--eval-every", "0", "--eval-batches", "1", "--log-every", "1",
            "--warmup-steps", "1", "--no-progress", "--scan-layers", "--last-bf16", "0",
            "--bf16-layers", "auto", "--bf16-warmup", "2", "--bf16-budget", "0.25",
            "--switch-at", "auto", "--switch", "bwd", "--grad-noise-every", "2",
            "--switch-threshold", "1000", "--switch-window", "2", "--data", text,
            "--checkpoint-every", "1", "--out", str(tmp / "a")]
    assert _cli(args) == 0
    a = json.loads((tmp / "a" / "result.json").read_text())
    cfg = T.TrainConfig(**BASE, **AUTO, data=text, out=str(tmp / "b"), checkpoint_every=1,
                        keep_checkpoints=5)
    T.train(cfg.replace(stop_at=2))
    warm = (tmp / "b" / "bf16_warmup" / "metrics.jsonl").stat().st_mtime_ns
    T.train(cfg.replace(stop_at=4, resume=True))
    (tmp / "b" / precision.RECORD).unlink()  # the checkpoints' copy must do
    b = T.train(cfg.replace(resume=True))
    return {"a": (tmp / "a", a), "b": (tmp / "b", b), "warm_mtime": warm, "text": text}


@pytest.mark.heavy(307)
@pytest.mark.xdist_group("micro_scan_nvfp4")  # test_stats.py's compiled steps
def test_auto_precision_end_to_end(tmp_path, monkeypatch):
    """``--bf16-layers auto`` and ``--switch-at auto`` on the micro preset (the runs of
    ``_runs``, shared by the checks below: one set of compilations on one test worker)."""
    runs = _runs(tmp_path)
    _check_bf16_layers_auto_measures_once_and_keeps_the_recommended_set(runs)
    _check_grad_noise_uses_the_train_steps_own_gradients(runs)
    _check_switch_at_auto_fires_after_its_window_and_survives_resume(runs)
    _check_switch_step_is_drawn_on_the_loss_plots(runs, tmp_path / "plots", monkeypatch)
    _check_bf16_layers_from_a_stats_file(runs, tmp_path / "from_file")


def _check_bf16_layers_auto_measures_once_and_keeps_the_recommended_set(runs):
    out, a = runs["a"]
    rec = json.loads((out / precision.RECORD).read_text())
    names = block_layer_names(get_preset("micro"))
    assert len(rec["layers"]) == 3 and set(rec["layers"]) <= set(names)  # floor(0.25 * 12)
    assert rec["measured_layers"] == 12 and rec["stats_steps"] == [1]
    # the three with the largest mean wgrad error of the warm-up's stats (step 1, not 0)
    warm = [r for r in run_records(out / "bf16_warmup") if r["type"] == "stats"]
    assert [r["step"] for r in warm] == [0, 1]
    err = {n: warm[1]["layers"][n]["wgrad"]["rel_error"] for n in names}
    assert set(rec["layers"]) == set(sorted(err, key=err.get)[-3:])
    assert rec["wgrad_rel_error"] == err
    # they run in BF16: the policy, the result, the metrics and the step's measured layers
    assert a["bf16_layers"] == rec["layers"]
    assert a["policy"].startswith("9 of 13 linear layers in NVFP4")
    for n in rec["layers"]:
        assert policy_layer_name(n, get_preset("micro")) in a["policy"]
    first = run_records(out)[0]
    assert first["type"] == "bf16_layers" and first["layers"] == rec["layers"]
    noise = next(r for r in run_records(out) if r["type"] == "grad_noise")
    assert noise["layers"]["lm_head"]["ratio"] == float("inf")  # no quantized GEMM reaches it
    # resumed twice (once without the run-dir record): the same set, no second warm-up
    out_b, b = runs["b"]
    assert b["bf16_layers"] == rec["layers"]
    assert (out_b / "bf16_warmup" / "metrics.jsonl").stat().st_mtime_ns == runs["warm_mtime"]
    assert not list(out_b.glob(f"{precision.WARMUP_DIR}.old-*"))


def _check_grad_noise_uses_the_train_steps_own_gradients(runs):
    """The monitor's quantized gradient is the train step's (its norm is the step's logged
    grad norm), and its high-precision one is what the step computes once the backward runs
    in BF16 (step 2, where the switch fired); the ratio is ||g|| / ||g_q - g||."""
    out, _ = runs["a"]
    recs = run_records(out)
    train = {r["step"]: r for r in recs if r["type"] == "train"}
    noise = {r["step"]: r for r in recs if r["type"] == "grad_noise"}
    assert sorted(noise) == [0, 2]  # none after the switch: the backward is BF16
    # compiled apart, the roundings may differ (measured 3e-5 relative on JAX 0.10.2, 6.4e-4
    # on 0.12.1, where stochastic rounding amplifies them: see the test below); SR draws
    # with another key move the norm by ~2 ||eps|| / sqrt(d) relative (7e-4): the norms are
    # a sanity check, the test below compares the gradients themselves, layer by layer
    np.testing.assert_allclose(noise[0]["grad_q_norm"], train[0]["grad_norm"], rtol=2e-3)
    np.testing.assert_allclose(noise[2]["grad_norm"], train[2]["grad_norm"], rtol=2e-3)
    for r in noise.values():
        assert r["ratio"] == pytest.approx(r["grad_norm"] / r["noise_norm"], rel=1e-6)
        assert r["sigma_q"] == pytest.approx(r["noise_norm"] / np.sqrt(r["d"]), rel=1e-6)
        assert 2 < r["ratio"] < 100 and r["d"] == sum(
            x["d"] for x in r["layers"].values()) + 256 * 64 + 2 * 2 * 64 + 64  # + embed, norms
        assert len(r["layers"]) == 9 + 3 + 1  # every kernel: FP4, BF16 layers, LM head
        # the FP4 layers' ratio, by hand from theirs: root sums of squares
        fp4 = [v for n, v in r["layers"].items() if n != "lm_head"
               and n not in runs["a"][1]["bf16_layers"]]
        assert len(fp4) == 9 and r["fp4_layers"]["d"] == sum(v["d"] for v in fp4)
        assert r["fp4_layers"]["ratio"] == pytest.approx(
            np.sqrt(sum(v["grad_norm"] ** 2 for v in fp4))
            / np.sqrt(sum(v["noise_norm"] ** 2 for v in fp4)), rel=1e-9)


def scanned_key(tree) -> str:
    """The one scanned-blocks entry of a micro scan model's tree (``blocks_0_1``)."""
    (key,) = [k for k in tree if k.startswith("blocks_")]
    return key


@pytest.mark.xdist_group("micro_scan_nvfp4")  # test_stats.py's compiled train step
def test_grad_noise_is_the_train_steps_sr_noise_and_matches_numpy():
    """``noise_gradients``' quantized gradient is the train step's own (same SR draws: the
    step's gradient, read off its Adam first moment, is within 5% of ``||eps||`` of it, also
    when the step runs data-parallel on several devices, as the harness's does here;
    another step's draws are ~1.4 ``||eps||`` away), and ``gradient_noise`` of the pair is
    the NumPy computation of ``||g|| / (sigma_q sqrt(d))`` on them, globally and per layer.
    (The config of tests/train/test_stats.py's runs: their compiled train step is reused.)"""
    import optax
    from jax.sharding import NamedSharding

    from fp4jax.models.llama import layer_name, quantized_llama
    from fp4jax.train import loop, parallel

    cfg = T.TrainConfig(**BASE)
    mc, recipe = T.model_config(cfg), fp4jax.recipes.nvfp4()
    policy = T.make_policy(cfg, mc, recipe)
    model = quantized_llama(mc, policy)
    model_hp = quantized_llama(mc, policy.replace(recipe=T.switched_recipe(recipe, "bwd")))
    tx = T.make_optimizer(cfg)
    mesh = loop.make_mesh(cfg.devices)  # all devices (4 under tests/conftest.py), as train()
    # laid out as train() lays them out: the same compiled (data-parallel) train step
    state = jax.jit(loop.make_init_state(model, tx, cfg), out_shardings=parallel.shardings(
        loop._REPLICATED, mesh))(jax.random.key(0))
    params = jax.tree.map(np.asarray, state["params"])
    batch = jax.device_put(jax.random.randint(jax.random.key(1), (8, 65), 0, 256),
                           NamedSharding(mesh, parallel.BATCH))
    base = jax.random.key(7)
    new, m = loop.make_train_step(model, tx, None, mesh)(state, batch, base)
    # step 0: mu = (1 - beta1) * g * clip_norm / max(||g||, clip_norm)
    adam = next(x for x in jax.tree.leaves(new["opt_state"], is_leaf=lambda x: isinstance(
        x, optax.ScaleByAdamState)) if isinstance(x, optax.ScaleByAdamState))
    scale = max(float(m["grad_norm"]), cfg.clip_norm) / cfg.clip_norm / (1 - cfg.beta1)
    g_step = jax.tree.map(lambda a: np.asarray(a, np.float64) * scale, adam.mu)
    grads = jax.jit(loop.noise_gradients(model, model_hp))
    g, g_q = jax.tree.map(lambda a: np.asarray(a, np.float64), grads(params, batch, base, 0))
    _, g_q1 = grads(params, batch, base, 1)

    def norm(t):
        return np.sqrt(sum(np.sum(np.square(np.asarray(a, np.float64)))
                           for a in jax.tree.leaves(t)))

    eps = norm(jax.tree.map(np.subtract, g_q, g))
    # Same draws, computed by two programs compiled apart: their unquantized parts may round
    # differently (the final norm's gradient differs by ~1e-5 relative on JAX 0.12.1, ~1e-9
    # on 0.10.2), and a stochastically rounded element near a code boundary then takes the
    # other code, so the difference grows layer by layer down the backward. Measured,
    # ||g_step - g_q|| / ||eps||: 0.013 (0.10.2) and 0.30 (0.12.1) over all parameters,
    # 0.014 / 0.074 for the last block's down projection (the first quantized wgrad of the
    # backward); another step's draws: 1.09 and 1.16 on both. The bounds sit between.
    assert norm(jax.tree.map(np.subtract, g_step, g_q)) < 0.5 * eps
    assert norm(jax.tree.map(np.subtract, g_step, g_q1)) > 0.9 * eps
    for name in ("down", "up"):  # the last block's MLP, where the backward starts
        w_, wq, ws, wq1 = (t[scanned_key(g)]["block"][name]["kernel"][1]
                           for t in (g, g_q, g_step, g_q1))
        e = np.linalg.norm(wq - w_)
        assert np.linalg.norm(ws - wq) < 0.2 * e, name
        assert np.linalg.norm(ws - wq1) > 0.9 * e, name
    got = D.flatten_noise(jax.device_get(jax.jit(
        lambda a, b: D.gradient_noise(a, b, name_fn=layer_name))(g, g_q)))
    flat = [np.ravel(a) for a in jax.tree.leaves(g)]
    flat_e = [np.ravel(b - a) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_q),
                                              strict=True)]
    d = sum(a.size for a in flat)
    sigma = np.sqrt(sum(np.sum(e**2) for e in flat_e) / d)
    assert got["d"] == d == 90432
    np.testing.assert_allclose(got["ratio"], norm(g) / (sigma * np.sqrt(d)), rtol=1e-5)
    np.testing.assert_allclose(got["sigma_q"], sigma, rtol=1e-5)
    (scanned,) = [k for k in g if k.startswith("blocks_")]  # blocks_0_1: both blocks, scanned
    w, w_q = (t[scanned]["block"]["down"]["kernel"][1] for t in (g, g_q))
    s_down = np.sqrt(np.mean((w_q - w) ** 2))
    np.testing.assert_allclose(got["layers"]["block_1/down"]["ratio"],
                               np.linalg.norm(w) / (s_down * np.sqrt(w.size)), rtol=1e-5)
    assert 1 < got["ratio"] < 1000


def _check_switch_at_auto_fires_after_its_window_and_survives_resume(runs):
    (out_a, a), (out_b, b) = runs["a"], runs["b"]
    for out, r in ((out_a, a), (out_b, b)):
        recs = run_records(out)
        sw = [x for x in recs if x["type"] == "switch"]
        assert len(sw) == 1 and sw[0]["step"] == 2 and sw[0]["below_since"] == 0, out
        assert [x["recipe"] for x in recs if x["type"] == "train"] == (
            ["nvfp4"] * 2 + ["nvfp4>bf16-bwd"] * 3)
        assert r["switch_step"] == 2
    # b was stopped before the switch and resumed twice: the same run, bit for bit
    assert a["history"] == b["history"] and a["final_val_loss"] == b["final_val_loss"]
    meta = json.loads((out_b / "checkpoints" / "4" / "meta" / "metadata").read_text())
    assert meta["auto_switch"]["switched_at"] == 2
    assert json.loads((out_b / "checkpoints" / "2" / "meta" / "metadata").read_text())[
        "auto_switch"] == {"threshold": 1000.0, "window": 2, "below_since": 0,
                           "switched_at": None, "last_step": 0}
    # the GEMM work in BF16, by hand: the LM head and the 3 BF16 layers always, the other
    # layers' dgrad and wgrad from step 2 of 5
    hp = LM_HEAD + sum(KN[n.split("/")[1]] for n in a["bf16_layers"])
    fp4 = 2 * sum(KN.values()) + LM_HEAD - hp
    want = (5 * 3 * hp + 3 * 2 * fp4) / (5 * 3 * (hp + fp4))
    assert a["bf16_gemm_fraction"] == pytest.approx(want, rel=1e-12)


def _check_switch_step_is_drawn_on_the_loss_plots(runs, tmp_path, monkeypatch):
    import matplotlib.axes

    tmp_path.mkdir()
    drawn = []
    real = matplotlib.axes.Axes.axvline
    monkeypatch.setattr(matplotlib.axes.Axes, "axvline",
                        lambda self, x=0, *a, **k: drawn.append(x) or real(self, x, *a, **k))
    a = runs["a"][1]
    assert T.plot_losses([a], tmp_path / "p.png").stat().st_size > 1000
    assert drawn == [2, 2]  # training and validation panels
    drawn.clear()
    T.plot_sweep([a, dict(runs["b"][1], seed=1)], tmp_path / "s.png")
    assert drawn == [2, 2, 2, 2]


def test_gemm_fraction_and_qualified_policy_layers():
    mc = get_preset("micro")
    r = fp4jax.recipes.nvfp4()
    total = 3 * (2 * sum(KN.values()) + LM_HEAD)
    plain = PrecisionPolicy(r)
    assert precision.gemm_work(mc, plain) == {"total": total, "high_precision": 3 * LM_HEAD}
    one = PrecisionPolicy(r, high_precision_layers=("block_1/mlp.down",))
    assert one.recipe_for(1, 2, "mlp.down") is None and one.recipe_for(0, 2, "mlp.down") is r
    assert PrecisionPolicy(r, high_precision_layers=("block_*/attn.q",)).count(
        2, mc.linear_layers) == (10, 13)
    assert precision.gemm_work(mc, one)["high_precision"] == 3 * (LM_HEAD + KN["down"])
    fwd = PrecisionPolicy(T.switched_recipe(r, "fwd"))
    f = precision.bf16_gemm_fraction(mc, plain, fwd, steps=10, switch_step=4)
    assert f == pytest.approx((4 * 3 * LM_HEAD + 6 * (3 * LM_HEAD + 2 * sum(KN.values())))
                              / (10 * total))
    assert precision.bf16_gemm_fraction(mc, plain, fwd, 10, None) == 3 * LM_HEAD / total
    assert policy_layer_name("block_0/q", mc) == "block_0/attn.q"
    for bad in ("block_2/q", "block_0/gate", "q", "block_0/attn.q"):
        with pytest.raises(ValueError, match="block_I/NAME"):
            policy_layer_name(bad, mc)


@pytest.mark.parametrize("args, flag, message", [
    (["--switch-at", "auto"], "--switch-at", r"give --grad-noise-every N"),
    (["--switch-at", "auto", "--grad-noise-every", "5", "--recipe", "nvfp4(sr=False)"],
     "--switch-at", r"rounds the gradient dy of dgrad and wgrad to nearest.*FP4-all-the-way"
                    r".*fixed --switch-at FRACTION"),
    (["--switch-at", "auto", "--grad-noise-every", "5", "--recipe", "nvfp4_fwd_only"],
     "--switch-at", "quantizes no backward GEMM"),
    (["--grad-noise-every", "5", "--compare", "bf16,nvfp4(switch_at=auto)"], None, None),
    (["--switch-at", "auto", "--grad-noise-every", "5", "--compare", "bf16,nvfp4"],
     "--switch-at", r"quantizes no backward GEMM.*\(recipe spec 'bf16'\)|recipe 'bf16'"),
    (["--switch-at", "later"], "--switch-at", "in \\[0, 1\\] or 'auto'"),
    (["--switch-threshold", "0"], "--switch-threshold", "> 0"),
    (["--switch-window", "-1"], "--switch-window", ">= 0"),
    (["--grad-noise-every", "-2"], "--grad-noise-every", ">= 0"),
    (["--bf16-layers", "block_7/q"], "--bf16-layers", r"block_I/NAME with I in 0\.\.1"),
    (["--bf16-layers", "auto:"], "--bf16-layers", "give the run directory"),
    (["--bf16-layers", "auto", "--bf16-warmup", "500", "--steps", "100"], "--bf16-warmup",
     "longer than the run"),
    (["--bf16-budget", "1.5"], "--bf16-budget", r"in \[0, 1\]"),
    (["--recipe", "nvfp4(bf16_budget=2)"], "--recipe", "bf16_budget"),
])
def test_cli_checks_the_automatic_precision_flags(args, flag, message, tmp_path, capsys):
    argv = ["--preset", "micro", *args, "--out", str(tmp_path / "r"), "--no-progress",
            "--compile-cache", "off"]
    if flag is None:  # valid: a per-spec auto switch beside a BF16 baseline
        assert T.TrainConfig(preset="micro", grad_noise_every=5,
                             compare="bf16,nvfp4(switch_at=auto)").compare
        return
    with pytest.raises(SystemExit) as e:
        T.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"fp4jax-train: error: argument {flag}: "), err
    assert re.search(message, err), err


def test_run_level_keys_and_stats_file_errors(tmp_path):
    assert T.split_run_spec("nvfp4(switch_at=auto, switch=bwd, bf16_layers=auto, "
                            "bf16_budget=0.2)") == (
        "nvfp4", {"switch_at": "auto", "switch": "bwd", "bf16_layers": "auto",
                  "bf16_budget": 0.2})
    assert T.split_run_spec("nvfp4(bf16_layers='block_0/q,block_1/down')")[1] == {
        "bf16_layers": "block_0/q,block_1/down"}
    cfg = T.TrainConfig(**BASE, out=str(tmp_path / "r"), bf16_layers="block_1/down,block_0/q")
    mc = T.model_config(cfg)
    assert T.make_policy(cfg, mc, fp4jax.recipes.nvfp4()).high_precision_layers == (
        "block_1/mlp.down", "block_0/attn.q")
    assert T.last_bf16_blocks(T.TrainConfig(bf16_layers="auto"), 4) == 0  # not the 15%
    assert T.last_bf16_blocks(T.TrainConfig(), 4) == 1
    with pytest.raises(ValueError, match="must be resolved"):
        T.make_policy(cfg.replace(bf16_layers="auto", bf16_warmup=2), mc,
                      fp4jax.recipes.nvfp4())
    text = write_text(tmp_path / "c.txt", 20_000)
    with pytest.raises(ValueError, match=r"--bf16-layers auto:.*does not exist"):
        T.train(cfg.replace(bf16_layers=f"auto:{tmp_path / 'nowhere'}", data=str(text)))
    (tmp_path / "nostats").mkdir()
    (tmp_path / "nostats" / "metrics.jsonl").write_text('{"type": "train", "step": 0}\n')
    with pytest.raises(ValueError, match="holds no per-layer stats record"):
        T.train(cfg.replace(bf16_layers=f"auto:{tmp_path / 'nostats'}", data=str(text)))
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # refused before training


def _check_bf16_layers_from_a_stats_file(runs, tmp_path):
    """``auto:PATH`` ranks the layers of an earlier run's stats records (here the warm-up of
    run ``a``) and stops after the record is written when told to (``stop_at=0``)."""
    out_a, a = runs["a"]
    cfg = T.TrainConfig(**BASE, data=runs["text"], out=str(tmp_path / "p"), stop_at=0,
                        bf16_layers=f"auto:{out_a / 'bf16_warmup'}", bf16_budget=0.25,
                        switch="bwd")  # run a's compiled functions, reused
    r = T.train(cfg)
    rec = json.loads((tmp_path / "p" / precision.RECORD).read_text())
    assert r["bf16_layers"] == rec["layers"] == a["bf16_layers"]
    assert rec["source"] == str(out_a / "bf16_warmup")
    shutil.rmtree(tmp_path / "p")
