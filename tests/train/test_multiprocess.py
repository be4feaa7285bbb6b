"""Multi-process runs of the harness (jax.distributed over loopback, CPU collectives: gloo).

Two processes with two virtual CPU devices each train the micro preset; their mesh is the
same (4, fsdp) mesh as one process with four devices (this test process, see conftest), so
the losses and the checkpointed state must be the same bits. A run whose processes are all
killed mid-run resumes from its newest complete checkpoint to the same bits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from fp4jax.train.checkpoint import Checkpointer
from fp4jax.train.config import TrainConfig
from fp4jax.train.loop import train
from tests import ROOT
from tests.textdata import write_text

# NVFP4 in the forward GEMMs (tensor scales from the amax over both processes' rows); the
# backward in BF16, which halves the three compilations of the train step (one per process
# and the one-process reference): the quantized backward's data-parallel amaxes are
# tests/dot/test_sharding.py's and tests/dot/test_amax_scope.py's, bit for bit.
RUN = dict(preset="micro", recipe="nvfp4_fwd_only", batch_size=8, seq_len=64,
           eval_batches=1, fsdp=2, progress=False)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flags(kw: dict) -> list[str]:
    out = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is False:
            out.append("--no-progress" if k == "progress" else "")
        else:
            out += [flag, str(v)]
    return [f for f in out if f]


def _launch(tmp: Path, kw: dict, n: int = 2) -> list[subprocess.Popen]:
    """Starts ``n`` processes of ``fp4jax-train`` with two CPU devices each."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": " ".join([f for f in os.environ.get("XLA_FLAGS", "").split()
                                  if "device_count" not in f]
                                 + ["--xla_force_host_platform_device_count=2"])}
    port = _port()
    procs = []
    for i in range(n):
        cmd = [sys.executable, "-m", "fp4jax.train", "--coordinator", f"127.0.0.1:{port}",
               "--num-processes", str(n), "--process-id", str(i),
               "--compile-cache", str(tmp / "xla"), *_flags(kw)]
        log = open(tmp / f"p{i}-{port}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      cwd=tmp))
        procs[-1].log_path = log.name
    return procs


def _wait(procs: list[subprocess.Popen], timeout: float = 600) -> list[str]:
    """Waits for every process; returns their outputs, each ending ``rc=N``. Kills all on
    a timeout."""
    t_end = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(max(1.0, t_end - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError("multi-process run timed out:\n" + "\n".join(
            Path(p.log_path).read_text()[-2000:] for p in procs)) from None
    return [Path(p.log_path).read_text() + f"\nrc={p.returncode}" for p in procs]


def _records(out: Path) -> list[dict]:
    keep = ("train", "eval")
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "wall_s")}
            for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["type"] in keep]


def _state(out: Path, step: int) -> list[np.ndarray]:
    c = Checkpointer(out / "checkpoints")
    try:
        return [np.asarray(x) for x in jax.tree.leaves(c.restore(step, None))]
    finally:
        c.close()


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return write_text(tmp_path_factory.mktemp("mp") / "text.txt")


@pytest.mark.heavy(182)
def test_killed_two_process_fsdp_run_resumes_to_one_process_result(text, tmp_path):
    """2 processes x 2 devices, a data 2 x fsdp 2 mesh (--fsdp 2), every process killed
    after checkpoint 3 of 6 (evaluations at steps 0 and 6: one before the kill, one
    after), resumed: the run equals one process with 4 devices (this one) to f32 summation
    order (gloo's cross-process reductions add in another order than the in-process ones:
    measured over 12 steps, 1 ulp in losses, 1.8e-6 relative in 12 of 60 state arrays)."""
    kw = dict(steps=6, eval_every=6, checkpoint_every=1, log_every=1)
    out = tmp_path / "run"
    procs = _launch(tmp_path, {**RUN, **kw, "data": text, "out": out})
    t_end = time.monotonic() + 600  # as _wait's: a loaded machine compiles slowly
    while time.monotonic() < t_end:  # kill every process once checkpoint 3 is committed
        if (out / "checkpoints" / "3").is_dir() or any(p.poll() is not None for p in procs):
            break
        time.sleep(0.005)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    _wait(procs)
    assert not (out / "result.json").exists(), "the run finished before it was killed"
    logs = _wait(_launch(tmp_path, {**RUN, **kw, "data": text, "out": out, "resume": True}))
    assert '"status": "finished"' in logs[0] and logs[1].endswith("rc=0"), "\n".join(logs)
    assert '"status"' not in logs[1]  # process 0 reports the run
    result = json.loads((out / "result.json").read_text())
    assert (result["processes"], result["devices"]) == (2, 4)

    ref = tmp_path / "one_process"
    train(TrainConfig(data=str(text), out=str(ref), devices=4, **RUN, **kw))
    got, want = _records(out), _records(ref)
    assert [(r["type"], r["step"]) for r in got] == [(r["type"], r["step"]) for r in want]
    for r, w in zip(got, want, strict=True):
        for k in ("loss", "grad_norm", "val_loss"):
            if k in w:
                np.testing.assert_allclose(r[k], w[k], rtol=1e-5, err_msg=f"{k} {w}")
    for a, b in zip(_state(out, 6), _state(ref, 6), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

    # process 0 owns --out: a repeated command is refused on every process, nothing changed
    before = (out / "metrics.jsonl").read_bytes()
    logs = _wait(_launch(tmp_path, {**RUN, **kw, "data": text, "out": out}))
    assert "already holds a run" in logs[0] and "process 0 failed" in logs[1], "\n".join(logs)
    assert all(log.endswith("rc=2") for log in logs)
    assert (out / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize("argv, msg", [
    (["--num-processes", "2", "--process-id", "2"], "--process-id must be in 0..1"),
    (["--coordinator", "localhost"], "--coordinator must be HOST:PORT"),
    (["--distributed", "--compare", "bf16,nvfp4"], "a multi-process launch trains one run"),
])
def test_bad_multiprocess_flags(argv, msg, capsys):
    from fp4jax.train.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err
