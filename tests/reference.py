"""Independent NumPy reference of the block-scaled FP4 formulas (no fp4jax code used).

Written from the spec, not from the implementation: grids are *enumerated* from
their bit codes and rounding picks the nearest enumerated value (ties to the even
code), where fp4jax uses exponent arithmetic. The scale arithmetic that
Transformer Engine performs in float32 is done with ``np.float32`` scalars in
the same order (``core_nvfp4.cuh``); rounding decisions are made in float64.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max


def grid_values(exp_bits: int, man_bits: int, nan_code: bool, ieee: bool = False) -> np.ndarray:
    """All finite non-negative values of unsigned ExMy, indexed by code (float64).

    ``nan_code``: the all-ones code is NaN (``e4m3fn``); ``ieee``: every code whose exponent
    field is all ones is Inf/NaN (IEEE 754; ``float8_e5m2``); neither: all codes finite."""
    bias = 2 ** (exp_bits - 1) - 1
    vals = []
    for code in range(2 ** (exp_bits + man_bits)):
        e, m = code >> man_bits, code & (2**man_bits - 1)
        if ieee and e == 2**exp_bits - 1:
            continue  # Inf / NaN
        if man_bits == 0:
            v = 2.0 ** (e - bias)
        elif e == 0:
            v = 2.0 ** (1 - bias) * (m / 2**man_bits)
        else:
            v = 2.0 ** (e - bias) * (1 + m / 2**man_bits)
        vals.append(v)
    if nan_code and not ieee:
        vals = vals[:-1]
    vals = np.array(vals, np.float64)
    if man_bits == 0:  # fp4jax uses float32-normal power-of-two scales only (>= 2**-126)
        vals = vals[vals >= 2.0**-126]
    return vals


E2M1 = grid_values(2, 1, nan_code=False)
assert list(E2M1) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
E4M3 = grid_values(4, 3, nan_code=True)
# cross-check the enumeration with ml_dtypes' own float8_e4m3fn
_all = np.arange(128, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
assert np.array_equal(E4M3, _all[np.isfinite(_all)])

# The OCP MX element types (OCP MX v1.0 sec. 5.3), by (exp_bits, man_bits): enumerated from
# their bit codes, each cross-checked with the ml_dtypes dtype of the same name (all of its
# non-negative finite codes).
ELEMENTS = {
    (2, 1): (E2M1, ml_dtypes.float4_e2m1fn, 8),
    (2, 3): (grid_values(2, 3, nan_code=False), ml_dtypes.float6_e2m3fn, 32),
    (3, 2): (grid_values(3, 2, nan_code=False), ml_dtypes.float6_e3m2fn, 32),
    (4, 3): (E4M3, ml_dtypes.float8_e4m3fn, 128),
    (5, 2): (grid_values(5, 2, nan_code=True, ieee=True), ml_dtypes.float8_e5m2, 128),
}
for _g, _dt, _n in ELEMENTS.values():
    _v = np.arange(_n, dtype=np.uint8).view(_dt).astype(np.float64)
    assert np.array_equal(_g, _v[np.isfinite(_v)]), _dt
ELEM_GRIDS = {k: v[0] for k, v in ELEMENTS.items()}
assert [g[-1] for g in ELEM_GRIDS.values()] == [6, 7.5, 28, 448, 57344]
# E1M2, the uniform 4-bit grid (UFP4, arXiv 2606.20381; no ml_dtypes type): enumerated from
# its bit codes (bias 0) and checked against the uniform list it must be
ELEM_GRIDS[(1, 2)] = grid_values(1, 2, nan_code=False)
assert np.array_equal(ELEM_GRIDS[(1, 2)], np.arange(8) / 2)


def round_elem_saturating_ml_dtypes(v: np.ndarray, elem: tuple[int, int]) -> np.ndarray:
    """An independent element RNE: clamp ``|v|`` to the element max, then ml_dtypes' own
    round-to-nearest-even cast (its float8 casts overflow to NaN/Inf rather than saturate,
    hence the clamp)."""
    g, dt, _ = ELEMENTS[elem]
    return np.minimum(np.abs(np.asarray(v, np.float32)), np.float32(g[-1])).astype(dt).astype(
        np.float64)


def round_nearest(v: np.ndarray, grid: np.ndarray, ties_up: bool = False) -> np.ndarray:
    """Nearest grid value to ``v >= 0`` (float64), ties to the even code, saturating."""
    v = np.ascontiguousarray(v, np.float64)
    out = np.empty(v.shape, np.float64)
    flat, res = v.reshape(-1), out.reshape(-1)
    for i, a in enumerate(flat):
        if np.isnan(a):
            res[i] = np.nan
            continue
        if a >= grid[-1]:
            res[i] = grid[-1]
            continue
        hi = int(np.searchsorted(grid, a, side="left"))
        if grid[hi] == a:
            res[i] = a
            continue
        lo = hi - 1
        if lo < 0:  # below the smallest value of a grid without zero
            res[i] = grid[0]
            continue
        dl, dh = a - grid[lo], grid[hi] - a
        if dl < dh:
            res[i] = grid[lo]
        elif dh < dl:
            res[i] = grid[hi]
        else:
            res[i] = grid[hi] if ties_up else (grid[lo] if lo % 2 == 0 else grid[hi])
    return out


def round_up(v: np.ndarray, grid: np.ndarray) -> np.ndarray:
    v = np.asarray(v, np.float64)
    idx = np.searchsorted(grid, v, side="left")
    return np.where(np.isnan(v), np.nan, grid[np.minimum(idx, len(grid) - 1)])


def ref_global_encode(amax: float, scale_max: float, tensor_scale: bool,
                      elem_max: float = 6.0) -> np.float32:
    if not tensor_scale:
        return F32(1.0)
    amax = F32(amax)
    if amax == 0:
        return F32(1.0)
    with np.errstate(divide="ignore", over="ignore"):
        enc = F32(F32(scale_max * elem_max) / amax)
    enc = min(enc, FLT_MAX)  # TE: fminf(., FLT_MAX); the decode scale may be subnormal
    return F32(1.0) if enc == 0 else F32(enc)


def ref_quantize(x, exp_bits=4, man_bits=3, block=16, tensor_scale=True, rule="nearest",
                 axis=-1, block_2d=False, sr_key_words=None, elem=(2, 1), scale_ieee=False):
    """Returns (data float64 with signed zeros, scale float64 per block, dec float32).

    ``elem``: the element type's (exp_bits, man_bits) (``ELEM_GRIDS``); the block amax maps
    to its max ``M`` (``rule`` ``"nearest"``/``"up"``: ``amax_b * f32(enc * f32(1/M))`` onto
    the scale grid; ``"ocp"``: ``2**(floor(log2(amax_b * enc)) - floor(log2 M))``; ``"oas"``
    (E2M1): the smallest power of two ``2**k`` with ``amax_b * enc < 7 * 2**k``), a
    tensor scale maps the tensor amax to ``min(scale_max, 2**17) * M``, and elements round
    to nearest even (or stochastically) onto the element grid, saturating to ``M``.
    ``scale_ieee``: the scale grid reserves its whole top exponent (IEEE).
    ``sr_key_words=(k1, k2)``: stochastic rounding of the elements with the uniforms of
    ``ref_sr_uniform`` over the padded array in its stored order (moved along with the
    data to the blocked-axis-last view)."""
    x = np.asarray(x, np.float32)
    sgrid = grid_values(exp_bits, man_bits, nan_code=True, ieee=scale_ieee)
    egrid = ELEM_GRIDS[tuple(elem)]
    a = np.abs(x)
    fin = np.isfinite(a)
    amax = a[fin].max() if fin.any() else F32(0)
    enc = ref_global_encode(amax, min(sgrid[-1], 2.0**17), tensor_scale, egrid[-1])
    dec = F32(F32(1.0) / enc)

    if block_2d:
        xm = x
        R, C = x.shape[-2:]
        pr, pc = (-R) % block, (-C) % block
        xp = np.pad(xm, [(0, 0)] * (x.ndim - 2) + [(0, pr), (0, pc)])
        t = xp.reshape(*xp.shape[:-2], xp.shape[-2] // block, block, xp.shape[-1] // block, block)
        amax_b = np.abs(t).max(axis=(-3, -1))
        s = _block_scale(amax_b, enc, sgrid, rule, man_bits, egrid)
        e = _elem_scale(s, dec)
        y = (t.astype(F32) * e[..., :, None, :, None].astype(F32)).astype(F32)
        u = None if sr_key_words is None else ref_sr_uniform(*sr_key_words, xp.shape)
        q = _round_elem(y, egrid, None if u is None else u.reshape(t.shape))
        return q.reshape(xp.shape)[..., :R, :C], s, dec

    axis = axis % x.ndim
    xm = np.moveaxis(x, axis, -1)
    n = xm.shape[-1]
    xp = np.pad(xm, [(0, 0)] * (x.ndim - 1) + [(0, (-n) % block)])
    blocks = xp.reshape(*xp.shape[:-1], -1, block)
    amax_b = np.abs(blocks).max(axis=-1)
    s = _block_scale(amax_b, enc, sgrid, rule, man_bits, egrid)
    e = _elem_scale(s, dec)
    y = (blocks.astype(F32) * e[..., None].astype(F32)).astype(F32)
    u = None
    if sr_key_words is not None:
        padded = list(x.shape)
        padded[axis] = xp.shape[-1]
        u = np.moveaxis(ref_sr_uniform(*sr_key_words, padded), axis, -1)
    q = _round_elem(y, egrid, None if u is None else u.reshape(blocks.shape))
    q = q.reshape(xp.shape)[..., :n]
    return np.moveaxis(q, -1, axis), np.moveaxis(s, -1, axis), dec


def _block_scale(amax_b, enc, sgrid, rule, man_bits, egrid=E2M1):
    amax_b = amax_b.astype(F32)
    emax = np.floor(np.log2(egrid[-1]))  # the element's largest exponent (OCP MX "emax")
    with np.errstate(over="ignore", invalid="ignore"):
        if rule == "oas":  # the smallest power of two 2**k with w < 7 * 2**k (float64)
            w = (amax_b * enc).astype(F32).astype(np.float64)
            with np.errstate(divide="ignore"):
                k = np.floor(np.log2(np.where(w > 0, w, 1.0) / 7.0)) + 1
            k = np.where(w >= 7.0 * np.exp2(k), k + 1, k)  # fix up log2's rounding
            k = np.where(w < 7.0 * np.exp2(k - 1), k - 1, k)
            k = np.where(w > 0, k, -np.inf)
            lo, hi = np.log2(sgrid[0]), np.log2(sgrid[-1])
            s = 2.0 ** np.clip(k, lo, hi)
        elif rule == "ocp":
            w = (amax_b * enc).astype(F32)
            with np.errstate(divide="ignore"):
                ex = np.floor(np.log2(w.astype(np.float64))) - emax
            lo, hi = np.log2(sgrid[0]), np.log2(sgrid[-1])
            s = 2.0 ** np.clip(ex, lo, hi)
        else:
            v = (amax_b * F32(enc * F32(1.0 / egrid[-1]))).astype(F32)
            if rule == "nearest":
                s = round_nearest(v.astype(np.float64), sgrid, ties_up=(man_bits == 0))
            else:
                s = round_up(v.astype(np.float64), sgrid)
    return np.where(np.isfinite(amax_b), s, np.nan)


def _elem_scale(s, dec):
    """``min(1 / f32(s * dec), FLT_MAX)`` in IEEE float32 (NumPy keeps subnormals): FLT_MAX
    where ``s == 0`` (TE's ``fminf(1.0f / (S_dec_block * S_dec), FLT_MAX)``)."""
    s32 = s.astype(F32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        e = (F32(1.0) / (s32 * dec).astype(F32)).astype(F32)
    return np.minimum(e, FLT_MAX).astype(F32)


def _round_elem(y, grid=E2M1, u=None):
    """Elements onto ``grid`` (sign kept; non-finite -> 0): nearest (ties to the even code,
    saturating) or, with uniforms ``u``, stochastic."""
    a = np.abs(y).astype(np.float64)
    if u is None:
        mag = round_nearest(a, grid)
    else:  # stochastic: the upper neighbour with probability P(u < (a - lo) / (hi - lo))
        idx = np.clip(np.searchsorted(grid, a, side="right") - 1, 0, len(grid) - 1)
        lo = grid[idx]
        hi = grid[np.minimum(idx + 1, len(grid) - 1)]
        with np.errstate(invalid="ignore", divide="ignore"):
            frac = np.where(hi > lo, (a - lo) / (hi - lo), 0.0)
        mag = np.where(u.astype(np.float64) < frac, hi, lo)
        mag = np.where(a >= grid[-1], grid[-1], mag)
    mag = np.where(np.isnan(y), 0.0, mag)  # +-Inf (x * FLT_MAX) saturates above
    return np.where(np.signbit(y), -mag, mag)


def ref_dequantize(q, s, dec, block=16, axis=-1, block_2d=False):
    q = np.asarray(q, np.float64)
    s = np.asarray(s, np.float64)
    if block_2d:
        R, C = q.shape[-2:]
        full = np.repeat(np.repeat(s, block, -2), block, -1)[..., :R, :C]
    else:
        axis = axis % q.ndim
        full = np.moveaxis(np.repeat(np.moveaxis(s, axis, -1), block, -1)
                           [..., : q.shape[axis]], -1, axis)
    return (q.astype(F32) * full.astype(F32)).astype(F32) * dec


def ref_hadamard(size: int) -> np.ndarray:
    """Sylvester Hadamard by the Walsh formula H[i, j] = (-1)^popcount(i & j), normalized."""
    i = np.arange(size)
    bits = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
    return ((-1.0) ** bits) / np.sqrt(size)


def ref_fwht_f32(v: np.ndarray, size: int) -> np.ndarray:
    """fp4jax's RHT rounding rule, independently: the in-place fast Walsh-Hadamard
    butterfly over the last axis (tiles of ``size``), one np.float32 add/sub at a time,
    then times f32(1/sqrt(size))."""
    v = np.array(v, dtype=F32).reshape(-1, size).copy()
    h = 1
    while h < size:
        for i in range(0, size, 2 * h):
            for j in range(i, i + h):
                a, b = v[:, j].copy(), v[:, j + h].copy()
                v[:, j], v[:, j + h] = a + b, a - b
        h *= 2
    return v * F32(1.0 / np.sqrt(size))


def ref_threefry_bits(k1: int, k2: int, n: int) -> np.ndarray:
    """``jax.random.bits(key, (n,), uint32)``: ``y0 ^ y1`` of ``ref_threefry_words``."""
    y0, y1 = ref_threefry_words(k1, k2, n)
    return y0 ^ y1


def ref_threefry_words(k1: int, k2: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``jax.random.bits(key, (n,), uint32)`` for a threefry key with words (k1, k2), from
    the Threefry-2x32 definition (Salmon et al. 2011, 20 rounds; Random123's key schedule
    and rotation constants) on the counters (0, i), i < n: the two output words (y0, y1),
    in NumPy uint32 arithmetic (JAX's partitionable layout; its 32-bit bits are y0 ^ y1)."""
    m = np.uint32(0xFFFFFFFF)
    rot = [(13, 15, 26, 6), (17, 29, 16, 24)]
    ks = [np.uint32(k1), np.uint32(k2), np.uint32(k1) ^ np.uint32(k2) ^ np.uint32(0x1BD11BDA)]
    x0 = np.zeros(n, np.uint32) + ks[0]
    x1 = np.arange(n, dtype=np.uint32) + ks[1]
    with np.errstate(over="ignore"):
        for i in range(5):
            for r in rot[i % 2]:
                x0 = (x0 + x1) & m
                x1 = ((x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r))) & m
                x1 = x0 ^ x1
            x0 = x0 + ks[(i + 1) % 3]
            x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def ref_sr_uniform(k1: int, k2: int, shape) -> np.ndarray:
    """The stochastic-rounding uniforms of ``fp4jax.numerics.uniform_from_key`` for a
    threefry key with words (k1, k2), written from its documented rule: view ``shape`` as
    (N, K) in stored order, K the last axis; element (n, k) takes byte ``2 (n % 2) + (k %
    2)`` of word ``n % 4 // 2`` (y0, y1) of the Threefry block on counter (0, ``(n // 4)
    ceil(K / 2) + k // 2``) and ``u = (byte + 1/2) / 256``. Loops over elements."""
    shape = tuple(shape)
    k = shape[-1]
    n = int(np.prod(shape[:-1]))
    kh = -(-k // 2)
    words = ref_threefry_words(k1, k2, -(-n // 4) * kh)
    u = np.empty((n, k), np.float32)
    for r in range(n):
        for c in range(k):
            word = int(words[(r % 4) // 2][(r // 4) * kh + c // 2])
            byte = (word >> (8 * (2 * (r % 2) + (c % 2)))) & 0xFF
            u[r, c] = (byte + 0.5) / 256.0
    return u.reshape(shape)


def ref_ms_eden(x, group: int, u_blocks) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """Quartet II's MS-EDEN (IST-DASLab/Quartet-II commit 8776a90b,
    ``src/models/quantization/schemes/quartet_2.py``, ``eden_1x16s_fp4_kernel``), written
    from its formulas with the order fp4jax documents (``fp4jax.quantization.ms_eden``): 1x16
    blocks along the last axis of ``x`` (zero-padded to a multiple of ``group``), one
    uniform per block in ``u_blocks`` (``x.shape[:-1] + (ceil(n/16),)``).

    In ``np.float32`` arithmetic, one rounding per operation: ``V = f32(6 / (17/16 *
    0.93))``, ``dec = (amax / f32(255.99)) / V`` (1 for an all-zero tensor, at least
    2**-126), ``s = e4m3_rne((amax_b / V) / dec)`` (1 where 0), elements ``q =
    e2m1_rne(x * f32(1 / (s * dec)))``, per group ``c = sum(y*y) / sum(y*q)`` summed
    pairwise (element i + element i + G/2, halving; non-finite y count as 0; ``c = 1`` when
    the denominator is 0), final scale ``s * c`` rounded onto the enumerated E4M3 grid up
    with probability ``(s*c - lo) / (hi - lo)`` (up iff ``u < that``, in float64, where it
    is exact), saturating at 448; NaN scales and +0 elements for blocks holding NaN/Inf.
    Returns (elements float64 with signed zeros, scales float64, dec float32)."""
    x = np.asarray(x, F32)
    a = np.abs(x)
    fin = np.isfinite(a)
    amax = F32(a[fin].max()) if fin.any() else F32(0)
    v = F32(6.0 / ((17 / 16) * 0.93))
    dec = F32(F32(amax / F32(255.99)) / v)
    dec = F32(1) if amax == 0 else max(dec, F32(2.0**-126))
    n = x.shape[-1]
    nb = -(-n // 16)
    xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (-n) % group)])
    blocks = xp.reshape(*xp.shape[:-1], -1, 16)
    u = np.pad(np.asarray(u_blocks, np.float64), [(0, 0)] * (x.ndim - 1)
               + [(0, blocks.shape[-2] - nb)])
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        amax_b = np.abs(blocks).max(axis=-1)
        finite = np.isfinite(amax_b)
        s = round_nearest(((amax_b.astype(F32) / v).astype(F32) / dec).astype(F32), E4M3)
        s = np.where(finite & (s == 0), 1.0, s)
        e = _elem_scale(s, dec)
        y = (blocks * e[..., None]).astype(F32)
        q = np.where(finite[..., None], _round_elem(y), 0.0)
        y0 = np.where(np.isfinite(y), y, F32(0)).astype(F32)
        yy = (y0 * y0).astype(F32).reshape(*y.shape[:-2], -1, group)
        yq = (y0 * q.astype(F32)).astype(F32).reshape(*y.shape[:-2], -1, group)
    while yy.shape[-1] > 1:
        h = yy.shape[-1] // 2
        yy = (yy[..., :h] + yy[..., h:]).astype(F32)
        yq = (yq[..., :h] + yq[..., h:]).astype(F32)
    num, den = yy[..., 0], yq[..., 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        c = np.where(den == 0, F32(1), (num / np.where(den == 0, F32(1), den)).astype(F32))
    c = np.repeat(c.astype(F32), group // 16, axis=-1)
    t = (s.astype(F32) * c).astype(F32).astype(np.float64)
    idx = np.clip(np.searchsorted(E4M3, t, side="right") - 1, 0, len(E4M3) - 1)
    lo, hi = E4M3[idx], E4M3[np.minimum(idx + 1, len(E4M3) - 1)]
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(hi > lo, (t - lo) / (hi - lo), 0.0)
    sf = np.where(u < frac, hi, lo)
    sf = np.where(t >= E4M3[-1], E4M3[-1], sf)
    sf = np.where(finite, sf, np.nan)
    q = q.reshape(xp.shape)[..., :n]
    return q, sf[..., :nb], dec

TINY = F32(2.0**-126)
FOUR_OVER_SIX_VARIANTS = {"4over6": ("mae", 256), "4over6-mse": ("mse", 256),
                          "4over6-448": ("mae", 448), "4over6-mse-448": ("mse", 448)}
"""4over6 rule name -> (error metric, the amax bound: 256 or 448 times 6)."""


# ---------------------------------------------------------------------------
# 4over6 (Transformer Engine's quantize_4over6_nvfp4.cuh).
# ---------------------------------------------------------------------------

def flush_subnormals(v: np.ndarray, ftz: bool) -> np.ndarray:
    """``v`` as float32 with subnormals flushed to signed zero when ``ftz`` (XLA:CPU's
    float32 arithmetic), else unchanged."""
    v = np.asarray(v, F32)
    return np.where(np.abs(v) < TINY, np.copysign(F32(0), v), v).astype(F32) if ftz else v


def e4m3_satfinite(v: np.ndarray) -> np.ndarray:
    """E4M3 round-to-nearest-even, satfinite (after TE's fminf(., 448)); NaN stays NaN."""
    return round_nearest(np.minimum(v, F32(448)), E4M3).astype(F32)


def ref_four_over_six(x: np.ndarray, rule: str, block_2d: bool = False, ftz: bool = False):
    """4over6 quantization of ``x`` with 1x16 blocks along the last axis (or 16x16 tiles
    over the last two axes), zero-padded. Returns (elements float64 with signed zeros,
    block scales float64 (NaN for non-finite blocks), dec float32, pick4 bool). ``ftz``: flush
    float32 subnormals after every operation as XLA:CPU does."""
    metric, bound = FOUR_OVER_SIX_VARIANTS[rule]
    x = flush_subnormals(np.asarray(x, F32), ftz)
    a = np.abs(x)
    amax = F32(a[np.isfinite(a)].max()) if np.isfinite(a).any() else F32(0)
    with np.errstate(divide="ignore", over="ignore"):  # TE core_nvfp4.cuh l. 81-95
        enc = F32(F32(bound * 6.0) / amax) if amax != 0 else F32(1)
    enc = min(enc, FLT_MAX)  # TE's fminf(., FLT_MAX)
    enc = F32(1) if enc == 0 else F32(enc)
    dec = F32(F32(1) / enc)

    if block_2d:
        r, c = x.shape[-2:]
        xp = np.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, -r % 16), (0, -c % 16)])
        t = xp.reshape(*xp.shape[:-2], xp.shape[-2] // 16, 16, xp.shape[-1] // 16, 16)
        blocks = np.moveaxis(t, -3, -2)  # (..., nr, nc, 16 rows, 16 cols)
    else:
        c = x.shape[-1]
        xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -c % 16)])
        blocks = xp.reshape(*xp.shape[:-1], xp.shape[-1] // 16, 1, 16)  # one row each
    finite = np.isfinite(blocks).all(axis=(-2, -1))
    with np.errstate(invalid="ignore"):
        amax_b = np.where(finite, np.abs(blocks).max(axis=(-2, -1)), np.nan).astype(F32)
    with np.errstate(invalid="ignore", over="ignore"):
        base = flush_subnormals(flush_subnormals(amax_b / F32(6), ftz) * enc, ftz)
        s4 = e4m3_satfinite(flush_subnormals(base * F32(1.5), ftz))
        s6 = e4m3_satfinite(base)

    def candidate(s):
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            # the element encode scale is exact even with a subnormal dec (no flush)
            e = np.minimum(F32(1) / (s * dec).astype(F32), FLT_MAX).astype(F32)
            y = flush_subnormals(blocks * e[..., None, None], ftz)
            mag = round_nearest(np.abs(y), E2M1)
            mag = np.where(np.isnan(y), 0.0, mag)  # Inf (x * FLT_MAX) saturated to 6
            q = np.where(np.signbit(y), -mag, mag).astype(F32)
            v = flush_subnormals(flush_subnormals(q * s[..., None, None], ftz) * amax, ftz)
            v = flush_subnormals(v / F32(6 * bound), ftz)
            d = flush_subnormals(v - blocks, ftz)
            t = np.abs(d) if metric == "mae" else flush_subnormals(d * d, ftz)
            row = t[..., 0]
            for i in range(1, 16):  # element order
                row = flush_subnormals(row + t[..., i], ftz)
        while row.shape[-1] > 1:  # 2D: the 16 row sums as TE's warp-shuffle tree
            h = row.shape[-1] // 2
            row = flush_subnormals(row[..., :h] + row[..., h:], ftz)
        return q, row[..., 0]

    q4, err4 = candidate(s4)
    q6, err6 = candidate(s6)
    pick4 = finite & (err4 < err6)
    s = np.where(pick4, s4, s6).astype(np.float64)
    q = np.where(pick4[..., None, None], q4, q6).astype(np.float64)
    if block_2d:
        q = np.moveaxis(q, -2, -3).reshape(xp.shape)[..., :r, :c]
    else:
        q = q.reshape(xp.shape)[..., :c]
    return q, s, dec, pick4


def np_rht_rows(a, size=16):
    """NumPy RHT of a 2-D array along axis 0 (zero-padded to a multiple of ``size``), with
    Transformer Engine's sign vector, by the float32 butterfly (``ref_fwht_f32``)."""
    import fp4jax

    a = np.pad(np.asarray(a, np.float32), ((0, (-a.shape[0]) % size), (0, 0)))
    signs = np.asarray(fp4jax.TE_SIGN_VECTOR, np.float32)
    t = np.moveaxis(a.reshape(-1, size, a.shape[1]), 1, -1) * signs
    return np.moveaxis(ref_fwht_f32(t.reshape(-1, size), size).reshape(t.shape), -1, 1
                       ).reshape(a.shape)


def np_fake_quant(a, axis, block_2d=False, sr=None, **fmt):
    """``ref_quantize`` then ``ref_dequantize`` of ``a`` (float64 result): NVFP4 by default,
    other formats by ``ref_quantize``'s keywords (``fmt``), SR with the key words ``sr``."""
    q, s, dec = ref_quantize(a, axis=axis, block_2d=block_2d, sr_key_words=sr, **fmt)
    return ref_dequantize(q, s, dec, block=fmt.get("block", 16), axis=axis,
                          block_2d=block_2d).astype(np.float64)
