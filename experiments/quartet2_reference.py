"""Quartet II's MS-EDEN, transcribed into CPU PyTorch, against fp4jax's ``ms_eden`` (issue 20).

Transcriptions (of THEIR code, for comparison only; never imported by fp4jax) from
IST-DASLab/Quartet-II commit 8776a90b7aa0c0a400ad858a3c05a66f7ec55b73 (Apache-2.0, the
license named in its ``kernels/pyproject.toml`` and the SPDX headers of its CUDA files;
Copyright (c) 2025-2026 IST Austria):

* ``triton_eden``: ``src/models/quantization/schemes/quartet_2.py``, ``eden_1x16s_fp4_kernel``
  (the Triton kernel ``Quartet_II_fn.backward`` calls through
  ``eden_1x16s_fp4_kernel_wrapper``), from ``# group`` to ``x_dequantized``, line by line in
  torch float32 ops. Left out: the fused Hadamard product and the ``atomic_max`` of the next
  amax (the input here is already rotated and its amax is passed in, as the non-delayed
  ``current_amax`` is in ``Quartet_II_fn.backward``); ``tl.rand(seed, offsets)`` is replaced by
  uniforms passed in (``u``); the output cast to the input dtype is left out (float32 here).
* ``torch_eden``: ``src/models/quantization/quantizers/eden.py``, ``EdenSRQuantizer.forward``'s
  pure-torch branch for ``scale_dtype="e4m3"``, ``unbiased="eden"`` (``rtn_fp4``,
  ``round_scales``, ``apply_correction`` -> ``sr_e4m3``), ``torch.bernoulli(p) == 1``
  replaced by ``u < p`` (the same law, with the uniforms passed in). In their code this
  branch is shadowed by the Triton call for e4m3 + eden; it is their only pure-PyTorch
  MS-EDEN, so it is run too.

Modes of this script (run from the repository root with a venv that has torch and numpy):

    python experiments/quartet2_reference.py compare --fp4jax /tmp/ms_eden_fp4jax.npz
        the same x, amax and uniforms as fp4jax (experiments/ms_eden_dump.py): field-by-field
        comparison, and the test's bias statistic for both on the same draws.
    python experiments/quartet2_reference.py bias --fp4jax /tmp/ms_eden_fp4jax.npz --keys 65536
        their algorithm with torch's own randomness (random signs as in
        ``rerotate_hadamard``, ``torch.rand`` uniforms), and the decomposition variants.
    python experiments/quartet2_reference.py mechanism --fp4jax /tmp/ms_eden_fp4jax.npz
        the identity behind the residual bias and the block statistics that drive it.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

F32 = torch.float32
BACKWARD_SCALE_OVERRIDE = (17 / 16) * 0.93  # Quartet_II_fn.backward_scale_override


# ---------------------------------------------------------------------------------------
# Transcription 1: the Triton kernel eden_1x16s_fp4_kernel (schemes/quartet_2.py)
# ---------------------------------------------------------------------------------------

def _rtn_fp4_thresholds(x_scaled):
    """The kernel's nested tl.where: round to the E2M1 grid, ties away from zero."""
    x_scaled_abs = torch.abs(x_scaled)
    x_scaled_sign = torch.where(x_scaled > 0, 1.0, -1.0).to(F32)
    t = torch.where(x_scaled_abs >= 0.25, 0.5, 0.0)
    t = torch.where(x_scaled_abs >= 0.75, 1.0, t)
    t = torch.where(x_scaled_abs >= 1.25, 1.5, t)
    t = torch.where(x_scaled_abs >= 1.75, 2.0, t)
    t = torch.where(x_scaled_abs >= 2.5, 3.0, t)
    t = torch.where(x_scaled_abs >= 3.5, 4.0, t)
    t = torch.where(x_scaled_abs >= 5, 6.0, t)
    return t.to(F32) * x_scaled_sign


def _e4m3_bits(v):
    return v.to(torch.float8_e4m3fn).view(torch.uint8)


def _from_bits(b):
    return b.view(torch.float8_e4m3fn).to(F32)


def triton_eden(x_had, amax, u, *, scale_override=BACKWARD_SCALE_OVERRIDE, hadamard_dim=128,
                group_size=16, sum_dtype=F32, correction_domain="scaled", stochastic=True):
    """x_had: (..., n) float32 rotated values, n a multiple of hadamard_dim; amax: (...,)
    float32, one per leading index (a tensor's amax); u: (..., n // group_size) uniforms.

    Variants (not in their code; for the decomposition of the bias): ``correction_domain=
    "original"`` computes c = <y, y> / <y, q * s_b> on the unscaled values instead of the
    block-scaled ones; ``"block"`` computes one c per block of 16; ``"none"`` skips the
    correction (RTN). ``stochastic=False`` keeps the corrected scale in float32 (the
    expectation of the stochastic rounding).
    Returns a dict of every intermediate."""
    lead = x_had.shape[:-1]
    n = x_had.shape[-1]
    x_grouped = x_had.reshape(*lead, n // group_size, group_size)

    scales_max = torch.tensor(255.99, dtype=F32)  # constexpr float -> fp32
    val_max = torch.tensor(6.0 / scale_override, dtype=F32)
    amax = amax.to(F32).reshape(*lead, 1, 1)
    s_dec = torch.where(amax == 0.0, torch.tensor(1.0, dtype=F32), amax / scales_max / val_max)

    s_dec_b = torch.amax(torch.abs(x_grouped), dim=-1, keepdim=True) / val_max
    s_dec_b_e4m3 = (s_dec_b / s_dec).to(torch.float8_e4m3fn).to(F32)
    s_dec_b_e4m3 = torch.where(s_dec_b_e4m3 == 0, torch.tensor(1.0, dtype=F32), s_dec_b_e4m3)
    x_scaled = x_grouped / (s_dec_b_e4m3 * s_dec)

    x_fp4 = _rtn_fp4_thresholds(x_scaled)

    # Calculate EDEN scale
    per = hadamard_dim // group_size
    xs = x_scaled.reshape(*lead, n // hadamard_dim, hadamard_dim).to(sum_dtype)
    xq = x_fp4.reshape(*lead, n // hadamard_dim, hadamard_dim).to(sum_dtype)
    if correction_domain == "original":  # not theirs: <y, y> / <y, q s_b> on unscaled y
        sb = s_dec_b_e4m3.reshape(*lead, n // hadamard_dim, per, 1).expand(
            *lead, n // hadamard_dim, per, group_size).reshape(xs.shape).to(sum_dtype)
        xs, xq = xs * sb, xq * sb
    if correction_domain == "block":  # not theirs here: one c per block of 16
        xs = xs.reshape(*lead, n // group_size, group_size)
        xq = xq.reshape(*lead, n // group_size, group_size)
    num = torch.sum(xs * xs, dim=-1, keepdim=True)
    denom = torch.sum(xs * xq, dim=-1, keepdim=True)
    correction = torch.where(denom == 0.0, torch.ones_like(num), num / denom).to(F32)
    if correction_domain == "none":
        correction = torch.ones_like(correction)

    # Apply EDEN scale
    if correction_domain == "block":
        corrected_scales = s_dec_b_e4m3 * correction
    else:
        scales = s_dec_b_e4m3.reshape(*lead, n // hadamard_dim, per)
        corrected_scales = (scales * correction).reshape(*lead, n // group_size, 1)

    bitscales = _e4m3_bits(corrected_scales)
    prevscale = _from_bits(bitscales - 1)
    currscale = _from_bits(bitscales)
    nextscale = _from_bits(bitscales + 1)
    up = torch.where(currscale > corrected_scales, currscale, nextscale)
    down = torch.where(currscale > corrected_scales, prevscale, currscale)
    prob_up = (corrected_scales - down) / (up - down)
    sampled_prob = u.to(F32).reshape(*lead, n // group_size, 1)
    scales = torch.where(sampled_prob < prob_up, up, down)
    if not stochastic:
        scales = corrected_scales

    x_dequantized = x_fp4 * scales * s_dec
    return dict(dec=s_dec.reshape(lead), s_rn=s_dec_b_e4m3.reshape(*lead, -1),
                c=correction.reshape(*lead, -1), sc=corrected_scales.reshape(*lead, -1),
                q=x_fp4.reshape(*lead, n), s=scales.reshape(*lead, -1),
                deq=x_dequantized.reshape(*lead, n), x_scaled=x_scaled.reshape(*lead, n))


# ---------------------------------------------------------------------------------------
# Transcription 2: EdenSRQuantizer's pure-torch e4m3/eden branch (quantizers/eden.py)
# ---------------------------------------------------------------------------------------

GRID = torch.tensor([-6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0,
                     0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # EdenSRQuantizer.grid


def rtn_fp4(x, grid):
    inds = torch.bucketize(x, grid)
    lo = torch.clamp(inds - 1, min=0, max=15)
    hi = torch.clamp(inds, min=0, max=15)
    low = grid[lo]
    high = grid[hi]
    return torch.where((high - x) <= (x - low), high, low)


def sr_e4m3(x, u):
    x = torch.clamp(x, -447.99, 447.99)
    q = x.to(torch.float8_e4m3fn)
    nextdq = (q.view(torch.uint8) + 1).view(torch.float8_e4m3fn).float()
    prevdq = (q.view(torch.uint8) - 1).view(torch.float8_e4m3fn).float()
    dq = q.float()
    low = torch.where(dq > x, prevdq, dq)
    high = torch.where(dq > x, dq, nextdq)
    return torch.where(u < (x - low) / (high - low), high, low)  # bernoulli(p) == 1


def torch_eden(x_had, u, *, scale_override=0.93, hadamard_dim=128, group_dim=16):
    """x_had: (T, n) one tensor per leading index t (each its own amax = scales.max());
    u: (T, n // group_dim). EdenSRQuantizer(hadamard_dim=128, group_dim=16,
    scale_dtype="e4m3", unbiased="eden", scale_override=0.93): the notebook's setting."""
    outs = []
    grid = GRID.to(F32)
    for t in range(x_had.shape[0]):
        xh = x_had[t].reshape(-1, group_dim)
        scales = xh.abs().max(dim=-1, keepdim=True)[0]
        # round_scales(scales, "eden"), scale_dtype "e4m3"
        scales_max = 255.99
        val_max = 6.0 / scale_override * (16 / 17)
        amax = scales.max()
        s_dec = torch.where(amax == 0.0, 1.0, amax / scales_max / val_max)
        s_dec_b = scales / val_max
        s_dec_b_e4m3 = (s_dec_b / s_dec).to(torch.float8_e4m3fn).float()
        s_dec_b_e4m3 = torch.where(s_dec_b_e4m3 == 0, 1.0, s_dec_b_e4m3)
        scales, global_scale = s_dec_b_e4m3, s_dec
        x_scaled = xh / scales / global_scale
        x_fp4 = rtn_fp4(x_scaled, grid)
        x_fp4 = x_fp4.view(-1, hadamard_dim)
        x_scaled = x_scaled.view(-1, hadamard_dim)
        num = (x_scaled * x_scaled).sum(dim=-1, keepdim=True)
        denom = (x_scaled * x_fp4).sum(dim=-1, keepdim=True)
        correction = num / denom
        correction = torch.where(correction.isnan(), 1.0, correction)
        s_rn = scales
        # apply_correction
        scales = scales.view(correction.size(0), -1)
        corrected_scales = (scales * correction).view(-1, 1)
        scales = sr_e4m3(corrected_scales, u[t].reshape(-1, 1))
        x_fp4 = x_fp4.view(-1, group_dim)
        outs.append(dict(dec=global_scale, s_rn=s_rn.reshape(-1), c=correction.reshape(-1),
                         sc=corrected_scales.reshape(-1), q=x_fp4.reshape(-1),
                         s=scales.reshape(-1), deq=(x_fp4 * scales * global_scale).reshape(-1)))
    return {k: torch.stack([o[k] for o in outs]) for k in outs[0]}


# ---------------------------------------------------------------------------------------
# Comparison helpers
# ---------------------------------------------------------------------------------------

def hadamard(n=128):
    """scipy.linalg.hadamard(n) * n**-0.5 (Sylvester), their get_hadamard_matrix."""
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return torch.tensor(h / np.sqrt(n), dtype=F32)


def cmp(a, b):
    """Bitwise-equal count and max relative difference of two float arrays."""
    a = np.asarray(a, np.float32).ravel()
    b = np.asarray(b, np.float32).ravel()
    eq = (a.view(np.uint32) == b.view(np.uint32)) | ((a == 0) & (b == 0))
    den = np.maximum(np.abs(a), np.abs(b))
    rel = np.where(den > 0, np.abs(a.astype(np.float64) - b) / np.where(den > 0, den, 1), 0)
    return dict(n=int(a.size), bit_equal=int(eq.sum()), max_rel_diff=float(rel.max()))


def shrink_stats(back, x):
    """The test's statistics: shrink = <mean, x>/<x, x> - 1 and the rms z-score, plus the
    standard error of the shrink (from the per-draw shrinks)."""
    back = np.asarray(back, np.float64)
    x = np.asarray(x, np.float64)
    k = back.shape[0]
    mean = back.mean(0)
    se = back.std(0) / np.sqrt(k)
    per_draw = np.einsum("kij,ij->k", back, x) / np.sum(x * x) - 1
    return dict(keys=k, shrink=float(np.sum(mean * x) / np.sum(x * x) - 1),
                shrink_se=float(per_draw.std(ddof=1) / np.sqrt(k)),
                z=float(np.sqrt(np.mean(((mean - x) / np.where(se > 0, se, 1)) ** 2))))


def back_rotate(deq, signs, h):
    """fp4jax's test: (deq @ H) * signs per 128-tile (H symmetric)."""
    k = deq.shape[0]
    t = deq.reshape(k, 2, 2, 128) @ h
    return (t * signs.reshape(k, 1, 1, 128)).reshape(k, 2, 256)


def compare(args):
    d = dict(np.load(args.fp4jax))
    xr = torch.from_numpy(d["xr"])  # (K, 2, 256)
    k = xr.shape[0]
    amax = torch.from_numpy(d["amax"])
    u = torch.from_numpy(d["u"])  # (K, 2, 16)
    flat = xr.reshape(k, 512)
    uf = u.reshape(k, 32)
    out = {}
    res = {}
    res["triton"] = {kk: v.numpy() for kk, v in triton_eden(flat, amax, uf).items()}
    res["triton_f64sums"] = {kk: v.numpy() for kk, v in
                             triton_eden(flat, amax, uf, sum_dtype=torch.float64).items()}
    res["torch"] = {kk: v.numpy() for kk, v in torch_eden(flat, uf).items()}
    fj = dict(dec=d["dec"], s_rn=d["s_rn"], c=d["c"], sc=d["sc"], q=d["q"], s=d["s"],
              deq=d["deq"])
    for name, r in res.items():
        out[name] = {f: cmp(fj[f], r[f]) for f in fj}
    # the differing elements: are they exact ties of the E2M1 rounding?
    xs = res["triton"]["x_scaled"].reshape(k, 2, 256)
    diff = d["q"] != res["triton"]["q"].reshape(k, 2, 256)
    ties = np.isin(np.abs(xs[diff]), [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    out["q_differences"] = dict(count=int(diff.sum()), at_exact_ties=int(ties.sum()),
                                values=sorted(set(np.abs(xs[diff]).tolist()))[:10])
    # SR decisions with the same uniforms, and the expectation over the uniforms
    h = hadamard()
    signs = torch.from_numpy(d["signs"])
    x = d["x"]
    stats = {"fp4jax (dump)": shrink_stats(d["back"], x)}
    for name in ("triton", "torch"):
        deq = torch.from_numpy(res[name]["deq"].reshape(k, 2, 256))
        stats[name] = shrink_stats(back_rotate(deq, signs, h).numpy(), x)
        # expectation over the scale rounding: q * (s*c) * dec
        e = (torch.from_numpy(res[name]["q"]).reshape(k, 32, 16)
             * torch.from_numpy(res[name]["sc"]).reshape(k, 32, 1)
             * torch.from_numpy(np.asarray(res[name]["dec"])).reshape(k, 1, 1))
        stats[name + " E_u"] = shrink_stats(back_rotate(e.reshape(k, 2, 256), signs, h).numpy(),
                                            x)
    e = (torch.from_numpy(d["q"]).reshape(k, 32, 16) * torch.from_numpy(d["sc"]).reshape(k, 32, 1)
         * torch.from_numpy(d["dec"]).reshape(k, 1, 1))
    stats["fp4jax E_u"] = shrink_stats(back_rotate(e.reshape(k, 2, 256), signs, h).numpy(), x)
    out["bias_same_draws"] = stats
    out["versions"] = dict(torch=torch.__version__, numpy=np.__version__)
    print(json.dumps(out, indent=1))


def bias(args):
    """Their algorithm with their own kind of randomness, on the test's x, and variants."""
    x = torch.from_numpy(np.load(args.fp4jax)["x"])  # (2, 256): the test's x
    gen = torch.Generator().manual_seed(args.seed)
    h = hadamard()
    variants = {
        "theirs (scaled-domain c, SR scales)": dict(),
        "theirs, SR replaced by its expectation": dict(stochastic=False),
        "c in the original domain, SR scales": dict(correction_domain="original"),
        "c in the original domain, no SR": dict(correction_domain="original",
                                                stochastic=False),
        "c per block of 16, SR scales": dict(correction_domain="block"),
        "no correction (RTN), no SR": dict(correction_domain="none", stochastic=False),
    }
    acc = {name: [] for name in variants}
    acc["torch_eden (their torch branch)"] = []
    diag = []
    left = args.keys
    while left > 0:
        k = min(left, 8192)
        left -= k
        # rerotate_hadamard: H @ diag(signs); the kernel gets (H diag s)^T and computes
        # x @ (H diag s)^T; the product's other operand undoes it: deq @ (H diag s)
        signs = (torch.randint(0, 2, (k, 128), generator=gen) * 2 - 1).to(F32)
        r = h.unsqueeze(0) * signs.unsqueeze(1)  # (k, 128, 128): H @ diag(s)
        xt = x.reshape(1, 4, 128).expand(k, 4, 128)
        x_had = torch.bmm(xt, r.transpose(1, 2)).reshape(k, 512)
        amax = x_had.abs().amax(-1)
        u = torch.rand((k, 32), generator=gen, dtype=F32)
        for name, kw in variants.items():
            o = triton_eden(x_had, amax, u, **kw)
            back = torch.bmm(o["deq"].reshape(k, 4, 128), r).reshape(k, 2, 256)
            acc[name].append(np.einsum("kij,ij->k", back.double().numpy(), x.double().numpy()))
            if name.startswith("theirs (") :
                diag.append(_block_diag(o))
        o = torch_eden(x_had, u)
        back = torch.bmm(o["deq"].reshape(k, 4, 128), r).reshape(k, 2, 256)
        acc["torch_eden (their torch branch)"].append(
            np.einsum("kij,ij->k", back.double().numpy(), x.double().numpy()))
    xx = float((x.double() ** 2).sum())
    out = {}
    for name, parts in acc.items():
        per = np.concatenate(parts) / xx - 1
        out[name] = dict(keys=int(per.size), shrink=float(per.mean()),
                         shrink_se=float(per.std(ddof=1) / np.sqrt(per.size)),
                         per_draw_min=float(per.min()), per_draw_max=float(per.max()))
    d = np.concatenate(diag)
    out["within-group correlation of block scale^2 with block EDEN factor r_b"] = float(
        np.mean(d))
    out["versions"] = dict(torch=torch.__version__, numpy=np.__version__, seed=args.seed)
    print(json.dumps(out, indent=1))


def mechanism(args):
    """Why the scaled-domain correction shrinks, on fp4jax's draws (their transcription).
    Per group g with blocks b: w_b = <y'_b, q_b>, r_b = |y'_b|^2 / w_b (scaled units),
    S_b = s_b * dec. With c_g = sum w r / sum w (theirs) the component of the reconstruction
    along x, with the scale rounding replaced by its expectation, misses |x|^2 by
    E = sum_g sum_b S_b^2 w_b (c_g - r_b) = -sum_g W_g Cov_w(S^2, r): zero when a group's
    scales are equal or its r_b are, negative when larger-scale blocks need larger r_b."""
    d = np.load(args.fp4jax)
    k = d["xr"].shape[0]
    xr = torch.from_numpy(d["xr"]).reshape(k, 512)
    o = triton_eden(xr, torch.from_numpy(d["amax"]), torch.from_numpy(d["u"]).reshape(k, 32))
    xs = o["x_scaled"].double().reshape(-1, 8, 16)
    q = o["q"].double().reshape(-1, 8, 16)
    w = (xs * q).sum(-1)
    r = (xs * xs).sum(-1) / w
    y = xr.double().reshape(-1, 8, 16)
    peak = y.abs().amax(-1) / y.pow(2).mean(-1).sqrt()
    rms2 = y.pow(2).mean(-1)
    s2 = o["s_rn"].double().reshape(-1, 8) ** 2
    big_s2 = s2 * o["dec"].double().repeat_interleave(4).reshape(-1, 1) ** 2
    c = (w * r).sum(-1, keepdim=True) / w.sum(-1, keepdim=True)
    err = (big_s2 * w * (c - r)).sum(-1).reshape(k, 4).sum(-1)
    x = d["x"].astype(np.float64)

    def corr(a, b):  # mean over groups of the correlation across the group's 8 blocks
        a = a - a.mean(-1, keepdim=True)
        b = b - b.mean(-1, keepdim=True)
        cc = (a * b).sum(-1) / torch.sqrt((a * a).sum(-1) * (b * b).sum(-1))
        return float(cc[torch.isfinite(cc)].mean())

    print(json.dumps({
        "identity: mean E / |x|^2 (= the shrink with E_u scales)":
            float(err.mean()) / float((x * x).sum()),
        "corr(s_b^2, r_b)": corr(s2, r),
        "corr(r_b, amax_b/rms_b)": corr(r, peak),
        "corr(s_b^2, amax_b/rms_b)": corr(s2, peak),
        "corr(s_b^2, rms_b^2)": corr(s2, rms2),
        "corr(r_b, rms_b^2)": corr(r, rms2),
        "versions": dict(torch=torch.__version__, numpy=np.__version__)}, indent=1))


def _block_diag(o):
    """Per group: the correlation, across its 8 blocks, of s_b^2 with the block's own EDEN
    factor r_b = <y_b, y_b> / <y_b, q_b> (scaled units)."""
    xs = o["x_scaled"].double().reshape(-1, 8, 16)
    q = o["q"].double().reshape(-1, 8, 16)
    r = (xs * xs).sum(-1) / (xs * q).sum(-1)
    s2 = o["s_rn"].double().reshape(-1, 8) ** 2
    r = r - r.mean(-1, keepdim=True)
    s2 = s2 - s2.mean(-1, keepdim=True)
    c = (r * s2).sum(-1) / torch.sqrt((r * r).sum(-1) * (s2 * s2).sum(-1))
    return c[torch.isfinite(c)].numpy()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("compare", "bias", "mechanism"))
    ap.add_argument("--fp4jax", default="/tmp/ms_eden_fp4jax.npz",
                    help="experiments/ms_eden_dump.py's output (x, and for compare every "
                         "intermediate)")
    ap.add_argument("--keys", type=int, default=65536)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(2)
    dict(compare=compare, bias=bias, mechanism=mechanism)[a.mode](a)


if __name__ == "__main__":
    main()
