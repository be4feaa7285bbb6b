"""TetraJet-v2's OsciReset (``fp4jax.train.oscillation``, ``--osci-reset``; issue 37 item 4).

* ``oscillation.apply`` over 40 steps of synthetic updates equals an independent NumPy
  transcription of the authors' rule (snapshot, tracking, ratio, reset; ``Q`` the 2D NVFP4
  quantize-dequantize of ``tests.reference``) bit for bit: parameters after every step
  and the reset fraction, on a plain and a stacked (scanned/experts) kernel, in float32
  and bfloat16 compute; untracked parameters are untouched;
* the schedule (``OsciReset.phase``) and the checks of its values;
* the harness: a ``micro`` run with ``--osci-reset`` records its resets, and stopped and
  resumed it ends with the uninterrupted run's parameters bit for bit (the state travels in
  the checkpoint); the flag's refusals.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from fp4jax import recipes as R  # noqa: E402
from fp4jax.train import oscillation as osc  # noqa: E402
from tests.reference import ref_dequantize, ref_quantize  # noqa: E402

F32 = np.float32


def _ref_q(w: np.ndarray, dtype: str) -> np.ndarray:
    """Q(w): cast to the compute dtype, 2D NVFP4 quantize-dequantize per matrix (NumPy)."""
    w = np.asarray(w, F32)
    if dtype == "bfloat16":
        w = w.astype(ml_dtypes.bfloat16).astype(F32)
    flat = w.reshape(-1, *w.shape[-2:])
    out = []
    for m in flat:
        q, s, dec = ref_quantize(m, block_2d=True)
        out.append(np.asarray(ref_dequantize(q, s, dec, block_2d=True), F32))
    return np.stack(out).reshape(w.shape)


def _ref_run(ws: list[np.ndarray], updates, cfg: osc.OsciReset, dtype: str):
    """The authors' rule (oscillation_reset.py, distance_ratio), transcribed in NumPy."""
    ws = [w.copy() for w in ws]
    last = dq = dw = None
    out = []
    for s, us in enumerate(updates):
        ws = [(w + u).astype(F32) for w, u in zip(ws, us, strict=True)]
        frac = 0.0
        first = -(-cfg.start // cfg.period) * cfg.period
        if s >= first:
            ph = s % cfg.period
            if ph == 0:
                last = [w.copy() for w in ws]
                dq = [np.zeros_like(w) for w in ws]
                dw = [np.zeros_like(w) for w in ws]
            elif ph <= cfg.iters:
                for i, w in enumerate(ws):
                    dq[i] = (dq[i] + np.abs(_ref_q(w, dtype) - _ref_q(last[i], dtype))).astype(F32)
                    dw[i] = (dw[i] + np.abs(w - last[i])).astype(F32)
                    last[i] = w.copy()
            elif ph == cfg.iters + 1:
                n = 0
                for i, w in enumerate(ws):
                    with np.errstate(divide="ignore", invalid="ignore"):
                        ratio = np.where(dw[i] == 0, F32(0), dq[i] / dw[i]).astype(F32)
                    mask = ratio >= F32(cfg.threshold)
                    ws[i] = np.where(mask, _ref_q(w, dtype), w).astype(F32)
                    n += int(mask.sum())
                frac = n / sum(w.size for w in ws)
        out.append(([w.copy() for w in ws], frac))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_apply_matches_numpy_reference(dtype):
    rng = np.random.default_rng(0)
    params = {"a": {"kernel": (rng.standard_normal((48, 32)) * 0.05).astype(F32)},
              "b": {"kernel": (rng.standard_normal((2, 32, 16)) * 0.05).astype(F32)},
              "norm": {"scale": np.ones((32,), F32)}}
    recipe = R.nvfp4()
    layers = {"a/kernel": (recipe, (48, 32), None), "b/kernel": (recipe, (32, 16), None),
              "c/kernel": (None, (4, 4), None)}
    tracked, skipped = osc.tracked_weights(params, layers, dtype)
    assert [t.path for t in tracked] == ["a/kernel", "b/kernel"]
    assert tracked[0].spec.block_2d
    cfg = osc.OsciReset(start=3, period=10, iters=5, threshold=4.0)
    steps = 40
    # small updates that flip sign: elements near a rounding boundary oscillate in Q(w)
    updates = [[(rng.standard_normal(p.shape) * 2e-3 * (-1) ** s).astype(F32)
                for p in (params["a"]["kernel"], params["b"]["kernel"])]
               for s in range(steps)]
    state = osc.init_state(params, tracked)

    @jax.jit
    def step(p, st, s, us):
        p = {**p, "a": {"kernel": p["a"]["kernel"] + us[0]},
             "b": {"kernel": p["b"]["kernel"] + us[1]}}
        return osc.apply(cfg, p, st, s, tracked)

    ref = _ref_run([params["a"]["kernel"], params["b"]["kernel"]], updates, cfg, dtype)
    p = jax.tree.map(jnp.asarray, params)
    resets = 0
    for s in range(steps):
        p, state, frac = step(p, state, jnp.int32(s), updates[s])
        (ra, rb), rfrac = ref[s]
        np.testing.assert_array_equal(np.asarray(p["a"]["kernel"]).view(np.uint32),
                                      ra.view(np.uint32), err_msg=f"step {s}")
        np.testing.assert_array_equal(np.asarray(p["b"]["kernel"]).view(np.uint32),
                                      rb.view(np.uint32), err_msg=f"step {s}")
        assert float(frac) == pytest.approx(rfrac, abs=1e-7), s
        resets += rfrac > 0
        assert cfg.phase(s) == "reset" or float(frac) == 0.0
    np.testing.assert_array_equal(np.asarray(p["norm"]["scale"]), params["norm"]["scale"])
    # the test has teeth: resets happened (steps 16, 26, 36), yet not every element
    assert resets == 3
    assert 0 < max(f for _, f in ref) < 0.5


def test_schedule_and_checks():
    cfg = osc.OsciReset(start=13, period=10, iters=5)
    assert cfg.first_snapshot == 20
    assert [cfg.phase(s) for s in (19, 20, 21, 25, 26, 27, 30)] == \
        ["off", "snapshot", "track", "track", "reset", "off", "snapshot"]
    assert osc.OsciReset(start=0, period=5, iters=3).phase(0) == "snapshot"
    for kw, msg in [({"start": -1}, "start"), ({"start": 0, "period": 2}, "period"),
                    ({"start": 0, "period": 10, "iters": 9}, "iters"),
                    ({"start": 0, "threshold": float("nan")}, "threshold"),
                    ({"start": 0, "threshold": True}, "threshold"),
                    ({"start": 1.5}, "start")]:
        with pytest.raises(ValueError, match=msg):
            osc.OsciReset(**kw)


def test_untracked_layers_say_why():
    params = {"a": {"kernel": np.zeros((32, 32), F32)}, "b": {"kernel": np.zeros((32, 32), F32)},
              "c": {"kernel": np.zeros((4, 8, 32), F32)}}
    layers = {"a/kernel": (R.get("bf16"), (32, 32), None),
              "b/kernel": (R.nvfp4(), (32, 32), "its kernel is divided by channel scales"),
              "c/kernel": (R.nvfp4(), (32, 32), None)}
    tracked, skipped = osc.tracked_weights(params, layers, "float32")
    assert tracked == []
    assert "does not quantize" in skipped["a/kernel"]
    assert "channel scales" in skipped["b/kernel"]
    assert "(32, 32)" in skipped["c/kernel"]


@pytest.mark.xdist_group("osci")
def test_harness_records_resets_and_resumes_exactly(tmp_path):
    from fp4jax.train import TrainConfig, train
    from tests.textdata import write_text

    data = write_text(tmp_path / "t.txt", 60_000)
    # only the forward weight quantized (what OsciReset tracks): the cheapest step to compile
    base = dict(preset="micro", recipe="bf16(fprop.rhs.fmt=nvfp4, fprop.rhs.block_2d=True)",
                data=str(data), seq_len=32,
                batch_size=4, steps=12, eval_every=0, progress=False, osci_reset=0.25,
                osci_period=4, osci_iters=2, osci_threshold=1.0, lr=3e-2, warmup_steps=0)
    full = train(TrainConfig(out=str(tmp_path / "full"), **base))
    import json

    recs = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().split("\n")
            if x]
    resets = [r for r in recs if r.get("type") == "osci_reset"]
    # start 3 -> snapshots at 4 and 8, resets at steps 7 and 11 (if any element qualifies)
    assert resets and {r["step"] for r in resets} <= {7, 11}
    assert all(0 < r["fraction"] < 1 for r in resets)
    cut = TrainConfig(out=str(tmp_path / "cut"), stop_at=6, checkpoint_every=3, **base)
    train(cut)
    resumed = train(cut.replace(stop_at=None, resume=True))
    assert resumed["final_val_loss"] == full["final_val_loss"]
    assert resumed["final_train_loss"] == full["final_train_loss"]


def test_flag_refusals(tmp_path):
    from fp4jax.train import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match="--osci-reset"):
        TrainConfig(osci_reset=1.5)
    with pytest.raises(ConfigError, match="--osci-iters"):
        TrainConfig(osci_reset=0.5, osci_period=5, osci_iters=4)
    with pytest.raises(ConfigError, match="--osci-period"):
        TrainConfig(osci_period=2)
    with pytest.raises(ConfigError, match="--compare"):
        TrainConfig(compare="nvfp4(osci_reset=x)")
