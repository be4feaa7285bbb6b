"""OsciReset: TetraJet-v2's reset of oscillating FP4 weights (arXiv 2510.27527), as the
authors' code runs it (thu-ml/TetraJet-v2-NVFP4Training, commit ``ca5953f``,
``olmo2-training/olmo/quantization_real/oscillation_reset.py`` and ``calibrate.py``,
``detect_type: distance_ratio``; configs ``*/TJv2-mix_fp8-osci_reset.yaml``).

A weight element oscillates when its master value moves little while its quantized value
jumps between two grid points. Every ``period`` steps, from the first multiple of
``period`` at or after ``start``, for each quantized weight ``w`` (the master weight after
the optimizer update of step ``s``; ``s`` counts from 0, the authors' ``iter_num =
global_step - 1``):

* phase ``s % period == 0``: snapshot ``last = w``, ``dq = dw = 0``;
* phase ``1 .. iters``: ``dq += |Q(w) - Q(last)|``, ``dw += |w - last|``, ``last = w``
  (float32, element-wise);
* phase ``iters + 1``: ``ratio = dq / dw`` (0 where ``dw == 0``), and ``w = Q(w)`` wherever
  ``ratio >= threshold``; the accumulators are cleared.

``Q`` is the quantize-dequantize of the weight as the layer's forward GEMM sees it: its
recipe's ``fprop.rhs`` format, 2D or 1D blocks and block-scale rule, round-to-nearest,
on the weight cast to the model's compute dtype, the product's weight ``(K, N)`` blocked
along ``K`` (a stacked kernel ``(..., K, N)``, scanned layers or experts, each matrix on
its own). **A stated difference**: the authors quantize with their own "double-block"
NVFP4 (inner blocks of 16, outer blocks of 128 instead of one tensor scale); fp4jax uses
the recipe's quantizer, the one its forward pass runs. Their defaults (70M-370M OLMo2
configs): ``period=200``, ``iters=50``, ``threshold=8``, start at 8,000 of 12,505 steps
(~64%).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from fp4jax import quantization as qz
from fp4jax.recipes import QuantSpec
from fp4jax.train.parallel import path_str


@dataclasses.dataclass(frozen=True)
class OsciReset:
    """When OsciReset runs (the module docstring has the rule).

    Attributes:
      start: the step (0-based) from which it runs: the first snapshot is at the first
        multiple of ``period`` at or after it.
      period: steps between snapshots (int >= 3; the authors' ``perturb_period``, 200).
      iters: steps over which the distances are accumulated after a snapshot
        (1 <= iters <= period - 2; ``detect_DistRatio_iters``, 50).
      threshold: the ratio ``sum |dQ(w)| / sum |dw|`` at or above which an element is reset
        to its quantized value (finite, > 0; ``detect_DistRatio_thrd``, 8).
    """

    start: int
    period: int = 200
    iters: int = 50
    threshold: float = 8.0

    def __post_init__(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.start) or self.start < 0:
            raise ValueError(f"OsciReset.start must be an int >= 0, got {self.start!r}")
        if not is_int(self.period) or self.period < 3:
            raise ValueError(f"OsciReset.period must be an int >= 3, got {self.period!r}")
        if not is_int(self.iters) or not 1 <= self.iters <= self.period - 2:
            raise ValueError(f"OsciReset.iters must be an int in [1, period - 2] = "
                             f"[1, {self.period - 2}], got {self.iters!r}")
        t = self.threshold
        if (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)
                or t <= 0):
            raise ValueError(f"OsciReset.threshold must be a finite number > 0, got {t!r}")

    @property
    def first_snapshot(self) -> int:
        """The step of the first snapshot: the first multiple of ``period`` >= ``start``."""
        return -(-self.start // self.period) * self.period

    def phase_index(self, step: Any) -> Any:
        """What step ``step`` does, as an index into ``PHASES`` (0 off, 1 snapshot, 2 track,
        3 reset): the schedule's one rule, for a Python int or a traced int32 step."""
        ph = step % self.period
        return jnp.where(step < self.first_snapshot, 0,
                         jnp.where(ph == 0, 1,
                                   jnp.where(ph <= self.iters, 2,
                                             jnp.where(ph == self.iters + 1, 3, 0))))

    def phase(self, step: int) -> str:
        """What step ``step`` does: ``"off"``, ``"snapshot"``, ``"track"`` or ``"reset"``."""
        return PHASES[int(self.phase_index(step))]


PHASES = ("off", "snapshot", "track", "reset")


@dataclasses.dataclass(frozen=True)
class Tracked:
    """One weight OsciReset tracks: the kernel's path, how the forward GEMM quantizes it
    (``spec``: its recipe's ``fprop.rhs``) and the compute dtype it is cast to first."""

    path: str
    spec: QuantSpec
    dtype: str


def fake_quant_weight(w: jax.Array, spec: QuantSpec, dtype: Any) -> jax.Array:
    """``Q(w)``: ``w (..., K, N)`` cast to ``dtype``, quantized as the forward GEMM's weight
    (``spec``'s format, 2D or 1D blocks along ``K``, block-scale rule; round-to-nearest)
    and dequantized to float32; leading axes are separate matrices (each its own tensor
    scale). Returns float32 of ``w``'s shape."""

    def one(m: jax.Array) -> jax.Array:
        q = qz.quantize(m.astype(dtype), spec.fmt, axis=0, block_2d=spec.block_2d,
                        block_scale_rule=spec.block_scale_rule)
        return qz.dequantize(q, jnp.float32)

    f = one
    for _ in range(w.ndim - 2):
        f = jax.vmap(f)
    return f(w)


def tracked_weights(params: Any, layers: Mapping[str, tuple[Any, tuple[int, ...], str | None]],
                    dtype: Any) -> tuple[list[Tracked], dict[str, str]]:
    """The weights OsciReset tracks, in the order of ``params``' leaves.

    Args:
      params: the parameter tree (arrays or ``ShapeDtypeStruct``s).
      layers: the model's linear layers by kernel path (``"block_0/q/kernel"``):
        ``(recipe or None, the weight shape their product uses, why the kernel is not what
        the product quantizes or None)`` (``fp4jax.train.models.llama_weight_layers``).
      dtype: the model's compute dtype.

    Returns:
      ``(tracked, skipped)``: ``skipped`` is ``{kernel path: why}`` for each listed layer
      not tracked (a high-precision layer, an unquantized weight, a kernel that is not the
      product's weight).
    """
    out, skipped = [], {}
    for p, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = path_str(p)
        entry = layers.get(path)
        if entry is None:
            continue
        recipe, weight, why = entry
        spec = None if recipe is None else recipe.fprop.rhs
        if why is None and (spec is None or not spec.quantized):
            why = "its forward GEMM does not quantize the weight"
        if why is None and tuple(x.shape[-2:]) != tuple(weight):
            why = (f"its product uses a weight of shape {tuple(weight)}, not the kernel's last "
                   f"two axes {tuple(x.shape[-2:])}")
        if why is None and spec.rounding not in ("nearest", "stochastic"):
            why = f"its weight's rounding {spec.rounding!r} has no round-to-nearest twin"
        if why is not None:
            skipped[path] = why
            continue
        out.append(Tracked(path, spec, jnp.dtype(dtype).name))
    return out, skipped


def _leaves(params: Any, tracked: list[Tracked]) -> tuple[list, list[int]]:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    index = {path_str(p): i for i, (p, _) in enumerate(flat)}
    idx = [index[t.path] for t in tracked]
    return [flat[i][1] for i in idx], idx


def init_state(params: Any, tracked: list[Tracked]) -> dict[str, list[jax.Array]]:
    """The state OsciReset keeps beside the train state: ``{"last", "dq", "dw"}``, each a
    list of float32 arrays shaped as the tracked kernels (3 extra copies of them)."""
    ws, _ = _leaves(params, tracked)
    return _fresh(ws, ws)


def _fresh(ws: list, last: list) -> dict[str, list[jax.Array]]:
    """A state with ``last`` as the snapshot (float32) and the distances at zero."""
    z = [jnp.zeros(w.shape, jnp.float32) for w in ws]
    return {"last": [jnp.asarray(w, jnp.float32) for w in last], "dq": z, "dw": list(z)}


def apply(cfg: OsciReset, params: Any, state: dict, step: jax.Array,
          tracked: list[Tracked]) -> tuple[Any, dict, jax.Array]:
    """One step of OsciReset after the optimizer update of step ``step`` (int32 scalar,
    0-based): ``params`` are the updated parameters. Returns ``(params, state, reset)``:
    ``reset`` is the fraction of tracked elements reset to their quantized value at this
    step (float32; 0 on other steps)."""
    if not tracked:
        return params, state, jnp.zeros((), jnp.float32)
    ws, idx = _leaves(params, tracked)
    branch = cfg.phase_index(step)

    def q(w, t):
        return fake_quant_weight(w, t.spec, t.dtype)

    def off(ws, st):
        return ws, st, jnp.zeros((), jnp.float32)

    def snapshot(ws, st):
        return ws, _fresh(ws, ws), jnp.zeros((), jnp.float32)

    def track(ws, st):
        dq = [a + jnp.abs(q(w, t) - q(lw, t))
              for a, w, lw, t in zip(st["dq"], ws, st["last"], tracked, strict=True)]
        dw = [a + jnp.abs(w.astype(jnp.float32) - lw)
              for a, w, lw in zip(st["dw"], ws, st["last"], strict=True)]
        return ws, {"last": [w.astype(jnp.float32) for w in ws], "dq": dq, "dw": dw}, \
            jnp.zeros((), jnp.float32)

    def reset(ws, st):
        new, n_reset = [], jnp.zeros((), jnp.float32)
        for w, a, b, t in zip(ws, st["dq"], st["dw"], tracked, strict=True):
            ratio = jnp.where(b == 0, jnp.float32(0), a / jnp.where(b == 0, 1, b))
            mask = ratio >= jnp.float32(cfg.threshold)
            new.append(jnp.where(mask, q(w, t).astype(w.dtype), w))
            n_reset = n_reset + jnp.sum(mask, dtype=jnp.float32)
        total = float(sum(w.size for w in ws))
        zeros = [jnp.zeros(w.shape, jnp.float32) for w in ws]
        return new, _fresh(ws, zeros), n_reset / total

    ws, state, frac = jax.lax.switch(branch, [off, snapshot, track, reset], ws, state)
    flat, treedef = jax.tree.flatten(params)
    for i, w in zip(idx, ws, strict=True):
        flat[i] = w
    return jax.tree.unflatten(treedef, flat), state, frac
