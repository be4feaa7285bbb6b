"""fp4jax's test suite, by layer (``core``, ``recipes``, ``dot``, ``kernels``, ``nn``,
``train``, ``experiments``, ``docs``); the helpers the layers share live here, at the top:
``reference`` (the independent NumPy reference), ``kernel_inputs``, ``interpret``,
``harness_models``, ``textdata``."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The repository's root folder."""

MICRO_SCAN_NVFP4 = dict(preset="micro", steps=5, lr=1e-2, batch_size=8, seq_len=64,
                        eval_every=0, eval_batches=1, log_every=1, warmup_steps=1,
                        progress=False, scan_layers=True, last_bf16=0)
"""``TrainConfig`` keywords of a 5-step micro run, both blocks NVFP4 in one ``nn.scan``: the
runs of tests/train/test_stats.py, test_auto_precision.py and test_train.py's scan test
compile the same train step (and stats step), once per session on the worker of their
xdist group ``micro_scan_nvfp4``."""
