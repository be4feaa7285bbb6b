"""No lost runs and no silent corruption (issue 16): the training harness refuses to destroy a
run, verifies what it resumes from, falls back past damaged checkpoints, tolerates a torn
metrics record, treats a non-finite final state as a divergence, refuses a changed corpus and
senseless flags, and prunes checkpoints by a documented rule. Micro preset, BF16, on CPU; the
runs share one optimizer schedule (and so their compiled steps) with tests/train/test_train.py."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from fp4jax import train as T
from tests.checks import nan_loss_from, patch_train_step, run_records
from tests.textdata import write_text

BASE = dict(preset="micro", recipe="bf16", steps=30, lr=1e-2, batch_size=8, seq_len=64,
            eval_every=0, eval_batches=2, log_every=1, warmup_steps=3, progress=False)
CLI = ["--preset", "micro", "--recipe", "bf16", "--steps", "30", "--lr", "0.01",
       "--batch-size", "8", "--seq-len", "64", "--eval-every", "0", "--eval-batches", "2",
       "--log-every", "1", "--warmup-steps", "3", "--no-progress", "--compile-cache", "auto"]


pytestmark = pytest.mark.usefixtures("keep_compile_cache")  # conftest


@pytest.fixture(scope="session")  # once per worker: other modules' tests run between
def base(tmp_path_factory):
    """One interrupted run (steps 0-5 of 30, checkpoints 2, 4, 6) on its own corpus; tests
    work on copies of it."""
    root = tmp_path_factory.mktemp("base")
    corpus = write_text(root / "corpus.txt", 60_000)
    cfg = T.TrainConfig(**BASE, data=str(corpus), out=str(root / "run"), stop_at=6,
                        checkpoint_every=2)
    result = T.train(cfg)
    return cfg, result


def _copy(base, tmp_path, **changes):
    """A copy of the base run under ``tmp_path`` (same corpus); its config."""
    cfg, _ = base
    shutil.copytree(cfg.out, tmp_path / "run")
    return cfg.replace(out=str(tmp_path / "run"), **changes)


def _train_losses(out):
    return {r["step"]: r["loss"] for r in run_records(out) if r["type"] == "train"}


def _steps(out):
    return sorted(int(p.name) for p in (Path(out) / "checkpoints").iterdir() if p.name.isdigit())


def _cli(args, out):
    return T.main([*CLI, *args, "--out", str(out)])


# 1. A repeated command never destroys a run ---------------------------------------------------

def test_repeated_command_refused_and_overwrite_moves_aside(base, tmp_path, capsys):
    cfg = _copy(base, tmp_path)
    out = Path(cfg.out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    # the Python API: a fresh run into a directory that holds one is refused, nothing changes
    with pytest.raises(ValueError, match=r"already holds a run .*--resume.*--overwrite"):
        T.train(cfg)
    with pytest.raises(T.RunExists, match="already holds a run"):  # also a FileExistsError
        T.train(cfg.replace(stop_at=None))
    # the CLI: a one-line error naming --resume and --overwrite (exit status 2)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        _cli(["--data", cfg.data, "--stop-at", "6"], out)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume" in err[0] and "--overwrite" in err[0], err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # --compare sub-runs: refused before anything trains (a finished sub-run in OUT/bf16)
    shutil.copytree(out, tmp_path / "cmp" / "bf16")
    with pytest.raises(T.RunExists, match=r"bf16.*already holds a run"):
        T.compare(cfg.replace(out=str(tmp_path / "cmp"), stop_at=2), ["nvfp4", "bf16"])
    assert not (tmp_path / "cmp" / "nvfp4").exists()
    # --overwrite moves the earlier run aside (kept whole) and starts afresh
    assert _cli(["--data", cfg.data, "--stop-at", "2", "--overwrite"], out) == 0
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(moved) == 1 and "moved the earlier run" in capsys.readouterr().err
    assert {moved[0] / p.relative_to(out): b for p, b in before.items()} == {
        p: p.read_bytes() for p in moved[0].rglob("*") if p.is_file()}
    assert _steps(out) == [2] and max(_train_losses(out)) == 1
    with pytest.raises(T.ConfigError, match="overwrite"):  # one or the other
        cfg.replace(resume=True, overwrite=True)


# 2. Resume verifies checkpoints and falls back past damaged ones ------------------------------

def _largest_data_file(ckpt_dir):
    files = [p for p in (ckpt_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    return max(files, key=lambda p: p.stat().st_size)


def _flip_bit(path):
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0x10
    path.write_bytes(bytes(b))


def _truncate(path):
    os.truncate(path, path.stat().st_size // 2)


DAMAGE = {
    "truncated array file": (lambda d: _truncate(_largest_data_file(d)), r"is truncated"),
    "truncated run metadata": (lambda d: _truncate(d / "meta" / "metadata"), r"is truncated"),
    "empty tree metadata": (lambda d: (d / "state" / "_METADATA").write_bytes(b""),
                            r"state/_METADATA is truncated"),
    "flipped bit": (lambda d: _flip_bit(_largest_data_file(d)), r"SHA-256 checksum"),
    # without its file manifest the checkpoint restores, and the arrays' checksum catches it
    "flipped bit, no manifest": (
        lambda d: ((d / "fp4jax_files.json").unlink(), _flip_bit(_largest_data_file(d))),
        r"arrays \(state/\) do not (match their SHA-256 checksum|restore)"),
}


def test_resume_falls_back_past_damaged_checkpoint(base, tmp_path, capsys):
    _, result = base
    want = result["history"]["loss"]
    for i, (kind, (damage, how)) in enumerate(DAMAGE.items()):
        cfg = _copy(base, tmp_path / str(i), resume=True)
        damage(Path(cfg.out) / "checkpoints" / "6")
        capsys.readouterr()
        r = T.train(cfg)  # steps 4 and 5 again, from checkpoint 4
        err = capsys.readouterr().err
        assert re.search(r"checkpoint 6 is damaged: .*" + how, err), (kind, err)
        assert "resuming from checkpoint 4, the newest" in err, (kind, err)
        assert r["history"]["loss"] == want, kind  # exact, as from an intact checkpoint
        assert _steps(cfg.out) == [2, 4, 6]
        assert (Path(cfg.out) / "checkpoints.damaged" / "6").is_dir()  # kept for inspection
        resume = [x for x in run_records(cfg.out) if x["type"] == "resume"]
        assert list(resume[0]["damaged_checkpoints"]) == ["6"], kind
    # no checkpoint restores: stop, naming each damage and the options
    cfg = _copy(base, tmp_path / "all", resume=True)
    for c in (2, 4, 6):
        (Path(cfg.out) / "checkpoints" / str(c) / "state" / "_METADATA").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no checkpoint .* restores completely \(checkpoint 6 "
                       r"is damaged: .*checkpoint 2 is damaged.*Options: .*--overwrite"):
        T.train(cfg)
    assert _steps(cfg.out) == [2, 4, 6]  # nothing moved when there is nothing to resume


# 3. A torn final metrics record is dropped; a damaged record before it names file and line ----

def test_torn_metrics_record(base, tmp_path, capsys):
    cfg = _copy(base, tmp_path / "torn", resume=True, stop_at=8)
    path = Path(cfg.out) / "metrics.jsonl"
    full = path.read_bytes()
    # a crash (or a full disk) in the middle of writing the record of step 6
    path.write_bytes(full + b'{"type": "train", "step": 6, "loss": 4.1')
    capsys.readouterr()
    r = T.train(cfg)
    err = capsys.readouterr().err
    line = len(full.splitlines()) + 1
    assert re.search(rf"metrics\.jsonl: dropped a torn final record \(line {line}:", err), err
    assert path.read_bytes().startswith(full)
    assert r["history"]["step"] == list(range(8))
    assert r["history"]["loss"][:6] == base[1]["history"]["loss"]
    cfg = _copy(base, tmp_path / "middle", resume=True)
    path = Path(cfg.out) / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:20]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl, line 3: damaged record"):
        T.train(cfg)
    assert _steps(cfg.out) == [2, 4, 6]


# 4. A non-finite final state or validation loss is a divergence -------------------------------

def _poison_last_update(monkeypatch, at):
    """Step ``at`` returns NaN parameters (its own loss, from the parameters before, is fine)."""
    def change(s, new, m):
        if s == at:
            new = dict(new, params=jax.tree.map(lambda x: x * np.nan, new["params"]))
        return new, m

    patch_train_step(monkeypatch, change)


def test_nan_at_final_step_is_divergence(base, tmp_path, monkeypatch, capsys):
    # the CLI, a 4-step run: its last step makes the parameters NaN, so the final validation
    # loss is NaN: exit status 1, no checkpoint 4, result.json says diverged
    corpus = base[0].data
    _poison_last_update(monkeypatch, 3)
    out = tmp_path / "cli"
    args = ["--data", corpus, "--steps", "4", "--checkpoint-every", "2", "--eval-every", "2"]
    capsys.readouterr()
    assert T.main([*CLI, *args, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert re.search(r"validation loss became nan at step 4 .*Last good checkpoint: 2", err), err
    assert _steps(out) == [2]
    res = json.loads((out / "result.json").read_text())
    assert res["status"] == "diverged" and res["final_val_loss"] is None
    assert {"type": "diverged", "step": 4} == {k: v for k, v in run_records(out)[-1].items()
                                               if k in ("type", "step")}
    # the Python API with --stop-at (no evaluation at the end): the state itself is checked
    _poison_last_update(monkeypatch, 5)
    cfg = T.TrainConfig(**BASE, data=corpus, out=str(tmp_path / "api"), stop_at=6,
                        checkpoint_every=2)
    with pytest.raises(T.TrainingDiverged, match=r"state became non-finite in step 5 .*params/"):
        T.train(cfg)
    assert _steps(cfg.out) == [2, 4]
    assert json.loads((tmp_path / "api" / "result.json").read_text())["status"] == "diverged"


# 6. Resuming on a changed corpus is refused unless --resume-override data ---------------------

def test_resume_refuses_changed_corpus(base, tmp_path):
    corpus = tmp_path / "corpus.txt"
    shutil.copy(base[0].data, corpus)
    cfg = base[0].replace(data=str(corpus), out=str(tmp_path / "run"), stop_at=2)
    first = T.train(cfg)
    with open(corpus, "a") as f:
        f.write("One more line of verse, appended after the run started.\n")
    cfg = cfg.replace(resume=True, stop_at=4)
    with pytest.raises(ValueError, match=r"training data differ .*--resume-override data"):
        T.train(cfg)
    assert first["data_sha256"] == base[1]["data_sha256"]  # a content fingerprint
    r = T.train(cfg.replace(resume_override="data"))
    rec = [x for x in run_records(cfg.out) if x["type"] == "resume"][0]
    assert rec["overrides"] == {"data_sha256": [first["data_sha256"], r["data_sha256"]]}
    assert r["data_sha256"] != first["data_sha256"] and len(r["history"]["loss"]) == 4
    # the corpus may move: with the same content its path is free to change
    moved = tmp_path / "moved.txt"
    shutil.copy(corpus, moved)
    assert len(T.train(cfg.replace(data=str(moved), stop_at=6))["history"]["loss"]) == 6


# 7. Senseless flags: argparse's one-line error naming the flag; ValueError in the Python API --

@pytest.mark.parametrize("args, flag", [
    (["--lr", "-1"], "--lr"), (["--lr", "nan"], "--lr"), (["--lr", "inf"], "--lr"),
    (["--log-every", "0"], "--log-every"), (["--batch-size", "0"], "--batch-size"),
    (["--eval-batches", "0"], "--eval-batches"), (["--steps", "0"], "--steps"),
    (["--steps", "-3"], "--steps"), (["--seq-len", "1"], "--seq-len"),
    (["--val-fraction", "0"], "--val-fraction"), (["--val-fraction", "1"], "--val-fraction"),
    (["--val-fraction", "1.5"], "--val-fraction"), (["--compare", ","], "--compare"),
    (["--compare", "bf16,bf16"], "--compare"), (["--keep-checkpoints", "0"], "--keep-checkpoints"),
    (["--stop-at", "-1"], "--stop-at"), (["--beta2", "1"], "--beta2"),
    (["--clip-norm", "0"], "--clip-norm"), (["--dtype", "int8"], "--dtype"),
    (["--resume", "--overwrite"], "--overwrite"), (["--out", "FILE"], "--out"),
    (["--out", "FILE/sub"], "--out"), (["--data", ""], "--data"),
    (["--warmup-steps", "-1"], "--warmup-steps"), (["--switch-at", "1.5"], "--switch-at"),
    (["--scan-remat", "dots"], "--scan-remat"),  # without --scan-layers
])
def test_cli_rejects_senseless_flags(args, flag, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("not a directory")
    args = [str(tmp_path / "file.txt") if a == "FILE" else
            str(tmp_path / "file.txt" / "sub") if a == "FILE/sub" else a for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as e:
        T.main([*args, *out, "--no-progress", "--compile-cache", "off"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"fp4jax-train: error: argument {flag}: "), err
    assert "Traceback" not in "\n".join(err)


def test_config_values_are_checked_in_python(tmp_path):
    for field, value in [("lr", -1.0), ("log_every", 0), ("seq_len", 1), ("val_fraction", 0.0),
                         ("steps", 0), ("eval_batches", 0), ("compare", ","),
                         ("keep_checkpoints", 0), ("batch_size", 2.5),
                         ("scan_remat", "some")]:
        with pytest.raises(ValueError, match=rf"TrainConfig\.{field} "):
            T.TrainConfig(**{field: value})
    # --scan-remat reaches the model; not given, the model's default ("dots") applies
    assert T.model_config(T.TrainConfig(scan_layers=True, scan_remat="full")).scan_remat == "full"
    assert T.model_config(T.TrainConfig(scan_layers=True)).scan_remat == "dots"
    (tmp_path / "f").write_text("x")
    with pytest.raises(T.ConfigError, match=r"is a file") as e:
        T.train(T.TrainConfig(**BASE, out=str(tmp_path / "f")))
    assert e.value.field == "out" and e.value.flag == "--out"


# 8. Checkpoints are pruned to the newest --keep-checkpoints, never the only good one ----------

def test_keep_checkpoints(base, tmp_path, monkeypatch):
    corpus = base[0].data
    assert _steps(base[0].out) == [2, 4, 6]  # default: 3 kept
    cfg = T.TrainConfig(**BASE, data=corpus, out=str(tmp_path / "two"), stop_at=5,
                        checkpoint_every=1, keep_checkpoints=2)
    T.train(cfg)
    assert _steps(cfg.out) == [4, 5]
    # keep 1: checkpoint 4 is saved (pruning keeps 2, the newest known good) and its step
    # diverges: checkpoint 4 goes, 2 stays
    nan_loss_from(monkeypatch, 4)
    cfg = cfg.replace(out=str(tmp_path / "one"), checkpoint_every=2, keep_checkpoints=1)
    with pytest.raises(T.TrainingDiverged, match="Last good checkpoint: 2"):
        T.train(cfg)
    assert _steps(cfg.out) == [2]
    assert "--keep-checkpoints" in T.build_parser().format_help()


def test_deterministic_flag_sets_xla_flags_once_and_results_record_them(base, monkeypatch):
    """``--deterministic`` adds XLA's deterministic-ops flags (kept beside other flags, never
    twice); every result.json records the XLA flags the run had."""
    from fp4jax.train import cli

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nonexistent "
                       "--xla_gpu_enable_triton_gemm=false")
    cli.set_deterministic()
    cli.set_deterministic()
    assert os.environ["XLA_FLAGS"].split() == ["--xla_dump_to=/nonexistent",
                                               "--xla_gpu_enable_triton_gemm=false",
                                               "--xla_gpu_deterministic_ops=true"]
    monkeypatch.delenv("XLA_FLAGS")
    cli.set_deterministic()
    assert os.environ["XLA_FLAGS"].split() == list(cli.DETERMINISTIC_FLAGS)
    assert "--xla_gpu_deterministic_ops=true" in cli.DETERMINISTIC_FLAGS
    _, res = base
    assert "xla_flags" in res and isinstance(res["xla_flags"], str)
    assert json.loads((Path(base[0].out) / "result.json").read_text())["xla_flags"] == res[
        "xla_flags"]


def test_threefry_lowering_is_set_for_this_process_and_its_workers(base, monkeypatch):
    """``--threefry`` (``set_threefry_lowering``) sets JAX's flag here and the environment
    variable that worker processes' JAX reads; a bad mode is refused by name; every
    result.json records the lowering of its run."""
    from fp4jax.train import cli

    monkeypatch.delenv(cli.THREEFRY_ENV, raising=False)
    before = jax.config.jax_threefry_gpu_kernel_lowering
    try:
        cli.set_threefry_lowering("kernel")
        assert jax.config.jax_threefry_gpu_kernel_lowering is True
        assert os.environ[cli.THREEFRY_ENV] == "true" and cli.threefry_lowering() == "kernel"
        cli.set_threefry_lowering("xla")
        assert jax.config.jax_threefry_gpu_kernel_lowering is False
        assert os.environ[cli.THREEFRY_ENV] == "false" and cli.threefry_lowering() == "xla"
        with pytest.raises(ValueError, match="'cuda'.*kernel"):
            cli.set_threefry_lowering("cuda")
        with pytest.raises(SystemExit):  # argparse's choices, before anything runs
            cli.main(["--threefry", "cuda"])
    finally:
        jax.config.update("jax_threefry_gpu_kernel_lowering", before)
    _, res = base
    assert res["threefry_lowering"] in cli.THREEFRY_LOWERINGS
    # the CLI applies it on GPUs only: on this CPU main() leaves JAX's flag (and so every
    # jit cache key) alone, and sets the variable for its workers
    monkeypatch.delenv(cli.THREEFRY_ENV, raising=False)
    with pytest.raises(SystemExit):
        cli.main(["--threefry", "kernel", "--lr", "-1"])  # refused after the flag is read
    assert jax.config.jax_threefry_gpu_kernel_lowering is before
    assert os.environ[cli.THREEFRY_ENV] == "true"


def test_checkpoint_records_their_stall_and_survive_resume(base, tmp_path):
    """Each checkpoint writes a ``checkpoint`` record with the seconds the save stalled
    training (the measurement behind the checkpoint-stall question); resuming from a
    checkpoint keeps that checkpoint's record and drops the newer ones."""
    cfg, _ = base
    recs = [r for r in run_records(cfg.out) if r["type"] == "checkpoint"]
    assert [r["step"] for r in recs] == [2, 4, 6]
    assert all(isinstance(r["seconds"], float) and r["seconds"] > 0 for r in recs)
    run = _copy(base, tmp_path)
    shutil.rmtree(Path(run.out) / "checkpoints" / "6")
    T.train(run.replace(resume=True, stop_at=5))
    steps = [r["step"] for r in run_records(run.out) if r["type"] == "checkpoint"]
    assert steps[:2] == [2, 4] and 6 not in steps[:3]


def test_failed_checkpoint_write_stops_the_run_naming_it(base, tmp_path, monkeypatch, capsys):
    """A checkpoint that cannot be written (here: a full disk at step 4) stops the run with one
    line naming the checkpoint and the fix; the checkpoints before it stay intact and a
    resume continues from them."""
    from fp4jax.train import checkpoint as ck

    real = ck.Checkpointer.save

    def failing(self, step, state, meta, checksum=None):
        if step == 4:
            raise OSError(28, "No space left on device")
        return real(self, step, state, meta, checksum)

    monkeypatch.setattr(ck.Checkpointer, "save", failing)
    out = tmp_path / "run"
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        _cli(["--data", base[0].data, "--checkpoint-every", "2", "--stop-at", "6"], out)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"checkpoint 4 could not be written .*No space left.*--resume", err), err
    assert _steps(out) == [2]
    monkeypatch.setattr(ck.Checkpointer, "save", real)
    T.train(base[0].replace(out=str(out), resume=True, stop_at=4, checkpoint_every=2))
    assert _steps(out) == [2, 4]


def test_resumed_segments_record_their_own_xla_flags(base, tmp_path, monkeypatch):
    """A run resumed under other XLA flags (e.g. without ``--deterministic``) says so and
    result.json lists every segment's flags: the first part's and the resumption's."""
    cfg = _copy(base, tmp_path, stop_at=8)
    first = [r for r in run_records(cfg.out) if r["type"] == "segment"]
    assert [r["step"] for r in first] == [0]
    before = first[0]["xla_flags"]
    monkeypatch.setenv("XLA_FLAGS", before + " --xla_gpu_deterministic_ops=true")
    res = T.train(cfg.replace(resume=True))
    assert [s["step"] for s in res["segments"]] == [0, 6]
    assert res["segments"][0]["xla_flags"] == before
    assert res["segments"][1]["xla_flags"].endswith("--xla_gpu_deterministic_ops=true")
    assert res["xla_flags"] == res["segments"][1]["xla_flags"]
    # resumed again from its last checkpoint (8): the segment that started at 6 is kept
    res = T.train(cfg.replace(resume=True, stop_at=10))
    assert [s["step"] for s in res["segments"]] == [0, 6, 8]
