"""What a run keeps on disk besides its result: orbax checkpoints (``Checkpointer``, a
``CheckpointManager`` of ``{"state", "meta"}``; orbax is optional and imported on first use),
the check that a resumed run's config matches its checkpoint's (``config_diff``), and the
``metrics.jsonl`` helpers that truncate the log to a checkpoint and read the loss curves back
when resuming.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from fp4jax.train.config import RESUMABLE_KEYS, TrainConfig


class Checkpointer:
    """Orbax ``CheckpointManager`` of ``{"state": pytree, "meta": json}`` (synchronous saves)."""

    def __init__(self, directory: Path, max_to_keep: int = 2) -> None:
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.mngr = ocp.CheckpointManager(
            directory.absolute(),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
            ),
        )

    def latest_step(self) -> int | None:
        return self.mngr.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        a = self._ocp.args
        self.mngr.save(step, args=a.Composite(state=a.StandardSave(state), meta=a.JsonSave(meta)),
                       force=True)
        self.mngr.wait_until_finished()

    def meta(self, step: int) -> dict:
        a = self._ocp.args
        return dict(self.mngr.restore(step, args=a.Composite(meta=a.JsonRestore())).meta)

    def restore(self, step: int, target: Any) -> Any:
        a = self._ocp.args
        return self.mngr.restore(step, args=a.Composite(state=a.StandardRestore(target))).state

    def close(self) -> None:
        self.mngr.close()


def config_diff(saved: dict, current: dict) -> list[str]:
    """Keys (outside ``RESUMABLE_KEYS``) whose values differ, as ``key: saved -> current``."""
    keys = sorted((set(saved) | set(current)) - RESUMABLE_KEYS)
    # a key absent from an older checkpoint's config had its default value then
    default = dataclasses.asdict(TrainConfig())
    return [f"{k}: {saved.get(k, default.get(k))!r} -> {current.get(k)!r}" for k in keys
            if saved.get(k, default.get(k)) != current.get(k)]


def _truncate_metrics(path: Path, ckpt_step: int) -> None:
    """Drops records newer than the checkpoint being resumed from."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        limit = ckpt_step if rec.get("type") in ("eval", "resume") else ckpt_step - 1
        if rec.get("step", 0) <= limit:
            keep.append(line)
    path.write_text("".join(x + "\n" for x in keep))


def _history_from_metrics(path: Path) -> dict[str, list]:
    """The loss curves recorded in ``metrics.jsonl`` (train losses at ``--log-every``
    resolution), to seed a resumed run's history."""
    history: dict[str, list] = {"step": [], "loss": [], "val_step": [], "val_loss": []}
    if not path.exists():
        return history
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "train":
            history["step"].append(rec["step"])
            history["loss"].append(rec["loss"])
        elif rec.get("type") == "eval":
            history["val_step"].append(rec["step"])
            history["val_loss"].append(rec["val_loss"])
    return history

