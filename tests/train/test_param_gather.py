"""FSDP parameter all-gather in FP4 (``--fp4-param-gather``, issue 37 item 1) on 4 virtual
CPU devices.

* ``fp4jax.sharding.fp4_all_gather``: the representative weight it rebuilds from the
  gathered codes and tile amaxes quantizes (the recipe's 2D weight quantization,
  ``fp4jax.quantize``) to the bits of the plain gather's weight: codes, block scales and
  tensor scale, on weights whose tiles span ten decades (subnormal and zero E4M3 scales),
  zero and -0 tiles, rows or columns or stacked layers split over 2 or 4 devices, NVFP4
  and MXFP4, bfloat16 and float32 compute; the plain dequantized weight would not;
* the loss and every gradient of a one-layer ``fp4jax.dot`` model through
  ``parallel.sharded_value_and_grad`` with the FP4 gather are the plain gather's, bit for
  bit, over fsdp 2 and 4;
* the compiled HLO: a planned weight's one all-gather carries bytes (its packed codes and
  tile amaxes), no float32 weight; their count;
* the plan and the refusals: which recipes, shards and layers fall back to the plain
  gather and why; bad configurations raise naming the flag.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fp4jax  # noqa: E402
from fp4jax import recipes as R  # noqa: E402
from fp4jax import sharding  # noqa: E402
from fp4jax.train import parallel  # noqa: E402
from tests.checks import bits_equal  # noqa: E402
from tests.textdata import write_text  # noqa: E402


def _wild(shape, seed=0):
    """A weight whose 16x16 tiles span ten decades (E4M3 block scales normal, subnormal and
    zero), with a zero tile, a -0 tile and a tile 1e-6 below its neighbours."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    r, c = shape[-2:]
    mag = 10.0 ** rng.uniform(-9, 1, size=shape[:-2] + (r // 16, c // 16))
    w *= np.repeat(np.repeat(mag, 16, -2), 16, -1).astype(np.float32)
    w[..., :16, :16] = 0.0
    w[..., 16:32, :16] = -0.0
    w[..., 32:48, 16:32] *= np.float32(1e-6)
    return jnp.asarray(w)


def _q_bits(w, fmt, dtype):
    """Per matrix of ``w`` (..., R, C): the 2D quantization of ``w.astype(dtype)`` that the
    dot makes, as (codes as float, scales as float, tensor scale)."""
    mats = w.astype(dtype).reshape((-1,) + w.shape[-2:])
    out = []
    for m in mats:
        q = fp4jax.quantize(m, fmt, block_2d=True)
        out.append((np.asarray(q.data.astype(jnp.float32)),
                    np.asarray(q.scale.astype(jnp.float32)), np.asarray(q.global_scale)))
    return out


def _gather_fn(mesh, axis, ndim, fmt, dtype):
    spec = P(*([None] * axis + ["fsdp"] + [None] * (ndim - axis - 1)))
    f = jax.jit(jax.shard_map(
        lambda x: sharding.fp4_all_gather(x, "fsdp", axis, fmt, dtype), mesh=mesh,
        in_specs=spec, out_specs=P(), check_vma=False))
    return f, NamedSharding(mesh, spec)


@pytest.mark.parametrize("n,shape,axis,fmt,dtype", [
    (2, (128, 64), 0, fp4jax.NVFP4, jnp.bfloat16),   # rows split
    (4, (64, 128), 1, fp4jax.NVFP4, jnp.bfloat16),   # columns split
    (4, (4, 64, 32), 0, fp4jax.NVFP4, jnp.float32),  # a scanned stack split by layer
    (2, (2, 64, 96), 1, fp4jax.NVFP4, jnp.float32),  # a stack split along its rows
    (2, (64, 64), 0, fp4jax.MXFP4, jnp.bfloat16),    # MX FP4 (E8M0 scales, 32x32 tiles)
])
def test_gathered_weight_quantizes_to_the_plain_gathers_bits(n, shape, axis, fmt, dtype):
    mesh = parallel.make_mesh(4, fsdp=n)
    w = _wild(shape)
    f, s = _gather_fn(mesh, axis, len(shape), fmt, dtype)
    got = f(jax.device_put(w, s))
    assert got.shape == w.shape and got.dtype == w.dtype
    for (qd, qs, qg), (wd, ws, wg) in zip(_q_bits(got, fmt, dtype), _q_bits(w, fmt, dtype),
                                          strict=True):
        bits_equal(qd, wd)
        bits_equal(qs, ws)
        bits_equal(qg, wg)
    if fmt == fp4jax.NVFP4:
        # the construction matters: the plain dequantized weight requantizes to other bits
        deq = jnp.stack([fp4jax.dequantize(fp4jax.quantize(m, fmt, block_2d=True))
                         for m in w.astype(dtype).reshape((-1,) + shape[-2:])])
        naive = _q_bits(deq.reshape(shape), fmt, dtype)
        assert any(not (np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]))
                   for a, b in zip(naive, _q_bits(w, fmt, dtype), strict=True))


# ---------------------------------------------------------------------------
# a two-layer model through the harness's sharded loss and gradients
# ---------------------------------------------------------------------------

# NVFP4's weight quantization (2D, round-to-nearest) with RtN activations and no RHT: the
# gather concerns only the weight; the lighter recipe compiles in half the time on the CPU
RECIPE = R.nvfp4().replace(sr=False, rht=0)


def _loss(p, x, key):
    bf = jnp.bfloat16
    y = fp4jax.dot((x * p["g"]).astype(bf), p["w"].astype(bf), recipe=RECIPE, key=key)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


@functools.cache
def _model(n_fsdp, fp4):
    """The compiled ``sharded_value_and_grad`` of ``_loss`` over a (4 / n_fsdp, n_fsdp) mesh,
    the FP4 gather on or off, and its arguments (compiled once per session)."""
    mesh = parallel.make_mesh(4, fsdp=n_fsdp)
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w": 0.2 * jax.random.normal(k[0], (64, 32)),
              "g": 1.0 + jax.random.normal(k[2], (64,))}
    specs = parallel.state_specs(params, mesh)
    plan = None
    if fp4:
        layers = {"w": (RECIPE, (64, 32), None)}
        plan, notes = parallel.fp4_gather_plan(params, specs, mesh, layers, "bfloat16")
        assert notes == {"w": None}
    params = jax.device_put(params, parallel.shardings(specs, mesh))
    x = jax.device_put(jax.random.normal(jax.random.key(1), (64, 64)),
                       NamedSharding(mesh, parallel.BATCH))
    args = (params, x, jax.random.key(2))
    f = jax.jit(parallel.sharded_value_and_grad(_loss, specs, mesh, plan))
    return f.lower(*args).compile(), args


@pytest.mark.parametrize("n_fsdp", [2, 4])
def test_loss_and_gradients_bit_identical_to_the_plain_gather(n_fsdp):
    (f0, args), (f1, _) = _model(n_fsdp, False), _model(n_fsdp, True)
    (l0, g0), (l1, g1) = f0(*args), f1(*args)
    bits_equal(l1, l0)
    for name in ("w", "g"):
        bits_equal(g1[name], g0[name])
    assert float(jnp.abs(g0["w"]).max()) > 0  # gradients that flow


def _all_gathers(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every array an all-gather of the HLO module returns (a combined
    all-gather returns a tuple)."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*(\(.*?\)|\S+)\s+all-gather(?:-start)?\(", line)
        if m:
            for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
                out.append((dt, tuple(int(d) for d in dims.split(",") if d)))
    return out


def _bytes(arrays):
    size = {"u8": 1, "bf16": 2, "f32": 4}
    return sum(size[dt] * int(np.prod(s)) for dt, s in arrays)


def test_compiled_all_gathers_carry_fp4_codes_not_float_weights():
    plain = _all_gathers(_model(4, False)[0].as_text())
    fp4 = _all_gathers(_model(4, True)[0].as_text())
    # the plain gather moves the float32 master weights
    assert sorted(plain) == [("f32", (64,)), ("f32", (64, 32))], plain
    # the FP4 gather: one all-gather of bytes a weight, each device's packed codes (two a
    # byte: 16 x 16) and its bf16 amax per 16x16 tile (1 x 2 tiles, 4 bytes); no float
    # weight; the norm scale g (not a dot weight) keeps its float32 gather
    assert sorted(fp4) == [("f32", (64,)), ("u8", (4, 16 * 16 + 4))], fp4
    weights_plain = _bytes([a for a in plain if len(a[1]) == 2])
    weights_fp4 = _bytes([a for a in fp4 if len(a[1]) == 2])
    assert weights_plain == 4 * 64 * 32
    assert weights_fp4 == 64 * 32 // 2 + 2 * 8
    assert weights_plain / weights_fp4 > 7.8  # 32 bits an element against 4 + 1/16


# ---------------------------------------------------------------------------
# the plan, the reasons, the refusals
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("recipe,why", [
    (R.nvfp4(), None),
    (R.nvfp4().replace(sr=False, rht=0), None),
    (R.mxfp4(), None),  # 2D 32x32 tiles, E8M0 scales
    (None, "high precision"),
    (R.bf16(), "keeps the forward weight in high precision"),
    (R.fp4_all_the_way(), "1D blocks"),
    (R.nvfp4().replace(**{"fprop.rhs.block_scale_rule": "4over6",
                         "dgrad.rhs.block_scale_rule": "4over6"}), "4over6"),
    (R.nvfp4_fwd_only(), "dgrad weight"),
    (R.nvfp4().replace(**{"fprop.rhs.rounding": "stochastic"}), "stochastic"),
    (R.mxfp8(), "not 4-bit E2M1"),
])
def test_which_recipes_gather_in_fp4(recipe, why):
    got = sharding.param_gather_unsupported_reason(recipe)
    if why is None:
        assert got is None
    else:
        assert got is not None and why in got, got


def test_plan_falls_back_to_the_plain_gather_with_a_reason():
    mesh = parallel.make_mesh(4, fsdp=4)
    params = {"a": jax.ShapeDtypeStruct((64, 32), jnp.float32),   # 16 rows a device
              "b": jax.ShapeDtypeStruct((96, 32), jnp.float32),   # 24 rows: tiles straddle
              "c": jax.ShapeDtypeStruct((64, 32), jnp.float32),   # high precision layer
              "d": jax.ShapeDtypeStruct((64, 32), jnp.float32),   # reshaped in its product
              "e": jax.ShapeDtypeStruct((64,), jnp.float32),      # not a weight
              "f": jax.ShapeDtypeStruct((6, 3), jnp.float32),     # kept whole (replicated)
              "h": jax.ShapeDtypeStruct((64, 3), jnp.float32)}    # whole tiles a device
    layers = {"a": (RECIPE, (64, 32), None), "b": (RECIPE, (96, 32), None),
              "c": (None, (64, 32), None), "d": (RECIPE, (2048,), None),
              "f": (RECIPE, (6, 3), None), "h": (RECIPE, (64, 3), None)}
    specs = parallel.state_specs(params, mesh)
    plan, notes = parallel.fp4_gather_plan(params, specs, mesh, layers, "bfloat16")
    assert plan["a"] == plan["h"] == parallel.FP4Gather(fp4jax.NVFP4, "bfloat16")
    assert plan["b"] is plan["c"] is plan["d"] is plan["e"] is plan["f"] is None
    assert notes["a"] is notes["h"] is None and set(notes) == {"a", "b", "c", "d", "h"}
    assert "24 rows" in notes["b"] and "straddle" in notes["b"]
    assert "high precision" in notes["c"] and "(2048,)" in notes["d"]
    line = parallel.describe_plan(notes)
    assert line.startswith("FP4 parameter gather: 2 of 5 sharded kernels") and "b:" in line


def test_llama_plan_gathers_the_nvfp4_blocks():
    from fp4jax.models.llama import get_preset, llama_rules, policy_rules, quantized_llama
    from fp4jax.nn import PrecisionPolicy
    from fp4jax.train.models import llama_weight_layers

    mc = get_preset("micro").replace(ffn="smooth_swiglu")
    policy = PrecisionPolicy(RECIPE, last_high_precision=1)
    model = quantized_llama(mc, policy)
    layers = llama_weight_layers(mc, model, llama_rules(mc, policy_rules(mc, policy)), 64)
    mesh = parallel.make_mesh(4, fsdp=2)
    x0 = jnp.zeros((1, 64), jnp.int32)
    params = jax.eval_shape(lambda: model.init({"params": jax.random.key(0)}, x0))["params"]
    plan, notes = parallel.fp4_gather_plan(params, parallel.state_specs(params, mesh), mesh,
                                           layers, mc.dtype)
    fp4 = sorted(p for p, why in notes.items() if why is None)
    assert fp4 == [f"block_0/{m}/kernel" for m in ("gate", "k", "o", "q", "up", "v")]
    assert "Smooth-SwiGLU" in notes["block_0/down/kernel"]
    assert "high precision" in notes["block_1/q/kernel"] and "high precision" in notes[
        "lm_head/kernel"]
    assert plan["block_0"]["q"]["kernel"] == parallel.FP4Gather(fp4jax.NVFP4, "bfloat16")
    assert plan["embed"]["embedding"] is None
    with pytest.raises(ValueError, match="pass the rules the model was built with"):
        llama_weight_layers(mc, model, policy_rules(mc, policy)[1:], 64)  # indices shifted


def test_moe_expert_kernels_gather_per_expert():
    # a mixture of experts' kernel (G, K, N): every expert its own fp4jax.dot, so the plan
    # takes it as a stack of (K, N) matrices; the router stays high precision
    from fp4jax.models.llama import get_preset, llama_rules, policy_rules, quantized_llama
    from fp4jax.nn import PrecisionPolicy
    from fp4jax.train.models import llama_weight_layers

    mc = get_preset("micro").replace(n_experts=4, top_k=2)
    policy = PrecisionPolicy(RECIPE, last_high_precision=1)
    model = quantized_llama(mc, policy)
    layers = llama_weight_layers(mc, model, llama_rules(mc, policy_rules(mc, policy)), 64)
    assert layers["block_0/up/kernel"][1:] == ((64, 128), None)
    mesh = parallel.make_mesh(4, fsdp=2)
    x0 = jnp.zeros((1, 64), jnp.int32)
    params = jax.eval_shape(lambda: model.init({"params": jax.random.key(0)}, x0))["params"]
    assert params["block_0"]["up"]["kernel"].shape == (4, 64, 128)
    plan, notes = parallel.fp4_gather_plan(params, parallel.state_specs(params, mesh), mesh,
                                           layers, mc.dtype)
    assert notes["block_0/up/kernel"] is None and notes["block_0/down/kernel"] is None
    assert plan["block_0"]["up"]["kernel"] == parallel.FP4Gather(fp4jax.NVFP4, "bfloat16")
    assert "high precision" in notes["block_0/router/kernel"]


def test_bad_configurations_are_refused(tmp_path):
    from fp4jax import train as T
    from fp4jax.train.config import ConfigError

    with pytest.raises(ConfigError, match="needs --fsdp 2 or more"):
        T.TrainConfig(fp4_param_gather=True)
    with pytest.raises(ConfigError, match="built-in Llama only"):
        T.TrainConfig(fp4_param_gather=True, fsdp=2, model="m:f")
    with pytest.raises(ConfigError, match="True or False"):
        T.TrainConfig(fp4_param_gather="yes", fsdp=2)
    assert "no 2D tiles" in sharding.fp4_gather_shard_reason((64,), 0, 2, 16)
    # a run none of whose weights the FP4 gather can take (its recipe's): refused by the
    # config, before data, devices or compiling
    text = write_text(tmp_path / "corpus.txt", 20_000)
    with pytest.raises(ConfigError, match=r"keeps the forward weight in high precision: no "
                       r"weight of the run would be gathered in FP4; drop --fp4-param-gather"):
        T.TrainConfig(preset="micro", recipe="bf16", steps=1, batch_size=8, seq_len=64,
                      eval_every=0, devices=4, fsdp=2, fp4_param_gather=True,
                      data=str(text), out=str(tmp_path / "run"), progress=False)
    assert not (tmp_path / "run").exists()
