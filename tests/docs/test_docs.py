"""The user-facing docs work: the README's Python example runs, and every relative link in
the Markdown pages (README, docs/, the kernels, experiments and notebooks pages) points to
a file or folder that exists in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         ROOT / "pallas_kernels" / "README.md", ROOT / "notebooks" / "README.md",
         ROOT / "experiments" / "README.md", ROOT / "experiments" / "results" / "README.md"]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_example_runs():
    blocks = _python_blocks((ROOT / "README.md").read_text())
    assert blocks, "README.md has no ```python example"
    ns: dict = {}
    exec(compile(blocks[0], "README.md example", "exec"), ns)  # noqa: S102
    y, dx, dw = ns["y"], ns["dx"], ns["dw"]
    assert y.shape == (8, 128, 256) and dx.shape == (8, 128, 512) and dw.shape == (512, 256)
    assert ns["ablation"].name == "nvfp4-no-sr-no-rht"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path):
    assert page.exists(), f"{page.relative_to(ROOT)} is missing"
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://|mailto:|#", target):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"
