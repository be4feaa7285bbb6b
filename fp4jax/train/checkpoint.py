"""What a run keeps on disk besides its result: orbax checkpoints (``Checkpointer``, a
``CheckpointManager`` of ``{"state", "meta"}``; orbax is optional and imported on first use),
the check that a resumed run's config matches its checkpoint's (``config_diff``), and the
``metrics.jsonl`` helpers that read the log back (``read_metrics``), truncate it to a
checkpoint and read the loss curves back when resuming.

Every checkpoint's ``meta`` (a small JSON item saved with the state, in the same atomic
commit) holds the run's config, its step, the data fingerprint and a SHA-256 checksum of the
state's arrays (``state_checksum``, computed on the host from the saved arrays' bytes); once
orbax has committed it, ``fp4jax_files.json`` beside them lists the size and SHA-256 of every
file of the checkpoint. ``Checkpointer.restore_verified`` checks the files against that list
(before orbax reads them), that the metadata reads, that the arrays restore and that their
bytes match the checksum; any failure raises ``CheckpointDamaged`` saying how.
Pruning is explicit (``Checkpointer.prune``: keep the newest N, and never a protected one),
not orbax's ``max_to_keep``, so that the last checkpoint known to be good always survives.

``RunCheckpoints`` is a run's use of them: opening ``--out``, saving a state checked to be
finite, resuming from the newest checkpoint that restores (``restore_newest``), and deleting
the checkpoints a divergence makes bad (``drop_bad``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.train import processes
from fp4jax.train.config import (
    OVERRIDABLE_KEYS,
    RESUMABLE_KEYS,
    TrainConfig,
    split_run_spec,
)

# the file manifest written into each checkpoint's directory after orbax commits it
MANIFEST = "fp4jax_files.json"


class CheckpointDamaged(Exception):
    """Checkpoint ``step`` does not restore completely; ``reason`` says how."""

    def __init__(self, step: int, reason: str) -> None:
        self.step, self.reason = step, reason
        super().__init__(f"checkpoint {step} is damaged: {reason}")


def _why(e: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message`` of the root cause of ``e`` (orbax wraps the
    informative tensorstore error), cut to ``limit`` characters."""
    seen = {id(e)}
    while (inner := e.__cause__ or e.__context__) is not None and id(inner) not in seen:
        e = inner
        seen.add(id(e))
    lines = str(e).strip().splitlines()
    msg = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def host_leaves(state: Any) -> list[tuple[str, np.ndarray]]:
    """``(path, host array)`` for every leaf of ``state`` (``params/blocks_0/...``)."""
    leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(state))
    return [(jax.tree_util.keystr(p, simple=True, separator="/"), np.asarray(x))
            for p, x in leaves]


def state_checksum(state: Any) -> dict:
    """SHA-256 of every array of ``state`` (its path, dtype, shape and bytes) and of them all:
    ``{"algorithm": "sha256", "sha256": hex, "arrays": {path: hex}}``."""
    leaves = state if isinstance(state, list) else host_leaves(state)
    total, arrays = hashlib.sha256(), {}
    for name, a in leaves:
        h = hashlib.sha256(f"{a.dtype.name}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))  # the bytes, not copied
        arrays[name] = h.hexdigest()
        total.update(name.encode() + h.digest())
    return {"algorithm": "sha256", "sha256": total.hexdigest(), "arrays": arrays}


def nonfinite_leaves(state: Any) -> list[str]:
    """Paths of the floating-point arrays of ``state`` holding a NaN or an infinity."""
    leaves = state if isinstance(state, list) else host_leaves(state)
    return [name for name, a in leaves
            if jnp.issubdtype(a.dtype, jnp.inexact) and not np.isfinite(a).all()]


@contextlib.contextmanager
def _quiet_unraisable() -> Iterator[None]:
    """Silences the "Exception ignored in: <coroutine ...>" reports (each with a page-long
    TensorStore spec) of orbax's abandoned reads once one read of a damaged checkpoint has
    failed; the failure itself is reported in one line by ``restore_verified``. (A checkpoint
    with a file manifest never gets that far: its damage is found before orbax reads it.)"""
    old = sys.unraisablehook
    sys.unraisablehook = lambda _: None
    try:
        yield
    finally:
        gc.collect()
        sys.unraisablehook = old


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_manifest(directory: Path) -> dict[str, dict]:
    """``{relative path: {"size", "sha256"}}`` of every file below ``directory`` (but
    ``MANIFEST``)."""
    files = {}
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        if p.is_file() and rel != MANIFEST:
            files[rel] = {"size": p.stat().st_size, "sha256": _sha256_file(p)}
    return files


def manifest_problem(directory: Path, recorded: dict[str, dict]) -> str | None:
    """How the files below ``directory`` differ from ``recorded`` (None when they do not)."""
    for rel, want in sorted(recorded.items()):
        p = directory / rel
        if not p.is_file():
            return f"its file {rel} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            how = "truncated" if size < want["size"] else "longer than written"
            return f"its file {rel} is {how} ({size} bytes, {want['size']} written)"
        if _sha256_file(p) != want["sha256"]:
            return f"its file {rel} is corrupted (it does not match its SHA-256 checksum)"
    return None


class Checkpointer:
    """Orbax ``CheckpointManager`` of ``{"state": pytree, "meta": json}`` (synchronous saves).

    ``max_to_keep`` is orbax's own pruning, off by default: the harness prunes with ``prune``.
    """

    def __init__(self, directory: Path, max_to_keep: int | None = None) -> None:
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = Path(directory).absolute()
        extra: dict[str, Any] = {}
        if jax.distributed.is_initialized() and jax.process_count() > 1:
            # a multi-process run: process 0 alone writes host copies of the whole state
            # (fp4jax.train.processes), so orbax must not wait for the other processes
            pid = jax.process_index()
            self.directory.mkdir(parents=True, exist_ok=True)
            extra["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
                primary_host=pid, active_processes={pid})
        self.mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, create=not extra, enable_async_checkpointing=False,
                **extra),
        )

    def all_steps(self) -> list[int]:
        return sorted(self.mngr.all_steps())

    def latest_step(self) -> int | None:
        return self.mngr.latest_step()

    def save(self, step: int, state: Any, meta: dict, checksum: dict | None = None) -> None:
        """Saves ``state`` with ``meta`` plus ``"checksum"`` (``state_checksum(state)`` unless
        given, e.g. computed from host arrays the caller already has)."""
        a = self._ocp.args
        meta = {**meta, "checksum": checksum or state_checksum(state)}
        self.mngr.save(step, args=a.Composite(state=a.StandardSave(state), meta=a.JsonSave(meta)),
                       force=True)
        self.mngr.wait_until_finished()
        d = self.directory / str(step)
        tmp = d / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps({"algorithm": "sha256", "files": file_manifest(d)}))
        os.replace(tmp, d / MANIFEST)

    def meta(self, step: int) -> dict:
        a = self._ocp.args
        return dict(self.mngr.restore(step, args=a.Composite(meta=a.JsonRestore())).meta)

    def restore(self, step: int, target: Any) -> Any:
        a = self._ocp.args
        return self.mngr.restore(step, args=a.Composite(state=a.StandardRestore(target))).state

    def restore_verified(self, step: int, target: Any,
                         check_meta: Callable[[dict], None] | None = None
                         ) -> tuple[Any, dict, str | None]:
        """Restores checkpoint ``step`` and verifies it: ``(state, meta, note)``, where
        ``note`` says when there was nothing to verify against (a checkpoint written before
        checksums were kept). ``check_meta(meta)`` runs between reading the metadata and
        restoring the arrays (its exceptions pass through: a config that differs is not
        damage).

        Raises:
          CheckpointDamaged: the metadata does not read, the arrays do not restore, or their
            bytes differ from the recorded checksum.
        """
        note = None
        d = self.directory / str(step)
        if (d / MANIFEST).exists():
            try:
                recorded = json.loads((d / MANIFEST).read_text())["files"]
                if not isinstance(recorded, dict) or not recorded:
                    raise ValueError("no files listed")
            except Exception as e:
                note = (f"checkpoint {step}: its file manifest {MANIFEST} does not read "
                        f"({_why(e, 80)}): checked by restoring it instead")
            else:
                problem = manifest_problem(d, recorded)
                if problem:
                    raise CheckpointDamaged(step, problem)
        else:
            note = (f"checkpoint {step} has no file manifest (written by an older fp4jax, or "
                    "cut short after its commit): checked by restoring it")
        try:
            meta = self.meta(step)
        except Exception as e:  # orbax/tensorstore/json raise many types
            raise CheckpointDamaged(step, f"its run metadata (meta/) does not read ({_why(e)})"
                                    ) from None
        if not isinstance(meta.get("config"), dict) or meta.get("step") != step:
            raise CheckpointDamaged(step, "its run metadata (meta/) lacks the config or the "
                                    f"step (keys: {sorted(meta)})")
        if check_meta is not None:
            check_meta(meta)
        try:
            with _quiet_unraisable():
                state = self.restore(step, target)
        except Exception as e:
            raise CheckpointDamaged(step, f"its arrays (state/) do not restore ({_why(e)})"
                                    ) from None
        expected = meta.get("checksum")
        if not isinstance(expected, dict) or "sha256" not in expected:
            return state, meta, (f"checkpoint {step} records no checksum (written by an older "
                                 "fp4jax): its arrays were not verified")
        got = state_checksum(state)
        if got["sha256"] != expected["sha256"]:
            exp = expected.get("arrays", {})
            bad = [k for k in sorted(set(exp) | set(got["arrays"]))
                   if exp.get(k) != got["arrays"].get(k)]
            raise CheckpointDamaged(
                step, f"its arrays (state/) do not match their SHA-256 checksum ({len(bad)} of "
                f"{len(got['arrays'])} differ: {', '.join(bad[:3])}{', ...' if bad[3:] else ''})")
        return state, meta, note

    def delete(self, step: int) -> None:
        self.mngr.delete(step)

    def prune(self, keep: int, protect: int | None = None) -> list[int]:
        """Deletes all but the newest ``keep`` checkpoints and ``protect`` (the newest one
        known to be good); returns the deleted steps."""
        steps = self.all_steps()
        kept = set(steps[-keep:]) | {protect}
        gone = [s for s in steps if s not in kept]
        for s in gone:
            self.mngr.delete(s)
        return gone

    def set_aside(self, step: int, dest: Path) -> Path:
        """Moves checkpoint ``step`` out of the manager's directory to ``dest/<step>`` (a free
        name), keeping it for inspection; returns where it went."""
        dest.mkdir(parents=True, exist_ok=True)
        path, k = dest / str(step), 1
        while path.exists():
            path, k = dest / f"{step}-{k}", k + 1
        os.rename(self.directory / str(step), path)
        self.mngr.reload()
        return path

    def close(self) -> None:
        self.mngr.close()


def _effective(config: dict, run_keys: Mapping[str, Any] | None = None) -> dict:
    """``config`` with the run-level keys of its recipe spec applied (``split_run_spec``, or
    ``run_keys`` where the caller parsed the spec already): what the run used, so a flag
    that the spec overrides is no difference."""
    if run_keys is None:
        try:
            _, run_keys = split_run_spec(config.get("recipe", ""))
        except (ValueError, TypeError):
            return config
    return {**config, **run_keys}


def config_diff(saved: dict, current: dict, run_keys: Mapping[str, Any] | None = None
                ) -> list[str]:
    """Keys (outside ``RESUMABLE_KEYS``) whose values differ, as ``key: saved -> current``;
    both configs as the run used them (a spec's run-level keys applied). ``run_keys``: the
    run-level keys of ``current``'s spec, parsed already (``RunPlan.run_keys``; None: parse
    it); a saved spec of the same text takes them too, so a resume parses no spec."""
    same = run_keys is not None and saved.get("recipe") == current.get("recipe")
    saved = _effective(saved, run_keys if same else None)
    current = _effective(current, run_keys)
    keys = sorted((set(saved) | set(current)) - RESUMABLE_KEYS)
    # a key absent from an older checkpoint's config had its default value then
    default = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    return [f"{k}: {saved.get(k, default.get(k))!r} -> {current.get(k)!r}" for k in keys
            if saved.get(k, default.get(k)) != current.get(k)]


def _note(msg: str) -> None:
    print(f"fp4jax-train: {msg}", file=sys.stderr, flush=True)


# keys a record of each type must have (besides "type" and "step")
_RECORD_KEYS = {"train": ("loss",), "eval": ("val_loss",), "stats": ("layers",),
                "checkpoint": ("seconds",), "grad_noise": ("ratio", "layers"),
                "switch": ("mode",), "bf16_layers": ("layers",)}


def _record_problem(raw: bytes) -> tuple[dict | None, str | None]:
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"
    if not isinstance(rec, dict) or not isinstance(rec.get("type"), str):
        return None, "not a JSON object with a type"
    if not isinstance(rec.get("step"), int):
        return None, "no integer step"
    missing = [k for k in _RECORD_KEYS.get(rec["type"], ()) if k not in rec]
    if missing:
        return None, f"a {rec['type']} record without {', '.join(missing)}"
    return rec, None


def read_metrics(path: Path, note: Callable[[str], None] = _note) -> list[tuple[str, dict]]:
    """The records of ``metrics.jsonl`` as ``(line, record)``; blank lines are skipped.

    A damaged final record (a write cut short by a crash or a full disk) is dropped, and
    ``note`` says so.

    Raises:
      ValueError: a damaged record before the last one (naming the file and the line).
    """
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    out = []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        rec, problem = _record_problem(raw)
        if rec is not None:
            out.append((raw.decode("utf-8"), rec))
            continue
        shown = raw[:60].decode("utf-8", "backslashreplace") + ("..." if raw[60:] else "")
        if all(not x.strip(b" \t\r\x00") for x in lines[i + 1:]):
            note(f"{path}: dropped a torn final record (line {i + 1}: {problem}: {shown!r}), "
                 "as left by an interrupted write")
            break
        raise ValueError(f"{path}, line {i + 1}: damaged record ({problem}): {shown!r}; only "
                         "the last line may be torn: repair or delete that line, then resume")
    return out


def truncate_metrics(path: Path, ckpt_step: int,
                     note: Callable[[str], None] = _note) -> None:
    """Drops records newer than the checkpoint being resumed from (and a torn final record);
    rewrites the file atomically."""
    if not path.exists():
        return
    keep = []
    for line, rec in read_metrics(path, note):
        limit = ckpt_step if rec.get("type") in ("eval", "resume", "checkpoint") else ckpt_step - 1
        if rec.get("step", 0) <= limit:
            keep.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(x + "\n" for x in keep))
    os.replace(tmp, path)


def history_from_metrics(path: Path) -> dict[str, list]:
    """The loss curves recorded in ``metrics.jsonl`` (train losses at ``--log-every``
    resolution), to seed a resumed run's history."""
    history: dict[str, list] = {"step": [], "loss": [], "val_step": [], "val_loss": []}
    for _, rec in read_metrics(path):
        if rec.get("type") == "train":
            history["step"].append(rec["step"])
            history["loss"].append(rec["loss"])
        elif rec.get("type") == "eval":
            history["val_step"].append(rec["step"])
            history["val_loss"].append(rec["val_loss"])
    return history


def restore_newest(ckpt: Checkpointer, target: Any, cfg_dict: dict, overrides: list[str],
                   data_sha: str, out: Path, model_sha: str | None = None,
                   run_keys: Mapping[str, Any] | None = None
                   ) -> tuple[Any, dict, list[CheckpointDamaged]]:
    """Restores the newest checkpoint that restores completely (metadata, arrays, checksum)
    after checking that its config and data fingerprint match ``cfg_dict`` and ``data_sha``
    and its model-code fingerprint ``model_sha`` (``--model``/``--rules`` files; None: not
    checked) the run's (keys in ``overrides`` may differ, ``"model"`` the code; ``run_keys``:
    ``config_diff``'s, the run-level keys of ``cfg_dict``'s spec); damaged
    newer checkpoints are moved to ``OUT/checkpoints.damaged/`` and reported. Returns
    ``(state, meta, damaged)``.

    Raises:
      ValueError: a changed config or corpus, or no checkpoint that restores.
    """
    where = ckpt.directory

    def check_meta(meta: dict) -> None:
        # with a recorded fingerprint the corpus is checked by content: its path may change
        free = [*overrides, *(["data"] if meta.get("data_sha256") else [])]
        free += ["tokenizer"] if "data" in free else []  # the fingerprint covers it
        diff = config_diff({**meta["config"], **{k: cfg_dict[k] for k in free}}, cfg_dict,
                           run_keys)
        if diff:
            raise ValueError("refusing to resume with a changed config; differing keys: "
                             + "; ".join(diff) + f" (only {list(OVERRIDABLE_KEYS)} can change, "
                             "named in --resume-override)")
        code = meta.get("model_sha256")
        if code is not None and model_sha is not None and code != model_sha \
                and "model" not in overrides:
            raise ValueError(
                f"refusing to resume: the --model code or --rules file differs from that of "
                f"checkpoint {meta['step']} (SHA-256 {code[:12]}... then, {model_sha[:12]}... "
                f"now; --model {cfg_dict.get('model')!r}, --rules {cfg_dict.get('rules')!r}): "
                "resume with the files the run started with, or pass --resume-override "
                "model to continue with these (a model of other parameter shapes cannot)")
        saved = meta.get("data_sha256")
        if saved is not None and saved != data_sha and "data" not in overrides:
            raise ValueError(
                f"refusing to resume: the training data differ from those of checkpoint "
                f"{meta['step']} (corpus, split or tokenizer: SHA-256 {saved[:12]}... then, "
                f"{data_sha[:12]}... now; --data {cfg_dict['data']!r}, --val-fraction "
                f"{cfg_dict['val_fraction']}): resume on the data the run started with, or pass "
                "--resume-override data to continue on these (recorded in metrics.jsonl)")

    damaged: list[CheckpointDamaged] = []
    steps = ckpt.all_steps()
    for c in reversed(steps):
        try:
            state, meta, note = ckpt.restore_verified(c, target, check_meta)
            if int(state["step"]) != c:
                raise CheckpointDamaged(c, f"it holds the state of step {int(state['step'])}")
        except CheckpointDamaged as e:
            damaged.append(e)
            continue
        for e in damaged:
            moved = ckpt.set_aside(e.step, out / "checkpoints.damaged")
            _note(f"{e}; moved it to {moved}")
        if damaged:
            _note(f"resuming from checkpoint {c}, the newest in {where} that restores completely")
        if note:
            _note(note)
        return state, meta, damaged
    if not steps:
        raise ValueError(f"--resume: no checkpoint in {where}: nothing to resume; start a fresh "
                         "run without --resume (with --overwrite if --out holds an earlier run, "
                         "which moves it aside)")
    raise ValueError(
        f"--resume: no checkpoint in {where} restores completely ("
        + "; ".join(str(e) for e in damaged) + "). Options: start afresh with --overwrite "
        f"(moves this run aside to {out}.old-<time>), or put back an intact copy of "
        f"{where} and resume again")


@dataclasses.dataclass
class Resumed:
    """What ``RunCheckpoints.resume`` restored: the ``state``, its ``step``, the checkpoint's
    ``meta``, the config keys it overrode (``{key: [then, now]}``) and the damaged newer
    checkpoints it set aside."""

    state: Any
    step: int
    meta: dict | None
    overridden: dict[str, list]
    damaged: list[CheckpointDamaged]


class RunCheckpoints:
    """The checkpoints of one run in ``OUT/checkpoints`` (process 0 reads and writes them;
    ``ckpt`` is None elsewhere and where orbax-checkpoint is not installed): opening the run
    directory, saving a checked state, resuming, and what to keep after a divergence.

    Args:
      out: the run directory.
      keep: ``--keep-checkpoints``.
      main: whether this is process 0.
    """

    def __init__(self, out: Path, keep: int, main: bool) -> None:
        self.out, self.keep, self.main = Path(out), keep, main
        self.ckpt: Checkpointer | None = None

    def open(self, cfg: TrainConfig) -> None:
        """Process 0: checks the log of a resumed run, claims ``OUT`` for a fresh one
        (``--overwrite`` moves an earlier run aside), opens ``OUT/checkpoints``."""
        from fp4jax.train.rundir import claim_out, lock_out

        if cfg.resume:  # a damaged log stops before any change
            read_metrics(self.out / "metrics.jsonl", note=lambda _: None)
        else:
            claim_out(cfg)
        self.out.mkdir(parents=True, exist_ok=True)
        lock_out(self.out)  # a second writer is refused (released when train returns)
        try:
            self.ckpt = Checkpointer(self.out / "checkpoints")
        except ImportError:  # orbax-checkpoint is optional: train without checkpoints
            print("fp4jax-train: orbax-checkpoint is not installed: no checkpoints will be "
                  "written (pip install orbax-checkpoint)", file=sys.stderr)

    def resume(self, state: Any, cfg_dict: dict, overrides: list[str], data_sha: str,
               check: Callable[[dict], None], model_sha: str | None = None,
               run_keys: Mapping[str, Any] | None = None) -> Resumed:
        """Restores the newest good checkpoint into the layout of ``state`` (several
        processes: process 0 restores host arrays and broadcasts them); ``check(meta)`` runs
        on process 0 after the restore (its errors stop every process); ``run_keys``: the
        run-level keys of ``cfg_dict``'s spec, parsed already (``restore_newest``).

        Raises:
          ValueError: see ``restore_newest``; no orbax-checkpoint.
        """
        multi = processes.count() > 1
        host_target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), state) if multi else None
        found: dict[str, Any] = {"meta": None, "overridden": {}, "damaged": []}

        def restore() -> Any:
            if self.ckpt is None:
                raise ValueError("--resume needs orbax-checkpoint (pip install "
                                 "orbax-checkpoint)")
            restored, meta, found["damaged"] = restore_newest(
                self.ckpt, host_target if multi else state, cfg_dict, overrides, data_sha,
                self.out, model_sha, run_keys)
            saved_cfg = meta["config"]
            overridden = {k: [saved_cfg.get(k), cfg_dict[k]] for k in overrides
                          if saved_cfg.get(k) != cfg_dict[k]}
            saved_sha = meta.get("data_sha256")
            if "data" in overrides and saved_sha not in (None, data_sha):
                overridden["data_sha256"] = [saved_sha, data_sha]
            found["meta"], found["overridden"] = meta, overridden
            check(meta)
            return restored

        restored = processes.on_main(restore, template=host_target, what="restoring --resume")
        if multi:  # host arrays -> the state's layout over every process's devices
            restored = jax.tree.map(lambda h, d: jax.make_array_from_callback(
                h.shape, d.sharding, lambda idx, h=h: h[idx]), restored, state)
        step = int(processes.host_value(restored["step"]))
        return Resumed(restored, step, found["meta"], found["overridden"], found["damaged"])

    def drop_bad(self, s: int) -> str:
        """Deletes checkpoints whose parameters give the non-finite step ``s`` (checkpoint
        ``s`` itself: step ``s`` starts from it) and says which checkpoint is good."""
        if not self.main:
            return "process 0 says which checkpoint is good"
        ckpt = self.ckpt
        if ckpt is None:
            return "no checkpoints are written (orbax-checkpoint is not installed)"
        bad = [c for c in ckpt.all_steps() if c >= s]
        for c in bad:
            ckpt.delete(c)
        good = [c for c in ckpt.all_steps() if c < s]
        dropped = f" (deleted checkpoint {bad[0]}: step {s} starts from it)" if bad else ""
        rerun = ("resuming unchanged repeats the divergence exactly; resume with a change, e.g. "
                 "--resume --resume-override lr --lr SMALLER (overridable: "
                 f"{', '.join(OVERRIDABLE_KEYS)}), or retrain with a lower --lr or more blocks in "
                 "BF16 (--first-bf16/--last-bf16)")
        if not good:
            return (f"No good checkpoint was saved{dropped}; retrain with a lower --lr or more "
                    "blocks in BF16 (--first-bf16/--last-bf16)")
        c = max(good)
        return (f"Last good checkpoint: {c} (the state before step {c}) in "
                f"{self.out / 'checkpoints'}{dropped}; {rerun}")

    def save(self, s: int, state: Any, meta: dict, log: Any) -> None:
        """Checks that ``state`` (the state before step ``s``) is finite, then checkpoints it
        with ``meta`` (``{"config", "step": s, "data_sha256", ...}``) and its checksum, and
        prunes: the newest ``keep`` stay, and the newest older one, known good (its step
        gave a finite loss) until this one is. ``log``: the run's ``RunLog`` (a
        ``"checkpoint"`` record; the time kept out of tokens/s).

        Raises:
          TrainingDiverged: a non-finite array (no checkpoint written).
          OSError: the checkpoint could not be written.
        """
        t0 = time.perf_counter()
        host = processes.host_value(state)  # checked below, then saved as it is (one copy)
        leaves = host_leaves(host)
        bad = nonfinite_leaves(leaves)
        if bad:
            raise log.diverged(
                {"step": s, "nonfinite": bad},
                f"the state became non-finite in step {s - 1} (0-based; NaN or Inf in "
                f"{len(bad)} arrays: {', '.join(bad[:3])}{', ...' if bad[3:] else ''}); "
                "stopped, not checkpointed.", s, s - 1)

        def write_checkpoint() -> None:
            ckpt = self.ckpt
            if ckpt is None:
                return
            try:
                ckpt.save(s, host, meta, checksum=state_checksum(leaves))
            except Exception as e:
                raise OSError(
                    f"checkpoint {s} could not be written to {ckpt.directory} ({e}); the "
                    "checkpoints before it are intact: free the space or fix the folder, then "
                    "rerun with --resume") from e
            ckpt.prune(self.keep, max((c for c in ckpt.all_steps() if c < s), default=None))
            # the training stall of this checkpoint (synchronous: device-to-host copy,
            # finiteness check, checksum, write, prune), kept out of tokens/s. Writing in a
            # background thread was measured and made training slower (docs/performance.md).
            log.write({"type": "checkpoint", "step": s, "seconds": time.perf_counter() - t0})

        processes.on_main(write_checkpoint, what=f"writing checkpoint {s}")
        log.pause(time.perf_counter() - t0)

    def finish(self) -> None:
        """The run ended good: prunes to the newest ``keep``."""
        if self.ckpt is not None:
            self.ckpt.prune(self.keep)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
