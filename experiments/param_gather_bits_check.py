"""Where the FP4 parameter gather's bits part from the plain gather's on a GPU (issue 37
item 1): ``param_gather_check.py`` found the training steps' losses differing on two H100s
while the CPU tests (``tests/train/test_param_gather.py``) are bit-identical.

On ``--devices`` devices (fsdp over all of them), for each weight shape: the plain weight
``w`` and the weight ``fp4jax.sharding.fp4_all_gather`` rebuilds from its shards, each
cast to bfloat16 and 2D-quantized by ``fp4jax.quantize`` (jitted, on the device): codes,
block scales and tensor scale compared bit for bit; then ``fp4jax.dot(x, w', nvfp4)``'s
output against ``fp4jax.dot(x, w)``'s, with the weight cast in the program, as the model
does. Prints one line per case and writes ``param_gather_bits_check.json``.

    PYTHONPATH=$PWD python3 experiments/param_gather_bits_check.py --devices 2 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp4jax  # noqa: E402
from fp4jax import sharding  # noqa: E402
from fp4jax.train import parallel  # noqa: E402


def _bits(a) -> np.ndarray:
    return np.asarray(jax.device_get(a), np.float32).view(np.uint32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    n = a.devices
    mesh = parallel.make_mesh(n, fsdp=n)
    rng = np.random.default_rng(0)
    rows = []
    for shape, axis in [((512, 1536), 0), ((1536, 512), 0), ((512, 512), 1), ((128, 64), 0)]:
        w = jnp.asarray((rng.standard_normal(shape) * 0.02).astype(np.float32))
        spec = P(*([None] * axis + ["fsdp"] + [None] * (len(shape) - axis - 1)))
        gather = jax.jit(jax.shard_map(
            lambda x, axis=axis: sharding.fp4_all_gather(x, "fsdp", axis, fp4jax.NVFP4,
                                                         jnp.bfloat16),
            mesh=mesh, in_specs=spec, out_specs=P(), check_vma=False))
        got = gather(jax.device_put(w, NamedSharding(mesh, spec)))

        @jax.jit
        def q(v):
            r = fp4jax.quantize(v.astype(jnp.bfloat16), fp4jax.NVFP4, block_2d=True)
            return r.data.astype(jnp.float32), r.scale.astype(jnp.float32), r.global_scale

        x = jnp.asarray(rng.standard_normal((256, shape[0])).astype(np.float32)).astype(
            jnp.bfloat16)
        dot = jax.jit(lambda x, v: fp4jax.dot(x, v.astype(jnp.bfloat16),
                                              recipe=fp4jax.recipes.nvfp4(),
                                              key=jax.random.key(0)))
        row = {"shape": list(shape), "axis": axis,
               "rebuilt_vs_plain_value_mismatch": int((_bits(got) != _bits(w)).sum())}
        for name, u, v in zip(("codes", "scales", "tensor_scale"), q(got), q(w), strict=True):
            row[name + "_mismatch"] = int((_bits(u) != _bits(v)).sum())
        row["dot_out_mismatch"] = int((_bits(dot(x, got)) != _bits(dot(x, w))).sum())
        # the same rebuilt weight taken to the host and back: no in-program producer
        host = jnp.asarray(np.asarray(got))
        row["dot_out_mismatch_host_copy"] = int((_bits(dot(x, host)) != _bits(dot(x, w))).sum())
        print(row, flush=True)
        rows.append(row)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "param_gather_bits_check.json").write_text(json.dumps(
        {"device": str(jax.devices()[0]), "jax": jax.__version__,
         "commit": os.environ.get("FP4JAX_COMMIT"), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
