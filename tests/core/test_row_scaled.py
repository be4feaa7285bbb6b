"""Row-scaled NVFP4 (Transformer Engine's ``row_scaled_nvfp4``: one FP32 tensor scale per row
instead of one per tensor) against an independent NumPy reference; its GEMM emulation, the
recipe knob, spec strings, refused combinations and the dispatcher's fallback.

The reference is ``tests/reference.py``'s per-tensor NVFP4 quantizer applied to each row
on its own: a row-scaled tensor is, by TE's definition, each row quantized as a tensor of
its own (``reference_nvfp4.py``: ``global_amax`` of shape ``(m, 1, 1)``).
"""

from __future__ import annotations

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


def _ref_rows(x: np.ndarray, rule: str = "max"):
    """Each row (last axis) quantized by the per-tensor reference on its own: (data, scales,
    decode scales of shape (..., 1))."""
    rows = x.reshape(-1, x.shape[-1])
    out = []
    for r in rows:
        if rule == "max":
            q, s, dec = ref.ref_quantize(r[None])
        else:
            q, s, dec, _ = ref.ref_four_over_six(r[None], rule, ftz=FTZ)
        out.append((q[0], s[0], dec))
    q = np.stack([o[0] for o in out]).reshape(x.shape)
    s = np.stack([o[1] for o in out]).reshape(*x.shape[:-1], -1)
    dec = np.array([o[2] for o in out], F32).reshape(*x.shape[:-1], 1)
    return q, s, dec


def _edge_rows() -> np.ndarray:
    """Rows of 40 (a partial last block) spanning magnitudes: normal, huge, tiny, zeros, a
    NaN, an Inf, one outlier."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 40)).astype(F32)
    x[1] *= F32(3e4)
    x[2] *= F32(1e-20)
    x[3] = 0
    x[4, 5] = np.nan
    x[5, 33] = np.inf
    x[6, 17] = F32(2e5)
    return x


@pytest.mark.parametrize("rule", ["max", "4over6"])
def test_bit_exact_per_row_against_reference(rule):
    x = _edge_rows()
    q = fp4jax.quantize(jnp.asarray(x), fp4jax.NVFP4, row_scaled=True, block_scale_rule=rule)
    rq, rs, rdec = _ref_rows(x, rule)
    assert q.global_scale.shape == (8, 1)
    bits_equal(q.data.astype(jnp.float32), rq)
    bits_equal(q.scale.astype(jnp.float32), rs)
    bits_equal(q.global_scale, rdec)
    want = np.stack([ref.ref_dequantize(rq[i], rs[i], rdec[i, 0]) for i in range(8)])
    bits_equal(fp4jax.dequantize(q), want)
    # the blocked axis need not be the last: axis 0 is the same rows of the transpose
    qt = fp4jax.quantize(jnp.asarray(x.T), fp4jax.NVFP4, axis=0, row_scaled=True,
                         block_scale_rule=rule)
    assert qt.global_scale.shape == (1, 8)
    bits_equal(qt.data.astype(jnp.float32).T, rq)
    bits_equal(qt.global_scale.T, rdec)


def test_a_later_row_no_longer_changes_earlier_rows():
    """The point of row scales: a token's quantization depends on its own row only. The
    per-tensor scale (negative control) couples every row to the largest one."""
    x = _edge_rows()[:4].copy()
    x[3] = np.random.default_rng(1).standard_normal(40)
    y = x.copy()
    y[3] *= F32(1e6)  # a later token with a huge amax
    for row_scaled, coupled in ((True, False), (False, True)):
        a = fp4jax.dequantize(fp4jax.quantize(jnp.asarray(x), row_scaled=row_scaled))[:3]
        b = fp4jax.dequantize(fp4jax.quantize(jnp.asarray(y), row_scaled=row_scaled))[:3]
        same = np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
        assert same != coupled


def _dot_case():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 24, 48)).astype(F32) * np.exp(rng.standard_normal((2, 24, 1)) * 3)
    w = (rng.standard_normal((48, 40)) * 0.1).astype(F32)
    dy = rng.standard_normal((2, 24, 40)).astype(F32) * np.exp(rng.standard_normal((1, 24, 1)))
    return x, w, dy


ALL_ROWS = ("nvfp4(sr=False, rht=0, block_2d=False, row_scaled=True, "
            "fprop.rhs.row_scaled=True, dgrad.lhs.row_scaled=True, dgrad.rhs.row_scaled=True, "
            "wgrad.lhs.row_scaled=True, wgrad.rhs.row_scaled=True)")


def test_gemms_apply_the_row_scales_exactly():
    """Forward, dgrad and wgrad with every operand row-scaled (round to nearest, so the
    operands are ``fp4jax.quantize``'s, checked above) against float64 products of the
    dequantized operands: only the float32 accumulation differs. The shapes make every
    row-scale axis distinct (M 48 = 2 x 24 tokens, K 48, N 40), so a scale applied along
    the wrong output axis fails."""
    r = R.parse(ALL_ROWS)
    x, w, dy = _dot_case()
    xq = lambda a, axis: np.asarray(fp4jax.dequantize(  # noqa: E731
        fp4jax.quantize(jnp.asarray(a), axis=axis, row_scaled=True)), np.float64)
    x2, dy2 = x.reshape(48, 48), dy.reshape(48, 40)
    want_y = xq(x2, -1) @ xq(w, 0)
    want_dx = xq(dy2, -1) @ xq(w, 1).T
    want_dw = xq(x2, 0).T @ xq(dy2, 0)
    y, vjp = jax.vjp(lambda a, b: fp4jax.dot(a, b, recipe=r), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    for got, want in ((y.reshape(48, 40), want_y), (dx.reshape(48, 48), want_dx), (dw, want_dw)):
        got = np.asarray(got, np.float64)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= 1e-5 * scale, np.abs(got - want).max() / scale
    # negative control: the per-tensor recipe's forward differs from this reference
    y0 = np.asarray(fp4jax.dot(jnp.asarray(x), jnp.asarray(w), recipe=R.parse(
        "nvfp4(sr=False, rht=0)")), np.float64).reshape(48, 40)
    assert np.abs(y0 - want_y).max() > 1e-3 * np.abs(want_y).max()


def test_recipe_knob_spec_strings_and_refusals():
    r = R.parse("nvfp4(row_scaled=True)")
    assert r.fprop.lhs.row_scaled and not any(
        q.row_scaled for g in (r.dgrad, r.wgrad) for q in (g.lhs, g.rhs))
    assert r == R.nvfp4().replace(row_scaled=True)
    assert R.parse(R.spec(r)) == r and "row-scaled" in str(r)
    assert R.parse("nvfp4(row_scaled=True, row_scaled=False)") == R.nvfp4()
    with pytest.raises(ValueError, match=r"row_scaled=True with .*block_2d=True"):
        fp4jax.quantize(jnp.ones((16, 16)), block_2d=True, row_scaled=True)
    with pytest.raises(ValueError, match=r"QuantSpec.row_scaled=True with QuantSpec.block_2d"):
        R.QuantSpec(fp4jax.NVFP4, block_2d=True, row_scaled=True)
    with pytest.raises(ValueError, match=r"row_scaled=True .*no tensor scale"):
        fp4jax.quantize(jnp.ones((4, 32)), fp4jax.MXFP4, row_scaled=True)
    with pytest.raises(ValueError,
                       match=r"fprop.rhs.row_scaled=True: .*row_scaled=True with .*block_2d=True"):
        R.parse("nvfp4(fprop.rhs.row_scaled=True)")
    with pytest.raises(ValueError, match="row_scaled=True with rounding='ms_eden'"):
        fp4jax.quantize(jnp.ones((4, 32)), rounding="ms_eden", key=jax.random.key(0),
                        row_scaled=True)


def test_dispatcher_declines_row_scaled():
    x = jnp.ones((1, 256, 256), jnp.bfloat16)
    assert dispatch.operand_kernel(x, block_2d=False, axis=2, stochastic=False, rht=0,
                                   key=jax.random.key(0), row_scaled=True) is None
    reason = dispatch.quantize_unsupported_reason((256, 256), jnp.bfloat16, row_scaled=True)
    assert reason is not None and "row_scaled" in reason
    from pallas_kernels.dot_sm90 import recipe_reason
    assert recipe_reason(R.parse(ALL_ROWS))
    # one row-scaled operand rides along on the kernel path (from the XLA quantizer)
    assert recipe_reason(R.nvfp4()) is None and recipe_reason(
        R.nvfp4().replace(row_scaled=True)) is None
