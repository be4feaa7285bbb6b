"""CPU tests of ``operand_sm90.fq_rows_cols_scaled``, the one-read NVFP4 rows + (RHT'd)
columns operand kernel (``dot_sm90.make_operands`` calls it under
``FP4JAX_KERNEL_OPERANDS=fused``): in Mosaic GPU interpret mode both outputs equal,
bit for bit, what the two separate kernels (``fq_rows_scaled``, ``fq_cols_scaled``)
write for the same scalars and key words, round to nearest and stochastic rounding, at
the GPU's strip width and at whole rows; ``fp4jax.dot`` makes x's and dy's pairs with it
and equals the XLA path; the real kernel lowers for CUDA on this machine."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import fp4jax  # noqa: E402
from fp4jax.hadamard import default_signs  # noqa: E402
from pallas_kernels.quantize import common_sm90 as cm  # noqa: E402
from pallas_kernels.quantize import operand_sm90 as fq  # noqa: E402
from tests.checks import export_cuda  # noqa: E402
from tests.interpret import InterpretGPUParams, needs_interpret  # noqa: E402
from tests.kernel_inputs import mismatches, wild_input  # noqa: E402

IP = InterpretGPUParams() if InterpretGPUParams is not None else None
SIGNS = jnp.asarray(np.asarray(default_signs(16), np.float32))
# One shape for the tests of the C % 1024 path (48 rows: the zero 16x1 column block of
# ``wild_input`` fits; 2048 columns: two GPU strips of 64 column blocks a row): their
# reference kernels (whole rows) and ``cols_amaxes`` are the same programs, compiled once
# (the session's compilation cache); in interpret mode the rows are a loop (more rows: no
# more compile time)
SHAPE = (48, 2048)


def _operands(x, sr_rows, sr_cols, rht, offset=None):
    """The scalars and key words ``make_operands`` gives a rows and a cols operand of x:
    one flat scalar batch (row 0 rows, row 1 cols: ``cols_amaxes``' two tensor scales,
    the cols row with the RHT signs), two different SR keys, one draw offset."""
    amax, rht_amax = fq.cols_amaxes(x, SIGNS, interpret=IP)
    enc, dec = cm.global_scales(None, jnp.stack([amax, rht_amax if rht else amax]))
    ones = jnp.ones((16,), jnp.float32)
    sc = cm.scalars(enc, dec, jnp.stack([ones, SIGNS if rht else ones])).reshape(-1)
    kw_r = cm.key_words(jax.random.key(11) if sr_rows else None, offset)
    kw_c = cm.key_words(jax.random.key(12) if sr_cols else None, offset)
    return sc, kw_r, kw_c


def _check(x, sr_rows, sr_cols, rht, g=None, offset=None, **kw):
    sc, kw_r, kw_c = _operands(x, sr_rows, sr_cols, rht, offset)
    got_r, got_c = fq.fq_rows_cols_scaled(x, sc, sc, kw_r, kw_c, sr_rows=sr_rows,
                                          sr_cols=sr_cols, rht=rht, g=g, sc_row_rows=0,
                                          sc_row_cols=1, interpret=IP, **kw)
    # the separate kernels at their interpret-mode tiling (whole rows) and, for the rows
    # SR, at the GPU's quad tiles of 64 blocks (the same bits: tested in test_operand)
    want_r = fq.fq_rows_scaled(x, sc, kw_r, sr=sr_rows, sc_row=0, interpret=IP)
    want_c = fq.fq_cols_scaled(x, sc, kw_c, sr=sr_cols, rht=rht, sc_row=1, interpret=IP)
    assert mismatches(got_r, want_r) == 0
    assert mismatches(got_c, want_c) == 0
    return got_r, got_c


@pytest.mark.slow  # > 20 s on the 2-core machine (tests/kernels is slow anyway)
@needs_interpret
@pytest.mark.parametrize("sr", [False, True])
def test_rows_cols_equal_the_two_kernels(sr):
    """The recipe's x (RtN both) and dy (SR both, two keys), RHT'd columns, wild input
    (zeros, -0, NaN, +-Inf, 1e-30, a row times 1e4, a zero 16x1 column block)."""
    x = wild_input(SHAPE, 21, zero_column_block=True)
    got_r, got_c = _check(x, sr, sr, rht=True)
    if sr:  # the draws matter: round-to-nearest differs
        rtn_r, rtn_c = _check(x, False, False, rht=True)
        assert mismatches(got_r, rtn_r) > 1000 and mismatches(got_c, rtn_c) > 1000


@needs_interpret
@pytest.mark.parametrize("sr_rows,sr_cols,rht", [(True, False, False), (False, True, True),
                                                 (True, True, False)])
def test_rows_cols_mixed_rounding_and_no_rht(sr_rows, sr_cols, rht):
    x = wild_input(SHAPE, 22)
    _check(x, sr_rows, sr_cols, rht)


@pytest.mark.slow  # > 20 s on the 2-core machine (tests/kernels is slow anyway)
@needs_interpret
def test_rows_cols_gpu_strips_and_offset():
    """The GPU's strips of 64 column blocks (two strips a row, two strips a CTA), a
    row-shard draw offset, large values (a row at 3e38: bf16-finite, E4M3 saturating)."""
    x = wild_input(SHAPE, 23)
    x = x.at[9].set(jnp.asarray(3e38, jnp.bfloat16) * jnp.sign(x[9]))
    off = jnp.uint32(12345)
    _check(x, True, True, rht=True, g=64, offset=off)
    _check(x, False, False, rht=True, g=64, steps=2)


@pytest.mark.slow  # > 20 s on the 2-core machine (tests/kernels is slow anyway)
@needs_interpret
def test_rows_cols_all_zero_and_constant():
    """An all-zero tensor (amax 0: enc = dec = 1 rules) and a constant one."""
    for v in (0.0, 448.0 * 6):
        x = jnp.full(SHAPE, v, jnp.bfloat16)
        _check(x, True, True, rht=True)
        _check(x, False, False, rht=True)


@pytest.mark.slow  # > 20 s on the 2-core machine (tests/kernels is slow anyway)
@needs_interpret
@pytest.mark.parametrize("c", [256, 768])
def test_rows_cols_narrow_widths(c):
    """A small model's widths (C = 256, 768: a strip is 16 whole rows, held as 4 buffers of
    a row of each quad), SR with a draw offset and RtN."""
    x = wild_input((32, c), 25)
    _check(x, True, True, rht=True, offset=jnp.uint32(77))
    _check(x, False, False, rht=True)


@needs_interpret
def test_fq_rows_cols_wrapper_equals_fq_rows_and_fq_cols():
    """The convenience wrapper (both amaxes from ``cols_amaxes``, the scalar batch, two
    keys) against ``fq_rows`` and ``fq_cols`` (their own amax passes), scales included."""
    x = wild_input(SHAPE, 24)
    kr, kc = jax.random.key(31), jax.random.key(32)
    (gr, dr), (gc, dc) = fq.fq_rows_cols(x, kr, kc, signs=SIGNS, interpret=IP)
    wr, wdr = fq.fq_rows(x, kr, interpret=IP)
    wc, wdc = fq.fq_cols(x, kc, signs=SIGNS, interpret=IP)
    assert mismatches(gr, wr) == 0 and mismatches(gc, wc) == 0
    assert float(dr) == float(wdr) and float(dc) == float(wdc)


def test_supported_rows_cols():
    bf = jnp.bfloat16
    assert fq.supported_rows_cols((16, 1024), bf) and fq.supported_rows_cols((32, 3072), bf)
    # narrow: 256, 512, 768 (whole-row strips); other widths below 1024 columns' multiples not
    assert fq.supported_rows_cols((16, 768), bf) and fq.supported_rows_cols((16, 256), bf)
    assert not fq.supported_rows_cols((16, 1280), bf) and not fq.supported_rows_cols((16, 1536), bf)
    assert not fq.supported_rows_cols((24, 1024), bf)  # 16x1 blocks
    assert not fq.supported_rows_cols((16, 1024), jnp.float32)
    assert fq.supported_rows_cols((16, 1024), bf, sr_rows=True)
    for shape in [(16, 1024), (48, 2048), (4096, 8192)]:
        if fq.supported_rows_cols(shape, bf, True):
            assert fq.supported_rows(shape, bf, True, padded=True)
            assert fq.supported_cols(shape, bf)
    sc, kw = cm.scalars(jnp.float32(1), jnp.float32(1)), cm.key_words(None)
    with pytest.raises(ValueError, match="fq_rows_cols needs"):
        fq.fq_rows_cols_scaled(jnp.zeros((16, 1280), bf), sc, sc, kw, kw)
    with pytest.raises(ValueError, match="tiling"):
        fq.fq_rows_cols_scaled(jnp.zeros((16, 2048), bf), sc, sc, kw, kw, g=64, steps=3)


@pytest.mark.parametrize("variant", ["rtn", "sr", "sr_steps", "rtn_c768", "sr_c768",
                                     "sr_c256_steps", "sr_c512"])
def test_rows_cols_lowers_for_cuda(variant):
    """The real kernel (strips of 64 column blocks; at C = 256, 512, 768 whole-row strips)
    lowers for CUDA (Mosaic GPU) with the flat scalar batch and its rows, as
    ``make_operands`` would call it."""
    sc = jax.ShapeDtypeStruct((2 * cm.SC_WIDTH,), jnp.float32)
    kw = jax.ShapeDtypeStruct((3,), jnp.int32)
    c = int(variant.split("_c")[1].split("_")[0]) if "_c" in variant else 2048
    x = jax.ShapeDtypeStruct((4096, c), jnp.bfloat16)
    sr = not variant.startswith("rtn")
    steps = 2 if variant.endswith("steps") else 1

    def f(x, s, k1, k2):
        return fq.fq_rows_cols_scaled(x, s, s, k1, k2, sr_rows=sr, sr_cols=sr, rht=True,
                                      sc_row_rows=0, sc_row_cols=1, steps=steps)

    exp = export_cuda(f, x, sc, kw, kw)
    assert "mosaic_gpu" in exp.mlir_module()


def _nvfp4_fwd_bwd(m, c):
    """``fp4jax.dot`` nvfp4 forward + backward of x (m, c) @ w (c, c): y, loss, dx, dw."""
    kx, kw, kc = jax.random.split(jax.random.key(m + c), 3)
    x = jax.random.normal(kx, (m, c)).astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(kw, (c, c))).astype(jnp.bfloat16)
    ct = jax.random.normal(kc, (m, c)).astype(jnp.bfloat16)

    def loss(x, w):
        y = fp4jax.dot(x, w, recipe="nvfp4", key=jax.random.key(9))
        return (y.astype(jnp.float32) * ct).sum(), y

    (v, y), (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
    return [np.asarray(a, np.float32) for a in (y, v, dx, dw)]


@pytest.mark.slow  # interpret mode: ~25 s on the 2-core machine
@needs_interpret
@pytest.mark.parametrize("c", [256])  # the narrow path; C % 1024 strips: the kernel tests
def test_dot_makes_rows_and_cols_in_one_pass(monkeypatch, c):
    """Wired in: with ``FP4JAX_KERNEL_OPERANDS=fused`` the kernel path makes x's
    (fprop rows, wgrad RHT cols) and dy's (dgrad SR rows, wgrad SR cols) operand pairs with
    ``fq_rows_cols_scaled``, one call each, and ``separate`` with none; y, loss, dx, dw equal
    the XLA path's bit for bit either way."""
    monkeypatch.setenv("FP4JAX_KERNELS", "off")
    want = _nvfp4_fwd_bwd(16, c)
    calls = []
    real = fq.fq_rows_cols_scaled

    def spy(x, *a, **k):
        calls.append((x.shape, k.get("sr_rows"), k.get("sr_cols"), k.get("rht")))
        return real(x, *a, **k)

    monkeypatch.setattr(fq, "fq_rows_cols_scaled", spy)
    monkeypatch.setenv("FP4JAX_KERNELS", "interpret")
    for passes, n in (("fused", 2), ("separate", 0)):
        monkeypatch.setenv("FP4JAX_KERNEL_OPERANDS", passes)
        calls.clear()
        got = _nvfp4_fwd_bwd(16, c)
        assert len(calls) == n, (passes, calls)
        if n:  # x: RtN rows, RHT'd RtN cols; dy: SR rows, RHT'd SR cols (the nvfp4 recipe)
            assert sorted(cl[1:] for cl in calls) == [(False, False, True), (True, True, True)]
        for g, w, name in zip(got, want, ("y", "loss", "dx", "dw"), strict=True):
            assert (g.view(np.uint32) == w.view(np.uint32)).all(), (passes, name)


def test_operand_passes_setting(monkeypatch):
    from pallas_kernels import dot_sm90

    monkeypatch.delenv("FP4JAX_KERNEL_OPERANDS", raising=False)
    assert dot_sm90.operand_passes() == "separate"
    monkeypatch.setenv("FP4JAX_KERNEL_OPERANDS", "Fused")
    assert dot_sm90.operand_passes() == "fused"
    monkeypatch.setenv("FP4JAX_KERNEL_OPERANDS", "one")
    with pytest.raises(ValueError,
                       match="FP4JAX_KERNEL_OPERANDS='one': use one of separate, fused"):
        dot_sm90.operand_passes()
