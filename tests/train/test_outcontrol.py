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
from fp4jax.train import channel_split, loop
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
    # jitted, as the harness's init is: one compilation instead of one per eager op and
    # layer shape
    params = jax.jit(model.init)(jax.random.fold_in(root, 0),
                                 jnp.zeros((1, cfg.seq_len), jnp.int32))
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
def test_split_is_the_top_channels_of_the_recorded_norms(tmp_path, monkeypatch):
    text = str(write_text(tmp_path / "corpus.txt", 30_000))
    cfg = T.TrainConfig(**{**BASE, "outcontrol_start": 0, "outcontrol_iters": 1}, data=text,
                        out=str(tmp_path / "run"))
    split_evals = []  # the evaluation after the split runs it (its eval function, called)
    orig = loop._split_evals

    def spy(fn, split):
        return orig(lambda *a: split_evals.append(1) or fn(*a), split)

    monkeypatch.setattr(loop, "_split_evals", spy)
    T.train(cfg)
    assert split_evals  # the final validation (step 5, after the split at step 1)
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
    a = json.loads((tmp_path / "a" / "result.json").read_text())
    la = [r["loss"] for r in run_records(tmp_path / "a") if r["type"] == "train"]
    oa = [r for r in run_records(tmp_path / "a") if r["type"] == "outcontrol"]
    assert len(la) == 5 and len(oa) == 1 and oa[0]["step"] == 3
    # one run stopped inside the window (2), resumed and stopped at the split (3), resumed
    # and stopped after it (4), then resumed to the end: a resume from each
    b = tmp_path / "b"
    assert T.main([*flags, "--out", str(b), "--stop-at", "2"]) == 0
    for stop in (3, 4):
        assert T.main([*flags, "--out", str(b), "--resume", "--stop-at", str(stop)]) == 0
    assert T.main([*flags, "--out", str(b), "--resume"]) == 0
    lb = [r["loss"] for r in run_records(b) if r["type"] == "train"]
    ob = [r for r in run_records(b) if r["type"] == "outcontrol"]
    assert lb == la and ob == oa
    assert json.loads((b / "result.json").read_text())["final_val_loss"] == (
        a["final_val_loss"])
    # the split changes the run: the same run without OutControl has the same losses
    # before step 3 (the recording leaves training alone) and others from step 3 on
    keep = [f for i, f in enumerate(flags) if not f.startswith("--outcontrol")
            and not flags[i - 1].startswith("--outcontrol")]
    assert T.main([*keep, "--out", str(tmp_path / "c")]) == 0
    lc = [r["loss"] for r in run_records(tmp_path / "c") if r["type"] == "train"]
    assert lc[:3] == la[:3] and lc[3] != la[3]


def test_statistic_is_the_whole_batchs_on_four_devices():
    """The statistic pass on 4 devices (the batch split over them, as the harness runs it)
    gives the 1-device norms: every layer's channels summed over the whole batch, not a
    device's share (which would be ~1/sqrt(2) of them at 2 devices)."""
    from jax.sharding import NamedSharding

    from fp4jax.train import parallel
    from fp4jax.train.steps import make_outcontrol_record

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    cfg = T.TrainConfig(**{**BASE, "batch_size": 8}, data=None, out="unused")
    ds = load_data(cfg)
    model = build_models(cfg, *run_recipe(cfg), ds).models[False]
    params = jax.jit(model.init)(jax.random.key(0),
                                 jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
    batch = jnp.asarray(ds.train_batch(0, cfg.batch_size, cfg.seed))
    norms = {}
    for n in (1, 4):
        mesh = parallel.make_mesh(n)
        record = make_outcontrol_record(model, mesh)
        b = jax.device_put(batch, NamedSharding(mesh, parallel.BATCH))
        norms[n] = jax.tree.map(np.asarray, record(params, b, jax.random.key(1), 0))
    flat1 = jax.tree_util.tree_leaves_with_path(norms[1])
    flat4 = dict(jax.tree_util.tree_leaves_with_path(norms[4]))
    assert len(flat1) == 12 and len(flat4) == 12
    for path, v in flat1:
        # float32 sums in another order: within a few ulps
        np.testing.assert_allclose(flat4[path], v, rtol=1e-5, err_msg=str(path))


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


def test_accumulate_and_select_against_numpy():
    """Two steps' norms added up (a plain (K,) leaf and a scanned (L, K) one), then each
    layer's (each block's) top channels by the sum, descending, ties to the lower index."""
    rng = np.random.default_rng(3)
    shapes = {"a": {"DotGeneral_0": {"sq": jax.ShapeDtypeStruct((64,), jnp.float32)}},
              "s": {"blk": {"DotGeneral_0": {"sq": jax.ShapeDtypeStruct((3, 128), jnp.float32)}}}}
    plan = channel_split.make_plan(shapes, 0.1, 16, 5, 2)
    assert plan.counts == {("a", "DotGeneral_0"): 16, ("s", "blk", "DotGeneral_0"): 16}
    state = channel_split.init_state(plan, shapes)
    steps = [(rng.random(64).astype(np.float32), rng.random((3, 128)).astype(np.float32))
             for _ in range(2)]
    steps[1][0][[3, 9]] = 10.0 - steps[0][0][[3, 9]]  # a tie in the sum (10 each)
    for a, sc in steps:
        state = channel_split.accumulate(plan, state, {
            "a": {"DotGeneral_0": {"sq": jnp.asarray(a)}},
            "s": {"blk": {"DotGeneral_0": {"sq": jnp.asarray(sc)}}}})
    state = channel_split.select(plan, state)
    sum_a = steps[0][0] + steps[1][0]
    sum_s = steps[0][1] + steps[1][1]
    np.testing.assert_array_equal(state["sums"]["a"]["DotGeneral_0"]["sq"], sum_a)
    order = np.argsort(-sum_a, kind="stable")
    np.testing.assert_array_equal(state["split"]["a"]["DotGeneral_0"]["hi"], order[:16])
    np.testing.assert_array_equal(state["split"]["a"]["DotGeneral_0"]["lo"], order[16:])
    assert list(np.asarray(state["split"]["a"]["DotGeneral_0"]["hi"][:2])) == [3, 9]
    for blk in range(3):
        order = np.argsort(-sum_s[blk], kind="stable")
        np.testing.assert_array_equal(state["split"]["s"]["blk"]["DotGeneral_0"]["hi"][blk],
                                      order[:16])


def test_settings_without_outcontrol_and_experts_are_refused(tmp_path):
    for bad in (dict(outcontrol_multiple=32), dict(outcontrol_start=10),
                dict(outcontrol_iters=5)):
        with pytest.raises(ValueError, match="which is off: pass --outcontrol"):
            T.TrainConfig(preset="micro", steps=50, out=str(tmp_path / "x"), **bad)
    with pytest.raises(ValueError, match="n-experts"):
        T.TrainConfig(**{**BASE, "n_experts": 4}, out=str(tmp_path / "x"))


def test_a_run_without_quantized_layers_runs_without_it(tmp_path, capsys):
    """``--compare nvfp4,bf16 --outcontrol 0.1``: the bf16 run has nothing to split; it runs
    as plain bf16 and says so."""
    text = str(write_text(tmp_path / "corpus.txt", 30_000))
    T.train(T.TrainConfig(**{**BASE, "recipe": "bf16", "steps": 4}, data=text,
                          out=str(tmp_path / "run")))
    assert "OutControl: off in this run" in capsys.readouterr().err
    assert not [r for r in run_records(tmp_path / "run") if r["type"] == "outcontrol"]


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
