"""Checkpoint-stall probe as run at commit f002721 (it patches that commit's
``BackgroundWriter``, since removed): 100m bf16 --scan-layers, 400 steps, a checkpoint every
100. Variants: ``async`` (the background writer), ``sync*`` (its job run inline), ``gcoff``
(``gc.disable()``), ``*_log50`` (a metrics record every 50 steps, else every step).
Usage: python3 ck_probe_f002721.py VARIANT DATA OUT"""

import gc
import json
import statistics
import sys
import time

from fp4jax import train as T
from fp4jax.train import checkpoint as ck

variant, data, out = sys.argv[1:4]
if variant.startswith("sync"):
    def submit(self, job):
        recs = self.wait()
        t0 = time.perf_counter()
        rec = job()
        self._done.append({**rec, "write_seconds": time.perf_counter() - t0})
        return recs

    ck.BackgroundWriter.submit = submit
if variant == "gcoff":
    gc.disable()
log_every = 50 if variant.endswith("log50") else 1
cfg = T.TrainConfig(preset="100m", recipe="bf16", scan_layers=True, steps=400,
                    checkpoint_every=100, eval_every=0, log_every=log_every, progress=False,
                    data=data, out=out)
T.train(cfg)
recs = [json.loads(line) for line in open(out + "/metrics.jsonl")]
tr = [r for r in recs if r["type"] == "train"]
summary = {"variant": variant, "checkpoints": [r for r in recs if r["type"] == "checkpoint"]}
for a, b in ((20, 100), (100, 200), (200, 300), (300, 400)):
    rs = [r for r in tr if a <= r["step"] < b]
    xs = [16384 / r["tokens_per_s"] for r in rs]
    summary[f"{a}-{b}"] = {"median_ms": 1e3 * statistics.median(xs), "max_ms": 1e3 * max(xs),
                           "tokens_per_s_mean": 16384 * len(rs) / sum(xs)}
print(json.dumps(summary))
