"""4over6 adaptive NVFP4 block scaling (Transformer Engine's ``quantize_4over6_nvfp4.cuh``)
against an independent NumPy reference written from TE's formulas; the recipe knob, its
spec strings, the refused combinations, the dispatcher's fallback and ``fp4jax.dot``.

The reference follows TE's float32 operation order with ``np.float32`` arithmetic (one
rounding per operation, the same order as the CUDA kernel and TE's PyTorch reference
``reference_nvfp4.py``), grids enumerated from bit codes (``tests/reference.py``), and no
fp4jax code. With ``ftz=True`` it also flushes float32 subnormal results to zero, as XLA
on CPU does (see ``four_over_six``'s docstring).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import recipes as R
from pallas_kernels import dispatch
from tests import reference as ref
from tests.checks import FTZ, bits_equal

F32 = np.float32
VARIANTS = ref.FOUR_OVER_SIX_VARIANTS


def _ref_dequantize(rq, rs, rdec, block_2d):
    """``(q * s) * dec`` with the scales of ``rs`` broadcast over their blocks (blocked axis
    last, or 16x16 tiles over the last two axes)."""
    if block_2d:
        s_el = np.repeat(np.repeat(rs, 16, -2), 16, -1)[..., :rq.shape[-2], :rq.shape[-1]]
    else:
        s_el = np.repeat(rs, 16, -1)[..., :rq.shape[-1]]
    with np.errstate(invalid="ignore"):
        return ((rq * s_el).astype(F32) * rdec).astype(F32)


def _check(x, rule, axis=-1, block_2d=False, x_in=None):
    """fp4jax.quantize against the reference, bit for bit; returns the reference's picks."""
    q = fp4jax.quantize(jnp.asarray(x if x_in is None else x_in), fp4jax.NVFP4, axis=axis,
                        block_2d=block_2d, block_scale_rule=rule)
    xm = np.moveaxis(np.asarray(x, F32), axis, -1) if not block_2d else np.asarray(x, F32)
    rq, rs, rdec, pick4 = ref.ref_four_over_six(xm, rule, block_2d, ftz=FTZ)
    rdeq = _ref_dequantize(rq, rs, rdec, block_2d)
    if not block_2d:
        rq, rs, rdeq = (np.moveaxis(a, -1, axis) for a in (rq, rs, rdeq))
    assert q.data.dtype == jnp.float4_e2m1fn and q.scale.dtype == jnp.float8_e4m3fn
    bits_equal(q.data.astype(jnp.float32), rq)
    bits_equal(q.scale.astype(jnp.float32), rs)
    assert np.float32(q.global_scale) == rdec
    bits_equal(fp4jax.dequantize(q), rdeq)
    return pick4


# ---------------------------------------------------------------------------
# Inputs: one shape for most, so that one vmapped compile per rule covers them all.
# ---------------------------------------------------------------------------

SHAPE = (8, 64)


def _inputs() -> dict[str, np.ndarray]:
    r = np.random.default_rng(46)
    out = {
        "gauss": r.standard_normal(SHAPE),
        "heavy": r.standard_t(2.0, SHAPE),
        "outliers": np.where(r.random(SHAPE) < 0.03, 200.0, 1.0) * r.standard_normal(SHAPE),
        "zeros_and_equal": np.concatenate(
            [np.zeros((8, 16)), np.full((8, 16), 0.7), np.full((8, 16), -3.0),
             r.standard_normal((8, 16)) * (r.random((8, 16)) < 0.3)], axis=1),
        "mixed_range": r.standard_normal(SHAPE) * 10.0 ** r.integers(-6, 6, SHAPE),
        "tiny": 1e-30 * r.standard_normal(SHAPE),
        "huge": 1e30 * r.standard_normal(SHAPE),
        # q*s*amax overflows float32 for the blocks near the amax: both errors are Inf there
        "overflow": 1e36 * r.standard_normal(SHAPE),
        # MSE terms d*d below 2**-126: XLA on CPU flushes them (TE keeps them)
        "subnormal_mse": 1e-19 * r.standard_normal(SHAPE),
    }
    nan = r.standard_normal(SHAPE)
    nan[0, 3], nan[2, 20], nan[4, 40], nan[5, 0], nan[7, 63] = np.nan, np.inf, -np.inf, np.nan, 1
    out["nan_inf"] = nan
    for i in range(24):  # random tensors of mixed tails and magnitudes
        out[f"t{i}"] = r.standard_t(1.0 + i % 5, SHAPE) * 10.0 ** r.uniform(-3, 3)
    return {k: v.astype(F32) for k, v in out.items()}


INPUTS = _inputs()
ODD = {"partial": np.random.default_rng(1).standard_normal((5, 37)).astype(F32),
       "3d": np.random.default_rng(2).standard_normal((2, 3, 40)).astype(F32)}


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_each(xs, rule, block_2d):
    """``fp4jax.quantize`` of every tensor of the stack ``xs`` (its own tensor scale each)."""
    return jax.vmap(lambda x: fp4jax.quantize(x, block_2d=block_2d, block_scale_rule=rule))(xs)


# ---------------------------------------------------------------------------
# Bit-exactness.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("rule", list(VARIANTS))
def test_bit_exact(rule, block_2d):
    """Every input (Gaussian, heavy-tailed, outliers, zero and all-equal blocks, a wide
    magnitude range, tiny, huge, overflowing, NaN/Inf, 24 random tensors) against the
    reference: elements, scales, tensor scale and dequantized values, bit for bit; and
    both candidates are picked (the comparison is exercised, not one branch)."""
    names = sorted(INPUTS)
    q = _quantize_each(jnp.asarray(np.stack([INPUTS[n] for n in names])), rule, block_2d)
    deq = np.asarray(fp4jax.dequantize(q))
    picks = []
    for i, n in enumerate(names):
        rq, rs, rdec, pick4 = ref.ref_four_over_six(INPUTS[n], rule, block_2d, ftz=FTZ)
        bits_equal(q.data[i].astype(jnp.float32), rq)
        bits_equal(q.scale[i].astype(jnp.float32), rs)
        assert np.float32(q.global_scale[i]) == rdec, n
        bits_equal(deq[i], _ref_dequantize(rq, rs, rdec, block_2d))
        picks.append(pick4.ravel())
    picks = np.concatenate(picks)
    assert picks.any() and not picks.all(), picks.mean()


@pytest.mark.parametrize("name,rule,axis,block_2d", [
    ("partial", "4over6", -1, False), ("partial", "4over6-mse-448", 0, False),
    ("3d", "4over6-mse", 0, False), ("3d", "4over6", 1, False),
    ("partial", "4over6-448", -1, True), ("3d", "4over6-mse", -1, True),
])
def test_partial_blocks_other_axes_and_3d(name, rule, axis, block_2d):
    _check(ODD[name], rule, axis=axis, block_2d=block_2d)


def test_bf16_input():
    x = np.asarray(jnp.asarray(INPUTS["heavy"], jnp.bfloat16).astype(jnp.float32))
    _check(x, "4over6", x_in=jnp.asarray(x, jnp.bfloat16))


def test_reference_ftz_is_inert_on_normal_inputs():
    """The subnormal flush changes nothing on the inputs but ``subnormal_mse``, so the
    bit-exact tests compare against TE's math (no flush) for all of them."""
    for name in INPUTS:
        for rule in VARIANTS:
            for b2 in (False, True):
                a = ref.ref_four_over_six(INPUTS[name], rule, b2, ftz=True)
                b = ref.ref_four_over_six(INPUTS[name], rule, b2, ftz=False)
                if name == "subnormal_mse" and "mse" in rule and not b2:
                    # the documented difference: flushed squares make every error 0, so
                    # every block ties and keeps map-to-6 where TE picks map-to-4
                    assert not a[3].any() and b[3].sum() >= 5
                    continue
                bits_equal(a[0], b[0])
                bits_equal(a[1], b[1])


def test_ties_take_map_to_6():
    """A block exactly representable under both scales ({0, 1.5, 3, 6} * 2**k with the
    tensor scale 1) has err4 == err6 == 0: TE keeps map-to-6 (scale 2**k, not 1.5 * 2**k)."""
    x = np.zeros((2, 32), F32)
    x[0, :16] = np.array([6, 3, 1.5, 0, -6, -3, -1.5, 0] * 2, F32) * 2.0**-3
    x[0, 16] = 1536.0  # tensor amax 256*6: enc = dec = 1
    x[1, :16] = np.array([6, 4, 2, 1] * 4, F32) * 2.0**-3  # map-to-6 exact, map-to-4 not
    x[1, 16:] = np.array([4, 3, 2] * 5 + [1], F32) * 2.0**-2  # map-to-4 exact (amax -> 4)
    q = fp4jax.quantize(jnp.asarray(x), block_scale_rule="4over6")
    assert float(q.global_scale) == 1.0
    s = np.asarray(q.scale.astype(jnp.float32))
    assert s[0, 0] == 2.0**-3  # tie: map-to-6
    assert s[1, 0] == 2.0**-3  # map-to-6 strictly better
    assert s[1, 1] == 0.25  # map-to-4 (amax_b / 4) strictly better
    bits_equal(fp4jax.dequantize(q), x)  # every chosen candidate is exact here
    pick4 = _check(x, "4over6")
    assert pick4.tolist() == [[False, False], [False, True]]


def test_4over6_lowers_the_mean_error():
    """The point of the rule: on Gaussian data every 4over6 variant has a lower mean
    absolute and squared error than the "max" rule."""
    names = sorted(INPUTS)
    xs = jnp.asarray(np.stack([INPUTS[n] for n in names]))
    g = names.index("gauss")
    err = {r: np.asarray(fp4jax.dequantize(_quantize_each(xs, r, False)))[g] - INPUTS["gauss"]
           for r in ("max", *VARIANTS)}
    for r in VARIANTS:
        assert np.abs(err[r]).mean() < np.abs(err["max"]).mean(), r
        assert (err[r] ** 2).mean() < (err["max"] ** 2).mean(), r


def test_scale_bounds_and_unbatched_equals_batched():
    """TE's 256 bound: the tensor amax maps to 256*6, so map-to-4 scales stay <= 384;
    with the 448 bound map-to-4 saturates at 448 near the tensor amax. The unbatched
    ``fp4jax.quantize`` gives the bits of the vmapped one."""
    names = sorted(INPUTS)
    xs = jnp.asarray(np.stack([INPUTS[n] for n in names]))
    h = names.index("heavy")
    x = INPUTS["heavy"]
    for rule, top in (("4over6", 384.0), ("4over6-448", 448.0)):
        q = fp4jax.quantize(jnp.asarray(x), block_scale_rule=rule)
        bound = VARIANTS[rule][1]
        assert np.float32(q.global_scale) == np.float32(1) / np.float32(
            np.float32(bound * 6.0) / np.float32(np.abs(x).max()))
        assert np.asarray(q.scale.astype(jnp.float32)).max() <= top
        qb = _quantize_each(xs, rule, False)
        bits_equal(q.data.astype(jnp.float32), qb.data[h].astype(jnp.float32))
        bits_equal(q.scale.astype(jnp.float32), qb.scale[h].astype(jnp.float32))


# ---------------------------------------------------------------------------
# Refused combinations and validation.
# ---------------------------------------------------------------------------

def test_quantize_refuses_sr_other_formats_and_unknown_rules():
    x = jnp.ones((4, 32))
    with pytest.raises(ValueError, match="rounding='nearest'.*stochastic rounding"):
        fp4jax.quantize(x, rounding="stochastic", key=jax.random.key(0),
                        block_scale_rule="4over6")
    with pytest.raises(ValueError, match="NVFP4 only.*mxfp4"):
        fp4jax.quantize(x, fp4jax.MXFP4, block_scale_rule="4over6")
    with pytest.raises(ValueError, match="NVFP4 only"):
        fp4jax.quantize(x, fp4jax.BlockFormat("b32", block_size=32), block_scale_rule="4over6")
    with pytest.raises(ValueError, match="block_scale_rule must be one of"):
        fp4jax.quantize(x, block_scale_rule="4over6-l1")


def test_quant_spec_and_gemm_spec_validation():
    with pytest.raises(ValueError, match="QuantSpec.rounding='nearest'"):
        fp4jax.QuantSpec(fp4jax.NVFP4, "stochastic", block_scale_rule="4over6")
    with pytest.raises(ValueError, match="NVFP4 only"):
        fp4jax.QuantSpec(fp4jax.MXFP4, block_scale_rule="4over6")
    with pytest.raises(ValueError, match="fmt=None"):
        fp4jax.QuantSpec(None, block_scale_rule="4over6")
    with pytest.raises(ValueError, match="QuantSpec.block_scale_rule must be one of"):
        fp4jax.QuantSpec(block_scale_rule="mse")
    four = fp4jax.QuantSpec(block_scale_rule="4over6")
    with pytest.raises(ValueError, match="refuses 4over6 with the RHT.*hadamard=0"):
        fp4jax.GemmSpec(lhs=four, rhs=fp4jax.QuantSpec(), hadamard=16)
    assert fp4jax.GemmSpec(lhs=four, rhs=four).lhs.block_scale_rule == "4over6"


def test_recipe_refusals_name_the_operand_and_the_fix():
    with pytest.raises(ValueError, match=r"wgrad.lhs \(x\).*RHT.*rht=0"):
        R.nvfp4().replace(block_scale_rule="4over6")
    with pytest.raises(ValueError, match=r"wgrad: GemmSpec: lhs.block_scale_rule='4over6' "
                                         r"with hadamard=16"):
        R.nvfp4().replace(**{"wgrad.lhs.block_scale_rule": "4over6"})
    with pytest.raises(ValueError, match="dgrad: QuantSpec.block_scale_rule='4over6' needs "
                                         "QuantSpec.rounding='nearest'"):
        R.nvfp4().replace(**{"dgrad.lhs.block_scale_rule": "4over6"})
    with pytest.raises(ValueError, match="wgrad.lhs, which rounds stochastically"):
        R.fp4_all_the_way().replace(block_scale_rule="4over6")
    with pytest.raises(ValueError, match="NVFP4 only"):
        R.mxfp4().replace(rht=0, block_scale_rule="4over6")
    # a 4over6 recipe cannot be turned into MXFP4 or get an RHT back silently
    r = R.nvfp4().replace(rht=0, block_scale_rule="4over6")
    with pytest.raises(ValueError, match="NVFP4 only"):
        r.replace(fmt=fp4jax.MXFP4)
    with pytest.raises(ValueError, match="RHT"):
        r.replace(rht=16)
    with pytest.raises(ValueError, match="spec .*wgrad.hadamard=16: .*RHT"):
        R.parse("nvfp4(rht=0, block_scale_rule=4over6, wgrad.hadamard=16)")


def test_recipe_shorthand_scope_is_te_all():
    """``block_scale_rule=4over6`` covers x and w (TE's ``nvfp4_4over6="all"``), not dy;
    the 2D weight stays shared by fprop and dgrad; ``block_scale_rule=max`` resets all."""
    r = R.nvfp4().replace(rht=0, block_scale_rule="4over6")
    rules = {(g, o): getattr(getattr(r, g), o).block_scale_rule
             for g in ("fprop", "dgrad", "wgrad") for o in ("lhs", "rhs")}
    assert rules == {("fprop", "lhs"): "4over6", ("fprop", "rhs"): "4over6",
                     ("dgrad", "lhs"): "max", ("dgrad", "rhs"): "4over6",
                     ("wgrad", "lhs"): "4over6", ("wgrad", "rhs"): "max"}
    assert r.dgrad.rhs == r.fprop.rhs and r.fprop.rhs.block_2d
    assert r.replace(block_scale_rule="max") == R.nvfp4().replace(rht=0)
    with pytest.raises(ValueError, match="block_scale_rule must be one of"):
        R.nvfp4().replace(block_scale_rule="4over8")
    assert "4over6" in str(r) and "4over6" in r.describe()
    assert "4over6" not in str(R.nvfp4())


@pytest.mark.parametrize("text,expr", [
    ("nvfp4(rht=0, block_scale_rule=4over6)",
     lambda: R.nvfp4().replace(rht=0, block_scale_rule="4over6")),
    ("nvfp4(fprop.lhs.block_scale_rule=4over6)",
     lambda: R.nvfp4().replace(**{"fprop.lhs.block_scale_rule": "4over6"})),
    ("nvfp4(fprop.rhs.block_scale_rule='4over6-mse', dgrad.rhs.block_scale_rule=4over6-mse)",
     lambda: R.nvfp4().replace(**{"fprop.rhs.block_scale_rule": "4over6-mse",
                                  "dgrad.rhs.block_scale_rule": "4over6-mse"})),
    ("fp4_all_the_way(sr=False, block_scale_rule=4over6-mse-448)",
     lambda: R.fp4_all_the_way().replace(sr=False, block_scale_rule="4over6-mse-448")),
])
def test_spec_strings_and_round_trip(text, expr):
    r = R.parse(text)
    assert r == expr()
    assert R.parse(R.spec(r)) == r
    assert "block_scale_rule=4over6" in R.spec(r)


def test_spec_string_errors():
    with pytest.raises(ValueError, match="unknown key"):
        R.parse("nvfp4(fprop.lhs.scale_rule=4over6)")
    with pytest.raises(ValueError, match="block_scale_rule must be one of"):
        R.parse("nvfp4(fprop.lhs.block_scale_rule=4over7)")
    with pytest.raises(ValueError, match=r"wgrad.lhs \(x\).*RHT"):
        R.parse("nvfp4(block_scale_rule=4over6)")


# ---------------------------------------------------------------------------
# The dispatcher declines 4over6; fp4jax.dot runs it under jit and grad.
# ---------------------------------------------------------------------------

def test_dispatcher_declines_4over6():
    x = jnp.zeros((1, 64, 1024), jnp.bfloat16)
    kw = dict(block_2d=False, axis=2, stochastic=False, rht=0, key=jax.random.key(0))
    assert dispatch.operand_kernel(x, **kw) == "rows"  # the control: "max" has a kernel
    assert dispatch.operand_kernel(x, **kw, block_scale_rule="4over6") is None
    kw2 = dict(kw, block_2d=True)
    assert dispatch.operand_kernel(x[:, :64], **kw2) == "2d"
    assert dispatch.operand_kernel(x[:, :64], **kw2, block_scale_rule="4over6-mse") is None
    reason = dispatch.quantize_unsupported_reason((256, 1024), jnp.bfloat16,
                                                  block_scale_rule="4over6")
    assert "'max' block scale rule only" in reason
    assert not dispatch.is_supported("quantize", (256, 1024), jnp.bfloat16,
                                     block_scale_rule="4over6")
    xb = jnp.asarray(INPUTS["gauss"][:, :64], jnp.bfloat16)
    q = dispatch.quantize(xb, block_scale_rule="4over6")  # auto: the XLA 4over6 path
    bits_equal(q.scale.astype(jnp.float32),
                fp4jax.quantize(xb, block_scale_rule="4over6").scale.astype(jnp.float32))
    with pytest.raises(ValueError, match="'max' block scale rule only"):
        dispatch.quantize(xb, block_scale_rule="4over6", backend="pallas")


def _all_4over6_recipe() -> fp4jax.Recipe:
    """Every operand 4over6 (dy included, round to nearest, no RHT): no operand may take a
    kernel."""
    r = R.nvfp4().replace(sr=False, rht=0, block_scale_rule="4over6")
    return r.replace(**{"dgrad.lhs.block_scale_rule": "4over6",
                        "wgrad.rhs.block_scale_rule": "4over6"})


def test_dot_forward_matches_quantized_operands_and_runs_under_jit_and_grad():
    """``fp4jax.dot`` with ``nvfp4(rht=0, block_scale_rule=4over6)`` under jit and grad:
    the forward is the product of the 4over6-quantized x (1x16) and w (16x16)."""
    r = np.random.default_rng(3)
    x = jnp.asarray(r.standard_normal((2, 16, 64)), jnp.float32)
    w = jnp.asarray(0.1 * r.standard_normal((64, 32)), jnp.float32)
    recipe = R.parse("nvfp4(rht=0, block_scale_rule=4over6)")
    key = jax.random.key(1)

    def loss(x, w):
        y = fp4jax.dot(x, w, recipe=recipe, key=key)
        return (y ** 2).sum(), y

    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
    xq = fp4jax.dequantize(fp4jax.quantize(x.reshape(32, 64), block_scale_rule="4over6"))
    wq = fp4jax.dequantize(fp4jax.quantize(w, block_2d=True, block_scale_rule="4over6"))
    want = jnp.dot(xq, wq, precision=jax.lax.Precision.HIGHEST).reshape(2, 16, 32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert dx.shape == x.shape and dw.shape == w.shape
    assert np.isfinite(np.asarray(dx)).all() and np.isfinite(np.asarray(dw)).all()
    assert float(jnp.abs(dw).sum()) > 0


def test_dot_kernel_mode_takes_the_xla_path_for_4over6(monkeypatch):
    """Under FP4JAX_KERNELS=interpret (the kernel path of ``fp4jax.dot``, on CPU) a recipe
    whose six operands are 4over6 lowers to no Pallas call: the dispatcher declines every
    operand, which then runs the reference quantizer (``fp4jax.backends.reference_quantize``).
    The control: the same recipe with the "max" rule lowers to kernels at these sizes."""
    x = jnp.zeros((16, 1024), jnp.bfloat16)  # the rows and cols kernels take this size
    w = jnp.zeros((1024, 16), jnp.bfloat16)

    def lowered(recipe):
        def loss(x, w):
            return (fp4jax.dot(x, w, recipe=recipe).astype(jnp.float32) ** 2).sum()
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()
        return "pallas" in text or "callback" in text or "mosaic" in text.lower()

    monkeypatch.setenv("FP4JAX_KERNELS", "interpret")
    assert lowered(R.nvfp4().replace(sr=False, rht=0))
    assert not lowered(_all_4over6_recipe())
