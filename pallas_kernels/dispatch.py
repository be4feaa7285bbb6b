"""Entry points that fp4jax calls: the Pallas Mosaic GPU kernels where they apply,
the XLA reference path everywhere else.

Every function takes ``backend``: ``"auto"`` (kernels on an sm_90 GPU when the shape,
dtype and options are supported, else XLA), ``"pallas"`` (kernels or a ValueError that
says why not) or ``"xla"`` (always the reference). The environment variable
``FP4JAX_KERNELS=off`` turns ``"auto"`` into ``"xla"`` (``=on`` turns it into
``"pallas"``); it is read at call (trace) time, nothing is cached.

What the kernels cover (everything else goes to XLA under ``"auto"``):

* ``quantize``: NVFP4, bfloat16 input; 1x16 blocks along the last axis, round-to-nearest
  (element count / 16 a multiple of 256, last axis a multiple of 16) or stochastic
  (rows % 4 == 0, last axis % 1024 == 0, a threefry key), or 16x16 tiles over the last
  two axes (``block_2d=True``, round-to-nearest: rows a multiple of 16, last axis a
  multiple of 1024; leading axes are stacked matrices), or 16x1 blocks along axis 0 of a
  2D (tokens, features) tensor, round-to-nearest or stochastic, optionally after the
  16-point RHT along the tokens (``quantize_cols_packed``: tokens % 256 == 0, features %
  256 == 0; codes written transposed, (C, R/2)). Bit-identical to ``fp4jax.quantize``
  (codes, E4M3 scale bits, tensor scale).
* ``w4a16_matmul``: ``x (M, K) bf16 @ W`` with W an NVFP4 ``QuantizedArray`` (K, N)
  scaled along K (1x16 along axis 0, or 16x16 tiles); M <= 256, K % 64 == 0,
  N % 64 == 0 (`pallas_kernels/w4a16_sm90.py`). Equal to ``x @ dequantize(W)`` up to
  float32 accumulation order.
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


COLS_KERNEL_IN_AUTO = False
"""Whether ``backend="auto"`` routes 16x1 quantization along axis 0 to the packed kernel
(``quantize_cols_nvfp4_sm90``). Off: it is bit-exact in interpret mode and lowers for CUDA
with JAX 0.10.2 and (since commit 69289fa) 0.11.2, but on the H200 its codes and scales
differ from ``fp4jax.quantize`` in about half the bytes (run 31), so on a GPU even
``backend="pallas"`` refuses it unless ``FP4JAX_UNSAFE_COLS_KERNEL=1`` (for debugging)."""


def quantize_unsupported_reason(shape, dtype, *, fmt=None, axis=-1, block_2d=False,
                                rounding="nearest", rht: bool = False,
                                key=None, explicit: bool = False) -> str | None:
    """None when a quantize kernel handles these arguments, else the reason.

    Kernels: 1x16 blocks along the last axis, round-to-nearest (``quantize_nvfp4_1x16``)
    or stochastic (``quantize_nvfp4_1x16_sr``); 16x16 tiles, round-to-nearest; 16x1
    blocks along axis 0 of a 2D (tokens, features) tensor, optionally after the RHT
    (``rht``), either rounding (``quantize_cols_nvfp4_sm90``). Stochastic rounding needs
    a threefry ``key`` (checked when given). ``explicit``: the caller asked for the kernel
    (``backend="pallas"``), which also admits kernels kept out of ``auto``
    (``COLS_KERNEL_IN_AUTO``)."""
    from pallas_kernels import quantize_cols_nvfp4_sm90 as qc
    from pallas_kernels import quantize_nvfp4_sm90 as qk

    if fmt is not None and not _nvfp4(fmt):
        return "kernel implements NVFP4 only"
    if rounding not in ("nearest", "stochastic"):
        return f"unknown rounding {rounding!r}"
    sr = rounding == "stochastic"
    if sr and (reason := _key_reason(key)) is not None:
        return reason
    name = jnp.dtype(dtype).name
    if block_2d:
        if sr:
            return "16x16 kernel implements round-to-nearest only (no stochastic rounding)"
        if rht:
            return "16x16 kernel has no RHT (the RHT runs along the token axis, axis=0)"
        if len(shape) < 2:
            return "16x16 tiles need >= 2 dims"
        if shape[-2] % 16 or not qk.supported_2d((_rows(shape), shape[-1]), dtype):
            return (f"16x16 kernel needs bfloat16, rows % 16 == 0 and last axis %"
                    f" {16 * qk.G2D[-1]} == 0; got {name} {tuple(shape)}")
        return None if on_sm90() else "no sm_90 GPU"
    if len(shape) < 1 or not -len(shape) <= axis < len(shape):
        return f"axis={axis} out of range for shape {tuple(shape)}"
    if len(shape) == 2 and axis % 2 == 0:  # 16x1 along the token axis
        reason = qc.unsupported_reason(shape, dtype)
        if reason is not None:
            return f"16x1 (axis=0) kernel: {reason}"
        if not (explicit or COLS_KERNEL_IN_AUTO):
            return ("16x1 (axis=0) packed kernel is kept out of backend='auto' (wrong "
                    "results on the H200, see COLS_KERNEL_IN_AUTO); the XLA path is exact")
        if not on_sm90():
            return "no sm_90 GPU"
        if os.environ.get("FP4JAX_UNSAFE_COLS_KERNEL") != "1":
            return ("16x1 (axis=0) packed kernel gives wrong codes on the H200 (GPU run 31) "
                    "and is disabled; use backend='xla' (exact), or set "
                    "FP4JAX_UNSAFE_COLS_KERNEL=1 to debug it")
        return None
    if axis % len(shape) != len(shape) - 1:
        return ("kernels block along the last axis, or along axis 0 of a 2D (tokens, "
                "features) tensor")
    if rht:
        return "the RHT kernel rotates the token axis: axis=0 of a 2D tensor only"
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


def _check_sr_key(rounding: str, key) -> None:
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if rounding == "stochastic" and key is None:
        raise ValueError("key: stochastic rounding needs a PRNG key, pass "
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
    key=key)``. For 16x1 blocks along the token axis see ``quantize_cols_packed``.
    """
    import fp4jax
    from pallas_kernels import quantize_nvfp4_sm90 as qk

    _check_sr_key(rounding, key)
    backend = _resolve(backend)
    reason = quantize_unsupported_reason(x.shape, x.dtype, block_2d=block_2d,
                                         rounding=rounding, key=key)
    if backend == "pallas" and reason is not None:
        raise ValueError(f"pallas quantize kernel unavailable: {reason}")
    if backend == "xla" or reason is not None:
        q = fp4jax.quantize(x, fp4jax.NVFP4, block_2d=block_2d, rounding=rounding, key=key)
        return (fp4jax.pack_e2m1(q.data), jax.lax.bitcast_convert_type(q.scale, jnp.uint8),
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


def quantize_cols_packed(x: jax.Array, *, signs=None, key=None, backend: str = "auto"):
    """NVFP4 16x1 blocks along the token axis (axis 0) of x (R tokens, C features),
    optionally after the 16-point random Hadamard transform along it (``signs``: the 16
    +-1 signs, e.g. ``fp4jax.hadamard.default_signs(16)``), stochastic rounding with
    ``key`` (else round-to-nearest); packed in the transposed (K-major) layout of
    ``quantize_cols_nvfp4_sm90``.

    Returns ``(codes uint8 (C, R/2), scale_bits uint8 (C, R/16), dec float32)``:
    ``pack_e2m1(q.data.T)``, ``bitcast(q.scale.T, uint8)``, ``q.global_scale`` of ``q =
    fp4jax.quantize(xin, NVFP4, axis=0, rounding=..., key=key)`` with ``xin =
    random_hadamard_transform(x, axis=0, size=16, signs=signs)`` (or ``x``).
    """
    import fp4jax
    from fp4jax.hadamard import random_hadamard_transform
    from pallas_kernels import quantize_cols_nvfp4_sm90 as qc

    if not hasattr(x, "shape") or len(x.shape) != 2:
        raise ValueError(f"x must be 2D (tokens, features), got shape "
                         f"{tuple(getattr(x, 'shape', ()))}")
    if signs is not None:
        signs = jnp.asarray(signs, jnp.float32)
        if signs.shape != (16,):
            raise ValueError(f"signs must hold 16 values (+-1), got shape {signs.shape}")
    rounding = "stochastic" if key is not None else "nearest"
    backend = _resolve(backend)
    reason = quantize_unsupported_reason(x.shape, x.dtype, axis=0, rounding=rounding,
                                         rht=signs is not None, key=key,
                                         explicit=backend == "pallas")
    if backend == "pallas" and reason is not None:
        raise ValueError(f"pallas quantize kernel unavailable: {reason}")
    if backend == "xla" or reason is not None:
        xin = x if signs is None else random_hadamard_transform(x, axis=0, size=16,
                                                                signs=signs)
        q = fp4jax.quantize(xin, fp4jax.NVFP4, axis=0, rounding=rounding, key=key)
        return (fp4jax.pack_e2m1(q.data.T),
                jax.lax.bitcast_convert_type(q.scale.T, jnp.uint8), q.global_scale)
    return qc.quantize_cols_nvfp4(x, key, signs=signs)


def quantize(x: jax.Array, fmt=None, *, axis: int = -1, block_2d: bool = False,
             rounding: str = "nearest", key=None, backend: str = "auto"):
    """Drop-in for ``fp4jax.quantize`` that uses a kernel when one applies (1x16 along the
    last axis with either rounding, 16x16 round-to-nearest, 16x1 along axis 0 of a 2D
    tensor with either rounding).

    The kernel result is unpacked into a ``QuantizedArray`` (one extra XLA pass over the
    packed bytes); callers that can consume packed data should use ``quantize_packed`` /
    ``quantize_cols_packed``.
    """
    import fp4jax
    from fp4jax.quantize import QuantizedArray

    fmt = fp4jax.NVFP4 if fmt is None else fmt
    _check_sr_key(rounding, key)
    backend = _resolve(backend)
    reason = quantize_unsupported_reason(x.shape, x.dtype, fmt=fmt, axis=axis,
                                         block_2d=block_2d, rounding=rounding, key=key,
                                         explicit=backend == "pallas")
    if backend == "pallas" and reason is not None:
        raise ValueError(f"pallas quantize kernel unavailable: {reason}")
    if backend == "xla" or reason is not None:
        return fp4jax.quantize(x, fmt, axis=axis, block_2d=block_2d, rounding=rounding, key=key)
    fmt = fp4jax.get_format(fmt)
    if not block_2d and x.ndim == 2 and axis % 2 == 0:
        codes, sbits, dec = quantize_cols_packed(x, key=key if rounding == "stochastic"
                                                 else None, backend="pallas")
        data = fp4jax.unpack_e2m1(codes, x.shape[0], axis=-1).T
        scale = jax.lax.bitcast_convert_type(sbits, jnp.float8_e4m3fn).T
        return QuantizedArray(data, scale, dec, fmt, -2, False)
    packed, sbits, dec = quantize_packed(x, block_2d=block_2d, rounding=rounding, key=key,
                                         backend="pallas")
    data = fp4jax.unpack_e2m1(packed, x.shape[-1], axis=-1)
    scale = jax.lax.bitcast_convert_type(sbits, jnp.float8_e4m3fn)
    if block_2d:
        return QuantizedArray(data, scale, dec, fmt, None, True)
    return QuantizedArray(data, scale, dec, fmt, -1, False)


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
    if k % 64 or n % 64:
        return f"K % 64 == 0 and N % 64 == 0 needed, got K={k}, N={n}"
    if not on_sm90():
        return "no sm_90 GPU"
    return None


def prepare_weight(q):
    """Kernel layout of an NVFP4 weight ``QuantizedArray`` (K, N): ``(wp, ws, dec)``.

    Do this once per weight (an XLA relayout of the codes and scales; see
    ``pallas_kernels/w4a16_sm90.py``)."""
    from pallas_kernels import w4a16_sm90 as wk

    return wk.prepare_weight(q)


def w4a16_matmul(x: jax.Array, q, *, prepared=None, out_dtype=None, backend: str = "auto"):
    """``x (..., K) @ dequantize(q)`` for an NVFP4 weight ``q`` (K, N).

    ``prepared``: the ``(wp, ws, dec)`` of ``prepare_weight(q)`` if already made.
    ``out_dtype`` defaults to ``x.dtype``. The XLA path computes
    ``dot(x, dequantize(q, float32))`` in float32.
    """
    import fp4jax
    from pallas_kernels import w4a16_sm90 as wk

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
    wp, ws, dec = prepared if prepared is not None else wk.prepare_weight(q)
    y = wk.w4a16_matmul(x.reshape(m, k), wp, ws, dec, out_dtype=out_dtype)
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
