"""OutControl in the harness (``fp4jax-train --outcontrol``, fp4jax.train.channel_split): the
recorded statistic and the split found independently (the harness's model at its initial
parameters, every layer's input captured by method interception, NumPy norms and a stable
argsort), exact resume from inside the recording window, and the refused combinations."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import train as T
from fp4jax.nn import linen as fnn
from fp4jax.train.config import run_recipe
from fp4jax.train.loop import build_models, load_data
from tests.checks import run_records
from tests.textdata import write_text

BASE = dict(preset="micro", steps=5, lr=1e-2, batch_size=4, seq_len=32, eval_every=0,
            eval_batches=1, log_every=1, warmup_steps=1, progress=False, last_bf16=0,
            outcontrol=0.1, outcontrol_multiple=16, outcontrol_start=1, outcontrol_iters=2)


def _layer_inputs(cfg):
    """Each quantized layer's input ``x`` in the forward pass of step 0 (initial parameters,
    batch 0), by intercepting the harness's model's DotGeneral calls."""
    rm = build_models(cfg, *run_recipe(cfg), load_data(cfg))
    model = rm.models[False]
    root = jax.random.key(cfg.seed)
    params = model.init(jax.random.fold_in(root, 0), jnp.zeros((1, cfg.seq_len), jnp.int32))
    ds = load_data(cfg)
    batch = jnp.asarray(ds.train_batch(0, cfg.batch_size, cfg.seed))

    def grab_all(params, batch):
        seen = {}

        def grab(next_fun, args, kwargs, context):
            if isinstance(context.module, fnn.DotGeneral) and context.method_name == "__call__":
                seen["/".join(context.module.path[:-1])] = args[0]
            return next_fun(*args, **kwargs)

        sr = jax.random.fold_in(root, 1)
        with nn.intercept_methods(grab):
            model.apply(params, batch[:, :-1], rngs={
                "fp4": jax.random.fold_in(sr, 0), "fp4_layer": jax.random.fold_in(sr, 2**31 - 2)})
        return seen

    # compiled, as the harness's statistic pass is (eager ops round some sums otherwise)
    seen = jax.jit(grab_all)(params, batch)
    return {k: np.asarray(v, np.float64).reshape(-1, v.shape[-1]) for k, v in seen.items()}


@pytest.mark.heavy(83)
@pytest.mark.xdist_group("outcontrol")  # the resume test below reuses its compiled steps
def test_split_is_the_top_channels_of_the_recorded_norms(tmp_path):
    text = str(write_text(tmp_path / "corpus.txt", 30_000))
    cfg = T.TrainConfig(**{**BASE, "outcontrol_start": 0, "outcontrol_iters": 1}, data=text,
                        out=str(tmp_path / "run"))
    T.train(cfg)
    recs = run_records(tmp_path / "run")
    (rec,) = [r for r in recs if r["type"] == "outcontrol"]
    assert rec["step"] == 1 and not rec["skipped"]
    inputs = _layer_inputs(cfg)
    assert sorted(rec["layers"]) == sorted(inputs) and len(inputs) == 12
    for path, x in inputs.items():
        norms = np.sqrt((x ** 2).sum(0)).astype(np.float32)
        n = 16  # int(K * 0.1) rounded up to 16: K 64 and 128 both give 16
        got = rec["layers"][path]
        assert got["mxfp8_channels"] == n
        # the recorded first 8 are the channels of the 8 largest norms, in order: their
        # NumPy norms equal the sorted ones up to the rounding of a jitted forward pass
        # against this eager one (near-ties may swap), and most are the very channels
        want = np.sort(norms)[::-1][:8]
        np.testing.assert_allclose(norms[got["first"]], want, rtol=1e-3, err_msg=path)
        assert len(set(got["first"]) & set(np.argsort(-norms)[:8].tolist())) >= 6, path


@pytest.mark.xdist_group("outcontrol")
def test_resume_inside_the_window_is_exact_and_cli_flags(tmp_path):
    text = str(write_text(tmp_path / "corpus.txt", 30_000))
    flags = ["--preset", "micro", "--steps", "5", "--lr", "0.01", "--batch-size", "4",
             "--seq-len", "32", "--eval-every", "0", "--eval-batches", "1", "--log-every", "1",
             "--warmup-steps", "1", "--no-progress", "--last-bf16", "0", "--data", text,
             "--outcontrol", "0.1", "--outcontrol-multiple", "16", "--outcontrol-start", "1",
             "--outcontrol-iters", "2", "--checkpoint-every", "1", "--compile-cache", "auto"]
    assert T.main([*flags, "--out", str(tmp_path / "a")]) == 0
    assert T.main([*flags, "--out", str(tmp_path / "b"), "--stop-at", "2"]) == 0
    assert T.main([*flags, "--out", str(tmp_path / "b"), "--resume"]) == 0
    a, b = (json.loads((tmp_path / r / "result.json").read_text()) for r in "ab")
    la = [r["loss"] for r in run_records(tmp_path / "a") if r["type"] == "train"]
    lb = [r["loss"] for r in run_records(tmp_path / "b") if r["type"] == "train"]
    assert la == lb and len(la) == 5 and a["final_val_loss"] == b["final_val_loss"]
    oa, ob = ([r for r in run_records(tmp_path / r) if r["type"] == "outcontrol"] for r in "ab")
    assert oa == ob and oa[0]["step"] == 3
    # the split changes the run: the same run without OutControl has the same losses
    # before step 3 (the recording leaves training alone) and others from step 3 on
    keep = [f for i, f in enumerate(flags) if not f.startswith("--outcontrol")
            and not flags[i - 1].startswith("--outcontrol")]
    assert T.main([*keep, "--out", str(tmp_path / "c")]) == 0
    lc = [r["loss"] for r in run_records(tmp_path / "c") if r["type"] == "train"]
    assert lc[:3] == la[:3] and lc[3] != la[3]


@pytest.mark.parametrize("bad,match", [
    (dict(outcontrol=1.0), "outcontrol"),
    (dict(outcontrol=0.1, outcontrol_multiple=24), "multiple of 16"),
    (dict(outcontrol=0.1, outcontrol_start=3, outcontrol_iters=2), "never reaches"),
    (dict(outcontrol=0.1, osci_reset=0.5), "osci-reset"),
    (dict(outcontrol=0.1, switch_at=0.5), "switch-at"),
    (dict(outcontrol=0.1, devices=2, fsdp=2), "fsdp"),
    (dict(outcontrol=0.1, stats_every=1), "stats-every"),
    (dict(outcontrol=0.1, bf16_layers="auto"), "bf16-layers auto"),
])
def test_refused_configs(bad, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        T.TrainConfig(**{**BASE, **bad}, out=str(tmp_path / "x"))


def test_no_layer_wide_enough(tmp_path):
    """micro's layers (64 and 128 inputs) cannot split 128 channels: one clear error."""
    text = str(write_text(tmp_path / "corpus.txt", 30_000))
    cfg = T.TrainConfig(**{**BASE, "outcontrol_multiple": 128}, data=text,
                        out=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="no quantized linear layer of this run can split"):
        T.train(cfg)


def test_spec_keys():
    from fp4jax.train.config import split_run_spec

    spec, keys = split_run_spec("nvfp4(outcontrol=0.1, outcontrol_multiple=32, "
                                "outcontrol_start=100)")
    assert spec == "nvfp4" and keys == {"outcontrol": 0.1, "outcontrol_multiple": 32,
                                        "outcontrol_start": 100}
    for bad in ("nvfp4(outcontrol=1)", "nvfp4(outcontrol_multiple=24)",
                "nvfp4(outcontrol_iters=0)"):
        with pytest.raises(ValueError, match="outcontrol"):
            split_run_spec(bad)
