"""``fp4jax.dot``'s Hopper kernel path for recipes with unquantized operands or GEMMs
(issue 35): the precision switch (``fp4jax.train.switched_recipe``, ``--switch fwd|bwd``),
``nvfp4_fwd_only`` and hybrids such as ``mxfp8_fwd_nvfp4_bwd``.

* the dispatcher takes them (some operand is one the kernels implement), and refuses a
  recipe with none, saying why;
* the forward + backward lowers for CUDA on this machine (``jax.export``) with the
  kernels making exactly the quantized operands the kernels cover (spied on
  ``dot_sm90.make_operands``), the unquantized ones entering as the tensors themselves;
* in Mosaic GPU interpret mode the kernel path's y, loss, dx and dw equal the XLA path's
  bit for bit, for a switched forward and a switched backward (``nvfp4_fwd_only``);
* with the operand kernels declined, the kernel path's own plumbing equals the XLA path's
  bits for a mixed recipe (row-scaled NVFP4 and MXFP8 operands from the XLA quantizer, a
  GEMM of a quantized and an unquantized operand in float32) and for a float32 weight.
GPU check: ``experiments/gpu_check.py dot_recipes``.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import fp4jax  # noqa: E402
from fp4jax import backends as B  # noqa: E402
from fp4jax import quantized_dot as dot_mod  # noqa: E402
from fp4jax import recipes as R  # noqa: E402
from fp4jax.train import switched_recipe  # noqa: E402
from pallas_kernels import dot_sm90  # noqa: E402
from tests.interpret import needs_interpret  # noqa: E402
from tests.kernel_inputs import mismatches  # noqa: E402

BIG = dot_sm90.KERNEL_AUTO_MIN_MKN
SWITCH_FWD = switched_recipe(R.nvfp4(), "fwd")
SWITCH_BWD = switched_recipe(R.nvfp4(), "bwd")
# operands the kernels do not implement inside the kernel path (the XLA quantizer): x
# row-scaled NVFP4 and w MXFP8 in fprop; NVFP4 dgrad (the kernels); wgrad with dy
# unquantized: x quantized after the RHT into a float32 GEMM (XLA's, float32)
MIXED = R.mxfp8_fwd_nvfp4_bwd().replace(
    name="mixed", **{"wgrad.rhs.fmt": None, "fprop.lhs": R.QuantSpec(row_scaled=True)})
TAKEN = {"switch_fwd": SWITCH_FWD, "switch_bwd": SWITCH_BWD,
         "nvfp4_fwd_only": R.nvfp4_fwd_only(), "mxfp8_fwd_nvfp4_bwd": R.mxfp8_fwd_nvfp4_bwd(),
         "row_scaled": R.nvfp4().replace(row_scaled=True), "mixed": MIXED}
REFUSED = {"bf16": R.bf16(), "mxfp8": R.mxfp8(), "quartet2": R.quartet2()}


def _why(recipe) -> dict[str, str | None]:
    """Per operand ``gemm.side``: None (the kernels' spec), "unquantized", or the
    dispatcher's reason."""
    return {f"{n}.{side}": ("unquantized" if not q.quantized else
                            dot_sm90.spec_unsupported_reason(
                                q.fmt, block_scale_rule=q.block_scale_rule,
                                row_scaled=q.row_scaled, rounding=q.rounding))
            for n, g in recipe.gemms.items() for side, q in (("lhs", g.lhs), ("rhs", g.rhs))}


def test_dispatch_takes_recipes_with_unquantized_operands(monkeypatch):
    monkeypatch.delenv("FP4JAX_KERNELS", raising=False)
    monkeypatch.setattr(dot_sm90, "on_sm90", lambda: True)
    monkeypatch.setattr(dot_sm90, "mosaic_api_reason", lambda: None)  # any JAX
    on = (dot_sm90.HopperBackend("on", dot_sm90.gemm_backend()), B.XLA)
    for name, r in TAKEN.items():
        why = _why(r)
        assert dot_sm90.recipe_reason(r) is None, (name, why)
        assert None in why.values(), (name, why)  # some operand is the kernels'
        assert B.select(None, B.DotCall(r, 1, BIG // 64, 8, 8)) == on
    # what rides along, and why: the switch's high-precision GEMMs, MXFP8, row scales
    assert set(_why(SWITCH_FWD).values()) == {None, "unquantized"}
    assert [k for k, v in _why(SWITCH_FWD).items() if v] == ["fprop.lhs", "fprop.rhs"]
    assert [k for k, v in _why(SWITCH_BWD).items() if v] == [
        "dgrad.lhs", "dgrad.rhs", "wgrad.lhs", "wgrad.rhs"]
    hyb = _why(R.mxfp8_fwd_nvfp4_bwd())
    assert "E4M3 elements" in hyb["fprop.lhs"] and "E4M3 elements" in hyb["fprop.rhs"]
    assert "row_scaled" in _why(TAKEN["row_scaled"])["fprop.lhs"]
    for name, r in REFUSED.items():
        assert dot_sm90.recipe_reason(r) is not None, (name, _why(r))
        assert B.select(None, B.DotCall(r, 1, BIG // 64, 8, 8)) == (B.XLA,)
        assert None not in _why(r).values(), name
    with pytest.raises(ValueError, match="no operand the kernels implement"):
        fp4jax.dot(jnp.ones((16, 256), jnp.bfloat16), jnp.ones((256, 256), jnp.bfloat16),
                   recipe=R.bf16(), implementation="pallas")


def _spy_operands(monkeypatch) -> list:
    """Records the kernel kinds of every ``dot_sm90.make_operands`` call."""
    seen = []
    real = dot_sm90.make_operands

    def spy(x, kinds, *a, **k):
        seen.append((tuple(x.shape), tuple(kinds)))
        return real(x, kinds, *a, **k)

    monkeypatch.setattr(dot_sm90, "make_operands", spy)
    return seen


def _fwd_bwd(recipe, implementation=None, wdtype=jnp.bfloat16):
    key = jax.random.key(9)

    def loss(x, w, ct):
        y = fp4jax.dot(x, w, recipe=recipe, key=key, implementation=implementation)
        return (y.astype(jnp.float32) * ct.astype(jnp.float32)).sum(), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


# the kernels the CUDA lowering must make for each recipe at 256 x 1024 x 1024: x (256,
# 1024), w (1024, 1024), dy (256, 1024)
CUDA_KINDS = {
    "switch_fwd": [((1, 256, 1024), ("cols",)), ((1, 1024, 1024), ("2d",)),
                   ((1, 256, 1024), ("rows", "cols"))],
    "mixed": [((1, 1024, 1024), ("2d",)), ((1, 256, 1024), ("rows",))],
}


@pytest.mark.parametrize("name", sorted(CUDA_KINDS))
def test_kernel_path_lowers_for_cuda(monkeypatch, name):
    """Forward + backward lowered for CUDA (the real Mosaic GPU kernels): the operands the
    kernels cover come from them, the unquantized ones and the float32 GEMM's quantized x
    (``mixed``'s wgrad) do not."""
    monkeypatch.setattr(dot_sm90, "on_sm90", lambda: True)
    monkeypatch.setattr(dot_sm90, "mosaic_api_reason", lambda: None)  # any JAX
    seen = _spy_operands(monkeypatch)
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    exp = jax.export.export(_fwd_bwd(TAKEN[name], "pallas"), platforms=["cuda"])(
        sd((256, 1024), bf), sd((1024, 1024), bf), sd((256, 1024), bf))
    text = exp.mlir_module()
    assert "mosaic_gpu" in text
    assert sorted(set(seen)) == sorted(CUDA_KINDS[name]), seen  # the primal traces x, w again


def _problem(wdtype=jnp.bfloat16):
    kx, kw, kc = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(kx, (16, 256)).astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(kw, (256, 256))).astype(wdtype)
    ct = jax.random.normal(kc, (16, 256)).astype(jnp.bfloat16)
    return x, w, ct


def _assert_same(got, want):
    (v2, y2), (dx2, dw2) = got
    (v, y), (dx, dw) = want
    for name, a, b in (("y", y2, y), ("loss", v2, v), ("dx", dx2, dx), ("dw", dw2, dw)):
        assert a.dtype == b.dtype and mismatches(a, b) == 0, name
    assert float(jnp.abs(dw.astype(jnp.float32)).sum()) > 0


@needs_interpret
@pytest.mark.parametrize("name,kinds", [
    ("switch_fwd", [((1, 16, 256), ("cols",)), ((1, 16, 256), ("rows", "cols"))]),
    ("nvfp4_fwd_only", [((1, 16, 256), ("rows",))]),  # = switch_bwd but for its name
])
def test_kernel_path_equals_xla_path(monkeypatch, name, kinds):
    """y, loss, dx, dw of the kernel path (Mosaic GPU interpret mode) vs the XLA path, bit
    for bit, at 16 x 256 x 256 (the 256-column weight takes the XLA path: 16x16 tiles need
    1024 columns); the kernels made the operands ``kinds``."""
    x, w, ct = _problem()
    want = _fwd_bwd(TAKEN[name], "xla")(x, w, ct)
    monkeypatch.setenv("FP4JAX_KERNELS", "interpret")
    seen = _spy_operands(monkeypatch)
    got = _fwd_bwd(TAKEN[name], "pallas")(x, w, ct)
    assert sorted(set(seen)) == sorted(kinds), seen
    _assert_same(got, want)


@pytest.mark.parametrize("name,wdtype", [("mixed", jnp.bfloat16), ("switch_fwd", jnp.float32)])
def test_kernel_path_plumbing_equals_xla_path(monkeypatch, name, wdtype):
    """The kernel path with every operand kernel declined (``dot_sm90.operand_kernel`` None,
    as for shapes the kernels do not tile), so no interpret mode is needed: the operands
    from the XLA quantizer (MXFP8, row-scaled: per-row scales), the unquantized ones, the
    GEMM of a quantized and an unquantized operand (``mixed``'s wgrad, in float32 after the
    RHT) and a float32 weight in an unquantized forward (float32, the caller's precision)
    give the XLA path's bits."""
    x, w, ct = _problem(wdtype)
    want = _fwd_bwd(TAKEN[name], "xla")(x, w, ct)
    monkeypatch.setenv("FP4JAX_KERNELS", "interpret")
    monkeypatch.setattr(dot_sm90, "operand_kernel", lambda *a, **k: None)
    seen = _spy_operands(monkeypatch)
    f = _fwd_bwd(TAKEN[name], "pallas")
    assert "pallas" not in f.lower(x, w, ct).as_text()
    _assert_same(f(x, w, ct), want)
    assert not seen


def test_gemm_dtypes_follow_the_xla_path():
    """The dtype each GEMM computes in, known before its operands exist: bf16 only where
    both operands are exact in bf16 (an unquantized one: a bf16 tensor without RHT)."""
    bf, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    d = dot_mod.gemm_dtypes(SWITCH_FWD, bf, bf, bf)
    assert d == {"fprop": bf, "dgrad": bf, "wgrad": bf}
    assert dot_mod.gemm_dtypes(SWITCH_FWD, bf, f32, bf)["fprop"] == f32
    assert dot_mod.gemm_dtypes(SWITCH_FWD, bf, f32, bf)["dgrad"] == bf  # w quantized
    assert dot_mod.gemm_dtypes(MIXED, bf, bf, bf) == {"fprop": bf, "dgrad": bf,
                                                      "wgrad": f32}  # RHT'd dy: float32
    np.testing.assert_equal(dot_mod.gemm_dtypes(R.bf16(), bf, bf, bf)["wgrad"], bf)
