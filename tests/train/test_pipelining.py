"""The training loop's pipelining (``fp4jax.train.loop``: batches prefetched to the devices,
metrics read ``IN_FLIGHT`` steps late, the logged learning rate dispatched with its step)
changes nothing a run records: the same ``metrics.jsonl`` losses, gradient norms and
learning rates, bit for bit, as the synchronous loop (each batch built when its step needs
it, each step's metrics read right after it), fresh and resumed from a checkpoint."""

from __future__ import annotations

import json
import threading

import jax
import numpy as np
import pytest

from fp4jax import train as T
from fp4jax.train import loop
from fp4jax.train.runlog import Progress, RunLog
from tests.textdata import write_text

# test_train.py's schedule (steps=30 is compiled into the optimizer): the runs here share
# its compiled steps and persistent-cache entries; stop_at keeps them short.
BASE = dict(preset="micro", steps=30, lr=1e-2, batch_size=8, seq_len=64, eval_every=15,
            eval_batches=2, log_every=1, warmup_steps=3, progress=False)

pytestmark = pytest.mark.usefixtures("keep_compile_cache")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return str(write_text(tmp_path_factory.mktemp("data") / "corpus.txt", 60_000))


def _records(out):
    """The run's train and eval records, the timing fields left out."""
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in recs
            if r["type"] in ("train", "eval")]


@pytest.fixture
def synchronous(monkeypatch):
    """The loop without pipelining: no batch built ahead, every step's metrics read as soon
    as it is dispatched."""
    def apply():
        monkeypatch.setattr(loop, "IN_FLIGHT", 0)
        monkeypatch.setattr(loop, "PREFETCH", 0)
    return apply


def test_pipelined_run_records_what_the_synchronous_loop_records(text, tmp_path,
                                                                 synchronous):
    cfg = T.TrainConfig(**{**BASE, "data": text, "recipe": "nvfp4", "stop_at": 16,
                           "checkpoint_every": 5, "out": str(tmp_path / "piped")})
    assert loop.IN_FLIGHT >= 1 and loop.PREFETCH >= 1  # the defaults pipeline
    piped = T.train(cfg)
    # resumed from step 10 (stop_at 12 leaves checkpoints 5 and 10 ... 12: the newest)
    half = cfg.replace(out=str(tmp_path / "resumed"), stop_at=12)
    T.train(half)
    resumed = T.train(half.replace(resume=True, stop_at=16))
    synchronous()
    sync = T.train(cfg.replace(out=str(tmp_path / "sync")))

    want = _records(tmp_path / "sync")
    assert [r["step"] for r in want if r["type"] == "train"] == list(range(16))
    assert _records(tmp_path / "piped") == want  # float == float: the same bits
    assert _records(tmp_path / "resumed") == want
    for r in (piped, resumed):
        assert r["history"] == sync["history"]
        assert r["steps"] == sync["steps"] == 16


def test_prefetcher_gives_each_steps_batch_built_ahead():
    mesh = T.make_mesh(1, 1)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    built, threads = [], set()

    def rows(s, r):
        built.append(s)
        threads.add(threading.current_thread().name)
        first, last, _ = r.indices(4)
        return np.arange(first, last, dtype=np.int32)[:, None] * 100 + s + np.zeros(
            (1, 3), np.int32)

    pf = loop.BatchPrefetcher(rows, (4, 3), sharding, start=5, end=9, depth=2)
    try:
        for s in range(5, 9):
            got = pf.get(s)
            assert got.sharding == sharding
            np.testing.assert_array_equal(np.asarray(got),
                                          np.arange(4)[:, None] * 100 + s + np.zeros((1, 3)))
            # each step built once, at most depth steps ahead (those may still be running)
            b = list(built)
            assert len(set(b)) == len(b) and set(range(5, s + 1)) <= set(b)
            assert max(b) <= min(8, s + 2)
    finally:
        pf.close()
    assert sorted(built) == [5, 6, 7, 8]  # never past the end
    assert threads == {t for t in threads if t.startswith("fp4jax-batches")}


def test_prefetcher_raises_a_build_error_at_its_step():
    mesh = T.make_mesh(1, 1)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

    def rows(s, r):
        if s == 1:
            raise OSError("unreadable token file")
        return np.zeros((2, 3), np.int32)

    pf = loop.BatchPrefetcher(rows, (2, 3), sharding, start=0, end=3)
    try:
        pf.get(0)
        with pytest.raises(OSError, match="unreadable"):
            pf.get(1)
    finally:
        pf.close()


def test_runlog_flush_keeps_the_newest_steps_unread(tmp_path):
    lr_calls = []

    def lr(s):
        lr_calls.append(s)
        return jax.numpy.float32(0.5) * s

    log = RunLog(tmp_path / "m.jsonl", Progress(4, 0, False, "x"), "x", 10, 2, 4, lr,
                 lambda s: "bf16", lambda s: "")
    for s in range(4):
        log.dispatched(s, {"loss": jax.numpy.float32(s), "grad_norm": jax.numpy.float32(1)})
        log.flush(keep=2)
        assert [p[0] for p in log.pending] == list(range(max(0, s - 1), s + 1))
    # the learning rate of a recorded step (every 2nd and the last) is asked for at dispatch
    assert lr_calls == [0, 2, 3]
    log.flush()
    log.close()
    recs = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["lr"]) for r in recs] == [(0, 0.0, 0.0), (2, 2.0, 1.0),
                                                               (3, 3.0, 1.5)]
    assert log.history["loss"] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("depth", [0, 1, 2, 4])
@pytest.mark.parametrize("start", [0, 5])
def test_prefetched_batches_are_the_datasets_in_order(depth, start):
    """Whatever the depth, and from a resumed step, batch ``s`` is ``train_batch(s)``
    exactly (over an epoch boundary too), each built once."""
    from fp4jax.train.data import ByteDataset

    rng = np.random.default_rng(0)
    ds = ByteDataset(rng.integers(0, 256, 40 * 9 + 3, dtype=np.uint8),
                     rng.integers(0, 256, 100, dtype=np.uint8), 8)
    assert ds.windows_per_epoch() < 12 * 4  # the steps below wrap epochs
    mesh = T.make_mesh(1, 1)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    built = []

    def rows(s, r):
        built.append(s)
        return ds.train_batch(s, 4, 3, r)

    pf = loop.BatchPrefetcher(rows, (4, 9), sharding, start, 12, depth)
    try:
        for s in range(start, 12):
            np.testing.assert_array_equal(np.asarray(pf.get(s)), ds.train_batch(s, 4, 3))
    finally:
        pf.close()
    assert sorted(built) == list(range(start, 12))


def test_prefetch_depth_follows_loop_constant(monkeypatch):
    """``depth=None`` takes ``loop.PREFETCH`` when the prefetcher is made (the synchronous
    loop of the test above sets it to 0): nothing built ahead, each batch in ``get``'s
    thread."""
    mesh = T.make_mesh(1, 1)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    threads = []

    def rows(s, r):
        threads.append((s, threading.current_thread().name))
        return np.full((2, 3), s, np.int32)

    monkeypatch.setattr(loop, "PREFETCH", 0)
    pf = loop.BatchPrefetcher(rows, (2, 3), sharding, start=0, end=3)
    try:
        assert pf.depth == 0 and not threads
        for s in range(3):
            assert int(np.asarray(pf.get(s))[0, 0]) == s
            assert threads[-1] == (s, threading.current_thread().name)
        assert len(threads) == 3
    finally:
        pf.close()
    monkeypatch.setattr(loop, "PREFETCH", 3)
    pf = loop.BatchPrefetcher(rows, (2, 3), sharding, start=0, end=10)
    try:
        assert pf.depth == 3
    finally:
        pf.close()
