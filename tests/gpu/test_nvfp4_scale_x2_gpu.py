"""The nvfp4 decode with session 34's group-scale path (``KVLAB_DECODE_SCALE_X2``, the default:
two E4M3 scale bytes per PRMT + cvt, times 2^7 in fp16) and session 35's E2M1 byte words
(``KVLAB_E2M1_SELECT``, the default: one sign mask, two bit-selects) gives the same output bits as
the build without both (``-DKVLAB_DECODE_NO_SCALE_X2 -DKVLAB_NO_E2M1_SELECT``: scales one byte at a
time through float32, byte words by mask-and-or), on every decode kernel that reads nvfp4
(per_head, paged two per SM, paged dual ring) and head size (64, 128, 256).

Two child processes (the build is a compile option, compiled once per process) run the same
ragged batches — decode and short chunked-prefill rows, KV lengths not multiples of the block,
block sizes 16 and 32, GQA 4 and 3, key and value magnitudes spread over five decades so that the
E4M3 group scales include zeros, subnormals and normals, with the global scale 1.0 and
calibrated — and every output must be equal bit for bit (NaN positions included). The default
build's outputs are also checked against the float64 reference (``check_close``, the paged
attention tests' tolerance), so a build that is wrong in both the same way fails too. The
offline proofs of the bit identity are tests/test_nvfp4_scale_x2_bits.py and
tests/test_packed_decode_bits.py.
KVLAB_SCALE_X2_TEST_TIMEOUT: seconds per child (600).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.gpu.isolated import CHILD_ENV, ROOT

pytestmark = pytest.mark.gpu

CHILD = r"""
import os, sys
import numpy as np
from tests.gpu.test_paged_attention_gpu import build_case, run_gpu, run_ref, check_close

CONFIGS = [("per_head", None), ("paged", "0"), ("paged", "1")]
res, checked = {}, 0
for d in (64, 128, 256):
    for case_id, (hkv, group, bs, gscale) in enumerate([(8, 4, 16, False), (3, 3, 32, True)]):
        rng = np.random.default_rng(1000 + 10 * d + case_id)
        kv_lens = [int(rng.integers(1500, 3000)), int(rng.integers(200, 700)), 17, 1]
        n = sum(kv_lens)
        key_mult = 10.0 ** rng.uniform(-3.0, 2.0, n)        # E4M3 scales: zero, subnormal, normal
        case = build_case(rng, "nvfp4", hkv, group, d, bs, [1, 2, 1, 1], kv_lens, global_scale=gscale,
                          key_mult=key_mult)
        ref = run_ref(case) if os.environ.get("SCALE_X2_CHECK_REF") == "1" else None
        for variant, dual in CONFIGS:
            if dual is not None:
                os.environ["KVLAB_DECODE_PAGED_DUAL"] = dual
            out, plan = run_gpu(case, num_splits=int(rng.choice([1, 3])), variant=variant)
            tag = f"d{d}_c{case_id}_{variant}{'' if dual is None else '_dual' + dual}"
            res[tag] = out
            if ref is not None:
                check_close(out, ref, "bfloat16", f"nvfp4 scale x2 {tag}")
                checked += 1
np.savez(sys.argv[1], **res)
print(f"configs={len(res)} checked_against_reference={checked}")
"""


def _run(options: str, path, check_ref: bool) -> str:
    env = dict(os.environ, **{CHILD_ENV: "1", "KVLAB_NVRTC_OPTIONS": options,
                              "SCALE_X2_CHECK_REF": "1" if check_ref else "0"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, "-c", CHILD, str(path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=int(os.environ.get("KVLAB_SCALE_X2_TEST_TIMEOUT", "600")))
    assert r.returncode == 0, f"{options!r}:\n{(r.stdout + r.stderr)[-3000:]}"
    return r.stdout


_SWITCH = ("-DKVLAB_DECODE_SCALE_X2", "-DKVLAB_DECODE_NO_SCALE_X2", "-DKVLAB_E2M1_SELECT", "-DKVLAB_NO_E2M1_SELECT")


def test_nvfp4_operand_switches_keep_the_output_bits(tmp_path):
    pytest.importorskip("torch")
    from tests.gpu.test_paged_attention_gpu import _device_cc

    if _device_cc() < 90:
        pytest.skip("the paged decode needs sm_90")
    base = [o for o in os.environ.get("KVLAB_NVRTC_OPTIONS", "").split() if o not in _SWITCH]
    log = _run(" ".join(base), tmp_path / "x2.npz", check_ref=True)
    assert "configs=18 checked_against_reference=18" in log, log
    _run(" ".join(base + ["-DKVLAB_DECODE_NO_SCALE_X2", "-DKVLAB_NO_E2M1_SELECT"]), tmp_path / "f32.npz",
         check_ref=False)
    a, b = np.load(tmp_path / "x2.npz"), np.load(tmp_path / "f32.npz")
    assert sorted(a.files) == sorted(b.files) and len(a.files) == 18
    for k in a.files:
        x, y = a[k], b[k]
        assert np.isfinite(x).mean() > 0.99, k              # real outputs, not a poisoned buffer
        np.testing.assert_array_equal(x.view(np.uint64), y.view(np.uint64), err_msg=k)
