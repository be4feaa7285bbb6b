"""Ablation sweeps (issue 15, part 1): ``--compare`` takes recipe specs, ``--seeds`` trains every
spec with every seed (one compiled step per spec), ``compare.json``/``compare.md`` aggregate over
seeds, and a repeated sweep skips finished runs and resumes cut-off ones. Micro preset, BF16-like
specs, a few steps on CPU."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from fp4jax import train as T
from fp4jax.train import loop
from tests.textdata import write_text

CLI = ["--preset", "micro", "--steps", "4", "--lr", "0.01", "--batch-size", "4",
       "--seq-len", "32", "--eval-every", "2", "--eval-batches", "1", "--log-every", "1",
       "--warmup-steps", "1", "--checkpoint-every", "2", "--no-progress",
       "--compile-cache", "auto"]
SPECS = "bf16,bf16(name=twin)"  # two specs with the same numerics


pytestmark = pytest.mark.usefixtures("keep_compile_cache")  # conftest


def test_split_specs_and_slugs():
    assert T.split_specs("nvfp4,nvfp4(sr=False, rht=0),bf16") == [
        "nvfp4", "nvfp4(sr=False, rht=0)", "bf16"]
    nested = "nvfp4(fmt=BlockFormat(block_size=32, scale='e4m3')), mxfp4 ,"
    assert T.split_specs(nested) == ["nvfp4(fmt=BlockFormat(block_size=32, scale='e4m3'))",
                                     "mxfp4"]
    with pytest.raises(ValueError, match="unclosed"):
        T.split_specs("bf16,nvfp4(sr=False")
    assert T.slug("nvfp4(sr=False, rht=0)") == "nvfp4_sr-False_rht-0"
    assert T.slug("bf16") == "bf16"
    assert re.fullmatch(r"[A-Za-z0-9._+-]+", T.slug(nested))
    slugs = T.spec_slugs(["nvfp4(sr=False, rht=0)", "nvfp4(sr=False,rht=0)", "bf16"])
    assert len(set(slugs.values())) == 3 and slugs["bf16"] == "bf16"
    assert T.parse_seeds("0, 1,2") == [0, 1, 2]
    for bad in ("", "0,x", "1,1"):
        with pytest.raises(ValueError):
            T.parse_seeds(bad)


@pytest.mark.parametrize("args, flag, message", [
    (["--compare", "bf16,nvfp4(sr=False, bogus=1)"], "--compare", "unknown key 'bogus'"),
    (["--compare", "bf16,nvfp4(rht=0"], "--compare", "unclosed"),
    (["--compare", "nvfp4,nvfp4()"], "--compare", "more than once"),
    (["--recipe", "nvfp4(rht=zero)"], "--recipe", "recipe spec"),
    (["--seeds", "0,a"], "--seeds", "integers"),
])
def test_cli_bad_spec_or_seeds(args, flag, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        T.main([*args, "--out", str(tmp_path), "--no-progress", "--compile-cache", "off"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}:" in err and message in err, err


def test_recipe_spec_trains(tmp_path):
    """A spec reaches the model (``train`` parses it) and is recorded in result.json."""
    corpus = write_text(tmp_path / "c.txt", 20_000)
    cfg = T.TrainConfig(preset="micro", recipe="nvfp4(sr=False, rht=0)", steps=4, seq_len=32,
                        batch_size=4, eval_every=0, progress=False, stop_at=0,
                        data=str(corpus), out=str(tmp_path / "run"))
    r = T.train(cfg)
    assert r["spec"] == "nvfp4(sr=False, rht=0)" and r["recipe"] == "nvfp4"
    assert r["config"]["recipe"] == r["spec"] and "NVFP4" in r["policy"]


def _loss0(run: Path) -> float:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in recs if r["type"] == "train" and r["step"] == 0)


def test_sweep_two_specs_two_seeds_rerun_resume(tmp_path, monkeypatch, capsys):
    corpus = write_text(tmp_path / "c.txt", 20_000)
    out = tmp_path / "sweep"
    args = [*CLI, "--data", str(corpus), "--out", str(out), "--compare", SPECS,
            "--seeds", "0,1"]
    monkeypatch.setattr(loop, "_STEP_CACHE", {})  # count this sweep's compilations only
    before = dict(loop.TRACE_COUNTS)
    assert T.main(args) == 0
    traced = {k: loop.TRACE_COUNTS[k] - before[k] for k in before}
    # one compiled init, train and eval step per spec, shared by its two seeds
    assert traced == {"init": 2, "train": 2, "eval": 2, "stats": 0, "noise": 0}, (
        traced)
    assert capsys.readouterr().err.count("compiled steps reused") == 2  # the seed-1 runs

    runs = {(sp, s): out / d / f"seed{s}" for sp, d in
            (("bf16", "bf16"), ("bf16(name=twin)", "bf16_name-twin")) for s in (0, 1)}
    results = {k: json.loads((p / "result.json").read_text()) for k, p in runs.items()}
    for (sp, s), r in results.items():
        assert r["status"] == "finished" and r["spec"] == sp and r["seed"] == s
        assert r["config"]["recipe"] == sp and r["config"]["seed"] == s
    # the same data order (and init) per seed: the same-numerics specs agree, seeds differ
    for s in (0, 1):
        assert _loss0(runs["bf16", s]) == _loss0(runs["bf16(name=twin)", s])
        assert results["bf16", s]["final_val_loss"] == \
            results["bf16(name=twin)", s]["final_val_loss"]
    assert _loss0(runs["bf16", 0]) != _loss0(runs["bf16", 1])

    agg = json.loads((out / "compare.json").read_text())
    assert agg["baseline"] == "bf16"
    assert [(r["recipe"], r["seed"]) for r in agg["runs"]] == list(runs)
    for r in agg["runs"]:
        assert set(r) == {"recipe", "seed", "final_val_loss", "tokens_per_s", "out", "status"}
        assert r["final_val_loss"] == results[r["recipe"], r["seed"]]["final_val_loss"]
    for x in agg["summary"]:
        vals = [results[x["recipe"], s]["final_val_loss"] for s in (0, 1)]
        assert x["seeds"] == [0, 1] and x["n"] == 2
        assert x["mean"] == pytest.approx(np.mean(vals))
        assert x["std"] == pytest.approx(np.std(vals, ddof=1))
        assert x["gap_vs_baseline"] == pytest.approx(0.0)
        assert x["gap_exceeds_spread"] is False
    md = (out / "compare.md").read_text()
    assert "mean ± std" in md and "exceeds spread" in md and "| bf16(name=twin) |" in md
    assert (out / "compare.png").stat().st_size > 10_000

    # a repeated sweep retrains nothing
    mtimes = {k: (p / "result.json").stat().st_mtime_ns for k, p in runs.items()}
    capsys.readouterr()
    assert T.main(args) == 0
    err = capsys.readouterr().err
    assert err.count("finished: skipped") == 4, err
    assert {k: (p / "result.json").stat().st_mtime_ns for k, p in runs.items()} == mtimes

    # a cut-off run (no result, newest checkpoint lost) resumes from checkpoint 2, exactly
    cut = runs["bf16(name=twin)", 1]
    (cut / "result.json").unlink()
    ck = T.Checkpointer(cut / "checkpoints")
    ck.delete(4)
    ck.close()
    assert T.main(args) == 0
    err = capsys.readouterr().err
    assert err.count("finished: skipped") == 3 and f"{cut}: cut off: resuming" in err, err
    again = json.loads((cut / "result.json").read_text())
    assert again["status"] == "finished"
    assert again["final_val_loss"] == results["bf16(name=twin)", 1]["final_val_loss"]
    assert {k: (p / "result.json").stat().st_mtime_ns for k, p in runs.items()
            if p != cut} == {k: v for k, v in mtimes.items() if runs[k] != cut}

    # a run killed before its first checkpoint is moved aside (kept) and restarted
    dead = runs["bf16", 0]
    (dead / "result.json").unlink()
    shutil.rmtree(dead / "checkpoints")
    assert T.main(args) == 0
    err = capsys.readouterr().err
    assert f"{dead}: no checkpoint: moving it aside, restarting" in err, err
    assert len(list(dead.parent.glob("seed0.old-*"))) == 1
    assert json.loads((dead / "result.json").read_text())["final_val_loss"] == \
        results["bf16", 0]["final_val_loss"]

    # the same sweep with a changed config is refused, naming the differing key
    with pytest.raises(SystemExit) as e:
        T.main([*args[:-4], "--lr", "0.02", *args[-4:]])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "lr: 0.01 -> 0.02" in err, err


def test_run_level_spec_keys():
    """First/last BF16 blocks and the precision switch belong to a row of a table: a spec
    carries them, they are split from the recipe's keys and checked."""
    split = T.split_run_spec
    assert split("nvfp4") == ("nvfp4", {})
    assert split("nvfp4(sr=False, last_bf16=0)") == ("nvfp4(sr=False)", {"last_bf16": 0})
    assert split("mxfp4(switch_at=0.8, switch=fwd, first_bf16=1)") == (
        "mxfp4", {"switch_at": 0.8, "switch": "fwd", "first_bf16": 1})
    for bad, msg in [("nvfp4(switch=up)", "switch=up"), ("nvfp4(last_bf16=-2)", "last_bf16"),
                     ("nvfp4(first_bf16=0.5)", "first_bf16"),
                     ("nvfp4(switch_at=-0.1)", "switch_at"),
                     ("nvfp4(switch_at=1.5)", "switch_at"), ("nvfp4(foo=1)", "run-level keys"),
                     ("nvfp4(last_bf16=0, last_bf16=1)", "twice"),
                     ("nvx(last_bf16=0)", "unknown recipe 'nvx'")]:
        with pytest.raises(ValueError, match=re.escape(msg)):
            split(bad)
    with pytest.raises(T.ConfigError, match="switch_at"):
        T.TrainConfig(recipe="nvfp4(switch_at=2)")
    with pytest.raises(T.ConfigError, match="more than once"):
        T.TrainConfig(compare="nvfp4(last_bf16=0),nvfp4(rht=16, last_bf16=0)")
    T.TrainConfig(compare="nvfp4,nvfp4(last_bf16=0)")  # differ in a run-level key: fine
    for same in ("nvfp4,nvfp4(last_bf16=-1)", "nvfp4,nvfp4(switch=fwd)"):  # the same runs
        with pytest.raises(T.ConfigError, match="more than once"):
            T.TrainConfig(compare=same)
    # a flag that every spec overrides is no difference on resume or repeat
    a = dataclasses.asdict(T.TrainConfig(recipe="nvfp4(last_bf16=0)", last_bf16=2))
    b = dataclasses.asdict(T.TrainConfig(recipe="nvfp4(last_bf16=0)"))
    assert T.config_diff(a, b) == []
    c = dataclasses.asdict(T.TrainConfig(recipe="nvfp4", last_bf16=2))
    assert T.config_diff(c, dataclasses.asdict(T.TrainConfig(recipe="nvfp4"))) == [
        "last_bf16: 2 -> -1"]


def test_run_level_keys_reach_the_run(tmp_path):
    corpus = write_text(tmp_path / "c.txt", 20_000)
    spec = "nvfp4(sr=False, rht=0, last_bf16=0, switch_at=0.5, switch=bwd)"
    # CLI's schedule: the unswitched step is test_parallel_sweep_equals_sequential's
    # (compiled once per session)
    cfg = T.TrainConfig(preset="micro", recipe=spec, steps=4, seq_len=32, batch_size=4,
                        lr=0.01, warmup_steps=1, eval_every=0, eval_batches=1, log_every=1,
                        progress=False, data=str(corpus), out=str(tmp_path / "run"))
    r = T.train(cfg)
    assert r["spec"] == spec and r["config"]["last_bf16"] == -1  # the flag as given
    assert "BF16: lm_head" in r["policy"] and "block" not in r["policy"].split("BF16:")[1]
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    names = {rec["step"]: rec["recipe"] for rec in recs if rec["type"] == "train"}
    assert names[1] == "nvfp4" and names[2] == "nvfp4>bf16-bwd", names


@pytest.mark.heavy(112)
def test_parallel_sweep_equals_sequential(tmp_path):
    """``--jobs 3``: specs (and seeds, with more jobs than specs) in their own processes give
    the same bits as one process."""
    corpus = write_text(tmp_path / "c.txt", 20_000)
    specs = "bf16,nvfp4(sr=False, rht=0, last_bf16=0)"  # 2 specs x 2 seeds, 3 jobs: one split
    finals = {}
    for jobs in (1, 3):
        out = tmp_path / f"j{jobs}"
        assert T.main([*CLI, "--data", str(corpus), "--out", str(out), "--compare", specs,
                       "--seeds", "0,1", "--jobs", str(jobs)]) == 0
        agg = json.loads((out / "compare.json").read_text())
        finals[jobs] = {(r["recipe"], r["seed"]): r["final_val_loss"] for r in agg["runs"]}
    assert finals[1] == finals[3] and len(finals[1]) == 4, finals
    logs = sorted(p.name for p in (tmp_path / "j3" / "workers").glob("*.log"))
    assert logs == ["bf16-seeds0.log", "bf16-seeds1.log",
                    "nvfp4_sr-False_rht-0_last_bf16-0.log"], logs


def test_parallel_sweep_failed_workers(tmp_path, capsys, monkeypatch):
    """A worker that fails is reported (SweepFailed, exit 2, its log named) with the summary
    written, and an older result.json in a failed sub-run's directory is not taken as its
    result; a one-seed --overwrite keeps each worker's log beside the runs."""
    corpus = write_text(tmp_path / "c.txt", 20_000)
    out = tmp_path / "s"
    args = [*CLI, "--data", str(corpus), "--out", str(out), "--compare", "bf16,bf16(name=b)",
            "--jobs", "2"]
    assert T.main(args) == 0
    # the workers see one CPU device, this process (which checks every run before the sweep
    # starts) four: --devices 2 passes here, and both workers fail at the mesh
    monkeypatch.setenv("XLA_FLAGS", re.sub(r"device_count=\d+", "device_count=1",
                                           os.environ["XLA_FLAGS"]))
    with pytest.raises(SystemExit) as e:
        T.main([*args, "--overwrite", "--devices", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "sweep worker(s) failed" in err and "workers/bf16.log" in err
    agg = json.loads((out / "compare.json").read_text())
    assert [r["status"] for r in agg["runs"]] == ["failed", "failed"], agg["runs"]
    assert all(r["final_val_loss"] is None for r in agg["runs"])
    assert "devices" in (out / "workers" / "bf16.log").read_text()


@pytest.mark.parametrize("args", [["--jobs", "0"], ["--jobs", "2"]])
def test_cli_bad_jobs(args, tmp_path, capsys):
    """--jobs below 1, or without a sweep (--compare/--seeds), is refused."""
    with pytest.raises(SystemExit) as e:
        T.main([*args, "--out", str(tmp_path / "x"), "--compile-cache", "off"])
    assert e.value.code == 2 and "argument --jobs" in capsys.readouterr().err
