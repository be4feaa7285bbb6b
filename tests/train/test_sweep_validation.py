"""A sweep (``--compare``) is validated whole before its first run starts, whatever the order
of its specs: every run must pass the checks its own single run passes (the config with its
spec's run-level keys applied, and the checks a run makes on its model and devices before
its first step). A refused sweep trains nothing and writes nothing."""

from __future__ import annotations

import pytest

from fp4jax import train as T
from fp4jax.train.comparison import compare
from tests.textdata import write_text

CLI = ["--preset", "micro", "--steps", "2", "--batch-size", "4", "--seq-len", "32",
       "--eval-every", "0", "--eval-batches", "1", "--warmup-steps", "0", "--no-progress",
       "--compile-cache", "off"]


def _refused(argv, tmp_path, capsys) -> str:
    corpus = write_text(tmp_path / "c.txt", 20_000)
    out = tmp_path / "sweep"
    with pytest.raises(SystemExit) as e:
        T.main([*CLI, "--data", str(corpus), "--out", str(out), *argv])
    assert e.value.code == 2
    assert not out.exists(), "a refused sweep wrote its --out (or trained a run)"
    return capsys.readouterr().err.strip().splitlines()[-1]


# (specs in one order, flags, the refused flag, the spec of the refused run)
STATIC = [
    ("nvfp4,bf16", ["--fp4-param-gather", "--fsdp", "2", "--devices", "2"],
     "--fp4-param-gather", "bf16"),
    ("nvfp4,nvfp4(switch_at=0.5)", ["--osci-reset", "0"], "--osci-reset",
     "nvfp4(switch_at=0.5)"),
    ("nvfp4,bf16", ["--osci-reset", "0.5"], "--osci-reset", "bf16"),
    ("bf16,nvfp4(outcontrol=0.1, outcontrol_start=0, outcontrol_iters=1)",
     ["--switch-at", "0.5"], "--outcontrol",
     "nvfp4(outcontrol=0.1, outcontrol_start=0, outcontrol_iters=1)"),
]


@pytest.mark.parametrize("jobs", ["1", "2"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("specs, flags, flag, bad", STATIC)
def test_static_refusal_whatever_the_order(specs, flags, flag, bad, reverse, jobs, tmp_path,
                                           capsys):
    order = T.split_specs(specs)
    if reverse:
        order = order[::-1]
    err = _refused(["--compare", ",".join(order), "--jobs", jobs, *flags], tmp_path, capsys)
    assert err.startswith(f"fp4jax-train: error: argument {flag}: "), err
    assert f"recipe spec {bad!r}" in err, err


@pytest.mark.parametrize("flags, flag, bad", [(f, fl, b) for _, f, fl, b in STATIC])
def test_the_single_run_refuses_the_same(flags, flag, bad, tmp_path, capsys):
    """What the sweep refuses is what the single run of that spec refuses."""
    err = _refused(["--recipe", bad, *flags], tmp_path, capsys)
    assert err.startswith(f"fp4jax-train: error: argument {flag}: "), err


@pytest.mark.parametrize("reverse", [False, True])
def test_model_level_refusal_before_the_first_run(reverse, tmp_path, capsys):
    """A refusal that needs the run's model and devices (here: 2 devices x 16 token rows,
    which MXFP4's 32-row blocks along the tokens refuse, NVFP4's 16-row ones not) comes
    before the first run, whichever spec comes first; the single MXFP4 run refuses it the
    same way."""
    specs = ["nvfp4", "mxfp4"][::-1] if reverse else ["nvfp4", "mxfp4"]
    flags = ["--devices", "2", "--batch-size", "4", "--seq-len", "8"]
    err = _refused(["--compare", ",".join(specs), *flags], tmp_path, capsys)
    assert "the run of recipe spec 'mxfp4' would be refused" in err, err
    assert "--batch-size 4 over 2 devices" in err, err
    single = _refused(["--recipe", "mxfp4", *flags], tmp_path, capsys)
    assert "--batch-size 4 over 2 devices" in single, single


def test_plan_level_refusal_before_the_first_run(tmp_path, capsys):
    """--outcontrol with a multiple no layer of the micro model reaches: the BF16 run has
    nothing to split (off), the NVFP4 run is refused; found from the parameters' shapes
    before the BF16 run trains."""
    flags = ["--outcontrol", "0.1", "--outcontrol-multiple", "4096", "--outcontrol-start",
             "0", "--outcontrol-iters", "1"]
    err = _refused(["--compare", "bf16,nvfp4", *flags], tmp_path, capsys)
    assert "the run of recipe spec 'nvfp4' would be refused" in err, err
    assert "--outcontrol: no quantized linear layer" in err, err


def test_devices_refused_before_parallel_workers(tmp_path, capsys):
    err = _refused(["--compare", "bf16,bf16(name=b)", "--jobs", "2", "--devices", "99"],
                   tmp_path, capsys)
    assert "would be refused" in err and "--devices 99" in err, err


def test_compare_function_checks_every_run(tmp_path):
    """``compare`` itself (not only the CLI) refuses before writing anything."""
    corpus = write_text(tmp_path / "c.txt", 20_000)
    cfg = T.TrainConfig(preset="micro", steps=2, batch_size=4, seq_len=8, devices=2,
                        eval_every=0, eval_batches=1, progress=False, data=str(corpus),
                        out=str(tmp_path / "s"))
    with pytest.raises(ValueError, match="recipe spec 'mxfp4' would be refused"):
        compare(cfg, ["nvfp4", "mxfp4"])
    assert not (tmp_path / "s").exists()


@pytest.mark.slow  # trains one micro run
def test_repeated_sweep_restarts_a_run_with_no_checkpoint_step(tmp_path, capsys):
    """A sub-run killed after creating its checkpoint folder but before its first checkpoint
    has nothing to resume: the repeated sweep moves it aside and restarts it (a sub-run told
    to resume would be refused)."""
    corpus = write_text(tmp_path / "c.txt", 20_000)
    out = tmp_path / "sweep"
    dead = out / "bf16"
    (dead / "checkpoints").mkdir(parents=True)
    (dead / "metrics.jsonl").write_text("")
    (out / "sweep.json").write_text("{}")
    assert T.main([*CLI, "--data", str(corpus), "--out", str(out), "--compare", "bf16"]) == 0
    err = capsys.readouterr().err
    assert f"{dead}: no checkpoint: moving it aside, restarting" in err, err
    assert len(list(out.glob("bf16.old-*"))) == 1
    assert (dead / "result.json").is_file()
