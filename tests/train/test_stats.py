"""Per-layer quantization statistics (issue 19, first part): ``fp4jax.diagnostics.layer_stats``
(each fp4jax linen layer measured on its own operands, also inside ``nn.scan``), the
``fp4jax-train --stats-every`` records, reading them back and the heat-map script; with the
flag off the train step is the one compiled before the feature existed."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import diagnostics as D
from fp4jax import train as T
from fp4jax.models.llama import layer_name, layer_order, quantized_llama
from fp4jax.nn import linen as fnn
from fp4jax.train import loop
from fp4jax.train.config import make_optimizer, make_policy, model_config, run_recipe
from tests import MICRO_SCAN_NVFP4, ROOT
from tests.textdata import write_text

RTN = fp4jax.recipes.nvfp4().replace(sr=False)
SCAN_AXES = {"params": 0, fnn.PERTURB_COLLECTION: 0, fnn.COTANGENT_COLLECTION: 0,
             fnn.STATS_COLLECTION: 0}


# -- a small hand-written model: fp4jax layers outside and inside nn.scan, and plain ones --

class _Block(nn.Module):
    recipe: Any

    @nn.compact
    def __call__(self, h: jax.Array, _: Any) -> tuple[jax.Array, None]:
        return h + fnn.Dense(32, recipe=self.recipe, name="mix")(jnp.tanh(h)), None


class _Net(nn.Module):
    """``x (B, T, 32)`` -> ``(B, T, 8)``: ``inp`` (fp4jax Dense), ``n_blocks`` ``_Block``
    (scanned as ``blocks`` or unrolled as ``blocks_0``, ``blocks_1``, ...), ``fp4head``
    (``nn.Dense`` with the fp4jax dot_general) and ``head`` (plain ``nn.Dense``: not
    measured)."""

    recipe: Any
    scan: bool = True
    n_blocks: int = 2

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = fnn.Dense(32, recipe=self.recipe, name="inp")(x)
        if self.scan and self.n_blocks:
            blocks = nn.scan(_Block, variable_axes=SCAN_AXES, length=self.n_blocks,
                             split_rngs={"params": True, "fp4": True})
            h, _ = blocks(self.recipe, name="blocks")(h, None)
        elif self.n_blocks:
            for i in range(self.n_blocks):
                h, _ = _Block(self.recipe, name=f"blocks_{i}")(h, None)
        dg = functools.partial(fnn.DotGeneral, recipe=self.recipe)
        h = nn.Dense(32, use_bias=False, dot_general_cls=dg, name="fp4head")(jnp.tanh(h))
        return nn.Dense(8, name="head")(h)


X = jax.random.normal(jax.random.key(1), (2, 16, 32))
TGT = jax.random.normal(jax.random.key(2), (2, 16, 8))


def _loss(out: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(out - TGT))


def _intercepted(model: nn.Module, params: Any, rngs: dict, pert: dict
                 ) -> tuple[jax.Array, dict, dict]:
    """Loss, inputs and outputs of the fp4jax layers named in ``pert`` (module paths), with
    ``pert[path]`` added to their outputs: Flax's method interception, independent of the
    statistics collections."""
    xs, ys = {}, {}

    def icpt(next_fun, args, kwargs, ctx):
        out = next_fun(*args, **kwargs)
        path = "/".join(ctx.module.scope.path) if ctx.module.scope is not None else ""
        if ctx.method_name == "__call__" and path in pert and isinstance(
                ctx.module, fnn.Dense | nn.Dense):
            xs[path], ys[path] = args[0], out
            out = out + pert[path]
        return out

    with nn.intercept_methods(icpt):
        out = model.apply({"params": params}, X, rngs=rngs)
    return _loss(out), xs, ys


def _close(got: Any, want: Any, n: int) -> None:
    """Equal up to float rounding: the two computations are compiled apart, so an element
    one ulp from a rounding boundary may count differently (1 of the ``n`` elements of an
    operand in the underflow and saturation fractions)."""
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                         strict=True):
        frac = p[-1].key in ("underflow", "saturation")
        np.testing.assert_allclose(float(a), float(b), rtol=0 if frac else 1e-5,
                                   atol=1.01 / n if frac else 1e-7,
                                   err_msg=jax.tree_util.keystr(p))


def test_layer_stats_equal_gemm_stats_on_each_layers_own_operands():
    """Scanned layers are split per iteration and each one's stats are ``gemm_stats`` of its
    input, weight and output cotangent, found independently (unrolled twin model, method
    interception); plain ``nn.Dense`` layers are absent."""
    model = _Net(RTN)
    params = model.init(jax.random.key(0), X)["params"]
    stats = jax.jit(lambda p: D.layer_stats(model, {"params": p}, X, loss=_loss))(params)
    assert sorted(stats) == ["blocks/mix[0]", "blocks/mix[1]", "fp4head", "inp"]

    twin = _Net(RTN, scan=False)
    blk = params["blocks"]["mix"]["kernel"]
    tp = {**{k: v for k, v in params.items() if k != "blocks"},
          **{f"blocks_{i}": {"mix": {"kernel": blk[i]}} for i in range(2)}}
    names = {"inp": "inp", "blocks_0/mix": "blocks/mix[0]", "blocks_1/mix": "blocks/mix[1]",
             "fp4head": "fp4head"}
    kernels = {"inp": tp["inp"]["kernel"], "blocks_0/mix": blk[0], "blocks_1/mix": blk[1],
               "fp4head": tp["fp4head"]["kernel"]}

    @jax.jit
    def reference(tp, kernels):
        zeros = {p: jnp.zeros((2, 16, 32)) for p in names}
        (_, (xs, _)), dys = jax.value_and_grad(
            lambda z: (lambda r: (r[0], r[1:]))(_intercepted(twin, tp, {}, z)),
            has_aux=True)(zeros)
        return {names[p]: D.gemm_stats(xs[p], kernels[p], dys[p], recipe=RTN) for p in names}

    want = reference(tp, kernels)
    for name in names.values():
        _close(stats[name], want[name], n=X.size)
        assert 0.01 < float(stats[name]["wgrad"]["rel_error"]) < 1.0, name
    assert float(stats["blocks/mix[0]"]["fprop"]["lhs"]["amax"]) != float(
        stats["blocks/mix[1]"]["fprop"]["lhs"]["amax"])  # two different blocks


def test_layer_stats_use_the_train_steps_stochastic_rounding_keys():
    """With stochastic rounding, the errors are those of the training step's own GEMMs: the
    wgrad and dgrad errors equal those of the gradients ``jax.grad`` computes with the same
    ``rngs``, and another key gives other numbers."""
    sr = fp4jax.recipes.nvfp4()
    assert sr.needs_key
    model = _Net(sr, n_blocks=0)  # inp, then fp4head: its dgrad's SR reaches inp's dy
    params = model.init(jax.random.key(0), X)["params"]
    rngs = {"fp4": jax.random.key(7)}
    run = jax.jit(lambda p, k: D.layer_stats(model, {"params": p}, X, loss=_loss,
                                             rngs={"fp4": k}))
    stats = run(params, rngs["fp4"])["inp"]

    zeros = {"inp": jnp.zeros((2, 16, 32))}
    (_, (xs, ys)), dys = jax.value_and_grad(
        lambda z: (lambda r: (r[0], r[1:]))(_intercepted(model, params, rngs, z)),
        has_aux=True)(zeros)
    x, w, dy = (np.asarray(a, np.float64).reshape(-1, a.shape[-1])
                for a in (xs["inp"], params["inp"]["kernel"], dys["inp"]))
    dw_q = jax.grad(lambda p: _loss(model.apply({"params": p}, X, rngs=rngs)))(
        params)["inp"]["kernel"]
    dx_q = jax.grad(lambda x_: _loss(model.apply({"params": params}, x_, rngs=rngs)))(X)

    def rel(a, b):
        a = np.asarray(a, np.float64).reshape(b.shape)
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    np.testing.assert_allclose(float(stats["wgrad"]["rel_error"]), rel(dw_q, x.T @ dy),
                               rtol=1e-4)
    np.testing.assert_allclose(float(stats["dgrad"]["rel_error"]), rel(dx_q, dy @ w.T),
                               rtol=1e-4)
    np.testing.assert_allclose(float(stats["fprop"]["rel_error"]), rel(ys["inp"], x @ w),
                               rtol=1e-4)
    other = run(params, jax.random.key(8))["inp"]
    assert abs(float(other["wgrad"]["rel_error"]) - rel(dw_q, x.T @ dy)) > 1e-4


def test_layer_names_and_no_fp4_layers():
    assert layer_name(("blocks_2_5", "block", "q"), (1,)) == "block_3/q"
    assert layer_name(("block_4", "down")) == "block_4/down"
    assert layer_name(("a", "b"), (2,)) == "a/b[2]"
    names = ["block_1/q", "block_0/down", "block_10/k", "block_0/q", "block_2/v"]
    assert sorted(names, key=layer_order) == [
        "block_0/q", "block_0/down", "block_1/q", "block_2/v", "block_10/k"]
    plain = nn.Dense(4)
    v = plain.init(jax.random.key(0), X)
    with pytest.warns(D.UnmeasuredLayerWarning, match="ran no quantized linear layer"):
        assert D.layer_stats(plain, v, X, loss=jnp.sum) == {}


# -- fp4jax-train --stats-every -------------------------------------------------------------

BASE = MICRO_SCAN_NVFP4


def on_runs(test):
    """Marks a test of ``runs`` (two micro trainings, set up once per xdist worker): started
    first (``heavy``), on the worker of every test that compiles this config's train and
    stats steps (the xdist group ``micro_scan_nvfp4``, ``--dist loadgroup``: also
    tests/train/test_auto_precision.py), so that they compile once."""
    return pytest.mark.heavy(150)(pytest.mark.xdist_group("micro_scan_nvfp4")(test))


@pytest.fixture(scope="session")  # once per worker: other modules' tests run between
def runs(tmp_path_factory):
    """The same micro run (2 scanned NVFP4 blocks) with --stats-every 2 and without."""
    tmp = tmp_path_factory.mktemp("stats")
    text = str(write_text(tmp / "corpus.txt", 30_000))
    before = dict(loop.TRACE_COUNTS)
    on = T.train(T.TrainConfig(**BASE, data=text, out=str(tmp / "on"), stats_every=2))
    traced = loop.TRACE_COUNTS["stats"] - before["stats"]
    off = T.train(T.TrainConfig(**BASE, data=text, out=str(tmp / "off")))
    return {"on": (tmp / "on", on), "off": (tmp / "off", off), "stats_traces": traced}


@on_runs
def test_stats_records_every_n_steps_with_every_quantized_layer(runs):
    out, _ = runs["on"]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines if '"type": "stats"' in x]
    assert [r["step"] for r in recs] == [0, 2, 4]
    assert runs["stats_traces"] == 1  # one compilation for the run
    want = [f"block_{b}/{n}" for b in (0, 1) for n in ("q", "k", "v", "o", "up", "down")]
    for r in recs:
        assert list(r["layers"]) == want  # both scanned blocks, in block order
        for name, layer in r["layers"].items():
            assert set(layer) == {"fprop", "dgrad", "wgrad"}
            for gemm, row in layer.items():
                assert {"rel_error", "lhs.underflow", "rhs.saturation", "lhs.scale_min",
                        "lhs.scale_max", "rhs.amax"} <= set(row)
                assert all(isinstance(v, float) and math.isfinite(v) for v in row.values()), (
                    name, gemm, row)
                assert 0 < row["rel_error"] < 1
    assert max(len(x) for x in lines) < 100_000
    b0, b1 = recs[0]["layers"]["block_0/q"], recs[0]["layers"]["block_1/q"]
    assert b0["fprop"]["lhs.amax"] != b1["fprop"]["lhs.amax"]


@on_runs
def test_stats_leave_training_bit_identical(runs):
    (out_on, on), (out_off, off) = runs["on"], runs["off"]
    assert on["history"] == off["history"]
    assert on["final_val_loss"] == off["final_val_loss"]
    sums = [json.loads((o / "checkpoints" / "5" / "meta" / "metadata").read_text())
            ["checksum"]["sha256"] for o in (out_on, out_off)
            if (o / "checkpoints" / "5").exists()]
    assert len(set(sums)) <= 1  # the same parameters and optimizer state after 5 steps


@on_runs
def test_stats_read_back_recommend_and_heatmap(runs, tmp_path):
    out, _ = runs["on"]
    last = D.stats_from_metrics(out)
    assert last == D.read_stats(out / "metrics.jsonl")[-1]["layers"]
    assert D.stats_from_metrics(out, step=2) != last
    top = D.recommend_high_precision_layers(last, budget=0.25)
    assert len(top) == 3 and top[0] == max(last, key=lambda n: last[n]["wgrad"]["rel_error"])
    with pytest.raises(ValueError, match="at step 3 .*--stats-every"):
        D.stats_from_metrics(out, step=3)
    with pytest.raises(ValueError, match="no per-layer stats record"):
        D.stats_from_metrics(runs["off"][0])

    spec = importlib.util.spec_from_file_location("stats_heatmap",
                                                  ROOT / "experiments" / "stats_heatmap.py")
    hm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hm)
    layers, steps, values = hm.stat_matrix(out, "wgrad.rel_err")
    assert steps == [0, 2, 4] and layers[0] == "block_0/q" and len(layers) == 12
    assert values[0][-1] == last["block_0/q"]["wgrad"]["rel_error"]
    png = tmp_path / "heat.png"
    assert hm.main([str(out), "--stat", "dgrad.lhs.underflow", "--log", "--out", str(png)]) == 0
    assert png.stat().st_size > 1000
    assert hm.main([str(out), "--stat", "wgrad.nope"]) == 2


def test_stats_every_rejects_negative_values(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        T.main(["--stats-every", "-1", "--out", str(tmp_path / "r"), "--no-progress",
                "--compile-cache", "off"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "fp4jax-train: error: argument --stats-every: must be an integer >= 0, got -1"
    with pytest.raises(T.ConfigError, match=r"TrainConfig\.stats_every \(--stats-every\)"):
        T.TrainConfig(stats_every=1.5)


# -- with the flag off, the compiled step is the one from before the feature ----------------

class DotGeneral(fnn.DotGeneral):
    """``fnn.DotGeneral`` as it was before the statistics hooks (same class name: the same
    module paths, so the same stochastic-rounding keys)."""

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None):
        return fnn.fp4_dot_general(lhs, rhs, dimension_numbers, precision,
                                   preferred_element_type, out_sharding, recipe=self.recipe,
                                   key=self._key(), rht_key=self._rht_key())


def _train_step_hlo(cfg: T.TrainConfig) -> str:
    rcfg, recipe = run_recipe(cfg)
    mc = model_config(rcfg)
    model = quantized_llama(mc, make_policy(rcfg, mc, recipe))
    tx = make_optimizer(cfg)
    state = jax.eval_shape(loop.make_init_state(model, tx, cfg), jax.random.key(0))
    step = loop.make_train_step(model, tx, None, loop.make_mesh(1))
    batch = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len + 1), jnp.int32)
    return step.lower(state, batch, jax.random.key(1)).as_text()


@pytest.mark.parametrize("kw", [dict(scan_layers=False, last_bf16=1),
                                dict(recipe="nvfp4(wgrad.hadamard_signs=layer)")])
def test_train_step_without_stats_is_unchanged(kw, monkeypatch):
    cfg = T.TrainConfig(**{**BASE, **kw})
    now = _train_step_hlo(cfg)
    monkeypatch.setattr(fnn, "DotGeneral", DotGeneral)
    assert _train_step_hlo(cfg) == now


@pytest.mark.xdist_group("micro_scan_nvfp4")
def test_xdist_group_is_in_the_node_id(request):
    """Under ``--dist loadgroup`` the group is in the node id (``@micro_scan_nvfp4``), which
    is what sends this group's tests to one worker (with pytest 9.2 pytest-xdist 3.8 lost
    it silently; tests/conftest.py puts it back)."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not under --dist loadgroup")
    assert request.node.nodeid.endswith("@micro_scan_nvfp4"), request.node.nodeid
