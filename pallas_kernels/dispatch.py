"""The standalone kernel operations of ``pallas_kernels``, each with its XLA fallback.

Every operation here has one entry whose meaning is a core XLA function (the reference it
is tested against) and whose Hopper (sm_90) kernels live beside it, grouped by operation
(``quantize/``, ``gemm/``):

* ``quantize`` / ``quantize_packed`` (``fp4jax.quantize``): NVFP4, bfloat16 input; 1x16
  blocks along the last axis, round-to-nearest (element count / 16 a multiple of 256,
  last axis a multiple of 16) or stochastic (rows % 4 == 0, last axis % 1024 == 0, a
  threefry key), or 16x16 tiles over the last two axes (``block_2d=True``,
  round-to-nearest: rows a multiple of 16, last axis a multiple of 1024; leading axes
  are stacked matrices). Bit-identical to ``fp4jax.quantize`` (codes, E4M3 scale bits,
  tensor scale);
* ``w4a16_matmul`` (``x @ dequantize(W)``): W an NVFP4 ``QuantizedArray`` (K, N) scaled
  along K (1x16 along axis 0, or 16x16 tiles); M <= 256, K % 64 == 0, N % 64 == 0.
  Equal up to float32 accumulation order;
* ``w4a4_matmul`` (``dequantize(A) @ dequantize(B)``): NVFP4 or MXFP4 operands scaled
  along K; decode kernel + bf16 GEMM (M % 64, N % 64, K % 256 == 0). Equal up to float32
  accumulation order.

``fp4jax.dot``'s backends are not here: ``dot_sm90.py`` (Hopper) and ``dot_sm100.py``
(Blackwell) implement ``fp4jax.backends.Backend`` and reach the core through its
entry-point registry. The names they moved there are re-exported below for one release.

These functions take ``backend``: ``"auto"`` (kernels on an sm_90 GPU when the shape,
dtype and options are supported, else XLA), ``"pallas"`` (kernels or a ValueError that
says why not) or ``"xla"`` (always the reference). ``FP4JAX_KERNELS=off`` turns ``"auto"``
into ``"xla"`` (``=on`` into ``"pallas"``); it is read at call (trace) time, nothing is
cached. Kernel modules are imported on first use (they load Pallas).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from fp4jax import quantization as qz
from fp4jax.formats import NVFP4, get_format

# Moved to dot_sm90 / dot_sm100 / support; kept here for one release (deprecated aliases).
from pallas_kernels.dot_sm90 import (  # noqa: F401
    KERNEL_AUTO_MIN_MKN,
    gemm_backend,
    make_operands,
    operand_kernel,
    scaled_gemm,
)
from pallas_kernels.dot_sm100 import NATIVE_MODES, native_gemm, native_mode  # noqa: F401
from pallas_kernels.support import (  # noqa: F401
    e2m1_reason,
    is_mx_fp4,
    is_nvfp4,
    mosaic_api_reason,
    on_sm90,
    on_sm100,
    spec_unsupported_reason,
)

BACKENDS = ("auto", "pallas", "xla")


def _resolve(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    env = os.environ.get("FP4JAX_KERNELS", "").lower()
    if backend == "auto" and env in ("off", "0", "xla"):
        return "xla"
    if backend == "auto" and env in ("on", "1", "pallas"):
        return "pallas"
    return backend


# ---------------------------------------------------------------------------
# Quantize to packed NVFP4. Reference: fp4jax.quantize. Kernels: quantize/packed_sm90.py.
# ---------------------------------------------------------------------------


def _rows(shape) -> int:
    r = 1
    for d in shape[:-1]:
        r *= d
    return r


def _key_reason(key) -> str | None:
    """None for a threefry key (typed or raw uint32) or no key, else why the kernels
    cannot draw its bits (they compute Threefry-2x32 in registers)."""
    if key is None:
        return None
    if hasattr(key, "dtype") and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        impl = str(jax.random.key_impl(key)).lower()
        if "threefry" not in impl:
            return f"kernels draw Threefry bits: key must be a threefry key, got {impl}"
    return None


def quantize_unsupported_reason(shape, dtype, *, fmt=None, axis=-1, block_2d=False,
                                rounding="nearest", key=None,
                                block_scale_rule="max", row_scaled=False) -> str | None:
    """None when a quantize kernel handles these arguments, else the reason.

    Kernels: 1x16 blocks along the last axis, round-to-nearest (``quantize_nvfp4_1x16``)
    or stochastic (``quantize_nvfp4_1x16_sr``); 16x16 tiles, round-to-nearest; all with
    the ``"max"`` block scale rule and one tensor scale (4over6, row-scaled tensors and
    MS-EDEN take the XLA path).
    Stochastic rounding needs a threefry ``key`` (checked when given). Blocks along
    another axis (e.g. 16x1 along the token axis) take the XLA path."""
    reason = spec_unsupported_reason(fmt, block_scale_rule=block_scale_rule,
                                     row_scaled=row_scaled, rounding=rounding)
    if reason is not None:
        return reason
    if is_mx_fp4(fmt):
        return ("the packed quantize kernels implement NVFP4 only (MXFP4 is quantized by "
                "fp4jax.dot's operand kernels; packed MXFP4 takes the XLA path)")
    from pallas_kernels.quantize import packed_sm90 as qk

    sr = rounding == "stochastic"
    if sr and (reason := _key_reason(key)) is not None:
        return reason
    name = jnp.dtype(dtype).name
    if block_2d:
        if sr:
            return "16x16 kernel implements round-to-nearest only (no stochastic rounding)"
        if len(shape) < 2:
            return "16x16 tiles need >= 2 dims"
        if shape[-2] % 16 or not qk.supported_2d((_rows(shape), shape[-1]), dtype):
            return (f"16x16 kernel needs bfloat16, rows % 16 == 0 and last axis %"
                    f" {16 * qk.G2D[-1]} == 0; got {name} {tuple(shape)}")
        return mosaic_api_reason() if on_sm90() else "no sm_90 GPU"
    if len(shape) < 1 or not -len(shape) <= axis < len(shape):
        return f"axis={axis} out of range for shape {tuple(shape)}"
    if axis % len(shape) != len(shape) - 1:
        return ("the packed kernels block along the last axis (or 16x16 tiles); other "
                "axes take the XLA path")
    c, r = shape[-1], _rows(shape)
    if sr:
        if not qk.supported_sr((r, c), dtype):
            return (f"stochastic-rounding kernel needs bfloat16, rows % 4 == 0, last axis "
                    f"% 1024 == 0 and size < 2^31; got {name} {tuple(shape)}")
    elif not qk.supported((r, c), dtype):
        return (f"kernel needs bfloat16, last axis % 16 == 0 and size/16 % {qk.SUB} == 0;"
                f" got {name} {tuple(shape)}")
    if not on_sm90():
        return "no sm_90 GPU"
    return mosaic_api_reason()


def is_supported(op: str, *args, **kwargs) -> bool:
    """``is_supported("quantize", shape, dtype, fmt=, axis=, block_2d=, rounding=)``,
    ``is_supported("w4a16_matmul", m, k, n, q=None)`` or ``is_supported("w4a4_matmul",
    m, k, n, qa=None, qb=None)``: True only on an sm_90 GPU."""
    if op == "quantize":
        return quantize_unsupported_reason(*args, **kwargs) is None
    if op == "w4a16_matmul":
        return w4a16_unsupported_reason(*args, **kwargs) is None
    if op == "w4a4_matmul":
        return w4a4_unsupported_reason(*args, **kwargs) is None
    raise ValueError(f"unknown op {op!r}: use quantize, w4a16_matmul or w4a4_matmul")


def _check_sr_key(rounding: str, key) -> None:
    if rounding not in ("nearest", "stochastic", "ms_eden"):
        raise ValueError(f"rounding must be 'nearest', 'stochastic' or 'ms_eden', got "
                         f"{rounding!r}")
    if rounding != "nearest" and key is None:
        raise ValueError(f"key: {rounding!r} rounding needs a PRNG key, pass "
                         "key=jax.random.key(seed) (a new key per call)")


def quantize_packed(x: jax.Array, *, block_2d: bool = False, rounding: str = "nearest",
                    key=None, backend: str = "auto"):
    """NVFP4 quantization, 1x16 blocks along the last axis (round-to-nearest or, with
    ``rounding="stochastic"`` and ``key``, stochastic) or (``block_2d``) 16x16 tiles over
    the last two axes (round-to-nearest), packed.

    Returns ``(packed uint8 (..., C/2), scale_bits, dec float32)``: ``packed`` is
    ``fp4jax.pack_e2m1(q.data)``, ``scale_bits`` the bits of ``q.scale`` (uint8
    (..., C/16), or (..., R/16, C/16) for 16x16) and ``dec`` is ``q.global_scale`` of
    ``q = fp4jax.quantize(x, fp4jax.NVFP4, block_2d=block_2d, rounding=rounding,
    key=key)``.
    """
    from pallas_kernels.quantize import packed_sm90 as qk

    _check_sr_key(rounding, key)
    backend = _resolve(backend)
    reason = quantize_unsupported_reason(x.shape, x.dtype, block_2d=block_2d,
                                         rounding=rounding, key=key)
    if backend == "pallas" and reason is not None:
        raise ValueError(f"pallas quantize kernel unavailable: {reason}")
    if backend == "xla" or reason is not None:
        q = qz.quantize(x, NVFP4, block_2d=block_2d, rounding=rounding, key=key)
        return (qz.pack_e2m1(q.data), jax.lax.bitcast_convert_type(q.scale, jnp.uint8),
                q.global_scale)
    c = x.shape[-1]
    if block_2d:
        # stacked matrices are stacked rows: 16-row tiles never straddle two matrices
        r = x.shape[-2]
        packed, sbits, dec = qk.quantize_nvfp4_2d(x.reshape(-1, c))
        return (packed.reshape(*x.shape[:-1], c // 2),
                sbits.reshape(*x.shape[:-2], r // 16, c // 16), dec)
    if rounding == "stochastic":
        # uniform_from_key views x as (prod(leading), C): the same as the 2D reshape
        packed, sbits, dec = qk.quantize_nvfp4_1x16_sr(x.reshape(-1, c), key)
    else:
        packed, sbits, dec = qk.quantize_nvfp4_1x16(x.reshape(-1, c))
    return (packed.reshape(*x.shape[:-1], c // 2), sbits.reshape(*x.shape[:-1], c // 16), dec)


def quantize(x: jax.Array, fmt=None, *, axis: int = -1, block_2d: bool = False,
             rounding: str = "nearest", key=None, backend: str = "auto",
             block_scale_rule: str = "max", row_scaled: bool = False,
             eden_group: int = 128):
    """Drop-in for ``fp4jax.quantize`` that uses a kernel when one applies (1x16 along the
    last axis with either rounding, 16x16 round-to-nearest; the ``"max"`` block scale
    rule, one tensor scale: 4over6, ``row_scaled`` and MS-EDEN run ``fp4jax.quantize``).

    The kernel result is unpacked into a ``QuantizedArray`` (one extra XLA pass over the
    packed bytes); callers that can consume packed data should use ``quantize_packed``.
    """
    fmt = NVFP4 if fmt is None else fmt
    _check_sr_key(rounding, key)
    backend = _resolve(backend)
    reason = quantize_unsupported_reason(x.shape, x.dtype, fmt=fmt, axis=axis,
                                         block_2d=block_2d, rounding=rounding, key=key,
                                         block_scale_rule=block_scale_rule,
                                         row_scaled=row_scaled)
    if backend == "pallas" and reason is not None:
        raise ValueError(f"pallas quantize kernel unavailable: {reason}")
    if backend == "xla" or reason is not None:
        return qz.quantize(x, fmt, axis=axis, block_2d=block_2d, rounding=rounding, key=key,
                           block_scale_rule=block_scale_rule, row_scaled=row_scaled,
                           eden_group=eden_group)
    fmt = get_format(fmt)
    packed, sbits, dec = quantize_packed(x, block_2d=block_2d, rounding=rounding, key=key,
                                         backend="pallas")
    data = qz.unpack_e2m1(packed, x.shape[-1], axis=-1)
    scale = jax.lax.bitcast_convert_type(sbits, jnp.float8_e4m3fn)
    if block_2d:
        return qz.QuantizedArray(data, scale, dec, fmt, None, True)
    return qz.QuantizedArray(data, scale, dec, fmt, -1, False)


# ---------------------------------------------------------------------------
# W4A16 GEMM.
# ---------------------------------------------------------------------------


def w4a16_unsupported_reason(m: int, k: int, n: int, q=None) -> str | None:
    """None when ``w4a16_matmul`` runs the kernel for x (m, k) @ W (k, n), else why not."""
    if q is not None:
        if not is_nvfp4(q.fmt):
            return "kernel implements NVFP4 weights only"
        if not q.block_2d and q.axis % q.ndim != 0:
            return "W must be scaled along K (axis=0 or 16x16 tiles)"
    if m > 256:
        return f"M <= 256 only (decode / small batches), got {m}"
    if k % 64 or n % 64:
        return f"K % 64 == 0 and N % 64 == 0 needed, got K={k}, N={n}"
    if not on_sm90():
        return "no sm_90 GPU"
    return mosaic_api_reason()


def prepare_weight(q):
    """Kernel layout of an NVFP4 weight ``QuantizedArray`` (K, N): ``(wp, ws, dec)``.

    Do this once per weight (an XLA relayout of the codes and scales; see
    ``pallas_kernels/gemm/w4a16_sm90.py``)."""
    from pallas_kernels.gemm import w4a16_sm90 as wk

    return wk.prepare_weight(q)


def w4a16_matmul(x: jax.Array, q, *, prepared=None, out_dtype=None, backend: str = "auto"):
    """``x (..., K) @ dequantize(q)`` for an NVFP4 weight ``q`` (K, N).

    ``prepared``: the ``(wp, ws, dec)`` of ``prepare_weight(q)`` if already made.
    ``out_dtype`` defaults to ``x.dtype``. The XLA path computes
    ``dot(x, dequantize(q, float32))`` in float32.
    """
    from pallas_kernels.gemm import w4a16_sm90 as wk

    backend = _resolve(backend)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    k, n = q.data.shape
    lead = x.shape[:-1]
    m = 1
    for d in lead:
        m *= d
    reason = w4a16_unsupported_reason(m, k, n, q)
    if reason is None and x.dtype != jnp.bfloat16:
        reason = f"x must be bfloat16, got {x.dtype}"
    if backend == "pallas" and reason is not None:
        raise ValueError(f"pallas W4A16 kernel unavailable: {reason}")
    if backend == "xla" or reason is not None:
        w = qz.dequantize(q, jnp.float32)
        y = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
        return y.astype(out_dtype)
    wp, ws, dec = prepared if prepared is not None else wk.prepare_weight(q)
    y = wk.w4a16_matmul(x.reshape(m, k), wp, ws, dec, out_dtype=out_dtype)
    return y.reshape(*lead, n)


# ---------------------------------------------------------------------------
# W4A4 GEMM (packed NVFP4 / MXFP4 x packed NVFP4 / MXFP4).
# ---------------------------------------------------------------------------

def w4a4_unsupported_reason(m: int, k: int, n: int, qa=None, qb=None) -> str | None:
    """None when ``w4a4_matmul`` runs the kernel for A (m, k) @ B (k, n), else why not
    (the decode kernel + bf16 GEMM needs M % 64, N % 64 and K % 256 == 0)."""
    from pallas_kernels.gemm.w4a4_sm90 import operand_unsupported_reason

    for name, q, ax in (("A", qa, 1), ("B", qb, 0)):
        if q is None:
            continue
        reason = e2m1_reason(q.fmt) or operand_unsupported_reason(q, ax)
        if reason is not None:
            return f"{reason} ({name})"
    if m % 64 or n % 64 or k % 256:
        return f"M % 64 == 0, N % 64 == 0 and K % 256 == 0 needed, got M={m}, K={k}, N={n}"
    if not on_sm90():
        return "no sm_90 GPU"
    return mosaic_api_reason()


def prepare_w4a4(qa, qb):
    """Kernel layouts of NVFP4 or MXFP4 A (M, K) and B (K, N): ``((aq, as, dec_a), (bq, bs,
    dec_b))`` (see ``gemm/w4a4_sm90``). Do this once per weight."""
    from pallas_kernels.gemm import w4a4_sm90 as w4

    return w4.prepare_a(qa), w4.prepare_b(qb)


def w4a4_matmul(qa, qb, *, prepared_a=None, prepared_b=None, out_dtype=jnp.bfloat16,
                backend: str = "auto"):
    """``dequantize(qa) @ dequantize(qb)`` for NVFP4 or MXFP4 (mixed allowed) ``qa`` (M, K)
    and ``qb`` (K, N), both scaled along K. Returns (M, N) ``out_dtype`` (bfloat16 or
    float32).

    ``prepared_a`` / ``prepared_b``: the kernel layouts (``prepare_w4a4``) if already
    made. The kernel decodes each operand to exact bf16 ``q * s`` and runs a bf16 GEMM
    with the tensor scales in its epilogue. The XLA path computes
    ``dot(dequantize(qa), dequantize(qb))`` in float32 (HIGHEST). Kernel results equal it
    up to float32 accumulation order.
    """
    from pallas_kernels.gemm import w4a4_sm90 as w4

    backend = _resolve(backend)
    if qa.ndim != 2 or qb.ndim != 2 or qa.shape[1] != qb.shape[0]:
        raise ValueError(f"need A (M, K) and B (K, N), got {qa.shape} and {qb.shape}")
    (m, k), n = qa.shape, qb.shape[1]
    reason = w4a4_unsupported_reason(m, k, n, qa, qb)
    if backend == "pallas" and reason is not None:
        raise ValueError(f"pallas W4A4 kernel unavailable: {reason}")
    if backend == "xla" or reason is not None:
        y = jnp.dot(qz.dequantize(qa, jnp.float32), qz.dequantize(qb, jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)
        return y.astype(out_dtype)
    pa = prepared_a if prepared_a is not None else w4.prepare_a(qa)
    pb = prepared_b if prepared_b is not None else w4.prepare_b(qb)
    return w4.w4a4_matmul_two_pass(*pa, *pb, out_dtype=out_dtype,
                                   scale_a=w4.scale_format(qa.fmt),
                                   scale_b=w4.scale_format(qb.fmt))
