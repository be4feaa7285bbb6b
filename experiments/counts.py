"""The byte and cycle counts of docs/performance.md, printed as its markdown tables (no
device needed):

    python3 experiments/counts.py nvfp4        # "NVFP4 at the emulation floor: bytes per pass"
    python3 experiments/counts.py mxfp4-fp8    # "MXFP4 on FP8 tensor cores: bytes and cycles"

``nvfp4`` (was ``nvfp4_pass_counts.py``; issue 56 item 3): the HBM passes an NVFP4 linear
layer's forward + backward makes on Hopper with the Pallas operand kernels, per tensor,
against BF16's GEMM operand traffic, for three designs:

* ``today``: ``pallas_kernels/dot_sm90.py:make_operands`` as it runs the ``nvfp4`` recipe.
  x and dy (bf16, 2 bytes an element): one ``cols_amaxes`` Pallas pass (reads the tensor,
  writes a float32 amax per column and 16-row strip for both the plain and the rotated
  tensor, 0.5 byte an element, which an XLA reduction reads back), one ``fq_rows_scaled``
  pass (1x16 blocks; reads 2, writes the 2-byte fake-quantized copy) and one
  ``fq_cols_scaled`` pass (16x1 blocks after the 16-point RHT along the tokens; reads 2,
  writes 2). w: an XLA ``finite_amax`` read and one ``fq_2d_scaled`` pass (16x16 tiles;
  read 2, write 2; weights narrower than 1,024 columns go through XLA's reference
  quantizer instead, about the same bytes in ~9 small kernels), its copy serving fprop and
  dgrad. The three GEMMs then read the copies: the same bytes as BF16's GEMMs.
* ``floor``: one amax read and one quantization read per tensor, that read writing every
  layout its GEMMs need (rows and RHT'd columns); the amax partials per CTA (no bytes);
  ``floor, producer amax``: the amax taken by the op that makes the tensor (no amax read).
* ``fp8_producer``: the producer-amax floor, each operand stored as 1-byte E4M3 codes (the
  E2M1 value, exact in E4M3) plus one E4M3 scale byte per 16 (per 256 for the 16x16 weight
  tiles) instead of a bf16 copy, decoded to bf16 next to the GEMM's BF16 ``wgmma`` (bytes
  only: the tensor rate stays BF16's); ``packed_producer``: 0.5-byte codes.

HBM time at 3.35 TB/s (H100 SXM datasheet), GEMM time at ~800 TFLOP/s (practical BF16 on
this workplace's H100s). Then the step-level prediction for ``small`` and ``100m`` from the
measured step times and operand-kernel times (docs/performance.md), the operand kernels
assumed to keep today's achieved bandwidth.

``mxfp4-fp8`` (was ``mxfp4_fp8_counts.py``): for each GEMM (or set of GEMMs), tensor time at
H100 SXM's dense BF16 and FP8 peaks (132 SMs x 4,096 / 8,192 FLOP per clock x 1.83 GHz) and
at ~800 TFLOP/s BF16, promotion time at 3.5 / 2 / 1 lane-instructions per output element and
32-block (128 per SM per clock), and HBM time at 3.35 TB/s for operands read once and the
bf16 output written once (BF16: 2 bytes an element; FP8: 1-byte codes + 1-byte scales per
32; packed: 0.5-byte codes). Prints the markdown rows.
"""

from __future__ import annotations

import argparse
import math

HBM = 3.35e12
BF16_PRACTICAL = 800e12
T = 16384  # tokens: 64 sequences of 256
BF = 2  # bytes of a bf16 element

# the presets' shapes (fp4jax/models/llama.py PRESETS: d_model, kv width = n_kv_heads *
# head_dim, d_ff; relu2 FFN: up and down) and their NVFP4 blocks (the harness keeps the last
# ceil(0.15 n_layers) in BF16: fp4jax/train/config.py last_bf16_blocks)
PRESETS = {"small": (512, 256, 2048, 8), "100m": (768, 256, 4096, 12)}

# measured (docs/performance.md): step times from tokens/s on one H100 (T tokens a step), and
# the Pallas operand kernels' and the XLA glue's device time a step (H100 profile,
# experiments/results/training/2026-11-26_profile_cudnn_h100)
MEASURED = {
    # preset: (BF16 tokens/s, NVFP4 tokens/s, operand kernels µs, glue µs, source)
    "small": (1_831_383, 1_125_101, 4_457, 1_229, "bench_harness 2026-12-07"),
    "100m": (622_069, 390_971, 12_289, 2_292, "issue 56's table (fbc222d)"),
}
# the GEMMs' device time a step in the same profile (NVFP4's = BF16's: cuBLAS through XLA),
# and gemm_alpha's speed against XLA's GEMM at the presets' shapes (pallas_kernels/gemm/
# alpha_sm90.py MIN_MKN: 0.91-0.93x at 16384x512x2048, H200 run 30): the codes designs need
# a GEMM that decodes its operands, i.e. a Pallas GEMM in place of cuBLAS
GEMM_US = {"small": 4_900, "100m": 15_426}
PALLAS_GEMM_SPEED = 0.92


def bf16_bytes(shape):
    """Bytes a bf16 tensor of ``shape`` (rows, cols) takes."""
    r, c = shape
    return BF * r * c


def act_passes(name, shape, design, sr):
    """[(tensor, pass, bytes read, bytes written)] of an activation or gradient (T, C) that
    is quantized along rows (1x16) and, RHT'd, along columns (16x1), under ``design``."""
    s = bf16_bytes(shape)
    rnd = "SR" if sr else "RtN"
    if design == "today":
        return [(name, "cols_amaxes (Pallas: plain + RHT amax partials)", s, s / 4),
                (name, "amax partials reduced (XLA jnp.max)", s / 4, 0),
                (name, f"fq_rows_scaled 1x16 {rnd} (bf16 copy)", s, s),
                (name, f"fq_cols_scaled RHT-16 16x1 {rnd} (bf16 copy)", s, s)]
    amax = [] if design.endswith("producer") else [
        (name, "amax pass (plain + RHT, per-CTA partials)", s, 0)]
    if design.startswith("floor"):
        return amax + [(name, "one read -> rows + RHT cols bf16 copies", s, 2 * s)]
    per = code_bytes(shape, 16, design)
    return amax + [(name, "one read -> rows + RHT cols codes + scales", s, 2 * per)]


def code_bytes(shape, block, design):
    """Bytes of one quantized copy as codes + E4M3 scales (``design`` ``fp8*``: 1-byte
    codes, ``packed*``: 0.5-byte), one scale per ``block`` elements."""
    n = shape[0] * shape[1]
    return n * (0.5 if design.startswith("packed") else 1.0) + n / block


def operand_bytes(shape, design, block=16):
    """Bytes one GEMM reads for one quantized operand of ``shape``."""
    if design in ("today", "floor", "floor_producer"):
        return bf16_bytes(shape)
    return code_bytes(shape, block, design)


def weight_passes(name, shape, design):
    s = bf16_bytes(shape)
    narrow = shape[1] < 1024
    kern = "XLA reference quantizer (N < 1024)" if narrow else "fq_2d_scaled 16x16 (bf16 copy)"
    if design == "today":
        return [(name, "finite_amax (XLA reduce)", s, 0), (name, kern, s, s)]
    amax = [] if design.endswith("producer") else [(name, "amax pass", s, 0)]
    out = s if design.startswith("floor") else code_bytes(shape, 256, design)
    return amax + [(name, "16x16 quantize (one copy, fprop + dgrad)", s, out)]


def layer(t, k, n):
    """One linear's canonical tensors: x (t, k), w (k, n), dy (t, n)."""
    return {"x": (t, k), "w": (k, n), "dy": (t, n)}


def gemms(t, k, n):
    """The three GEMMs (name, M, K, N, lhs tensor, rhs tensor, out shape)."""
    return [("fprop", t, k, n, "x", "w", (t, n)), ("dgrad", t, n, k, "dy", "w", (t, k)),
            ("wgrad", k, t, n, "x", "dy", (k, n))]


def block_linears(d, kv, ff, t=T):
    """A block's linears (name, t, k, n, x tensor id): q, k and v share their input, so
    their x is quantized once (XLA merges the identical kernel calls; the H200 census
    counts 31 operand kernels a block)."""
    return [("q", t, d, d, "attn_in"), ("k", t, d, kv, "attn_in"), ("v", t, d, kv, "attn_in"),
            ("o", t, d, d, "attn_out"), ("up", t, d, ff, "mlp_in"), ("down", t, ff, d, "h")]


DESIGNS = ("today", "floor", "floor_producer", "fp8_producer", "packed_producer")


def count(linears, design):
    """(operand-kernel passes, operand-kernel bytes, GEMM operand + output bytes, GEMM
    flops, GEMM roofline s) of ``linears`` under ``design`` (``bf16``: no operand passes)."""
    passes, seen = [], set()
    gemm_bytes = flops = roof = 0.0
    for name, t, k, n, xid in linears:
        sh = layer(t, k, n)
        if design != "bf16":
            if xid not in seen:
                seen.add(xid)
                passes += act_passes(f"x {xid} {t}x{k}", sh["x"], design, sr=False)
            passes += weight_passes(f"w {name} {k}x{n}", sh["w"], design)
            passes += act_passes(f"dy {name} {t}x{n}", sh["dy"], design, sr=True)
        for _, m, kk, nn, a, b, out in gemms(t, k, n):
            if design == "bf16":
                rd = bf16_bytes(sh[a]) + bf16_bytes(sh[b])
            else:
                rd = (operand_bytes(sh[a], design)
                      + operand_bytes(sh[b], design, 256 if b == "w" else 16))
            by = rd + bf16_bytes(out)
            f = 2 * m * kk * nn
            gemm_bytes += by
            flops += f
            roof += max(f / BF16_PRACTICAL, by / HBM)
    op_bytes = sum(r + w for _, _, r, w in passes)
    return passes, op_bytes, gemm_bytes, flops, roof


def us(s):
    return f"{s * 1e6:,.0f}"


def mb(b):
    return f"{b / 1e6:,.1f}"


def table_today(title, linears):
    """(a) today's passes, one row per pass."""
    passes, op, gb, fl, roof = count(linears, "today")
    _, _, gb16, _, roof16 = count(linears, "bf16")
    print(f"\n### (a) today's passes: {title}\n")
    print("| tensor | pass | read MB | written MB | µs at 3.35 TB/s |")
    print("| --- | --- | ---: | ---: | ---: |")
    for t, p, r, w in passes:
        print(f"| {t} | {p} | {mb(r)} | {mb(w)} | {us((r + w) / HBM)} |")
    print(f"| **all operand passes** | {len(passes)} passes | "
          f"{mb(sum(p[2] for p in passes))} | {mb(sum(p[3] for p in passes))} | "
          f"**{us(op / HBM)}** |")
    print(f"| BF16's GEMMs (operands read once + outputs) | {3 * len(linears)} GEMMs, "
          f"{fl / 1e9:,.1f} GFLOP | | {mb(gb16)} total | {us(gb16 / HBM)} HBM, "
          f"{us(fl / BF16_PRACTICAL)} at 800 TFLOP/s |")
    return op


def table_designs(rows):
    """(b), (c): per design, the operand passes' bytes and HBM time and the GEMMs'."""
    print("\n### (b), (c): every design, forward + backward\n")
    print("| shape | design | operand-pass bytes (x BF16 GEMM traffic) | operand passes µs "
          "at 3.35 TB/s | GEMM bytes | GEMM roofline µs (800 TFLOP/s, 3.35 TB/s) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for title, linears in rows:
        _, _, gb16, _, roof16 = count(linears, "bf16")
        print(f"| {title} | BF16 | 0 | 0 | {mb(gb16)} MB | {us(roof16)} |")
        for d in DESIGNS:
            _, op, gb, _, roof = count(linears, d)
            print(f"| {title} | {d} | {mb(op)} MB ({op / gb16:.2f}x) | {us(op / HBM)} | "
                  f"{mb(gb)} MB | {us(roof)} |")


def step_prediction():
    """Per preset: measured step, operand-kernel bytes today, the achieved bandwidth, the
    predicted operand time, step time and ratio to BF16 for each design."""
    print("\n### Step-level prediction (one H100; operand kernels at today's achieved "
          "bandwidth; glue: the measured XLA glue around them)\n")
    print("| preset | design | operand-pass GB a step | operand µs | glue µs | "
          "NVFP4 step ms | NVFP4 / BF16 tokens/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    out = {}
    for preset, (d, kv, ff, layers) in PRESETS.items():
        blocks = layers - math.ceil(0.15 * layers)
        bf_tps, nv_tps, op_us, glue_us, _ = MEASURED[preset]
        bf_step, nv_step = T / bf_tps * 1e6, T / nv_tps * 1e6
        lin = block_linears(d, kv, ff)
        op_today = count(lin, "today")[1] * blocks
        bw = op_today / (op_us * 1e-6)
        out[preset] = {"blocks": blocks, "achieved_TBps": bw / 1e12}
        print(f"| `{preset}` ({blocks} NVFP4 blocks) | today (measured) | "
              f"{op_today / 1e9:.2f} | {op_us:,} | {glue_us:,} | {nv_step / 1e3:.2f} | "
              f"{bf_step / nv_step:.3f}x |")
        # the amax partials' bytes: written by cols_amaxes, read back by the XLA reduction
        partials = sum(w if p.startswith("cols_amaxes") else r
                       for _, p, r, w in count(lin, "today")[0]
                       if p.startswith(("cols_amaxes", "amax partials")))
        for dsg, glue, pen in (("floor", glue_us, 0), ("floor", 0, 0), ("alu", 0, 0),
                               ("floor_producer", 0, 0), ("fp8_producer", 0, 0),
                               ("fp8_producer", 0, 1), ("packed_producer", 0, 0)):
            if dsg == "alu":  # the fused pass costs today's two passes: only the partials go
                b = op_today - partials * blocks
                label = "floor, arithmetic-bound (glue folded)"
            else:
                b = count(lin, dsg)[1] * blocks
                label = dsg + (", glue kept" if glue else ", glue folded")
            t_op = b / bw * 1e6
            # codes designs: the GEMMs' roofline change (bytes only), and with ``pen`` a
            # Pallas GEMM at gemm_alpha's measured speed against cuBLAS
            g_gain = 0.0
            if dsg.startswith(("fp8", "packed")):
                g_gain = (count(lin, "today")[4] - count(lin, dsg)[4]) * blocks * 1e6
                g_gain -= pen * GEMM_US[preset] * (1 / PALLAS_GEMM_SPEED - 1)
                label += ", Pallas GEMM at 0.92x cuBLAS" if pen else ", GEMM at cuBLAS speed"
            step = nv_step - (op_us - t_op) - (glue_us - glue) - g_gain
            out[preset][label] = bf_step / step
            out[preset]["step_us " + label] = step
            print(f"| `{preset}` | {label} | {b / 1e9:.2f} | {t_op:,.0f} | {glue:,} | "
                  f"{step / 1e3:.2f} | {bf_step / step:.3f}x |")
        print(f"| `{preset}` | BF16 (measured) | 0 | 0 | 0 | {bf_step / 1e3:.2f} | 1.000x |")
    for preset, r in out.items():
        base = r["step_us floor_producer, glue folded"]
        for dsg in ("fp8_producer", "packed_producer"):
            gain = base - r[f"step_us {dsg}, glue folded, GEMM at cuBLAS speed"]
            speed = GEMM_US[preset] / (GEMM_US[preset] + gain)
            r[f"break-even GEMM speed {dsg}"] = speed
            print(f"\n`{preset}` {dsg}: saves {gain:,.0f} µs a step over the producer-amax "
                  f"floor (bf16 copies) with cuBLAS-speed GEMMs; it pays only if its decoding "
                  f"GEMM runs at >= {speed:.2f}x cuBLAS's speed ({GEMM_US[preset]:,} µs of "
                  "GEMMs a step)")
    achieved = ", ".join(f"`{p}` {v['achieved_TBps']:.2f} TB/s" for p, v in out.items())
    print(f"\n(today's operand kernels achieve {achieved} over the bytes counted here)")
    return out


def fp8_wgmma_cycles():
    """Why NVFP4 cannot use FP8 ``wgmma`` for speed: per output element and 16 of K, SM
    clocks of the tensor core and of the promotion (128 lane-instructions per SM per clock),
    at H100's dense peaks (BF16 2,048 MAC per SM per clock, FP8 4,096); FP8 ``wgmma``'s K is
    32, so one NVFP4 block per instruction means the other 16 of K zero. Then the issue share
    of decoding E4M3 codes to bf16 inside a BF16 GEMM (the ``fp8_producer`` design)."""
    bf16 = 16 / 2048
    fp8_padded = 32 / 4096  # one K = 32 step, half of it zeros
    print("\n### NVFP4 on FP8 `wgmma` (per output element and 16-block, SM clocks)\n")
    print("| path | tensor | promotion 3.5 / 2 / 1 instr | x BF16's tensor time |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| BF16 `wgmma` on the bf16 copies (today) | {bf16:.5f} | 0 | 1.00x |")
    prom = [c / 128 for c in (3.5, 2, 1)]
    print(f"| FP8 `wgmma`, one 16-block per K = 32 step | {fp8_padded:.5f} | "
          f"{' / '.join(f'{p:.5f}' for p in prom)} | "
          f"{' / '.join(f'{max(fp8_padded, p) / bf16:.2f}x' for p in prom)} |")
    tm, tn, tk, instr = 128, 256, 64, 1.5
    dec = (tm + tn) * tk * instr / 128
    ten = tm * tn * tk / 2048
    print(f"\nDecoding E4M3 codes x scales to bf16 in a {tm}x{tn}x{tk} BF16 GEMM tile step at "
          f"{instr} instructions an element: {dec:.0f} issue clocks against {ten:.0f} tensor "
          f"clocks ({dec / ten:.0%}), to be hidden under the `wgmma`s.")
    return dec / ten


def nvfp4_main():
    rows = [("8192^3 layer", [("w", 8192, 8192, 8192, "x")])]
    for preset, (d, kv, ff, _) in PRESETS.items():
        rows.append((f"`{preset}` block (6 linears)", block_linears(d, kv, ff)))
    table_today("one `small` block (6 linears, q/k/v sharing x; T = 16384)", rows[1][1])
    table_today("8192^3 layer", rows[0][1])
    table_designs(rows)
    fp8_wgmma_cycles()
    return step_prediction()


# --- mxfp4-fp8 ---

MX_SM, MX_CLK = 132, 1.83e9
MX_BF16_PEAK, MX_FP8_PEAK = MX_SM * 4096 * MX_CLK, MX_SM * 8192 * MX_CLK
MX_LANES = MX_SM * 128 * MX_CLK  # lane-instructions per second
MX_BF16_PRACTICAL = 798e12  # (the NVFP4 counts use 800e12)


def mx_gemm(m, k, n):
    """(GFLOP-ready flops, bf16 peak s, bf16 practical s, fp8 peak s, {instr: promotion s},
    hbm s bf16, hbm s fp8 codes, hbm s fp8 packed) for an M x K x N GEMM."""
    fl = 2 * m * k * n
    blocks = m * n * (k / 32)
    prom = {c: blocks * c / MX_LANES for c in (3.5, 2, 1)}
    by_bf = 2 * (m * k + k * n) + 2 * m * n
    by_f8 = (m * k + k * n) + (m * k + k * n) / 32 + 2 * m * n
    by_f8p = (m * k + k * n) / 2 + (m * k + k * n) / 32 + 2 * m * n
    return (fl, fl / MX_BF16_PEAK, fl / MX_BF16_PRACTICAL, fl / MX_FP8_PEAK, prom, by_bf / HBM,
            by_f8 / HBM, by_f8p / HBM)


def mx_row(name, shapes):
    tot = [0.0] * 8
    prom = {3.5: 0.0, 2: 0.0, 1: 0.0}
    for (m, k, n) in shapes:
        r = mx_gemm(m, k, n)
        for i in (0, 1, 2, 3, 5, 6, 7):
            tot[i] += r[i]
        for c in prom:
            prom[c] += r[4][c]

    def us(t):
        return f"{t * 1e6:,.0f}"

    fl, tb, tbm, t8, _, bb, b8, b8p = tot
    print(f"| {name} | {fl / 1e9:,.1f} | {us(tb)} / {us(tbm)} | {us(t8)} | "
          f"{us(prom[3.5])} / {us(prom[2])} / {us(prom[1])} | {us(bb)} | "
          f"{us(b8)} ({us(b8p)} packed) |")


def mxfp4_fp8_main():
    mx_row("8192^3 GEMM", [(8192, 8192, 8192)])
    mx_row("8192^3 layer fwd+bwd (3 GEMMs)", [(8192, 8192, 8192)] * 3)
    for name, d, kv, ff in (("small", 512, 256, 2048), ("100m", 768, 256, 4096),
                            ("1b", 2048, 1024, 6144)):
        layers = [(d, d), (d, kv), (d, kv), (d, d), (d, ff), (ff, d)]  # q k v o up down
        three = []
        for k, n in layers:
            three += [(T, k, n), (T, n, k), (k, T, n)]  # fprop, dgrad, wgrad
        mx_row(f"`{name}` up-proj fprop ({T}x{d}x{ff})", [(T, d, ff)])
        mx_row(f"`{name}` one block's 6 linears, fwd+bwd", three)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("which", choices=("nvfp4", "mxfp4-fp8"),
                    help="nvfp4: bytes per pass; mxfp4-fp8: bytes and cycles on FP8")
    args = ap.parse_args(argv)
    return nvfp4_main() if args.which == "nvfp4" else mxfp4_fp8_main()


if __name__ == "__main__":
    main()
