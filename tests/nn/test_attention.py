"""The Llama's attention choice (``attention="auto"``, the default) and cuDNN's fused
attention under the harness's multi-device steps, on the CPU.

* ``"auto"`` is XLA's attention on the CPU, bit for bit (cuDNN only on NVIDIA GPUs);
* the evaluation step over an ``fsdp`` mesh (4 virtual devices, ``--fsdp 2``) runs the
  attention inside ``jax.shard_map`` on each device's sequences, and lowered for CUDA (the
  cuDNN version checks stubbed: no GPU here) it calls cuDNN's fused attention directly,
  without the custom partitioner whose "Query, key and value should have same sharding"
  stopped ``--attention cudnn --fsdp 2``; the same attention under a plain ``jit`` over
  sharded inputs goes through that partitioner (what the check would catch).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fp4jax  # noqa: E402
from fp4jax import sharding  # noqa: E402
from fp4jax.models import llama  # noqa: E402
from fp4jax.nn import PrecisionPolicy  # noqa: E402
from fp4jax.train import loop, parallel  # noqa: E402

CFG = llama.LlamaConfig(d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=128,
                        max_seq_len=32)


def _qkv(b=2, t=16):
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, t, 4, 16)).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, t, 2, 16)).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, 2, 16)).astype(jnp.bfloat16)
    return q, k, v


def test_auto_is_xla_on_the_cpu():
    assert llama.LlamaConfig().attention == "auto"
    assert llama.resolve_attention("auto") == "xla" and not llama.on_nvidia_gpu()
    assert llama.resolve_attention("cudnn") == "cudnn"
    with pytest.raises(ValueError, match="attention must be one of"):
        llama.resolve_attention("flash")
    q, k, v = _qkv()
    np.testing.assert_array_equal(
        np.asarray(llama.causal_attention(q, k, v, "auto"), np.float32),
        np.asarray(llama.causal_attention(q, k, v, "xla"), np.float32))


@pytest.fixture
def stub_cudnn(monkeypatch):
    """cuDNN's trace-time checks answer as on an H100 with cuDNN 9.10 (the lowering is
    for CUDA; nothing runs)."""
    fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    monkeypatch.setattr(fa, "check_cudnn_version", lambda *a, **k: 91000)
    monkeypatch.setattr(fa, "check_compute_capability", lambda *a, **k: True)
    monkeypatch.setattr(llama, "on_nvidia_gpu", lambda: True)


def _targets(text: str) -> set[str]:
    return set(re.findall(r"custom_call @([\w$.]+)", text))


def test_auto_takes_cudnn_where_it_runs(stub_cudnn):
    q, k, v = _qkv()
    text = jax.jit(lambda q, k, v: llama.causal_attention(q, k, v, "auto")).trace(
        q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert any("fmha" in t for t in _targets(text))
    # a head size cuDNN refuses at trace time: "auto" falls back to the XLA attention
    q2, k2, v2 = (a[..., :12] for a in (q, k, v))
    text = jax.jit(lambda q, k, v: llama.causal_attention(q, k, v, "auto")).trace(
        q2, k2, v2).lower(lowering_platforms=("cuda",)).as_text()
    assert not any("fmha" in t for t in _targets(text))


def test_fsdp_eval_step_calls_cudnn_per_device(stub_cudnn, monkeypatch):
    mesh = parallel.make_mesh(4, fsdp=2)
    model = llama.quantized_llama(CFG.replace(attention="cudnn"),
                                  PrecisionPolicy(fp4jax.recipes.nvfp4()))
    batch = jnp.zeros((8, 17), jnp.int32)
    params = jax.eval_shape(
        lambda: model.init({"params": jax.random.key(0), "fp4": jax.random.key(1)},
                           batch[:, :-1]))["params"]
    specs = parallel.state_specs(params, mesh)
    assert any("fsdp" in tuple(s) for s in jax.tree.leaves(
        specs, is_leaf=lambda s: isinstance(s, P)))  # the weights are split over fsdp
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                            sharding=NamedSharding(mesh, s)),
                          params, specs)
    batch = jax.ShapeDtypeStruct(batch.shape, batch.dtype,
                                 sharding=NamedSharding(mesh, parallel.BATCH))
    seen = []
    real = llama.causal_attention

    def spy(q, k, v, impl="xla"):
        seen.append((q.shape[0], sharding.data_axis()))
        return real(q, k, v, impl)

    monkeypatch.setattr(llama, "causal_attention", spy)
    ev = loop.make_eval_step(model, None, mesh)
    text = ev.trace(params, batch, jax.random.key(2)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert seen == [(2, parallel.AXES)]  # each device's 2 of the 8 sequences
    targets = _targets(text)
    assert any("fmha" in t for t in targets) and "CustomSPMDPartitioning" not in targets

    # what the eval step did before: the attention under a plain jit over sharded inputs
    # goes through cuDNN's custom partitioner (on the GPU it refused q, k, v sharded apart)
    q, k, v = _qkv(8)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
            for a, s in ((q, parallel.BATCH), (k, P("data", None, "fsdp")),
                         (v, P("data", None, "fsdp")))]
    text = jax.jit(lambda q, k, v: real(q, k, v, "cudnn")).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "CustomSPMDPartitioning" in _targets(text)


def test_sharded_eval_equals_one_device():
    # the shard_map'd eval step gives the single-device loss (XLA attention on the CPU)
    model = llama.quantized_llama(CFG, PrecisionPolicy(fp4jax.recipes.nvfp4()))
    batch = jax.random.randint(jax.random.key(3), (8, 17), 0, 256, jnp.int32)
    params = model.init({"params": jax.random.key(0), "fp4": jax.random.key(1)},
                        batch[:, :-1])["params"]
    one = loop.make_eval_step(model, None, parallel.make_mesh(1))(params, batch,
                                                                   jax.random.key(2))
    mesh = parallel.make_mesh(4, fsdp=2)
    specs = parallel.state_specs(params, mesh)
    sharded = loop.make_eval_step(model, None, mesh)(
        jax.device_put(params, parallel.shardings(specs, mesh)),
        jax.device_put(batch, NamedSharding(mesh, parallel.BATCH)), jax.random.key(2))
    np.testing.assert_allclose(float(sharded), float(one), rtol=2e-6)
