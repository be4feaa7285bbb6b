"""The Blackwell (sm_100+) backend of ``fp4jax.dot`` on the CPU: ``jax.nn.scaled_matmul`` on
the library's own quantized operands (``pallas_kernels/gemm/blockscale_sm100``), chosen by
``pallas_kernels.dot_sm100.native_mode``.

What is checked here, without Blackwell hardware:
* the scale swizzle (``swizzle_scales_128x4``) against a NumPy loop over the documented
  per-element offset (cuBLAS "1D Block Scaling Factors Layout");
* the K-major operands (1x16 and 16x16 scales, both contracted axes, padding) against
  ``scaled_data``;
* ``fp4jax.dot`` forward + backward with ``FP4JAX_KERNELS=native`` (the backend forced on
  the CPU) against the XLA path, bit for bit: both are XLA float32 dots over the same exact
  products on the CPU (see ``blockscale_sm100``'s docstring), for the three GEMMs, partial
  blocks and padded K, 2D weights, SR and the RHT, a batched ``dot_general``;
* that ``jax.nn.scaled_matmul`` itself is what runs: JAX >= 0.11 lowers it on the CPU; on
  JAX 0.10.2 (no CPU lowering) the test registers a CPU lowering of JAX's primitive made
  of the documented definition, so JAX's own front end (argument checks, the partitioned
  wrapper primitive, jit/grad) runs around it.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import fp4jax  # noqa: E402
from fp4jax import backends as B  # noqa: E402
from fp4jax import quantization as qz  # noqa: E402
from pallas_kernels import dot_sm90, dot_sm100, support  # noqa: E402
from pallas_kernels.gemm import blockscale_sm100 as bs  # noqa: E402
from tests.checks import export_cuda  # noqa: E402


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """CPU checks, also when a GPU is the default device (the GPU machine's pytest runs with
    JAX_PLATFORMS=cuda,cpu): on a GPU, ``experiments/blackwell_check.py`` is the check."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


# ---------------------------------------------------------------------------
# The scale layout.
# ---------------------------------------------------------------------------

def _documented_swizzle(s: np.ndarray) -> np.ndarray:
    """cuBLAS' 1D block scaling factors layout, element by element: 128x4 tiles of 512
    bytes, tiles row-major, offset ``16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4`` inside."""
    r_, c_ = s.shape
    nrt, nct = -(-r_ // 128), -(-c_ // 4)
    out = np.zeros(nrt * nct * 512, s.dtype)
    for r in range(r_):
        for c in range(c_):
            tile = (r // 128) * nct + c // 4
            out[tile * 512 + 16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4] = s[r, c]
    return out.reshape(nrt, nct, 32, 16)


@pytest.mark.parametrize("shape", [(128, 4), (256, 8), (200, 10), (1, 1), (130, 3)])
def test_swizzle_is_the_documented_layout(shape):
    s = np.arange(1, np.prod(shape) + 1, dtype=np.int32).reshape(shape)  # all distinct
    got = np.asarray(bs.swizzle_scales_128x4(jnp.asarray(s)))
    np.testing.assert_array_equal(got, _documented_swizzle(s))


def test_swizzle_test_catches_a_wrong_rule():
    """The NumPy reference tells the layout from its near misses (the 32 and 4 row groups
    swapped: the plain row-major (128, 4) tile)."""
    s = np.arange(128 * 4, dtype=np.int32).reshape(128, 4)
    plain = s.reshape(1, 1, 32, 16)
    assert not np.array_equal(plain, _documented_swizzle(s))
    with pytest.raises(ValueError, match="scales must be 2-D"):
        bs.swizzle_scales_128x4(jnp.zeros((2, 128, 4)))


def _q(shape, block_2d=False, axis=-1, fmt=fp4jax.NVFP4, seed=0):
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    x = x * jnp.exp(jax.random.normal(jax.random.key(seed + 1), shape))  # wide range
    return fp4jax.quantize(x, fmt, axis=axis, block_2d=block_2d)


@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("contract", [1, 2])
def test_kmajor_operand_is_scaled_data(block_2d, contract):
    q = _q((2, 40, 72), block_2d=block_2d, axis=contract - 3)
    codes, scales = bs.kmajor_operand(q, contract)
    k = q.shape[contract]
    kp = -(-k // bs.K_ALIGN) * bs.K_ALIGN
    rows = q.shape[3 - contract]
    assert codes.dtype == jnp.float4_e2m1fn and scales.dtype == jnp.float8_e4m3fn
    assert codes.shape == (2, rows, kp) and scales.shape == (2, rows, kp // bs.BLOCK)
    got = (np.asarray(codes, np.float32)
           * np.repeat(np.asarray(scales, np.float32), bs.BLOCK, axis=-1))
    want = np.asarray(qz.scaled_data(q, jnp.float32))
    want = np.moveaxis(want, contract, -1)
    np.testing.assert_array_equal(got[..., :k], want)
    assert not got[..., k:].any()


def test_operand_reasons_and_errors():
    assert bs.operand_reason(_q((1, 32, 64)), 2) is None
    assert "e8m0" in bs.operand_reason(_q((1, 32, 64), fmt=fp4jax.MXFP4), 2)
    assert "not quantized" in bs.operand_reason(jnp.zeros((1, 32, 64)), 2)
    assert "axis 2" in bs.operand_reason(_q((1, 32, 64)), 1)
    assert "E2M1" in bs.operand_reason(_q((1, 32, 64), fmt="mxfp8_e4m3"), 2)
    mx = _q((1, 32, 64), fmt=fp4jax.MXFP4)  # E8M0 scales, block 32: the XLA path's GEMM
    assert dot_sm100.native_gemm("bmk,bkn->bmn", mx, _q((1, 64, 32), axis=1),
                                mode="scaled_matmul", out_dtype=jnp.float32) is None
    assert dot_sm100.native_gemm("bmk,bkn->bmn", mx, mx, out_dtype=jnp.float32,
                                mode="off") is None
    with pytest.raises(ValueError, match="kmajor_operand: blocks run along axis 2"):
        bs.kmajor_operand(_q((1, 32, 64)), 1)
    with pytest.raises(ValueError, match="unknown GEMM layout"):
        dot_sm100.native_gemm("bmk,bnk->bmn", None, None, out_dtype=jnp.float32,
                             mode="scaled_matmul")
    with pytest.raises(ValueError, match="mode must be one of"):
        dot_sm100.native_gemm("bmk,bkn->bmn", None, None, out_dtype=jnp.float32, mode="on")


# ---------------------------------------------------------------------------
# The dispatcher.
# ---------------------------------------------------------------------------

def test_native_mode_setting(monkeypatch):
    monkeypatch.delenv("FP4JAX_KERNELS", raising=False)
    if jax.devices()[0].platform == "cpu":  # the default on this machine: no change
        assert not support.on_sm100() and dot_sm100.native_mode() == "off"
    for cc, sm90, sm100 in (((9, 0), True, False), ((10, 0), False, True),
                            ((10, 3), False, True), ((12, 0), False, True),
                            ((8, 0), False, False), (None, False, False)):
        monkeypatch.setattr(support, "_compute_capability", lambda v=cc: v)
        assert (support.on_sm90(), support.on_sm100()) == (sm90, sm100), cc
    monkeypatch.undo()
    monkeypatch.delenv("FP4JAX_KERNELS", raising=False)
    for sm100 in (False, True):
        monkeypatch.setattr(dot_sm100, "on_sm100", lambda v=sm100: v)
        hw = "scaled_matmul" if sm100 else "off"
        for env, want in (("", hw), ("auto", hw), ("on", hw), ("1", hw), ("off", "off"),
                          ("xla", "off"), ("interpret", "off"), ("native", "scaled_matmul"),
                          ("tcgen05", "tcgen05")):
            monkeypatch.setenv("FP4JAX_KERNELS", env)
            assert dot_sm100.native_mode() == want, (env, sm100)
    monkeypatch.setattr(dot_sm90, "on_sm90", lambda: True)
    call = B.DotCall(fp4jax.recipes.nvfp4(), 1, 2**30, 1, 1)
    for env in ("native", "tcgen05"):  # the Hopper kernels stay off
        monkeypatch.setenv("FP4JAX_KERNELS", env)
        assert B.select(None, call)[0].name == "native"
    monkeypatch.setenv("FP4JAX_KERNELS", "blackwell")
    with pytest.raises(ValueError, match="FP4JAX_KERNELS='blackwell'"):
        dot_sm100.native_mode()


# ---------------------------------------------------------------------------
# fp4jax.dot on the native backend vs the XLA path.
# ---------------------------------------------------------------------------

@pytest.fixture
def scaled_matmul_on_cpu(monkeypatch):
    """``jax.nn.scaled_matmul`` runnable on the CPU: natively from JAX 0.11; on older JAX
    a CPU lowering of JAX's primitive built from the documented definition
    (``blockscale_sm100.emulate``) is registered for the test and removed after. Records
    which GEMMs took the native backend and counts the (traced) ``scaled_matmul`` calls."""
    from jax._src.cudnn import scaled_matmul_stablehlo as sms
    from jax._src.interpreters import mlir

    added = False
    if not bs.jax_lowers_on("cpu"):
        def lowering(a, b, sa, sb, *, preferred_element_type):
            return bs.emulate(a, b, sa, sb).astype(preferred_element_type)

        mlir.register_lowering(sms._scaled_matmul_p,
                               mlir.lower_fun(lowering, multiple_results=False),
                               platform="cpu")
        added = True
        monkeypatch.setattr(bs, "jax_lowers_on", lambda platform: True)
    calls = {"gemms": set(), "scaled_matmul": 0}
    real_mm, real_gemm = bs.scaled_matmul, bs.gemm

    def spy_mm(a, b, sa, sb):
        calls["scaled_matmul"] += 1
        return real_mm(a, b, sa, sb)

    def spy_gemm(subscripts, *args):
        calls["gemms"].add(GEMM_NAMES[subscripts])
        return real_gemm(subscripts, *args)

    monkeypatch.setattr(bs, "scaled_matmul", spy_mm)
    monkeypatch.setattr(bs, "gemm", spy_gemm)
    monkeypatch.setenv("FP4JAX_KERNELS", "native")
    yield calls
    if added:
        mlir._platform_specific_lowerings["cpu"].pop(sms._scaled_matmul_p, None)


def _fwd_bwd(x, w, recipe, key, dims=None):
    def f(x, w, k):
        if dims is None:
            y = fp4jax.dot(x, w, recipe=recipe, key=k)
        else:
            y = fp4jax.dot_general(x, w, dims, recipe=recipe, key=k)
        return jnp.sum(y.astype(jnp.float32) * jnp.cos(y.astype(jnp.float32))), y

    (loss, y), (dx, dw) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, w, key)
    return [np.asarray(a, np.float32) for a in (y, loss, dx, dw)]


GEMM_NAMES = {"bmk,bkn->bmn": "fprop", "bmn,bkn->bmk": "dgrad", "bmk,bmn->bkn": "wgrad"}
ALL3 = {"fprop", "dgrad", "wgrad"}
CASES = {
    # recipe, x shape, w shape, dot_general dims (None: fp4jax.dot), native GEMMs
    "nvfp4_partial": ("nvfp4", (40, 80), (80, 48), None, ALL3),  # 2D w, SR, RHT, K % 64
    "fp4_all_the_way": ("fp4_all_the_way", (2, 24, 64), (64, 96), None, ALL3),  # SR on x
    "batched": ("nvfp4(rht=0)", (2, 32, 64), (2, 64, 32), (((2,), (1,)), ((0,), (0,))),
                ALL3),
    "fwd_only": ("nvfp4_fwd_only", (32, 64), (64, 32), None, {"fprop"}),  # bf16 backward
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_native_dot_equals_xla_path(case, scaled_matmul_on_cpu, monkeypatch):
    spec, xs, ws, dims, n_native = CASES[case]
    recipe = fp4jax.recipes.parse(spec)
    x = jax.random.normal(jax.random.key(1), xs, jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(2), ws, jnp.float32) * 0.1).astype(jnp.bfloat16)
    key = jax.random.key(3)
    got = _fwd_bwd(x, w, recipe, key, dims)
    assert scaled_matmul_on_cpu["gemms"] == n_native, scaled_matmul_on_cpu
    assert (scaled_matmul_on_cpu["scaled_matmul"] > 0) == bool(n_native)
    monkeypatch.setenv("FP4JAX_KERNELS", "off")
    want = _fwd_bwd(x, w, recipe, key, dims)
    for name, g, v in zip(("y", "loss", "dx", "dw"), got, want, strict=True):
        assert g.shape == v.shape
        assert (g.view(np.uint32) == v.view(np.uint32)).all(), (case, name)


def test_native_gemm_sees_every_scale(scaled_matmul_on_cpu):
    """The equality above can fail: one block scale of the weight doubled changes exactly the
    outputs it feeds (a layout mistake would change others, or none)."""
    xq = _q((1, 32, 64), axis=-1, seed=4)
    wq = _q((1, 64, 48), block_2d=True, seed=5)
    base = np.asarray(dot_sm100.native_gemm("bmk,bkn->bmn", xq, wq, out_dtype=jnp.float32,
                                           mode="scaled_matmul"))
    s = wq.scale.astype(jnp.float32).at[0, 1, 2].multiply(2.0).astype(wq.scale.dtype)
    wq2 = qz.QuantizedArray(wq.data, s, wq.global_scale, wq.fmt, None, True)
    got = np.asarray(dot_sm100.native_gemm("bmk,bkn->bmn", xq, wq2, out_dtype=jnp.float32,
                                          mode="scaled_matmul"))
    changed = np.argwhere(got != base)
    assert changed.size and set(changed[:, 2]) <= set(range(32, 48))  # tile column 2
    ref = B.XLA.gemm("bmk,bkn->bmn", B.Operand.from_codes(xq), B.Operand.from_codes(wq2),
                     out_dtype=jnp.float32)
    np.testing.assert_array_equal(got, np.asarray(ref))


def test_native_gemm_lowers_to_xlas_block_scaled_dot_for_cuda():
    """Lowered for CUDA (no GPU needed), the native fprop is XLA's block-scaled dot custom
    call on E2M1 operands and E4M3 scales, K-major and padded to 64, f32 out."""
    xq, wq = _q((1, 32, 80)), _q((1, 80, 48), block_2d=True)

    def f(a, b):
        return dot_sm100.native_gemm("bmk,bkn->bmn", a, b, out_dtype=jnp.bfloat16,
                                    mode="scaled_matmul")

    text = jax.jit(f).trace(xq, wq).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "__op$block_scaled_dot" in ln]
    assert len(calls) == 1, calls
    assert ("(tensor<1x32x128xf4E2M1FN>, tensor<1x48x128xf4E2M1FN>, tensor<1x32x8xf8E4M3FN>,"
            " tensor<1x48x8xf8E4M3FN>) -> tensor<1x32x48xf32>") in calls[0]


def test_jax_lowers_on_is_true_to_this_jax():
    """``jax_lowers_on("cpu")`` says whether this JAX lowers ``jax.nn.scaled_matmul`` on the
    CPU (JAX 0.10.2: no; 0.11: yes, equal to ``emulate`` there)."""
    a = jnp.ones((1, 8, 32), jnp.float4_e2m1fn)
    b = jnp.ones((1, 16, 32), jnp.float4_e2m1fn)
    sa = jnp.full((1, 8, 2), 0.5, jnp.float8_e4m3fn)
    sb = jnp.full((1, 16, 2), 3.0, jnp.float8_e4m3fn)
    if bs.jax_lowers_on("cpu"):
        got = jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(bs.emulate(a, b, sa, sb)))
    else:
        with pytest.raises(NotImplementedError, match="scaled_matmul"):
            jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(bs.emulate(a, b, sa, sb)),
                                  np.full((1, 8, 16), 48.0, np.float32))


# ---------------------------------------------------------------------------
# The Pallas tcgen05 kernel (gemm/tcgen05_sm100): lowering only, never run here.
# ---------------------------------------------------------------------------

NVFP4_MMA = "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X"


def test_tcgen05_kernel_lowers_for_sm100(monkeypatch):
    """Lowered for CUDA on the CPU with Mosaic GPU's target arch set to 10.0 (with no GPU
    it assumes 9.0): Mosaic GPU's Python-side checks of the block-scaled MMA run (dtypes,
    shapes, TMEM scale layouts) and the module holds the NVFP4 block-scaled MMA (E2M1, one
    E4M3 scale per 16 elements: ``scale_vec::4X``) and the shared-to-tensor-memory scale
    copies. Not compiled (no ptxas here), not run."""
    from jax.experimental.mosaic.gpu import core as mgpu_core

    from pallas_kernels.gemm import tcgen05_sm100 as tc

    if not tc.available():
        pytest.skip("this JAX has no block-scaled tcgen05_mma")
    if not hasattr(mgpu_core, "_infer_arch"):  # JAX 0.11.2 has no such hook (H100 run)
        pytest.skip("this JAX's Mosaic GPU has no _infer_arch to set an sm_100 target: the "
                    "sm_100 lowering is checked on JAX 0.10.2 only")
    monkeypatch.setattr(mgpu_core, "_infer_arch", lambda: (10, 0))
    m, k, n = 256, 512, 128
    S = jax.ShapeDtypeStruct
    args = (S((m, k), jnp.float4_e2m1fn), S((n, k), jnp.float4_e2m1fn),
            S((m // 128, k // 64, 32, 16), jnp.float8_e4m3fn),
            S((n // 128, k // 64, 32, 16), jnp.float8_e4m3fn), S((), jnp.float32))
    text = export_cuda(tc.gemm_alpha_nvfp4, *args).mlir_module()
    assert "mosaic_gpu" in text and NVFP4_MMA in text and "tcgen05.cp" in text


def test_tcgen05_kernel_input_checks_and_routing(monkeypatch):
    from pallas_kernels.gemm import tcgen05_sm100 as tc

    f4, e4 = jnp.float4_e2m1fn, jnp.float8_e4m3fn
    a, b = jnp.zeros((128, 256), f4), jnp.zeros((128, 256), f4)
    s = jnp.zeros((1, 4, 32, 16), e4)
    with pytest.raises(ValueError, match="float4_e2m1fn"):
        tc.gemm_alpha_nvfp4(a.astype(jnp.bfloat16), b, s, s, 1.0)
    with pytest.raises(ValueError, match="K % 256 == 0"):
        tc.gemm_alpha_nvfp4(a[:, :128], b[:, :128], s, s, 1.0)
    with pytest.raises(ValueError, match="swizzle_scales_128x4"):
        tc.gemm_alpha_nvfp4(a, b, s[:, :2], s, 1.0)
    assert tc.supported(128, 256, 128) and not tc.supported(64, 256, 128)
    assert tc.gemm("bmk,bkn->bmn", _q((1, 128, 64)), _q((1, 64, 128), axis=1)) is None  # K
    # the dispatcher asks for the kernel only under FP4JAX_KERNELS=tcgen05 on an sm_100+
    # GPU with a bf16 output (here a stand-in that records the call)
    seen = []
    monkeypatch.setattr(tc, "gemm", lambda sub, qa, qb: seen.append(sub))  # returns None
    xq, wq = _q((1, 128, 256)), _q((1, 256, 128), block_2d=True)
    for sm100, out, n_calls in ((False, jnp.bfloat16, 0), (True, jnp.float32, 0),
                                (True, jnp.bfloat16, 1)):
        monkeypatch.setattr(dot_sm100, "on_sm100", lambda v=sm100: v)
        y = dot_sm100.native_gemm("bmk,bkn->bmn", xq, wq, out_dtype=out, mode="tcgen05")
        assert y.dtype == out and len(seen) == n_calls  # else: the scaled_matmul backend
