"""The scale-ladder driver (issue 36): corpus, tokens and a queue of ``fp4jax-train`` runs,
one per GPU, within a device call's time limit.

    python experiments/ladder/run.py --phases sweep:mini ladder:mini --time-limit 540 \\
        --out $OUT                         # on the GPU machine (experiments/ladder/gpu.sh)
    python experiments/ladder/run.py --phases ladder --plan-only       # print the plan

Each call:

1. **corpus** (``build_corpus.py``) from this interpreter's site-packages into
   ``WORK/corpus`` (``--work``, default ``.data/ladder``, git-ignored so a warm machine keeps
   it), checked against the committed ``experiments/results/ladder/corpus/manifest.json``
   (another corpus SHA-256 stops the call: another image);
2. **tokens** (``fp4jax-tokenize``, BPE 16384) into ``WORK/tokens``: with the committed
   ``experiments/results/ladder/corpus/tokenizer.json`` when there is one (then the shards'
   SHA-256 are checked against the committed ``tokens_meta.json``), else the vocabulary is
   trained here on a deterministic third of the training files (``spec.BPE_SAMPLE``) and
   it, ``meta.json``, the manifest and the file list go to ``OUT/corpus/`` to be committed;
   an up-to-date ``WORK/tokens`` is reused;
3. **runs**: the phases' runs (``spec.py``) not yet finished, here or in the committed
   results (``experiments/results/ladder/runs/<name>/result.json``, loose or packed in
   ``runs/records.tar.xz``: ``experiments/pack_results.py``), one ``fp4jax-train``
   process per GPU (``CUDA_VISIBLE_DEVICES``), into ``WORK/runs/<name>``; each run is
   started only if its estimate (measured tokens/s and overheads of finished runs, else
   ``spec.RATES`` and ``spec.COMPILE_S``) fits before the time limit (sweeps first, then
   size by size in ``spec.SIZES`` order, the main rows before the extra rows, seed by seed,
   the longest run first); a ladder run waits for
   its size's LR sweep (the LR of the lowest final validation loss). With ``--split`` a
   run too long for what is left starts anyway with ``--stop-at`` (the steps that fit) and
   a checkpoint there, and a later call on the same warm machine resumes it. At the limit
   every run still going is stopped (SIGTERM) and reported.

What comes back, directly under ``--out`` (a device call returns at most 8 files, at most
two folders down): ``runs.tar.gz`` (``runs/<name>/``: ``result.json``, ``metrics.jsonl``,
``train.log``; no checkpoints; rewritten after every run), ``driver.json`` (the plan, each
run's GPU, start, end, process seconds, tokens/s and exit status, the prep times) and, on
the first call, ``corpus.tar.gz`` (``corpus/``: manifest, file list, tokenizer, token
meta); ``gpu.sh`` adds ``driver.log`` and ``env.log``. Unpack both archives into
``experiments/results/ladder/``, put ``driver.json``, ``driver.log`` and ``env.log`` in
``experiments/results/ladder/calls/<n>/``, run ``analyze.py``, then pack the new files
(``python experiments/pack_results.py --raw experiments/results/ladder/runs
experiments/results/ladder/calls``); this script and ``analyze.py`` read the committed
``result.json`` and ``driver.json`` files loose or packed alike.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (str(ROOT), str(HERE), str(HERE.parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

import build_corpus  # noqa: E402
import pack_results  # noqa: E402
import spec as S  # noqa: E402

RESULTS = ROOT / "experiments" / "results" / "ladder"
COMMITTED_CORPUS = RESULTS / "corpus"
SPLIT_CHECKPOINT_EVERY = 128  # steps between the checkpoints of a run started with --stop-at
MARGIN_S = 20.0  # kept free before the limit: copying results, stopping
# the rows run at every size (BF16, NVFP4, MXFP4): queued before the middle size's extras
MAIN_SPECS = frozenset(spec for _, spec, _, sizes in S.ROWS if len(sizes) == len(S.SIZES))


def say(msg: str) -> None:
    print(f"[ladder {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------ prepare


def prepare(work: Path, out: Path, roots: list[Path] | None, committed: Path,
            max_file_bytes: int | None = None, tokenizer: str | None = None,
            val_per_10k: int | None = None) -> dict:
    """Steps 1 and 2 of the module docstring; returns ``{"tokens": DIR, "seconds": ...}``."""
    from fp4jax.train import tokens as T

    t0 = time.perf_counter()
    cdir = work / "corpus"
    want = None
    if (committed / "manifest.json").is_file():
        want = json.loads((committed / "manifest.json").read_text())
    kw = {} if max_file_bytes is None else {"max_file_bytes": max_file_bytes}
    if val_per_10k is not None:
        kw["val_per_10k"] = val_per_10k
    if want is not None and roots is None:
        kw = {"max_file_bytes": want["settings"]["max_file_bytes"],
              "val_per_10k": want["settings"]["val_per_10k"]}
    man = build_corpus.build(roots or build_corpus.default_roots(), cdir, **kw)
    t_corpus = time.perf_counter() - t0
    say(f"corpus {man['corpus_sha256'][:16]}: {man['counts']['kept']} files, train "
        f"{man['bytes']['train'] / 1e6:.1f} MB, val {man['bytes']['val'] / 1e6:.2f} MB, "
        f"{t_corpus:.1f} s")
    if want is not None and want["corpus_sha256"] != man["corpus_sha256"]:
        raise SystemExit(f"corpus SHA-256 {man['corpus_sha256']} differs from the committed "
                         f"{want['corpus_sha256']} ({committed / 'manifest.json'}): another "
                         "image or package set; compare files.tsv")
    tok_file = committed / "tokenizer.json"
    spec = tokenizer or (str(tok_file) if tok_file.is_file() else None)
    bpe = {}
    t1 = time.perf_counter()
    if spec is None:  # the first call: train the vocabulary on a sample of the train split
        spec, bpe = train_tokenizer(cdir / "train.tar", work / "tokenizer.json")
        say(f"BPE {S.VOCAB} trained on {bpe['files']} files, {bpe['bytes'] / 1e6:.1f} MB, "
            f"{bpe['seconds']:.1f} s")
    tdir = work / "tokens"
    meta = T.tokenize_corpus(cdir / "train.tar", spec, tdir, shard_tokens=SHARD_TOKENS,
                             val_data=cdir / "val.tar", cache=work / "cache",
                             overwrite=True)
    t_tok = time.perf_counter() - t1 - bpe.get("seconds", 0.0)
    say(f"tokens ({spec}): train {meta['tokens']['train'] / 1e6:.2f}M, val "
        f"{meta['tokens']['val'] / 1e6:.3f}M, "
        f"{man['bytes']['train'] / max(meta['tokens']['train'], 1):.3f} bytes/token, "
        f"{t_tok:.1f} s")
    committed_meta = committed / "tokens_meta.json"
    if committed_meta.is_file():
        cm = json.loads(committed_meta.read_text())
        if cm["splits"] != meta["splits"] or cm["tokenizer_sha256"] != meta["tokenizer_sha256"]:
            raise SystemExit(f"token shards differ from the committed {committed_meta}: "
                             "another tokenizers version or corpus")
        say("token shards match the committed SHA-256s")
    else:  # the first call: everything needed to rebuild, to be committed
        dest = out / "corpus"  # ``out`` is the call's outbox (packed into OUT/corpus.tar.gz)
        dest.mkdir(parents=True, exist_ok=True)
        for f in ("manifest.json", "files.tsv"):
            shutil.copy2(cdir / f, dest / f)
        shutil.copy2(tdir / "tokenizer.json", dest / "tokenizer.json")
        shutil.copy2(tdir / "meta.json", dest / "tokens_meta.json")
        say("first build: manifest, file list, tokenizer and token meta in corpus.tar.gz "
            "(commit them to experiments/results/ladder/corpus/)")
    return {"tokens": tdir, "corpus_sha256": man["corpus_sha256"], "bpe": bpe,
            "train_tokens": meta["tokens"]["train"], "val_tokens": meta["tokens"]["val"],
            "bytes": man["bytes"], "seconds": {"corpus": round(t_corpus, 1),
                                               "tokens": round(t_tok, 1)}}


SHARD_TOKENS = 50_000_000


def bpe_sampled(body: bytes) -> bool:
    """Whether a training file is in the BPE vocabulary's training sample (``S.BPE_SAMPLE``)."""
    return int(hashlib.sha256(body).hexdigest()[8:16], 16) % S.BPE_SAMPLE == 0


def train_tokenizer(train_tar: Path, dest: Path) -> tuple[str, dict]:
    """Trains ``bpe:VOCAB`` (``fp4jax.train.tokens.train_bpe``: deterministic) on the sampled
    training files of ``train_tar``; saves it to ``dest``; returns its path and a record."""
    from fp4jax.train import tokens as T
    from fp4jax.train.data import load_documents

    t0 = time.perf_counter()
    texts = [b.decode("utf-8") for _, b in load_documents(train_tar) if bpe_sampled(b)]
    tok = T.train_bpe(texts, S.VOCAB)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tok.save(dest)
    return str(dest), {"files": len(texts), "bytes": sum(len(t.encode()) for t in texts),
                       "sample": f"sha256[8:16] % {S.BPE_SAMPLE} == 0",
                       "vocab_size": tok.vocab_size, "sha256": tok.sha256,
                       "seconds": round(time.perf_counter() - t0, 1)}


# ------------------------------------------------------------------------------ runs


def finished(run_dir: Path) -> dict | None:
    """A run's ``result.json`` (loose, or packed in a ``records.tar.xz`` above it) when it
    finished (or diverged), else None."""
    try:
        r = json.loads(pack_results.read_text(run_dir, "result.json"))
    except (OSError, ValueError):
        return None
    return r if r.get("status") in ("finished", "diverged") else None


def known_results(*bases: Path) -> dict[str, dict]:
    """``{name: result}`` of every finished run under ``BASE/runs`` (the first base that
    has a run wins), ``name`` its path below ``runs`` (``ladder/small/nvfp4/seed0``);
    ``result.json`` loose or packed (``pack_results.find``)."""
    out: dict[str, dict] = {}
    for base in bases:
        root = (base / "runs").resolve()
        for res in pack_results.find(root, "result.json") if root.is_dir() else []:
            name = res.parent.relative_to(root).as_posix()
            r = finished(res.parent)
            if r is not None:
                out.setdefault(name, r)
    return out


def matches(run: dict, res: dict) -> bool:
    """Whether ``res`` (a ``result.json``) is a run of ``run``'s setup: preset, spec, seed,
    steps, sequence length and batch (and the sweep run's LR)."""
    cfg = res.get("config", {})
    want = {"preset": S.SIZES[run["size"]]["preset"], "recipe": run["spec"],
            "seed": run["seed"], "steps": S.run_tokens(run) // S.TOKENS_PER_STEP,
            "seq_len": S.SEQ_LEN, "batch_size": S.BATCH}
    if run["lr"] is not None:
        want["lr"] = run["lr"]
    return all(cfg.get(k) == v for k, v in want.items())


def chosen_lr(size: str, results: dict[str, dict]) -> float | None:
    """The LR of the lowest final validation loss among ``size``'s sweep runs, once all of
    them finished (a diverged run counts as infinitely bad); None before."""
    best = None
    for r in S.runs("sweep", (size,)):
        res = results.get(r["name"])
        if res is None:
            return None
        v = res.get("final_val_loss")
        v = float("inf") if v is None else v
        if best is None or v < best[0]:
            best = (v, r["lr"])
    return None if best is None or best[0] == float("inf") else best[1]


def measured_rates(results: dict[str, dict]) -> dict[tuple[str, str], float]:
    """Median tokens/s per (size, spec) of finished runs."""
    by: dict[tuple[str, str], list[float]] = {}
    for name, r in results.items():
        parts = name.split("/")
        if len(parts) < 3 or not r.get("tokens_per_s"):
            continue
        spec = r.get("spec") or r.get("recipe")
        by.setdefault((parts[1], spec), []).append(float(r["tokens_per_s"]))
    return {k: sorted(v)[len(v) // 2] for k, v in by.items()}


def metrics_rate(run_dir: Path) -> float | None:
    """Tokens/s of a run from its ``metrics.jsonl`` (the median of the second half of its
    ``train`` records; None with fewer than 8): also for a run stopped at the limit."""
    try:
        lines = pack_results.read_text(run_dir).splitlines()
    except OSError:
        return None
    tps = []
    for ln in lines:
        try:
            rec = json.loads(ln)
        except ValueError:
            continue
        if rec.get("type") == "train" and rec.get("tokens_per_s"):
            tps.append(float(rec["tokens_per_s"]))
    if len(tps) < 8:
        return None
    half = sorted(tps[len(tps) // 2:])
    return half[len(half) // 2]


def record_rates(records: list[dict]) -> dict[tuple[str, str], float]:
    """Median tokens/s per (size, spec) of the driver records that measured one (runs
    stopped at a call's limit included)."""
    runs = {r["name"]: r for ph in ("sweep", "ladder") for r in S.runs(ph)}
    by: dict[tuple[str, str], list[float]] = {}
    for rec in records:
        run = runs.get(rec.get("name"))
        if run is not None and rec.get("tokens_per_s"):
            by.setdefault((run["size"], run["spec"]), []).append(float(rec["tokens_per_s"]))
    return {k: sorted(v)[len(v) // 2] for k, v in by.items()}


def measured_overheads(records: list[dict], results: dict[str, dict]
                       ) -> dict[tuple[str, str], float]:
    """Per ``spec.overhead_key`` the largest measured overhead of a whole run (process
    seconds minus its tokens at its measured tokens/s: start-up, compiles, evaluations)
    among the driver records ``records`` (``driver.json``'s ``runs``) of finished runs. A
    record whose command trained another number of steps than the run has now (the first,
    half-token 100m rung's) is no measure of it and is skipped."""
    out: dict[tuple[str, str], float] = {}
    runs = {r["name"]: r for ph in ("sweep", "ladder") for r in S.runs(ph)}
    for rec in records:
        run, res = runs.get(rec.get("name")), results.get(rec.get("name"))
        if (run is None or res is None or rec.get("resumed") or rec.get("stop_at")
                or not rec.get("process_s") or not res.get("tokens_per_s")
                or rec.get("toy")):
            continue
        cmd = rec.get("command") or []
        if "--steps" in cmd and cmd.index("--steps") + 1 < len(cmd) and \
                cmd[cmd.index("--steps") + 1] != str(S.run_tokens(run) // S.TOKENS_PER_STEP):
            continue
        ov = rec["process_s"] - S.run_tokens(run) / res["tokens_per_s"]
        key = S.overhead_key(run)
        out[key] = max(out.get(key, 0.0), ov)
    return out


def driver_records(*bases: Path) -> list[dict]:
    """The run records of every ``driver.json`` under ``BASE/calls`` (committed calls),
    loose or packed in ``calls/records.tar.xz`` (``pack_results.find``)."""
    recs = []
    for base in bases:
        calls = (base / "calls").resolve()
        for f in pack_results.find(calls, "driver.json") if calls.is_dir() else []:
            try:
                d = json.loads(pack_results.read_text(f.parent, f.name))
            except ValueError:
                continue
            if not d.get("toy"):
                recs += d.get("runs", [])
    return recs


def run_argv(run: dict, toy: dict | None, tokens_dir: Path, out: Path) -> list[str]:
    """The ``fp4jax-train`` command line of ``run``."""
    size = S.SIZES[run["size"]]
    steps = S.run_tokens(run) // S.TOKENS_PER_STEP
    argv = [sys.executable, "-m", "fp4jax.train", "--preset", size["preset"],
            "--recipe", run["spec"], "--seed", str(run["seed"]), "--lr", f"{run['lr']:g}",
            "--steps", str(steps), *S.COMMON, "--data", str(tokens_dir), "--out", str(out)]
    if toy:
        argv = _toy_argv(argv, toy)
    return argv


def _toy_argv(argv: list[str], toy: dict) -> list[str]:
    """``argv`` with the toy overrides (``--toy``: a CPU dry run of the pipeline)."""
    argv = list(argv)
    for flag, value in toy.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = str(value)
        else:
            argv += [flag, str(value)]
    return argv


TOY_ESTIMATE_S = 30.0  # planned seconds of a toy run
TOY = {"--preset": "micro", "--steps": 6, "--seq-len": 32, "--batch-size": 4,
       "--eval-every": 3, "--eval-batches": 2, "--log-every": 1, "--warmup-steps": 1,
       "--attention": "xla"}


def gpu_ids(n: int | None) -> list[str]:
    """``n`` GPU ids (``CUDA_VISIBLE_DEVICES`` values); default: every GPU ``nvidia-smi -L``
    lists (1 when there is none: a CPU dry run)."""
    if n is None:
        try:
            lines = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                   timeout=30).stdout.splitlines()
            n = sum(1 for x in lines if x.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            n = 0
        n = n or 1
    return [str(i) for i in range(n)]


PACKS = ("runs", "corpus")  # the outbox folders, each sent back as OUT/<name>.tar.gz


def pack_out(outbox: Path, out: Path) -> list[Path]:
    """Each folder of ``outbox`` named in ``PACKS`` as ``out/<name>.tar.gz`` (members
    ``<name>/...``, sorted, mtime 0): the device call returns at most 8 files, at most 2
    folders down, so runs and corpus files travel as two archives. Written to a temporary
    name and renamed: a call cut off mid-way leaves the previous, complete archive."""
    import tarfile

    made = []
    for name in PACKS:
        src = outbox / name
        if not src.is_dir():
            continue
        tmp = out / f".{name}.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz", format=tarfile.PAX_FORMAT) as tar:
            for f in sorted(p for p in src.rglob("*") if p.is_file()):
                info = tar.gettarinfo(str(f), arcname=f.relative_to(outbox).as_posix())
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                with open(f, "rb") as fh:
                    tar.addfile(info, fh)
        os.replace(tmp, out / f"{name}.tar.gz")
        made.append(out / f"{name}.tar.gz")
    return made


def copy_back(run_dir: Path, dest: Path, log: Path) -> None:
    """A run's files without checkpoints, and its log, into ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns(
        "checkpoints*", "*.lock", ".fp4jax-lock", "*.old-*", "*.tmp"))
    if log.is_file():
        shutil.copy2(log, dest / "train.log")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phases", nargs="+", default=["sweep", "ladder"],
                   help="PHASE or PHASE:SIZE[,SIZE] (sweep, ladder; sizes mini, small, 100m), "
                        "queued in this order")
    p.add_argument("--specs", default=None,
                   help="only these specs (comma-separated slugs, e.g. bf16,nvfp4)")
    p.add_argument("--seeds", default=None, help="only these seeds (e.g. 0,1)")
    p.add_argument("--time-limit", type=float, default=540.0,
                   help="seconds from the start of this command to the end of the last run")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all)")
    p.add_argument("--work", default=None,
                   help="corpus, tokens, runs and caches (default: .data/ladder, with --toy "
                        ".data/ladder-toy)")
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".data" / "ladder-out")))
    p.add_argument("--results", default=str(RESULTS),
                   help="the committed results (finished runs are skipped; corpus/ checks)")
    p.add_argument("--root", action="append", default=None,
                   help="corpus roots (default: site-packages)")
    p.add_argument("--split", action="store_true",
                   help="start a run too long for the time left with --stop-at (resumed by a "
                        "later call on the same warm machine)")
    p.add_argument("--overhead-s", type=float, default=None,
                   help="at least this many seconds of compile, first step, evaluations and "
                        "start-up for every queued run (default: the largest measured for its "
                        "size, else spec.COMPILE_S); a recipe slower to compile than those "
                        "measured needs it for --split to fit")
    p.add_argument("--plan-only", action="store_true", help="print the plan and exit")
    p.add_argument("--toy", action="store_true",
                   help="CPU dry run: the micro preset, 6 steps, sequences of 32")
    p.add_argument("--max-file-bytes", type=int, default=None,
                   help="corpus: skip larger files (default: build_corpus's, or the committed)")
    p.add_argument("--val-per-10k", type=int, default=None,
                   help="corpus: held-out files per 10,000 (default: build_corpus's 150, "
                        "or the committed; --toy: 1000)")
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + a.time_limit
    work = Path(a.work or ROOT / ".data" / ("ladder-toy" if a.toy else "ladder"))
    out, committed = Path(a.out), Path(a.results)
    toy = TOY if a.toy else None
    if toy and a.results == str(RESULTS):  # a dry run never checks against the real ones
        committed = work / "toy-results"
    queue = []
    for ph in a.phases:
        name, _, sizes = ph.partition(":")
        queue += S.runs(name, tuple(sizes.split(",")) if sizes else None)
    if a.specs:
        keep = set(a.specs.split(","))
        queue = [r for r in queue if S.slug(r["spec"]) in keep or r["spec"] in keep]
    if a.seeds:
        keep_s = {int(x) for x in a.seeds.split(",")}
        queue = [r for r in queue if r["seed"] in keep_s]
    results = known_results(committed, work)
    if not toy:  # a result of another setup (a --toy run, other steps) is no ladder result
        runs_by = {r["name"]: r for ph in ("sweep", "ladder") for r in S.runs(ph)}
        for name in [n for n, r in results.items() if n in runs_by and not matches(
                runs_by[n], r)]:
            say(f"ignoring {name}: its result.json is not of this ladder's setup")
            del results[name]
    gpus = gpu_ids(a.gpus)
    rates = measured_rates(results)
    past = driver_records(committed)
    rates = {**record_rates(past), **rates}  # a finished run's own tokens/s first
    overheads = measured_overheads(past, results)
    if a.overhead_s is not None:
        for k in {S.overhead_key(r) for r in queue}:
            overheads[k] = max(a.overhead_s, overheads.get(k, S.COMPILE_S[k[1]]))

    def est(r: dict) -> float:
        """Seconds ``r`` needs, less the part a checkpoint here already holds."""
        if toy:
            return TOY_ESTIMATE_S
        full = S.estimate_s(r, rates, overheads)
        done = checkpoint_step(work / "runs" / r["name"])
        if not done:
            return full
        ov = overheads.get(S.overhead_key(r), S.COMPILE_S[S.overhead_key(r)[1]])
        return ov + (full - ov) * (1 - done / (S.run_tokens(r) // S.TOKENS_PER_STEP))

    todo = [r for r in queue if r["name"] not in results]
    say(f"{len(queue)} runs queued, {len(queue) - len(todo)} already finished, "
        f"{len(gpus)} GPU(s), limit {a.time_limit:.0f} s")
    for r in todo:
        say(f"  plan: {r['name']:58s} ~{est(r):5.0f} s")
    say(f"  plan total ~{sum(est(r) for r in todo):.0f} GPU-s "
        f"(/{len(gpus)} = ~{sum(est(r) for r in todo) / len(gpus):.0f} s)")
    if a.plan_only:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    outbox = work / "outbox"  # this call's files, packed into OUT/runs.tar.gz, corpus.tar.gz
    if outbox.exists():
        shutil.rmtree(outbox)
    outbox.mkdir(parents=True)
    record: dict = {"argv": sys.argv, "phases": a.phases, "time_limit": a.time_limit,
                    "gpus": gpus, "toy": bool(toy), "runs": []}
    try:
        prep = prepare(work, outbox, [Path(r) for r in a.root] if a.root else None,
                       committed / "corpus", a.max_file_bytes, None,
                       a.val_per_10k if a.val_per_10k is not None else (1000 if toy else None))
    except SystemExit as e:
        record["error"] = str(e)
        (out / "driver.json").write_text(json.dumps(record, indent=1))
        raise
    record["prepare"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in prep.items()}
    pack_out(outbox, out)
    free = list(gpus)
    running: dict[str, tuple] = {}
    pending = list(todo)

    def save_record() -> None:
        (out / "driver.json").write_text(json.dumps(record, indent=1))

    def launch(r: dict, gpu: str, stop_at: int | None) -> None:
        rdir = work / "runs" / r["name"]
        resume = checkpoint_step(rdir) > 0
        if rdir.exists() and not resume:
            shutil.rmtree(rdir)  # a run cut off before its checkpoint: nothing to keep
        rdir.parent.mkdir(parents=True, exist_ok=True)
        cmd = run_argv(r, toy, prep["tokens"], rdir)
        if resume:
            cmd.append("--resume")
        if stop_at is not None or resume:  # a split run also keeps a checkpoint every
            # SPLIT_CHECKPOINT_EVERY steps: cut off at the call's limit, it loses at most those
            cmd += ["--checkpoint-every", str(SPLIT_CHECKPOINT_EVERY)]
        if stop_at is not None:
            cmd += ["--stop-at", str(stop_at)]
        log = rdir.parent / f"{rdir.name}.log"
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu,
               "FP4JAX_CACHE": str(work / "cache")}
        f = open(log, "a")
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                cwd=str(ROOT))
        rec = {"name": r["name"], "gpu": gpu, "lr": r["lr"], "start_s":
               round(time.perf_counter() - t_start, 1), "resumed": resume,
               "stop_at": stop_at, "estimate_s": round(est(r), 1),
               "command": cmd[2:]}
        record["runs"].append(rec)
        running[r["name"]] = (proc, f, gpu, r, rec, time.perf_counter(), log)
        say(f"start {r['name']} on GPU {gpu} (lr {r['lr']:g}"
            + (", resumed" if resume else "") + (f", stop at {stop_at}" if stop_at else "")
            + f", ~{rec['estimate_s']:.0f} s)")

    def reap(name: str, stopped: bool = False) -> None:
        proc, f, gpu, r, rec, t0, log = running.pop(name)
        f.close()
        rdir = work / "runs" / name
        if rec["resumed"] and proc.returncode == 2 and not stopped:  # resume refused
            aside = rdir.with_name(f"{rdir.name}.old-{int(time.time())}")
            rdir.rename(aside)
            say(f"{name}: its resume was refused (see {log}); moved to {aside.name}, it "
                "starts afresh next time")
        free.append(gpu)
        rec.update(end_s=round(time.perf_counter() - t_start, 1),
                   process_s=round(time.perf_counter() - t0, 1), returncode=proc.returncode,
                   killed_at_limit=stopped)
        res = finished(rdir)
        rec["tokens_per_s"] = metrics_rate(rdir)
        rates.update({**record_rates(record["runs"]), **measured_rates(results)})
        if res is not None:
            results[name] = res
            rates.update(measured_rates(results))
            if not toy:
                overheads.update(measured_overheads(past + record["runs"], results))
        try:
            st = json.loads((rdir / "result.json").read_text()).get("status")
        except (OSError, ValueError):
            st = None
        rec["status"] = st
        if (rdir / "result.json").is_file() or (rdir / "metrics.jsonl").is_file():
            copy_back(rdir, outbox / "runs" / name, log)
            pack_out(outbox, out)
        say(f"end {name}: {st or 'no result'} (exit {proc.returncode}, "
            f"{rec['process_s']:.0f} s)")
        save_record()

    try:
        while True:
            for name, (proc, *_rest) in list(running.items()):
                if proc.poll() is not None:
                    reap(name)
            left = deadline - time.perf_counter() - MARGIN_S
            # LRs known now (a sweep may have just finished)
            for r in pending:
                if r["phase"] == "ladder" and r["lr"] is None:
                    r["lr"] = chosen_lr(r["size"], results)
            while free and pending:
                ready = [r for r in pending if r["lr"] is not None]
                fits = [r for r in ready if est(r) <= left]
                if fits:  # sweeps first (they unlock a size), then size by size: the main
                    # rows (BF16, NVFP4, MXFP4 at every size) before the middle size's extra
                    # rows, seed by seed (a call cut short still leaves paired seeds), the
                    # longest run first within a seed
                    r = min(fits, key=lambda x: (x["phase"] != "sweep",
                                                 list(S.SIZES).index(x["size"]),
                                                 x["spec"] not in MAIN_SPECS, x["seed"] or 0,
                                                 -est(x)))
                    pending.remove(r)
                    launch(r, free.pop(0), None)
                    continue
                if a.split and ready and not running_sweeps(running):
                    r = ready[0]
                    steps = _fit_steps(r, rates, overheads, left,
                                       checkpoint_step(work / "runs" / r["name"]), toy)
                    if steps:
                        pending.remove(r)
                        launch(r, free.pop(0), steps)
                        continue
                break
            if not running:  # nothing runs and nothing more could start: done
                if pending:
                    say(f"{len(pending)} run(s) not started (no time left, or waiting for "
                        f"an LR sweep): {', '.join(r['name'] for r in pending)}")
                    record["not_started"] = [r["name"] for r in pending]
                break
            if time.perf_counter() > deadline - 5:
                break
            time.sleep(1.0)
    finally:
        for name, (proc, *_rest) in list(running.items()):
            say(f"time limit: stopping {name}")
            proc.send_signal(signal.SIGTERM)
        for name, (proc, *_rest) in list(running.items()):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            reap(name, stopped=True)
        record["wall_s"] = round(time.perf_counter() - t_start, 1)
        save_record()
    done = [x for x in record["runs"] if x.get("status") == "finished"]
    say(f"{len(done)} run(s) finished in this call, {record['wall_s']:.0f} s; results in "
        + ", ".join(str(p) for p in pack_out(outbox, out)))
    return 0


def running_sweeps(running: dict) -> bool:
    return any(v[3]["phase"] == "sweep" for v in running.values())


def checkpoint_step(run_dir: Path) -> int:
    """The step of the newest checkpoint of a run cut off by ``--stop-at`` (0: none)."""
    ck = run_dir / "checkpoints"
    steps = [int(x.name) for x in ck.iterdir() if x.name.isdigit()] if ck.is_dir() else []
    return max(steps, default=0)


def _fit_steps(r: dict, rates: dict, overheads: dict, left: float, done: int,
               toy: dict | None) -> int | None:
    """The step to stop ``r`` at (``--stop-at``) so that it fits ``left`` seconds, resumed
    from step ``done``: at least 10% of its steps more, short of the end; else None."""
    steps = S.run_tokens(r) // S.TOKENS_PER_STEP if not toy else int(toy["--steps"])
    ov = overheads.get(S.overhead_key(r), S.COMPILE_S[S.overhead_key(r)[1]])
    per_step = (S.estimate_s(r, rates, overheads) - ov) / steps
    n = int((left - ov - 15) / max(per_step, 1e-9))
    return done + n if steps // 10 <= n and done + n < steps else None


if __name__ == "__main__":
    sys.exit(main())
