"""Tests of the training harness (fp4jax.train) on the micro preset, on CPU."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import numpy as np
import pytest

import fp4jax
from fp4jax import train as T
from fp4jax.train import loop
from tests import MICRO_SCAN_NVFP4, ROOT
from tests.checks import nan_loss_from
from tests.textdata import write_text

# One optimizer schedule for every test, so that runs share compiled step functions.
BASE = dict(preset="micro", steps=30, lr=1e-2, batch_size=8, seq_len=64, eval_every=15,
            eval_batches=2, log_every=1, warmup_steps=3, progress=False)


# The session's compilation cache (conftest) is shared with the other files' runs of this
# schedule (tests/train/test_safety.py); CLI runs with ``--compile-cache off`` switch it off,
# so put it back after each test.
pytestmark = pytest.mark.usefixtures("keep_compile_cache")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return str(write_text(tmp_path_factory.mktemp("data") / "corpus.txt", 60_000))


def _cfg(text, tmp_path, **kw):
    return T.TrainConfig(**{**BASE, "data": text, "out": str(tmp_path / "run"), **kw})


def _losses(out):
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {(r["type"], r["step"]): r.get("loss", r.get("val_loss")) for r in recs
            if r["type"] in ("train", "eval")}


def test_compare_bf16_nvfp4_losses_fall(text, tmp_path, capsys):
    cfg = _cfg(text, tmp_path)
    results = T.compare(cfg, ["bf16", "nvfp4"])
    for r in results:
        h = r["history"]
        assert h["val_step"] == [0, 15, 30]
        assert r["final_val_loss"] < h["val_loss"][0] - 1.5, r["recipe"]  # ~5.5 -> < 4
        assert np.isfinite(h["loss"]).all()
    assert results[0]["policy"].startswith("0 of 13 linear layers quantized")
    assert results[1]["policy"].startswith("6 of 13 linear layers in NVFP4")
    out = tmp_path / "run"
    assert (out / "compare.png").stat().st_size > 10_000
    table = (out / "compare.md").read_text()
    assert "| bf16 |" in table and "| nvfp4 |" in table and "+0.00%" in table
    gap = 100 * (results[1]["final_val_loss"] / results[0]["final_val_loss"] - 1)
    assert f"{gap:+.2f}%" in table
    assert "gap to bf16" in capsys.readouterr().out
    summary = json.loads((out / "compare.json").read_text())
    assert [s["recipe"] for s in summary["runs"]] == ["bf16", "nvfp4"]
    assert summary["baseline"] == "bf16" and summary["summary"][1]["std"] == 0.0


def test_resume_is_exact_and_refuses_changed_config(text, tmp_path):
    # steps 0-19 of the 30-step schedule: uninterrupted, and stopped at 12 then resumed from
    # the checkpoint of step 10 (the one written at the stop is dropped, as if the run died)
    full = T.train(_cfg(text, tmp_path / "a", stop_at=20))
    out_b = tmp_path / "b"
    T.train(_cfg(text, out_b, stop_at=12, checkpoint_every=5))  # checkpoints 5, 10, 12
    ckpt = T.Checkpointer(out_b / "run" / "checkpoints")
    ckpt.mngr.delete(12)
    assert ckpt.latest_step() == 10
    ckpt.close()
    resumed = T.train(_cfg(text, out_b, resume=True, checkpoint_every=5, stop_at=20))
    a, b = _losses(tmp_path / "a" / "run"), _losses(out_b / "run")
    assert a.keys() == b.keys() and len(a) == 20 + 2  # train losses 0-19, evals at 0 and 15
    assert a == b  # bit-identical loss curves (NVFP4 with stochastic rounding)
    # the resumed run's curves include the part before the resume (from metrics.jsonl)
    assert resumed["history"] == full["history"]
    assert resumed["history"]["step"] == list(range(20))
    with pytest.raises(ValueError, match=r"differing keys: lr: 0\.01 -> 0\.001; seed: 0 -> 1"):
        T.train(_cfg(text, out_b, resume=True, lr=1e-3, seed=1))
    with pytest.raises(ValueError, match="no checkpoint"):
        T.train(_cfg(text, tmp_path / "c", resume=True))


@pytest.mark.heavy(40)
@pytest.mark.xdist_group("micro_scan_nvfp4")  # test_stats.py's compiled train step
def test_scan_layers_trains_and_old_configs_resume(text, tmp_path):
    """``--scan-layers`` trains (NVFP4, stochastic rounding inside the scan) with a falling
    loss (5 steps of MICRO_SCAN_NVFP4: a step compiled once for three files); a checkpoint
    config written before the key existed counts as its default."""
    r = T.train(T.TrainConfig(**MICRO_SCAN_NVFP4, data=text, out=str(tmp_path / "scan")))
    loss = r["history"]["loss"]
    assert len(loss) == 5 and np.isfinite(loss).all() and max(loss[-2:]) < min(loss[:2])
    cfg = dataclasses.asdict(_cfg(text, tmp_path))
    old = {k: v for k, v in cfg.items() if k != "scan_layers"}
    assert T.config_diff(old, cfg) == []
    assert T.config_diff(old, {**cfg, "scan_layers": True}) == ["scan_layers: False -> True"]


@pytest.fixture(scope="module")
def one_device(text, tmp_path_factory):
    """Steps 0-4 of the shared schedule, NVFP4 on one device: the reference of the
    4-device data-parallel and FSDP runs below (one run for both: xdist group
    ``one_device``)."""
    return T.train(_cfg(text, tmp_path_factory.mktemp("one"), devices=1, stop_at=5,
                        recipe="nvfp4"))


@pytest.mark.xdist_group("one_device")
def test_sharded_four_devices_matches_one(text, tmp_path, one_device):
    # NVFP4 data-parallel in shard_map (fp4jax.sharding): every quantized operand is the
    # single-device bits, so the first loss differs only by the order of its float32 mean
    # (measured 9e-8 relative; quantizing each shard apart, without data_parallel: 1.6e-4).
    # Later steps drift more: each device's weight-gradient partial is rounded to bf16
    # before the sum and Adam's first steps amplify sign flips of tiny gradients.
    # tests/dot/test_sharding.py checks the GEMMs bit for bit.
    assert len(jax.devices()) >= 4, "tests/conftest.py should force 4 CPU devices"
    one = one_device
    four = T.train(_cfg(text, tmp_path / "four", devices=4, stop_at=5, recipe="nvfp4"))
    assert four["devices"] == 4
    np.testing.assert_allclose(four["history"]["loss"][0], one["history"]["loss"][0],
                               rtol=1e-6)
    np.testing.assert_allclose(four["history"]["loss"], one["history"]["loss"], rtol=2e-3)
    assert len(one["history"]["loss"]) == 5
    with pytest.raises(ValueError, match="not divisible by 4 devices"):
        T.train(_cfg(text, tmp_path / "bad", devices=4, batch_size=6))


@pytest.mark.xdist_group("one_device")
def test_fsdp_shards_the_state_and_resumes_exactly(text, tmp_path, one_device):
    # 4 devices as data 2 x fsdp 2: parameters and Adam moments stored in halves, gathered
    # for the step; the same NVFP4 operands as one device (first loss to f32 order), and a
    # run stopped and resumed in the same mesh continues bit for bit.
    from fp4jax.train import parallel

    one = one_device["history"]["loss"][:4]
    full = T.train(_cfg(text, tmp_path / "full", devices=4, fsdp=2, stop_at=6))
    np.testing.assert_allclose(full["history"]["loss"][0], one[0], rtol=1e-6)
    np.testing.assert_allclose(full["history"]["loss"][:4], one, rtol=2e-3)
    T.train(_cfg(text, tmp_path / "b", devices=4, fsdp=2, stop_at=4, checkpoint_every=2))
    T.train(_cfg(text, tmp_path / "b", devices=4, fsdp=2, stop_at=6, checkpoint_every=2,
                 resume=True))
    a, b = _losses(tmp_path / "full" / "run"), _losses(tmp_path / "b" / "run")
    assert a == b and len(a) == 6 + 1

    # the state's layout: every array with an even dimension is split over fsdp
    mesh = parallel.make_mesh(4, 2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2}
    cfg = _cfg(text, tmp_path)
    mc = T.model_config(cfg)
    model = fp4jax.models.quantized_llama(mc, T.make_policy(cfg, mc, fp4jax.recipes.nvfp4()))
    init = loop.make_init_state(model, T.make_optimizer(cfg), cfg)
    specs = parallel.state_specs(jax.eval_shape(init), mesh)
    state = jax.jit(init, out_shardings=parallel.shardings(specs, mesh))()
    leaves = jax.tree.leaves(state)
    total = sum(x.nbytes for x in leaves)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    split = [x for x in leaves if any(d % 2 == 0 for d in x.shape)]
    assert split and all(x.addressable_shards[0].data.size * 2 == x.size for x in split)
    assert per_device < 0.51 * total, (per_device, total)
    with pytest.raises(ValueError, match="--fsdp 3 must divide"):
        parallel.make_mesh(4, 3)
    with pytest.raises(ValueError, match="fsdp"):
        T.train(_cfg(text, tmp_path / "bad", fsdp=0))


def test_cudnn_attention_needs_a_gpu(text, tmp_path):
    if jax.devices()[0].platform == "gpu":
        pytest.skip("runs on a GPU")
    with pytest.raises(ValueError, match="--attention cudnn needs NVIDIA GPUs"):
        T.train(_cfg(text, tmp_path, attention="cudnn"))
    with pytest.raises(ValueError, match="attention"):
        T.train(_cfg(text, tmp_path, attention="flash"))


def test_fsdp_spec_rule():
    from fp4jax.train.parallel import fsdp_spec

    P = jax.sharding.PartitionSpec
    assert fsdp_spec((256, 64), 4) == P("fsdp")
    assert fsdp_spec((64, 256), 4) == P(None, "fsdp")
    assert fsdp_spec((6, 64, 64), 2) == P(None, "fsdp")  # largest, first of equals
    assert fsdp_spec((3, 5), 2) == P() and fsdp_spec((), 2) == P()
    assert fsdp_spec((256, 64), 1) == P()


def test_precision_switch(text, tmp_path):
    r = fp4jax.recipes.nvfp4()
    fwd, bwd = T.switched_recipe(r, "fwd"), T.switched_recipe(r, "bwd")
    assert not fwd.fprop.quantized and fwd.dgrad.quantized and fwd.wgrad.quantized
    assert bwd.fprop.quantized and not bwd.dgrad.quantized and not bwd.wgrad.quantized
    assert not T.switched_recipe(r, "both").quantized
    # 8 steps of the shared 30-step schedule (its compiled unswitched step is reused), switching
    # at step 4 (the same switch point as --steps 8 --switch-at 0.5), no evals
    kw = dict(stop_at=8, eval_every=0)
    base = T.train(_cfg(text, tmp_path / "none", **kw))["history"]["loss"]
    runs = {m: T.train(_cfg(text, tmp_path / m, switch_at=4 / 30, switch=m, **kw))
            for m in ("fwd", "bwd")}
    same = {m: [a == b for a, b in zip(r["history"]["loss"], base, strict=True)]
            for m, r in runs.items()}
    # fwd: step 4's loss already comes from the BF16 forward pass
    assert same["fwd"] == [True] * 4 + [False] * 4
    # bwd: step 4's forward is unchanged (equal loss); its BF16 gradients change step 5 on
    assert same["bwd"] == [True] * 5 + [False] * 3
    recs = [json.loads(x) for x in (tmp_path / "fwd" / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [x["recipe"] for x in recs if x["type"] == "train"] == (
        ["nvfp4"] * 4 + ["nvfp4>bf16-fwd"] * 4)


def test_switch_at_end_never_switches(text, tmp_path, capsys):
    T.train(_cfg(text, tmp_path, switch_at=1.0, stop_at=0))
    assert "never switches" in capsys.readouterr().err


def test_nan_stops_and_keeps_last_good_checkpoint(text, tmp_path, monkeypatch, capsys):
    # the poison stands for parameters that went bad at checkpoint 4: the loss of step s comes
    # from the parameters of checkpoint s, so checkpoint 4 is not good and must not be kept
    nan_loss_from(monkeypatch, 4)
    cfg = _cfg(text, tmp_path, recipe="bf16", checkpoint_every=2, eval_every=0)
    msg = (r"at step 4 \(0-based\).*Last good checkpoint: 2 \(the state before step 2\).*"
           r"deleted checkpoint 4.*resuming unchanged repeats.*--resume-override lr")
    with pytest.raises(T.TrainingDiverged, match=msg):
        T.train(cfg)
    ckpt = T.Checkpointer(tmp_path / "run" / "checkpoints")
    assert ckpt.latest_step() == 2
    ckpt.close()
    first = _losses(tmp_path / "run")
    # resuming from the reported checkpoint: its steps are finite (and bit-identical), until the
    # same divergence at step 4
    with pytest.raises(T.TrainingDiverged, match=msg):
        T.train(cfg.replace(resume=True))
    again = _losses(tmp_path / "run")
    assert again == first
    assert np.isfinite([again["train", s] for s in range(4)]).all()
    # named optimizer keys may change on resume, and the change is recorded
    T.train(cfg.replace(resume=True, resume_override="lr", lr=1e-3, stop_at=2))
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"type": "resume", "step": 2, "overrides": {"lr": [0.01, 0.001]}} in recs
    with pytest.raises(ValueError, match="cannot be overridden"):
        T.train(cfg.replace(resume=True, resume_override="seq_len"))
    monkeypatch.setattr("sys.argv", ["fp4jax-train"])
    args = ["--preset", "micro", "--data", text, "--recipe", "bf16", "--steps", "30",
            "--lr", "0.01", "--warmup-steps", "3", "--batch-size", "8", "--seq-len", "64",
            "--eval-batches", "2", "--eval-every", "0", "--checkpoint-every", "4",
            "--out", str(tmp_path / "cli"), "--no-progress", "--compile-cache", "auto"]
    capsys.readouterr()
    assert T.main(args) == 1
    err = capsys.readouterr().err
    assert re.search(r"training diverged: \[bf16\] loss became nan .* at step 4 \(0-based\); "
                     r"stopped\. No good checkpoint was saved \(deleted checkpoint 4", err), err


@pytest.mark.parametrize("args, message", [
    (["--recipe", "nvfp5"], "unknown recipe 'nvfp5'; valid names: .*nvfp4"),
    (["--compare", "bf16,fp3"], "unknown recipe 'fp3'; valid names"),
    (["--preset", "giant"], "unknown preset 'giant'; valid presets: .*tiny"),
    (["--data", "/nonexistent/corpus.txt"], "does not exist"),
])
def test_cli_bad_input(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        T.main([*args, "--out", str(tmp_path), "--no-progress", "--compile-cache", "off"])
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_cli_persistent_compile_cache(tmp_path):
    """``--compile-cache DIR`` fills DIR with compiled executables (a second run of the same
    configuration then skips XLA compilation); in a subprocess, since JAX's cache setting
    is process-wide. BF16: the cache does not depend on the recipe, and a BF16 step
    compiles in a third of an NVFP4 step's time on the CPU."""
    import subprocess
    import sys

    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question. " * 400)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    cmd = [sys.executable, "-m", "fp4jax.train", "--preset", "micro", "--data", str(text),
           "--recipe", "bf16", "--steps", "2", "--batch-size", "4", "--seq-len", "32",
           "--eval-every", "0", "--no-progress", "--out", str(tmp_path / "run"),
           "--compile-cache", str(tmp_path / "xla")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert any("jit_step" in p.name for p in (tmp_path / "xla").iterdir())


def test_new_compiled_config_starts_from_fresh_trace_caches(monkeypatch):
    """A config the harness has not compiled yet is built from cleared JAX trace caches, as
    in a fresh process: what a program lowers to (which identical inner jitted calls share
    a private function) otherwise depends on what the process traced before, and so does
    its persistent-cache key (the micro NVFP4 stats step lowered after other runs: 758
    private functions instead of 683, recompiled for 22 s). A function jitted before the
    build is traced again after it; a config already built is reused without clearing."""
    traces = []

    @jax.jit
    def probe(x):
        traces.append(1)
        return x + 1

    monkeypatch.setattr(loop, "_STEP_CACHE", {})
    cfg = T.TrainConfig(preset="micro", progress=False)
    recipe, mesh = fp4jax.recipes.get("bf16"), loop.make_mesh(1)
    probe(1.0)
    _, reused = loop._step_fns(cfg, recipe, mesh, dict)
    probe(1.0)
    assert not reused and len(traces) == 2
    _, reused = loop._step_fns(cfg, recipe, mesh, dict)
    probe(1.0)
    assert reused and len(traces) == 2


def test_schedules():
    cfg = T.TrainConfig(steps=100, lr=1.0, warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.1)
    wsd = T.make_schedule(cfg)
    lrs = [float(wsd(s)) for s in (0, 5, 10, 50, 79, 80, 90, 100)]
    np.testing.assert_allclose(lrs, [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.55, 0.1], atol=1e-6)
    cos = T.make_schedule(cfg.replace(schedule="cosine"))
    np.testing.assert_allclose([float(cos(s)) for s in (10, 55, 100)], [1.0, 0.55, 0.1],
                               atol=1e-6)
    with pytest.raises(ValueError, match="valid"):
        T.make_schedule(cfg.replace(schedule="linear"))


def test_comparison_table_and_plot_handle_missing_values(tmp_path):
    h = {"step": [0, 1, 2], "loss": [5.0, 4.0, 3.0], "val_step": [0, 3], "val_loss": [5.5, 4.5]}
    common = dict(preset="micro", params=1000, devices=1, device_kind="cpu", policy="p",
                  tokens_per_s=None, final_val_loss=None, history=h)
    results = [dict(common, recipe="bf16", last_val_step=3, last_val_loss=4.5,
                    final_train_loss=3.0),
               dict(common, recipe="nvfp4", last_val_step=3, last_val_loss=4.59,
                    final_train_loss=None),
               dict(common, recipe="mxfp4", last_val_step=None, last_val_loss=None,
                    final_train_loss=None, history={k: [] for k in h})]
    table = T.comparison_table(results).splitlines()
    early = "(last eval, step 3; stopped early)"
    assert f"| bf16 | 4.5000 {early} | +0.00% | 3.0000 | n/a |" in table[2]
    assert f"| nvfp4 | 4.5900 {early} | +2.00% | n/a | n/a |" in table[3]
    assert "| mxfp4 | n/a | n/a | n/a | n/a |" in table[4]
    assert T.plot_losses(results, tmp_path / "p.png").stat().st_size > 1000


def test_import_fp4jax_stays_light():
    """``import fp4jax`` loads neither Flax nor Optax nor the harness; ``fp4jax.train`` is
    imported on first use (in a subprocess: this one has loaded them all)."""
    import subprocess
    import sys

    code = ("import sys, fp4jax; heavy = [m for m in ('flax', 'optax', 'fp4jax.train') "
            "if m in sys.modules]; assert not heavy, heavy; "
            "assert fp4jax.train.TrainConfig is fp4jax.train.config.TrainConfig; "
            "assert 'optax' in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
