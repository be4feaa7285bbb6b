"""``experiments/pack_results.py`` (issue 38): a campaign's per-step records packed into one
``records.tar.xz`` read back as the loose files were, packing is deterministic and
idempotent, unfinished runs are refused, and the committed campaigns are read from their
archives."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from pathlib import Path

import pytest

from tests import ROOT


@pytest.fixture(scope="module")
def P():
    spec = importlib.util.spec_from_file_location("pack_results",
                                                  ROOT / "experiments" / "pack_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _campaign(root: Path, stamp: int = 0) -> dict[str, bytes]:
    """Two finished runs (one gzipped), a nested warm-up run and a renamed copy; returns the
    record files' expected contents by member name."""
    want = {}
    for i, rel in enumerate(["a/seed0", "a/seed1", "b/seed0/bf16_warmup"]):
        run = root / rel
        run.mkdir(parents=True)
        recs = [{"type": "train", "step": s, "loss": 5.0 - 0.1 * s - i} for s in range(4)]
        text = "".join(json.dumps(r) + "\n" for r in recs) + '{"type": "tra'  # torn last line
        data = text.encode()
        if rel == "a/seed1":
            (run / "metrics.jsonl.gz").write_bytes(gzip.compress(data, mtime=stamp))
        else:
            (run / "metrics.jsonl").write_bytes(data)
        (run / "result.json").write_text(json.dumps({"status": "finished", "seed": i}))
        want[f"{rel}/metrics.jsonl"] = data
    (root / "probe_sync.metrics.jsonl").write_text('{"type": "checkpoint", "seconds": 4.5}\n')
    want["probe_sync.metrics.jsonl"] = (root / "probe_sync.metrics.jsonl").read_bytes()
    (root / "README.md").write_text("# a campaign\n")
    (root / "probe_summaries.jsonl").write_text("{}\n")  # a summary: stays loose
    for p in root.rglob("*"):
        os.utime(p, (1e9 + stamp, 1e9 + stamp))
    return want


def test_packed_records_read_as_loose_ones(P, tmp_path):
    c = tmp_path / "c"
    want = _campaign(c)
    runs = ["a/seed0", "a/seed1", "b/seed0/bf16_warmup"]
    loose = {r: P.read_records(c / r) for r in runs}
    assert [x["step"] for x in loose["a/seed1"]] == [0, 1, 2, 3]  # gz read, torn line skipped
    assert sorted(P.pack(c)) == sorted(want)
    assert P.archive_members(c / P.ARCHIVE) == want
    assert not [p for p in c.rglob("*metrics*") if p.name != P.ARCHIVE]  # loose ones gone
    assert all((c / r / "result.json").is_file() for r in runs)
    assert (c / "README.md").is_file() and (c / "probe_summaries.jsonl").is_file()
    assert {r: P.read_records(c / r) for r in runs} == loose
    assert P.read_bytes(c, "probe_sync.metrics.jsonl") == want["probe_sync.metrics.jsonl"]
    assert P.has_records(c / "a/seed0") and not P.has_records(c / "a/seed9")
    with pytest.raises(FileNotFoundError, match="a/seed9/metrics.jsonl"):
        P.read_records(c / "a/seed9")
    copy = tmp_path / "copy"
    copy.mkdir()
    assert [p.name for p in P.restore(c / "a/seed0", copy)] == ["metrics.jsonl"]
    assert (copy / "metrics.jsonl").read_bytes() == want["a/seed0/metrics.jsonl"]


def test_pack_is_deterministic_and_idempotent(P, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    _campaign(one, stamp=0)
    _campaign(two, stamp=12345)  # other mtimes, other gzip header
    P.pack(one), P.pack(two)
    blob = (one / P.ARCHIVE).read_bytes()
    assert (two / P.ARCHIVE).read_bytes() == blob
    assert P.pack(one) == [] and (one / P.ARCHIVE).read_bytes() == blob  # nothing loose
    assert len(P.unpack(one)) == 4 and P.pack(one) == []  # unpacked = packed: merged as-is
    assert (one / P.ARCHIVE).read_bytes() == blob
    (one / "c" / "seed0").mkdir(parents=True)  # a run added later: merged in
    (one / "c" / "seed0" / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match=r"unfinished runs .*c/seed0; .*--force"):
        P.pack(one)
    assert (one / P.ARCHIVE).read_bytes() == blob  # refused before anything changed
    (one / "c" / "seed0" / "result.json").write_text("{}")
    assert P.pack(one) == ["c/seed0/metrics.jsonl"]
    assert P.read_records(one / "c" / "seed0") == [{"step": 0}]
    (one / "a" / "seed0" / "metrics.jsonl").write_text("{}\n")  # differs from the packed one
    with pytest.raises(ValueError, match="differs from a/seed0/metrics.jsonl"):
        P.pack(one)


def test_cli_and_committed_campaigns(P, tmp_path, capsys):
    c = tmp_path / "c"
    _campaign(c)
    assert P.main([str(c), "--dry-run"]) == 0 and not (c / P.ARCHIVE).exists()
    assert "would pack 4 record files" in capsys.readouterr().out
    assert P.main([str(c)]) == 0 and P.main([str(c)]) == 0
    assert "nothing loose to pack" in capsys.readouterr().out
    # every finished committed campaign is packed, and its runs read from the archive
    assert [str(f) for f in P.campaigns() if not P.unfinished(f)] == []
    ap = P.RESULTS / "training" / "2026-11-25_auto_precision_h100" / "quality"
    recs = P.read_records(ap / "nvfp4_switch_at-auto_switch-bwd_grad_noise_every-10_"
                          "switch_window-50" / "seed0")
    res = json.loads(P.read_text(ap / "nvfp4" / "seed0", "result.json"))
    assert sum(r["type"] == "grad_noise" for r in recs) > 10
    assert [r["step"] for r in P.read_records(ap / "nvfp4" / "seed0")
            if r["type"] == "eval"] == res["history"]["val_step"]


def test_raw_pack_keeps_pages_and_plots_and_finds_packed_files(P, tmp_path):
    """``--raw`` packs a topic folder whole but its READMEs and top-level pages and plots;
    a subfolder with its own archive is left to it; ``find`` lists loose and packed files
    alike, ``read_text`` reads either, and a repeat changes nothing."""
    topic = tmp_path / "topic"
    want = {f"c/{k}": v for k, v in _campaign(topic / "c").items()}
    (topic / "NOTES.md").write_text("# notebook\n")
    (topic / "plot.png").write_bytes(b"\x89PNG")
    (topic / "old_run").mkdir()
    (topic / "old_run" / "gpu_check.json").write_text('{"pass": 3}')
    (topic / "old_run" / "step.log.gz").write_bytes(gzip.compress(b"log", mtime=0))
    (topic / "c" / "compare.md").write_text("| a |\n")
    own = topic / "own"
    _campaign(own)
    P.pack(own)
    own_blob = (own / P.ARCHIVE).read_bytes()
    before = {p.relative_to(topic).as_posix(): p.read_bytes()
              for p in topic.rglob("*") if p.is_file() and not p.is_relative_to(own)}
    added = P.pack(topic, raw=True)
    assert "old_run/gpu_check.json" in added and "c/compare.md" in added
    assert "old_run/step.log.gz" in added  # not a record file: stored as it is
    assert not (topic / "old_run").exists() and (topic / "c" / "README.md").is_file()
    assert (topic / "NOTES.md").is_file() and (topic / "plot.png").is_file()
    assert (own / P.ARCHIVE).read_bytes() == own_blob  # a campaign with its own archive
    members = P.archive_members(topic / P.ARCHIVE)
    assert all(members[k] == v for k, v in want.items())
    for rel, data in before.items():  # every byte it replaced
        if rel.endswith("metrics.jsonl.gz"):
            assert members[rel[:-3]] == gzip.decompress(data)
        elif not (topic / rel).is_file():
            assert members[rel] == data
    blob = (topic / P.ARCHIVE).read_bytes()
    assert P.pack(topic, raw=True) == [] and (topic / P.ARCHIVE).read_bytes() == blob
    found = [p.relative_to(topic).as_posix() for p in P.find(topic, "result.json")]
    assert found == ["c/a/seed0/result.json", "c/a/seed1/result.json",
                     "c/b/seed0/bf16_warmup/result.json", "own/a/seed0/result.json",
                     "own/a/seed1/result.json", "own/b/seed0/bf16_warmup/result.json"]
    assert [p.name for p in P.find(topic / "c", "a/seed*/result.json")] == ["result.json"] * 2
    assert P.read_text(topic / "old_run", "gpu_check.json") == '{"pass": 3}'
    assert P.read_records(topic / "c" / "a" / "seed0") == P.read_records(own / "a" / "seed0")
