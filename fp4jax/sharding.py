"""Data-parallel ``fp4jax.dot`` inside ``jax.shard_map``: the same bits as one device.

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
* lets the Pallas kernels run (``pallas_kernels.dispatch.kernel_mode``).

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
from collections.abc import Iterator

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
