"""``fp4jax.dot(..., implementation=)``: the backend as an argument (tokamax style).

* ``dispatch.dot_backend`` maps (implementation, ``FP4JAX_KERNELS``, device, size, recipe)
  to a backend: None keeps the automatic choice with fallback to XLA, an explicit backend
  that cannot run the call raises a ValueError that says why;
* the argument overrides the environment: ``"xla"`` under ``FP4JAX_KERNELS=interpret``
  lowers without a kernel, ``"pallas"`` lowers the kernels and gives the XLA bits
  (Mosaic GPU interpret mode on the CPU).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import fp4jax  # noqa: E402
from fp4jax import recipes as R  # noqa: E402
from pallas_kernels import dispatch  # noqa: E402
from pallas_kernels.gemm import blockscale_sm100 as bs  # noqa: E402
from tests.interpret import needs_interpret  # noqa: E402

BIG = dispatch.KERNEL_AUTO_MIN_MKN


def test_dot_backend_choice(monkeypatch):
    monkeypatch.delenv("FP4JAX_KERNELS", raising=False)
    pick = dispatch.dot_backend
    # on the CPU: automatic is XLA at any size; explicit backends say why they cannot run
    assert pick(None, mkn=BIG, kernel_recipe=True) == dispatch.DotBackend()
    assert pick("xla", mkn=BIG, kernel_recipe=True) == dispatch.DotBackend()
    with pytest.raises(ValueError, match="no sm_90"):
        pick("pallas", mkn=BIG, kernel_recipe=True)
    with pytest.raises(ValueError, match="no operand the kernels implement"):
        pick("pallas", mkn=BIG, kernel_recipe=False)
    with pytest.raises(ValueError, match="batched"):
        pick("pallas", mkn=0, kernel_recipe=True)
    with pytest.raises(ValueError, match="implementation must be None or one of"):
        pick("cuda", mkn=BIG, kernel_recipe=True)
    if bs.jax_lowers_on("cpu"):
        assert pick("native", mkn=1, kernel_recipe=False).native == "scaled_matmul"
    else:
        with pytest.raises(ValueError, match="does not lower jax.nn.scaled_matmul"):
            pick("native", mkn=1, kernel_recipe=True)

    # on a (pretended) Hopper GPU with one device: automatic takes the kernels for large
    # unbatched calls of kernel recipes and falls back to XLA otherwise; "pallas" at any size
    monkeypatch.setattr(dispatch, "on_sm90", lambda: True)
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    on = dispatch.DotBackend("pallas", "on", dispatch.gemm_backend())
    assert pick(None, mkn=BIG, kernel_recipe=True) == on
    assert pick(None, mkn=BIG - 1, kernel_recipe=True) == dispatch.DotBackend()
    assert pick(None, mkn=BIG, kernel_recipe=False) == dispatch.DotBackend()
    assert pick("pallas", mkn=1, kernel_recipe=True) == on
    assert pick("xla", mkn=BIG, kernel_recipe=True) == dispatch.DotBackend()
    # FP4JAX_KERNELS sets the automatic choice only: off is XLA, on is the kernels at any
    # size (and the packed quantize kernels for recipes the kernel path does not take)
    monkeypatch.setenv("FP4JAX_KERNELS", "off")
    assert pick(None, mkn=BIG, kernel_recipe=True) == dispatch.DotBackend()
    assert pick("pallas", mkn=BIG, kernel_recipe=True) == on
    monkeypatch.setenv("FP4JAX_KERNELS", "on")
    assert pick(None, mkn=1, kernel_recipe=True) == on
    assert pick(None, mkn=1, kernel_recipe=False) == dispatch.DotBackend(packed_quantize=True)
    assert pick("xla", mkn=BIG, kernel_recipe=True) == dispatch.DotBackend()


def test_dot_rejects_unsupported_implementations():
    x = jnp.ones((32, 64), jnp.bfloat16)
    w = jnp.ones((64, 32), jnp.bfloat16)
    k = jax.random.key(0)
    with pytest.raises(ValueError, match="no sm_90"):
        fp4jax.dot(x, w, key=k, implementation="pallas")
    with pytest.raises(ValueError, match="no operand the kernels implement"):
        fp4jax.dot(x, w, recipe="mxfp8", key=k, implementation="pallas")
    with pytest.raises(ValueError, match="batched"):
        fp4jax.dot_general(jnp.stack([x, x]), jnp.stack([w, w]),
                           (((2,), (1,)), ((0,), (0,))), key=k, implementation="pallas")
    with pytest.raises(ValueError, match="implementation must be"):
        fp4jax.dot(x, w, key=k, implementation="triton")
    # "xla" is the default on the CPU: the same bits
    np.testing.assert_array_equal(
        np.asarray(fp4jax.dot(x, w, key=k, implementation="xla"), np.float32),
        np.asarray(fp4jax.dot(x, w, key=k), np.float32))


@needs_interpret
def test_argument_overrides_the_environment(monkeypatch):
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (16, 1024)).astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(kw, (1024, 1024))).astype(jnp.bfloat16)
    key = jax.random.key(9)

    def fwd(impl):
        return jax.jit(lambda x, w: fp4jax.dot(x, w, recipe=R.nvfp4(), key=key,
                                               implementation=impl))

    monkeypatch.setenv("FP4JAX_KERNELS", "off")
    want = np.asarray(fwd(None)(x, w), np.float32)
    hlo_pallas = fwd("pallas")  # off only sets the default: "pallas" still needs the GPU
    with pytest.raises(ValueError, match="no sm_90"):
        hlo_pallas.lower(x, w)
    monkeypatch.setenv("FP4JAX_KERNELS", "interpret")
    xla_text = fwd("xla").lower(x, w).as_text()
    assert "pallas" not in xla_text and "callback" not in xla_text
    f = fwd("pallas")
    text = f.lower(x, w).as_text()
    assert "pallas" in text or "callback" in text
    np.testing.assert_array_equal(np.asarray(f(x, w), np.float32), want)
