"""Tokenizers and tokenized corpora (``fp4jax.train.tokens``): BPE training and reuse by hash, a
user's tokenizer.json, .bin/.npy token files memory-mapped, batches a pure function of
(seed, step) and of the rows a process reads, fingerprints, bad input, ``fp4jax-tokenize``,
and a few CPU steps of ``fp4jax-train`` on a tokenized corpus with an exact resume."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fp4jax.train import tokens as T
from fp4jax.train.data import ByteDataset
from tests.textdata import make_text, write_text

try:
    import tokenizers  # noqa: F401

    _HAS_TOKENIZERS = True
except ImportError:  # an optional dependency (the train and dev extras install it)
    _HAS_TOKENIZERS = False
needs_tokenizers = pytest.mark.skipif(not _HAS_TOKENIZERS, reason="needs `tokenizers`")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh fp4jax cache (BPE vocabularies, token digests) for each test."""
    d = tmp_path / "cache"
    monkeypatch.setenv("FP4JAX_CACHE", str(d))
    return d


@pytest.fixture
def corpus(tmp_path):
    """A directory of two text documents (~30 KB)."""
    d = tmp_path / "corpus"
    d.mkdir()
    write_text(d / "a.txt", 18_000, seed=0)
    write_text(d / "b.txt", 12_000, seed=1)
    return d


@needs_tokenizers
def test_bpe_round_trip_reuse_by_hash_and_determinism(cache, tmp_path, monkeypatch):
    texts = [make_text(20_000, seed=0), make_text(10_000, seed=1) + " Ünïcödé ✓ \t\n"]
    tok = T.bpe_tokenizer(texts, 300, cache)
    assert tok.vocab_size <= 300 and tok.eot == 0 and tok.spec == "bpe:300"
    for t in texts:  # byte-level BPE: exact round trip, and fewer ids than bytes
        ids = tok.encode(t)
        assert ids.max() < tok.vocab_size and len(ids) < len(t.encode())
        assert tok.decode(ids) == t
    saved = sorted((cache / "tokenizers").iterdir())
    assert len(saved) == 1
    # the same texts: loaded, not trained (training would raise)
    monkeypatch.setattr(T, "train_bpe", lambda *a: (_ for _ in ()).throw(AssertionError))
    again = T.bpe_tokenizer(texts, 300, cache)
    assert again.sha256 == tok.sha256
    monkeypatch.undo()
    # changed text or N: trained again, saved beside the first
    other = T.bpe_tokenizer([texts[0] + "x"], 300, cache)
    T.bpe_tokenizer(texts, 290, cache)
    assert len(list((cache / "tokenizers").iterdir())) == 3 and other.sha256 != tok.sha256
    # deterministic: a fresh training (another cache) gives the same tokenizer.json
    assert T.bpe_tokenizer(texts, 300, tmp_path / "c2").sha256 == tok.sha256


@needs_tokenizers
def test_byte_level_encode_in_pieces_equals_whole(cache):
    """Long texts are encoded in pieces cut at newlines between non-blanks: the same ids as
    one piece, on text rich in blanks, quotes and non-ASCII (a cut after any newline would
    differ: `` \\n`` is one pre-token at the end of a text and two inside it)."""
    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list("ab c\n\n  \t'sxyz,.!Ü✓"), 3000)) for _ in range(4)]
    tok = T.train_bpe(texts, 300)
    for t in texts:
        whole = tok.encode(t, chunk_chars=10**9)
        for size in (5, 17, 100):
            np.testing.assert_array_equal(tok.encode(t, chunk_chars=size), whole)


@needs_tokenizers
def test_batched_encoding_equals_one_text_at_a_time(cache):
    """``encode_many``/``encode_documents`` encode many documents in one parallel batch: the
    same ids as ``encode`` one text at a time, empty texts included, in any batch size."""
    rng = np.random.default_rng(1)
    texts = ["".join(rng.choice(list("ab c\n\n  \t'sxyz,.!Ü✓"), n)) for n in (3000, 0, 40, 900)]
    tok = T.train_bpe(texts, 300)
    one = [tok.encode(t, chunk_chars=64) for t in texts]
    for got, want in zip(tok.encode_many(texts, chunk_chars=64), one, strict=True):
        np.testing.assert_array_equal(got, want)
    want = [np.append(w, 0) for w, t in zip(one, texts, strict=True) if t]
    for batch in (1, 50, 10**9):
        got = list(T.encode_documents(tok, texts, batch_chars=batch))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


@needs_tokenizers
def test_tokenize_with_a_validation_corpus_splits_by_document(cache, tmp_path):
    """``--val-data``: every document of DATA is training text, every document of the
    validation corpus validation text; BPE trains on DATA only; the key covers both."""
    tr, va = tmp_path / "tr", tmp_path / "va"
    tr.mkdir()
    va.mkdir()
    write_text(tr / "a.txt", 9_000, seed=0)
    write_text(tr / "b.txt", 6_000, seed=1)
    write_text(va / "c.txt", 2_000, seed=2)
    out = tmp_path / "tok"
    meta = T.tokenize_corpus(tr, "bpe:300", out, val_data=va)
    assert meta["source"]["val_data"] == str(va) and meta["source"]["val_fraction"] is None
    tok = T.bpe_tokenizer([(tr / n).read_text() for n in ("a.txt", "b.txt")], 300, cache)
    ds = T.load_dataset(out, 16)
    assert ds.tokenizer_sha256 == tok.sha256
    want = {"train": np.concatenate([np.append(tok.encode((tr / n).read_text()), 0)
                                     for n in ("a.txt", "b.txt")]),
            "val": np.append(tok.encode((va / "c.txt").read_text()), 0)}
    np.testing.assert_array_equal(ds.train[:], want["train"])
    np.testing.assert_array_equal(ds.val[:], want["val"])
    # a changed validation corpus is another corpus: refused without --overwrite
    write_text(va / "c.txt", 2_100, seed=2)
    with pytest.raises(FileExistsError, match="--overwrite"):
        T.tokenize_corpus(tr, "bpe:300", out, val_data=va)


@needs_tokenizers
def test_text_corpus_with_bpe_and_user_tokenizer(cache, corpus, tmp_path):
    ds = T.load_dataset(corpus, seq_len=16, val_fraction=0.1, tokenizer="bpe:300")
    assert isinstance(ds, T.TokenDataset) and ds.vocab_size <= 300 and ds.train.dtype == np.uint16
    # the training split only shaped the vocabulary; each document part ends with <|endoftext|>
    tr, va = T.split_texts(T.load_documents(corpus), 0.1)
    tok = T.bpe_tokenizer(tr, 300, cache)
    want = np.concatenate([np.append(tok.encode(t), 0) for t in tr])
    np.testing.assert_array_equal(ds.train, want)
    assert tok.decode(ds.val[: len(ds.val) - 1]).startswith(va[0][:50])
    # the same tokenizer as the user's tokenizer.json (file or directory): the same tokens
    (tmp_path / "mytok").mkdir()
    tok.save(tmp_path / "mytok" / "tokenizer.json")
    for spec in (str(tmp_path / "mytok" / "tokenizer.json"), str(tmp_path / "mytok")):
        ds2 = T.load_dataset(corpus, 16, 0.1, tokenizer=spec)
        np.testing.assert_array_equal(ds2.train, ds.train)
        assert ds2.fingerprint() == ds.fingerprint()  # the tokenizer's content, not its name
    # bytes (or no tokenizer): exactly today's ByteDataset
    b = T.load_dataset(corpus, 16, 0.1, tokenizer="bytes")
    ref = ByteDataset.load(corpus, 16, 0.1)
    assert type(b) is ByteDataset and b.vocab_size == 256
    assert b.fingerprint() == ref.fingerprint() != ds.fingerprint()


def _write_bin(path, ids, dtype="<u2"):
    np.asarray(ids, dtype=dtype).tofile(path)  # nanoGPT: flat little-endian ids, no header


def test_bin_files_round_trip(cache, tmp_path):
    rng = np.random.default_rng(1)
    train, val = rng.integers(0, 50257, 5000), rng.integers(0, 50257, 700)
    d = tmp_path / "owt"
    d.mkdir()
    _write_bin(d / "train.bin", train)
    _write_bin(d / "val.bin", val)
    ds = T.load_dataset(d, seq_len=32)  # vocabulary: largest id + 1 (said on stderr)
    assert isinstance(ds.train, T.TokenStream) and isinstance(ds.train.parts[0], np.memmap)
    np.testing.assert_array_equal(ds.train[:], train)
    np.testing.assert_array_equal(ds.val[:], val)
    assert ds.vocab_size == max(train.max(), val.max()) + 1
    (d / "meta.json").write_text(json.dumps({"vocab_size": 50257}))
    assert T.load_dataset(d, 32).vocab_size == 50257
    # uint32 ids, known from meta.json
    big = rng.integers(0, 100_000, 3000)
    d32 = tmp_path / "big"
    d32.mkdir()
    _write_bin(d32 / "train.bin", big, "<u4")
    (d32 / "meta.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 100_000}))
    ds32 = T.load_dataset(d32, 32, val_fraction=0.1)  # no val.bin: the last 10% held out
    np.testing.assert_array_equal(np.concatenate([ds32.train[:], ds32.val[:]]), big)
    assert len(ds32.val) == 300
    # llm.c's header (magic, version 1, token count) is skipped
    header = np.zeros(256, "<i4")
    header[:3] = [T.LLMC_MAGIC, 1, len(train)]
    with open(tmp_path / "shard_train.bin", "wb") as f:
        f.write(header.tobytes() + train.astype("<u2").tobytes())
    np.testing.assert_array_equal(T.open_token_file(tmp_path / "shard_train.bin"), train)
    # plain ids that happen to start like that header (the count does not fit): plain ids
    plain = np.concatenate([header[:3].view("<u2"), train]).astype("<u2")
    _write_bin(tmp_path / "plain.bin", plain)
    np.testing.assert_array_equal(T.open_token_file(tmp_path / "plain.bin"), plain)


def test_npy_shards_stream_across_boundaries(cache, tmp_path):
    rng = np.random.default_rng(2)
    d = tmp_path / "shards"
    d.mkdir()
    sizes = [100, 1, 257, 64]
    shards = [rng.integers(0, 1000, n).astype(np.uint16) for n in sizes]
    for i, s in enumerate(shards):
        np.save(d / f"train_{i:03d}.npy", s)
    np.save(d / "val_000.npy", rng.integers(0, 1000, 90).astype(np.uint32))
    ds = T.load_dataset(d, seq_len=8)
    whole = np.concatenate(shards)
    assert len(ds.train) == len(whole) and len(ds.train.parts) == 4
    for a, b in rng.integers(0, len(whole) + 1, (200, 2)):
        a, b = sorted((int(a), int(b)))
        np.testing.assert_array_equal(ds.train[a:b], whole[a:b])
    assert ds.val.dtype == np.uint32 and len(ds.val) == 90


def test_batches_pure_in_seed_and_step_and_split_over_processes(cache, tmp_path):
    """The same windows from shards as from the same tokens in memory; a fresh dataset gives
    the same batch; two simulated processes reading rows 0-3 and 4-7 get disjoint, consistent
    halves of the global batch."""
    rng = np.random.default_rng(3)
    train = rng.integers(0, 500, 4000).astype(np.uint16)
    d = tmp_path / "s"
    d.mkdir()
    for i, part in enumerate(np.array_split(train, 3)):
        np.save(d / f"train_{i}.npy", part)
    np.save(d / "val.npy", rng.integers(0, 500, 400).astype(np.uint16))
    ds = T.load_dataset(d, seq_len=16)
    mem = T.TokenDataset(train, np.load(d / "val.npy"), 16, 500)
    for step in (0, 7, 31, 250):  # 250: a later epoch
        full = ds.train_batch(step, 8, seed=5)
        np.testing.assert_array_equal(full, mem.train_batch(step, 8, seed=5))
        np.testing.assert_array_equal(full, T.load_dataset(d, 16).train_batch(step, 8, 5))
        halves = [ds.train_batch(step, 8, 5, slice(0, 4)), ds.train_batch(step, 8, 5, slice(4, 8))]
        np.testing.assert_array_equal(np.concatenate(halves), full)
        starts = [tuple(r) for r in full]
        assert len(set(starts)) == 8  # distinct windows
    assert not np.array_equal(ds.train_batch(0, 8, 5), ds.train_batch(0, 8, 6))
    for a, b in zip(ds.val_batches(2, 4), mem.val_batches(2, 4), strict=True):
        np.testing.assert_array_equal(a, b)


@needs_tokenizers
def test_fingerprint_covers_tokens_split_and_tokenizer(cache, tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    ids = np.arange(3000, dtype=np.uint16) % 300
    np.save(d / "train_0.npy", ids)
    np.save(d / "val_0.npy", ids[:500])
    fp = T.load_dataset(d, 8).fingerprint()
    assert T.load_dataset(d, 8).fingerprint() == fp  # cached digests: the same
    changed = ids.copy()
    changed[1234] += 1
    np.save(d / "train_0.npy", changed)
    st = os.stat(d / "train_0.npy")
    os.utime(d / "train_0.npy", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    fp2 = T.load_dataset(d, 8).fingerprint()
    assert fp2 != fp
    # a tokenizer beside the files enters the fingerprint
    tok = T.train_bpe([make_text(5000)], 300)
    tok.save(d / "tokenizer.json")
    ds = T.load_dataset(d, 8)
    assert ds.fingerprint() != fp2 and ds.tokenizer_sha256 == tok.sha256
    # without a validation file the cut point is part of it
    (d / "val_0.npy").unlink()
    (d / "tokenizer.json").unlink()
    a, b = T.load_dataset(d, 8, 0.1), T.load_dataset(d, 8, 0.2)
    assert a.fingerprint() != b.fingerprint()


@needs_tokenizers
def test_bad_token_input_errors(cache, tmp_path, corpus):
    with pytest.raises(FileNotFoundError, match="--data"):
        T.read_token_files(tmp_path / "nope.bin")
    np.save(tmp_path / "f.npy", np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="--data.*float32.*integer"):
        T.load_dataset(tmp_path / "f.npy", 4)
    np.save(tmp_path / "e.npy", np.zeros(0, np.uint16))
    with pytest.raises(ValueError, match="--data.*empty"):
        T.load_dataset(tmp_path / "e.npy", 4)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00" * 50 + b"\x07")  # a torn .bin
    with pytest.raises(ValueError, match="--data.*101 bytes.*truncated"):
        T.load_dataset(tmp_path / "odd.bin", 4)
    # an id outside meta.json's vocabulary; a model smaller than the data's vocabulary
    d = tmp_path / "v"
    d.mkdir()
    _write_bin(d / "train.bin", np.arange(1000) % 700)
    (d / "meta.json").write_text(json.dumps({"vocab_size": 600}))
    with pytest.raises(ValueError, match="id 699, outside the vocabulary of 600"):
        T.load_dataset(d, 4)
    (d / "meta.json").write_text(json.dumps({"vocab_size": 800, "dtype": "float16"}))
    with pytest.raises(ValueError, match="dtype 'float16'"):
        T.load_dataset(d, 4)
    (d / "meta.json").write_text(json.dumps({"vocab_size": 800}))
    ds = T.load_dataset(d, 4)
    assert T.model_vocab_size(ds) == 800 and T.model_vocab_size(ds, 896) == 896
    with pytest.raises(ValueError, match="--vocab-size 512 is smaller.*800"):
        T.model_vocab_size(ds, 512)
    with pytest.raises(ValueError, match="already tokenized"):
        T.load_dataset(d, 4, tokenizer="bpe:300")
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        T.load_dataset(corpus, 4, tokenizer=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="bpe:N needs an integer"):
        T.parse_tokenizer_spec("bpe:lots")
    from fp4jax.train.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match="--tokenizer"):
        TrainConfig(tokenizer="bpe:12")
    with pytest.raises(ConfigError, match="--vocab-size"):
        TrainConfig(vocab_size=0)


@needs_tokenizers
def test_tokenize_command_writes_once_and_never_destroys(cache, corpus, tmp_path, capsys):
    out = tmp_path / "tok"
    args = [str(corpus), "--tokenizer", "bpe:300", "--out", str(out), "--shard-tokens", "2000",
            "--val-fraction", "0.1"]
    assert T.main(args) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["format"] == T.TOKENS_FORMAT
    assert len(meta["splits"]["train"]) > 1 and (out / "tokenizer.json").is_file()
    # the shards hold exactly the in-memory tokens of the same corpus and tokenizer
    mem = T.load_dataset(corpus, 16, 0.1, tokenizer="bpe:300")
    shards = T.load_dataset(out, 16)
    np.testing.assert_array_equal(shards.train[:], mem.train)
    np.testing.assert_array_equal(shards.val[:], mem.val)
    assert shards.vocab_size == mem.vocab_size and shards.tokenizer_sha256 == mem.tokenizer_sha256
    # a repeated command changes nothing
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert T.main(args) == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    # other settings: refused; with --overwrite the old output is moved aside, not deleted
    with pytest.raises(SystemExit) as e:
        T.main([*args[:-2], "--val-fraction", "0.2"])
    assert e.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert T.main([*args[:-2], "--val-fraction", "0.2", "--overwrite"]) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("tok.old-")]
    assert len(aside) == 1 and json.loads((aside[0] / "meta.json").read_text()) == meta
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    # a shard changed after tokenizing is refused
    first = out / json.loads((out / "meta.json").read_text())["splits"]["train"][0]["file"]
    np.save(first, np.load(first)[:-1])
    with pytest.raises(ValueError, match="changed since it was written"):
        T.load_dataset(out, 16)


@needs_tokenizers
def test_train_cli_on_tokenized_corpus_resumes_exactly(cache, corpus, tmp_path):
    """``fp4jax-tokenize`` then ``fp4jax-train --data DIR`` (micro preset, BPE vocabulary from
    meta.json into the model): 4 steps uninterrupted, and 2 + resume 2, give the same bits;
    the text corpus with ``--tokenizer bpe:300`` gives the same run."""
    from fp4jax import train as TR

    tok = tmp_path / "tok"
    assert T.main([str(corpus), "--tokenizer", "bpe:300", "--out", str(tok)]) == 0
    vocab = json.loads((tok / "meta.json").read_text())["vocab_size"]
    common = ["--preset", "micro", "--recipe", "bf16", "--steps", "4", "--batch-size", "4",
              "--seq-len", "16", "--eval-every", "0", "--log-every", "1", "--warmup-steps",
              "1", "--no-progress", "--compile-cache", "auto", "--devices", "1"]

    def run(out, *extra):
        data = [] if "--data" in extra else ["--data", str(tok)]
        assert TR.main([*common, *data, "--out", str(tmp_path / out), *extra]) == 0
        return json.loads((tmp_path / out / "result.json").read_text())

    full = run("full")
    run("cut", "--stop-at", "2")
    resumed = run("cut", "--resume")
    assert resumed["status"] == "finished" and resumed["history"] == full["history"]
    assert resumed["final_val_loss"] == full["final_val_loss"]
    assert np.isfinite(full["history"]["loss"]).all()
    d = 64  # micro's d_model: embed and lm_head hold vocab * d parameters each
    from fp4jax.models.llama import get_preset

    assert full["params"] == get_preset("micro").replace(vocab_size=vocab).num_params()
    assert full["params"] - get_preset("micro").num_params() == 2 * d * (vocab - 256)
    assert full["data_sha256"] == T.load_dataset(tok, 16).fingerprint()
    # the text corpus tokenized in memory: the same tokens, so the same run and bits (the
    # compiled steps are reused: the tokenizer is data, the vocabulary is in the model)
    text = run("text", "--data", str(corpus), "--tokenizer", "bpe:300")
    assert text["history"] == full["history"] and text["params"] == full["params"]
    assert text["config"]["tokenizer"] == "bpe:300"
