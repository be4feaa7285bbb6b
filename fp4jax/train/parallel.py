"""The harness's device mesh and how the train step is partitioned over it.

One place says where every array lives:

* the mesh: ``(data, fsdp)`` devices, axes ``("data", "fsdp")`` (``make_mesh``);
* the batch: its rows split over both axes, data-major (``BATCH``);
* the state (parameters, optimizer state): each array split over ``fsdp`` along one
  dimension (``fsdp_spec``: the largest dimension divisible by the axis size), else
  replicated (``state_specs``): ZeRO-3-style sharded storage;
* the loss and gradients: computed in ``jax.shard_map`` (``sharded_value_and_grad``), each
  device on its rows of the batch inside ``fp4jax.sharding.data_parallel`` (so every
  quantized tensor's amax and stochastic-rounding bits are the whole batch's, and the
  Pallas kernels run), the sharded parameters all-gathered over ``fsdp`` first, the
  gradients averaged (gathered parameters: reduce-scattered back to their shards by the
  all-gather's transpose); the optimizer update then runs on the sharded arrays under
  ``jit``.

With one device nothing here is used: the step is the plain single-device program.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fp4jax.sharding

AXES = ("data", "fsdp")
BATCH = P(AXES)
"""The batch's rows over both mesh axes (data-major, as ``fp4jax.sharding`` counts them)."""


def make_mesh(n: int = 0, fsdp: int = 1) -> Mesh:
    """The ``(n / fsdp, fsdp)`` mesh, axes ``AXES``, over the first ``n`` devices (0: all).

    With several processes (``jax.distributed``) the mesh spans every process's devices
    (``jax.devices()``, process-major as JAX orders them, so process 0 holds the first rows
    of every batch), and ``n`` must be 0 or their total: a device left out would leave its
    process without work in the step."""
    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    n_proc = jax.process_count()
    if n_proc > 1 and n not in (0, len(devs)):
        raise ValueError(f"--devices {n}: a run of {n_proc} processes uses all their "
                         f"{len(devs)} devices: pass --devices 0 (or {len(devs)})")
    n = n or len(devs)
    if not 1 <= n <= len(devs):
        raise ValueError(f"--devices {n}: only {len(devs)} devices ({devs[0].platform})")
    if fsdp < 1 or n % fsdp:
        raise ValueError(f"--fsdp {fsdp} must divide the number of devices ({n}); e.g. "
                         f"--fsdp {n} (all devices hold a shard of the state) or 1 (replicated)")
    return Mesh(np.array(devs[:n]).reshape(n // fsdp, fsdp), AXES)


def fsdp_spec(shape: tuple[int, ...], n: int) -> P:
    """Where an array of ``shape`` lives on an ``fsdp`` axis of size ``n``: split along its
    largest dimension that ``n`` divides (the first of equal ones), else (or ``n == 1``)
    replicated, ``P()``."""
    dims = [d for d, s in enumerate(shape) if n > 1 and s >= n and s % n == 0]
    if not dims:
        return P()
    d = max(dims, key=lambda d: (shape[d], -d))
    return P(*([None] * d + ["fsdp"]))


def state_specs(state: Any, mesh: Mesh) -> Any:
    """``fsdp_spec`` of every leaf of ``state`` (arrays or ``ShapeDtypeStruct``s)."""
    n = mesh.shape["fsdp"]
    return jax.tree.map(lambda x: fsdp_spec(tuple(x.shape), n), state)


def shardings(specs: Any, mesh: Mesh) -> Any:
    """``NamedSharding``s of a tree of ``PartitionSpec``s."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda s: isinstance(s, P))


def _gather(x: jax.Array, spec: P) -> jax.Array:
    if "fsdp" not in tuple(spec):
        return x
    return jax.lax.all_gather(x, "fsdp", axis=tuple(spec).index("fsdp"), tiled=True)


def sharded_value_and_grad(loss: Callable[..., jax.Array], param_specs: Any, mesh: Mesh
                           ) -> Callable[..., tuple[jax.Array, Any]]:
    """``f(params, batch, *args) -> (loss, grads)`` of ``loss(params, batch, *args)`` (a
    scalar mean over the batch rows) on ``mesh``: ``params`` laid out by ``param_specs``
    (``state_specs``), ``batch`` by ``BATCH``, ``args`` replicated; the loss and the
    gradients (laid out as ``params``) are those of the whole batch: the mean of the
    devices' losses and gradients."""
    n_fsdp = mesh.shape["fsdp"]

    def f(params, batch, *args):
        treedef = jax.tree.structure(params)
        specs = (treedef.unflatten([param_specs] * treedef.num_leaves)
                 if isinstance(param_specs, P) else param_specs)  # a prefix: every leaf
        flat_specs = treedef.flatten_up_to(specs)

        def local(params, batch, *args):
            def full_loss(shards):
                full = [_gather(x, s) for x, s in zip(treedef.flatten_up_to(shards),
                                                      flat_specs, strict=True)]
                return loss(treedef.unflatten(full), batch, *args)

            with fp4jax.sharding.data_parallel(AXES):
                value, grads = jax.value_and_grad(full_loss)(params)
            # a gathered parameter's gradient arrives summed over fsdp (the gather's
            # transpose, a reduce-scatter): divide, then average over data
            g = [jax.lax.pmean(x / n_fsdp, "data") if "fsdp" in tuple(s)
                 else jax.lax.pmean(x, AXES)
                 for x, s in zip(treedef.flatten_up_to(grads), flat_specs, strict=True)]
            return jax.lax.pmean(value, AXES), treedef.unflatten(g)

        sm = jax.shard_map(local, mesh=mesh, in_specs=(specs, BATCH, *([P()] * len(args))),
                           out_specs=(P(), specs), check_vma=False)
        return sm(params, batch, *args)

    return f


def sharded_value(loss: Callable[..., jax.Array], param_specs: Any, mesh: Mesh
                  ) -> Callable[..., jax.Array]:
    """``f(params, batch, *args) -> loss`` of ``loss(params, batch, *args)`` (a scalar mean
    over the batch rows) on ``mesh``, laid out as for ``sharded_value_and_grad``: each device
    its rows of the batch inside ``fp4jax.sharding.data_parallel`` (the whole batch's amaxes
    and random bits, the kernels on), the parameters gathered over ``fsdp``, the devices'
    losses averaged. Every op runs on per-device arrays: cuDNN's fused attention (whose
    partitioner needs q, k and v sharded alike, which a plain ``jit`` over ``fsdp``-sharded
    weights does not give) included."""

    def f(params, batch, *args):
        treedef = jax.tree.structure(params)
        specs = (treedef.unflatten([param_specs] * treedef.num_leaves)
                 if isinstance(param_specs, P) else param_specs)
        flat_specs = treedef.flatten_up_to(specs)

        def local(params, batch, *args):
            full = [_gather(x, s) for x, s in zip(treedef.flatten_up_to(params), flat_specs,
                                                  strict=True)]
            with fp4jax.sharding.data_parallel(AXES):
                value = loss(treedef.unflatten(full), batch, *args)
            return jax.lax.pmean(value, AXES)

        sm = jax.shard_map(local, mesh=mesh, in_specs=(specs, BATCH, *([P()] * len(args))),
                           out_specs=P(), check_vma=False)
        return sm(params, batch, *args)

    return f
