"""GPU exactness and speed of the packed NVFP4 quantize kernels with stochastic rounding
and along the token axis (issue 5 items 1-2): ``quantize_nvfp4_sm90.quantize_nvfp4_1x16_sr``
(1x16 rows, SR) and ``quantize_cols_nvfp4_sm90.quantize_cols_nvfp4`` (16x1 along axis 0,
RtN or SR, with or without the RHT, codes written transposed (C, R/2)).

* exactness: codes, scale bits and tensor scale against ``fp4jax.quantize`` (XLA) on fresh
  inputs of several shapes, one with NaN/Inf/-0 and a wide range: differing bytes;
* speed (CUPTI medians, 8192x8192 bf16, same run): each kernel with its tensor scales
  precomputed and with its amax pass, the bf16-operand kernels of the same quantization
  (``fq_rows`` SR, ``fq_cols``), XLA ``fp4jax.quantize``, and the fraction of the measured
  copy bandwidth (bytes: read x, write codes + scales; plus one read of x for the amax).

    PYTHONPATH=$PWD python3 experiments/gpu_check_packed.py   # -> $OUT/gpu_check_packed.json
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fp4jax  # noqa: E402
from experiments.gpu_check_fakequant import data  # noqa: E402  (inputs incl. NaN/Inf/-0)
from experiments.kernel_timing import time_fn  # noqa: E402
from fp4jax.hadamard import default_signs, random_hadamard_transform  # noqa: E402
from pallas_kernels import fakequant_nvfp4_sm90 as fq  # noqa: E402
from pallas_kernels import quantize_cols_nvfp4_sm90 as qc  # noqa: E402
from pallas_kernels import quantize_nvfp4_sm90 as qk  # noqa: E402

RES = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
       "started": time.strftime("%Y-%m-%d %H:%M:%S"),
       "command": "PYTHONPATH=$PWD python3 experiments/gpu_check_packed.py",
       "check": [], "speed": []}
KEY = jax.random.key(0)
SIGNS = jnp.asarray(default_signs(16), jnp.float32)
u8 = jnp.uint8


def dump():
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_check_packed.json"), "w") as f:
        json.dump(RES, f, indent=1)


def differ(a, b):
    return int(jnp.sum(jnp.asarray(a) != jnp.asarray(b)))


def check(shapes=(((2048, 1024), True), ((8192, 8192), False), ((4096, 14336), False),
                  ((16384, 4096), True))):
    for shape, wild in shapes:
        x = data(shape, sum(shape), wild)
        row = {"shape": list(shape), "wild": wild, "kernel": "rows SR packed"}
        try:
            p, s, d = jax.jit(qk.quantize_nvfp4_1x16_sr)(x, KEY)
            q = fp4jax.quantize(x, fp4jax.NVFP4, axis=-1, rounding="stochastic", key=KEY)
            row.update(codes_differ=differ(p, fp4jax.pack_e2m1(q.data)),
                       scales_differ=differ(s, jax.lax.bitcast_convert_type(q.scale, u8)),
                       dec_equal=bool(float(d) == float(q.global_scale)))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            traceback.print_exc()
        RES["check"].append(row)
        print(json.dumps(row), flush=True)
        for sg, k in ((None, None), (None, KEY), (SIGNS, None), (SIGNS, KEY)):
            name = "cols" + (" RHT" if sg is not None else "") + (" SR" if k is not None else
                                                                   " RtN")
            row = {"shape": list(shape), "wild": wild, "kernel": name + " packed"}
            try:
                c, s, d = jax.jit(lambda x, k=k, sg=sg: qc.quantize_cols_nvfp4(x, k, signs=sg))(x)
                xin = x if sg is None else random_hadamard_transform(x, axis=0, size=16,
                                                                     signs=sg)
                q = fp4jax.quantize(xin, fp4jax.NVFP4, axis=0, key=k,
                                    rounding="stochastic" if k is not None else "nearest")
                row.update(codes_differ=differ(c, fp4jax.pack_e2m1(q.data.T)),
                           scales_differ=differ(s, jax.lax.bitcast_convert_type(q.scale.T, u8)),
                           dec_equal=bool(float(d) == float(q.global_scale)))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                traceback.print_exc()
            RES["check"].append(row)
            print(json.dumps(row), flush=True)
            dump()


def speed(r=8192, c=8192):
    x = data((r, c), 1, False)
    n = r * c
    copy = time_fn(jax.jit(lambda a: a * 2), x)["median_us"]
    copy_bps = 4 * n / (copy * 1e-6)
    RES["speed"].append({"name": "copy x*2", "us": round(copy, 1), "gbps": copy_bps / 1e9})
    packed_bytes = 2 * n + n // 2 + n // 16  # read x, write codes + scales
    enc, dec = qk.global_scales(x)
    encr, decr = qk.global_scales(x, fq.rht_cols_amax(x, SIGNS))
    kw = fq.key_words(KEY)
    sc_r = fq.scalars(encr, decr, SIGNS)
    sc_p = fq.scalars(enc, dec)
    cases = [
        ("rows SR packed, kernel only", lambda x: qk.quantize_nvfp4_1x16_sr_scaled(
            x, enc, dec, kw), packed_bytes),
        ("rows SR packed + amax", lambda x: qk.quantize_nvfp4_1x16_sr(x, KEY),
         packed_bytes + 2 * n),
        ("rows SR bf16 operand (fq_rows) + amax", lambda x: fq.fq_rows(x, KEY), 6 * n),
        ("rows SR XLA fp4jax.quantize", lambda x: fp4jax.quantize(
            x, fp4jax.NVFP4, rounding="stochastic", key=KEY), None),
        ("cols RtN packed, kernel only", lambda x: qc.quantize_cols_nvfp4_scaled(
            x, sc_p, kw), packed_bytes),
        ("cols RHT RtN packed, kernel only", lambda x: qc.quantize_cols_nvfp4_scaled(
            x, sc_r, kw, rht=True), packed_bytes),
        ("cols RHT SR packed, kernel only", lambda x: qc.quantize_cols_nvfp4_scaled(
            x, sc_r, kw, sr=True, rht=True), packed_bytes),
        ("cols RHT SR packed + amax", lambda x: qc.quantize_cols_nvfp4(x, KEY, signs=SIGNS),
         packed_bytes + 2 * n),
        ("cols RHT SR bf16 operand (fq_cols) + amax", lambda x: fq.fq_cols(
            x, KEY, signs=SIGNS), 6 * n),
        ("cols RHT SR XLA", lambda x: fp4jax.quantize(random_hadamard_transform(
            x, axis=0, size=16, signs=SIGNS), fp4jax.NVFP4, axis=0, rounding="stochastic",
            key=KEY), None),
    ]
    for name, f, nbytes in cases:
        row = {"name": name, "shape": [r, c]}
        try:
            t = time_fn(jax.jit(f), x, iterations=20)
            row.update(us=round(t["median_us"], 1), method=t["method"])
            if nbytes:
                row["frac_copy_bw"] = round(nbytes / (t["median_us"] * 1e-6) / copy_bps, 4)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            traceback.print_exc()
        RES["speed"].append(row)
        print(json.dumps(row), flush=True)
        dump()


if __name__ == "__main__":
    which = sys.argv[1:] or ["check", "speed"]
    if "speed" in which:  # first: the numbers matter most if the call runs out of time
        speed()
    if "check" in which:
        check()
    if "check2" in which:  # one call's worth: the wild small shape and 8192^2
        check((((2048, 1024), True), ((8192, 8192), False)))
    RES["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    dump()
