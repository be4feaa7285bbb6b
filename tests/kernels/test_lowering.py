"""The quantize kernels and the W4A4 decode kernel ask for Mosaic GPU's Lane lowering
semantics explicitly (``common_sm90.lane_params``): JAX 0.11 made Warpgroup the default, and
under it these kernels spent ~30 s of a cold NVFP4 train-step compile in layout inference
(experiments/results/training/2026-11-24_bench_train_h100/). CI runs JAX 0.10, whose default
is Lane, so the test makes the default Warpgroup (as 0.11's) while tracing each kernel for
the GPU path, and checks every kernel's compiler parameters."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemm import w4a4_sm90 as w4
from pallas_kernels.quantize import common_sm90 as cm
from pallas_kernels.quantize import operand_sm90 as fq
from pallas_kernels.quantize import packed_sm90 as qk

BF = jnp.bfloat16
SIGNS = jnp.ones((16,), jnp.float32)


def _kernel_params(jaxpr) -> list:
    """The ``compiler_params`` of every kernel call in ``jaxpr`` (nested jaxprs included)."""
    out = []
    for e in jaxpr.eqns:
        if "compiler_params" in e.params:
            out.append(e.params["compiler_params"])
        for p in e.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                out.extend(_kernel_params(inner))
    return out


CASES = {
    "rows": lambda x: fq.fq_rows(x),
    "rows_sr": lambda x: fq.fq_rows(x, jax.random.key(0)),
    "cols_rht_sr": lambda x: fq.fq_cols(x, jax.random.key(0), signs=SIGNS),
    "cols_narrow": lambda x: fq.fq_cols(x[:, :768], signs=SIGNS),
    "2d": lambda x: fq.fq_2d(x),
    "amaxes": lambda x: fq.cols_amaxes(x, SIGNS),
    "rows_cols_sr": lambda x: fq.fq_rows_cols(x, jax.random.key(0), jax.random.key(1),
                                              signs=SIGNS),
    "packed_1x16": lambda x: qk.quantize_nvfp4_1x16(x),
    "packed_2d": lambda x: qk.quantize_nvfp4_2d(x),
    "packed_sr": lambda x: qk.quantize_nvfp4_1x16_sr(x, jax.random.key(0)),
    "w4a4_decode": lambda x: w4.decode_operand(
        jnp.zeros((256, 512), jnp.uint8), jnp.zeros((64, 256), jnp.uint8)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_ask_for_lane_semantics(case, monkeypatch):
    warpgroup_default = functools.partial(
        plgpu.CompilerParams, lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    # the kernels' jitted wrappers would reuse traces made before the patch (and later tests
    # those made under it): caches cleared on both sides. Not jax.disable_jit(): under it
    # JAX 0.12's emit_pipeline fails (its fori_loop hands the body a Python int step)
    jax.clear_caches()
    monkeypatch.setattr(plgpu, "CompilerParams", warpgroup_default)
    try:
        jaxpr = jax.make_jaxpr(CASES[case])(jnp.zeros((256, 1024), BF))
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    params = _kernel_params(jaxpr.jaxpr)
    assert params, "no kernel call traced"
    assert all(p.lowering_semantics == plgpu.LoweringSemantics.Lane for p in params), params


def test_the_simulated_default_would_be_caught():
    """Without ``lane_params`` the patched default gives Warpgroup: the test above can fail."""
    p = functools.partial(plgpu.CompilerParams,
                          lowering_semantics=plgpu.LoweringSemantics.Warpgroup)()
    assert p.lowering_semantics == plgpu.LoweringSemantics.Warpgroup
    assert cm.lane_params(unsafe_no_auto_barriers=True).lowering_semantics == (
        plgpu.LoweringSemantics.Lane)
