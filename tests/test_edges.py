"""Issue 38, sections 2 and 3: what a careless or unlucky researcher broke, and what a newcomer
met. Each test failed before its fix."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp4jax
from fp4jax import recipes as R
from fp4jax.hadamard import TE_SIGN_VECTOR

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------
# Hadamard signs: +-1 only, as many as the RHT size.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("signs,match", [
    ((0, 1) * 8, "every entry must be"),        # 0/1 bits
    ((2,) * 16, "every entry must be"),
    ((True, False) * 8, "every entry must be"),
    ((1, -1) * 4, "8 signs for an RHT of size 16"),
    (2**40, "seed"),
])
def test_hadamard_signs_validated_where_the_spec_is_built(signs, match):
    with pytest.raises(ValueError, match=match):
        R.GemmSpec(R.QuantSpec(), R.QuantSpec(), hadamard=16, hadamard_signs=signs)
    with pytest.raises(ValueError, match=match):
        R.nvfp4().replace(**{"wgrad.hadamard_signs": signs})
    with pytest.raises(ValueError, match=r"wgrad\.hadamard_signs"):
        R.parse(f"nvfp4(wgrad.hadamard_signs={signs!r})")


def test_valid_hadamard_signs_accepted():
    g = R.GemmSpec(hadamard=16, hadamard_signs=list(TE_SIGN_VECTOR))
    assert g.hadamard_signs == tuple(float(v) for v in TE_SIGN_VECTOR)
    r = R.parse("nvfp4(wgrad.hadamard_signs=" + repr(tuple(int(v) for v in TE_SIGN_VECTOR))
                + ")")
    assert R.parse(R.spec(r)) == r
    with pytest.raises(ValueError, match="32"):  # a longer RHT needs 32 signs
        r.replace(rht=32)


# ---------------------------------------------------------------------------
# Spec values beyond the parser; booleans; get() of a spec.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["-" * 5000 + "16", "-" * 20000 + "16", "1e999", "16.5",
                                   "'16'", "True", "10**3", "9" * 400])
def test_bad_rht_values_are_value_errors_naming_the_key(value):
    with pytest.raises(ValueError, match="rht") as e:
        R.parse(f"nvfp4(rht={value})")
    assert len(str(e.value)) < 400  # one readable line, not the whole spec echoed


@pytest.mark.parametrize("key", ["sr", "block_2d", "row_scaled", "fprop.rhs.block_2d"])
@pytest.mark.parametrize("value", ["Flase", "0", "1", "'False'", "None"])
def test_spec_booleans_are_true_or_false_only(key, value):
    with pytest.raises(ValueError, match=rf"{key}={value}.*True or False"):
        R.parse(f"nvfp4({key}={value})")


def test_rht_must_be_an_int_in_replace():
    for bad in (16.5, "16", True):
        with pytest.raises(TypeError, match="rht must be an int"):
            R.nvfp4().replace(rht=bad)
    with pytest.raises(TypeError, match="block_2d must be True or False"):
        R.QuantSpec(block_2d="False")


def test_get_accepts_spec_strings():
    assert R.get("nvfp4(sr=False)") == R.parse("nvfp4(sr=False)")
    assert R.get("nvfp4") == R.nvfp4()
    with pytest.raises(ValueError, match="unknown recipe"):
        R.get("nvfp5(sr=False)")


def test_spec_of_a_name_with_both_quote_kinds_parses_back():
    r = R.nvfp4().replace(name="a'b\"c, (d)")
    assert R.parse(R.spec(r)) == r


# ---------------------------------------------------------------------------
# quartet2 with 0 tokens.
# ---------------------------------------------------------------------------

def test_dot_with_zero_tokens_under_quartet2_like_nvfp4():
    """MS-EDEN's reshape of an empty array divided by zero (nvfp4 handled 0 tokens)."""
    x = jnp.zeros((0, 128), jnp.float32)
    w = jnp.ones((128, 16), jnp.float32)

    def loss(x, w):
        y = fp4jax.dot(x, w, recipe=R.quartet2(), key=jax.random.key(0))
        return y.sum(), y.shape

    (_, shape), (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
    assert shape == (0, 16) and dx.shape == (0, 128)
    np.testing.assert_array_equal(np.asarray(dw), 0)
    q = fp4jax.quantize(jnp.zeros((3, 0, 128)), rounding="ms_eden", key=jax.random.key(1))
    assert q.scale.shape == (3, 0, 8)


# ---------------------------------------------------------------------------
# A gzip corpus with a damaged byte.
# ---------------------------------------------------------------------------

def test_damaged_gzip_corpus_is_one_line_naming_the_file(tmp_path):
    from fp4jax.train import data

    raw = gzip.compress(("To be, or not to be, that is the question. " * 200).encode())
    hit = 0
    for i in range(12, len(raw) - 8):  # flip one byte of the deflate stream at a time
        bad = bytearray(raw)
        bad[i] ^= 0x5A
        try:
            zlib.decompress(bytes(bad), 31)
            continue
        except zlib.error:
            pass
        except Exception:  # noqa: BLE001 - other failures are not this case
            continue
        path = tmp_path / f"corpus{i}.txt.gz"
        path.write_bytes(bytes(bad))
        with pytest.raises(ValueError) as e:
            data.load_documents(path)
        msg = str(e.value)
        assert path.name in msg and "damaged" in msg and "\n" not in msg
        hit += 1
        if hit == 3:
            break
    assert hit == 3


# ---------------------------------------------------------------------------
# --bf16-layers auto:PATH with a bad stats source.
# ---------------------------------------------------------------------------

def _stats_line(layers) -> str:
    return json.dumps({"type": "stats", "step": 4, "layers": layers}) + "\n"


@pytest.mark.parametrize("content,match", [
    (b"\x98\x00\xff binary", "not UTF-8"),
    (_stats_line([]).encode(), r"stats record 1 \(step 4\).*'layers'"),
    (_stats_line({"block_0/q": {"wgrad": {"rel_error": "x"}}}).encode(),
     r"stats record 1 .*block_0/q/wgrad/rel_error = 'x' is not a number"),
    (_stats_line({"block_0/q": ["wgrad"]}).encode(), r"layer 'block_0/q'"),
])
def test_bad_bf16_stats_source_names_flag_file_and_record(tmp_path, content, match):
    from fp4jax.train.precision import read_stats_source

    f = tmp_path / "metrics.jsonl"
    f.write_bytes(content)
    flag = f"--bf16-layers auto:{tmp_path}"
    with pytest.raises(ValueError, match=match) as e:
        read_stats_source(tmp_path, flag)
    assert flag in str(e.value) and str(f) in str(e.value)


# ---------------------------------------------------------------------------
# A run directory refuses a second writer; sweep workers end with their parent.
# ---------------------------------------------------------------------------

def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}


def test_run_directory_refuses_a_second_writer(tmp_path):
    from fp4jax.train import TrainConfig
    from fp4jax.train.rundir import (
        RunLocked,
        check_unlocked,
        claim_out,
        lock_out,
        lock_owner,
        release_out,
    )

    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from fp4jax.train.rundir import lock_out
            lock_out({str(out)!r}); print("locked", flush=True); time.sleep(120)""")],
        stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert lock_owner(out) == holder.pid
        with pytest.raises(RunLocked, match=f"process {holder.pid}"):
            check_unlocked(out)
        with pytest.raises(RunLocked):
            claim_out(TrainConfig(out=str(out), overwrite=True))
        with pytest.raises(RunLocked):
            lock_out(out)
    finally:
        holder.kill()
        holder.wait()
    # a dead owner does not hold it (its pid is still in the file)
    assert (out / ".fp4jax-lock").read_text().strip() == str(holder.pid)
    assert lock_owner(out) is None
    lock_out(out)
    lock_out(out)  # re-entrant in one process
    release_out(out)
    release_out(out)
    check_unlocked(out)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def test_sweep_worker_ends_when_its_parent_is_killed(tmp_path):
    """The parent is killed with SIGKILL (as an OOM killer does): its worker, which would
    otherwise train on as an orphan, ends within seconds."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, subprocess, sys, time
        env = dict(os.environ, FP4JAX_SWEEP_PARENT=str(os.getpid()))
        child = subprocess.Popen([sys.executable, "-c",
            "import os, sys, time\\n"
            "from fp4jax.train._worker import watch_parent\\n"
            "watch_parent(int(os.environ['FP4JAX_SWEEP_PARENT']), interval=0.2)\\n"
            "open({str(pid_file)!r}, 'w').write(str(os.getpid()))\\n"
            "time.sleep(120)\\n"], env=env)
        time.sleep(120)""")], env=_env())
    try:
        deadline = time.time() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert time.time() < deadline and parent.poll() is None
            time.sleep(0.1)
        child = int(pid_file.read_text())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.time() + 15
        while time.time() < deadline:
            if not _alive(child):
                break
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the worker outlived its parent")
    finally:
        if parent.poll() is None:
            parent.kill()


# ---------------------------------------------------------------------------
# Newcomer frictions (section 3).
# ---------------------------------------------------------------------------

def test_help_every_flag_explained_defaults_once():
    import re

    from fp4jax.train.cli import build_parser

    p = build_parser()
    for action in p._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help"
    text = p.format_help()
    flat = " ".join(text.split())
    assert not re.search(r"\(default: [^)]*\)\s*\(default:", flat)
    assert "Default: bytes / the files' own (default" not in flat
    no_progress = flat.split("--no-progress", 2)[2].split("--", 1)[0]
    assert "shown by default" in no_progress and "(default: True)" not in no_progress
    assert "micro 1 of 2" in flat  # the preset-dependent --last-bf16 default, shown
    assert "--seq-len SEQ_LEN tokens per training sequence (default: 128)" in flat


def test_compare_tables_one_seed_and_bf16_share():
    from fp4jax.train.comparison import comparison_table, recipe_colors, summary_table

    agg = {"baseline": "bf16", "summary": [
        {"recipe": "bf16", "seeds": [0], "n": 1, "mean": 1.5, "std": 0.0, "min": 1.5,
         "max": 1.5, "gap_vs_baseline": None, "gap_exceeds_spread": None,
         "tokens_per_s": 10.0}]}
    table = summary_table(agg)
    assert "1.5000 ± n/a" in table and "± 0.0000" not in table
    rows = comparison_table([
        {"recipe": "bf16", "final_val_loss": 1.5, "bf16_gemm_fraction": 1.0},
        {"recipe": "nvfp4", "final_val_loss": 1.6, "bf16_gemm_fraction": 0.5}])
    assert "BF16 GEMM work" in rows and "| 50% |" in rows and "| 100% |" in rows
    assert recipe_colors(["bf16", "nvfp4", "bf16", "mxfp4"]) == {
        "bf16": "C0", "nvfp4": "C1", "mxfp4": "C2"}


# ---------------------------------------------------------------------------
# Per-device token rows: checked before --out is claimed.
# ---------------------------------------------------------------------------

def test_token_rows_per_device_refused_before_out_is_claimed(tmp_path):
    """quartet2's 128-token RHT with 48 token rows a device (4 devices, 4 sequences of 48):
    refused with the numbers and a fix before anything is written, so the corrected command
    runs without ``--overwrite``; a batch that fits passes the check."""
    if len(jax.devices()) < 4:
        pytest.skip("needs the 4 virtual CPU devices of conftest.py")
    from fp4jax.train import TrainConfig, loop
    from fp4jax.train.config import run_recipe
    from tests.textdata import write_text

    corpus = write_text(tmp_path / "corpus.txt", 20_000)
    out = tmp_path / "run"
    cfg = TrainConfig(preset="micro", recipe="quartet2", steps=2, batch_size=4, seq_len=48,
                      devices=4, eval_every=0, eval_batches=1, progress=False,
                      data=str(corpus), out=str(out))
    with pytest.raises(ValueError, match=r"48 token rows a device; recipe 'quartet2' needs a "
                                         r"multiple of 128.*multiple of 32"):
        loop.train(cfg)
    assert not out.exists()
    # the suggested batch (8 sequences a device: 384 rows, a multiple of 128) passes the check
    ds = loop.load_data(cfg)
    rcfg, recipe = run_recipe(cfg)
    good = cfg.replace(batch_size=32)
    mesh = loop.run_mesh(good, rcfg)
    loop.check_token_rows(good, loop.build_models(good, rcfg, recipe, ds), mesh)
    # nvfp4 needs 16 rows: 48 a device is fine
    loop.check_token_rows(cfg.replace(recipe="nvfp4"), loop.build_models(
        cfg, *run_recipe(cfg.replace(recipe="nvfp4")), ds), mesh)


def test_paired_difference_against_numpy_and_in_the_compare_table():
    """Recipes compared per seed: mean of (loss - baseline loss) over the shared seeds with
    its standard error std(d, ddof=1)/sqrt(n), and the same relative, against a hand NumPy
    computation; a seed only one recipe ran is left out; one shared seed gives n/a."""
    from fp4jax.train.comparison import paired_difference, summarize, summary_table

    base = {0: 1.20, 1: 1.25, 2: 1.22, 3: 1.30}
    other = {0: 1.21, 1: 1.27, 2: 1.225, 5: 1.0}
    p = paired_difference(base, other)
    b = np.array([1.20, 1.25, 1.22])
    d = np.array([1.21, 1.27, 1.225]) - b
    assert p["seeds"] == [0, 1, 2] and p["n"] == 3
    assert p["mean"] == pytest.approx(d.mean(), rel=1e-12)
    assert p["se"] == pytest.approx(np.std(d, ddof=1) / np.sqrt(3), rel=1e-12)
    assert p["rel_mean"] == pytest.approx((d / b).mean(), rel=1e-12)
    assert p["rel_se"] == pytest.approx(np.std(d / b, ddof=1) / np.sqrt(3), rel=1e-12)
    # the paired SE is far below the unpaired spread when seeds move both recipes together
    assert p["se"] < np.std(list(base.values())[:3], ddof=1) / 3
    one = paired_difference({0: 1.0}, {0: 1.1, 1: 1.2})
    assert one["n"] == 1 and one["mean"] == pytest.approx(0.1) and one["se"] is None
    assert paired_difference({0: 1.0}, {1: 1.0})["mean"] is None
    assert paired_difference({0: 1.0, 1: float("nan")}, {0: 1.1, 1: 1.0})["n"] == 1

    runs = [{"recipe": sp, "seed": s, "final_val_loss": v, "status": "finished"}
            for sp, vals in (("bf16", base), ("nvfp4", other)) for s, v in vals.items()]
    agg = summarize(runs)
    row = agg["summary"][1]
    assert row["paired"]["mean"] == pytest.approx(p["mean"]) and row["paired"]["n"] == 3
    assert agg["summary"][0]["paired"]["se"] == 0.0  # the baseline against itself
    md = summary_table(agg)
    assert f"{p['mean']:+.4f} ± {p['se']:.4f} (n=3)" in md
    assert f"{100 * p['rel_mean']:+.2f}% ± {100 * p['rel_se']:.2f}%" in md
    solo = summarize([{"recipe": "bf16", "seed": 0, "final_val_loss": 1.0},
                      {"recipe": "nvfp4", "seed": 0, "final_val_loss": 1.1}])
    assert "| n/a | n/a |" in summary_table(solo)


def test_sweep_workers_get_gpus_of_their_own(tmp_path, monkeypatch):
    """``--jobs N`` with runs of ``--devices d``: when N x d fit the GPUs, each worker gets
    its own ``CUDA_VISIBLE_DEVICES`` (a finished worker's GPUs go to the next); otherwise
    (``--devices 0``, too few GPUs, none) they share every device, without preallocation."""
    import subprocess

    from fp4jax.train import comparison as C
    from fp4jax.train.config import TrainConfig

    assert C.gpu_slots(2, 2, ["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert C.gpu_slots(4, 1, ["4", "5", "6", "7"]) == ["4", "5", "6", "7"]
    assert C.gpu_slots(3, 2, ["0", "1", "2", "3"]) is None
    assert C.gpu_slots(2, 0, ["0", "1"]) is None and C.gpu_slots(1, 1, []) is None
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert C.local_gpus() == ["3", "5"]
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert C.local_gpus() == []

    started = []

    class FakeProc:
        returncode = 0

        def __init__(self, argv, env, **kw):
            started.append(env.get("CUDA_VISIBLE_DEVICES"))
            self.env = env

        def poll(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakeProc)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")

    def subs(devices):
        return {(sp, s): TrainConfig(recipe=sp, seed=s, devices=devices,
                                     out=str(tmp_path / sp / f"seed{s}"))
                for sp in ("bf16", "nvfp4", "mxfp4") for s in (0,)}

    slugs = {"bf16": "bf16", "nvfp4": "nvfp4", "mxfp4": "mxfp4"}
    assert C._train_parallel(subs(1), slugs, tmp_path, 2, gpus=["0", "1"]) == []
    assert started == ["0", "1", "0"] or started == ["0", "1", "1"]
    started.clear()
    C._train_parallel(subs(0), slugs, tmp_path, 2, gpus=["0", "1"])  # all devices: shared
    assert started == [None, None, None]
