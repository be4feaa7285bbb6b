"""CPU tests of the W4A4 packed-NVFP4/MXFP4 GEMM (pallas_kernels/gemm/w4a4_sm90.py).

* The decode kernel runs in Mosaic GPU interpret mode
  and its bf16 output is compared bit for bit with an independent NumPy decode
  (ml_dtypes casts, ``pallas_kernels.reference``) of the ``QuantizedArray``.
* The two-pass GEMM end to end in interpret mode, and the XLA-decode variant, against
  the float32 NumPy ``dequantize(A) @ dequantize(B)``.
* The decode kernel is lowered for CUDA on this CPU machine (``jax.export``), which runs
  the whole Mosaic GPU lowering.
GPU exactness and timing: experiments/gpu_check.py (``w4a4``) and
experiments/bench_kernels.py (``w4a4two``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
fp4jax = pytest.importorskip("fp4jax")

from pallas_kernels import dispatch  # noqa: E402
from pallas_kernels import reference as npref  # noqa: E402
from pallas_kernels.gemm import w4a4_sm90 as w4  # noqa: E402
from tests.checks import bf16_bits, export_cuda  # noqa: E402
from tests.interpret import InterpretGPUParams, needs_interpret  # noqa: E402


def _operands(m, k, n, seed, block_2d=False, special=False):
    """NVFP4 A (M, K) along axis 1 and B (K, N) along axis 0, per-block magnitudes over
    many binades (E4M3 normal and subnormal scales)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    a *= np.exp2(rng.uniform(-14, 8, (m, k // 16, 1))).repeat(16, -1).reshape(m, k)
    b = rng.standard_normal((k, n)).astype(np.float32)
    b *= np.exp2(rng.uniform(-14, 8, (k // 16, 1, n))).repeat(16, 1).reshape(k, n)
    if special:
        a[0, :16] = 0.0  # zero block: s = 0
        a[1, 16:32] = -0.0
        a[2, :16] = [-6, -5, -3.5, -2.5, -1.75, -1.25, -.75, -.25, .25, .75, 1.25, 1.75,
                     2.5, 3.5, 5, 6]
    if block_2d:
        qa = fp4jax.quantize(jnp.asarray(a), fp4jax.NVFP4, block_2d=True)
        qb = fp4jax.quantize(jnp.asarray(b), fp4jax.NVFP4, block_2d=True)
    else:
        qa = fp4jax.quantize(jnp.asarray(a), fp4jax.NVFP4, axis=1)
        qb = fp4jax.quantize(jnp.asarray(b), fp4jax.NVFP4, axis=0)
    return qa, qb


def _np_qs(q, contract_axis):
    """NumPy q * s (float32, no tensor scale) of a QuantizedArray, as (R, K)."""
    codes = np.asarray(q.data).view(np.uint8) & 0xF
    sb = np.asarray(jax.lax.bitcast_convert_type(q.scale, jnp.uint8))
    if q.block_2d:
        sb = sb.repeat(16, axis=0).repeat(16, axis=1)[: codes.shape[0], : codes.shape[1]]
        sb = sb[:, ::16] if contract_axis == 1 else sb[::16, :]
    if contract_axis == 0:
        codes, sb = codes.T, sb.T
    return npref.dequantize_nvfp4(codes, sb, np.float32(1))


def _np_reference(qa, qb):
    a = _np_qs(qa, 1) * np.float32(qa.global_scale)
    b = _np_qs(qb, 0) * np.float32(qb.global_scale)
    return a.astype(np.float64) @ b.T.astype(np.float64)


def _close(y, ref):
    y = np.asarray(y, np.float64)
    err = np.abs(y - ref).max() / np.abs(ref).max()
    assert err < 1e-5, err


def test_decoders_exact():
    sb = np.arange(256, dtype=np.uint8)
    got = np.asarray(w4.decode_e4m3(jnp.asarray(sb)))
    want = sb.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)  # NaN positions equal too
    # every code x every finite non-negative scale: bf16 bits of q * s
    c = np.tile(np.arange(16, dtype=np.int32), 127)
    s = np.repeat(np.arange(127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                  .astype(np.float32), 16)
    v = w4.decode_block(jnp.asarray(c), jnp.asarray(s))
    want = (npref.decode_codes(c.astype(np.uint8)) * s).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bf16_bits(v), want.view(np.uint16))


@pytest.mark.parametrize("block_2d", [False, True])
def test_layout_roundtrip(block_2d):
    qa, qb = _operands(32, 128, 48, 1, block_2d=block_2d)
    aq, as_, _ = w4.prepare_a(qa)
    bq, bs, _ = w4.prepare_b(qb)
    assert aq.shape == (32, 64) and as_.shape == (8, 32)
    assert bq.shape == (48, 64) and bs.shape == (8, 48)
    for q, (cq, sbits), ax in ((qa, (aq, as_), 1), (qb, (bq, bs), 0)):
        r = cq.shape[0]
        c = np.asarray(cq).reshape(r, -1, 1, 16)
        codes = np.concatenate([c & 15, c >> 4], axis=2).reshape(r, -1)
        got = npref.dequantize_nvfp4(codes, np.asarray(sbits).T, np.float32(1))
        np.testing.assert_array_equal(got, _np_qs(q, ax))


@needs_interpret
@pytest.mark.parametrize("m,k,seed", [(64, 256, 0), (128, 512, 1)])
def test_decode_kernel_interpret_bit_exact(m, k, seed):
    qa, _ = _operands(m, k, 16, seed, special=True)
    aq, as_, _ = w4.prepare_a(qa)
    got = w4.decode_operand(aq, as_, interpret=InterpretGPUParams())
    want = _np_qs(qa, 1).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bf16_bits(got), want.view(np.uint16))
    np.testing.assert_array_equal(bf16_bits(w4.decode_operand_xla(aq, as_)), want.view(np.uint16))


@needs_interpret
@pytest.mark.parametrize("block_2d", [False, True])
def test_two_pass_interpret_matches_reference(block_2d):
    qa, qb = _operands(64, 256, 64, 3, block_2d=block_2d)
    pa, pb = w4.prepare_a(qa), w4.prepare_b(qb)
    y = w4.w4a4_matmul_two_pass(*pa, *pb, out_dtype=jnp.float32,
                                interpret=InterpretGPUParams())
    ref = _np_reference(qa, qb)
    _close(y, ref)
    _close(w4.w4a4_matmul_xla(*pa, *pb, out_dtype=jnp.float32), ref)
    _close(w4.reference_w4a4(*pa, *pb), ref)
    yb = w4.w4a4_matmul_two_pass(*pa, *pb, interpret=InterpretGPUParams())
    assert yb.dtype == jnp.bfloat16


def _mx_operands(m, k, n, seed, fmt_a=fp4jax.MXFP4, fmt_b=fp4jax.MXFP4):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    a *= np.exp2(rng.uniform(-30, 30, (m, k // 32, 1))).repeat(32, -1).reshape(m, k)
    b = rng.standard_normal((k, n)).astype(np.float32)
    b *= np.exp2(rng.uniform(-30, 30, (k // 32, 1, n))).repeat(32, 1).reshape(k, n)
    a[0, :32] = 0.0
    return (fp4jax.quantize(jnp.asarray(a), fmt_a, axis=1),
            fp4jax.quantize(jnp.asarray(b), fmt_b, axis=0))


@needs_interpret
@pytest.mark.parametrize("fmt", [fp4jax.MXFP4, fp4jax.MXFP4_OCP], ids=lambda f: f.name)
def test_decode_kernel_mxfp4_interpret_bit_exact(fmt):
    qa, _ = _mx_operands(64, 256, 64, 7, fmt_a=fmt)
    aq, as_, dec = w4.prepare_a(qa)
    assert float(dec) == 1.0 and w4.scale_format(qa.fmt) == "ue8m0"
    got = w4.decode_operand(aq, as_, interpret=InterpretGPUParams(), scale_fmt="ue8m0")
    # NumPy: E2M1 value of each code times 2^(e - 127) of its 32-block's UE8M0 bits
    codes = np.asarray(jax.lax.bitcast_convert_type(qa.data, jnp.uint4)).astype(np.int64)
    e = np.asarray(jax.lax.bitcast_convert_type(qa.scale, jnp.uint8)).astype(np.float64)
    mag = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])[codes & 7] * np.exp2(e - 127).repeat(32, 1)
    want = np.where(codes & 8, -mag, mag).astype(np.float32).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bf16_bits(got), want.view(np.uint16))
    np.testing.assert_array_equal(
        bf16_bits(w4.decode_operand_xla(aq, as_, "ue8m0")), want.view(np.uint16))
    deq = np.asarray(fp4jax.dequantize(qa, jnp.float32)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bf16_bits(got), deq.view(np.uint16))


@needs_interpret
@pytest.mark.parametrize("mixed", [False, True])
def test_two_pass_mxfp4_interpret_matches_reference(mixed):
    qa, qb = _mx_operands(64, 256, 128, 8)
    if mixed:  # NVFP4 activations x MXFP4 weights
        qa = fp4jax.quantize(fp4jax.dequantize(qa), fp4jax.NVFP4, axis=1)
    pa, pb = w4.prepare_a(qa), w4.prepare_b(qb)
    sa, sb = w4.scale_format(qa.fmt), w4.scale_format(qb.fmt)
    y = w4.w4a4_matmul_two_pass(*pa, *pb, out_dtype=jnp.float32, scale_a=sa, scale_b=sb,
                                interpret=InterpretGPUParams())
    ref = (np.asarray(fp4jax.dequantize(qa, jnp.float32), np.float64)
           @ np.asarray(fp4jax.dequantize(qb, jnp.float32), np.float64))
    _close(y, ref)
    _close(w4.w4a4_matmul_xla(*pa, *pb, out_dtype=jnp.float32, scale_a=sa, scale_b=sb), ref)
    # the scale format matters: decoding UE8M0 bits as E4M3 gives something else
    wrong = w4.w4a4_matmul_xla(*pa, *pb, out_dtype=jnp.float32, scale_a="e4m3", scale_b="e4m3")
    assert not np.allclose(np.asarray(wrong), ref, rtol=1e-3)


def test_mxfp4_prepare_and_dispatch_rules():
    qa, qb = _mx_operands(64, 256, 64, 9)
    assert dispatch.w4a4_unsupported_reason(64, 256, 64, qa, qb) in (None, "no sm_90 GPU")
    q8 = fp4jax.quantize(jnp.ones((64, 256)), fp4jax.BlockFormat(
        "b8", block_size=8, scale_exp_bits=4, scale_man_bits=3, tensor_scale=True), axis=1)
    assert "NVFP4 and MXFP4" in dispatch.w4a4_unsupported_reason(64, 256, 64, qa=q8)
    with pytest.raises(ValueError, match="NVFP4 and MXFP4"):
        w4.prepare_a(q8)
    q2d = fp4jax.quantize(jnp.ones((64, 256)), fp4jax.MXFP4, block_2d=True)
    assert "1-D blocks" in dispatch.w4a4_unsupported_reason(64, 256, 64, qa=q2d)
    with pytest.raises(ValueError, match="1-D blocks"):
        w4.prepare_a(q2d)
    _close(dispatch.w4a4_matmul(qa, qb, out_dtype=jnp.float32, backend="xla"),
           np.asarray(fp4jax.dequantize(qa), np.float64) @ np.asarray(fp4jax.dequantize(qb),
                                                                        np.float64))


def _u8(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.uint8)


@pytest.mark.parametrize("tile_k,out_swizzle", [(256, True), (128, False)])
def test_decode_kernel_lowers_for_cuda(tile_k, out_swizzle):
    exp = export_cuda(lambda c, s: w4.decode_operand(c, s, tile_k=tile_k,
                                                      out_swizzle=out_swizzle),
                       _u8(256, 512), _u8(64, 256))
    assert "mosaic_gpu" in exp.mlir_module()


def test_kernels_reject_bad_shapes():
    with pytest.raises(ValueError, match="layout mismatch"):
        w4.decode_operand(jnp.zeros((64, 64), jnp.uint8), jnp.zeros((4, 64), jnp.uint8))
    with pytest.raises(ValueError, match="K % 256"):
        w4.decode_operand(jnp.zeros((64, 64), jnp.uint8), jnp.zeros((8, 64), jnp.uint8))


def test_dispatch_w4a4(monkeypatch):
    qa, qb = _operands(64, 256, 64, 5)
    ref = _np_reference(qa, qb)
    _close(dispatch.w4a4_matmul(qa, qb, out_dtype=jnp.float32, backend="xla"), ref)
    assert not dispatch.is_supported("w4a4_matmul", 48, 256, 64)
    assert dispatch.w4a4_unsupported_reason(48, 256, 64).startswith("M % 64")
    assert "K % 256" in dispatch.w4a4_unsupported_reason(64, 128, 64)
    qx = fp4jax.quantize(jnp.ones((64, 256)), fp4jax.NVFP4, axis=0)
    assert "scaled along K" in dispatch.w4a4_unsupported_reason(64, 256, 64, qa=qx)
    if dispatch.on_sm90():
        return
    _close(dispatch.w4a4_matmul(qa, qb, out_dtype=jnp.float32), ref)  # auto -> XLA
    with pytest.raises(ValueError, match="no sm_90 GPU"):
        dispatch.w4a4_matmul(qa, qb, backend="pallas")
    monkeypatch.setenv("FP4JAX_KERNELS", "on")
    with pytest.raises(ValueError, match="unavailable"):
        dispatch.w4a4_matmul(qa, qb)
