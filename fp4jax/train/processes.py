"""Runs over several processes (``jax.distributed``): starting them, and the host side.

A multi-process run is the same program on every process (JAX's multi-controller model):
each process drives its own devices, and the mesh (``parallel.make_mesh``) spans the
devices of all of them. On top of that, this module keeps one rule: **process 0 owns the
run directory**. Only it reads and writes ``--out`` (checking and claiming it, the metrics
log, checkpoints, ``result.json``); what the others need from there (a restored state) is
broadcast to them, and an error raised there is raised on every process (``on_main``), so
no process waits forever on a collective the others never reach. The other processes need
the training data (each reads only its own rows of every batch) but no shared filesystem.

With one process every function here is the plain single-process operation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

T = TypeVar("T")

__all__ = ["initialize", "count", "index", "is_main", "on_main", "host_value",
           "global_array", "ProcessFailed"]

_MSG_BYTES = 4096
# exception types re-raised as themselves on the other processes (others: RuntimeError)
_KINDS: tuple[type[BaseException], ...] = (ValueError, OSError, RuntimeError)


class ProcessFailed(RuntimeError):
    """Raised on processes other than 0 when process 0 failed in a step they share."""


MAX_PROCESSES = 1 << 16  # --num-processes' bound (JAX takes it as a 32-bit integer)


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """``jax.distributed.initialize`` with a clear error, before any JAX computation.

    ``coordinator``: ``HOST:PORT`` of process 0's coordination service (``None``: from
    ``JAX_COORDINATOR_ADDRESS`` or the cluster, as JAX detects it: Slurm, Open MPI, ...);
    ``num_processes`` and ``process_id`` likewise (``None``: detected). On CPU devices the
    processes talk through gloo (JAX's CPU collectives), so a run on one machine with
    several processes works without GPUs (tests, rehearsals)."""
    if num_processes is not None and not 1 <= num_processes <= MAX_PROCESSES:
        raise ValueError(f"--num-processes must be in 1..{MAX_PROCESSES}, got {num_processes}")
    if process_id is not None and not 0 <= process_id < (num_processes or MAX_PROCESSES):
        raise ValueError(f"--process-id must be in 0..{(num_processes or MAX_PROCESSES) - 1}"
                         + (f" (--num-processes {num_processes})" if num_processes else "")
                         + f", got {process_id}")
    port = coordinator.rsplit(":", 1)[1] if coordinator and ":" in coordinator else ""
    if coordinator is not None and (not port.isascii() or not port.isdigit()
                                    or not 0 < int(port) < 65536):
        raise ValueError(f"--coordinator must be HOST:PORT (process 0's address and a free "
                         f"port, e.g. 10.0.0.1:1234), got {coordinator!r}")
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # not a config option in this JAX: its default then
        pass
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id)
    except Exception as e:
        raise ValueError(
            f"jax.distributed.initialize(coordinator={coordinator!r}, num_processes="
            f"{num_processes!r}, process_id={process_id!r}) failed: {e}. Give --coordinator "
            "HOST:PORT, --num-processes N and --process-id I on every process (the same "
            "coordinator and count everywhere; ids 0..N-1), or run under a cluster manager "
            "JAX detects (Slurm, Open MPI)") from e


def _distributed() -> bool:
    # without jax.distributed there is one process; asking JAX would start its backends
    # (a sweep's parent process must not take the GPUs its workers use)
    return jax.distributed.is_initialized()


def count() -> int:
    """The number of processes of the run."""
    return jax.process_count() if _distributed() else 1


def index() -> int:
    """This process's index (0: the one that owns the run directory)."""
    return jax.process_index() if _distributed() else 0


def is_main() -> bool:
    """Whether this process owns the run directory (process 0)."""
    return index() == 0


def _encode(e: BaseException | None) -> dict[str, np.ndarray]:
    kind = -1 if e is None else next((i for i, k in enumerate(_KINDS) if isinstance(e, k)),
                                     len(_KINDS))
    raw = b"" if e is None else f"{type(e).__name__}: {e}".encode()[:_MSG_BYTES]
    msg = np.zeros(_MSG_BYTES, np.uint8)
    msg[:len(raw)] = np.frombuffer(raw, np.uint8)
    return {"kind": np.array(kind, np.int32), "msg": msg}


def on_main(fn: Callable[[], T], template: Any = None, what: str = "") -> T | Any:
    """Runs ``fn()`` on process 0 only and shares its outcome with every process.

    Returns ``fn()``'s value on process 0; on the others ``template`` (None), or, when
    ``template`` is given (a pytree of arrays shaped as ``fn``'s value), process 0's value
    broadcast to them. When ``fn`` raises on process 0, it raises there and every other
    process raises too (the same built-in type for ``ValueError``/``OSError``/
    ``RuntimeError``, else ``ProcessFailed``), with process 0's message; ``what`` names
    the step in that message. With one process: ``fn()``."""
    if count() == 1:
        return fn()
    err: BaseException | None = None
    value = template
    if is_main():
        try:
            value = fn()
        except Exception as e:
            err = e
    status = multihost_utils.broadcast_one_to_all(_encode(err))
    kind = int(status["kind"])
    if kind >= 0:
        if err is not None:
            raise err
        text = bytes(np.asarray(status["msg"])).rstrip(b"\0").decode(errors="replace")
        cls = _KINDS[kind] if kind < len(_KINDS) else ProcessFailed
        raise cls(f"process 0 failed{' ' + what if what else ''} (see its output): {text}")
    if template is not None:
        value = multihost_utils.broadcast_one_to_all(
            jax.tree.map(np.asarray, value if is_main() else template))
        value = jax.tree.map(np.asarray, value)
    return value


@functools.lru_cache(maxsize=8)
def _replicator(mesh: Any) -> Callable[[Any], Any]:
    # one compiled identity per mesh that lays a whole pytree out replicated on it
    return jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))


def host_value(x: Any) -> Any:
    """The whole value of every array of the pytree ``x`` as NumPy, on every process
    (``jax.device_get``). Arrays split over other processes' devices are first replicated
    on their mesh (one compiled program for the whole tree: a collective, so every process
    must call it); then each process reads its own copy."""
    leaves, treedef = jax.tree.flatten(x)
    split = [i for i, a in enumerate(leaves) if isinstance(a, jax.Array)
             and not a.is_fully_addressable and not a.sharding.is_fully_replicated]
    if split:
        mesh = leaves[split[0]].sharding.mesh
        whole = _replicator(mesh)([leaves[i] for i in split])
        for i, a in zip(split, whole, strict=True):
            leaves[i] = a
    leaves = [np.asarray(a.addressable_data(0)) if isinstance(a, jax.Array)
              and not a.is_fully_addressable else a for a in leaves]
    return jax.device_get(treedef.unflatten(leaves))


def global_array(shape: tuple[int, ...], sharding: Sharding,
                 rows: Callable[[slice], np.ndarray]) -> jax.Array:
    """The array of ``shape`` laid out by ``sharding`` (split along its first axis at most),
    built from ``rows(slice)``: the rows of that slice, computed only for the rows this
    process's devices hold (``jax.make_array_from_callback``)."""
    def cb(idx: tuple) -> np.ndarray:
        r = idx[0] if idx else slice(None)
        start, stop, _ = r.indices(shape[0])
        block = rows(slice(start, stop))
        return block[(slice(None), *idx[1:])] if len(idx) > 1 else block

    return jax.make_array_from_callback(shape, sharding, cb)

