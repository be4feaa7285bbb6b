"""``Recipe.amax_scope``: the whole batch's tensor amax (``"global"``, the default) or each
device's own (``"local"``, Transformer Engine's data-parallel semantics) inside
``fp4jax.sharding.data_parallel``, on 4 virtual CPU devices.

* ``"local"`` is its own XLA reference: each device's rows give what ``fp4jax.dot`` gives
  on those rows alone on one device (round-to-nearest recipes: no draws to place), bit for
  bit for y and dx, dw the sum of the per-shard ones;
* ``"global"`` gives the one-device bits (``tests/dot/test_sharding.py``) and ``"local"``
  differs from it where the shards' amaxes differ;
* the collectives: ``"local"`` has no amax all-reduce; ``"global"`` one per quantized
  tensor's operands on the kernel path (x: fprop rows + wgrad columns in one all-reduce;
  dy likewise), counted in the lowered HLO.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from jax.sharding import PartitionSpec as P  # noqa: E402

import fp4jax  # noqa: E402
from fp4jax import recipes as R  # noqa: E402
from fp4jax import sharding  # noqa: E402
from tests.kernel_inputs import shard_gemm_operands  # noqa: E402

N_DEV = 4



def _fb(recipe, key):
    def fb(x, w, g):
        y, vjp = jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe=recipe, key=key), x, w)
        return (y, *vjp(g))
    return fb


def _sharded(mesh, recipe, key):
    fb = _fb(recipe, key)

    def local(x, w, g):
        with sharding.data_parallel("data"):
            y, dx, dw = fb(x, w, g)
        return y, dx, jax.lax.psum(dw.astype(jnp.float32), "data")

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                                 out_specs=(P("data"), P("data"), P()), check_vma=False))


def test_local_scope_is_each_shard_alone(mesh):
    recipe = R.nvfp4().replace(sr=False, amax_scope="local")
    key = jax.random.key(3)
    x, w, g = shard_gemm_operands(128, 256, 128)
    y, dx, dw = _sharded(mesh, recipe, key)(x, w, g)
    fb = jax.jit(_fb(recipe, key))  # one device, no data_parallel: the shard is the tensor
    rows = x.shape[0] // N_DEV
    dws = []
    for i in range(N_DEV):
        s = slice(i * rows, (i + 1) * rows)
        yi, dxi, dwi = fb(x[s], w, g[s])
        np.testing.assert_array_equal(np.asarray(y[s]), np.asarray(yi))
        np.testing.assert_array_equal(np.asarray(dx[s]), np.asarray(dxi))
        dws.append(np.asarray(dwi, np.float32))
    np.testing.assert_allclose(np.asarray(dw), np.sum(dws, 0), rtol=1e-5, atol=1e-6)
    # the default scope is the whole batch's: other bits where the shards' amaxes differ
    y_g, dx_g, _ = _sharded(mesh, recipe.replace(amax_scope="global"), key)(x, w, g)
    assert not np.array_equal(np.asarray(y), np.asarray(y_g))
    assert not np.array_equal(np.asarray(dx), np.asarray(dx_g))


def test_local_scope_with_stochastic_rounding_runs(mesh):
    # SR draws stay at each row's place in the whole tensor; the result is finite and differs
    # from the global scope's
    x, w, g = shard_gemm_operands(128, 256, 128)
    key = jax.random.key(5)
    out_l = _sharded(mesh, R.nvfp4().replace(amax_scope="local"), key)(x, w, g)
    out_g = _sharded(mesh, R.nvfp4(), key)(x, w, g)
    assert all(np.isfinite(np.asarray(a, np.float32)).all() for a in out_l)
    assert not np.array_equal(np.asarray(out_l[0]), np.asarray(out_g[0]))


def _all_reduces(mesh, recipe, monkeypatch, kernels):
    monkeypatch.setenv("FP4JAX_KERNELS", kernels)
    # 32 x 256 per device: every x and dy operand has its kernel
    x, w, g = shard_gemm_operands(128, 256, 256)
    text = _sharded(mesh, recipe, jax.random.key(3)).lower(
        x, w.astype(jnp.bfloat16), g.astype(jnp.bfloat16)).as_text()  # bf16 dy: kernels
    return len(re.findall(r"stablehlo\.all_reduce|\ball-reduce\(", text))


@pytest.mark.parametrize("kernels", ["off", "interpret"])
def test_amax_collectives(mesh, monkeypatch, kernels):
    from tests.interpret import InterpretGPUParams

    if kernels == "interpret" and InterpretGPUParams is None:
        pytest.skip("no Mosaic GPU interpret mode")
    base = _all_reduces(mesh, R.bf16(), monkeypatch, kernels)  # the dw psum only
    local = _all_reduces(mesh, R.nvfp4().replace(amax_scope="local"), monkeypatch, kernels)
    glob = _all_reduces(mesh, R.nvfp4(), monkeypatch, kernels)
    assert local == base
    # XLA path: one per quantized x/dy operand (fprop x, wgrad x, dgrad dy, wgrad dy);
    # kernel path: one per tensor (x's two operands together, dy's two together)
    assert glob - base == (4 if kernels == "off" else 2), (base, local, glob)
