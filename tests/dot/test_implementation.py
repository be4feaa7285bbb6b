"""``fp4jax.dot(..., implementation=)``: the backend as an argument (tokamax style).

* ``fp4jax.backends.select`` maps (implementation, ``FP4JAX_KERNELS``, device, size,
  recipe) to an ordered tuple of backends ending with the reference: None keeps the
  automatic choice with fallback to XLA, an explicit backend that cannot run the call
  raises a ValueError that says why;
* the kernel backends are found through the ``fp4jax.backends`` entry points, without the
  core importing them;
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
from fp4jax import backends as B  # noqa: E402
from fp4jax import recipes as R  # noqa: E402
from pallas_kernels import dot_sm90, dot_sm100  # noqa: E402
from pallas_kernels.gemm import blockscale_sm100 as bs  # noqa: E402
from tests.interpret import needs_interpret  # noqa: E402

BIG = dot_sm90.KERNEL_AUTO_MIN_MKN


def _call(recipe=None, batch=1, mkn=BIG, partitioned=False):
    """A ``DotCall`` of ``M*K*N == mkn`` (M = mkn / 64)."""
    return B.DotCall(recipe or R.nvfp4(), batch, mkn // 64, 8, 8, partitioned)


def test_providers_come_from_the_entry_points():
    names = [p.name for p in B.providers()]
    # priority order: Hopper, Hopper with the FP8 MXFP4 GEMM, then Blackwell
    assert names == ["pallas", "pallas_fp8", "native"]
    assert isinstance(B.providers()[0], dot_sm90.HopperProvider)
    assert B.providers()[1] is dot_sm90.FP8_PROVIDER
    assert isinstance(B.providers()[2], dot_sm100.BlackwellProvider)
    # the entry points are declared, not imported by name, in the core
    import pathlib

    core = pathlib.Path(fp4jax.__file__).parent
    for path in core.rglob("*.py"):
        text = path.read_text()
        assert "import pallas_kernels" not in text and "from pallas_kernels" not in text, path


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("FP4JAX_KERNELS", raising=False)
    pick = B.select
    xla = (B.XLA,)
    mxfp8 = R.parse("mxfp8")
    # on the CPU: automatic is XLA at any size; explicit backends say why they cannot run
    assert pick(None, _call()) == xla
    assert pick("xla", _call()) == xla
    with pytest.raises(ValueError, match="no sm_90"):
        pick("pallas", _call())
    with pytest.raises(ValueError, match="no operand the kernels implement"):
        pick("pallas", _call(mxfp8))
    with pytest.raises(ValueError, match="batched"):
        pick("pallas", _call(batch=2))
    with pytest.raises(ValueError, match="implementation must be None, 'xla' or one of"):
        pick("cuda", _call())
    if bs.jax_lowers_on("cpu"):
        assert pick("native", _call(mkn=64))[0] == dot_sm100.BlackwellBackend("scaled_matmul")
    else:
        with pytest.raises(ValueError, match="does not lower jax.nn.scaled_matmul"):
            pick("native", _call(mkn=64))

    # on a (pretended) Hopper GPU: automatic takes the kernels for large unbatched calls of
    # kernel recipes that XLA does not partition, and falls back to XLA otherwise; "pallas"
    # at any size
    monkeypatch.setattr(dot_sm90, "on_sm90", lambda: True)
    monkeypatch.setattr(dot_sm90, "mosaic_api_reason", lambda: None)  # any JAX
    on = (dot_sm90.HopperBackend("on", dot_sm90.gemm_backend()), B.XLA)
    assert pick(None, _call()) == on
    assert pick(None, _call(mkn=BIG - 64)) == xla
    assert pick(None, _call(batch=2)) == xla
    assert pick(None, _call(partitioned=True)) == xla
    assert pick(None, _call(mxfp8)) == xla
    assert pick("pallas", _call(mkn=64)) == on
    assert pick("pallas", _call(partitioned=True)) == on
    assert pick("xla", _call()) == xla
    # FP4JAX_KERNELS sets the automatic choice only: off is XLA, on is the kernels at any
    # size, interpret the kernels in interpret mode; an unknown spelling is refused
    monkeypatch.setenv("FP4JAX_KERNELS", "off")
    assert pick(None, _call()) == xla
    assert pick("pallas", _call()) == on
    monkeypatch.setenv("FP4JAX_KERNELS", "on")
    assert pick(None, _call(mkn=64)) == on
    assert pick(None, _call(mxfp8)) == xla
    assert pick("xla", _call()) == xla
    monkeypatch.setenv("FP4JAX_KERNELS", "interpret")
    assert pick(None, _call(mkn=64))[0].mode == "interpret"
    monkeypatch.setenv("FP4JAX_KERNELS", "cuda")
    with pytest.raises(ValueError, match="FP4JAX_KERNELS='cuda': use auto, on or off"):
        pick(None, _call())


def test_a_registered_provider_joins_the_choice(monkeypatch):
    """A plug-in registered by ``register_provider`` is chosen by its name and, where it
    takes the call, automatically before those of higher priority; its GEMMs run where
    it takes them, the reference elsewhere."""
    import dataclasses

    calls = []

    @dataclasses.dataclass(frozen=True)
    class Twice(B.Backend):
        name = "twice"

        def gemm_reason(self, subscripts, a, b, out_dtype):
            return None if subscripts == B.SUBSCRIPTS["fprop"] else "fprop only"

        def gemm(self, subscripts, a, b, *, out_dtype, precision=None):
            calls.append(subscripts)
            return 2 * B.XLA.gemm(subscripts, a, b, out_dtype=out_dtype, precision=precision)

    @dataclasses.dataclass(frozen=True)
    class TwiceProvider:
        name: str = "twice"
        priority: int = 0
        env_modes: tuple = ()

        def backend(self, call, mode, explicit):
            if not explicit and call.m < 64:
                raise B.NotSupported("small")
            return Twice()

    monkeypatch.setitem(B._PROVIDERS, "twice", TwiceProvider())
    x = jax.random.normal(jax.random.key(0), (64, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (64, 32), jnp.float32)
    k = jax.random.key(2)
    want = fp4jax.dot(x, w, key=k, implementation="xla")
    np.testing.assert_array_equal(fp4jax.dot(x, w, key=k, implementation="twice"), 2 * want)
    np.testing.assert_array_equal(fp4jax.dot(x, w, key=k), 2 * want)  # automatic, first
    np.testing.assert_array_equal(fp4jax.dot(x[:32], w, key=k), want[:32])  # declined
    gx = jax.grad(lambda x: fp4jax.dot(x, w, key=k, implementation="twice").sum())(x)
    gx_ref = jax.grad(lambda x: fp4jax.dot(x, w, key=k, implementation="xla").sum())(x)
    np.testing.assert_array_equal(gx, gx_ref)  # the custom VJP's dgrad: on the reference
    assert set(calls) == {B.SUBSCRIPTS["fprop"]}


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


def test_kernels_decline_a_jax_whose_mosaic_api_they_do_not_know(monkeypatch):
    """On the GPU the Hopper backend is chosen only on the JAX releases whose Mosaic GPU API
    its kernels are written for (``support.MOSAIC_API``); elsewhere the automatic choice
    keeps the reference and ``implementation="pallas"`` says why. Interpret mode runs."""
    from pallas_kernels import support

    monkeypatch.delenv("FP4JAX_KERNELS", raising=False)
    monkeypatch.setattr(dot_sm90, "on_sm90", lambda: True)
    monkeypatch.setattr(support.jax, "__version__", "0.12.1")
    assert "JAX 0.12.1" in support.mosaic_api_reason()
    assert B.select(None, _call()) == (B.XLA,)
    with pytest.raises(ValueError, match="Mosaic GPU API"):
        B.select("pallas", _call())
    monkeypatch.setenv("FP4JAX_KERNELS", "interpret")
    assert B.select("pallas", _call())[0].mode == "interpret"
    for version in ("0.10.2", "0.11.2"):
        monkeypatch.setattr(support.jax, "__version__", version)
        assert support.mosaic_api_reason() is None
        monkeypatch.delenv("FP4JAX_KERNELS", raising=False)
        assert B.select(None, _call())[0] == dot_sm90.HopperBackend("on", "pallas")
