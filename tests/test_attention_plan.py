"""AttentionPlan.check_run_args: a plan built once is reused for every layer, so ``run`` checks
that the arrays it is handed fit the plan (CPU: NumPy stand-ins for the GPU arrays, device None)."""
import numpy as np
import pytest

import kvlab
from kvlab.cuda.attention import AttentionPlan


def _plan(**kw):
    base = dict(fmt_code=3, head_size=128, q_dtype="float16", num_tokens=5, num_q_heads=8,
                num_kv_heads=2, block_size=16, hpc=4, tpc=2, ny=2, scale_log2=1.0, k_scale=1.0,
                v_scale=1.0, window=0, swizzle_v=0, items=None, red_items=None, n_items=0, n_red=0,
                n_parts=0, ws_o=None, ws_ml=None, device_id=None)
    base.update(kw)
    return AttentionPlan(**base)


def _args():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((5, 8, 128)).astype(np.float16)
    cache = kvlab.allocate_cache("int4_per_token_head", 4, 16, 2, 128)
    return q, cache


def test_fitting_arrays_pass():
    q, cache = _args()
    _plan().check_run_args(q, cache, out=np.empty_like(q))


@pytest.mark.parametrize("bad, match", [
    (lambda q, c: (q[:4], c, None), r"^q: this plan was built for shape \(5, 8, 128\)"),
    (lambda q, c: (q.astype(np.float32), c, None), r"^q: this plan was built for dtype float16, got float32"),
    (lambda q, c: (np.asfortranarray(q), c, None), r"^q: must be contiguous"),
    (lambda q, c: (q, c, np.empty((5, 8, 64), np.float16)), r"^out: this plan was built for shape"),
    (lambda q, c: (q, c[:, :, :8], None), r"^kv_cache: this plan was built for \(num_blocks, 2, 16, 2, row\)"),
    (lambda q, c: (q, c[0], None), r"^kv_cache: this plan was built for"),
])
def test_misfits_name_the_argument(bad, match):
    q, cache = _args()
    qq, cc, out = bad(q, cache)
    with pytest.raises((TypeError, ValueError), match=match):
        _plan().check_run_args(qq, cc, out=out)
