"""GPU entry points validate before any launch: TypeError/ValueError naming the argument, and the
cache byte-identical after every rejected call (SPEC 7, issue 6)."""
import numpy as np
import pytest

import kvlab

from tests.gpu.device_arrays import off_boundary

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def _setup(fmt="int4_per_token_head", T=5, H=2, d=64, nb=4, bs=16):
    g = torch.Generator(device="cuda").manual_seed(0)
    key = torch.randn((T, H, d), generator=g, device="cuda").to(torch.bfloat16)
    val = torch.randn((T, H, d), generator=g, device="cuda").to(torch.bfloat16)
    cache = kvlab.allocate_cache(fmt, nb, bs, H, d, like=key)
    cache.copy_(torch.randint(0, 255, cache.shape, device="cuda").to(cache.dtype))
    slots = torch.arange(T, device="cuda", dtype=torch.int64)
    return key, val, cache, slots


WRITE_CASES = [
    (lambda k, v, c, s: dict(key=k.float()), TypeError, "value: expected dtype in"),
    (lambda k, v, c, s: dict(key=k[0]), ValueError, "key: expected 3 dimensions"),
    (lambda k, v, c, s: dict(value=v[:4]), ValueError, "value: expected shape"),
    (lambda k, v, c, s: dict(slot_mapping=s.float()), TypeError, "slot_mapping: expected dtype"),
    (lambda k, v, c, s: dict(slot_mapping=s + 60), ValueError, r"slot_mapping: entries must be in \[0, 64\)"),
    (lambda k, v, c, s: dict(slot_mapping=s.cpu()), TypeError, "slot_mapping: torch CPU tensors"),
    (lambda k, v, c, s: dict(key=k.cpu().float().numpy(), value=v.cpu().float().numpy()), TypeError,
     "arrays must all be NumPy"),
    (lambda k, v, c, s: dict(kv_cache=c[:, :, :, :, :-4].contiguous()), ValueError, "kv_cache"),
    (lambda k, v, c, s: dict(kv_cache=c[..., ::2]), ValueError, "kv_cache: expected a C-contiguous"),
    (lambda k, v, c, s: dict(k_scale=-1.0), ValueError, "k_scale"),
    (lambda k, v, c, s: dict(kv_cache=off_boundary(c, 4)), ValueError, "kv_cache: its data must start on a 16-byte boundary"),
]


@pytest.mark.parametrize("case", range(len(WRITE_CASES)))
def test_reshape_and_cache_rejects(case):
    key, val, cache, slots = _setup()
    make, exc, match = WRITE_CASES[case]
    args = dict(key=key, value=val, kv_cache=cache, slot_mapping=slots, kv_cache_dtype="int4_per_token_head")
    args.update(make(key, val, cache, slots))
    before = cache.clone()
    with pytest.raises(exc, match=match):
        kvlab.reshape_and_cache(**args)
    torch.cuda.synchronize()
    assert torch.equal(cache, before)


def test_paged_attention_rejects_out_of_range_block_table():
    key, val, cache, slots = _setup()
    kvlab.reshape_and_cache(key, val, cache, slots, "int4_per_token_head")
    q = torch.randn((1, 4, 64), device="cuda").to(torch.bfloat16)
    bt = torch.tensor([[99]], device="cuda", dtype=torch.int32)
    sl = torch.tensor([5], device="cuda", dtype=torch.int32)
    qsl = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
    before = cache.clone()
    with pytest.raises(ValueError, match=r"block_table: entries used by sequence 0 must be in \[0, 4\)"):
        kvlab.paged_attention(q, cache, bt, sl, qsl, "int4_per_token_head")
    with pytest.raises(ValueError, match="seq_lens: each must be >= its query length"):
        kvlab.paged_attention(q, cache, bt * 0, sl * 0, qsl, "int4_per_token_head")
    with pytest.raises(ValueError, match="q: num_q_heads must be a multiple"):
        kvlab.paged_attention(q[:, :3], cache, bt * 0, sl, qsl, "int4_per_token_head")
    with pytest.raises(TypeError, match="q: expected dtype"):
        kvlab.paged_attention(q.to(torch.int32), cache, bt * 0, sl, qsl, "int4_per_token_head")
    with pytest.raises(ValueError, match="kv_cache: its data must start on a 16-byte boundary"):
        kvlab.paged_attention(q, off_boundary(cache, 4), bt * 0, sl, qsl, "int4_per_token_head")
    torch.cuda.synchronize()
    assert torch.equal(cache, before)


def test_dequantize_cache_rejects():
    _, _, cache, _ = _setup("nvfp4")
    with pytest.raises(ValueError, match="kv_cache: expected 5 dimensions"):
        kvlab.dequantize_cache(cache[0], "nvfp4")


def test_empty_write_is_a_no_op():
    key, val, cache, slots = _setup()
    before = cache.clone()
    kvlab.reshape_and_cache(key[:0], val[:0], cache, slots[:0], "int4_per_token_head")
    torch.cuda.synchronize()
    assert torch.equal(cache, before)


@pytest.mark.parametrize("name", [n for n in kvlab.FORMAT_NAMES if n != "auto"])
def test_nan_rule_matches_reference(name):
    """A vector with a NaN/Inf is stored as the invalid row, as in the reference (formats/base.py)."""
    key, val, cache, slots = _setup(name)
    key = key.clone()
    key[1, 0, 7] = float("nan")
    key[3, 1, 0] = float("inf")
    kvlab.reshape_and_cache(key, val, cache, slots, name)
    ref = cache.cpu().numpy().copy()
    kn = key.float().cpu().numpy()
    vn = val.float().cpu().numpy()
    # the reference on the same values (as float32: bf16 → float32 is exact; int4 rounds its
    # rotation to the input dtype, so feed bf16 there)
    from kvlab.arrays import NUMPY_BF16
    kvlab.reshape_and_cache(kn.astype(NUMPY_BF16), vn.astype(NUMPY_BF16), ref, slots.cpu().numpy(), name)
    fmt = kvlab.get_format(name)
    got = cache.cpu().numpy()
    rows_g, rows_r = fmt.gather_rows(got), fmt.gather_rows(ref)
    for t, h in ((1, 0), (3, 1)):
        np.testing.assert_array_equal(rows_g[t // 16, 0, t % 16, h], rows_r[t // 16, 0, t % 16, h])
    k, _ = kvlab.dequantize_cache(cache, name)
    k = k.cpu().numpy()
    assert np.all(np.isnan(k[0, 1, 0])) and np.all(np.isnan(k[0, 3, 1]))
    assert np.all(np.isfinite(k[0, 0])) and np.all(np.isfinite(k[0, 2]))
