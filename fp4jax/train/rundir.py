"""A run's output directory (``--out``): whether it can be written (``check_out``), whether it
already holds a run (``run_contents``), and the rule that keeps an earlier run from being
destroyed by a repeated command (``claim_out``): without ``--resume`` a directory that holds
a run is refused, unless ``--overwrite`` asks to move it aside to ``OUT.old-<time>``
(``move_aside``); nothing is deleted.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from fp4jax.train.config import ConfigError, TrainConfig

# what marks a directory as holding a run (its checkpoints count when they hold a step)
RUN_FILES = ("metrics.jsonl", "result.json")


class RunExists(FileExistsError, ValueError):
    """``--out`` already holds a run and neither ``--resume`` nor ``--overwrite`` was given."""


def check_out(out: str | os.PathLike, field: str = "out") -> None:
    """Checks that ``out`` is, or can be created as, a writable directory (by creating and
    removing a probe file in it or in its nearest existing parent; nothing else is written).

    Raises:
      ConfigError: ``out`` (or a parent) is a file, or the directory is not writable.
    """
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(field, f"{str(path)!r} is a file, not a directory")
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(field, f"cannot create {str(path)!r}: {str(probe)!r} is a file")
    try:
        fd, name = tempfile.mkstemp(prefix=".fp4jax-write-probe-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise ConfigError(field, f"{str(path)!r} is not writable (creating a file in "
                          f"{str(probe)!r} failed: {e.strerror or e})") from None


def run_contents(out: str | os.PathLike) -> list[str]:
    """What in ``out`` belongs to a run (``metrics.jsonl``, ``result.json``, checkpoints), as
    short descriptions; empty when ``out`` holds no run."""
    out = Path(out)
    if not out.is_dir():
        return []
    found = [name for name in RUN_FILES if (out / name).exists()]
    ckpt = out / "checkpoints"
    if ckpt.is_dir():
        steps = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
        if steps:
            found.append(f"checkpoints {', '.join(map(str, steps))}")
    return found


def aside_path(out: str | os.PathLike) -> Path:
    """A free name ``OUT.old-<YYYYmmdd-HHMMSS>[-k]`` next to ``out``."""
    out = Path(out)
    base = out.with_name(f"{out.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    path, k = base, 1
    while path.exists():
        path, k = base.with_name(f"{base.name}-{k}"), k + 1
    return path


def move_aside(out: str | os.PathLike) -> Path:
    """Renames the directory ``out`` to ``aside_path(out)``; returns the new path."""
    dest = aside_path(out)
    os.rename(out, dest)
    return dest


def refusal(out: str | os.PathLike, found: list[str]) -> str:
    """The one-line message that refuses to train into ``out``, which holds a run."""
    return (f"{str(out)!r} already holds a run ({'; '.join(found)}); a new run would "
            "destroy it: continue it with --resume (resume=True), or pass --overwrite "
            f"(overwrite=True) to move it aside to {str(out)}.old-<time> and start afresh")


def claim_out(cfg: TrainConfig, dry_run: bool = False) -> Path | None:
    """Makes ``cfg.out`` ready for a fresh run (``cfg.resume`` false).

    An ``out`` that holds a run is refused unless ``cfg.overwrite``, which moves it aside
    (``move_aside``; said on stderr). ``dry_run`` only checks. Returns where an earlier run
    was moved, or None.

    Raises:
      RunExists: ``out`` holds a run and ``cfg.overwrite`` is false (a ``FileExistsError``
        and a ``ValueError``).
    """
    out = Path(cfg.out)
    found = run_contents(out)
    if not found:
        return None
    if not cfg.overwrite:
        raise RunExists(refusal(out, found))
    if dry_run:
        return None
    dest = move_aside(out)
    print(f"fp4jax-train: --overwrite: moved the earlier run in {out} ({'; '.join(found)}) to "
          f"{dest}", file=sys.stderr, flush=True)
    return dest
