"""A refused harness call leaves nothing behind: ``--resume`` with nothing to resume creates no
run directory (no lock, no checkpoint folder) and compiles nothing; ``fp4jax-tokenize`` into
an ``--out`` that holds other files reads no corpus and trains no vocabulary (no cache
written), and the ``--out`` keeps its files."""

from __future__ import annotations

import pytest

from fp4jax import train as T
from fp4jax.train import loop
from fp4jax.train import tokens as TK
from tests.textdata import write_text


@pytest.mark.parametrize("make", ["missing", "empty", "checkpoints_empty"])
def test_resume_with_nothing_to_resume_leaves_nothing(make, tmp_path, monkeypatch):
    out = tmp_path / "run"
    if make != "missing":
        out.mkdir()
    if make == "checkpoints_empty":
        (out / "checkpoints").mkdir()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    # refused before the data, the model and the compiled steps (which would raise here)
    monkeypatch.setattr(loop, "load_data", lambda *a: pytest.fail("data loaded"))
    cfg = T.TrainConfig(preset="micro", steps=2, resume=True, out=str(out), progress=False)
    with pytest.raises(ValueError, match=r"--resume: no checkpoint in .*nothing to resume"):
        T.train(cfg)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_resume_cli_refusal_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        T.main(["--resume", "--out", str(out), "--preset", "micro", "--steps", "2",
                "--no-progress", "--compile-cache", "off"])
    assert e.value.code == 2 and "nothing to resume" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_tokenize_into_foreign_out_reads_and_trains_nothing(tokenizer, tmp_path, monkeypatch):
    corpus = write_text(tmp_path / "c.txt", 5_000)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    cache = tmp_path / "cache"
    monkeypatch.setattr(TK, "load_documents", lambda *a: pytest.fail("corpus read"))
    with pytest.raises(FileExistsError, match="holds other files.*--overwrite"):
        TK.tokenize_corpus(str(corpus), tokenizer, out, cache=cache)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert not cache.exists()
    assert not any(p.name.startswith("out.") for p in tmp_path.iterdir())  # no tmp, no aside
