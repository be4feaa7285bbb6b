"""Quantization error of NVFP4, MXFP4 and BF16 on real-looking tensors (a CPU demo).

Prints one row per (tensor, format): relative RMS error, signal-to-noise ratio,
and the share of non-zero values that quantize to zero. Run:

    python experiments/quant_error_demo.py [--rows 1024 --cols 1024 --seed 0]
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

import fp4jax


def tensors(rows: int, cols: int, seed: int) -> dict[str, np.ndarray]:
    """Gaussian, heavy-tailed (Student-t, 3 dof) and Gaussian with 0.1% outliers at 50 sigma."""
    r = np.random.default_rng(seed)
    g = r.standard_normal((rows, cols))
    outl = g.copy()
    mask = r.random((rows, cols)) < 1e-3
    outl[mask] = 50.0 * np.sign(g[mask])
    return {
        "gaussian": g.astype(np.float32),
        "heavy-tailed (t3)": r.standard_t(3.0, (rows, cols)).astype(np.float32),
        "outliers (0.1% at 50s)": outl.astype(np.float32),
    }


def errors(x: np.ndarray, xh: np.ndarray) -> tuple[float, float, float]:
    err = xh.astype(np.float64) - x
    rel = float(np.sqrt(np.mean(err**2) / np.mean(x.astype(np.float64) ** 2)))
    snr = float(-20 * np.log10(rel)) if rel > 0 else float("inf")
    nz = x != 0
    flushed = float(np.mean(xh[nz] == 0))
    return rel, snr, flushed


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    fmts = {"NVFP4": fp4jax.NVFP4, "MXFP4": fp4jax.MXFP4, "MXFP4 (OCP)": fp4jax.MXFP4_OCP}
    rows = []
    print(f"{'tensor':<24} {'format':<12} {'rel. RMS err':>12} {'SNR dB':>8} {'-> zero':>8}")
    print("-" * 68)
    for tname, x in tensors(a.rows, a.cols, a.seed).items():
        xj = jnp.asarray(x)
        outs = {"BF16": np.asarray(xj.astype(jnp.bfloat16).astype(jnp.float32))}
        for fname, fmt in fmts.items():
            outs[fname] = np.asarray(fp4jax.dequantize(fp4jax.quantize(xj, fmt)))
        for fname, xh in outs.items():
            rel, snr, flushed = errors(x, xh)
            rows.append(dict(tensor=tname, format=fname, rel_rms=rel, snr_db=snr, zero=flushed))
            print(f"{tname:<24} {fname:<12} {rel:>12.4f} {snr:>8.2f} {flushed:>8.2%}")
        print()
    return rows


if __name__ == "__main__":
    main()
