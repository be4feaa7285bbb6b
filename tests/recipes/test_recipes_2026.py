"""The 2026 recipe knobs of issue 37 item 4, each against an independent NumPy reference:
the deterministic (unsigned) Hadamard (``hadamard_signs="ones"``, AMD arXiv 2605.09825)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax.hadamard import random_hadamard_transform, unsigned_signs
from pallas_kernels import dispatch, dot_sm90
from tests.reference import ref_fwht_f32, ref_hadamard

# --------------------------------------------------------------------------------------
# 1. The deterministic (unsigned) Hadamard: hadamard_signs="ones"
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [16, 32])
def test_unsigned_hadamard_is_sylvester_matrix(size):
    """``signs="ones"`` rotates each tile by ``H / sqrt(n)`` itself: bit for bit the NumPy
    float32 butterfly, and within float32 rounding of the Walsh-formula matrix product."""
    assert np.array_equal(unsigned_signs(size), np.ones(size, np.float32))
    x = np.asarray(jax.random.normal(jax.random.key(0), (3 * size, 5)), np.float32)
    got = np.asarray(random_hadamard_transform(x, axis=0, size=size, signs="ones"))
    tiles = np.moveaxis(x.reshape(3, size, 5), 1, -1)  # (3, 5, size): the rotated axis last
    want = np.moveaxis(ref_fwht_f32(tiles, size).reshape(3, 5, size), -1, 1).reshape(x.shape)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    mat = np.einsum("tij,ik->tkj", x.reshape(3, size, 5).astype(np.float64), ref_hadamard(size))
    np.testing.assert_allclose(got, mat.reshape(x.shape), rtol=0, atol=1e-5)
    te = np.asarray(random_hadamard_transform(x, axis=0, size=size))  # TE's signs differ
    assert not np.array_equal(got, te)


def _dw(recipe):
    x = jax.random.normal(jax.random.key(1), (64, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (32, 16), jnp.float32)
    f = jax.grad(lambda w: jnp.sum(jnp.sin(fp4jax.dot(x, w, recipe=recipe))))
    return np.asarray(jax.jit(f)(w))


# only Wgrad quantized (NVFP4, RtN): the cheapest recipe whose result depends on the signs
_WGRAD = "bf16(wgrad.hadamard=16, wgrad.lhs.fmt=nvfp4, wgrad.rhs.fmt=nvfp4, {})"


def test_ones_policy_in_a_recipe_is_the_all_ones_tuple():
    """``wgrad.hadamard_signs=ones`` is the recipe with the sign vector spelled out as a
    tuple of +1 (the tuple path is the one tested against the NumPy RHT), needs no key,
    and round-trips through the spec string."""
    r = fp4jax.recipes.parse("mxfp4(sr=False, wgrad.hadamard_signs=ones)")
    assert r.wgrad.hadamard_signs == "ones" and not r.needs_key
    assert fp4jax.recipes.parse(fp4jax.recipes.spec(r)) == r
    assert "signs='ones'" in str(r)
    got = _dw(fp4jax.recipes.parse(_WGRAD.format("wgrad.hadamard_signs=ones")))
    tup = _dw(fp4jax.recipes.parse(_WGRAD.format(f"wgrad.hadamard_signs={(1,) * 16}")))
    assert np.array_equal(got.view(np.uint32), tup.view(np.uint32))
    te = _dw(fp4jax.recipes.parse(_WGRAD.format("wgrad.hadamard_signs=None")))
    assert not np.array_equal(got, te)  # dW: the rotation's signs matter


def test_bad_sign_policy_names_the_argument():
    with pytest.raises(ValueError, match="hadamard_signs='one'.*'ones'"):
        fp4jax.recipes.GemmSpec(hadamard=16, hadamard_signs="one")
    with pytest.raises(ValueError, match="wgrad.hadamard_signs"):
        fp4jax.recipes.parse("nvfp4(wgrad.hadamard_signs=unsigned)")
    with pytest.raises(ValueError, match="'ones'"):
        random_hadamard_transform(jnp.ones((16,)), size=16, signs="unsigned")


def test_kernel_path_gets_the_unsigned_vector(monkeypatch):
    """The sm_90 operand kernels take the sign vector as data (``dot_sm90.make_operands``'s
    ``signs``), so "ones" needs no refusal: the kernel path receives the all-ones vector
    (recorded at run time; the kernels themselves are stood in for by zeros, so nothing is
    interpreted)."""
    monkeypatch.setenv("FP4JAX_KERNELS", "interpret")
    seen = []

    def spy(x, kinds, sr_keys, signs, *a, **k):
        for s in signs:
            if s is not None:
                jax.debug.callback(lambda v: seen.append(np.asarray(v)), s)
        return [(jnp.zeros(x.shape, jnp.bfloat16), jnp.float32(1)) for _ in kinds]

    monkeypatch.setattr(dot_sm90, "make_operands", spy)
    x = jax.random.normal(jax.random.key(1), (32, 256)).astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(jax.random.key(2), (256, 256))).astype(jnp.bfloat16)
    r = fp4jax.recipes.parse("mxfp4(sr=False, wgrad.hadamard_signs=ones)")
    f = jax.grad(lambda x, w: jnp.sum(fp4jax.dot(x, w, recipe=r).astype(jnp.float32)), (0, 1))
    jax.block_until_ready(f(x, w))
    assert len(seen) == 2  # x and dy of wgrad, 32x1 columns after the RHT-32
    assert all(np.array_equal(s, np.ones(32, np.float32)) for s in seen)


# --------------------------------------------------------------------------------------
# 2. MXFP4 with Overflow-Aware Scaling (scale_rule="oas", google/qwix's c = 12/7)
# --------------------------------------------------------------------------------------


def _oas_input(seed=0):
    """Blocks of 32 whose amaxes sit on and around the rule's thresholds 7 * 2**k (and
    3.5 * 2**k, 6 * 2**k, qwix's 6.5 and 7.5), one ulp either side, plus random blocks,
    an all-zero block and a float32-max block."""
    rng = np.random.default_rng(seed)
    amaxes = [6.5, 7.5, 7.0, 3.5, 6.0, 4.0, 1.0, 2.0**-100, 3e38]
    for k in (-3, 0, 5):
        t = np.float32(7.0 * 2.0**k)
        amaxes += [t, np.nextafter(t, np.float32(0)), np.nextafter(t, np.float32(np.inf))]
    blocks = rng.standard_normal((len(amaxes) + 6, 32)).astype(np.float32)
    blocks *= np.exp2(rng.integers(-8, 8, (len(blocks), 1))).astype(np.float32)
    for i, a in enumerate(amaxes):
        b = blocks[i] / np.abs(blocks[i]).max() * np.float32(a * 0.999)
        b[i % 32] = np.float32(a) * (1 if i % 2 else -1)
        blocks[i] = b
    blocks[-1] = 0.0
    return blocks


def test_oas_block_scales_and_elements_bit_exact_vs_numpy():
    """``MXFP4_OAS`` (RtN): every scale and element bit for bit the NumPy reference, whose
    rule is written independently (the smallest ``2**k`` with ``amax < 7 * 2**k``, by
    float64 search); qwix's own test values hold (amax 6.5: scale 1, 7.5: scale 2)."""
    from fp4jax.formats import MXFP4_OAS
    from tests.reference import ref_quantize

    x = _oas_input()
    q = fp4jax.quantize(jnp.asarray(x), MXFP4_OAS)
    data, s, dec = ref_quantize(x, 8, 0, 32, tensor_scale=False, rule="oas")
    assert np.array_equal(np.asarray(q.scale.astype(jnp.float32), np.float64), s)
    got = np.asarray(q.data.astype(jnp.float32), np.float64)
    assert np.array_equal(got, data) and np.array_equal(np.signbit(got), np.signbit(data))
    assert s[0, 0] == 1.0 and s[1, 0] == 2.0  # qwix: amax 6.5 -> 1, 7.5 -> 2
    # the rule differs from the paper's round-up one and from OCP's where designed to
    up = np.asarray(fp4jax.quantize(jnp.asarray(x), "mxfp4").scale.astype(jnp.float32))
    ocp = np.asarray(fp4jax.quantize(jnp.asarray(x), "mxfp4_ocp").scale.astype(jnp.float32))
    assert (s[:, 0] != up[:, 0]).any() and (s[:, 0] != ocp[:, 0]).any()
    assert (s[:, 0] <= up[:, 0]).all() and (s[:, 0] >= ocp[:, 0]).all()


def test_oas_stochastic_rounding_bit_exact_and_unbiased():
    """SR with OAS scales: bit for bit the NumPy reference's SR on the same uniforms, and
    unbiased over 4096 draws for blocks that do not saturate (amax / scale < 6)."""
    from fp4jax.formats import MXFP4_OAS
    from tests.reference import ref_quantize

    x = _oas_input(1)
    key = jax.random.key(5)
    q = fp4jax.quantize(jnp.asarray(x), MXFP4_OAS, rounding="stochastic", key=key)
    k1, k2 = (int(v) for v in np.asarray(jax.random.key_data(key)).reshape(2))
    data, s, _ = ref_quantize(x, 8, 0, 32, tensor_scale=False, rule="oas",
                              sr_key_words=(k1, k2))
    assert np.array_equal(np.asarray(q.data.astype(jnp.float32), np.float64), data)
    # 4096 draws of one block: amax 1.325, scale 2**-2, amax / scale = 5.3 < 6
    row = (np.random.default_rng(2).uniform(-1, 1, 32) * 1.325).astype(np.float32)
    row[3] = np.float32(1.325)
    reps = jnp.asarray(np.tile(row, (4096, 1)))
    qs = fp4jax.quantize(reps, MXFP4_OAS, rounding="stochastic", key=jax.random.key(7))
    assert np.all(np.asarray(qs.scale.astype(jnp.float32)) == 0.25)
    mean = np.asarray(fp4jax.dequantize(qs)).mean(0)
    step = 0.25 * 2  # the widest E2M1 step below 6 (4 -> 6) times the scale
    se = step / 2 / np.sqrt(4096)  # the std of one draw is at most step / 2
    assert np.abs(mean - row).max() < 5 * se + step * 2**-9
    rtn = np.asarray(fp4jax.dequantize(fp4jax.quantize(jnp.asarray(row), MXFP4_OAS)))
    assert np.abs(rtn - row).max() > 10 * se  # RtN is biased here: the test can fail


def test_oas_format_spec_and_kernel_refusal():
    """``fmt=mxfp4_oas`` in a spec string; bad formats named; the sm_90 operand kernels
    (which implement the 'up' and 'ocp' MX rules only) refuse it, so ``fp4jax.dot`` takes
    the XLA path for it (no kernel that ignores the rule)."""
    from fp4jax.formats import MXFP4_OAS

    r = fp4jax.recipes.parse("mxfp4(fmt=mxfp4_oas)")
    assert r.fprop.lhs.fmt == MXFP4_OAS and fp4jax.recipes.spec(r) == "mxfp4(fmt=mxfp4_oas)"
    assert fp4jax.recipes.parse("mxfp4(fmt=BlockFormat(block_size=32, scale='e8m0', "
                                "tensor_scale=False, scale_rule='oas'))").fprop.lhs.fmt.\
        scale_rule == "oas"
    with pytest.raises(ValueError, match="scale_rule='oas' needs a power-of-two scale"):
        fp4jax.BlockFormat("x", 16, scale_rule="oas")
    with pytest.raises(ValueError, match="scale_rule='oas' is defined for E2M1"):
        MXFP4_OAS.replace(elem_exp_bits=4, elem_man_bits=3)
    with pytest.raises(ValueError, match="'nearest', 'up', 'ocp' or 'oas'"):
        MXFP4_OAS.replace(scale_rule="bias")
    why = dispatch.spec_unsupported_reason(MXFP4_OAS)
    assert why is not None and "mxfp4_oas" in why
    assert dispatch.spec_unsupported_reason(fp4jax.MXFP4) is None
    x = jax.random.normal(jax.random.key(1), (32, 256)).astype(jnp.bfloat16)
    assert dispatch.operand_kernel(x[None], block_2d=False, axis=2, stochastic=False, rht=0,
                                   key=jax.random.key(0), fmt=MXFP4_OAS) is None


# --------------------------------------------------------------------------------------
# 3. The uniform 4-bit grid E1M2 (UFP4's), in NVFP4's scaling: "nvfp4_e1m2"
# --------------------------------------------------------------------------------------


def _e1m2_input(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    x *= np.exp2(rng.integers(-6, 6, (8, 1))).astype(np.float32)
    x[0, :16] = np.arange(16, dtype=np.float32) * np.float32(0.25) - 2  # ties of the grid
    x[1, 16:32] = 0.0
    return x


def test_e1m2_grid_and_rtn_bit_exact_vs_numpy():
    """The E1M2 element grid is 0, 0.5, ..., 3.5 (uniform); ``nvfp4_e1m2`` round-to-nearest
    (ties to even codes) is bit for bit the NumPy reference (grid enumerated from its bit
    codes, nearest-value search), scales, elements and tensor scale."""
    from fp4jax.formats import NVFP4_E1M2
    from fp4jax.numerics import E1M2
    from tests.reference import ref_quantize

    assert E1M2.max_value == 3.5 and NVFP4_E1M2.elem_max == 3.5 and NVFP4_E1M2.elem_bits == 4
    x = _e1m2_input(0)
    for axis in (-1, 0):
        q = fp4jax.quantize(jnp.asarray(x), "nvfp4_e1m2", axis=axis)
        data, s, dec = ref_quantize(x, 4, 3, 16, tensor_scale=True, axis=axis, elem=(1, 2))
        got = np.asarray(q.data.astype(jnp.float32), np.float64)
        assert np.array_equal(got, data) and np.array_equal(np.signbit(got), np.signbit(data))
        assert np.array_equal(np.asarray(q.scale.astype(jnp.float32), np.float64), s)
        assert np.float32(q.global_scale) == dec
    assert set(np.unique(np.abs(got))) <= set(np.arange(8) / 2)
    q2 = fp4jax.quantize(jnp.asarray(x), NVFP4_E1M2, block_2d=True)
    data, s, _ = ref_quantize(x, 4, 3, 16, tensor_scale=True, block_2d=True, elem=(1, 2))
    assert np.array_equal(np.asarray(q2.data.astype(jnp.float32), np.float64), data)


def test_e1m2_stochastic_rounding_bit_exact_and_unbiased():
    """SR onto E1M2: bit for bit the NumPy reference on the same uniforms, and unbiased over
    4096 draws (every element below the block max; a uniform grid has no shrinkage
    bias under round-to-nearest either, but SR's mean must match x itself)."""
    from fp4jax.formats import NVFP4_E1M2
    from tests.reference import ref_quantize

    x = _e1m2_input(1)
    key = jax.random.key(11)
    q = fp4jax.quantize(jnp.asarray(x), NVFP4_E1M2, rounding="stochastic", key=key)
    k1, k2 = (int(v) for v in np.asarray(jax.random.key_data(key)).reshape(2))
    data, _, _ = ref_quantize(x, 4, 3, 16, tensor_scale=True, elem=(1, 2),
                              sr_key_words=(k1, k2))
    assert np.array_equal(np.asarray(q.data.astype(jnp.float32), np.float64), data)
    row = np.random.default_rng(3).uniform(-1, 1, 16).astype(np.float32)
    row[0] = np.float32(1.0)  # the block max
    reps = jnp.asarray(np.tile(row, (4096, 1)))
    qs = fp4jax.quantize(reps, NVFP4_E1M2, rounding="stochastic", key=jax.random.key(12))
    deq = np.asarray(fp4jax.dequantize(qs))
    step = float(np.asarray(qs.scale.astype(jnp.float32))[0, 0] * qs.global_scale) * 0.5
    se = step / 2 / np.sqrt(4096)
    err = np.abs(deq.mean(0) - row)[1:]
    assert err.max() < 5 * se + step * 2**-9
    assert len(np.unique(deq[:, 5])) == 2  # each element takes its two neighbours


def test_e1m2_format_in_specs_and_kernel_refusal():
    """``fmt=nvfp4_e1m2`` in a spec string, ``BlockFormat(elem='e1m2')`` too; the sm_90
    kernels (E2M1 codes only) and the native Blackwell GEMM refuse it: the XLA path."""
    from fp4jax.formats import NVFP4_E1M2
    from pallas_kernels.gemm import blockscale_sm100 as bs

    r = fp4jax.recipes.parse("nvfp4(fmt=nvfp4_e1m2)")
    assert r.wgrad.rhs.fmt == NVFP4_E1M2 and fp4jax.recipes.spec(r) == "nvfp4(fmt=nvfp4_e1m2)"
    f = fp4jax.recipes.parse("nvfp4(fmt=BlockFormat(elem='e1m2'))").fprop.lhs.fmt
    assert (f.elem_exp_bits, f.elem_man_bits, f.name) == (1, 2, "e1m2_e4m3-b16")
    with pytest.raises(ValueError, match=r"\(1, 2\) E1M2"):
        fp4jax.BlockFormat("x", elem_exp_bits=1, elem_man_bits=3)
    why = dispatch.spec_unsupported_reason(NVFP4_E1M2)
    assert why is not None and "E1M2" in why
    q = fp4jax.quantize(jnp.ones((1, 16, 16)), NVFP4_E1M2, axis=2)
    assert "E2M1" in bs.operand_reason(q, 2)
