"""A deterministic code corpus from the Python source of the installed packages (issue 36).

    python experiments/ladder/build_corpus.py --out .data/ladder/corpus          # site-packages
    python experiments/ladder/build_corpus.py --root /some/dir --out DIR         # any tree

The corpus is **Python source code** (every ``.py`` file of the roots, by default
``site.getsitepackages()`` of the running interpreter), not natural language: the scale
ladder trains on it because the GPU machine has no network and ~370 MB of it installed.

Rules (all recorded in ``manifest.json``; the same tree gives the same bytes):

* files: every regular ``.py`` file under each root (``os.walk``, symbolic links neither
  followed nor read, ``__pycache__`` and hidden directories skipped; an installed copy of
  this project (``fp4jax``, ``pallas_kernels``, ...) and ``__editable__*`` finders left out,
  so the corpus does not change with the project's commits), named
  ``<root index>/<path relative to the root>`` (forward slashes) and sorted by name;
* size: files above ``--max-file-bytes`` (default 1,000,000: generated tables, vendored
  data) and empty files are left out, counted;
* bad UTF-8: decoded with ``errors="replace"`` (each invalid byte sequence becomes U+FFFD)
  and written back as UTF-8, counted; so every document is valid UTF-8;
* duplicates: files with the same content (SHA-256 of the bytes as written) are kept once,
  the first by name;
* split: a file is held out for validation when the first 8 hex digits of its SHA-256,
  as an integer, modulo 10,000 fall below ``--val-per-10k`` (default 300: ~3% of the
  files, ~2.3% of the bytes of the development venv's site-packages), so the
  split is by file and does not depend on which other files exist.

Output (``--out DIR``): ``train.tar`` and ``val.tar`` (uncompressed, one member per file,
sorted, mtime 0, uid/gid 0, mode 0644: the documents ``fp4jax-tokenize`` reads),
``manifest.json`` (settings, counts, bytes, the corpus SHA-256 and each tar's SHA-256, the
Python and platform it came from) and ``files.tsv`` (one line per kept file: split, bytes,
the first 16 hex digits of its SHA-256, name). The corpus SHA-256 hashes, split by split,
each kept file's name, length and bytes, so it identifies the corpus whatever the tar
format. Reading and hashing run on ``--workers`` threads (default: all cores).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import site
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FORMAT = "fp4jax.ladder.corpus v1"
# top-level names left out of every root: this project's own packages (an installed copy
# would change the corpus with every commit) and editable-install finders (which hold the
# absolute paths of a checkout)
EXCLUDE_TOP = ("fp4jax", "pallas_kernels", "tests", "experiments")
EXCLUDE_PREFIX = ("__editable__",)
MAX_FILE_BYTES = 1_000_000
VAL_PER_10K = 300


def list_files(roots: list[Path]) -> list[tuple[str, Path]]:
    """``[(name, path)]`` of every regular ``.py`` file under ``roots``, sorted by name
    (``<root index>/<relative path>``); symbolic links, ``__pycache__`` and hidden
    directories, this project's packages at a root's top (``EXCLUDE_TOP``) and
    editable-install finders (``EXCLUDE_PREFIX``) are skipped."""
    out = []
    for i, root in enumerate(roots):
        for d, dirs, files in os.walk(root, followlinks=False):
            top = Path(d) == Path(root)
            dirs[:] = sorted(x for x in dirs if x != "__pycache__" and not x.startswith(".")
                             and not (top and x in EXCLUDE_TOP))
            for f in files:
                if not f.endswith(".py") or f.startswith(EXCLUDE_PREFIX) or (
                        top and f[:-3] in EXCLUDE_TOP):
                    continue
                p = Path(d) / f
                if p.is_symlink() or not p.is_file():
                    continue
                out.append((f"{i}/{p.relative_to(root).as_posix()}", p))
    out.sort(key=lambda t: t[0])
    return out


def read_file(path: Path, max_bytes: int) -> tuple[bytes | None, str]:
    """The file's bytes as valid UTF-8 and what happened: ``"ok"``, ``"replaced"`` (invalid
    UTF-8 decoded with U+FFFD), ``"large"``/``"empty"``/``"unreadable"`` (bytes None)."""
    try:
        if path.stat().st_size > max_bytes:
            return None, "large"
        raw = path.read_bytes()
    except OSError:
        return None, "unreadable"
    if not raw:
        return None, "empty"
    if len(raw) > max_bytes:
        return None, "large"
    try:
        raw.decode("utf-8")
        return raw, "ok"
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace").encode("utf-8"), "replaced"


def is_val(sha256_hex: str, val_per_10k: int) -> bool:
    """Whether a file of this content hash is held out (see the module docstring)."""
    return int(sha256_hex[:8], 16) % 10_000 < val_per_10k


def _tar_bytes(docs: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, b in docs:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(b), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(b))
    return buf.getvalue()


def default_roots() -> list[Path]:
    """The running interpreter's ``site.getsitepackages()`` that exist (an image may list
    folders it does not have, e.g. ``/opt/torch/.venv/local/lib/python3.12/dist-packages``),
    each once by its real path, in the listed order."""

    seen, roots = set(), []
    for r in site.getsitepackages():
        path = Path(r)
        if path.is_dir() and path.resolve() not in seen:
            seen.add(path.resolve())
            roots.append(path)
    return roots


def build(roots: list[Path], out: Path, max_file_bytes: int = MAX_FILE_BYTES,
          val_per_10k: int = VAL_PER_10K, workers: int | None = None) -> dict:
    """Builds the corpus of ``roots`` into ``out`` (see the module docstring); returns the
    manifest."""
    if not roots:
        raise ValueError("no --root given and site.getsitepackages() is empty")
    for r in roots:
        if not r.is_dir():
            raise ValueError(f"--root {str(r)!r} is not a directory")
    if not 0 <= val_per_10k < 10_000:
        raise ValueError(f"--val-per-10k must be in [0, 10000), got {val_per_10k}")
    t0 = time.perf_counter()
    files = list_files(roots)
    t_list = time.perf_counter() - t0
    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(workers) as ex:
        read = list(ex.map(lambda f: read_file(f[1], max_file_bytes), files, chunksize=64))
        hashes = list(ex.map(lambda r: hashlib.sha256(r[0]).hexdigest() if r[0] else "",
                             read, chunksize=64))
    t_read = time.perf_counter() - t0 - t_list
    counts = {"py_files": len(files), "large": 0, "empty": 0, "unreadable": 0,
              "duplicates": 0, "replaced_utf8": 0}
    seen: set[str] = set()
    splits: dict[str, list[tuple[str, bytes, str]]] = {"train": [], "val": []}
    for (name, _), (b, what), h in zip(files, read, hashes, strict=True):
        if b is None:
            counts[what] += 1
            continue
        if h in seen:
            counts["duplicates"] += 1
            continue
        seen.add(h)
        counts["replaced_utf8"] += what == "replaced"
        splits["val" if is_val(h, val_per_10k) else "train"].append((name, b, h))
    for split, docs in splits.items():
        if not docs:
            raise ValueError(f"the {split} split holds no file ({counts['py_files']} .py "
                             f"files under {', '.join(map(str, roots))}): give a larger "
                             "--root or another --val-per-10k")
    corpus = hashlib.sha256(FORMAT.encode())
    out.mkdir(parents=True, exist_ok=True)
    tars = {}
    for split, docs in splits.items():
        corpus.update(f"{split}:{len(docs)}\0".encode())
        for name, b, _ in docs:
            corpus.update(name.encode("utf-8", errors="surrogateescape") + b"\0")
            corpus.update(len(b).to_bytes(8, "little"))
            corpus.update(b)
        raw = _tar_bytes([(n, b) for n, b, _ in docs])
        tmp = out / f".{split}.tar.tmp"
        tmp.write_bytes(raw)
        os.replace(tmp, out / f"{split}.tar")
        tars[split] = {"file": f"{split}.tar", "files": len(docs),
                       "bytes": sum(len(b) for _, b, _ in docs),
                       "tar_sha256": hashlib.sha256(raw).hexdigest()}
    with open(out / "files.tsv", "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write("split\tbytes\tsha256_16\tname\n")
        for split, docs in splits.items():
            for name, b, h in docs:
                f.write(f"{split}\t{len(b)}\t{h[:16]}\t{name}\n")
    manifest = {
        "format": FORMAT, "what": "Python source code (.py files of installed packages)",
        "corpus_sha256": corpus.hexdigest(),
        "roots": [str(r) for r in roots],
        "settings": {"max_file_bytes": max_file_bytes, "val_per_10k": val_per_10k,
                     "utf8": "errors=replace", "dedup": "sha256 of the bytes, first by name"},
        "counts": {**counts, "kept": sum(len(v) for v in splits.values())},
        "bytes": {s: v["bytes"] for s, v in tars.items()}, "splits": tars,
        "python": sys.version.split()[0], "platform": platform.platform(),
        "seconds": {"list": round(t_list, 2), "read_hash": round(t_read, 2),
                    "total": round(time.perf_counter() - t0, 2)},
        "workers": workers,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", action="append", default=None,
                   help="a directory to take .py files from (repeatable; default: "
                        "site.getsitepackages() of this interpreter)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--max-file-bytes", type=int, default=MAX_FILE_BYTES)
    p.add_argument("--val-per-10k", type=int, default=VAL_PER_10K)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--expect-sha256", default=None,
                   help="exit 1 unless the corpus SHA-256 is this (a rebuild's check)")
    a = p.parse_args(argv)
    roots = [Path(r) for r in a.root] if a.root else default_roots()
    m = build(roots, Path(a.out), a.max_file_bytes, a.val_per_10k, a.workers)
    print(json.dumps({k: m[k] for k in ("corpus_sha256", "counts", "bytes", "seconds")}))
    if a.expect_sha256 and m["corpus_sha256"] != a.expect_sha256:
        print(f"build_corpus: corpus SHA-256 {m['corpus_sha256']} is not the expected "
              f"{a.expect_sha256}: another image or package set", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
