"""A small deterministic English-like corpus for tests (no network, no fixtures on disk)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

_WORDS = (
    "the king queen lord lady good sweet fair night day love heart death life time man world "
    "shall will thou thee thy art hath doth what where when why how come go speak hear see "
    "o my mine your our their this that with from upon against before after never ever"
).split()


def make_text(n_bytes: int = 60_000, seed: int = 0) -> str:
    """Lines of pseudo-verse drawn from a fixed vocabulary: learnable, deterministic."""
    rng = np.random.default_rng(seed)
    out, size = [], 0
    while size < n_bytes:
        words = rng.choice(_WORDS, size=int(rng.integers(4, 10)))
        line = " ".join(words).capitalize() + rng.choice([",", ".", ";", "!", "?"]) + "\n"
        out.append(line)
        size += len(line)
    return "".join(out)[:n_bytes]


def write_text(path: Path, n_bytes: int = 60_000, seed: int = 0) -> Path:
    path.write_text(make_text(n_bytes, seed))
    return path
