"""fp4jax.ragged_dot (grouped GEMMs): every expert is its own fp4jax.dot, bit for bit, and
an independent NumPy rebuild of one expert's three GEMMs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import recipes
from fp4jax.numerics import uniform_rows
from fp4jax.quantized_dot import operand_key
from fp4jax.quantized_ragged_dot import ragged_row_multiple
from tests import reference as ref
from tests.checks import bits_equal

# expert 0 spans a 16-row block and a partial one, expert 1 is empty, expert 2 starts at
# row 18 (not a multiple of 4 or 16), and 4 trailing rows belong to no expert (equal sizes:
# the per-expert reference compiles once)
SIZES = (18, 0, 18)
M, K, N = 40, 40, 24


def _data(dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)) * np.exp(rng.uniform(-3, 3, (M, 1)))
    w = rng.standard_normal((len(SIZES), K, N)) * np.array([1.0, 3.0, 0.01])[:, None, None]
    dy = rng.standard_normal((M, N)) * np.exp(rng.uniform(-2, 2, (M, 1)))
    return tuple(jnp.asarray(a, dtype) for a in (x, w, dy))


@functools.cache
def _ragged(recipe):
    @jax.jit
    def f(x, w, dy, sizes, key, rht_key):
        y, vjp = jax.vjp(lambda a, b: fp4jax.ragged_dot(a, b, sizes, recipe=recipe, key=key,
                                                        rht_key=rht_key), x, w)
        return (y, *vjp(dy))
    return f


def _per_expert(recipe, sizes):
    """fp4jax.dot on each expert's slice with fold_in(key, g): the definition (None for an
    empty expert, checked to be zero)."""
    def f(x, w, dy, key, rht_key):
        out, o = [], 0
        for g, m in enumerate(sizes):
            if m == 0:
                out.append(None)
                continue
            kg, rg = jax.random.fold_in(key, g), jax.random.fold_in(rht_key, g)
            y, vjp = jax.vjp(lambda a, b, kg=kg, rg=rg: fp4jax.dot(
                a, b, recipe=recipe, key=kg, rht_key=rg), x[o:o + m], w[g])
            out.append((y, *vjp(dy[o:o + m])))
            o += m
        return out
    return f


RECIPES = {
    # NVFP4: SR on dy, 16-point RHT on wgrad (its signs drawn per expert from the layer
    # key), 16x16 weight tiles (the default recipe's fixed signs: the NumPy test below)
    "nvfp4-layer-rht": recipes.nvfp4().replace(**{"wgrad.hadamard_signs": "layer"}),
    "mxfp4": recipes.mxfp4(),  # blocks of 32, 32x32 weights, 32-point RHT
    "bf16": recipes.bf16(),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_ragged_dot_is_per_expert_dot_bit_for_bit(name):
    """Forward rows, dx rows and dw[g] equal fp4jax.dot on each expert's rows and weight
    with key fold_in(key, g) (and rht_key fold_in(rht_key, g)), bit for bit; the trailing
    rows are zero (y and dx) and the empty expert's dw is zero."""
    recipe = RECIPES[name]
    dtype = jnp.bfloat16 if name == "bf16" else jnp.float32
    x, w, dy = _data(dtype)
    key, rht_key = jax.random.key(11), jax.random.key(12)
    y, dx, dw = _ragged(recipe)(x, w, dy, jnp.asarray(SIZES, jnp.int32), key, rht_key)
    want = _per_expert(recipe, SIZES)(x, w, dy, key, rht_key)
    S = sum(SIZES)
    bits_equal(y[:S], jnp.concatenate([o[0] for o in want if o]))
    bits_equal(dx[:S], jnp.concatenate([o[1] for o in want if o]))
    for g in (0, 2):
        bits_equal(dw[g], want[g][2])
    assert not np.any(np.asarray(y[S:], np.float32)) and not np.any(np.asarray(dx[S:],
                                                                             np.float32))
    assert not np.any(np.asarray(dw[1], np.float32))  # the empty expert
    assert y.dtype == dx.dtype == dw.dtype == dtype


def test_ragged_dot_unquantized_float32_up_to_accumulation_order():
    """The bf16 recipe on float32 tensors (float32 GEMMs): equal to the per-expert dot up to
    float32 accumulation order (XLA's ragged contraction sums in its own order)."""
    x, w, dy = _data(jnp.float32)
    r = recipes.bf16()
    key = jax.random.key(0)
    y, dx, dw = _ragged(r)(x, w, dy, jnp.asarray(SIZES, jnp.int32), key, key)
    want = _per_expert(r, SIZES)(x, w, dy, key, key)
    S = sum(SIZES)
    np.testing.assert_allclose(y[:S], jnp.concatenate([o[0] for o in want if o]),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx[:S], jnp.concatenate([o[1] for o in want if o]),
                               rtol=1e-5, atol=1e-5)
    for g in (0, 2):
        np.testing.assert_allclose(dw[g], want[g][2], rtol=1e-5, atol=1e-5)


def test_ragged_dot_nvfp4_one_expert_against_numpy():
    """Expert 2 (rows 18..35) of the NVFP4 recipe rebuilt in NumPy from its own slice: its
    own tensor amaxes, 16x16 weight tiles, SR on dy with the uniforms of its own key at its
    own row positions (tests/reference.py, written from the documented rule), TE's 16-point
    RHT along its own 18 tokens zero-padded to 32."""
    r = recipes.nvfp4()
    x, w, dy = _data()
    key = jax.random.key(11)
    y, dx, dw = _ragged(r)(x, w, dy, jnp.asarray(SIZES, jnp.int32), key, key)
    g, o, m = 2, 18, 18
    xg, wg, dyg = (np.asarray(a, np.float32) for a in (x[o:o + m], w[g], dy[o:o + m]))
    kg = jax.random.fold_in(key, g)

    def words(gemm, which):
        return tuple(int(v) for v in jax.random.key_data(operand_key(kg, gemm, which)))

    wq = ref.np_fake_quant(wg, -1, block_2d=True)
    want_y = ref.np_fake_quant(xg, -1) @ wq
    want_dx = ref.np_fake_quant(dyg, -1, sr=words("dgrad", "lhs")) @ wq.T
    want_dw = (ref.np_fake_quant(ref.np_rht_rows(xg), 0).T
               @ ref.np_fake_quant(ref.np_rht_rows(dyg), 0, sr=words("wgrad", "rhs")))
    np.testing.assert_allclose(y[o:o + m], want_y, rtol=2e-6, atol=1e-6 * np.abs(want_y).max())
    np.testing.assert_allclose(dx[o:o + m], want_dx, rtol=2e-6,
                               atol=1e-6 * np.abs(want_dx).max())
    np.testing.assert_allclose(dw[g], want_dw, rtol=2e-6, atol=1e-6 * np.abs(want_dw).max())
    # one shared tensor scale (all experts' rows together) would give other values
    shared = ref.np_fake_quant(np.asarray(x[:sum(SIZES)]), -1)[o:o + m] @ wq
    assert np.abs(shared - want_y).max() > 1e-3 * np.abs(want_y).max()


def test_ragged_dot_expert_scales_are_independent():
    """Per-expert tensor scales: scaling expert 0's rows (by a non-power of two) changes
    neither expert 2's outputs nor its gradients, bit for bit."""
    r = recipes.nvfp4()
    x, w, dy = _data()
    key = jax.random.key(11)
    sizes = jnp.asarray(SIZES, jnp.int32)
    base = _ragged(r)(x, w, dy, sizes, key, key)
    x2 = x.at[:18].multiply(1000.3)
    new = _ragged(r)(x2, w, dy, sizes, key, key)
    bits_equal(new[0][18:36], base[0][18:36])
    bits_equal(new[1][18:36], base[1][18:36])
    bits_equal(new[2][2], base[2][2])
    assert not np.array_equal(np.asarray(new[2][0]), np.asarray(base[2][0]))


def test_uniform_rows_is_the_documented_rule():
    """numerics.uniform_rows (per-row keys, rows at their own positions) against the NumPy
    transcription of uniform_from_key's rule (tests/reference.py)."""
    keys = [jax.random.key(3), jax.random.key(4)]
    kw = np.stack([np.asarray(jax.random.key_data(k)) for k in keys])
    rows = np.array([0, 1, 2, 3, 5, 9, 6, 0])
    which = np.array([0, 0, 1, 1, 0, 1, 1, 1])
    got = np.asarray(uniform_rows(jnp.asarray(kw[which]), jnp.asarray(rows), 7))
    for i, (k, n) in enumerate(zip(which, rows, strict=True)):
        want = ref.ref_sr_uniform(int(kw[k, 0]), int(kw[k, 1]), (n + 1, 7))[n]
        np.testing.assert_array_equal(got[i], want)


def test_ragged_row_multiple():
    assert ragged_row_multiple(recipes.nvfp4()) == 16
    assert ragged_row_multiple(recipes.mxfp4()) == 32
    assert ragged_row_multiple(recipes.bf16()) == 1
    assert ragged_row_multiple(recipes.fp4_all_the_way()) == 16


def test_ragged_dot_errors():
    x, w = jnp.ones((8, 16)), jnp.ones((2, 16, 4))
    gs = jnp.asarray([3, 5], jnp.int32)
    with pytest.raises(ValueError, match="lhs must be"):
        fp4jax.ragged_dot(x[0], w, gs, recipe="bf16")
    with pytest.raises(ValueError, match="contraction sizes"):
        fp4jax.ragged_dot(x, w[:, :8], gs, recipe="bf16")
    with pytest.raises(ValueError, match="group_sizes must be"):
        fp4jax.ragged_dot(x, w, jnp.asarray([3.0, 5.0]), recipe="bf16")
    with pytest.raises(ValueError, match="group_sizes must be"):
        fp4jax.ragged_dot(x, w, jnp.asarray([3, 2, 3]), recipe="bf16")
    with pytest.raises(ValueError, match="XLA only"):
        fp4jax.ragged_dot(x, w, gs, recipe="bf16", implementation="pallas")
    with pytest.raises(ValueError, match="'max' rule"):
        fp4jax.ragged_dot(x, w, gs, recipe="quartet2", key=jax.random.key(0))
    with pytest.raises(ValueError, match="pass key="):
        fp4jax.ragged_dot(x, w, gs, recipe="nvfp4")
    with pytest.raises(ValueError, match="threefry"):
        fp4jax.ragged_dot(x, w, gs, recipe="nvfp4", key=jax.random.key(0, impl="rbg"))


def test_ragged_dot_data_parallel_is_each_devices_own_call(mesh):
    """Inside fp4jax.sharding.data_parallel (shard_map over 4 devices, each with its own
    rows and group sizes): each device's output is the bits of ragged_dot on its rows alone
    with the key folded with its index (its own amaxes; stochastic rounding on x here, so
    the keys show). The backward runs the same operands (tested above)."""
    from jax.sharding import PartitionSpec as P

    from fp4jax import sharding

    n, m = 4, 12
    r = recipes.nvfp4().replace(**{"fprop.lhs.rounding": "stochastic"})
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((n * m, 32)) * np.exp(rng.uniform(-3, 3, (n * m, 1))),
                    jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 32, 16)), jnp.float32)
    sizes = jnp.asarray([[5, 0, 7], [12, 0, 0], [1, 2, 3], [0, 9, 3]], jnp.int32)
    key = jax.random.key(3)

    def local(x, gs):
        with sharding.data_parallel("data"):
            return fp4jax.ragged_dot(x, w, gs[0], recipe=r, key=key)

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data")),
                              out_specs=P("data"), check_vma=False))
    y = f(x, sizes)
    one = jax.jit(lambda x, gs, k: fp4jax.ragged_dot(x, w, gs, recipe=r, key=k))
    for i in range(n):
        rows = slice(i * m, (i + 1) * m)
        bits_equal(y[rows], one(x[rows], sizes[i], jax.random.fold_in(key, i)))
    assert not np.array_equal(np.asarray(y[:m]), np.asarray(one(x[:m], sizes[0], key)))
