"""CPU tests of the MXFP4 GEMM on FP8 tensor cores (pallas_kernels/gemm/mxfp4_fp8wgmma_sm90.py).

* Block partial sums: every product of two E2M1 values and every adversarial 32-block sum
  is an integer number of quarters below 2^13, and a NumPy model of an adder that keeps
  13 fraction bits below the largest product's binade (truncating the rest) sums every
  block exactly (with fewer bits it does not: the check can fail).
* ``emulate`` (XLA) equals a NumPy float32 replay of the promotion rule bit for bit, lies
  within the float32 summation bound of the exact float64 product on adversarial inputs,
  and agrees with the repository's XLA reference (``fp4jax.quantize`` ->
  ``fp4jax.dequantize`` -> float32 HIGHEST matmul) within both sums' bounds.
* The kernel is lowered for CUDA on this CPU (``jax.export``: the whole Mosaic GPU
  lowering), and its ``unsupported_reason`` is checked.
The kernel itself runs on the GPU only: experiments/mxfp4_fp8_gpu_check.py (bit for bit
against ``emulate``).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
fp4jax = pytest.importorskip("fp4jax")

from pallas_kernels.gemm import mxfp4_fp8wgmma_sm90 as mx  # noqa: E402
from tests.checks import export_cuda  # noqa: E402

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float64)
SIGNED = np.concatenate([E2M1, -E2M1])
F8 = jnp.float8_e4m3fn
U = 2.0**-24


# --------------------------------------------------------------------------- partial sums


def truncating_block_sum(products: np.ndarray, frac_bits: int) -> np.ndarray:
    """NumPy model of a fixed-point block adder: products aligned to the largest
    product's binade 2^E (E = floor(log2 max|p|)) and truncated to ``frac_bits`` bits
    below it, then summed exactly (the alignment-and-truncation model of Hopper's FP8
    accumulation, DeepSeek-V3 report sec. 3.3.2). ``products`` (..., 32) float64."""
    mx_ = np.max(np.abs(products), axis=-1, keepdims=True)
    e = np.floor(np.log2(np.where(mx_ > 0, mx_, 1.0)))
    ulp = np.exp2(e - frac_bits)
    return np.sum(np.trunc(products / ulp) * ulp, axis=-1)


def _adversarial_blocks(rng):
    blocks = [np.full((2, 32), 6.0), np.zeros((2, 32)), np.full((2, 32), 0.5)]
    mixed = np.full((2, 32), 6.0)
    mixed[1, ::2] = -6.0
    blocks.append(mixed)
    tiny_big = np.full((2, 32), 0.5)
    tiny_big[:, 0] = 6.0  # largest product 36 with 31 products of 1/4 below it
    blocks.append(tiny_big)
    blocks.append(SIGNED[rng.integers(0, 16, (2, 32))])
    a = np.stack([b[0] for b in blocks])
    b = np.stack([b[1] if len(b) > 1 else b[0] for b in blocks])
    ra = SIGNED[rng.integers(0, 16, (20000, 32))]
    rb = SIGNED[rng.integers(0, 16, (20000, 32))]
    return np.concatenate([a, ra]), np.concatenate([b, rb])


def test_every_e2m1_product_is_quarters_up_to_36():
    p = np.outer(SIGNED, SIGNED)
    assert np.all(p * 4 == np.round(p * 4))
    assert np.max(np.abs(p)) == 36.0
    # every product is exactly representable in float8_e4m3fn's inputs' float32 product
    assert np.all(np.asarray(jnp.asarray(SIGNED, F8), np.float64) == SIGNED)


def test_block_sums_are_quarters_below_2_13():
    rng = np.random.default_rng(0)
    a, b = _adversarial_blocks(rng)
    s = np.sum(a * b, axis=-1)
    q = s * 4
    assert np.all(q == np.round(q))
    assert np.max(np.abs(q)) == 1152 * 4 < 2**13  # the all-max block reaches the bound
    assert np.max(np.abs(q)) > 2**12  # 13 bits are needed, not fewer


@pytest.mark.parametrize("frac_bits,exact", [(13, True), (7, True), (6, False), (4, False)])
def test_truncating_adder_is_exact_with_enough_bits(frac_bits, exact):
    """Products are multiples of 1/4 and the largest binade is at most 2^5 (36), so 7
    fraction bits below it resolve 1/4 and 13 (what ~14-bit FP8 accumulation keeps) are
    ample; with 6 or fewer some block (a 36 beside quarters) loses its quarters."""
    rng = np.random.default_rng(1)
    a, b = _adversarial_blocks(rng)
    p = a * b
    got = truncating_block_sum(p, frac_bits)
    assert np.array_equal(got, np.sum(p, axis=-1)) == exact


def test_emulate_partials_equal_numpy_block_sums():
    rng = np.random.default_rng(2)
    a = SIGNED[rng.integers(0, 16, (8, 128))]
    b = SIGNED[rng.integers(0, 16, (4, 128))]
    ea = np.full((8, 4), 127, np.uint8)
    eb = np.full((4, 4), 127, np.uint8)
    # one block at a time (the others zeroed): emulate returns that block's partial
    for kb in range(4):
        mask = np.zeros(128)
        mask[kb * 32:(kb + 1) * 32] = 1
        out = np.asarray(mx.emulate(jnp.asarray(a * mask, F8), jnp.asarray(ea),
                                    jnp.asarray(b, F8), jnp.asarray(eb)))
        ref = (a * mask) @ b.T
        assert np.array_equal(out.astype(np.float64), ref)


# --------------------------------------------------------------------------- promotion


def test_scale_f32_is_two_to_the_e_minus_127():
    e = np.arange(256, dtype=np.uint8)
    s = np.asarray(mx.scale_f32(jnp.asarray(e)))
    normal = e[1:255]
    assert np.array_equal(s[1:255], np.ldexp(np.float32(1), normal.astype(np.int32) - 127))
    assert np.isnan(s[255])
    e8 = jax.lax.bitcast_convert_type(jnp.asarray(e), jnp.float8_e8m0fnu)
    assert np.array_equal(np.asarray(mx.scale_f32(e8))[1:255], s[1:255])


def numpy_balanced(ea, eb):
    """NumPy replay of the per-block-column shift: A's exponents of block column kb
    centred on 2^0 (c = 127 - floor((max + min) / 2)), B's moved by -c, both clamped to
    float32's normal, finite powers of two or 0 below them."""
    ea = ea.astype(np.int64)
    eb = eb.astype(np.int64)
    c = 127 - (ea.max(axis=0) + ea.min(axis=0)) // 2  # (kb,)
    xa, xb = ea - 127 + c, eb - 127 - c
    sa = np.where(xa < -126, 0, np.ldexp(np.float32(1), np.clip(xa, -126, 127)))
    sb = np.where(xb < -126, 0, np.ldexp(np.float32(1), np.clip(xb, -126, 127)))
    return sa.astype(np.float32), sb.astype(np.float32)


def numpy_promotion(a, ea, b, eb):
    """Independent NumPy float32 replay of the kernel's rule: exact block partials
    (float64, then float32: exact), ``acc + (p * sa') * sb'`` in float32, blocks in K
    order."""
    m, k = a.shape
    acc = np.zeros((m, b.shape[0]), np.float32)
    sa, sb = numpy_balanced(ea, eb)
    for kb in range(k // 32):
        sl = slice(32 * kb, 32 * kb + 32)
        p = (a[:, sl] @ b[:, sl].T).astype(np.float32)
        acc = (acc + (p * sa[:, kb, None]) * sb[None, :, kb]).astype(np.float32)
    return acc


def test_balanced_scales_keep_the_product():
    rng = np.random.default_rng(5)
    ea = rng.integers(0, 255, (64, 8)).astype(np.uint8)
    eb = (254 - ea[:8].astype(np.int64) + rng.integers(-20, 21, (8, 8))).clip(0, 254)
    eb = eb.astype(np.uint8)
    sa, sb = (np.asarray(x) for x in mx.balanced_scales(jnp.asarray(ea), jnp.asarray(eb)))
    ra, rb = numpy_balanced(ea, eb)
    assert np.array_equal(sa, ra.T) and np.array_equal(sb, rb.T)
    prod = sa.astype(np.float64)[:, :, None] * sb.astype(np.float64)[:, None, :]
    true = np.ldexp(1.0, ea.T.astype(np.int64)[:, :, None] + eb.T.astype(np.int64)[:, None, :]
                    - 254)
    assert np.all(np.isfinite(sa)) and np.all(np.isfinite(sb))
    assert np.all((sa >= 2.0**-126) | (sa == 0)) and np.all((sb >= 2.0**-126) | (sb == 0))
    # the product is kept wherever neither factor had to be clamped
    a_shift = ea.T.astype(np.int64) - 127 + (127 - (ea.max(0).astype(np.int64)
                                                     + ea.min(0)) // 2)[:, None]
    ok_a = (a_shift >= -126) & (a_shift <= 127)
    with np.errstate(divide="ignore"):
        b_shift = np.log2(sb.astype(np.float64))
    ok_b = (b_shift > -126) & (b_shift < 127)
    ok = ok_a[:, :, None] & ok_b[:, None, :]
    assert ok.mean() > 0.5
    assert np.array_equal(prod[ok], true[ok])
    nan = mx.balanced_scales(jnp.full((4, 2), 255, jnp.uint8), jnp.full((4, 2), 255, jnp.uint8))
    assert np.isnan(np.asarray(nan[0])).all() and np.isnan(np.asarray(nan[1])).all()


def exact64(a, ea, b, eb):
    """Exact (float64) product of the dequantized operands and the sum of |terms|."""
    sa = np.repeat(np.ldexp(1.0, ea.astype(np.int64) - 127), 32, axis=1)
    sb = np.repeat(np.ldexp(1.0, eb.astype(np.int64) - 127), 32, axis=1)
    av, bv = a * sa, b * sb
    return av @ bv.T, np.abs(av) @ np.abs(bv).T


def make_case(name, m, k, n, seed):
    """Adversarial operands whose block terms lie in float32's normal range (the scales
    themselves span E8M0's range)."""
    rng = np.random.default_rng(seed)
    kb = k // 32
    a = SIGNED[rng.integers(0, 16, (m, k))]
    b = SIGNED[rng.integers(0, 16, (n, k))]
    if name == "random":
        ea = rng.integers(117, 138, (m, kb))
        eb = rng.integers(117, 138, (n, kb))
    elif name == "allmax_mixed_sign":
        a = 6.0 * np.where(rng.random((m, k)) < .5, -1, 1)
        b = 6.0 * np.where(rng.random((n, k)) < .5, -1, 1)
        ea = rng.integers(120, 135, (m, kb))
        eb = rng.integers(120, 135, (n, kb))
    elif name == "allmax_same_sign":
        a, b = np.full((m, k), 6.0), np.full((n, k), -6.0)
        ea = rng.integers(125, 130, (m, kb))
        eb = rng.integers(125, 130, (n, kb))
    elif name == "zero_blocks_extreme_scales":  # zero blocks at E8M0's ends give 0, not NaN
        za = rng.random((m, kb)) < .5
        zb = rng.random((n, kb)) < .5
        a = a * np.repeat(~za, 32, axis=1)
        b = b * np.repeat(~zb, 32, axis=1)
        ea = np.where(za, rng.choice([0, 1, 253, 254], (m, kb)), rng.integers(100, 155, (m, kb)))
        eb = np.where(zb, rng.choice([0, 1, 253, 254], (n, kb)), rng.integers(100, 155, (n, kb)))
        # a zero A block meeting a nonzero B block of large scale: (0 * sa) * sb = 0
    elif name == "scales_span_e8m0":  # per-block scales over the whole E8M0 range
        base = rng.integers(8, 247, (1, kb))
        ea = base + rng.integers(-8, 9, (m, kb))
        eb = 254 - base + rng.integers(-8, 9, (n, kb))
    else:
        raise ValueError(name)
    return a, ea.astype(np.uint8), b, eb.astype(np.uint8)


CASES = ["random", "allmax_mixed_sign", "allmax_same_sign", "zero_blocks_extreme_scales",
         "scales_span_e8m0"]


@pytest.mark.parametrize("case", CASES)
def test_emulate_bitwise_numpy_and_within_bound_of_exact(case):
    m, k, n = 32, 1024, 24
    a, ea, b, eb = make_case(case, m, k, n, seed=CASES.index(case))
    out = np.asarray(mx.emulate(jnp.asarray(a, F8), jnp.asarray(ea), jnp.asarray(b, F8),
                                jnp.asarray(eb)))
    ref = numpy_promotion(a, ea, b, eb)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
    ex, absum = exact64(a, ea, b, eb)
    assert not np.isnan(out).any()
    bound = (k // 32) * U * absum  # recursive summation of K/32 exact terms
    err = np.abs(out.astype(np.float64) - ex)
    assert np.all(err <= bound), np.max(err / np.where(bound > 0, bound, 1))
    if case == "allmax_same_sign":  # every block sum is -1152, a float32-exact total
        assert np.array_equal(out.astype(np.float64), ex)


def test_bound_check_can_fail():
    """A wrong promotion (scale of the previous block) is caught by the bound."""
    m, k, n = 16, 256, 8
    a, ea, b, eb = make_case("random", m, k, n, seed=9)
    wrong = np.asarray(mx.emulate(jnp.asarray(a, F8), jnp.asarray(np.roll(ea, 1, axis=1)),
                                  jnp.asarray(b, F8), jnp.asarray(eb)))
    ex, absum = exact64(a, ea, b, eb)
    assert np.any(np.abs(wrong - ex) > (k // 32) * U * absum)


@pytest.mark.parametrize("x_exp,w_exp", [((-3, 3), (-3, 3)), ((-60, 60), (-60, 60)),
                                         ((-122, -100), (100, 122))])
def test_emulate_matches_repo_xla_reference(x_exp, w_exp):
    """Operands quantized by ``fp4jax.quantize`` (MXFP4, along K): ``emulate`` on their
    codes and exponents vs ``dequantize`` + float32 HIGHEST matmul. Both round float32
    sums of the same exact terms (K/32 block terms vs K element products), so they agree
    within (K/32 + K) u sum|a_k b_k|."""
    rng = np.random.default_rng(abs(x_exp[0]))
    m, k, n = 32, 512, 16
    x = rng.standard_normal((m, k)) * np.exp2(rng.integers(*x_exp, (m, k // 32, 1))
                                              ).repeat(32, -1).reshape(m, k)
    w = rng.standard_normal((n, k)) * np.exp2(rng.integers(*w_exp, (n, k // 32, 1))
                                              ).repeat(32, -1).reshape(n, k)
    x[0, :32] = 0.0  # a zero block
    qx = fp4jax.quantize(jnp.asarray(x, jnp.float32), fp4jax.MXFP4, axis=-1)
    qw = fp4jax.quantize(jnp.asarray(w, jnp.float32), fp4jax.MXFP4, axis=-1)
    codes = [q.data.astype(F8) for q in (qx, qw)]
    exps = [jax.lax.bitcast_convert_type(q.scale, jnp.uint8) for q in (qx, qw)]
    out = np.asarray(mx.emulate(codes[0], exps[0], codes[1], exps[1]), np.float64)
    dx = fp4jax.dequantize(qx)
    dw = fp4jax.dequantize(qw)
    ref = np.asarray(jnp.dot(dx, dw.T, precision=jax.lax.Precision.HIGHEST), np.float64)
    absum = np.abs(np.asarray(dx, np.float64)) @ np.abs(np.asarray(dw, np.float64)).T
    bound = (k // 32 + k) * U * absum
    assert np.all(np.abs(out - ref) <= bound)
    exact = np.asarray(dx, np.float64) @ np.asarray(dw, np.float64).T
    assert np.all(np.abs(out - exact) <= (k // 32) * U * absum)


# --------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_three_gemms_through_k_major(gemm):
    """fprop x W, dgrad dy W^T and wgrad x^T dy as ``A @ Bt^T`` of K-major operands
    (``k_major`` for the contraction-first ones), against the exact product (the
    emulation stands in for the kernel, which has the same operand contract)."""
    rng = np.random.default_rng(["fprop", "dgrad", "wgrad"].index(gemm))
    t, d, f = 64, 96, 128  # tokens, in, out

    def operand(r, c, axis):  # E2M1 values (r, c) blocked along ``axis``, exponents
        v = SIGNED[rng.integers(0, 16, (r, c))]
        shape = (r, c // 32) if axis == 1 else (r // 32, c)
        return v, rng.integers(120, 135, shape).astype(np.uint8)

    def deq(v, e, axis):
        return v * np.repeat(np.ldexp(1.0, e.astype(np.int64) - 127), 32, axis=axis)

    if gemm == "fprop":  # x (T, D) along D; W (D, F) along D: contraction-first
        (xa, xe), (wa, we) = operand(t, d, 1), operand(d, f, 0)
        a, sa = xa, xe
        b, sb = k_major(wa, we)
        ref = deq(xa, xe, 1) @ deq(wa, we, 0)
    elif gemm == "dgrad":  # dy (T, F) along F; W (D, F) along F: already K-major
        (ga, ge), (wa, we) = operand(t, f, 1), operand(d, f, 1)
        a, sa, b, sb = ga, ge, wa, we
        ref = deq(ga, ge, 1) @ deq(wa, we, 1).T
    else:  # x (T, D) and dy (T, F), both along T: contraction-first
        (xa, xe), (ga, ge) = operand(t, d, 0), operand(t, f, 0)
        a, sa = k_major(xa, xe)
        b, sb = k_major(ga, ge)
        ref = deq(xa, xe, 0).T @ deq(ga, ge, 0)
    a, sa, b, sb = (np.asarray(x) for x in (a, sa, b, sb))
    out = np.asarray(mx.emulate(jnp.asarray(a, F8), jnp.asarray(sa), jnp.asarray(b, F8),
                                jnp.asarray(sb)), np.float64)
    absum = np.abs(deq(a, sa, 1)) @ np.abs(deq(b, sb, 1)).T
    assert out.shape == ref.shape
    assert np.all(np.abs(out - ref) <= (a.shape[1] // 32) * U * absum)


def k_major(codes, scales):
    return mx.k_major(jnp.asarray(codes), jnp.asarray(scales))


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_lowers_for_cuda(out_dtype):
    m, k, n = 256, 512, 256
    exp = export_cuda(lambda a, sa, b, sb: mx.mxfp4_gemm(a, sa, b, sb, out_dtype=out_dtype),
                      jax.ShapeDtypeStruct((m, k), F8),
                      jax.ShapeDtypeStruct((m, k // 32), jnp.uint8),
                      jax.ShapeDtypeStruct((n, k), F8),
                      jax.ShapeDtypeStruct((n, k // 32), jnp.uint8))
    assert exp.out_avals[0].shape == (m, n)
    assert exp.out_avals[0].dtype == out_dtype
    assert "mosaic_gpu" in exp.mlir_module().lower()


def test_unsupported_reason():
    assert mx.unsupported_reason(8192, 8192, 8192) is None
    assert mx.unsupported_reason(16384, 512, 2048) is None
    assert "K=" in mx.unsupported_reason(256, 96, 256)
    assert "M=" in mx.unsupported_reason(64, 128, 128)
    assert "N=" in mx.unsupported_reason(128, 128, 96)
    assert "float8_e4m3fn" in mx.unsupported_reason(128, 128, 128, a_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="K="):
        mx.mxfp4_gemm(jnp.zeros((128, 96), F8), jnp.zeros((128, 3), jnp.uint8),
                      jnp.zeros((128, 96), F8), jnp.zeros((128, 3), jnp.uint8))


# --------------------------------------------------------------------------- fp4jax.dot


def test_fp8_gemms_of_recipes():
    """The GEMMs whose two operands are MX FP4 codes the FP8 GEMM reads."""
    from pallas_kernels import dot_sm90

    R = fp4jax.recipes
    assert dot_sm90.fp8_gemms(R.get("mxfp4")) == {"fprop", "dgrad", "wgrad"}
    assert dot_sm90.fp8_gemms(R.get("nvfp4")) == set()
    assert dot_sm90.fp8_gemms(R.get("bf16")) == set()
    assert dot_sm90.fp8_gemms(R.parse("mxfp4(fprop.lhs.fmt=nvfp4)")) == {"dgrad", "wgrad"}


def _dot_grads(recipe, impl, x, w, ct, key):
    def f(x, w):
        y = fp4jax.dot(x, w, recipe=recipe, key=key, implementation=impl)
        return jnp.sum(y.astype(jnp.float32) * ct), y
    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, w)
    return [np.asarray(v, np.float64) for v in (y, dx, dw)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dot_on_the_fp8_path_matches_the_reference(monkeypatch, dtype):
    """``fp4jax.dot(recipe="mxfp4", implementation="pallas_fp8")`` in interpret mode (the
    GEMMs by ``emulate``, the kernel's arithmetic): the three GEMMs take the FP8 path
    (operands as codes, the 32x32 weight tiles' scales per row, the wgrad operands
    K-major after the RHT and stochastic rounding) and y, dx, dw agree with the XLA
    reference to float32 summation order: within (K/32) 2^-24 sum |a b| of each output,
    with the rows' blocks spanning 2^40."""
    from pallas_kernels import dot_sm90

    monkeypatch.setenv("FP4JAX_KERNELS", "interpret")
    calls = []
    real = mx.emulate
    monkeypatch.setattr(mx, "emulate", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    m, k, n = 256, 512, 384
    kx, kw, kc, kk = jax.random.split(jax.random.key(3), 4)
    span = jnp.exp2(jnp.linspace(-20, 20, m))[:, None]  # row magnitudes over 40 binades
    x = (jax.random.normal(kx, (m, k)) * span).astype(dtype)
    w = (0.05 * jax.random.normal(kw, (k, n))).astype(dtype)
    ct = jax.random.normal(kc, (m, n)).astype(dtype)
    ref = _dot_grads("mxfp4", "xla", x, w, ct, kk)
    got = _dot_grads("mxfp4", "pallas_fp8", x, w, ct, kk)
    assert set(calls) == {(m, k), (m, n), (k, m)}  # fprop, dgrad, wgrad A
    assert dot_sm90.FP8_PROVIDER.gemm == "fp8"
    # bound: the float32 sum of |terms| of each output, from the reference's operands
    eps = 2.0**-24 * (max(m, k, n) // 32 + 1)
    out_ulp = 2.0**-8 if dtype == jnp.bfloat16 else 2.0**-24
    for name, r, g in zip(("y", "dx", "dw"), ref, got, strict=True):
        scale = np.abs(r).max()
        assert np.all(np.abs(g - r) <= eps * 40 * scale + 2 * out_ulp * np.abs(r)), name


def test_fp8_path_declines_what_it_cannot_read(monkeypatch):
    """Unaligned shapes keep the bfloat16 operand kernels and GEMM; NVFP4 never takes the
    FP8 path; a fp8 choice from the environment is the default of ``pallas``."""
    from fp4jax import backends as B
    from pallas_kernels import dot_sm90

    monkeypatch.setenv("FP4JAX_KERNELS", "interpret")
    monkeypatch.setenv("FP4JAX_KERNEL_GEMM", "fp8")
    mxr = fp4jax.recipes.get("mxfp4")
    be = B.select("pallas", B.DotCall(mxr, 1, 256, 256, 256, False))[0]
    assert be.gemm_impl == "fp8" and be.fp8 == {"fprop", "dgrad", "wgrad"}
    nv = B.select("pallas", B.DotCall(fp4jax.recipes.get("nvfp4"), 1, 256, 256, 256, False))[0]
    assert nv.fp8 == frozenset()
    q = fp4jax.quantize(jnp.ones((1, 96, 128)), "mxfp4")
    assert "blocked along another axis" in dot_sm90.fp8_operand_reason(q, 1)
    assert dot_sm90.fp8_operand_reason(q, 2) is None
    assert "codes" in dot_sm90.fp8_operand_reason(None, 2)
    monkeypatch.setenv("FP4JAX_KERNEL_GEMM", "fp9")
    with pytest.raises(ValueError, match="FP4JAX_KERNEL_GEMM='fp9'"):
        dot_sm90.gemm_backend()


def test_dot_on_the_fp8_path_lowers_for_cuda(monkeypatch):
    """Forward and backward of ``fp4jax.dot(recipe="mxfp4")`` on the GPU's FP8 path,
    lowered for CUDA: three Mosaic GPU GEMM kernels, no bfloat16 operand kernel."""
    from pallas_kernels import dot_sm90

    monkeypatch.delenv("FP4JAX_KERNELS", raising=False)
    monkeypatch.setattr(dot_sm90, "on_sm90", lambda: True)
    monkeypatch.setattr(dot_sm90, "mosaic_api_reason", lambda: None)
    kk = jax.random.key(0)

    def f(x, w, ct):
        def loss(x, w):
            y = fp4jax.dot(x, w, recipe="mxfp4", key=kk, implementation="pallas_fp8")
            return jnp.sum(y.astype(jnp.float32) * ct)
        return jax.grad(loss, argnums=(0, 1))(x, w)

    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    text = export_cuda(f, sd((256, 512), bf), sd((512, 384), bf), sd((256, 384), bf)
                       ).mlir_module()
    assert text.count("mosaic_gpu") >= 3
