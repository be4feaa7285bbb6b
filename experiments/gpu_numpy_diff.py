"""Where the GPU quantize (kernel == XLA) differs from the CPU NumPy reference, and why.

PYTHONPATH=$PWD python3 experiments/gpu_numpy_diff.py  -> $OUT/gpu_numpy_diff.json
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels import quantize_nvfp4_sm90 as qk  # noqa: E402
from pallas_kernels import reference as npref  # noqa: E402

res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
# 1) float32 reciprocal on the GPU (XLA) vs IEEE (NumPy)
p = np.exp2(np.random.default_rng(0).uniform(-40, 40, 2_000_000)).astype(np.float32)
g = np.asarray(jax.jit(lambda p: jnp.float32(1.0) / p)(jnp.asarray(p)))
res["xla_recip_mismatch"] = int((g != (np.float32(1) / p)).sum())
bad = g != np.float32(1) / p
res["xla_recip_examples"] = [[float(a), float(b), float(np.float32(1) / a)]
                             for a, b in zip(p[bad][:5], g[bad][:5], strict=True)]
# 2) quantize mismatches vs NumPy on several seeds
CPU = jax.devices()[0].platform == "cpu"  # dry run: small shape, interpret mode
R, C = (16, 256) if CPU else (512, 4096)
kw = {}
if CPU:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    kw = dict(interpret=InterpretGPUParams())
tot = dict(blocks=0, scale_mismatch=0, packed_mismatch_blocks=0, examples=[])
for seed in range(2 if CPU else 6):
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (R, C), jnp.float32)
    x = (x * jnp.exp2(jax.random.randint(k2, (R, 1), -12, 12).astype(jnp.float32)))
    x = x.astype(jnp.bfloat16)
    packed, sb, dec = qk.quantize_nvfp4_1x16(x, **kw)
    enc, dec2 = map(np.float32, jax.jit(qk.global_scales)(x))
    xs = np.asarray(x.astype(jnp.float32))
    c, s_np, _ = npref.quantize_nvfp4_1x16(xs, enc, dec2)
    pk = np.asarray(packed).reshape(R, C // 16, 8)
    pn = npref.pack_codes(c).reshape(R, C // 16, 8)
    sbk = np.asarray(sb)
    tot["blocks"] += sbk.size
    tot["scale_mismatch"] += int((sbk != s_np).sum())
    badb = (pk != pn).any(-1)
    tot["packed_mismatch_blocks"] += int(badb.sum())
    for (i, j) in np.argwhere(badb)[:3]:
        blk = xs[i, 16 * j:16 * j + 16]
        s = np.float32(s_np[i, j:j + 1].view(ml_dtypes.float8_e4m3fn).astype(np.float32)[0])
        e_np = np.float32(1) / (s * dec2)
        e_gpu = float(jax.jit(lambda a, b: jnp.float32(1.0) / (a * b))(s, dec2))
        ck = npref.unpack_codes(pk[i, j][None])[0]
        cn = npref.unpack_codes(pn[i, j][None])[0]
        k = int(np.argmax(ck != cn))
        tot["examples"].append(dict(
            s=float(s), dec=float(dec2), e_numpy=float(e_np), e_gpu_xla=e_gpu, x=float(blk[k]),
            x_times_e=float(blk[k] * e_np), code_kernel=int(ck[k]), code_numpy=int(cn[k])))
res["quantize_vs_numpy"] = tot
print(json.dumps(res, indent=1))
with open(os.path.join(os.environ.get("OUT", "."), "gpu_numpy_diff.json"), "w") as f:
    json.dump(res, f, indent=1)
