"""Data-parallel ``fp4jax.dot`` in ``jax.shard_map`` (``fp4jax.sharding``) against one
device, on the 4 virtual CPU devices of tests/conftest.py: the XLA path here, the Pallas
kernels in interpret mode in test_sharded_kernels_equal_one_device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fp4jax
from fp4jax import numerics, sharding
from tests.interpret import needs_interpret
from tests.kernel_inputs import shard_gemm_operands


def _one_and_sharded(mesh, recipe, x, w, g, key, use_context=True, one_device=True):
    """(y, dx, dw) on one device and with x, dy split over the mesh (dw summed in f32);
    ``one_device=False``: the one-device result is not computed (None), for a sharded call
    that must be refused (its compile would be wasted)."""

    def fb(x, w, g):
        y, vjp = jax.vjp(lambda x, w: fp4jax.dot(x, w, recipe=recipe, key=key), x, w)
        return (y, *vjp(g))

    one = jax.jit(fb)(x, w, g) if one_device else None

    def local(x, w, g):
        if use_context:
            with sharding.data_parallel("data"):
                y, dx, dw = fb(x, w, g)
        else:
            y, dx, dw = fb(x, w, g)
        return y, dx, jax.lax.psum(dw.astype(jnp.float32), "data")

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                              out_specs=(P("data"), P("data"), P()), check_vma=False))
    return one, f(x, w, g)


def _check(one, sharded, dw_rtol):
    (y1, dx1, dw1), (y2, dx2, dw2) = one, sharded
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y1))  # bit for bit
    np.testing.assert_array_equal(np.asarray(dx2), np.asarray(dx1))
    dw1 = np.asarray(dw1, np.float32)
    err = np.abs(np.asarray(dw2) - dw1).max() / np.abs(dw1).max()
    assert err <= dw_rtol, err


@pytest.mark.parametrize("name", ["nvfp4", "fp4_all_the_way", "mxfp4"])
def test_sharded_dot_equals_one_device(mesh, name):
    # float32 w: dw is the f32 GEMM output, so sharded and single-device dw differ only in
    # the f32 summation order over tokens; y and dx are the same bits (global amaxes, and
    # stochastic-rounding draws at each row's place in the whole tensor).
    recipe = fp4jax.recipes.get(name)
    x, w, g = shard_gemm_operands(256, 256, 128)
    one, sharded = _one_and_sharded(mesh, recipe, x, w, g, jax.random.key(3))
    _check(one, sharded, dw_rtol=1e-6)


def test_blocks_and_rht_along_tokens_must_not_straddle_devices(mesh):
    # mxfp4's 32x1 wgrad blocks and a 32-point RHT need 32 rows per device: 16 would be
    # zero-padded per device (dw off by ~20%), so it is refused; 32 gives the single-device
    # bits
    from fp4jax.quantized_dot import token_row_multiple

    rht32 = fp4jax.recipes.nvfp4().replace(rht=32)

    assert token_row_multiple(fp4jax.recipes.nvfp4()) == 16
    assert token_row_multiple(fp4jax.recipes.mxfp4()) == 32
    assert token_row_multiple(rht32) == 32
    for recipe in (fp4jax.recipes.mxfp4(), rht32):
        x, w, g = shard_gemm_operands(64, 64, 32)  # 16 rows per device
        with pytest.raises(ValueError, match="needs a multiple of 32"):
            _one_and_sharded(mesh, recipe, x, w, g, jax.random.key(3), one_device=False)
        x, w, g = shard_gemm_operands(128, 64, 32)  # 32 rows per device
        one, sharded = _one_and_sharded(mesh, recipe, x, w, g, jax.random.key(3))
        _check(one, sharded, dw_rtol=1e-6)


def test_without_the_context_shards_quantize_apart(mesh):
    # the same shard_map without data_parallel quantizes each shard with its own amax and
    # draws: not the single-device bits (what the context exists to fix)
    x, w, g = shard_gemm_operands(256, 256, 128)
    (y1, dx1, _), (y2, dx2, _) = _one_and_sharded(mesh, fp4jax.recipes.nvfp4(), x, w, g,
                                                  jax.random.key(3), use_context=False)
    assert not np.array_equal(np.asarray(y1), np.asarray(y2))
    assert not np.array_equal(np.asarray(dx1), np.asarray(dx2))


def test_row_shard_draw_offset_matches_whole_tensor():
    key = jax.random.key(11)
    # jitted, as the quantizers call it (integer draws: the same bits as eager), one
    # program a shape instead of ~20 eager ops' programs a shape and offset
    uniform = jax.jit(numerics.uniform_from_key, static_argnums=1)
    for shape, n in (((64, 48), 4), ((1, 32, 33), 2), ((16, 2, 7), 8)):
        whole = np.asarray(uniform(key, (n * shape[0], *shape[1:])))
        rows = int(np.prod(shape[:-1]))
        for i in range(n):
            part = uniform(key, shape, numerics.row_shard_draw_offset(shape, i))
            np.testing.assert_array_equal(
                np.asarray(part).reshape(rows, -1),
                whole.reshape(n * rows, -1)[i * rows:(i + 1) * rows])
    with pytest.raises(ValueError, match="multiple of 4 rows"):
        numerics.row_shard_draw_offset((6, 16), 1)
    numerics.row_shard_draw_offset((4, 2**20), 0, n_shards=2**12)  # 2**31 draws in all
    with pytest.raises(ValueError, match="2\\*\\*32"):  # the counters would wrap
        numerics.row_shard_draw_offset((4, 2**20), 0, n_shards=2**13)
    with pytest.raises(ValueError, match="threefry key"):
        numerics.draws_from_key(jax.random.key(0, impl="rbg"), 8, jnp.uint32(4))


def test_data_parallel_errors(mesh):
    x, w, _ = shard_gemm_operands(64, 64, 32)
    with sharding.data_parallel("data"), pytest.raises(ValueError, match="not traced inside"):
        jax.jit(lambda x, w: fp4jax.dot(x, w, key=jax.random.key(0)))(x, w)
    with pytest.raises(TypeError, match="axis_name"):
        with sharding.data_parallel(3):
            pass

    def run(f, x, spec=None):
        spec = P("data") if spec is None else spec
        sm = jax.shard_map(f, mesh=mesh, in_specs=(spec, P()), out_specs=spec,
                           check_vma=False)
        return jax.jit(sm)(x, w)

    def dp(x, w):
        with sharding.data_parallel("data"):
            return fp4jax.dot(x, w, key=jax.random.key(0))

    with pytest.raises(ValueError, match="multiple of 16"):
        run(dp, x[:40])  # 10 rows per device
    xb = jnp.stack([x, x])  # batch dims: x (2, 64, 64) @ w (2, 64, 32)

    def dpb(x, w):
        with sharding.data_parallel("data"):
            return fp4jax.dot_general(x, jnp.stack([w, w]), (((2,), (1,)), ((0,), (0,))),
                                      key=jax.random.key(0))

    with pytest.raises(ValueError, match="batch dimensions"):
        run(dpb, xb, P(None, "data"))
    # the BF16 recipe quantizes nothing: no constraint on the rows
    y = run(lambda x, w: fp4jax.dot(x, w, recipe="bf16"), x[:40])
    assert y.shape == (40, 32)
    assert sharding.data_axis() is None


@needs_interpret
@pytest.mark.parametrize("kind", ["rows", "cols", "cols_rht"])
def test_kernels_quantize_a_row_shard_as_the_whole_tensor(kind):
    # What data-parallel dot asks of the fused operand kernels (dot_sm90.make_operands with
    # a RowShard): each device's rows, given the whole tensor's amax and the first draw of its
    # rows, are the whole tensor's operand rows, bit for bit, with stochastic rounding.
    # (The kernels inside jax.shard_map itself ran on two GPUs: experiments/gpu_check.py
    # sharded; Mosaic GPU's interpret mode does not run under a multi-device shard_map.)
    from pallas_kernels.quantize import operand_sm90 as fq
    from pallas_kernels.quantize.common_sm90 import finite_amax
    from tests.interpret import InterpretGPUParams

    ip = InterpretGPUParams()
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((64, 1024)) * 3, jnp.bfloat16)
    x = x.at[50, 9].set(90.0)  # the amax on the second shard
    key = jax.random.key(9)
    signs = (jnp.asarray(np.where(rng.random(16) < 0.5, -1.0, 1.0), jnp.float32)
             if kind == "cols_rht" else None)
    if kind == "rows":
        def quant(m, **kw):
            return fq.fq_rows(m, key, interpret=ip, **kw)
        amax = finite_amax(x)
    else:
        def quant(m, **kw):
            return fq.fq_cols(m, key, signs=signs, interpret=ip, **kw)
        amax = (fq.rht_cols_amax(x, signs, interpret=ip) if signs is not None
                else finite_amax(x))
    whole, dec = quant(x)
    parts = [quant(x[32 * i:32 * (i + 1)], amax=amax,
                   offset=numerics.row_shard_draw_offset((32, 1024), i)) for i in range(2)]
    got = jnp.concatenate([p[0] for p in parts])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(whole, np.float32))
    assert all(float(p[1]) == float(dec) for p in parts)
    # the offset matters: shard 1 drawn from 0 is not the whole tensor's rows
    alone, _ = quant(x[32:], amax=amax)
    assert not np.array_equal(np.asarray(alone, np.float32), np.asarray(whole[32:], np.float32))
