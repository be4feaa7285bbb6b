"""The scale ladder of issue 36, as data: sizes, tokens, schedule, rows, seeds, the LR sweep
and the H100 throughput table the driver plans calls with.

``python experiments/ladder/spec.py`` prints the ladder (parameter counts, tokens per
parameter, every run with its estimated seconds).

Everything a run is trained with is in ``SIZES``/``COMMON``/``ROWS`` and the LR the sweep
picks (``run.py`` passes it; each run's ``result.json`` records its whole config).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VOCAB = 16384  # bpe:16384, trained on the training split of the code corpus
# the BPE vocabulary is trained on the training files whose SHA-256 digits 8-16, as an
# integer, are 0 modulo BPE_SAMPLE (a third of the training split, ~120 MB of ~370): enough
# text for 16k merges, and a first call that is not spent on BPE training
BPE_SAMPLE = 3
SEQ_LEN = 1024
BATCH = 128  # sequences per step: 131,072 tokens
TOKENS_PER_STEP = SEQ_LEN * BATCH
STEPS = 1024  # 134,217,728 tokens a run (2**27) at every size
# --eval-batches 16: 2.1M held-out tokens, about the whole validation split (~2.3% of the
# corpus); fewer windows than asked for would be repeated (ByteDataset.val_batches)
EVAL_BATCHES = 16
VAL_TOKENS = EVAL_BATCHES * BATCH * SEQ_LEN

# the flags every run shares (the preset, --lr and --steps come from the size)
COMMON = ["--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH),
          "--warmup-steps", "50", "--schedule", "wsd", "--decay-fraction", "0.2",
          "--eval-every", "128", "--eval-batches", str(EVAL_BATCHES), "--log-every", "8",
          "--checkpoint-every", "0", "--keep-checkpoints", "1", "--no-progress",
          "--devices", "1"]

# sweep_fraction: the LR sweep's runs are this fraction of the steps (their own WSD
# schedule), to keep the sweep of the two larger sizes cheap
SIZES = {
    "mini": {"preset": "mini", "steps": STEPS, "sweep_fraction": 1.0},
    "small": {"preset": "small", "steps": STEPS, "sweep_fraction": 0.25},
    # 134M tokens as mini and small (issue 58). The sweep's 256 steps (a quarter, as small's)
    # are the runs of the first, half-token rung's sweep (half of its 512 steps): the same LR
    # sweep, kept (peak LR 0.0012)
    "100m": {"preset": "100m", "steps": STEPS, "sweep_fraction": 0.25},
}
MIDDLE = "small"

# superseded rungs, kept as rows of their own (results under runs/ladder/<key>/): never
# queued by the driver; analyze.py tables and plots them beside the sizes above
ARCHIVED = {
    # the first 100m rung (issue 36, calls 4-6): half the tokens, 512 steps, because at
    # the MXFP4 rate then guessed (~850 s a run) 1024 steps would not fit one 10-minute call
    "100m-67M": {"size": "100m", "preset": "100m", "steps": STEPS // 2,
                 "label": "100m-67M, the first 100m rung: half the tokens, superseded"},
}

# the BF16 LR sweep (phase "sweep"): seed 0, the run's own length, these peak LRs; the
# ladder uses, per size, the LR of the lowest final validation loss (``chosen_lr``)
SWEEP = {"mini": (1e-3, 2e-3, 4e-3, 8e-3),
         "small": (5e-4, 1e-3, 2e-3, 4e-3),
         "100m": (3e-4, 6e-4, 1.2e-3, 2.4e-3)}
SWEEP_SEED = 0

BASE = "nvfp4(sr=False, rht=0, block_2d=False, last_bf16=0)"  # NVIDIA's Figure 5 base method
# (label, spec, seeds, sizes)
ROWS = [
    ("BF16", "bf16", (0, 1, 2), ("mini", "small", "100m")),
    ("NVFP4 recipe", "nvfp4", (0, 1, 2), ("mini", "small", "100m")),
    ("MXFP4", "mxfp4", (0, 1, 2), ("mini", "small", "100m")),
    ("no BF16 blocks", "nvfp4(last_bf16=0)", (0, 1), (MIDDLE,)),
    ("base method (all FP4, RtN, 1D, no RHT)", BASE, (0, 1), (MIDDLE,)),
    ("BF16 forward from 80%", "nvfp4(switch_at=0.8, switch=fwd)", (0, 1), (MIDDLE,)),
    # Transformer Engine's nvfp4_4over6="all" scope (x and w); TE refuses 4over6 with the
    # RHT, so the Wgrad RHT is off in this row (docs/numerics.md, 4over6)
    ("4over6 on x and w (no RHT)", "nvfp4(rht=0, block_scale_rule=4over6)", (0, 1), (MIDDLE,)),
    ("Quartet II", "quartet2", (0, 1), (MIDDLE,)),
]
BASELINE = "bf16"

# H100 tokens/s per (preset, spec) at vocabulary 16384, for planning only. small/100m bf16,
# nvfp4 and small mxfp4 are the lead's measured numbers at vocabulary 256 (cuDNN attention,
# one H100, unscanned) plus the BF16 LM head of 16384 ids at bf16 speed; the others are
# guesses (marked). run.py prefers tokens/s measured by finished ladder runs.
RATES = {
    ("mini", "bf16"): 2.0e6, ("mini", "nvfp4"): 1.4e6, ("mini", "mxfp4"): 1.5e6,  # guesses
    # small mxfp4: on the MX operand kernels, 1,130,907 tokens/s at vocabulary 256
    # (experiments/results/training/2026-11-27_mxfp4_kernels_h100), scaled as nvfp4's
    ("small", "bf16"): 1.24e6, ("small", "nvfp4"): 0.76e6, ("small", "mxfp4"): 0.88e6,
    ("100m", "bf16"): 0.55e6, ("100m", "nvfp4"): 0.36e6,
    ("100m", "mxfp4"): 0.40e6,  # guess: small's mxfp4/nvfp4 ratio
}
# specs not in RATES: the rate of the spec they are closest to, times a factor (guesses)
LIKE = {"nvfp4(last_bf16=0)": ("nvfp4", 0.95), BASE: ("nvfp4", 1.0),
        "nvfp4(switch_at=0.8, switch=fwd)": ("nvfp4", 1.05),
        # XLA path, no kernels: as mxfp4 was on the XLA path (0.44x of its kernel rate)
        "nvfp4(rht=0, block_scale_rule=4over6)": ("mxfp4", 0.44),
        "quartet2": ("mxfp4", 0.35)}
COMPILE_S = {"bf16": 40.0, "other": 110.0}  # compile, first step, eval and startup, guesses


def size_config(size: str):
    """The ``LlamaConfig`` of ``size`` at vocabulary ``VOCAB``."""
    from fp4jax.models.llama import PRESETS

    return PRESETS[{**SIZES, **ARCHIVED}[size]["preset"]].replace(vocab_size=VOCAB,
                                                                  max_seq_len=SEQ_LEN)


def param_counts(size: str) -> dict[str, int]:
    """Parameter counts of ``size``: ``embedding`` (token embedding + LM head, untied: 2 x
    vocab x d), ``non_embedding`` (blocks + final norm) and ``total``."""
    mc = size_config(size)
    total = mc.num_params()
    emb = 2 * mc.vocab_size * mc.d_model
    return {"embedding": emb, "non_embedding": total - emb, "total": total}


def tokens(size: str) -> int:
    """Tokens a ladder run of ``size`` (a key of ``SIZES`` or of ``ARCHIVED``) trains on."""
    return {**SIZES, **ARCHIVED}[size]["steps"] * TOKENS_PER_STEP


def runs(phase: str, sizes: tuple[str, ...] | None = None) -> list[dict]:
    """The runs of ``phase`` (``"sweep"`` or ``"ladder"``) at ``sizes`` (default: all), in
    the order they are queued: ``{"phase", "size", "spec", "seed", "lr", "name"}`` (``lr``
    None in the ladder: the sweep's choice, filled in by ``run.py``)."""
    sizes = tuple(SIZES) if sizes is None else sizes
    out = []
    if phase == "sweep":
        for size in sizes:
            for lr in SWEEP[size]:
                out.append({"phase": "sweep", "size": size, "spec": BASELINE,
                            "seed": SWEEP_SEED, "lr": lr,
                            "name": f"sweep/{size}/lr{lr:g}"})
    elif phase == "ladder":
        for size in sizes:
            for _, spec, seeds, where in ROWS:
                if size in where:
                    for s in seeds:
                        out.append({"phase": "ladder", "size": size, "spec": spec,
                                    "seed": s, "lr": None,
                                    "name": f"ladder/{size}/{slug(spec)}/seed{s}"})
    else:
        raise ValueError(f"phase {phase!r}: use sweep or ladder")
    return out


def slug(spec: str) -> str:
    from fp4jax.train.comparison import slug as _slug

    return _slug(spec)


def rate(size: str, spec: str, measured: dict | None = None) -> float:
    """Planned tokens/s of ``spec`` at ``size``: measured (``{(size, spec): tokens/s}``),
    else ``RATES``, else ``LIKE``."""
    if measured and (size, spec) in measured:
        return measured[size, spec]
    if (size, spec) in RATES:
        return RATES[size, spec]
    base, f = LIKE.get(spec, ("nvfp4", 0.8))
    return RATES[size, base] * f


def run_tokens(run: dict) -> int:
    """Tokens ``run`` trains on (a sweep run: its ``sweep_fraction`` of the steps)."""
    size = SIZES[run["size"]]
    steps = size["steps"]
    if run["phase"] == "sweep":
        steps = max(1, int(round(steps * size.get("sweep_fraction", 1.0))))
    return steps * TOKENS_PER_STEP


def overhead_key(run: dict) -> tuple[str, str]:
    """(size, ``"bf16"`` or ``"other"``): runs whose start-up and compile cost alike."""
    return run["size"], "bf16" if run["spec"] == "bf16" else "other"


def estimate_s(run: dict, measured: dict | None = None,
               overheads: dict | None = None) -> float:
    """Estimated process seconds of ``run`` on one H100: its start-up, compiles and
    evaluations (``overheads[overhead_key(run)]`` measured by earlier runs, else
    ``COMPILE_S``) plus its tokens at its rate (:func:`rate`)."""
    key = overhead_key(run)
    c = (overheads or {}).get(key, COMPILE_S[key[1]])
    return c + run_tokens(run) / rate(run["size"], run["spec"], measured)


def describe() -> dict:
    """The ladder as JSON: sizes with their parameter counts and tokens per parameter, the
    rows, the run counts and the estimated GPU-seconds per phase."""
    sizes = {}
    for s in SIZES:
        pc = param_counts(s)
        sizes[s] = {**SIZES[s], **pc, "tokens": tokens(s),
                    "tokens_per_non_embedding_param": tokens(s) / pc["non_embedding"],
                    "sweep_lrs": SWEEP[s]}
    est = {ph: sum(estimate_s(r) for r in runs(ph)) for ph in ("sweep", "ladder")}
    return {"vocab": VOCAB, "seq_len": SEQ_LEN, "batch": BATCH, "common": COMMON,
            "sizes": sizes, "rows": [{"label": lab, "spec": sp, "seeds": list(se),
                                      "sizes": list(wh)} for lab, sp, se, wh in ROWS],
            "runs": {ph: len(runs(ph)) for ph in ("sweep", "ladder")},
            "estimated_gpu_s": est,
            "estimated_x4_wall_min": {k: round(v / 4 / 60, 1) for k, v in est.items()}}


if __name__ == "__main__":
    d = describe()
    print(json.dumps(d, indent=1))
    for ph in ("sweep", "ladder"):
        for r in runs(ph):
            print(f"{r['name']:60s} {estimate_s(r):7.0f} s")
    for s in SIZES:
        pc = param_counts(s)
        print(f"{s}: non-embedding {pc['non_embedding'] / 1e6:.2f}M, embedding "
              f"{pc['embedding'] / 1e6:.2f}M, total {pc['total'] / 1e6:.2f}M, "
              f"{tokens(s) / pc['non_embedding']:.1f} tokens per non-embedding parameter")
