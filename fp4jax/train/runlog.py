"""What a run says while it trains: ``metrics.jsonl`` records, the progress bar, the loss
curves kept for ``result.json``, the throughput clocks, and the divergence error.

* ``RunLog``: writes one JSON object per line to ``OUT/metrics.jsonl`` (process 0 only),
  reads each step's metrics behind the device (``dispatched`` then ``flush``, which may
  leave the steps still in flight unread:
  a divergence check, the loss curve, a ``"train"`` record every ``log_every`` steps), and
  keeps the tokens/s clocks from which the time of evaluations, measurements and
  checkpoints is taken out (``pause``).
* ``Progress``: the optional tqdm bar, else log lines on stderr.
* ``TrainingDiverged``: a non-finite loss, validation loss, gradient norm or state.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from fp4jax.train import processes


class TrainingDiverged(RuntimeError):
    """A training or validation loss, the gradient norm or the state became non-finite at
    step ``step`` (0-based; None when unknown)."""

    def __init__(self, msg: str, step: int | None = None) -> None:
        super().__init__(msg)
        self.step = step


class Progress:
    """A tqdm progress bar of ``total`` steps from ``initial`` (``enabled`` and tqdm
    installed), else nothing; ``write`` prints a line above it (or on stderr). ``quiet``: a
    process other than 0 of a multi-process run says nothing."""

    def __init__(self, total: int, initial: int, enabled: bool, desc: str,
                 quiet: bool = False) -> None:
        self.bar = None
        self.quiet = quiet
        if enabled:
            try:
                from tqdm.auto import tqdm

                tty = sys.stderr.isatty()
                self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True,
                                file=sys.stderr, mininterval=0.2 if tty else 10.0)
            except ImportError:  # tqdm is optional: fall back to log lines
                pass

    def update(self, postfix: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)

    def write(self, msg: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def empty_history() -> dict[str, list]:
    """The loss curves of a fresh run: ``{"step", "loss", "val_step", "val_loss"}``."""
    return {"step": [], "loss": [], "val_step": [], "val_loss": []}


class RunLog:
    """The run's log: ``metrics.jsonl`` (``path``; None on processes other than 0, which
    write nothing), the progress bar, the loss curves (``history``) and the clocks.

    Args:
      path: ``OUT/metrics.jsonl`` (appended to), or None.
      progress: the run's ``Progress``.
      name: the recipe's name, the prefix of messages (``[nvfp4] ...``).
      tokens_per_step: ``batch_size * seq_len``.
      log_every: a ``"train"`` record every this many steps (and at ``end - 1``).
      end: the step the run stops before.
      lr: the learning rate of a step (the schedule).
      recipe_name: the name of the recipe that step ``s`` ran (the precision switch).
      diverged_note: ``note(s) -> str``: what the run keeps after a divergence at ``s``
        (the checkpoints' ``drop_bad``), appended to ``TrainingDiverged``'s message.
      history: the curves so far (a resumed run's, from its ``metrics.jsonl``).
    """

    def __init__(self, path: Path | None, progress: Progress, name: str, tokens_per_step: int,
                 log_every: int, end: int, lr: Callable[[int], Any],
                 recipe_name: Callable[[int], str], diverged_note: Callable[[int], str],
                 history: dict[str, list] | None = None) -> None:
        self.file = path.open("a") if path is not None else None
        self.progress = progress
        self.name = name
        self.tokens_per_step = tokens_per_step
        self.log_every, self.end = log_every, end
        self.lr, self.recipe_name, self.diverged_note = lr, recipe_name, diverged_note
        self.history = history if history is not None else empty_history()
        now = time.perf_counter()
        # throughput: steps after the first two (compilation), and the window of the
        # current "train" record
        self.clock = {"t": now, "train_s": 0.0, "train_tokens": 0, "seen": 0}
        self.window = {"t": now, "tokens": 0}
        self.pending: list[tuple[int, Any]] = []

    def write(self, rec: dict) -> None:
        """Appends ``rec`` to ``metrics.jsonl`` (process 0)."""
        if self.file is not None:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()

    def say(self, msg: str) -> None:
        """A line on stderr (above the progress bar), prefixed ``[recipe]``."""
        self.progress.write(f"[{self.name}] {msg}")

    def pause(self, seconds: float) -> None:
        """Keeps ``seconds`` (an evaluation, a measurement, a checkpoint) out of tokens/s."""
        self.clock["t"] += seconds
        self.window["t"] += seconds

    def diverged(self, rec: dict, msg: str, step: int, at: int | None = None
                 ) -> TrainingDiverged:
        """Writes the ``"diverged"`` record ``rec`` and returns the error to raise: ``msg``
        then what the checkpoints keep after a divergence at ``step`` (``diverged_note``,
        which drops the bad ones); ``at``: the step the error names (default ``step``)."""
        self.write({"type": "diverged", **rec})
        return TrainingDiverged(f"[{self.name}] {msg} {self.diverged_note(step)}",
                                step if at is None else at)

    def dispatched(self, step: int, metrics: Any) -> None:
        """Queues the (device) metrics of ``step``, read by a later ``flush``. Nothing here
        waits for the device: the metrics' copies to the host start now (they complete when
        the step does), and a step that gets a ``"train"`` record has its learning rate
        (``lr(step)``, a device computation) dispatched now too, so that ``flush`` reads
        finished values instead of queueing work behind the steps in flight."""
        for x in jax.tree.leaves(metrics):
            if isinstance(x, jax.Array) and x.is_fully_addressable:
                x.copy_to_host_async()
        lr = self.lr(step) if self._recorded(step) else None
        self.pending.append((step, metrics, lr))

    def _recorded(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.end - 1

    @property
    def tokens_per_s(self) -> float | None:
        """Training tokens per second so far (the first two steps left out), or None."""
        c = self.clock
        return c["train_tokens"] / c["train_s"] if c["train_s"] > 0 else None

    def flush(self, keep: int = 0) -> None:
        """Reads the metrics of dispatched steps, oldest first, all but the newest ``keep``
        (the training loop keeps the steps still in flight unread, so it never waits for
        the device's queue to drain; evaluations, measurements and checkpoints flush all).

        Raises:
          TrainingDiverged: a non-finite loss or gradient norm.
        """
        c, w = self.clock, self.window
        while len(self.pending) > keep:
            s, m, lr = self.pending.pop(0)
            m = processes.host_value(m)
            loss, gnorm = float(m["loss"]), float(m["grad_norm"])
            now = time.perf_counter()
            dt, c["t"] = now - c["t"], now
            c["seen"] += 1
            if c["seen"] > 2:  # skip compilation
                c["train_s"] += dt
                c["train_tokens"] += self.tokens_per_step
            if not (math.isfinite(loss) and math.isfinite(gnorm)):
                raise self.diverged({"step": s, "loss": loss, "grad_norm": gnorm},
                                    f"loss became {loss} (grad norm {gnorm}) at step {s} "
                                    "(0-based); stopped.", s)
            if "osci_reset" in m and float(m["osci_reset"]) > 0:  # --osci-reset's reset step
                self.write({"type": "osci_reset", "step": s,
                            "fraction": float(m["osci_reset"])})
            self.history["step"].append(s)
            self.history["loss"].append(loss)
            w["tokens"] += self.tokens_per_step
            self.progress.update({"loss": f"{loss:.3f}",
                                  "tok/s": f"{self.tokens_per_s or 0.0:,.0f}"})
            if self._recorded(s):
                wdt = now - w["t"]
                self.write({"type": "train", "step": s, "loss": loss, "grad_norm": gnorm,
                            "lr": float(self.lr(s) if lr is None else lr),
                            "tokens_per_s": w["tokens"] / wdt,
                            "recipe": self.recipe_name(s)})
                w["t"], w["tokens"] = now, 0

    def val_loss(self, step: int, value: float) -> None:
        """Records the validation loss ``value`` of the state before ``step``.

        Raises:
          TrainingDiverged: ``value`` is not finite.
        """
        if not math.isfinite(value):
            raise self.diverged({"step": step, "val_loss": value},
                                f"validation loss became {value} at step {step} (the state "
                                f"before step {step}); stopped.", step)
        self.write({"type": "eval", "step": step, "val_loss": value})
        self.history["val_step"].append(step)
        self.history["val_loss"].append(value)
        self.say(f"step {step}: val loss {value:.4f}")

    def close(self) -> None:
        self.progress.close()
        if self.file is not None:
            self.file.close()
