"""A run's output directory (``--out``): whether it can be written (``check_out``), whether it
already holds a run (``run_contents``), and the rule that keeps an earlier run from being
destroyed by a repeated command (``claim_out``): without ``--resume`` a directory that holds
a run is refused, unless ``--overwrite`` asks to move it aside to ``OUT.old-<time>``
(``move_aside``); nothing is deleted. While a process trains into a directory it holds the
directory's lock (``lock_out``: ``OUT/.fp4jax-lock``, an advisory ``flock`` with the owner's
pid, released by the kernel when the owner dies), and a second writer is refused
(``RunLocked``) instead of moving the directory aside under it or writing beside it.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locks
    fcntl = None

from fp4jax.train.config import ConfigError, TrainConfig

# what marks a directory as holding a run (its checkpoints count when they hold a step)
RUN_FILES = ("metrics.jsonl", "result.json")


class RunExists(FileExistsError, ValueError):
    """``--out`` already holds a run and neither ``--resume`` nor ``--overwrite`` was given."""


class RunLocked(RunExists):
    """``--out`` is being written by another live process (it holds ``OUT/.fp4jax-lock``)."""


LOCK_FILE = ".fp4jax-lock"
_held: dict[str, list] = {}  # realpath of a locked directory -> [fd, count]
_scopes: list[list[str]] = []  # the locks taken inside each running ``releases_locks`` call
F = TypeVar("F", bound=Callable[..., Any])


def _lock_key(out: str | os.PathLike) -> str:
    return os.path.realpath(Path(out).expanduser())


def lock_owner(out: str | os.PathLike) -> int | None:
    """The pid of the live process (another than this one) that holds ``out``'s lock, or
    None. A lock file left by a dead process is not held (the kernel released its ``flock``);
    -1 when the holder's pid cannot be read."""
    path = Path(out).expanduser() / LOCK_FILE
    if fcntl is None or not path.is_file() or _lock_key(out) in _held:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # held by a live process
            try:
                return int(os.read(fd, 64).split()[0])
            except (OSError, ValueError, IndexError):
                return -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _locked_message(out: str | os.PathLike, pid: int) -> str:
    who = "another process" if pid < 0 else f"process {pid}"
    return (f"{str(out)!r} is being written by {who} (it holds {LOCK_FILE} there): a second "
            "writer would corrupt the run. Wait for it to end or stop it (e.g. an orphaned "
            "sweep worker: kill " + ("<pid>" if pid < 0 else str(pid)) + "), then run again")


def check_unlocked(out: str | os.PathLike) -> None:
    """Raises ``RunLocked`` when another live process holds ``out``'s lock."""
    pid = lock_owner(out)
    if pid is not None:
        raise RunLocked(_locked_message(out, pid))


def lock_out(out: str | os.PathLike) -> None:
    """Takes ``out``'s lock for this process (``out`` exists): ``OUT/.fp4jax-lock`` holding
    the pid under an exclusive ``flock``. Re-entrant within a process; released by
    ``release_out``, at the end of the enclosing ``releases_locks`` call, or by the kernel
    when the process ends (so a killed owner never holds it). No-op without ``fcntl``.

    Raises:
      RunLocked: another live process holds it.
    """
    if fcntl is None:
        return
    key = _lock_key(out)
    if key in _held:
        _held[key][1] += 1
    else:
        fd = os.open(Path(out).expanduser() / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                pid = int(os.read(fd, 64).split()[0])
            except (OSError, ValueError, IndexError):
                pid = -1
            os.close(fd)
            raise RunLocked(_locked_message(out, pid)) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _held[key] = [fd, 1]
    if _scopes:
        _scopes[-1].append(key)


def release_out(out: str | os.PathLike) -> None:
    """Releases one ``lock_out`` of ``out`` by this process (the lock goes with the last)."""
    _release(_lock_key(out))


def _release(key: str) -> None:
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _held[key]
        os.close(entry[0])  # closing the descriptor drops the flock


def releases_locks(fn: F) -> F:
    """Decorator: the directory locks ``fn`` takes (``lock_out``) are released when it
    returns or raises."""
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _scopes.append([])
        try:
            return fn(*args, **kwargs)
        finally:
            for key in _scopes.pop():
                _release(key)
    return wrapped  # type: ignore[return-value]


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


def check_resumable(out: str | os.PathLike) -> None:
    """``--resume``: refuses an ``out`` with no checkpoint to resume from (no step directory
    in ``OUT/checkpoints``) before anything is compiled or written; whether the newest one
    restores is checked when the run restores it.

    Raises:
      ValueError: naming ``OUT/checkpoints`` and the fix.
    """
    ck = Path(out).expanduser() / "checkpoints"
    if not ck.is_dir() or not any(p.name.isdigit() for p in ck.iterdir()):
        raise ValueError(f"--resume: no checkpoint in {ck}: nothing to resume; start a fresh "
                         "run without --resume (with --overwrite if --out holds an earlier "
                         "run, which moves it aside)")


def claim_out(cfg: TrainConfig, dry_run: bool = False) -> Path | None:
    """Makes ``cfg.out`` ready for a fresh run (``cfg.resume`` false).

    An ``out`` that holds a run is refused unless ``cfg.overwrite``, which moves it aside
    (``move_aside``; said on stderr). ``dry_run`` only checks. Returns where an earlier run
    was moved, or None.

    Raises:
      RunExists: ``out`` holds a run and ``cfg.overwrite`` is false (a ``FileExistsError``
        and a ``ValueError``); ``RunLocked`` (a ``RunExists``): another live process is
        writing ``out``.
    """
    out = Path(cfg.out)
    check_unlocked(out)
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
