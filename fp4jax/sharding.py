"""Data-parallel ``fp4jax.dot`` inside ``jax.shard_map``: the same bits as one device; and
the FSDP parameter all-gather in FP4 (``fp4_all_gather``, at the end of this module).

Under a plain ``jax.jit`` with sharded inputs, XLA partitions ``fp4jax.dot``'s XLA path
with its global meaning (tensor amaxes become all-reduces, random bits are drawn by
position), but it cannot partition the Pallas kernels, so multi-device runs used to keep
the XLA path. Inside ``jax.shard_map`` each device runs its own program on its own rows,
kernels included; what makes that program compute the single-device result is this
module's context::

    def local_grads(params, batch):              # batch: this device's rows
        with fp4jax.sharding.data_parallel("data"):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return jax.lax.pmean(loss, "data"), jax.lax.pmean(grads, "data")

    jax.shard_map(local_grads, mesh=mesh, in_specs=(P(), P("data")),
                  out_specs=(P(), P()), check_vma=False)

While it is active, every ``fp4jax.dot`` / ``dot_general`` call traced treats its
activation ``x`` and its output gradient ``dy`` as one shard of a tensor split along the
token rows over the mesh axes ``axis_name`` (weights replicated), and

* takes the tensor amax of every quantized ``x``/``dy`` operand as ``lax.pmax`` over the
  axes (the per-tensor scale is that of the whole tensor; on the kernel path one all-reduce
  per tensor for all its operands). A recipe with ``amax_scope="local"``
  (``Recipe.amax_scope``, Transformer Engine's data-parallel semantics) skips it: each
  device quantizes its rows with their own amax, no collective, other bits than one
  device's (what ``fp4jax.dot`` gives on those rows alone, for round-to-nearest operands);
* draws shard ``i``'s stochastic-rounding bits at its rows' positions in the whole tensor
  (``numerics.row_shard_draw_offset``; threefry keys);
* lets the kernel backends run (``xla_partitions`` is False: each device runs its own
  program on its rows).

So the forward output, the input gradient and every quantized operand are the
single-device bits; the weight gradient's contraction over tokens is split: each device
returns its rows' partial product in the weight's dtype, and the caller's ``pmean``/``psum``
adds them in float32 (the weight gradient agrees with one device up to that summation and
the partials' rounding, as XLA's own partitioning of the XLA path does).

Requirements (checked where they can be): unbatched ``dot_general`` calls; each device
holds a multiple of ``fp4jax.quantized_dot.token_row_multiple(recipe)`` token rows (16 for
``nvfp4()``, 32 for ``mxfp4()`` or a 32-point RHT: no block or RHT along the tokens may
straddle devices); outside ``shard_map`` over these axes a traced ``dot`` raises. Not
detectable, so up to the caller: the split is of ``x``'s leading rows, as ``shard_map``
with ``P(axis)`` on the batch dimension makes it (not under a ``jax.vmap`` over the split
examples, not a split of the sequence axis with several examples per device), and a
``jax.jit``-wrapped function that calls ``dot`` is traced anew inside the block (a trace
made outside it is reused by JAX and ignores the context).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from fp4jax import numerics
from fp4jax import quantization as qz
from fp4jax.formats import BlockFormat

AxisName = str | tuple[str, ...]

_AXIS: contextvars.ContextVar[AxisName | None] = contextvars.ContextVar(
    "fp4jax_data_axis", default=None)


@contextlib.contextmanager
def data_parallel(axis_name: AxisName) -> Iterator[None]:
    """Trace ``fp4jax.dot`` calls in this block as data-parallel shards over the mesh axis
    (or tuple of axes) ``axis_name`` of the enclosing ``jax.shard_map`` (module docstring).
    Nests; ``None`` turns it off inside."""
    if axis_name is not None and not (
            isinstance(axis_name, str) or (isinstance(axis_name, tuple) and axis_name
                                           and all(isinstance(a, str) for a in axis_name))):
        raise TypeError(f"axis_name must be a mesh axis name or a tuple of them, got "
                        f"{axis_name!r}")
    token = _AXIS.set(axis_name)
    try:
        yield
    finally:
        _AXIS.reset(token)


def data_axis() -> AxisName | None:
    """The mesh axis (or axes) of the active ``data_parallel`` block, or None."""
    return _AXIS.get()


_ONE_DEVICE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fp4jax_one_device", default=False)


@contextlib.contextmanager
def one_device(active: bool = True) -> Iterator[None]:
    """Trace ``fp4jax.dot`` calls in this block as parts of a program that runs on a single
    device although JAX sees several (a one-GPU run on a multi-GPU host: a ``jax.jit``
    whose inputs and outputs all live on one device).

    The automatic backend choice (``implementation=None``) keeps the XLA path whenever
    ``jax.device_count() > 1``, because XLA cannot partition a Pallas call of a program
    sharded over several devices, which leaves a one-GPU run on a multi-GPU host on the
    slower XLA path (measured in docs/performance.md). In this block the choice
    is that of a single-device host: the Hopper kernels for large GEMMs (same bits either
    way). Tracing a program that is partitioned over several devices in this block is the
    caller's error: XLA does not partition the kernels' calls.
    ``fp4jax-train`` and the harness's step builders enter it for a one-device mesh.
    Nests; ``one_device(False)`` turns it off inside."""
    if not isinstance(active, bool):
        raise TypeError(f"one_device: active must be a bool, got {active!r}")
    token = _ONE_DEVICE.set(active)
    try:
        yield
    finally:
        _ONE_DEVICE.reset(token)


def on_one_device() -> bool:
    """Whether a ``one_device`` block is active."""
    return _ONE_DEVICE.get()


def xla_partitions() -> bool:
    """Whether an ``fp4jax.dot`` traced now is part of a program XLA partitions over several
    devices itself: JAX sees more than one device and neither ``data_parallel`` (each device
    runs its own ``shard_map`` program on its rows) nor ``one_device`` is active. A Pallas
    call in such a program is not partitioned, so the automatic backend choice keeps the
    reference there (``fp4jax.backends.DotCall.partitioned``)."""
    return jax.device_count() > 1 and data_axis() is None and not on_one_device()


# ---------------------------------------------------------------------------
# FSDP parameter all-gather in FP4 (``fp4_all_gather``)
# ---------------------------------------------------------------------------


def param_gather_unsupported_reason(recipe: Any) -> str | None:
    """None when ``fp4_all_gather`` can stand in for the plain all-gather of a weight that
    ``fp4jax.dot`` multiplies under ``recipe`` (a ``fp4jax.Recipe`` or None), else why not.

    It can when the weight is quantized once, the same way for fprop and dgrad, by a rule
    that only reads the weight's values: ``fprop.rhs`` quantized with 4-bit E2M1 elements
    (NVFP4; an MX FP4 format too) in 2D tiles, round-to-nearest, the ``"max"`` block scale
    rule, one tensor scale (not row-scaled), ``dgrad.rhs`` the same spec, and no RHT on
    either GEMM (the rotation would mix the weight before it is quantized). That is the
    2D-scaled weight of ``recipes.nvfp4()`` (NVFP4 paper sec. 4.2: ``Q(W).T == Q(W.T)``, one
    quantized weight for both GEMMs)."""
    if recipe is None:
        return "the layer runs in high precision (no recipe): its weight is not quantized"
    name = getattr(recipe, "name", "?")
    fp, dg = recipe.fprop, recipe.dgrad
    q = fp.rhs
    if not q.quantized:
        return f"recipe {name!r} keeps the forward weight in high precision"
    if jnp.dtype(q.fmt.data_dtype) != jnp.dtype(jnp.float4_e2m1fn):
        return (f"recipe {name!r} quantizes weights to {q.fmt.name} elements, not 4-bit "
                "E2M1 (only E2M1 codes pack two a byte)")
    if not q.block_2d:
        return (f"recipe {name!r} quantizes weights in 1D blocks (fprop.rhs.block_2d=False): "
                "fprop and dgrad quantize them along different axes, so one gathered weight "
                "cannot serve both")
    if q.rounding != "nearest":
        return f"recipe {name!r} rounds weights with {q.rounding!r}, not round-to-nearest"
    if q.block_scale_rule != "max":
        return (f"recipe {name!r} chooses weight block scales by {q.block_scale_rule!r}, "
                "which reads every element's error, not only the block amax")
    if q.row_scaled:
        return f"recipe {name!r} row-scales weights"
    if dg.rhs != q:
        return (f"recipe {name!r} quantizes the dgrad weight ({dg.rhs}) unlike the fprop "
                f"weight ({q})")
    if fp.hadamard or dg.hadamard:
        return f"recipe {name!r} rotates the weight by an RHT in fprop or dgrad"
    return None


def fp4_gather_shard_reason(shape: tuple[int, ...], axis: int, n: int, block: int
                            ) -> str | None:
    """None when a weight of (global) ``shape`` split over ``n`` devices along ``axis`` can
    be gathered by ``fp4_all_gather`` with ``block x block`` tiles over its last two axes,
    else why not: it needs 2 or more dims, and along a tiled axis (one of the last two) a
    multiple of ``block`` rows or columns per device (no tile may straddle two devices).
    A split of a leading (stacked-layer) axis keeps every tile whole."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        return f"a weight of shape {shape} has no 2D tiles"
    axis = axis % len(shape)
    if shape[axis] % n:
        return f"axis {axis} of shape {shape} does not split evenly over {n} devices"
    if axis >= len(shape) - 2 and (shape[axis] // n) % block:
        what = "rows" if axis == len(shape) - 2 else "columns"
        return (f"its shards hold {shape[axis] // n} {what} of shape {shape} "
                f"(split over {n} devices along axis {axis}): not a "
                f"multiple of the {block}x{block} tiles, one would straddle two devices")
    return None


def _fp4_gather_parts(x: jax.Array, axis_name: AxisName, axis: int, fmt: BlockFormat,
                      dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Sender side of ``fp4_all_gather``: this shard's packed codes (uint8, two a byte along
    the last axis) and tile amaxes (``(..., ceil(rows/b), ceil(cols/b))`` in ``dtype``),
    quantized with the whole weight's tensor amax (``quantize``'s ``shard``: a ``pmax`` over
    ``axis_name`` when ``axis`` is a tiled axis; a split of a leading axis keeps every
    matrix whole on one device)."""
    b = fmt.block_size
    nd = x.ndim
    tiled = axis % nd >= nd - 2
    xf = numerics.exact_float32(x.astype(dtype))  # what the model's cast gives the dot
    lead = xf.shape[:-2]
    mat = xf.reshape((-1,) + xf.shape[-2:])

    def one(m):
        q = qz.quantize_unchecked(m, None, fmt, -1, True, "nearest", "max",
                                  axis_name if tiled else None)
        r, c = m.shape
        mp = jnp.pad(m, ((0, (-r) % b), (0, (-c) % b)))
        tiles = mp.reshape(mp.shape[0] // b, b, mp.shape[1] // b, b)
        return qz.pack_e2m1(q.data, axis=-1), qz.block_amax(tiles, axis=(-3, -1))

    codes, bamax = jax.vmap(one)(mat)
    return (codes.reshape(lead + codes.shape[1:]),
            bamax.astype(dtype).reshape(lead + bamax.shape[1:]))


def _gather_bytes(parts: list[jax.Array], axis_name: AxisName, axis: int) -> list[jax.Array]:
    """``all_gather(p, axis_name, axis=axis, tiled=True)`` of each array of ``parts`` (any
    dtypes) as one all-gather of their bytes (one collective a weight)."""
    flat = [jax.lax.bitcast_convert_type(p, jnp.uint8).reshape(-1) if p.dtype.itemsize > 1
            else p.reshape(-1) for p in parts]
    sizes = [f.shape[0] for f in flat]
    buf = jax.lax.all_gather(jnp.concatenate(flat), axis_name, axis=0, tiled=False)
    out, start = [], 0
    for p, n in zip(parts, sizes, strict=True):
        raw = buf[:, start:start + n]
        start += n
        if p.dtype.itemsize > 1:
            v = jax.lax.bitcast_convert_type(raw.reshape(raw.shape[0], *p.shape,
                                                         p.dtype.itemsize), p.dtype)
        else:
            v = jax.lax.bitcast_convert_type(raw.reshape(raw.shape[0], *p.shape), p.dtype)
        out.append(jnp.concatenate(list(v), axis=axis))  # the devices' shards in order
    return out


def _fp4_rebuild(codes: jax.Array, bamax: jax.Array, cols: int, fmt: BlockFormat,
                 dtype: Any) -> jax.Array:
    """Receiver side of ``fp4_all_gather``: the representative weight (``fp4_all_gather``'s
    docstring) from the whole tensor's codes and tile amaxes; its tensor amax is the
    largest finite tile amax (the sender's ``pmax``, for finite weights)."""
    b = fmt.block_size
    lead = codes.shape[:-2]
    codes = codes.reshape((-1,) + codes.shape[-2:])
    bam = bamax.reshape((-1,) + bamax.shape[-2:]).astype(jnp.float32)

    def one(c, bm):
        a = qz.finite_amax(bm)
        data = qz.unpack_e2m1(c, cols, axis=-1)
        enc = qz.global_encode_scale(a, fmt)
        dec = numerics.reciprocal_rn(enc)
        s = qz.block_decode_scale(bm, enc, fmt)
        v = qz.dequantize(qz.QuantizedArray(data, s.astype(fmt.scale_dtype), dec, fmt, None,
                                            True), jnp.float32)
        r = data.shape[0]
        mag = jnp.abs(data.astype(jnp.float32))
        magp = jnp.pad(mag, ((0, (-r) % b), (0, (-cols) % b)))
        qmax = magp.reshape(magp.shape[0] // b, b, magp.shape[1] // b, b).max(axis=(1, 3))
        full = lambda t: jnp.repeat(jnp.repeat(t, b, 0), b, 1)[:r, :cols]  # noqa: E731
        top = mag == full(qmax)
        neg = jnp.signbit(data.astype(jnp.float32))
        bm_el = full(bm)
        return jnp.where(top, jnp.where(neg, -bm_el, bm_el), v)

    out = jax.vmap(one)(codes, bam)
    return out.astype(dtype).reshape(lead + out.shape[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def fp4_all_gather(x: jax.Array, axis_name: AxisName, axis: int, fmt: BlockFormat,
                   dtype: Any) -> jax.Array:
    """``jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)`` of an FSDP-sharded weight
    that ``fp4jax.dot`` quantizes (``param_gather_unsupported_reason``), moving its packed
    FP4 codes instead of its values: inside ``jax.shard_map`` over ``axis_name``.

    Args:
      x: this device's shard of a weight ``(..., R, C)`` in any float dtype (float32
        master weights): its last two axes are the matrix the dot's 2D tiles cover, leading
        axes stack layers (a scanned model's kernels); the whole weight is the shards
        concatenated along ``axis`` in device order (``P(..., axis_name, ...)``).
      axis_name: the mesh axis (or axes) the weight is split over.
      axis: the split axis of ``x``; along one of the last two, each shard holds a
        multiple of ``fmt.block_size`` rows/columns (``fp4_gather_shard_reason``).
      fmt: the weight's format in the recipe (``fprop.rhs.fmt``: E2M1 elements, 2D tiles,
        round-to-nearest, ``"max"`` block scale rule).
      dtype: the dtype the model casts the weight to before ``fp4jax.dot`` (its compute
        dtype, e.g. bfloat16).

    Returns:
      the whole weight's shape in ``x.dtype``: a representative ``W'`` of the gathered
      weight ``W`` whose quantization is ``W``'s, bit for bit: ``Q(W'.astype(dtype)) ==
      Q(W.astype(dtype))`` (codes, block scales, tensor scale), ``Q`` the recipe's weight
      quantization, so every GEMM that quantizes it multiplies exactly the dequantized
      ``Q(W)`` of the plain gather. Its values are not ``W``'s: use it only where the dot
      quantizes it (fprop and dgrad of a recipe for which
      ``param_gather_unsupported_reason`` is None).

    How (the idea of Megatron-LM's ``--fp4-param-gather``, which gathers FSDP/ZeRO weights
    as NVFP4 with their scales; here the numerics are fp4jax's own): each device quantizes
    its shard of ``W.astype(dtype)`` with the whole tensor's amax (one ``pmax`` of a scalar
    per weight; ``quantize``'s ``shard``), 2D tiles never straddling devices, so its codes
    are those of quantizing ``W``; it sends the codes packed two a byte
    (``fp4jax.pack_e2m1``) and each tile's amax in ``dtype`` (one value per ``b x b`` tile:
    1/16 bit an element for NVFP4's 16x16 tiles in bfloat16), both as the bytes of one
    all-gather; each device rebuilds ``W'``:
    every element the dequantized value of its code (``dequantize`` with the block scales
    recomputed from the tile amaxes by ``block_decode_scale``, rounded to ``dtype``) except
    the elements of each tile whose code has the tile's largest magnitude, which become
    the tile amax with their code's sign. Then ``W'`` has the same tensor amax (the largest
    tile amax) and tile amaxes as ``W``, hence the same tensor and block scales, and each
    element rounds to its own code again (a dequantized value is within ``dtype``'s
    rounding of its code times the decode scales; the tile amax rounded to the tile's
    largest code in ``W``). Bytes moved per element: 4 bits of code plus 16 / 256 bits of
    tile amax, against 16 for a bfloat16 gather and 32 for float32 master weights.
    Not covered: tensors whose amax is below ~1e-35 (subnormal float32 decode scales; the
    dequantized values may flush to zero) and weights holding NaN/Inf.

    The gradient is the plain gather's: ``psum_scatter`` of the cotangent over
    ``axis_name`` along ``axis`` (the straight-through estimator of the dot's quantization
    already gives the whole weight's gradient).
    """
    return _fp4_all_gather_fwd(x, axis_name, axis, fmt, dtype)[0]


def _fp4_all_gather_fwd(x, axis_name, axis, fmt, dtype):
    nd = x.ndim
    if nd < 2 or not -nd <= axis < nd:
        raise ValueError(f"fp4_all_gather: x must have 2 or more dims and axis must be one of "
                         f"them, got shape {x.shape} and axis={axis}")
    axis = axis % nd
    if axis >= nd - 2 and x.shape[axis] % fmt.block_size:
        raise ValueError(
            f"fp4_all_gather: each shard holds {x.shape[axis]} of axis {axis} (shape "
            f"{x.shape}), not a multiple of {fmt.name}'s {fmt.block_size}x{fmt.block_size} "
            "tiles: a tile would straddle two devices; use the plain all-gather "
            "(fp4_gather_shard_reason says which weights can)")
    codes, bamax = _fp4_gather_parts(x, axis_name, axis, fmt, dtype)
    with jax.named_scope("fp4_param_gather"):
        # codes and tile amaxes in one all-gather of bytes (an integer gather, which no
        # backend widens: XLA:CPU gathers bfloat16 as float32)
        codes, bamax = _gather_bytes([codes, bamax], axis_name, axis)
    cols = x.shape[-1] * (jax.lax.axis_size(axis_name) if axis == nd - 1 else 1)
    w = _fp4_rebuild(codes, bamax, cols, fmt, dtype).astype(x.dtype)
    return w, None


def _fp4_all_gather_bwd(axis_name, axis, fmt, dtype, res, g):
    del fmt, dtype, res
    return (jax.lax.psum_scatter(g, axis_name, scatter_dimension=axis % g.ndim, tiled=True),)


fp4_all_gather.defvjp(_fp4_all_gather_fwd, _fp4_all_gather_bwd)
