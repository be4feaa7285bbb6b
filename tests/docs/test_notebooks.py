"""Execute every notebook in notebooks/ top to bottom (nbclient, kernel python3); fail on any error.

Each notebook runs in its own fresh kernel with an empty temporary directory (not notebooks/) as
the working directory: they import only the installed library and find their data through it
(e.g. ``fp4jax.train.data.sonnets_path()``), so they run from anywhere. The kernel does not inherit
the test session's forced 4 CPU devices (conftest.py), so the notebooks see the same single CPU
device a user has; it gets ``FP4JAX_NOTEBOOK_SMOKE=1``, which a notebook that trains reads
for a shorter run (its text says so).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import ROOT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300


def _kernel_env() -> dict[str, str]:
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    # notebooks that train read it for a smaller run (05: 12 steps instead of 40, the same
    # compilations; 75 s of CPU instead of 109 s for its three trainings)
    env["FP4JAX_NOTEBOOK_SMOKE"] = "1"
    return env


def test_notebooks_are_the_readmes_table():
    """notebooks/README.md's table lists exactly the notebooks present (numbered 01, 02, ...
    without gaps, in order), and each is what the README promises: a title cell ``# NN ·``
    first, then, as its first code cell, the install cell that installs the clone when
    ``fp4jax`` is not importable."""
    import re

    names = [p.name for p in NOTEBOOKS]
    assert len(names) >= 6, names
    assert [n[:3] for n in names] == [f"{i:02d}_" for i in range(1, len(names) + 1)], names
    readme = (NOTEBOOKS_DIR / "README.md").read_text()
    rows = re.findall(r"^\| \[`([^`]+\.ipynb)`\]\(([^)]+)\) \|", readme, flags=re.M)
    assert [a for a, _ in rows] == names and [b for _, b in rows] == names, rows
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        first = nb.cells[0]
        assert first.cell_type == "markdown" and first.source.startswith(
            f"# {path.name[:2]} · "), (path.name, first.source[:40])
        code = [c.source for c in nb.cells if c.cell_type == "code"]
        assert 'find_spec("fp4jax") is None' in code[0] and "pip" in code[0], path.name


# notebook 05 trains three micro models: the suite starts it first (conftest)
HEAVY = {"05_train_tiny_model": 95}


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=[pytest.mark.heavy(HEAVY[p.stem])] if p.stem in HEAVY else [])
    for p in NOTEBOOKS], ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path):
    nb = nbformat.read(path, as_version=4)
    stored = [c for c in nb.cells if c.cell_type == "code" and (c.get("outputs") or
                                                                c.get("execution_count"))]
    assert not stored, f"{path.name} is stored with outputs: strip them before committing"
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    # Raises nbclient.exceptions.CellExecutionError (with the cell and traceback) on any error.
    client.execute(env=_kernel_env())
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
