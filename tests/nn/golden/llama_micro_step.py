"""Loss and gradients of one ``micro`` Llama training step, as the harness builds the model
(``fp4jax.train.loop.build_models``): the golden values of ``llama_micro_step.json``.

The file was produced by fp4jax at commit 7e8f18f (the Llama of fp4jax's own quantized
layers and ``PrecisionPolicy``), before the Llama became plain Flax layers put under
``fp4jax.nn.quantize_model`` rules; the test (``test_llama_rules.py``) runs ``cases()`` on
today's code and compares: the parameter tree (paths and shapes), the loss's and every
gradient's float32 bits (SHA-256 of each array's bytes). Regenerate (only on purpose)::

    PYTHONPATH=$PWD python tests/nn/golden/llama_micro_step.py \
        > tests/nn/golden/llama_micro_step.json

(at 7e8f18f: this file run on ``git archive 7e8f18f``'s tree; XLA:CPU, the suite's flags).
The RMSNorm scales' gradients (``is_host_sum``) differ in their last bits between hosts:
``host_sums`` holds their hashes from a second host (7e8f18f's tree run there, 2026-11-28:
an AVX-512 Xeon, where the first file's norm gradients did not reproduce while every other
gradient and the loss did) and ``sum_grads`` their values there, which the test compares
within float32 rounding on any other host.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np

# the test suite's XLA:CPU flags (tests/conftest.py): float32 sums' order depends on them
XLA_TEST_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

# (name, TrainConfig changes): the default recipes at micro (block_1 BF16 by --last-bf16's
# default), BF16, a scanned stack (both blocks NVFP4: one nn.scan), --bf16-layers names,
# and the model after the precision switch to BF16's forward (--switch fwd)
CASES = (
    ("nvfp4", {"recipe": "nvfp4"}),
    ("bf16", {"recipe": "bf16"}),
    ("nvfp4_scan", {"recipe": "nvfp4", "last_bf16": 0, "scan_layers": True}),
    ("nvfp4_bf16_layers", {"recipe": "nvfp4", "last_bf16": 0, "bf16_layers": "block_1/up"}),
    ("nvfp4_switched_fwd", {"recipe": "nvfp4", "switch": "fwd", "switch_at": 0.5}),
)
SEQ, BATCH = 16, 2


def is_host_sum(path: str) -> bool:
    """Whether the gradient at ``path`` is an RMSNorm scale's: a float32 sum over the
    batch's tokens that XLA:CPU vectorizes by the host CPU's vector width (even at the
    suite's optimization level 0), so its last bits differ between hosts (AVX-512 and
    others); every other gradient and the loss have the same bits on every host seen."""
    return "norm" in path


def digest(x) -> str:
    return hashlib.sha256(np.asarray(x, np.float32).tobytes()).hexdigest()[:16]


def run_case(changes: dict) -> dict:
    """``{"params": {path: shape}, "loss": bits, "grads": {path: sha}}`` of one case."""
    import jax
    import jax.numpy as jnp

    from fp4jax.train.config import TrainConfig, run_recipe
    from fp4jax.train.loop import build_models
    from fp4jax.train.steps import LAYER_KEY_INDEX, loss_fn

    cfg = TrainConfig(preset="micro", seq_len=SEQ, batch_size=BATCH, steps=4,
                      warmup_steps=1, **changes)
    rcfg, recipe = run_recipe(cfg)

    class Bytes:  # build_models asks the data for its vocabulary only
        vocab_size = 256
        tokenizer = "bytes"

    rm = build_models(cfg, rcfg, recipe, Bytes())
    model = rm.models["switch_at" in changes]
    root = jax.random.key(0)
    params = model.init(jax.random.fold_in(root, 0), jnp.zeros((1, SEQ), jnp.int32))["params"]
    batch = jax.random.randint(jax.random.key(7), (BATCH, SEQ + 1), 0, 256, jnp.int32)
    base = jax.random.fold_in(root, 1)
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p: loss_fn(model, p, batch, jax.random.fold_in(base, 3),
                          jax.random.fold_in(base, LAYER_KEY_INDEX))))(params)
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(grads)}
    pflat = jax.tree_util.tree_leaves_with_path(params)
    return {"params": {jax.tree_util.keystr(k): list(v.shape) for k, v in pflat},
            "loss": float(loss), "loss_bits": digest(loss),
            "grads": {k: digest(v) for k, v in flat.items()},
            "sum_grads": {k: np.asarray(v, np.float32).tolist() for k, v in flat.items()
                          if is_host_sum(k)}}


def cases(names=None) -> dict:
    return {name: run_case(ch) for name, ch in CASES if names is None or name in names}


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " " + XLA_TEST_FLAGS
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    out = {"jax": jax.__version__, "xla_flags": XLA_TEST_FLAGS, "cases": cases()}
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    print()
