"""An unedited Equinox model under ``fp4jax.nn.quantize_function`` (issue 34's plain-JAX
transform): ``eqx.nn.MLP`` addressed by its weights' pytree paths, loss and gradients
compared bit for bit with the same MLP wired by hand with ``fp4jax.dot_general``.

    PYTHONPATH=$PWD python experiments/equinox_check.py --out $OUT/equinox_check.json

Equinox is not a dependency of fp4jax (the test suite checks the mechanism on an
Equinox-style pytree model, ``tests/nn/test_functional.py``); this script needs it installed.
"""

from __future__ import annotations

import argparse
import json
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import lab  # noqa: F401  (puts the repository root on sys.path)
import numpy as np

import fp4jax
from fp4jax.nn import function_report, layer_key, quantize_function

DN = (((1,), (0,)), ((), ()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="equinox_check.json")
    a = ap.parse_args()
    rec = fp4jax.recipes.get("nvfp4")
    mlp = eqx.nn.MLP(256, 256, 512, depth=2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (256, 256))
    key = jax.random.key(2)
    rules = [(r"layers/2/weight", None), (r"layers/\d+/weight", "nvfp4")]

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)
    qloss = quantize_function(loss, rules, paths="params")
    report = function_report(qloss, mlp, x)

    def by_hand(m, x):
        h = x
        for i, layer in enumerate(m.layers):
            if i < 2:
                k = jax.random.fold_in(layer_key(key, f"layers/{i}/weight"), 0)
                h = fp4jax.dot_general(h, layer.weight.T, DN, recipe=rec, key=k) + layer.bias
                h = jax.nn.relu(h)
            else:
                h = jax.vmap(lambda hi, w=layer.weight: w @ hi)(h) + layer.bias
        return jnp.mean(h ** 2)

    got = eqx.filter_jit(eqx.filter_value_and_grad(lambda m: qloss(m, x, fp4_key=key)))(mlp)
    want = eqx.filter_jit(eqx.filter_value_and_grad(lambda m: by_hand(m, x)))(mlp)
    plain = eqx.filter_jit(eqx.filter_value_and_grad(lambda m: loss(m, x)))(mlp)
    leaves = lambda t: [np.asarray(v) for v in jax.tree_util.tree_leaves(t)]  # noqa: E731
    same = all(np.array_equal(p.view(np.uint32), q.view(np.uint32))
               for p, q in zip(leaves(got), leaves(want), strict=True))
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "equinox": eqx.__version__, "layers": {p: d["recipe"] for p, d in
                                                  report.layers.items()},
           "unused_rules": [i for i, _ in report.unused_rules],
           "loss": float(got[0]), "loss_by_hand": float(want[0]), "loss_plain": float(plain[0]),
           "bit_identical_to_hand_wired": bool(same)}
    print(json.dumps(out, indent=1))
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
