"""Random Hadamard transform (RHT) over tiles along one axis.

NVFP4 paper section 4.1 and Appendix C: the Wgrad inputs are rotated by a
16x16 random Hadamard matrix ``diag(signs) @ H / sqrt(16)`` along the
contraction (token) axis; the rotation is orthogonal, so applying it to both
operands leaves the product unchanged while spreading block outliers.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import numerics

__all__ = ["TE_SIGN_VECTOR", "SIGN_POLICIES", "check_size", "default_signs", "unsigned_signs",
           "fwht_tiles", "hadamard_matrix", "random_hadamard_transform", "resolve_signs"]

TE_SIGN_VECTOR = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""Transformer Engine's fixed Wgrad sign vector (``get_wgrad_sign_vector`` in
``transformer_engine/jax/quantize/hadamard.py`` and the PyTorch ``nvfp4_tensor.py``):
one vector for all layers and steps."""


def hadamard_matrix(size: int) -> np.ndarray:
    """Normalized Sylvester Hadamard matrix ``H_size / sqrt(size)`` (float64, symmetric)."""
    check_size(size)
    h = np.array([[1.0]])
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(size)


def check_size(size: int) -> None:
    """Refuses a Hadamard tile size that is not a power of two in 2..256 (ValueError)."""
    if not isinstance(size, int) or size < 2 or size > 256 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two in 2..256, got {size!r}")


def default_signs(size: int) -> np.ndarray:
    """The default sign vector for a tile of ``size``.

    Size 16 is Transformer Engine's ``TE_SIGN_VECTOR``. Smaller sizes take its
    first ``size`` entries; larger sizes extend it with Rademacher signs from
    ``numpy.random.default_rng(size)`` (fixed, documented, reproducible).
    """
    check_size(size)
    te = np.asarray(TE_SIGN_VECTOR, np.float32)
    if size <= 16:
        return te[:size].copy()
    extra = np.random.default_rng(size).choice([-1.0, 1.0], size - 16).astype(np.float32)
    return np.concatenate([te, extra])


def unsigned_signs(size: int) -> np.ndarray:
    """The sign vector of the deterministic (unsigned) Hadamard transform: all ``+1``, so
    the rotation is the normalized Sylvester matrix ``H_size / sqrt(size)`` itself, with no
    random sign flips (``signs="ones"``; a recipe's ``hadamard_signs="ones"``).

    Source: Cim et al. (AMD), "Pretraining Large Language Models with MXFP4 on Native FP4
    Hardware", arXiv 2605.09825 (abstract): on Wgrad, "stochastic rounding and randomized
    Hadamard rotations fail to stabilize training once Wgrad is quantized, whereas
    deterministic Hadamard rotations consistently restore stable optimization". The
    paper's text beyond its abstract could not be read here, so which deterministic
    rotation they use (its size, whether it has any fixed sign vector) is not confirmed:
    ``"ones"`` is the literal reading (no signs at all); fp4jax's default ``None``
    (Transformer Engine's fixed vector, the same every step and layer) is a deterministic
    rotation too, and ``"random"`` the randomized one they compare against.
    """
    check_size(size)
    return np.ones((size,), np.float32)


SIGN_POLICIES = ("te", "ones")
"""The named sign vectors ``resolve_signs`` takes as strings: ``"te"`` (``default_signs``,
the same as ``None``) and ``"ones"`` (``unsigned_signs``)."""


def resolve_signs(signs: Any, size: int) -> jax.Array:
    """Turn a ``signs`` argument into a float32 vector of +-1 of length ``size``.

    Accepts ``None`` / ``"te"`` (``default_signs``), ``"ones"`` (``unsigned_signs``: the
    deterministic Hadamard, no sign flips), an ``int`` seed (Rademacher signs from
    ``jax.random.key(seed)``), a ``jax.random`` key (per-call random signs) or an explicit
    array of +-1 of length ``size``.
    """
    if signs is None or (isinstance(signs, str) and signs == "te"):
        return jnp.asarray(default_signs(size))
    if isinstance(signs, str) and signs == "ones":
        return jnp.asarray(unsigned_signs(size))
    if isinstance(signs, str):
        raise ValueError(f"signs={signs!r}: use None/'te', 'ones', an int seed, a key or an "
                         "array")
    if isinstance(signs, bool):
        raise TypeError("signs must be None/'te', 'ones', an int seed, a key or a +-1 array, "
                        "not a bool")
    if isinstance(signs, int):
        return jax.random.rademacher(jax.random.key(signs), (size,), jnp.float32)
    arr = signs if isinstance(signs, jax.Array) else jnp.asarray(signs)
    if jnp.issubdtype(arr.dtype, jax.dtypes.prng_key):
        return jax.random.rademacher(arr, (size,), jnp.float32)
    if arr.dtype == jnp.uint32 and arr.shape == (2,):  # raw PRNGKey
        return jax.random.rademacher(arr, (size,), jnp.float32)
    if arr.shape != (size,):
        raise ValueError(f"signs must have shape ({size},), got {arr.shape}")
    try:  # checked when the signs are concrete; traced signs (inside jit) pass through
        concrete = np.asarray(arr, np.float64)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        concrete = None
    if concrete is not None and not np.all(np.abs(concrete) == 1):
        raise ValueError("signs must hold only +1 and -1 (the transform must stay orthogonal)")
    return arr.astype(jnp.float32)


def random_hadamard_transform(
    x: jax.Array, axis: int = -1, size: int = 16, signs: Any = None
) -> jax.Array:
    """Rotate every tile of ``size`` along ``axis``: ``v -> v @ (diag(signs) @ H / sqrt(size))``.

    This is Transformer Engine's RHT (``get_rht_matrix``: sign matrix times the
    normalized Hadamard matrix, applied to row vectors), computed in float32 as
    ``fwht_tiles(v * signs)`` (a butterfly with a fixed addition order).
    The matrix is orthogonal, so ``rht(a, 0) .T @ rht(b, 0) == a.T @ b`` up to
    float32 rounding, and its inverse is its transpose.

    Args:
      x: float array; ``x.shape[axis]`` must be a multiple of ``size`` (pad with
        zeros first otherwise: zero padding does not change a product).
      axis: the axis to transform along (the contraction axis of the product).
      size: tile size, a power of two in 2..256 (16 in the NVFP4 recipe).
      signs: ``None``/``"te"`` (Transformer Engine's fixed vector), ``"ones"`` (no
        sign flips: the deterministic Hadamard, ``unsigned_signs``), an ``int``
        seed, a ``jax.random`` key (fresh signs per call) or a +-1 array of length
        ``size``.
    Returns:
      float32 array of ``x.shape``.
    """
    if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
        raise TypeError(f"x must have a floating dtype, got {jnp.asarray(x).dtype}")
    check_size(size)
    x = numerics.exact_float32(x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for x of shape {x.shape}")
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % size:
        raise ValueError(
            f"random_hadamard_transform: x.shape[{axis}]={n} is not a multiple of size={size}; "
            "zero-pad that axis to a multiple first"
        )
    return _rht_jit(x, resolve_signs(signs, size), axis, size)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _rht_jit(x: jax.Array, signs: jax.Array, axis: int, size: int) -> jax.Array:
    n = x.shape[axis]
    pre, post = x.shape[:axis], x.shape[axis + 1:]
    tiles = x.reshape(*pre, n // size, size, *post)
    sb = signs.reshape((size,) + (1,) * len(post))
    return fwht_tiles(tiles * sb, len(pre) + 1, size).reshape(x.shape)


def fwht_tiles(v: jax.Array, axis: int, size: int) -> jax.Array:
    """``H_size @ v / sqrt(size)`` along ``axis`` (of length ``size``) by the fast
    Walsh-Hadamard butterfly, in float32: the rule for how fp4jax's RHT rounds.

    ``log2(size)`` stages; stage ``h = 1, 2, 4, ...`` replaces each pair ``(a, b) =
    (v[i], v[i + h])`` (``i mod 2h < h``) by ``(a + b, a - b)``, which yields the
    Sylvester-ordered ``H @ v``; the result is then multiplied by ``f32(1/sqrt(size))``
    (exact, 1/4, for the recipe's size 16). This fixes the order of every float32
    addition, so the XLA path and the Pallas kernels (``pallas_kernels/
    quantize/operand_sm90.py``, which runs the same stages on register arrays) give the
    same bits; a matrix product would leave the summation order to the backend.
    Transformer Engine applies the same matrix with a tensor-core MMA
    (``hadamard_transform_cast_fusion.cu``), whose rounding is unspecified.
    """
    shape = v.shape
    pre, post = shape[:axis], shape[axis + 1:]
    h = 1
    while h < size:
        # one elementwise stage (reverse + select fuse into a single XLA loop; slicing
        # and stacking the halves made XLA emit a slice and a concatenate kernel per
        # stage): the partner of i is i ^ h; the first of a pair gets a + b, the second
        # partner - self = a - b (float addition is commutative, so the same bits)
        t = v.reshape(*pre, size // (2 * h), 2, h, *post)
        partner = jax.lax.rev(t, (len(pre) + 1,))  # jnp.flip without its jit wrapper
        first = jax.lax.broadcasted_iota(jnp.int32, t.shape, len(pre) + 1) == 0
        v = numerics.where(first, t + partner, partner - t).reshape(shape)
        h *= 2
    return v * jnp.float32(1.0 / np.sqrt(size))
