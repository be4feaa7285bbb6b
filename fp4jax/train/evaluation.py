"""What a run measures besides its training loss: the validation loss (every
``--eval-every`` steps), the per-layer quantization statistics (``--stats-every``) and the
gradient-to-noise ratio (``--grad-noise-every``), each by its own jitted function
(``fp4jax.train.steps``), with the keys of the train step it measures, written to the run's
``RunLog`` with its time kept out of tokens/s.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from fp4jax import diagnostics
from fp4jax.train import processes
from fp4jax.train.runlog import RunLog


def _layer_of(name: str) -> str:
    """A measurement's layer path: its name without the scan index (``"[3]"``), the call
    suffix (``"#2"``) and the weight's name (``":w_down"``, a weight not called
    ``kernel``: ``diagnostics.gradient_noise``)."""
    return re.sub(r"(\[\d+\])+$", "", name.split("#", 1)[0].split(":", 1)[0])


class Evaluation:
    """The run's measurements. Each function table maps "switched" (the precision switch:
    step ``s >= switch_step``) to the jitted function of that model.

    Args:
      log: the run's ``RunLog``.
      key: the run's base key (``fold_in(root, 1)``), an argument of every function.
      evals: ``{switched: eval(params, batch, key) -> loss}`` (``make_eval_step``).
      val: the validation batches, ``(B, T+1)`` int32 global arrays.
      stats: ``{switched: stats(params, batch, key, step)}`` (``make_stats_step``) or None.
      noise: ``{switched: noise(params, batch, key, step)}`` (``make_grad_noise_step``) or
        None.
      fp4_names: the layers whose recipe quantizes a GEMM (their combined ratio is recorded
        beside the global one).
      layer_order: sort key of layer names (the order of a ``"stats"`` record).
    """

    def __init__(self, log: RunLog, key: jax.Array, evals: dict[bool, Callable],
                 val: Sequence[jax.Array], stats: dict[bool, Callable] | None = None,
                 noise: dict[bool, Callable] | None = None, fp4_names: Sequence[str] = (),
                 layer_order: Callable[[str], Any] = str) -> None:
        self.log, self.key = log, key
        self.evals, self.val, self.stats_fns, self.noise_fns = evals, val, stats, noise
        self.fp4_names, self.layer_order = list(fp4_names), layer_order

    def val_loss(self, s: int, params: Any, switched: bool) -> float:
        """The mean validation loss of ``params`` (the state before step ``s``), recorded.

        Raises:
          TrainingDiverged: not finite.
        """
        fn = self.evals[switched]
        t0 = time.perf_counter()
        # every batch dispatched before the first is read: the device runs them back to back
        losses = [fn(params, b, self.key) for b in self.val]
        v = float(np.mean([float(processes.host_value(x)) for x in losses]))
        self.log.val_loss(s, v)
        self.log.pause(time.perf_counter() - t0)  # keep eval time out of throughput
        return v

    def stats(self, s: int, params: Any, batch: jax.Array, step: jax.Array,
              switched: bool) -> None:
        """Writes the per-layer statistics of step ``s`` (``params``: the state before it,
        its ``batch`` and keys; ``step``: the state's step counter) as a ``"stats"``
        record."""
        t0 = time.perf_counter()
        st = processes.host_value(self.stats_fns[switched](params, batch, self.key, step))
        layers = {name: diagnostics.flatten_stats(st[name])
                  for name in sorted(st, key=self.layer_order)}
        dt = time.perf_counter() - t0
        rec: dict[str, Any] = {"type": "stats", "step": s, "wall_s": dt, "layers": layers}
        measured = {_layer_of(n) for n in st}
        missing = [n for n in self.fp4_names if n not in measured]
        if missing:  # quantized layers layer_stats could not measure (it warned why)
            rec["unmeasured"] = missing
        self.log.write(rec)
        self.log.pause(dt)

    def noise(self, s: int, params: Any, batch: jax.Array, step: jax.Array,
              switched: bool) -> dict[str, Any]:
        """Writes the gradient-to-noise ratio of step ``s`` (as for ``stats``) as a
        ``"grad_noise"`` record and returns it (``diagnostics.flatten_noise``, with
        ``"fp4_layers"``: the quantized layers' combined ratio)."""
        t0 = time.perf_counter()
        r = diagnostics.flatten_noise(jax.device_get(self.noise_fns[switched](
            params, batch, self.key, step)))
        # beside the global ratio (the paper's, over every parameter): the FP4 layers'
        fp4 = set(self.fp4_names)
        r["fp4_layers"] = diagnostics.combine_noise([e for n, e in r["layers"].items()
                                                     if n in fp4 or _layer_of(n) in fp4])
        dt = time.perf_counter() - t0
        self.log.write({"type": "grad_noise", "step": s, "wall_s": dt, **r})
        self.log.pause(dt)
        return r
