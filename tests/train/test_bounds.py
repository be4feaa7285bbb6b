"""Every size a user types has a range, checked before anything is allocated or written:
``fp4jax-train``'s integer flags, ``--seeds``, ``--tokenizer bpe:N`` (also in
``fp4jax-tokenize``), ``--vocab-size`` and the vocabulary token files declare; and
``fp4jax-tokenize --tokenizer bytes`` writes the raw streams ``fp4jax-train --data`` trains
on (binary files and cuts inside a UTF-8 character included)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fp4jax import train as T
from fp4jax.train import tokens as TK
from fp4jax.train.config import INT32_MAX, MAX_BATCH_IDS, MAX_SEED
from fp4jax.train.data import ByteDataset

BIG = str(10**30)


def _refused(argv, tmp_path, capsys) -> str:
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        T.main([*argv, "--out", str(out), "--no-progress", "--compile-cache", "off"])
    assert e.value.code == 2
    assert not out.exists(), "a refused command wrote its --out"
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("flag", [
    "--steps", "--seq-len", "--batch-size", "--warmup-steps", "--eval-every", "--eval-batches",
    "--log-every", "--checkpoint-every", "--keep-checkpoints", "--stats-every", "--devices",
    "--fsdp", "--first-bf16", "--last-bf16", "--n-experts", "--top-k", "--osci-period",
    "--osci-iters", "--grad-noise-every", "--switch-window", "--bf16-warmup", "--stop-at",
    "--vocab-size", "--seed",
])
def test_huge_integer_flag_refused_by_name(flag, tmp_path, capsys):
    err = _refused([flag, BIG], tmp_path, capsys)
    assert err.startswith(f"fp4jax-train: error: argument {flag}: must be an integer in "), err
    assert err.endswith(f"got {BIG}"), err


@pytest.mark.parametrize("flag, value, upper", [
    ("--steps", INT32_MAX, INT32_MAX + 1), ("--seq-len", 1 << 20, (1 << 20) + 1),
    ("--batch-size", 1 << 20, (1 << 20) + 1), ("--n-experts", 1 << 12, (1 << 12) + 1),
    ("--vocab-size", 1 << 24, (1 << 24) + 1), ("--seed", MAX_SEED, MAX_SEED + 1),
])
def test_the_bound_itself_is_accepted(flag, value, upper, tmp_path, capsys):
    """The largest value passes the range check (TrainConfig), the next one is refused."""
    field = flag[2:].replace("-", "_")
    extra = {"n_experts": {"top_k": 1}, "seq_len": {"batch_size": 1},
             "batch_size": {"seq_len": 2}}.get(field, {})
    T.TrainConfig(**{field: value, **extra})
    with pytest.raises(T.ConfigError, match=rf"\({flag}\): must be an integer in"):
        T.TrainConfig(**{field: upper, **extra})


def test_products_of_sizes_are_bounded(tmp_path, capsys):
    err = _refused(["--batch-size", "65536", "--seq-len", "65536"], tmp_path, capsys)
    assert "argument --batch-size:" in err and str(MAX_BATCH_IDS) in err
    assert "lower --batch-size or --seq-len" in err
    err = _refused(["--eval-batches", "1000000"], tmp_path, capsys)
    assert "argument --eval-batches:" in err and "lower --eval-batches" in err


def test_seeds_bounded(tmp_path, capsys):
    for bad in ("0,-1", f"0,{MAX_SEED + 1}"):
        err = _refused(["--seeds", bad], tmp_path, capsys)
        assert err.startswith("fp4jax-train: error: argument --seeds: seeds must be integers "
                              f"in 0..{MAX_SEED}"), err


@pytest.mark.parametrize("spec", ["bpe:" + "9" * 5000, "bpe:" + BIG, "bpe:1048577", "bpe:257",
                                  "bpe:-300", "bpe:+300", "bpe:３００", "bpe:²⁵⁸"])
def test_bpe_size_refused_before_training(spec, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"bpe:N needs an integer N in 258\.\.1048576"):
        TK.parse_tokenizer_spec(spec)
    err = _refused(["--tokenizer", spec], tmp_path, capsys)
    assert "argument --tokenizer:" in err and "258..1048576" in err
    out = tmp_path / "tok"
    (tmp_path / "a.txt").write_text("some text to tokenize " * 20)
    with pytest.raises(SystemExit) as e:
        TK.main([str(tmp_path / "a.txt"), "--tokenizer", spec, "--out", str(out),
                 "--cache-dir", str(tmp_path / "cache")])
    assert e.value.code == 2 and "258..1048576" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_bpe_bounds_accepted():
    assert TK.parse_tokenizer_spec("bpe:258") == ("bpe", 258)
    assert TK.parse_tokenizer_spec("bpe:1048576") == ("bpe", 1 << 20)


def test_vocabulary_bounds(tmp_path):
    ds = ByteDataset(np.zeros(64, np.uint8), np.zeros(64, np.uint8), 8)
    assert TK.model_vocab_size(ds, TK.MAX_VOCAB) == TK.MAX_VOCAB
    for bad in (TK.MAX_VOCAB + 1, 1, 10**30):
        with pytest.raises(ValueError, match=r"--vocab-size must be an integer in 2\.\."):
            TK.model_vocab_size(ds, bad)
    # token files: meta.json's vocab_size, and ids past the largest vocabulary
    d = tmp_path / "toks"
    d.mkdir()
    np.save(d / "train.npy", np.arange(100, dtype=np.uint32))
    for bad in (10**30, "many", 0, True):
        (d / "meta.json").write_text(json.dumps({"vocab_size": bad}))
        with pytest.raises(ValueError, match=r"vocab_size must be an integer in 1\.\."):
            TK.read_token_files(d, cache=tmp_path / "c")
    (d / "meta.json").unlink()
    np.save(d / "train.npy", np.array([0, 1, TK.MAX_VOCAB], np.uint32))
    with pytest.raises(ValueError, match="past the largest vocabulary"):
        TK.read_token_files(d, cache=tmp_path / "c")


def _corpus(tmp_path):
    """Two documents: a binary file (invalid UTF-8 throughout) and a text whose held-out
    cut (5%) falls inside a multi-byte UTF-8 character."""
    d = tmp_path / "corpus"
    d.mkdir()
    rng = np.random.default_rng(0)
    (d / "blob.txt").write_bytes(bytes(rng.integers(0, 256, 3000, dtype=np.uint8)))
    text = ("ab" * 950 + "é" * 50 + "z" * 20).encode()  # 2020 bytes, the cut at 1919:
    assert (text[1919] & 0xC0) == 0x80  # between the two bytes of an "é"
    (d / "text.txt").write_bytes(text)
    return d


@pytest.mark.parametrize("val_data", [False, True])
def test_tokenize_bytes_is_what_train_reads(val_data, tmp_path):
    corpus = _corpus(tmp_path)
    kw = {}
    if val_data:
        v = tmp_path / "val"
        v.mkdir()
        (v / "v.bin.txt").write_bytes(bytes(range(256)) * 4)
        kw = {"val_data": str(v)}
    out = tmp_path / "tokens"
    meta = TK.tokenize_corpus(str(corpus), "bytes", out, shard_tokens=700,
                              cache=tmp_path / "c", **kw)
    assert meta["vocab_size"] == 256
    tok = TK.load_dataset(str(out), 16, cache=tmp_path / "c")
    if val_data:
        raw = [(corpus / n).read_bytes() for n in sorted(p.name for p in corpus.iterdir())]
        want_train = np.frombuffer(b"".join(raw), np.uint8)
        want_val = np.frombuffer(bytes(range(256)) * 4, np.uint8)
    else:
        direct = TK.load_dataset(str(corpus), 16, cache=tmp_path / "c")  # fp4jax-train --data
        assert isinstance(direct, ByteDataset)
        want_train, want_val = direct.train, direct.val
        for step in range(3):
            np.testing.assert_array_equal(tok.train_batch(step, 4, seed=1),
                                          direct.train_batch(step, 4, seed=1))
    np.testing.assert_array_equal(np.asarray(tok.train[0:len(tok.train)]), want_train)
    np.testing.assert_array_equal(np.asarray(tok.val[0:len(tok.val)]), want_val)


@pytest.mark.parametrize("argv, message", [
    (["--num-processes", BIG, "--process-id", "0"], "--num-processes must be in 1..65536"),
    (["--process-id", "-1"], "--process-id must be in 0..65535"),
    (["--coordinator", "localhost:" + BIG], "--coordinator must be HOST:PORT"),
    (["--coordinator", "localhost:0"], "--coordinator must be HOST:PORT"),
])
def test_process_flags_bounded(argv, message, tmp_path, capsys):
    err = _refused(argv, tmp_path, capsys)
    assert message in err, err
