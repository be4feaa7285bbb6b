"""Independent NumPy references for the Pallas kernels (NVFP4, 1x16 blocks).

These follow the numerics spec of fp4jax (Transformer Engine's NVFP4 formulas,
``transformer_engine/common/cast/nvfp4/core_nvfp4.cuh``), evaluated in float32:

* ``amax = max|x|`` over the tensor; ``enc = min(448*6/amax, FLT_MAX)`` (1 if amax == 0);
  ``dec = 1/enc``.
* block scale ``s = e4m3_rne_satfinite(amax_block * (enc * f32(1/6)))``.
* element scale ``e = min(1/(f32(s) * dec), FLT_MAX)`` (FLT_MAX if s == 0: nonzero
  elements of an underflowed block saturate to +-6, as TE's ``core_nvfp4.cuh``);
  ``q = e2m1_rne_satfinite(x * e)``; decode ``(q * s) * dec``.

They are deliberately written with ml_dtypes casts (not the kernels' integer tricks)
so that a test comparing the two can fail.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
TE_HADAMARD_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float32)


def global_scales(x: np.ndarray) -> tuple[np.float32, np.float32]:
    """(enc, dec) tensor scales of NVFP4."""
    a = np.abs(np.asarray(x, np.float32))
    a = a[np.isfinite(a)]
    amax = F32(a.max()) if a.size else F32(0)
    if amax == 0:
        return F32(1), F32(1)
    with np.errstate(over="ignore", divide="ignore"):
        enc = F32(F32(448.0 * 6.0) / amax)
    enc = F32(min(enc, FLT_MAX))
    return enc, F32(F32(1) / enc)


def e2m1_codes(v: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even, saturating E2M1 codes (s e1 e0 m) of float32 ``v``."""
    v = np.asarray(v, np.float32)
    q = v.astype(ml_dtypes.float4_e2m1fn)  # RNE, saturates to +-6
    return q.view(np.uint8) & 0xF


def _block_scales(amax: np.ndarray, enc, dec):
    """E4M3 block scales and element encode scales from block (or tile) amaxes, in
    Transformer Engine's float32 order (``core_nvfp4.cuh``): ``s = e4m3(min(amax *
    (enc/6), 448))`` (NaN for a NaN/Inf block), ``e = min(1 / (f32(s) * dec), FLT_MAX)``
    (FLT_MAX where ``s == 0``). Returns (s float8_e4m3fn, e float32)."""
    enc6 = F32(enc * F32(1.0 / 6.0))
    with np.errstate(invalid="ignore", over="ignore"):
        s_f = np.minimum(amax * enc6, F32(448.0))
    s_f = np.where(np.isfinite(amax), s_f, F32(np.nan))  # NaN/Inf block -> NaN scale
    s = s_f.astype(ml_dtypes.float8_e4m3fn)
    s32 = s.astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        e = np.minimum(F32(1) / (s32 * dec), FLT_MAX).astype(np.float32)
    return s, e


def quantize_nvfp4_1x16(x: np.ndarray, enc=None, dec=None):
    """Reference 1x16 NVFP4 quantization along the last axis (len % 16 == 0).

    Returns (codes uint8 (..., C), scale bits uint8 (..., C/16), dec float32).
    """
    x = np.asarray(x, np.float32)
    if enc is None:
        enc, dec = global_scales(x)
    enc, dec = F32(enc), F32(dec)
    c = x.shape[-1]
    assert c % 16 == 0
    xb = x.reshape(*x.shape[:-1], c // 16, 16)
    with np.errstate(invalid="ignore"):
        amax_b = np.max(np.abs(xb), axis=-1)
    s, e = _block_scales(amax_b, enc, dec)
    with np.errstate(invalid="ignore", over="ignore"):
        v = xb * e[..., None]
    codes = e2m1_codes(v).reshape(x.shape)
    return codes, s.view(np.uint8), dec


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """Two codes per byte along the last axis: element 2i low nibble, 2i+1 high nibble."""
    codes = np.asarray(codes, np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack_codes(packed: np.ndarray) -> np.ndarray:
    packed = np.asarray(packed, np.uint8)
    out = np.stack([packed & 0xF, packed >> 4], axis=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def decode_codes(codes: np.ndarray) -> np.ndarray:
    codes = np.asarray(codes, np.uint8)
    mag = E2M1_VALUES[codes & 7]
    return np.where(codes & 8, -mag, mag).astype(np.float32)


def dequantize_nvfp4(codes, scale_bits, dec, axis_block=16):
    """(q * s) * dec with s broadcast over blocks of 16 along the last axis."""
    q = decode_codes(codes)
    s = np.asarray(scale_bits, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = np.repeat(s, axis_block, axis=-1)
    return ((q * s) * F32(dec)).astype(np.float32)


def quantize_nvfp4_16x16(x: np.ndarray, enc=None, dec=None):
    """Reference 16x16 (2D) NVFP4 quantization of a 2-D ``x`` (R, C), R and C % 16 == 0.

    One E4M3 scale per 16x16 tile from the tile amax (NVFP4 paper sec. 4.2; the 2D rule
    of ``fp4jax.quantize(x, NVFP4, block_2d=True)``), then the 1x16 formulas above with
    the tile's scale. Returns (codes uint8 (R, C), scale bits uint8 (R/16, C/16), dec).
    """
    x = np.asarray(x, np.float32)
    if enc is None:
        enc, dec = global_scales(x)
    enc, dec = F32(enc), F32(dec)
    r, c = x.shape
    assert r % 16 == 0 and c % 16 == 0
    tiles = x.reshape(r // 16, 16, c // 16, 16)
    with np.errstate(invalid="ignore"):
        amax_t = np.max(np.abs(tiles), axis=(1, 3))  # (R/16, C/16)
    s, e = _block_scales(amax_t, enc, dec)
    with np.errstate(invalid="ignore", over="ignore"):
        v = tiles * e[:, None, :, None]
    codes = e2m1_codes(v).reshape(r, c)
    return codes, s.view(np.uint8), dec
