"""The scale ladder's scripts (issue 36, ``experiments/ladder/``): every row is a valid spec,
the corpus builder is deterministic (dedup, bad UTF-8, the split by file), the driver picks
the sweep's LR and skips finished runs, ``analyze.py`` matches an independent NumPy
computation on a synthetic results tree and notices stale tables, and the committed tables
are what ``analyze.py`` makes of the committed results."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from fp4jax.train.config import split_run_spec
from tests import ROOT

LADDER = ROOT / "experiments" / "ladder"


def _load(name):
    if str(LADDER) not in sys.path:
        sys.path.insert(0, str(LADDER))
    spec = importlib.util.spec_from_file_location(name, LADDER / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def L():
    mods = {n: _load(n) for n in ("spec", "build_corpus", "run", "analyze")}
    yield mods
    for n in mods:
        sys.modules.pop(n, None)


def test_rows_are_valid_specs_and_the_counts_add_up(L):
    S = L["spec"]
    for _, sp, seeds, sizes in S.ROWS:
        split_run_spec(sp)
        assert set(sizes) <= set(S.SIZES) and seeds
    pc = {s: S.param_counts(s) for s in S.SIZES}
    for s, c in pc.items():
        mc = S.size_config(s)
        assert c["embedding"] == 2 * S.VOCAB * mc.d_model
        assert c["total"] == c["embedding"] + c["non_embedding"] == mc.num_params()
    ne = [pc[s]["non_embedding"] for s in S.SIZES]
    assert ne == sorted(ne) and 10 <= ne[-1] / ne[0] <= 25  # the issue's ~10-20x span
    names = [r["name"] for ph in ("sweep", "ladder") for r in S.runs(ph)]
    assert len(names) == len(set(names)) == 12 + 3 * 9 + 5 * 2


def test_corpus_is_deterministic_deduplicated_and_split_by_file(L, tmp_path):
    B = L["build_corpus"]
    root = tmp_path / "site"
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / ".hidden").mkdir()
    texts = {f"pkg/m{i:02d}.py": f"def f{i}():\n    return {i} * {i}\n" for i in range(40)}
    for name, t in texts.items():
        (root / name).write_text(t)
    (root / "pkg" / "copy.py").write_text(texts["pkg/m03.py"])  # a duplicate: one kept
    (root / "pkg" / "bad.py").write_bytes(b"x = '\xff\xfe'\n")  # invalid UTF-8
    (root / "pkg" / "empty.py").write_bytes(b"")
    (root / "pkg" / "big.py").write_text("#" * 300)
    (root / "pkg" / "notes.txt").write_text("not python")
    (root / "pkg" / "__pycache__" / "c.py").write_text("skipped")
    (root / ".hidden" / "h.py").write_text("skipped")
    os.symlink(root / "pkg" / "m01.py", root / "pkg" / "link.py")
    (root / "fp4jax").mkdir()  # an installed copy of this project: left out
    (root / "fp4jax" / "x.py").write_text("left out")
    (root / "__editable___fp4jax_finder.py").write_text("MAPPING = {'/a/checkout': 1}")
    m = B.build([root], tmp_path / "a", max_file_bytes=200, val_per_10k=3000, workers=2)
    c = m["counts"]
    assert (c["py_files"], c["duplicates"], c["empty"], c["large"], c["replaced_utf8"]) == \
        (44, 1, 1, 1, 1)
    assert c["kept"] == 41
    rows = [ln.split("\t") for ln in (tmp_path / "a" / "files.tsv").read_text().splitlines()[1:]]
    names = {r[3]: r for r in rows}
    assert "0/pkg/copy.py" in names and "0/pkg/m03.py" not in names  # the first by name
    assert not any("link" in n or "__pycache__" in n or "hidden" in n for n in names)
    for split, size, h16, name in rows:  # the split is the content hash's
        body = (root / name[2:]).read_bytes()
        if name.endswith("bad.py"):
            body = body.decode("utf-8", errors="replace").encode()
        h = hashlib.sha256(body).hexdigest()
        assert h16 == h[:16] and int(size) == len(body)
        assert (split == "val") == B.is_val(h, 3000)
    assert {r[0] for r in rows} == {"train", "val"}
    again = B.build([root], tmp_path / "b", max_file_bytes=200, val_per_10k=3000, workers=1)
    assert again["corpus_sha256"] == m["corpus_sha256"]
    for f in ("train.tar", "val.tar", "files.tsv"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    (root / "pkg" / "m05.py").write_text("changed = 1\n")
    assert B.build([root], tmp_path / "c", 200, 3000)["corpus_sha256"] != m["corpus_sha256"]
    with pytest.raises(ValueError, match="val split holds no file"):
        B.build([root], tmp_path / "d", 200, 0)


def _result(spec, seed, final, cfg=None, steps=(0, 4, 8), tps=1000.0, status="finished"):
    curve = [final + 1.0, final + 0.3, final]
    return {"config": {"recipe": spec, "seed": seed, **(cfg or {})},
            "recipe": spec.split("(")[0], "spec": spec, "seed": seed, "status": status,
            "final_val_loss": final if status == "finished" else None, "steps": 8,
            "tokens_per_s": tps, "device_kind": "test", "preset": "mini", "params": 1,
            "history": {"step": list(steps), "loss": curve, "val_step": list(steps),
                        "val_loss": curve}}


def _tree(L, base):
    S = L["spec"]
    cfg = {"preset": "mini", "seq_len": S.SEQ_LEN, "batch_size": S.BATCH}
    for i, r in enumerate(S.runs("sweep", ("mini",))):
        d = base / "runs" / r["name"]
        d.mkdir(parents=True)
        (d / "result.json").write_text(json.dumps(_result(
            "bf16", 0, 3.0 - 0.1 * (i == 2),
            {**cfg, "lr": r["lr"], "steps": S.run_tokens(r) // S.TOKENS_PER_STEP})))
    finals = {("bf16", 0): 2.50, ("bf16", 1): 2.60, ("bf16", 2): 2.55,
              ("nvfp4", 0): 2.53, ("nvfp4", 1): 2.62, ("nvfp4", 2): 2.59,
              ("mxfp4", 0): 2.56}
    for (sp, s), v in finals.items():
        d = base / "runs" / "ladder" / "mini" / sp / f"seed{s}"
        d.mkdir(parents=True)
        (d / "result.json").write_text(json.dumps(_result(
            sp, s, v, {**cfg, "steps": S.SIZES["mini"]["steps"]})))
    return finals


def test_driver_picks_the_sweeps_lr_and_skips_finished_runs(L, tmp_path, capsys):
    R, S = L["run"], L["spec"]
    _tree(L, tmp_path)
    res = R.known_results(tmp_path)
    assert R.chosen_lr("mini", res) == S.SWEEP["mini"][2] and R.chosen_lr("small", res) is None
    assert R.measured_rates(res)["mini", "nvfp4"] == 1000.0
    assert R.main(["--phases", "sweep:mini", "ladder:mini", "--plan-only", "--gpus", "4",
                   "--results", str(tmp_path), "--work", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    assert "13 runs queued, 11 already finished" in out
    # a result of another setup (a --toy run's micro preset) is not taken for a ladder run
    f = tmp_path / "runs" / "ladder" / "mini" / "mxfp4" / "seed0" / "result.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "config": {"preset": "micro"}}))
    assert R.main(["--phases", "ladder:mini", "--plan-only", "--results", str(tmp_path),
                   "--work", str(tmp_path / "w")]) == 0
    assert "9 runs queued, 6 already finished" in capsys.readouterr().out
    assert "ladder/mini/mxfp4/seed1" in out and "ladder/mini/bf16/seed0 " not in out
    # a run stopped at a call's limit still measures its tokens/s (its metrics.jsonl)
    d = tmp_path / "w" / "runs" / "ladder" / "small" / "mxfp4" / "seed0"
    d.mkdir(parents=True)
    tps = [10.0, 20.0, 30.0, 40.0, 100.0, 300.0, 200.0, 400.0, 500.0, 600.0]
    d.joinpath("metrics.jsonl").write_text("".join(
        json.dumps({"type": "train", "step": i, "tokens_per_s": t}) + "\n"
        for i, t in enumerate(tps)) + '{"type": "eval", "step": 10}\n{"torn')
    assert R.metrics_rate(d) == 400.0 and R.metrics_rate(d.parent) is None
    assert R.record_rates([{"name": "ladder/small/mxfp4/seed0", "tokens_per_s": 400.0},
                           {"name": "ladder/small/mxfp4/seed1", "tokens_per_s": 500.0},
                           {"name": "ladder/small/mxfp4/seed2", "tokens_per_s": None}]) == {
        ("small", "mxfp4"): 500.0}
    argv = R.run_argv({**S.runs("ladder", ("mini",))[0], "lr": 2e-3}, None, Path("T"), Path("O"))
    assert argv[argv.index("--lr") + 1] == "0.002" and "--devices" in argv
    assert R._toy_argv(argv, R.TOY)[argv.index("--preset") + 1] == "micro"


def test_call_files_come_back_as_two_archives(L, tmp_path):
    """A device call returns at most 8 files, two folders down: the runs and the corpus
    travel as ``runs.tar.gz`` and ``corpus.tar.gz`` (members ``runs/<name>/...``), without
    checkpoints or lock files, and unpack into the results layout."""
    import tarfile

    R = L["run"]
    run = tmp_path / "work" / "runs" / "ladder" / "mini" / "bf16" / "seed0"
    (run / "checkpoints" / "8").mkdir(parents=True)
    (run / "checkpoints" / "8" / "state").write_text("big")
    for f in ("result.json", "metrics.jsonl", ".fp4jax-lock"):
        (run / f).write_text(f)
    log = run.parent / "seed0.log"
    log.write_text("log")
    box, out = tmp_path / "box", tmp_path / "out"
    out.mkdir()
    R.copy_back(run, box / "runs" / "ladder" / "mini" / "bf16" / "seed0", log)
    (box / "corpus").mkdir()
    (box / "corpus" / "manifest.json").write_text("{}")
    made = R.pack_out(box, out)
    assert sorted(p.name for p in out.iterdir()) == ["corpus.tar.gz", "runs.tar.gz"] == \
        sorted(p.name for p in made)
    with tarfile.open(out / "runs.tar.gz") as t:
        assert sorted(t.getnames()) == [f"runs/ladder/mini/bf16/seed0/{f}" for f in
                                        ("metrics.jsonl", "result.json", "train.log")]
        assert t.extractfile("runs/ladder/mini/bf16/seed0/train.log").read() == b"log"
    with tarfile.open(out / "corpus.tar.gz") as t:
        assert t.getnames() == ["corpus/manifest.json"]


def test_analyze_matches_numpy_and_notices_stale_tables(L, tmp_path):
    A = L["analyze"]
    finals = _tree(L, tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{A.BEGIN}\n{A.END}\n\nafter\n")
    args = ["--results", str(tmp_path), "--readme", str(readme)]
    assert A.main([*args, "--check"]) == 1  # nothing written yet
    assert A.main(args) == 0
    md = (tmp_path / "TABLES.md").read_text()
    b = np.array([finals["bf16", s] for s in (0, 1, 2)])
    d = np.array([finals["nvfp4", s] for s in (0, 1, 2)]) - b
    se = np.std(d, ddof=1) / np.sqrt(3)
    r = d / b
    assert f"| {d.mean():+.4f} ± {se:.4f} (n=3) |" in md
    assert f"{100 * r.mean():+.2f}% ± {100 * np.std(r, ddof=1) / np.sqrt(3):.2f}%" in md
    nv = np.array([finals["nvfp4", s] for s in (0, 1, 2)])
    assert f"{nv.mean():.4f} ± {np.std(nv, ddof=1):.4f}" in md
    assert "| MXFP4 | `mxfp4` | 1 of 3 | 2.5600 ± n/a | +0.39% | n/a | n/a |" in md
    assert "| small | `small` |" in md and "pending" in md
    assert "| mini | `mini` |" in md and "| 0.004 |" in md  # the sweep's best LR
    text = readme.read_text()
    assert text.startswith("# x\n") and text.endswith("after\n") and "paired" in text
    for f in ("gap_vs_size.png", "gap_over_training.png", "curves_mini.png"):
        assert (tmp_path / f).stat().st_size > 5_000
    assert A.main([*args, "--check"]) == 0
    f = tmp_path / "runs" / "ladder" / "mini" / "nvfp4" / "seed1" / "result.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "final_val_loss": 2.70}))
    assert A.main([*args, "--check"]) == 1


def test_analyze_and_driver_read_packed_and_loose_runs_alike(L, tmp_path):
    """Packed run folders (``pack_results.py --raw runs calls``) and loose ones beside them
    (a new call's runs) give the same tables, results and driver records; packing the new
    ones merges them, and a repeat packs nothing."""
    import shutil

    A, R = L["analyze"], L["run"]
    P = A.pack_results
    _tree(L, tmp_path)
    (tmp_path / "calls" / "01").mkdir(parents=True)
    (tmp_path / "calls" / "01" / "driver.json").write_text(json.dumps(
        {"runs": [{"name": "ladder/mini/bf16/seed0", "tokens_per_s": 900.0}]}))
    (tmp_path / "calls" / "01" / "driver.log").write_text("log\n")
    for name in ("metrics.jsonl", "train.log"):
        (tmp_path / "runs" / "ladder" / "mini" / "bf16" / "seed0" / name).write_text("{}\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"{A.BEGIN}\n{A.END}\n")
    args = ["--results", str(tmp_path), "--readme", str(readme), "--no-plots"]
    assert A.main(args) == 0
    md = (tmp_path / "TABLES.md").read_text()
    res, recs = R.known_results(tmp_path), R.driver_records(tmp_path)
    new = tmp_path / "runs" / "ladder" / "mini" / "mxfp4" / "seed0"
    shutil.move(new, tmp_path / "aside")  # the run a later call brings
    assert len(P.pack(tmp_path / "runs", raw=True)) == len(res) - 1 + 2  # + log, metrics
    assert len(P.pack(tmp_path / "calls", raw=True)) == 2
    assert [p.name for p in (tmp_path / "runs").rglob("*") if p.is_file()] == [P.ARCHIVE]
    assert not (tmp_path / "calls" / "01").exists()
    shutil.move(tmp_path / "aside", new)  # loose, beside the packed runs
    assert A.load(tmp_path) == res and R.known_results(tmp_path) == res
    assert R.driver_records(tmp_path) == recs
    assert A.main([*args, "--check"]) == 0 and (tmp_path / "TABLES.md").read_text() == md
    assert P.pack(tmp_path / "runs", raw=True) == ["ladder/mini/mxfp4/seed0/result.json"]
    assert A.main([*args, "--check"]) == 0 and A.load(tmp_path) == res
    assert P.pack(tmp_path / "runs", raw=True) == []
    assert R.finished(new)["spec"] == "mxfp4"
    # a loose result that differs from its packed copy is refused, not merged
    new.mkdir(parents=True)
    (new / "result.json").write_text(json.dumps({**res["ladder/mini/mxfp4/seed0"],
                                                 "final_val_loss": 9.0}))
    with pytest.raises(ValueError, match="differs"):
        P.pack(tmp_path / "runs", raw=True)


def test_committed_ladder_tables_are_current(L):
    """``analyze.py --check`` on the committed results (pending rows while none ran)."""
    A = L["analyze"]
    if not (A.RESULTS / "TABLES.md").is_file():
        pytest.skip("no ladder tables committed yet")
    assert A.main(["--check", "--no-plots"]) == 0
