"""Entry points that fp4jax calls: the Pallas Mosaic GPU kernels where they apply,
the XLA reference path everywhere else.

Every function takes ``backend``: ``"auto"`` (kernels on an sm_90 GPU when the shape,
dtype and options are supported, else XLA), ``"pallas"`` (kernels or a ValueError that
says why not) or ``"xla"`` (always the reference). The environment variable
``FP4JAX_KERNELS=off`` turns ``"auto"`` into ``"xla"`` (``=on`` turns it into
``"pallas"``); it is read at call (trace) time, nothing is cached.

What the kernels cover (everything else goes to XLA under ``"auto"``):

* ``quantize``: NVFP4, round-to-nearest, bfloat16 input; 1x16 blocks along the last
  axis (element count / 16 a multiple of 256, last axis a multiple of 16), or 16x16
  tiles over the last two axes (``block_2d=True``: rows a multiple of 16, last axis a
  multiple of 1024; leading axes are stacked matrices). Bit-identical to
  ``fp4jax.quantize`` (codes, E4M3 scale bits, tensor scale).
* ``w4a16_matmul``: ``x (M, K) bf16 @ W`` with W an NVFP4 ``QuantizedArray`` (K, N)
  scaled along K (1x16 along axis 0, or 16x16 tiles); M <= 256, K % 256 == 0,
  N % 64 == 0. Equal to ``x @ dequantize(W)`` up to float32 accumulation order.
* ``w4a4_matmul``: NVFP4 or MXFP4 A (M, K) @ NVFP4 or MXFP4 B (K, N), both scaled along
  K; two-pass (decode kernel + XLA bf16 GEMM: M % 64, N % 64, K % 256 == 0; both formats)
  or fused (NVFP4 only; M % 64, N % 128, K % 128 == 0). Equal to
  ``dequantize(A) @ dequantize(B)`` up to float32 accumulation order.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

BACKENDS = ("auto", "pallas", "xla")


def on_sm90() -> bool:
    """True when JAX's default device is an NVIDIA GPU of compute capability 9.x."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    if dev.platform != "gpu":
        return False
    cc = str(getattr(dev, "compute_capability", ""))
    return cc.startswith("9")


def _resolve(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    env = os.environ.get("FP4JAX_KERNELS", "").lower()
    if backend == "auto" and env in ("off", "0", "xla"):
        return "xla"
    if backend == "auto" and env in ("on", "1", "pallas"):
        return "pallas"
    return backend


def _nvfp4(fmt) -> bool:
    import fp4jax

    return fmt == fp4jax.NVFP4 or fmt == "nvfp4"


# ---------------------------------------------------------------------------
# Quantize.
# ---------------------------------------------------------------------------


def quantize_unsupported_reason(shape, dtype, *, fmt=None, axis=-1, block_2d=False,
                                rounding="nearest") -> str | None:
    """None when the quantize kernel handles these arguments, else the reason."""
    from pallas_kernels import quantize_nvfp4_sm90 as qk

    if fmt is not None and not _nvfp4(fmt):
        return "kernel implements NVFP4 only"
    if rounding != "nearest":
        return "kernel implements round-to-nearest only (no stochastic rounding)"
    if block_2d:
        if len(shape) < 2:
            return "16x16 tiles need >= 2 dims"
        r = 1
        for d in shape[:-1]:
            r *= d
        if shape[-2] % 16 or not qk.supported_2d((r, shape[-1]), dtype):
            return (f"16x16 kernel needs bfloat16, rows % 16 == 0 and last axis %"
                    f" {16 * qk.G2D[-1]} == 0; got {jnp.dtype(dtype).name} {tuple(shape)}")
        return None if on_sm90() else "no sm_90 GPU"
    if len(shape) < 1 or axis % len(shape) != len(shape) - 1:
        return "kernel blocks along the last axis only"
    c = shape[-1]
    r = 1
    for d in shape[:-1]:
        r *= d
    if not qk.supported((r, c), dtype):
        return (f"kernel needs bfloat16, last axis % 16 == 0 and size/16 % {qk.SUB} == 0;"
                f" got {jnp.dtype(dtype).name} {tuple(shape)}")
    if not on_sm90():
        return "no sm_90 GPU"
    return None


def is_supported(op: str, *args, **kwargs) -> bool:
    """``is_supported("quantize", shape, dtype, fmt=, axis=, block_2d=, rounding=)`` or
    ``is_supported("w4a16_matmul", m, k, n, q=None)``: True only on an sm_90 GPU."""
    if op == "quantize":
        return quantize_unsupported_reason(*args, **kwargs) is None
    if op == "w4a16_matmul":
        return w4a16_unsupported_reason(*args, **kwargs) is None
    if op == "w4a4_matmul":
        return w4a4_unsupported_reason(*args, **kwargs) is None
    raise ValueError(f"unknown op {op!r}")


def quantize_packed(x: jax.Array, *, block_2d: bool = False, backend: str = "auto"):
    """NVFP4 quantization, 1x16 blocks along the last axis or (``block_2d``) 16x16 tiles
    over the last two axes, packed.

    Returns ``(packed uint8 (..., C/2), scale_bits, dec float32)``: ``packed`` is
    ``fp4jax.pack_e2m1(q.data)``, ``scale_bits`` the bits of ``q.scale`` (uint8
    (..., C/16), or (..., R/16, C/16) for 16x16) and ``dec`` is ``q.global_scale`` of
    ``q = fp4jax.quantize(x, fp4jax.NVFP4, block_2d=block_2d)``.
    """
    import fp4jax
    from pallas_kernels import quantize_nvfp4_sm90 as qk

    backend = _resolve(backend)
    reason = quantize_unsupported_reason(x.shape, x.dtype, block_2d=block_2d)
    if backend == "pallas" and reason is not None:
        raise ValueError(f"pallas quantize kernel unavailable: {reason}")
    if backend == "xla" or reason is not None:
        q = fp4jax.quantize(x, fp4jax.NVFP4, block_2d=block_2d)
        return (fp4jax.pack_e2m1(q.data), jax.lax.bitcast_convert_type(q.scale, jnp.uint8),
                q.global_scale)
    c = x.shape[-1]
    if block_2d:
        # stacked matrices are stacked rows: 16-row tiles never straddle two matrices
        r = x.shape[-2]
        packed, sbits, dec = qk.quantize_nvfp4_2d(x.reshape(-1, c))
        return (packed.reshape(*x.shape[:-1], c // 2),
                sbits.reshape(*x.shape[:-2], r // 16, c // 16), dec)
    packed, sbits, dec = qk.quantize_nvfp4_1x16(x.reshape(-1, c))
    return (packed.reshape(*x.shape[:-1], c // 2), sbits.reshape(*x.shape[:-1], c // 16), dec)


def quantize(x: jax.Array, fmt=None, *, axis: int = -1, block_2d: bool = False,
             rounding: str = "nearest", key=None, backend: str = "auto"):
    """Drop-in for ``fp4jax.quantize`` that uses the kernel when it applies.

    The kernel result is unpacked into a ``QuantizedArray`` (one extra XLA pass over the
    packed bytes); callers that can consume packed data should use ``quantize_packed``.
    """
    import fp4jax
    from fp4jax.quantize import QuantizedArray

    fmt = fp4jax.NVFP4 if fmt is None else fmt
    backend = _resolve(backend)
    reason = quantize_unsupported_reason(x.shape, x.dtype, fmt=fmt, axis=axis,
                                         block_2d=block_2d, rounding=rounding)
    if backend == "pallas" and reason is not None:
        raise ValueError(f"pallas quantize kernel unavailable: {reason}")
    if backend == "xla" or reason is not None:
        return fp4jax.quantize(x, fmt, axis=axis, block_2d=block_2d, rounding=rounding, key=key)
    packed, sbits, dec = quantize_packed(x, block_2d=block_2d, backend="pallas")
    data = fp4jax.unpack_e2m1(packed, x.shape[-1], axis=-1)
    scale = jax.lax.bitcast_convert_type(sbits, jnp.float8_e4m3fn)
    if block_2d:
        return QuantizedArray(data, scale, dec, fp4jax.get_format(fmt), None, True)
    return QuantizedArray(data, scale, dec, fp4jax.get_format(fmt), -1, False)


# ---------------------------------------------------------------------------
# W4A16 GEMM.
# ---------------------------------------------------------------------------


def w4a16_unsupported_reason(m: int, k: int, n: int, q=None) -> str | None:
    """None when ``w4a16_matmul`` runs the kernel for x (m, k) @ W (k, n), else why not."""
    if q is not None:
        if not _nvfp4(q.fmt):
            return "kernel implements NVFP4 weights only"
        if not q.block_2d and q.axis % q.ndim != 0:
            return "W must be scaled along K (axis=0 or 16x16 tiles)"
    if m > 256:
        return f"M <= 256 only (decode / small batches), got {m}"
    if k % 256 or n % 64:
        return f"K % 256 == 0 and N % 64 == 0 needed, got K={k}, N={n}"
    if not on_sm90():
        return "no sm_90 GPU"
    return None


def prepare_weight(q):
    """Kernel layout of an NVFP4 weight ``QuantizedArray`` (K, N): ``(wq, ws, dec)``.

    Do this once per weight (it is an XLA relayout of the codes and scales)."""
    from pallas_kernels import fp4_matmul_sm90 as mm

    return mm.prepare_weight(q)


def w4a16_matmul(x: jax.Array, q, *, prepared=None, out_dtype=None, backend: str = "auto"):
    """``x (..., K) @ dequantize(q)`` for an NVFP4 weight ``q`` (K, N).

    ``prepared``: the ``(wq, ws, dec)`` of ``prepare_weight(q)`` if already made.
    ``out_dtype`` defaults to ``x.dtype``. The XLA path computes
    ``dot(x, dequantize(q, float32))`` in float32.
    """
    import fp4jax
    from pallas_kernels import fp4_matmul_sm90 as mm

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
        w = fp4jax.dequantize(q, jnp.float32)
        y = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
        return y.astype(out_dtype)
    wq, ws, dec = prepared if prepared is not None else mm.prepare_weight(q)
    y = mm.w4a16_matmul(x.reshape(m, k), wq, ws, dec, out_dtype=out_dtype)
    return y.reshape(*lead, n)


# ---------------------------------------------------------------------------
# W4A4 GEMM (packed NVFP4 / MXFP4 x packed NVFP4 / MXFP4).
# ---------------------------------------------------------------------------

W4A4_IMPLS = ("two_pass", "fused")


def w4a4_unsupported_reason(m: int, k: int, n: int, qa=None, qb=None,
                            impl: str = "two_pass") -> str | None:
    """None when ``w4a4_matmul`` runs a kernel for A (m, k) @ B (k, n), else why not.

    ``two_pass`` (decode kernel + XLA bf16 GEMM) needs M % 64, N % 64 and K % 256 == 0;
    ``fused`` needs M % 64, N % 128 and K % 128 == 0.
    """
    if impl not in W4A4_IMPLS:
        raise ValueError(f"impl must be one of {W4A4_IMPLS}, got {impl!r}")
    from pallas_kernels.fp4_gemm_w4a4_sm90 import operand_unsupported_reason, scale_format

    for name, q, ax in (("A", qa, 1), ("B", qb, 0)):
        if q is None:
            continue
        reason = operand_unsupported_reason(q, ax)
        if reason is not None:
            return f"{reason} ({name})"
        if impl == "fused" and scale_format(q.fmt) != "e4m3":
            return f"fused kernel implements NVFP4 operands only ({name}: {q.fmt.name})"
    kq, nq = (256, 64) if impl == "two_pass" else (128, 128)
    if m % 64 or n % nq or k % kq:
        return (f"{impl}: M % 64 == 0, N % {nq} == 0 and K % {kq} == 0 needed,"
                f" got M={m}, K={k}, N={n}")
    if not on_sm90():
        return "no sm_90 GPU"
    return None


def prepare_w4a4(qa, qb):
    """Kernel layouts of NVFP4 or MXFP4 A (M, K) and B (K, N): ``((aq, as, dec_a), (bq, bs,
    dec_b))`` (see ``fp4_gemm_w4a4_sm90``). Do this once per weight."""
    from pallas_kernels import fp4_gemm_w4a4_sm90 as w4

    return w4.prepare_a(qa), w4.prepare_b(qb)


def w4a4_matmul(qa, qb, *, prepared_a=None, prepared_b=None, out_dtype=jnp.bfloat16,
                impl: str = "two_pass", backend: str = "auto"):
    """``dequantize(qa) @ dequantize(qb)`` for NVFP4 or MXFP4 (``impl="two_pass"``; the fused
    kernel: NVFP4) ``qa`` (M, K) and ``qb`` (K, N), both scaled along K. Returns (M, N)
    ``out_dtype`` (bfloat16 or float32).

    ``prepared_a`` / ``prepared_b``: the kernel layouts (``prepare_w4a4``) if already
    made. ``impl``: ``"two_pass"`` (decode kernel + XLA bf16 GEMM) or ``"fused"``.
    The XLA path computes ``dot(dequantize(qa), dequantize(qb))`` in float32 (HIGHEST).
    Kernel results equal it up to float32 accumulation order.
    """
    import fp4jax
    from pallas_kernels import fp4_gemm_w4a4_sm90 as w4

    backend = _resolve(backend)
    if qa.ndim != 2 or qb.ndim != 2 or qa.shape[1] != qb.shape[0]:
        raise ValueError(f"need A (M, K) and B (K, N), got {qa.shape} and {qb.shape}")
    (m, k), n = qa.shape, qb.shape[1]
    reason = w4a4_unsupported_reason(m, k, n, qa, qb, impl)
    if backend == "pallas" and reason is not None:
        raise ValueError(f"pallas W4A4 kernel unavailable: {reason}")
    if backend == "xla" or reason is not None:
        y = jnp.dot(fp4jax.dequantize(qa, jnp.float32), fp4jax.dequantize(qb, jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)
        return y.astype(out_dtype)
    pa = prepared_a if prepared_a is not None else w4.prepare_a(qa)
    pb = prepared_b if prepared_b is not None else w4.prepare_b(qb)
    if impl == "fused":
        return w4.w4a4_matmul_fused(*pa, *pb, out_dtype=out_dtype)
    return w4.w4a4_matmul_two_pass(*pa, *pb, out_dtype=out_dtype,
                                   scale_a=w4.scale_format(qa.fmt),
                                   scale_b=w4.scale_format(qb.fmt))
