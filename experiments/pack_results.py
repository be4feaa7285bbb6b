"""A finished campaign's per-step records (or, ``--raw``, a whole topic's raw files) in one
compressed archive, and the reader that the rebuild scripts use whether a file is loose (a
fresh run) or packed.

    python experiments/pack_results.py experiments/results/training/2026-11-25_auto_precision_h100
    python experiments/pack_results.py --all               # every campaign with loose records
    python experiments/pack_results.py FOLDER --dry-run    # list what would be packed
    python experiments/pack_results.py FOLDER --unpack     # the loose files back (to resume a run)

A campaign folder (``experiments/results/<area>/<campaign>``) keeps its summaries, tables,
READMEs, plots, logs and every ``result.json`` as they are; its per-step records, the
``metrics.jsonl`` of each run and the copies named ``*metrics*.jsonl`` (``.gz`` ones are
stored decompressed), go into ``FOLDER/records.tar.xz`` under their paths relative to
``FOLDER`` and the loose files are removed once the archive reads back the same bytes.

Packing is idempotent and deterministic: members sorted by path, fixed mtime, owner and
mode, xz at preset 9e, so packing the same records again gives the same bytes (a folder
with nothing loose is left alone; new loose records are merged into the archive, and a
loose file that differs from the member of the same path is refused). A run directory whose
``metrics.jsonl`` has no ``result.json`` beside it is unfinished: the folder is refused
unless ``--force``.

``--raw`` packs a folder whole: every file but what a reader checks a claim with (each
``README.md``, and the ``*.md`` pages and ``*.png`` plots at the folder's top) goes into
``FOLDER/records.tar.xz``: logs, JSON, PTX and HLO dumps, scripts, runs' ``compare.md``. A
subfolder with a ``records.tar.xz`` of its own is a campaign packed on its own (pack it
first); a folder of folders, e.g. a topic (``experiments/results/kernels``), can be packed
into one archive. Folders left empty are removed.

    python experiments/pack_results.py --raw experiments/results/kernels

Readers: ``read_text(run_dir)`` / ``read_records(run_dir)`` give a run's ``metrics.jsonl``
from the loose file if there is one, else from the ``records.tar.xz`` of the nearest folder
above the run that has one; ``read_text(folder, name)`` reads any packed file the same
way, and ``find(root, pattern)`` lists the files under ``root``, loose or packed, whose
path matches ``pattern`` (``result.json``, ``seeds*/*/seed*/result.json``). A Markdown link
to a packed file points at the archive, the member after ``#``:
``[gpu_check.json](records.tar.xz#gpu_run42_lab/gpu_check.json)``.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import io
import json
import lzma
import os
import re
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

ARCHIVE = "records.tar.xz"
METRICS = "metrics.jsonl"
RESULT = "result.json"
RESULTS = Path(__file__).resolve().parent / "results"
# per-step records: a run's metrics.jsonl and the copies of it kept under other names
# (bf16_metrics.jsonl, probe_sync_disk.metrics.jsonl, metrics_on.jsonl, ...), gzipped or not
RECORD_NAME = re.compile(r"(^|.*[._-])metrics([._-].*)?\.jsonl(\.gz)?$")


# what stays loose under --raw: the pages and plots a reader checks a claim with
KEPT_NAME = re.compile(r".*\.(md|png)$")


def is_kept_file(rel: str) -> bool:
    """Whether ``--raw`` leaves a file loose, by its path relative to the packed folder:
    every ``README.md``, and the pages and plots (``*.md``, ``*.png``) at the folder's top
    (a topic's tables, notebook and plots); a run's own ``compare.md`` is packed."""
    name = rel.rsplit("/", 1)[-1]
    return name == "README.md" or ("/" not in rel and bool(KEPT_NAME.match(name)))


def is_record_file(name: str) -> bool:
    """Whether a file name is a per-step record file (``metrics.jsonl``, ``*metrics*.jsonl``,
    either gzipped)."""
    return bool(RECORD_NAME.match(name))


# ------------------------------------------------------------------------------- reading


@functools.lru_cache(maxsize=8)
def _members(path: str, size: int, mtime_ns: int) -> dict[str, bytes]:
    """Every member of an archive as ``{relative path: bytes}`` (cached by size and mtime:
    a campaign's runs are read one after the other from one archive)."""
    out = {}
    with tarfile.open(path, "r:xz") as tar:
        for m in tar.getmembers():
            if m.isfile():
                out[m.name] = tar.extractfile(m).read()
    return out


def archive_members(archive: str | os.PathLike) -> dict[str, bytes]:
    """The members of a ``records.tar.xz`` as ``{path relative to its folder: bytes}``."""
    st = os.stat(archive)
    return dict(_members(os.fspath(archive), st.st_size, st.st_mtime_ns))


def _packed(run: Path, name: str) -> tuple[Path, str] | None:
    """``(archive, member)`` holding ``run/name`` in the nearest folder above ``run`` that
    has an archive; None if none does."""
    run = run.resolve()
    for folder in (run, *run.parents):
        archive = folder / ARCHIVE
        if archive.is_file():
            member = (run / name).relative_to(folder).as_posix()
            if member in archive_members(archive):
                return archive, member
            return None  # the campaign's archive, without this run
    return None


def read_bytes(run_dir: str | os.PathLike, name: str = METRICS) -> bytes:
    """The bytes of ``run_dir/name`` (``name`` a record file, ``metrics.jsonl`` by default):
    the loose file if it exists (or its ``.gz``), else the member of the campaign's
    ``records.tar.xz``.

    Raises:
      FileNotFoundError: neither loose nor packed.
    """
    run = Path(run_dir)
    if (run / name).is_file():
        return (run / name).read_bytes()
    if (run / (name + ".gz")).is_file():
        return gzip.decompress((run / (name + ".gz")).read_bytes())
    found = _packed(run, name)
    if found is None:
        raise FileNotFoundError(f"{run / name}: no such file, loose or in a {ARCHIVE} of a "
                                "folder above it")
    archive, member = found
    return archive_members(archive)[member]


def has_records(run_dir: str | os.PathLike, name: str = METRICS) -> bool:
    """Whether ``read_bytes(run_dir, name)`` finds the file."""
    run = Path(run_dir)
    return ((run / name).is_file() or (run / (name + ".gz")).is_file()
            or _packed(run, name) is not None)


def read_text(run_dir: str | os.PathLike, name: str = METRICS) -> str:
    """``read_bytes`` decoded as UTF-8."""
    return read_bytes(run_dir, name).decode("utf-8")


def read_records(run_dir: str | os.PathLike, name: str = METRICS) -> list[dict]:
    """The records (one JSON object a line) of a run's ``metrics.jsonl``, loose or packed;
    lines that do not parse (a torn last record) are skipped, as ``fp4jax.diagnostics``
    does."""
    out = []
    for line in read_text(run_dir, name).splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def find(root: str | os.PathLike, pattern: str) -> list[Path]:
    """The files under ``root``, loose or packed in a ``records.tar.xz`` (of ``root``, of a
    folder above it or of one below it), whose path relative to ``root`` matches the glob
    ``pattern`` part for part (a pattern of one part, e.g. ``result.json``, matches that
    name at any depth, as ``rglob``). Packed ones are named by the path they had; read
    them with ``read_text(path.parent, path.name)``. Sorted, each once."""
    root = Path(root).resolve()
    want = PurePosixPath(pattern)

    def matches(rel: PurePosixPath) -> bool:
        if len(want.parts) > 1 and len(rel.parts) != len(want.parts):
            return False
        return rel.match(pattern)

    found = {p.resolve() for p in root.rglob("*")
             if p.is_file() and matches(PurePosixPath(p.relative_to(root).as_posix()))}
    archives = sorted(root.rglob(ARCHIVE))
    above = next((f / ARCHIVE for f in root.parents if (f / ARCHIVE).is_file()), None)
    if above is not None:
        archives.append(above)
    for archive in archives:
        folder = archive.parent
        for member in archive_members(archive):
            path = folder / member
            if path.is_relative_to(root) and matches(
                    PurePosixPath(path.relative_to(root).as_posix())):
                found.add(path)
    return sorted(found)


def restore(run_dir: str | os.PathLike, dest: str | os.PathLike) -> list[Path]:
    """Writes the packed record files of the run ``run_dir`` into ``dest`` (a copy of the
    run directory), e.g. before a copied run is resumed; loose files of ``run_dir`` are
    copied already. Returns the files written."""
    run = Path(run_dir).resolve()
    written = []
    for folder in (run, *run.parents):
        archive = folder / ARCHIVE
        if archive.is_file():
            prefix = run.relative_to(folder).as_posix()
            prefix = "" if prefix == "." else prefix + "/"
            for member, data in archive_members(archive).items():
                if member.startswith(prefix):
                    path = Path(dest) / member[len(prefix):]
                    if not path.exists():
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_bytes(data)
                        written.append(path)
            break
    return written


# ------------------------------------------------------------------------------- packing


def _loose(folder: Path, raw: bool = False) -> dict[str, Path]:
    """The loose files to pack under ``folder`` as ``{member name: path}``: the record files
    (``.gz`` ones under the name without ``.gz``), or with ``raw`` every file but the kept
    ones (``is_kept_file``) and those of a subfolder with an archive of its own; checkpoints
    and moved-aside attempts included as they are (the caller decides)."""
    out: dict[str, Path] = {}
    own = [p.parent for p in folder.rglob(ARCHIVE) if p.parent != folder] if raw else []
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or path.name in (ARCHIVE, ARCHIVE + ".tmp"):
            continue
        if raw:
            if (is_kept_file(path.relative_to(folder).as_posix())
                    or any(path.is_relative_to(o) for o in own)):
                continue
        elif not is_record_file(path.name):
            continue
        rel = path.relative_to(folder).as_posix()
        name = rel[:-3] if rel.endswith(".gz") and is_record_file(path.name) else rel
        if name in out:
            raise ValueError(f"{folder}: both {name} and {name}.gz; keep one")
        out[name] = path
    return out


def unfinished(folder: Path) -> list[str]:
    """Run directories under ``folder`` with a ``metrics.jsonl`` (loose) but no
    ``result.json``."""
    return sorted(path.parent.relative_to(folder).as_posix()
                  for path in _loose(folder).values()
                  if path.name in (METRICS, METRICS + ".gz")
                  and not (path.parent / RESULT).is_file())


def tar_bytes(members: dict[str, bytes]) -> bytes:
    """A deterministic tar of ``members`` (sorted; mtime 0, uid/gid 0, no owner names, mode
    0644), compressed with xz preset 9e."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(members):
            data = members[name]
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return lzma.compress(buf.getvalue(), format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64,
                         preset=9 | lzma.PRESET_EXTREME)


def pack(folder: str | os.PathLike, force: bool = False, dry_run: bool = False,
         raw: bool = False) -> list[str]:
    """Packs the loose per-step records under ``folder`` (with ``raw``, every file but the
    pages and plots: ``_loose``) into ``folder/records.tar.xz`` (merged with what it holds)
    and removes them, and with ``raw`` the folders left empty; returns the members added
    (empty when there was nothing loose: a repeat changes nothing).

    Raises:
      ValueError: a run is unfinished (no ``result.json``; pass ``force=True``), or a loose
        file differs from the packed member of the same path.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder")
    loose = _loose(folder, raw=raw)
    if not loose:
        return []
    todo = unfinished(folder)
    if todo and not force:
        raise ValueError(f"{folder}: unfinished runs (metrics.jsonl without result.json): "
                         f"{', '.join(todo)}; pack a finished campaign, or pass --force")
    archive = folder / ARCHIVE
    members = archive_members(archive) if archive.is_file() else {}
    added = []
    for name, path in loose.items():
        data = path.read_bytes()
        if path.name.endswith(".gz") and is_record_file(path.name):
            data = gzip.decompress(data)
        if name in members and members[name] != data:
            raise ValueError(f"{path}: differs from {name} in {archive}; move one aside")
        if name not in members:
            added.append(name)
        members[name] = data
    if dry_run:
        return added
    blob = tar_bytes(members)
    tmp = archive.with_name(ARCHIVE + ".tmp")
    tmp.write_bytes(blob)
    with tarfile.open(tmp, "r:xz") as tar:  # read back before anything is removed
        back = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    if back != members:
        tmp.unlink()
        raise RuntimeError(f"{tmp}: did not read back the same records; nothing removed")
    os.replace(tmp, archive)
    for path in loose.values():
        path.unlink()
    if raw:  # the folders the packed files leave empty, deepest first
        for path in sorted({p.parent for p in loose.values()}, key=lambda p: -len(p.parts)):
            while path != folder and path.is_dir() and not any(path.iterdir()):
                path.rmdir()
                path = path.parent
    return added


def unpack(folder: str | os.PathLike) -> list[Path]:
    """Writes the archive's members back as loose files (those absent); the archive stays."""
    folder = Path(folder)
    return restore(folder, folder) if (folder / ARCHIVE).is_file() else []


def campaigns(root: Path = RESULTS) -> Iterator[Path]:
    """The campaign folders (``root/<area>/<campaign>``) that hold loose record files."""
    for area in sorted(p for p in root.iterdir() if p.is_dir()):
        for folder in sorted(p for p in area.iterdir() if p.is_dir()):
            if _loose(folder):
                yield folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("folders", nargs="*", type=Path, help="campaign folders")
    p.add_argument("--all", action="store_true",
                   help="every campaign under experiments/results with loose records")
    p.add_argument("--force", action="store_true", help="pack unfinished runs too")
    p.add_argument("--dry-run", action="store_true", help="list what would be packed")
    p.add_argument("--raw", action="store_true",
                   help="pack every file but the *.md pages and *.png plots (logs, JSON, dumps)")
    p.add_argument("--unpack", action="store_true",
                   help="write the packed records back as loose files (the archive stays)")
    a = p.parse_args(argv)
    if not a.folders and not a.all:
        p.error("give campaign folders or --all")
    folders = [*a.folders, *(campaigns() if a.all else [])]
    rc = 0
    for folder in folders:
        try:
            if a.unpack:
                print(f"{folder}: unpacked {len(unpack(folder))} files")
                continue
            added = pack(folder, force=a.force, dry_run=a.dry_run, raw=a.raw)
        except ValueError as e:
            print(f"pack_results: error: {e}", file=sys.stderr)
            rc = 2
            continue
        verb = "would pack" if a.dry_run else "packed"
        what = "files" if a.raw else "record files"
        print(f"{folder}: {verb} {len(added)} {what}" if added
              else f"{folder}: nothing loose to pack")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
