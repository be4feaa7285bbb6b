"""The Mosaic GPU (``plgpu``) calls whose API differs between the JAX releases the Hopper
kernels run on (0.10, 0.11, 0.12): the kernels call these instead, so each difference is
stated and handled once. Each picks its form by what this JAX's API has (not by version
number) and computes the same values on every release: on JAX 0.10 and 0.11 the kernels
trace to the same jaxprs through it as through the calls it replaced."""

from __future__ import annotations

import inspect
from typing import Any

from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["interpret_gpu_params", "load", "register_pallas_call_lowering", "store_untiled",
           "transpose"]


def register_pallas_call_lowering() -> None:
    """Registers ``pl.pallas_call``'s Mosaic GPU lowering (done when this module is
    imported, so by every kernel module).

    JAX 0.10's ``pallas_call`` lowering imports it itself; on JAX 0.11 and 0.12 a
    ``pallas_call`` lowered for CUDA finds it only once
    ``jax._src.pallas.mosaic_gpu.pallas_call_registration`` has been imported, and no
    public name imports it: the private module is imported here only."""
    try:
        from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401
    except ImportError:  # pragma: no cover
        pass


register_pallas_call_lowering()


def _load_takes_idx() -> bool:
    """Whether ``plgpu.load`` requires its index as a positional argument (JAX 0.10)."""
    p = inspect.signature(plgpu.load).parameters.get("idx")
    return p is not None and p.default is inspect.Parameter.empty


_LOAD_TAKES_IDX = _load_takes_idx()


def load(ref: Any, idx: Any = (), *, layout: Any = None) -> Any:
    """``ref[idx]`` loaded into registers in ``layout`` (``plgpu.load``).

    JAX 0.10: ``plgpu.load(ref, idx, layout=...)``, the index required apart. JAX 0.11:
    the index may still be passed apart but is deprecated (a warning), indexing the ref
    (``ref.at[idx]``) instead. JAX 0.12: ``plgpu.load(ref, layout=...)`` takes one indexed
    ref only. Both forms append the same ``NDIndexer`` to the ref's transforms (an empty
    ``idx`` appends none), so the loads lower alike."""
    if _LOAD_TAKES_IDX:
        return plgpu.load(ref, idx, layout=layout)
    if not (isinstance(idx, tuple) and not idx):
        ref = ref.at[idx]
    return plgpu.load(ref, layout=layout)


def _store_takes_optimized() -> bool:
    """Whether this JAX exports ``plgpu.store`` with an ``optimized`` flag (JAX 0.12)."""
    store = getattr(plgpu, "store", None)
    return store is not None and "optimized" in inspect.signature(store).parameters


_STORE_TAKES_OPTIMIZED = _store_takes_optimized()


def store_untiled(ref: Any, value: Any) -> None:
    """``ref[...] = value`` for an SMEM ``ref`` with no tiling or swizzle transform (plain
    row-major; indexing it is fine), from registers, with the bank-conflict-tolerant
    ("unoptimized") transfer.

    JAX 0.10 and 0.11 lower ``ref[...] = value`` of a tiled-layout array (WGMMA and the
    like) into such a ref that way. JAX 0.12 lowers it asking for a transfer free of bank
    conflicts and fails where the layout has none ("Failed to synthesize a transfer
    pattern that avoids bank conflicts", e.g. a (64, 16) bf16 slice of a (64, 128)
    row-major tile), so there it is ``plgpu.store(ref, value, optimized=False)``, the
    0.10/0.11 transfer. The stored values are the same either way."""
    if _STORE_TAKES_OPTIMIZED:
        plgpu.store(ref, value, optimized=False)
    else:
        ref[...] = value


def transpose(ref: Any, permutation: tuple[int, ...]) -> Any:
    """``ref`` viewed with its dimensions permuted (no copy): an SMEM operand of
    ``plgpu.wgmma`` / ``tcgen05_mma`` read transposed.

    JAX 0.10: ``plgpu.transpose_ref(ref, perm)``, which only checks the ref is not in TMEM
    and returns ``ref.transpose(perm)``. JAX 0.11: ``transpose_ref`` deprecated for
    ``ref.transpose(perm)``. JAX 0.12: ``transpose_ref`` removed. ``ref.transpose(perm)``
    (a plain ref or a ``TransformedRef``, the permutation as one tuple) exists on all three
    and appends the same ``TransposeTransform``."""
    if getattr(ref, "memory_space", None) == plgpu.MemorySpace.TMEM:
        raise ValueError("a TMEM reference cannot be transposed")
    return ref.transpose(tuple(permutation))


def interpret_gpu_params() -> Any:
    """The parameters of Mosaic GPU's interpret mode (``interpret=`` of ``plgpu.kernel``
    and ``pl.pallas_call``), with its defaults: the kernels run on CPU.

    JAX 0.11 and 0.12 export ``plgpu.InterpretGPUParams``; JAX 0.10 has the class only in
    ``jax._src.pallas.mosaic_gpu.interpret.params`` (private, imported there only)."""
    cls = getattr(plgpu, "InterpretGPUParams", None)
    if cls is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls()
