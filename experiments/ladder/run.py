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
   trained on the training split here and it, ``meta.json``, the manifest and the file list
   go to ``OUT/corpus/`` to be committed; an up-to-date ``WORK/tokens`` is reused;
3. **runs**: the phases' runs (``spec.py``) not yet finished, here or in the committed
   results (``experiments/results/ladder/runs/<name>/result.json``), one ``fp4jax-train``
   process per GPU (``CUDA_VISIBLE_DEVICES``), into ``WORK/runs/<name>``; each run is
   started only if its estimate (measured tokens/s of finished runs, else ``spec.RATES``)
   fits before the time limit; a ladder run waits for its size's LR sweep (the LR of the
   lowest final validation loss). With ``--split`` a run too long for what is left starts
   anyway with ``--stop-at`` (the steps that fit) and a checkpoint there, and a later call
   on the same warm machine resumes it. At the limit every run still going is stopped
   (SIGTERM) and reported.

What comes back, under ``--out``: ``runs/<name>/`` (``result.json``, ``metrics.jsonl``,
``train.log``; no checkpoints), ``driver.json`` (the plan, each run's GPU, start, end,
process seconds and exit status, the prep times) and ``corpus/`` on the first call. Copy
``OUT/runs/*`` and ``OUT/driver.json`` (as ``calls/<n>/driver.json``) into
``experiments/results/ladder/`` and run ``analyze.py``.
"""

from __future__ import annotations

import argparse
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
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import build_corpus  # noqa: E402
import spec as S  # noqa: E402

RESULTS = ROOT / "experiments" / "results" / "ladder"
COMMITTED_CORPUS = RESULTS / "corpus"
MARGIN_S = 20.0  # kept free before the limit: copying results, stopping


def say(msg: str) -> None:
    print(f"[ladder {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------ prepare


def prepare(work: Path, out: Path, roots: list[Path] | None, committed: Path,
            max_file_bytes: int | None = None, tokenizer: str | None = None,
            val_per_10k: int | None = None) -> dict:
    """Steps 1 and 2 of the module docstring; returns ``{"tokens": DIR, "seconds": ...}``."""
    from fp4jax import tokens as T

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
    import site

    man = build_corpus.build(roots or [Path(r) for r in site.getsitepackages()], cdir, **kw)
    t_corpus = time.perf_counter() - t0
    say(f"corpus {man['corpus_sha256'][:16]}: {man['counts']['kept']} files, train "
        f"{man['bytes']['train'] / 1e6:.1f} MB, val {man['bytes']['val'] / 1e6:.2f} MB, "
        f"{t_corpus:.1f} s")
    if want is not None and want["corpus_sha256"] != man["corpus_sha256"]:
        raise SystemExit(f"corpus SHA-256 {man['corpus_sha256']} differs from the committed "
                         f"{want['corpus_sha256']} ({committed / 'manifest.json'}): another "
                         "image or package set; compare files.tsv")
    tok_file = committed / "tokenizer.json"
    spec = tokenizer or (str(tok_file) if tok_file.is_file() else f"bpe:{S.VOCAB}")
    tdir = work / "tokens"
    t1 = time.perf_counter()
    meta = T.tokenize_corpus(cdir / "train.tar", spec, tdir, shard_tokens=SHARD_TOKENS,
                             val_data=cdir / "val.tar", cache=work / "cache",
                             overwrite=True)
    t_tok = time.perf_counter() - t1
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
        dest = out / "corpus"
        dest.mkdir(parents=True, exist_ok=True)
        for f in ("manifest.json", "files.tsv"):
            shutil.copy2(cdir / f, dest / f)
        shutil.copy2(tdir / "tokenizer.json", dest / "tokenizer.json")
        shutil.copy2(tdir / "meta.json", dest / "tokens_meta.json")
        say(f"first build: manifest, file list, tokenizer and token meta in {dest} "
            "(commit them to experiments/results/ladder/corpus/)")
    return {"tokens": tdir, "corpus_sha256": man["corpus_sha256"],
            "train_tokens": meta["tokens"]["train"], "val_tokens": meta["tokens"]["val"],
            "bytes": man["bytes"], "seconds": {"corpus": round(t_corpus, 1),
                                               "tokens": round(t_tok, 1)}}


SHARD_TOKENS = 50_000_000


# ------------------------------------------------------------------------------ runs


def finished(run_dir: Path) -> dict | None:
    """A run's ``result.json`` when it finished (or diverged), else None."""
    try:
        r = json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError):
        return None
    return r if r.get("status") in ("finished", "diverged") else None


def known_results(*bases: Path) -> dict[str, dict]:
    """``{name: result}`` of every finished run under ``BASE/runs`` (the first base that
    has a run wins), ``name`` its path below ``runs`` (``ladder/small/nvfp4/seed0``)."""
    out: dict[str, dict] = {}
    for base in bases:
        root = base / "runs"
        for res in sorted(root.rglob("result.json")) if root.is_dir() else []:
            name = res.parent.relative_to(root).as_posix()
            r = finished(res.parent)
            if r is not None:
                out.setdefault(name, r)
    return out


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


def run_argv(run: dict, toy: dict | None, tokens_dir: Path, out: Path) -> list[str]:
    """The ``fp4jax-train`` command line of ``run``."""
    size = S.SIZES[run["size"]]
    steps = size["steps"]
    if run["phase"] == "sweep":
        steps = max(1, int(round(steps * size.get("sweep_fraction", 1.0))))
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


def copy_back(run_dir: Path, dest: Path, log: Path) -> None:
    """A run's files without checkpoints, and its log, into ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns("checkpoints*", "*.lock",
                                                                  "*.old-*"))
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
    p.add_argument("--work", default=str(ROOT / ".data" / "ladder"))
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / ".data" / "ladder-out")))
    p.add_argument("--results", default=str(RESULTS),
                   help="the committed results (finished runs are skipped; corpus/ checks)")
    p.add_argument("--root", action="append", default=None,
                   help="corpus roots (default: site-packages)")
    p.add_argument("--split", action="store_true",
                   help="start a run too long for the time left with --stop-at (resumed by a "
                        "later call on the same warm machine)")
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
    work, out, committed = Path(a.work), Path(a.out), Path(a.results)
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
    gpus = gpu_ids(a.gpus)
    rates = measured_rates(results)

    def est(r: dict) -> float:
        return TOY_ESTIMATE_S if toy else S.estimate_s(r, rates)

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
    record: dict = {"argv": sys.argv, "phases": a.phases, "time_limit": a.time_limit,
                    "gpus": gpus, "toy": bool(toy), "runs": []}
    try:
        prep = prepare(work, out, [Path(r) for r in a.root] if a.root else None,
                       committed / "corpus", a.max_file_bytes, None,
                       a.val_per_10k if a.val_per_10k is not None else (1000 if toy else None))
    except SystemExit as e:
        record["error"] = str(e)
        (out / "driver.json").write_text(json.dumps(record, indent=1))
        raise
    record["prepare"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in prep.items()}
    free = list(gpus)
    running: dict[str, tuple] = {}
    pending = list(todo)

    def save_record() -> None:
        (out / "driver.json").write_text(json.dumps(record, indent=1))

    def launch(r: dict, gpu: str, stop_at: int | None) -> None:
        rdir = work / "runs" / r["name"]
        resume = (rdir / "checkpoints").is_dir() and any(
            x.name.isdigit() for x in (rdir / "checkpoints").iterdir())
        if rdir.exists() and not resume:
            shutil.rmtree(rdir)  # a run cut off before its checkpoint: nothing to keep
        rdir.parent.mkdir(parents=True, exist_ok=True)
        cmd = run_argv(r, toy, prep["tokens"], rdir)
        if resume:
            cmd.append("--resume")
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
        free.append(gpu)
        rec.update(end_s=round(time.perf_counter() - t_start, 1),
                   process_s=round(time.perf_counter() - t0, 1), returncode=proc.returncode,
                   killed_at_limit=stopped)
        rdir = work / "runs" / name
        res = finished(rdir)
        if res is not None:
            results[name] = res
            rates.update(measured_rates({name: res}))
        try:
            st = json.loads((rdir / "result.json").read_text()).get("status")
        except (OSError, ValueError):
            st = None
        rec["status"] = st
        if (rdir / "result.json").is_file() or (rdir / "metrics.jsonl").is_file():
            copy_back(rdir, out / "runs" / name, log)
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
                if fits:
                    r = fits[0]
                    pending.remove(r)
                    launch(r, free.pop(0), None)
                    continue
                if a.split and ready and not running_sweeps(running):
                    r = ready[0]
                    steps = _fit_steps(r, est(r), left, toy)
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
    say(f"{len(done)} run(s) finished in this call, {record['wall_s']:.0f} s; "
        f"results in {out / 'runs'}")
    return 0


def running_sweeps(running: dict) -> bool:
    return any(v[3]["phase"] == "sweep" for v in running.values())


def _fit_steps(r: dict, estimate: float, left: float, toy: dict | None) -> int | None:
    """The steps of ``r`` (estimated ``estimate`` seconds in all) that fit ``left``
    seconds (at least 10% of its steps), or None."""
    steps = S.SIZES[r["size"]]["steps"] if not toy else int(toy["--steps"])
    per_step = (estimate - S.COMPILE_S["other"]) / steps
    n = int((left - S.COMPILE_S["other"] - 15) / max(per_step, 1e-9))
    return n if steps // 10 <= n < steps else None


if __name__ == "__main__":
    sys.exit(main())
