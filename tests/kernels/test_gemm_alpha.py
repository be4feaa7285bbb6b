"""CPU tests of the Pallas GEMM with the alpha epilogue (``pallas_kernels/gemm/alpha_sm90``)
and of how ``fp4jax.dot``'s kernel path and the W4A4 two-pass GEMM route to it.

The kernel itself (warp-specialized, Warpgroup lowering semantics) has no CPU interpret
mode: here it is lowered for CUDA in all three layouts (the lowering traces the whole
body: tiling, transposed shared-memory operands, shared-memory budget), and its inputs are
validated; its numerics are checked on the GPU (``experiments/gpu_check.py gemm_alpha``: bf16
outputs equal to XLA's f32 dot times alpha at 4 shapes x 3 layouts, run 27).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from fp4jax import backends as B  # noqa: E402
from pallas_kernels import dot_sm90  # noqa: E402
from pallas_kernels.gemm import alpha_sm90 as ga  # noqa: E402
from tests.checks import export_cuda  # noqa: E402


def _export(f, *shapes):
    return export_cuda(f, *shapes).mlir_module()


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False)])
def test_gemm_alpha_lowers_for_cuda(trans_a, trans_b):
    m, k, n = 256, 384, 512
    a = jax.ShapeDtypeStruct((k, m) if trans_a else (m, k), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((n, k) if trans_b else (k, n), jnp.bfloat16)
    al = jax.ShapeDtypeStruct((), jnp.float32)
    text = _export(lambda a, b, al: ga.gemm_alpha(a, b, al, trans_a=trans_a, trans_b=trans_b),
                   a, b, al)
    assert "mosaic_gpu" in text


def test_gemm_alpha_rejects_bad_input():
    a = jnp.zeros((256, 128), jnp.bfloat16)
    b = jnp.zeros((128, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="bf16 operands"):
        ga.gemm_alpha(a.astype(jnp.float32), b, 1.0)
    with pytest.raises(ValueError, match="2-D"):
        ga.gemm_alpha(a[None], b, 1.0)
    with pytest.raises(ValueError, match="contraction sizes differ"):
        ga.gemm_alpha(a, b[:64], 1.0)
    with pytest.raises(ValueError, match="N % 256 == 0"):
        ga.gemm_alpha(a, b[:, :128], 1.0)
    assert ga.supported(128, 128, 256) and not ga.supported(128, 128, 128)
    assert not ga.supported(64, 128, 256) and not ga.supported(128, 96, 256)


def test_reference_is_alpha_times_the_f32_product():
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((8, 16)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((16, 4)), jnp.bfloat16)
    want = (np.asarray(a, np.float64) @ np.asarray(b, np.float64)) * np.float32(0.37)
    got = np.asarray(ga.reference(a, b, 0.37, out_dtype=jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    got_t = ga.reference(a.T, b.T, 0.37, trans_a=True, trans_b=True, out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(got_t), got)


def test_kernel_path_gemm_routing(monkeypatch):
    """The kernel path's GEMM takes gemm_alpha only on the GPU ("on"), with FP4JAX_KERNEL_GEMM
    at its default, bf16 output and tile-aligned sizes of at least MIN_MKN; the XLA einsum
    otherwise (the same values here on the CPU)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1, 256, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1, 128, 256)), jnp.bfloat16)
    sx, sw = jnp.float32(0.5), jnp.float32(3.0)
    want = B.einsum_scaled("bmk,bkn->bmn", x, w, sx, sw,
                           jax.lax.Precision.HIGHEST).astype(jnp.bfloat16)

    def gemm(sub, a, b, out_dtype, mode, impl):
        chain = (dot_sm90.HopperBackend(mode, impl), B.XLA)
        return B.run_gemm(chain, sub, B.Operand.from_scaled(a, sx),
                          B.Operand.from_scaled(b, sw), out_dtype)

    for kmode, impl in (("interpret", "pallas"), ("on", "xla")):
        got = gemm("bmk,bkn->bmn", x, w, jnp.bfloat16, kmode, impl)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

    def lowered(sub, a, b, out_dtype=jnp.bfloat16):
        return _export(lambda a, b: gemm(sub, a, b, out_dtype, "on", "pallas"), a, b)

    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    big = sd((1, 4096, 4096), bf)  # M*K*N = 2^36 = ga.MIN_MKN
    assert "mosaic_gpu" in lowered("bmk,bkn->bmn", big, big)
    assert "mosaic_gpu" in lowered("bmn,bkn->bmk", big, big)
    assert "mosaic_gpu" in lowered("bmk,bmn->bkn", big, big)
    # an f32 output, N not a multiple of 256, or below MIN_MKN: XLA
    assert "mosaic_gpu" not in lowered("bmk,bkn->bmn", big, big, jnp.float32)
    assert "mosaic_gpu" not in lowered("bmk,bkn->bmn", big, sd((1, 4096, 4224), bf))
    assert ga.supported(256, 128, 256) and not ga.preferred(256, 128, 256)
    assert "mosaic_gpu" not in lowered("bmk,bkn->bmn", sd((1, 256, 128), bf),
                                       sd((1, 128, 256), bf))
    monkeypatch.setenv("FP4JAX_KERNEL_GEMM", "cublas")
    with pytest.raises(ValueError, match="FP4JAX_KERNEL_GEMM"):
        dot_sm90.gemm_backend()
