"""CPU tests of the packed NVFP4 quantize kernel with stochastic rounding,
``quantize.packed_sm90.quantize_nvfp4_1x16_sr`` (1x16 rows, SR), and its ``dispatch`` wiring.

* The kernels run in Mosaic GPU interpret mode and are compared bit for bit (codes of
  every block, NaN/Inf blocks included, E4M3 scale bits, tensor scale) with
  ``fp4jax.quantize`` on inputs with NaN, Inf, -0, tiny and huge values, with whole-row
  tiles and with the GPU's tilings (several CTA tiles per row / column tiles).
* The real kernels are lowered for CUDA on this machine (``jax.export``).
* ``dispatch``: reasons, argument errors, the XLA fallback off the GPU and the kernel
  wiring (pretending to be on sm_90, kernels in interpret mode).
GPU exactness: ``experiments/gpu_check.py packed_sr``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
fp4jax = pytest.importorskip("fp4jax")

from fp4jax.formats import NVFP4  # noqa: E402
from pallas_kernels import dispatch  # noqa: E402
from pallas_kernels.quantize import packed_sm90 as qk  # noqa: E402
from tests.checks import assert_packed_equal, export_cuda, packed_bits  # noqa: E402
from tests.interpret import InterpretGPUParams, needs_interpret  # noqa: E402
from tests.kernel_inputs import wild_input  # noqa: E402

IP = InterpretGPUParams() if InterpretGPUParams is not None else None


def test_e2m1_code_of_value():
    vals = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
    v = jnp.asarray(np.concatenate([vals, -vals]))
    got = np.asarray(jax.jit(qk.e2m1_code_of_value)(v))
    np.testing.assert_array_equal(got, np.arange(16))
    want = np.asarray(fp4jax.quantize(v, NVFP4).data.astype(jnp.float32))
    np.testing.assert_array_equal(want, np.asarray(v))  # scale 1 for this block


@needs_interpret
@pytest.mark.parametrize("tiling", [{}, {"g": 64, "rq": 2}])
def test_sr_rows_kernel_matches_xla(tiling):
    """Whole rows, one quad a tile; and the GPU tiling (2 row quads x 64 blocks a tile,
    2 x 2 tiles): the draw offsets of every tile."""
    x = wild_input((16, 2048), 6, zero_column_block=True)
    key = jax.random.key(21)
    got = qk.quantize_nvfp4_1x16_sr(x, key, interpret=IP, **tiling)
    want = fp4jax.quantize(x, NVFP4, rounding="stochastic", key=key)
    assert_packed_equal(got, packed_bits(want))
    if not tiling:  # the random bits matter: round-to-nearest and another key differ
        assert (np.asarray(got[0]) != packed_bits(fp4jax.quantize(x, NVFP4))[0]).sum() > 1000
        other = qk.quantize_nvfp4_1x16_sr(x, jax.random.key(22), interpret=IP)
        assert (np.asarray(got[0]) != np.asarray(other[0])).sum() > 1000


@pytest.mark.parametrize("variant", ["rows_sr", "rows_sr_c1024"])
def test_kernels_lower_for_cuda(variant):
    key = jax.random.key(0)
    f = {
        "rows_sr": lambda x: qk.quantize_nvfp4_1x16_sr(x, key),
        "rows_sr_c1024": lambda x: qk.quantize_nvfp4_1x16_sr(x.reshape(1024, 1024), key),
    }[variant]
    exp = export_cuda(f, jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16))
    assert "mosaic_gpu" in exp.mlir_module()


def test_supported_shapes_and_reasons():
    bf = jnp.bfloat16
    assert qk.supported_sr((4, 1024), bf) and not qk.supported_sr((6, 1024), bf)
    assert not qk.supported_sr((4, 512), bf) and not qk.supported_sr((4, 1024), jnp.float32)
    r = dispatch.quantize_unsupported_reason
    assert "stochastic" in r((6, 1024), bf, rounding="stochastic")
    assert "stochastic" in r((32, 1024), bf, block_2d=True, rounding="stochastic")
    # blocks along another axis than the last (16x1 along the tokens): the XLA path
    assert "axis" in r((256, 1024), bf, axis=0) and "axis" in r((4, 256, 256), bf, axis=0)
    rbg = jax.random.key(0, impl="rbg")
    assert "threefry" in r((4, 1024), bf, rounding="stochastic", key=rbg)
    if not dispatch.on_sm90():
        for kw in ({"rounding": "stochastic"}, {"rounding": "stochastic",
                                                "key": jax.random.key(1)}):
            assert r((256, 1024), bf, **kw) == "no sm_90 GPU"


def test_dispatch_argument_errors_and_xla_fallback(monkeypatch):
    if dispatch.on_sm90():
        pytest.skip("tests the fallback off the GPU")
    x = wild_input((256, 1024), 3, zero_column_block=True)
    key = jax.random.key(4)
    with pytest.raises(ValueError, match="key"):
        dispatch.quantize_packed(x, rounding="stochastic")
    with pytest.raises(ValueError, match="key"):
        dispatch.quantize(x, rounding="stochastic")
    with pytest.raises(ValueError, match="rounding"):
        dispatch.quantize_packed(x, rounding="up")
    with pytest.raises(ValueError, match="no sm_90 GPU"):
        dispatch.quantize_packed(x, backend="pallas")
    with pytest.raises(ValueError, match="bfloat16"):
        dispatch.quantize_packed(x.astype(jnp.float32), backend="pallas")
    monkeypatch.setenv("FP4JAX_KERNELS", "on")
    with pytest.raises(ValueError, match="unavailable"):
        dispatch.quantize_packed(x, rounding="stochastic", key=key)
    monkeypatch.delenv("FP4JAX_KERNELS")
    # off the GPU: the XLA path, in the same layouts
    got = dispatch.quantize_packed(x, rounding="stochastic", key=key)
    want = fp4jax.quantize(x, NVFP4, rounding="stochastic", key=key)
    assert_packed_equal(got, packed_bits(want))
    q = dispatch.quantize(x, axis=0, rounding="stochastic", key=key)
    want = fp4jax.quantize(x, NVFP4, axis=0, rounding="stochastic", key=key)
    assert_packed_equal(packed_bits(q), packed_bits(want))


@needs_interpret
def test_dispatch_kernel_path_wiring(monkeypatch):
    """Pretend to be on sm_90 with the kernels in interpret mode: dispatch's packed
    results and QuantizedArrays equal fp4jax.quantize's (SR rows of a stacked tensor; 16x1
    along axis 0 falls back to XLA)."""
    monkeypatch.setattr(dispatch, "on_sm90", lambda: True)
    monkeypatch.setattr(dispatch, "mosaic_api_reason", lambda: None)  # any JAX
    monkeypatch.setattr(qk, "quantize_nvfp4_1x16_sr", functools.partial(
        qk.quantize_nvfp4_1x16_sr, interpret=IP))
    key = jax.random.key(6)
    x = wild_input((256, 256), 9, zero_column_block=True)
    x3 = wild_input((8, 1024), 10, zero_column_block=True).reshape(2, 4, 1024)
    got = dispatch.quantize_packed(x3, rounding="stochastic", key=key, backend="pallas")
    want = fp4jax.quantize(x3, NVFP4, rounding="stochastic", key=key)
    assert_packed_equal(got, packed_bits(want))
    with pytest.raises(ValueError, match="axis"):
        dispatch.quantize(x, axis=0, backend="pallas")
    for k in (None, key):
        rounding = "nearest" if k is None else "stochastic"
        q = dispatch.quantize(x, axis=0, rounding=rounding, key=k)
        want = fp4jax.quantize(x, NVFP4, axis=0, rounding=rounding, key=k)
        assert (q.axis, q.block_2d, q.data.shape, q.scale.shape) == (
            want.axis, want.block_2d, want.data.shape, want.scale.shape)
        assert_packed_equal(packed_bits(q), packed_bits(want))
    q = dispatch.quantize(x3, rounding="stochastic", key=key, backend="pallas")
    want = fp4jax.quantize(x3, NVFP4, rounding="stochastic", key=key)
    assert (q.axis, q.data.shape) == (want.axis, want.data.shape)
    assert_packed_equal(packed_bits(q), packed_bits(want))
