"""The default int4 write (kernels_cu/reshape_and_cache.cu: the lean MMA8 write with LEAN2's index
math, the default since session 8) writes the same int4 cache bytes as -DKVLAB_INT4_WRITE_DIV64
(the same write with session 7's index math: C++ 64-bit divisions, copysign zero point). Two
child processes (the build is a compile option, compiled once per process) write the same rows —
random scales over 12 (bf16) / 7.5 (fp16) decades, zero rows, one-signed rows, NaN and Inf
inputs, rows whose rotation overflows the input dtype, padding slots, block sizes 16 / 17 / 32,
1 / 3 / 8 heads, bf16 and fp16 at d = 128 — and the caches must be equal byte for byte (codes and
scale words; the offline proofs are in tests/test_int4_write_variants.py).

Until session 8 this was tests/gpu/test_int4_write_lean2_gpu.py (-DKVLAB_INT4_WRITE_LEAN2 against
the then default, DIV64's index math). KVLAB_DIV64_TEST_TIMEOUT: seconds per child (400).
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
import sys
import numpy as np
import torch
import kvlab
from kvlab.formats import get_format

fmt = "int4_per_token_head"
res = {}
for dt in ("bfloat16", "float16"):
    big, (lo, hi) = (3.0e38, (-6, 6)) if dt == "bfloat16" else (6.0e4, (-4, 3.5))
    for case, (T, H, bs) in enumerate([(300, 8, 16), (257, 3, 17), (64, 1, 32)]):
        rng = np.random.default_rng(100 + case)
        x = rng.standard_normal((2, T, H, 128)) * 10.0 ** rng.uniform(lo, hi, (2, T, H, 1))
        x[:, 1] = 0.0
        x[:, 2] = np.abs(x[:, 2])
        x[:, 3] = -np.abs(x[:, 3])
        x[0, 4, 0, 5] = np.nan
        x[1, 5, 0, 7] = np.inf
        x[:, 6] = np.sign(x[:, 6]) * big
        x[:, 7, :, :64] = big
        t = torch.from_numpy(x.astype(np.float32)).cuda().to(getattr(torch, dt))
        nb = -(-T // bs) + 3
        slots = rng.permutation(nb * bs)[:T].astype(np.int64)
        slots[::11] = -1
        cache = torch.full(get_format(fmt).cache_shape(nb, bs, H, 128), 0xA5, dtype=torch.uint8, device="cuda")
        kvlab.reshape_and_cache(t[0], t[1], cache, torch.from_numpy(slots).cuda(), kv_cache_dtype=fmt)
        res[f"{dt}_{case}"] = cache.cpu().numpy()
np.savez(sys.argv[1], **res)
"""


def _write(options: str, path) -> None:
    env = dict(os.environ, **{CHILD_ENV: "1", "KVLAB_NVRTC_OPTIONS": options})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, "-c", CHILD, str(path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=int(os.environ.get("KVLAB_DIV64_TEST_TIMEOUT", "400")))
    assert r.returncode == 0, f"{options!r}:\n{(r.stdout + r.stderr)[-3000:]}"


#: builds that choose the lean MMA8 write's index math (removed from the base options) and builds
#: without a lean MMA8 write (DIV64 is an #error with them: nothing to compare)
_INDEX_MATH = ("-DKVLAB_INT4_WRITE_LEAN2", "-DKVLAB_INT4_WRITE_DIV64")
_NO_LEAN_MMA8 = ("-DKVLAB_INT4_WRITE_PLAIN_TAIL", "-DKVLAB_INT4_WRITE_CUDA_CORES", "-DKVLAB_INT4_WRITE_MMA")


def test_int4_write_default_bytes_equal_div64(tmp_path):
    pytest.importorskip("torch")
    base = [o for o in os.environ.get("KVLAB_NVRTC_OPTIONS", "").split() if o not in _INDEX_MATH]
    if any(o.split("=")[0] in _NO_LEAN_MMA8 for o in base):
        pytest.skip(f"KVLAB_NVRTC_OPTIONS={' '.join(base)!r} builds no lean MMA8 write")
    _write(" ".join(base), tmp_path / "default.npz")
    _write(" ".join(base + ["-DKVLAB_INT4_WRITE_DIV64"]), tmp_path / "div64.npz")
    a, b = np.load(tmp_path / "default.npz"), np.load(tmp_path / "div64.npz")
    assert sorted(a.files) == sorted(b.files) and len(a.files) == 6
    for k in a.files:
        diff = np.count_nonzero(a[k] != b[k])
        assert diff == 0, f"{k}: {diff} bytes differ between the default and -DKVLAB_INT4_WRITE_DIV64"
        assert np.count_nonzero(a[k] != 0xA5) > 0
