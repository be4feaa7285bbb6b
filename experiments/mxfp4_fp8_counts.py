"""The counts of docs/performance.md, "MXFP4 on FP8 tensor cores: bytes and cycles": for
each GEMM (or set of GEMMs), tensor time at H100 SXM's dense BF16 and FP8 peaks (132 SMs
x 4,096 / 8,192 FLOP per clock x 1.83 GHz) and at ~800 TFLOP/s BF16, promotion time at
3.5 / 2 / 1 lane-instructions per output element and 32-block (128 per SM per clock), and
HBM time at 3.35 TB/s for operands read once and the bf16 output written once (BF16: 2
bytes an element; FP8: 1-byte codes + 1-byte scales per 32; packed: 0.5-byte codes).
Prints the markdown rows. Usage: python3 experiments/mxfp4_fp8_counts.py
"""

SM, CLK = 132, 1.83e9
BF16_PEAK, FP8_PEAK = SM * 4096 * CLK, SM * 8192 * CLK
LANES = SM * 128 * CLK  # lane-instructions per second
HBM = 3.35e12
BF16_PRACTICAL = 798e12
T = 16384  # tokens: 64 sequences of 256


def gemm(m, k, n):
    """(GFLOP-ready flops, bf16 peak s, bf16 practical s, fp8 peak s, {instr: promotion s},
    hbm s bf16, hbm s fp8 codes, hbm s fp8 packed) for an M x K x N GEMM."""
    fl = 2 * m * k * n
    blocks = m * n * (k / 32)
    prom = {c: blocks * c / LANES for c in (3.5, 2, 1)}
    by_bf = 2 * (m * k + k * n) + 2 * m * n
    by_f8 = (m * k + k * n) + (m * k + k * n) / 32 + 2 * m * n
    by_f8p = (m * k + k * n) / 2 + (m * k + k * n) / 32 + 2 * m * n
    return (fl, fl / BF16_PEAK, fl / BF16_PRACTICAL, fl / FP8_PEAK, prom, by_bf / HBM,
            by_f8 / HBM, by_f8p / HBM)


def row(name, shapes):
    tot = [0.0] * 8
    prom = {3.5: 0.0, 2: 0.0, 1: 0.0}
    for (m, k, n) in shapes:
        r = gemm(m, k, n)
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


def main():
    row("8192^3 GEMM", [(8192, 8192, 8192)])
    row("8192^3 layer fwd+bwd (3 GEMMs)", [(8192, 8192, 8192)] * 3)
    for name, d, kv, ff in (("small", 512, 256, 2048), ("100m", 768, 256, 4096),
                            ("1b", 2048, 1024, 6144)):
        layers = [(d, d), (d, kv), (d, kv), (d, d), (d, ff), (ff, d)]  # q k v o up down
        three = []
        for k, n in layers:
            three += [(T, k, n), (T, n, k), (k, T, n)]  # fprop, dgrad, wgrad
        row(f"`{name}` up-proj fprop ({T}x{d}x{ff})", [(T, d, ff)])
        row(f"`{name}` one block's 6 linears, fwd+bwd", three)


if __name__ == "__main__":
    main()
