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
  ``jit``;
* with ``--fp4-param-gather`` (``fp4_gather_plan``), the weights that ``fp4jax.dot``
  quantizes as 2D NVFP4 are gathered as packed FP4 codes and tile amaxes
  (``fp4jax.sharding.fp4_all_gather``, ``FP4Gather``) instead of their float32 values, the
  same loss and gradients bit for bit.

With one device nothing here is used: the step is the plain single-device program.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
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
        hint = ("; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N (set before "
                "the process starts) gives N devices" if devs[0].platform == "cpu" else "")
        raise ValueError(f"--devices {n}: only {len(devs)} devices ({devs[0].platform})"
                         f"{hint}")
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


@dataclasses.dataclass(frozen=True)
class FP4Gather:
    """How one weight is gathered over ``fsdp`` in FP4 (``fp4jax.sharding.fp4_all_gather``).

    Attributes:
      fmt: the weight's format in its layer's recipe (``recipe.fprop.rhs.fmt``).
      dtype: the dtype name the model casts the weight to before ``fp4jax.dot``
        (``"bfloat16"``, ``"float32"``)."""

    fmt: Any
    dtype: str


def _gather(x: jax.Array, spec: P, fp4: FP4Gather | None = None) -> jax.Array:
    if "fsdp" not in tuple(spec):
        return x
    axis = tuple(spec).index("fsdp")
    if fp4 is not None:
        return fp4jax.sharding.fp4_all_gather(x, "fsdp", axis, fp4.fmt, jnp.dtype(fp4.dtype))
    return jax.lax.all_gather(x, "fsdp", axis=axis, tiled=True)


def _plan_leaves(treedef: Any, fp4: Any) -> list:
    """``fp4`` (a tree like the parameters of ``FP4Gather`` or None leaves, or None) as one
    entry per parameter leaf."""
    if fp4 is None:
        return [None] * treedef.num_leaves
    return treedef.flatten_up_to(fp4)


def fp4_gather_plan(params: Any, specs: Any, mesh: Mesh,
                    layers: Mapping[str, tuple[Any, tuple[int, ...], str | None]],
                    dtype: Any) -> tuple[Any, dict[str, str | None]]:
    """Which weights ``--fp4-param-gather`` gathers in FP4.

    Args:
      params: the parameter tree (arrays or ``ShapeDtypeStruct``s).
      specs: their ``PartitionSpec``s (``state_specs``; a ``P`` prefix allowed).
      mesh: the run's mesh (its ``fsdp`` axis size).
      layers: the model's linear layers by the path of their kernel (``"block_0/q/kernel"``,
        without ``"params"``): ``(recipe or None, the weight shape the product uses, why
        the kernel is not what the product quantizes or None)``. Parameters not listed
        (embeddings, norms) are not weights of an ``fp4jax.dot``: plain gather.
      dtype: the model's compute dtype (what its layers cast the kernels to).

    Returns:
      ``(plan, notes)``: ``plan`` a tree like ``params`` of ``FP4Gather`` (gathered in FP4)
      or None (the plain gather, or not split over ``fsdp``); ``notes`` ``{kernel path:
      None (FP4) or why it keeps the plain gather}`` for every listed kernel split over
      ``fsdp`` (``fp4jax.sharding.param_gather_unsupported_reason``,
      ``fp4jax.sharding.fp4_gather_shard_reason``, ``layers``' own reason).
    """
    n = mesh.shape["fsdp"]
    treedef = jax.tree.structure(params)
    if isinstance(specs, P):
        specs = treedef.unflatten([specs] * treedef.num_leaves)
    flat_specs = treedef.flatten_up_to(specs)
    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    notes: dict[str, str | None] = {}
    out = []
    for path, x, spec in zip(paths, jax.tree.leaves(params), flat_specs, strict=True):
        entry = layers.get(path)
        if entry is None or "fsdp" not in tuple(spec):
            out.append(None)
            continue
        recipe, weight, why = entry
        shape = tuple(x.shape)
        if why is None:
            why = fp4jax.sharding.param_gather_unsupported_reason(recipe)
        if why is None and (len(weight) != 2 or tuple(shape[-2:]) != tuple(weight)):
            why = (f"its product uses a weight of shape {tuple(weight)}, not the kernel's "
                   f"last two axes {shape[-2:]} (the 2D tiles would differ)")
        if why is None:
            why = fp4jax.sharding.fp4_gather_shard_reason(
                shape, tuple(spec).index("fsdp"), n, recipe.fprop.rhs.fmt.block_size)
        notes[path] = why
        out.append(None if why is not None else
                   FP4Gather(recipe.fprop.rhs.fmt, jnp.dtype(dtype).name))
    return treedef.unflatten(out), notes


def path_str(path: tuple) -> str:
    """A parameter's tree path as ``"block_0/q/kernel"`` (dict keys, no ``"params"``)."""
    keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    if keys[:1] == ["params"]:
        keys = keys[1:]
    return "/".join(keys)


def describe_plan(notes: Mapping[str, str | None]) -> str:
    """One line on ``fp4_gather_plan``'s notes: how many kernels gather in FP4, and each
    reason the others keep the plain gather (with the kernels it applies to)."""
    fp4 = [p for p, why in notes.items() if why is None]
    by_reason: dict[str, list[str]] = {}
    for p, why in notes.items():
        if why is not None:
            by_reason.setdefault(why, []).append(re.sub(r"/kernel$", "", p))
    text = f"FP4 parameter gather: {len(fp4)} of {len(notes)} sharded kernels"
    for why, ps in by_reason.items():
        text += f"; plain gather for {', '.join(ps)}: {why}"
    return text


def sharded_value_and_grad(loss: Callable[..., jax.Array], param_specs: Any, mesh: Mesh,
                           fp4: Any = None) -> Callable[..., tuple[jax.Array, Any]]:
    """``f(params, batch, *args) -> (loss, grads)`` of ``loss(params, batch, *args)`` (a
    scalar mean over the batch rows) on ``mesh``: ``params`` laid out by ``param_specs``
    (``state_specs``), ``batch`` by ``BATCH``, ``args`` replicated; the loss and the
    gradients (laid out as ``params``) are those of the whole batch: the mean of the
    devices' losses and gradients. ``fp4``: ``fp4_gather_plan``'s tree (None: every
    parameter gathered as it is stored)."""
    n_fsdp = mesh.shape["fsdp"]

    def f(params, batch, *args):
        treedef = jax.tree.structure(params)
        specs = (treedef.unflatten([param_specs] * treedef.num_leaves)
                 if isinstance(param_specs, P) else param_specs)  # a prefix: every leaf
        flat_specs = treedef.flatten_up_to(specs)
        plans = _plan_leaves(treedef, fp4)

        def local(params, batch, *args):
            def full_loss(shards):
                full = [_gather(x, s, g) for x, s, g in zip(treedef.flatten_up_to(shards),
                                                            flat_specs, plans, strict=True)]
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


def sharded_value(loss: Callable[..., jax.Array], param_specs: Any, mesh: Mesh,
                  fp4: Any = None) -> Callable[..., jax.Array]:
    """``f(params, batch, *args) -> loss`` of ``loss(params, batch, *args)`` (a scalar mean
    over the batch rows) on ``mesh``, laid out as for ``sharded_value_and_grad``: each device
    its rows of the batch inside ``fp4jax.sharding.data_parallel`` (the whole batch's amaxes
    and random bits, the kernels on), the parameters gathered over ``fsdp``, the devices'
    losses averaged. Every op runs on per-device arrays: cuDNN's fused attention (whose
    partitioner needs q, k and v sharded alike, which a plain ``jit`` over ``fsdp``-sharded
    weights does not give) included. ``fp4``: as ``sharded_value_and_grad``'s."""

    def f(params, batch, *args):
        treedef = jax.tree.structure(params)
        specs = (treedef.unflatten([param_specs] * treedef.num_leaves)
                 if isinstance(param_specs, P) else param_specs)
        flat_specs = treedef.flatten_up_to(specs)
        plans = _plan_leaves(treedef, fp4)

        def local(params, batch, *args):
            full = [_gather(x, s, g) for x, s, g in zip(treedef.flatten_up_to(params),
                                                        flat_specs, plans, strict=True)]
            with fp4jax.sharding.data_parallel(AXES):
                value = loss(treedef.unflatten(full), batch, *args)
            return jax.lax.pmean(value, AXES)

        sm = jax.shard_map(local, mesh=mesh, in_specs=(specs, BATCH, *([P()] * len(args))),
                           out_specs=P(), check_vma=False)
        return sm(params, batch, *args)

    return f
