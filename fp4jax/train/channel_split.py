"""OutControl in the training harness: TetraJet-v2's outlier channels (arXiv 2510.27527;
``fp4jax.outcontrol`` holds the rules and their source) as training-loop state.

The schedule (``OutControlPlan``; 0-based steps, the authors' ``iter_num``): the forward
passes of steps ``start .. start + iters - 1`` record each quantized dense layer's
per-input-channel L2 norm over the step's batch (``steps.make_outcontrol_record``), added
up in float32; before step ``start + iters`` every layer whose input width admits a split
(``outcontrol.outcontrol_count``) takes its top channels by the summed norm as its MXFP8
channels (``outcontrol.select_channels``); from that step on its GEMMs run
``outcontrol.split_dot`` (evaluation too). The authors' defaults: ``start=501``,
``iters=50``, ratio 0.1, channel counts multiples of 128.

The state lives in the train state under ``"outcontrol"``: ``{"sums": {path: {"sq":
float32 (..., K)}}, "split": {path: {"hi": int32 (..., n), "lo": int32 (..., K - n)}}}``,
nested by module path as linen's collections are (a scanned stack has a leading block
axis), so checkpoints and exact resume keep it (theirs cannot resume inside the recording
window: its flag is not saved).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from fp4jax import outcontrol


@dataclasses.dataclass(frozen=True)
class OutControlPlan:
    """The run's OutControl: its schedule and which layers split how many channels.

    Attributes:
      start, iters: the recorded steps ``start .. start + iters - 1``; the split from
        ``start + iters`` (``split_step``).
      counts: ``{path: n}``, the MXFP8 channel count of every layer that splits (paths as
        tuples of module names, ending with the ``DotGeneral`` submodule).
      skipped: ``{"/".join(path): why}`` for the quantized dense layers that do not.
    """

    start: int
    iters: int
    counts: dict
    skipped: dict

    @property
    def split_step(self) -> int:
        return self.start + self.iters

    def recording(self, step: int) -> bool:
        return self.start <= step < self.split_step

    def describe(self) -> str:
        n = len(self.counts)
        text = (f"OutControl: {n} layer(s) record channel norms over steps {self.start}.."
                f"{self.split_step - 1} and run their top channels in MXFP8 from step "
                f"{self.split_step}")
        if self.skipped:
            text += f" ({len(self.skipped)} layer(s) too narrow to split)"
        return text


def make_plan(norm_shapes: Any, ratio: float, multiple: int, start: int,
              iters: int) -> OutControlPlan:
    """The plan from the shapes of ``steps.make_outcontrol_record``'s output (its tree of
    ``"sq"`` leaves, ``jax.eval_shape``'d): each layer's ``K`` is its leaf's last axis."""
    counts, skipped = {}, {}
    for path, leaf in traverse_util.flatten_dict(norm_shapes).items():
        layer = path[:-1]
        try:
            counts[layer] = outcontrol.outcontrol_count(int(leaf.shape[-1]), ratio, multiple)
        except ValueError as e:
            skipped["/".join(layer)] = str(e)
    return OutControlPlan(start, iters, counts, skipped)


def init_state(plan: OutControlPlan, norm_shapes: Any) -> dict:
    """Zero sums and placeholder splits (every index 0, unused before ``split_step``) of the
    plan's layers, shaped as the record's leaves."""
    flat = traverse_util.flatten_dict(norm_shapes)
    sums, split = {}, {}
    for layer, n in plan.counts.items():
        shape = flat[(*layer, "sq")].shape
        sums[(*layer, "sq")] = jnp.zeros(shape, jnp.float32)
        split[(*layer, "hi")] = jnp.zeros((*shape[:-1], n), jnp.int32)
        split[(*layer, "lo")] = jnp.zeros((*shape[:-1], shape[-1] - n), jnp.int32)
    return {"sums": traverse_util.unflatten_dict(sums),
            "split": traverse_util.unflatten_dict(split)}


def accumulate(plan: OutControlPlan, state: dict, norms: Any) -> dict:
    """``state`` with one step's ``norms`` (the record's tree) added to the plan's sums."""
    flat = traverse_util.flatten_dict(norms)
    sums = traverse_util.flatten_dict(state["sums"])
    sums = {k: v + flat[k] for k, v in sums.items()}
    return {**state, "sums": traverse_util.unflatten_dict(sums)}


def select(plan: OutControlPlan, state: dict) -> dict:
    """``state`` with every planned layer's split from its summed norms
    (``outcontrol.select_channels``; a scanned stack: each block its own)."""
    sums = traverse_util.flatten_dict(state["sums"])
    split = {}
    for layer, n in plan.counts.items():
        s = sums[(*layer, "sq")]
        pick = lambda v, n=n: outcontrol.select_channels(v, n)  # noqa: E731
        for _ in range(s.ndim - 1):
            pick = jax.vmap(pick)
        split[(*layer, "hi")], split[(*layer, "lo")] = pick(s)
    return {**state, "split": traverse_util.unflatten_dict(split)}


def counts_record(plan: OutControlPlan, state: dict, step: int) -> dict:
    """The run-log record of the split: per layer (its module path without the
    ``DotGeneral`` submodule) its MXFP8 channel count and its first 8 channels (block 0's
    for a scanned stack), and the layers that do not split."""
    split = traverse_util.flatten_dict(state["split"])
    layers = {}
    for layer, n in plan.counts.items():
        hi = jax.device_get(split[(*layer, "hi")]).reshape(-1, n)[0]
        name = "/".join(layer[:-1] if layer[-1].startswith("DotGeneral_") else layer)
        layers[name] = {"mxfp8_channels": n, "first": [int(c) for c in hi[:8]]}
    return {"type": "outcontrol", "step": step, "layers": layers, "skipped": plan.skipped}
