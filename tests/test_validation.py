"""Every public entry point rejects bad input with TypeError/ValueError naming the argument (SPEC 7).

The messages are matched on the argument name, so a test fails if a message stops naming it;
the cache is byte-identical after every rejected call.
"""
import numpy as np
import pytest

import kvlab
from kvlab.arrays import NUMPY_BF16


def _setup(fmt="int4_per_token_head", T=5, H=2, d=64, nb=4, bs=16):
    rng = np.random.default_rng(0)
    key = rng.standard_normal((T, H, d)).astype(NUMPY_BF16)
    val = rng.standard_normal((T, H, d)).astype(NUMPY_BF16)
    cache = kvlab.allocate_cache(fmt, nb, bs, H, d, like=key)
    cache[...] = rng.integers(0, 255, cache.shape).astype(cache.dtype)
    slots = np.arange(T, dtype=np.int64)
    return key, val, cache, slots


def test_get_format():
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        kvlab.get_format("int3")
    with pytest.raises(TypeError, match="kv_cache_dtype"):
        kvlab.get_format(4)


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((0, 16, 2, 64), ValueError, "num_blocks: expected >= 1"),
        ((4, 0, 2, 64), ValueError, "block_size"),
        ((4, 16, 0, 64), ValueError, "num_kv_heads"),
        ((4, 16, 2, 96), ValueError, r"head_size: .* supports head sizes \[16, 32, 64, 128, 256, 512\], got 96"),
        ((4, 16, 2, 64.0), TypeError, "head_size: expected an int"),
        ((4, True, 2, 64), TypeError, "block_size: expected an int"),
    ],
)
def test_cache_shape_and_allocate(args, exc, match):
    with pytest.raises(exc, match=match):
        kvlab.get_format("nvfp4").cache_shape(*args)
    with pytest.raises(exc, match=match):
        kvlab.allocate_cache("nvfp4", *args)


def test_allocate_cache_dtype():
    with pytest.raises(ValueError, match="dtype: expected one of"):
        kvlab.allocate_cache("auto", 2, 16, 2, 64, dtype="int8")
    with pytest.raises(ValueError, match="dtype: nvfp4 caches are uint8"):
        kvlab.allocate_cache("nvfp4", 2, 16, 2, 64, dtype="float16")
    with pytest.raises(TypeError, match="like: expected a NumPy array"):
        kvlab.allocate_cache("nvfp4", 2, 16, 2, 64, like=[1, 2])


def _bad_write_cases():
    key, val, cache, slots = _setup()
    return [
        (dict(key=key.astype(np.int32)), TypeError, "key: expected dtype"),
        (dict(key=key[0]), ValueError, "key: expected 3 dimensions"),
        (dict(key=key[:, :1]), ValueError, r"key: expected shape \(5, 2, 64\)"),
        (dict(value=val[:4]), ValueError, r"value: expected shape \(5, 2, 64\)"),
        (dict(value=val.astype(np.float16)), TypeError, r"value: expected dtype in \['bfloat16'\]"),
        (dict(slot_mapping=slots.astype(np.float32)), TypeError, "slot_mapping: expected dtype"),
        (dict(slot_mapping=slots[:3]), ValueError, "slot_mapping: expected shape"),
        (dict(slot_mapping=np.array([0, 1, 2, 3, 64])), ValueError,
         r"slot_mapping: entries must be in \[0, 64\) or negative \(skip\), got 64"),
        (dict(kv_cache=np.ascontiguousarray(cache[:, :1])), ValueError, "kv_cache: dimension 1 must be 2"),
        (dict(kv_cache=cache.astype(np.int8)), TypeError, "kv_cache: expected dtype"),
        (dict(kv_cache=cache[..., :-4]), ValueError, "kv_cache"),
        (dict(kv_cache=np.ascontiguousarray(cache[:, :, :, :1])), ValueError, "key: expected shape"),
        (dict(kv_cache_dtype="int2"), ValueError, "kv_cache_dtype"),
        (dict(k_scale=0.0), ValueError, "k_scale: expected > 0"),
        (dict(v_scale=float("nan")), ValueError, "v_scale: expected a finite"),
        (dict(k_scale="1"), TypeError, "k_scale: expected a float"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_write_cases())))
def test_reshape_and_cache_rejects(case):
    key, val, cache, slots = _setup()
    over, exc, match = _bad_write_cases()[case]
    args = dict(key=key, value=val, kv_cache=cache, slot_mapping=slots,
                kv_cache_dtype="int4_per_token_head", k_scale=1.0, v_scale=1.0)
    for k, v in over.items():
        args[k] = v
    before = cache.copy()
    with pytest.raises(exc, match=match):
        kvlab.reshape_and_cache(**args)
    np.testing.assert_array_equal(cache, before)     # no silent corruption


def test_non_contiguous_cache_rejected():
    key, val, cache, slots = _setup()
    big = np.zeros(cache.shape[:-1] + (2 * cache.shape[-1],), np.uint8)
    with pytest.raises(ValueError, match="kv_cache: expected a C-contiguous"):
        kvlab.reshape_and_cache(key, val, big[..., ::2], slots, "int4_per_token_head")


def test_auto_cache_dtype_must_match_key():
    key, val, cache, slots = _setup("auto")
    with pytest.raises(TypeError, match="kv_cache: an 'auto' cache stores the key dtype"):
        kvlab.reshape_and_cache(key.astype(np.float32), val.astype(np.float32), cache, slots, "auto")


def test_dequantize_cache_rejects():
    _, _, cache, _ = _setup("nvfp4")
    with pytest.raises(ValueError, match="kv_cache: expected 5 dimensions"):
        kvlab.dequantize_cache(cache[0], "nvfp4")
    with pytest.raises(ValueError, match="kv_cache: last dimension 40 matches no nvfp4"):
        kvlab.dequantize_cache(np.zeros((2, 2, 16, 2, 40), np.uint8), "nvfp4")
    with pytest.raises(ValueError, match="k_scale"):
        kvlab.dequantize_cache(cache, "nvfp4", k_scale=-1.0)
    with pytest.raises(TypeError, match="kv_cache: expected a NumPy array"):
        kvlab.dequantize_cache([[1]], "nvfp4")


def _attn_args(rng):
    from tests.helpers import make_paged_batch

    b = make_paged_batch(rng, "int4_per_token_head", [20, 33], [1, 4], 2, 4, 64, 16)
    return dict(q=b.q, kv_cache=b.kv_cache, block_table=b.block_table, seq_lens=b.seq_lens,
                query_start_loc=b.query_start_loc, kv_cache_dtype="int4_per_token_head")


def _bad_attention_cases(a):
    q, bt, sl = a["q"], a["block_table"], a["seq_lens"]
    return [
        (dict(q=q.astype(np.int32)), TypeError, "q: expected dtype"),
        (dict(q=q[0]), ValueError, "q: expected 3 dimensions"),
        (dict(q=q[..., :32]), ValueError, "q: head size"),
        (dict(q=q[:, :3]), ValueError, "q: num_q_heads must be a multiple of num_kv_heads=2, got 3"),
        (dict(block_table=bt.astype(np.int64)), TypeError, "block_table: expected dtype"),
        (dict(block_table=bt[:, :1]), ValueError, "block_table: sequence 1 needs 3 blocks"),
        (dict(block_table=np.where(bt >= 0, bt + 1000, bt).astype(np.int32)), ValueError,
         r"block_table: entries used by sequence 0 must be in \[0, "),
        (dict(seq_lens=sl[:1]), ValueError, "seq_lens: expected shape"),
        (dict(seq_lens=np.array([20, 2], np.int32)), ValueError, r"seq_lens: each must be >= its query length"),
        (dict(query_start_loc=np.array([1, 2, 5], np.int32)), ValueError, "query_start_loc: must start at 0"),
        (dict(query_start_loc=np.array([0, 3, 2], np.int32)), ValueError, "query_start_loc: must be non-decreasing"),
        (dict(query_start_loc=np.array([0, 1, 4], np.int32)), ValueError, "query_start_loc: last entry must equal"),
        (dict(softmax_scale=-1.0), ValueError, "softmax_scale: expected > 0"),
        (dict(sliding_window=0), ValueError, "sliding_window: expected >= 1"),
        (dict(sliding_window=2.5), TypeError, "sliding_window: expected an int"),
        # int4 rows at d=64 are 36 bytes, which int8 reads as d=32: caught by the head-size check
        (dict(kv_cache_dtype="int8_per_token_head"), ValueError, "q: head size"),
    ]


@pytest.mark.parametrize("case", range(16))
def test_paged_attention_rejects(case, rng):
    a = _attn_args(rng)
    over, exc, match = _bad_attention_cases(a)[case]
    a.update(over)
    before = a["kv_cache"].copy()
    with pytest.raises(exc, match=match):
        kvlab.paged_attention(**a)
    np.testing.assert_array_equal(a["kv_cache"], before)


def test_mixed_numpy_and_gpu_arrays_rejected():
    torch = pytest.importorskip("torch")
    key, val, cache, slots = _setup()
    with pytest.raises(TypeError, match="slot_mapping: torch CPU tensors are not accepted"):
        kvlab.reshape_and_cache(key, val, cache, torch.from_numpy(slots), "int4_per_token_head")


def test_array_kind_by_type():
    """``arrays.kind`` looks its answer up by type (it runs ~100 times per attention call); a
    torch tensor's CPU / CUDA kind is still read from the tensor, subclasses are classified by
    what they derive from, and arbitrary objects are not remembered."""
    import torch

    from kvlab import arrays

    class Sub(np.ndarray):
        pass

    class Thing:
        pass

    a = np.ones(3)
    assert arrays.kind(a) == arrays.kind(a) == "numpy"
    assert arrays.kind(a.view(Sub)) == "numpy" and arrays._TYPE_KINDS[Sub] == "numpy"
    assert arrays.kind(torch.ones(2)) == "torch_cpu" and arrays._TYPE_KINDS[torch.Tensor] == "torch"
    assert arrays.kind(torch.nn.Parameter(torch.ones(2))) == "torch_cpu"
    assert arrays.kind(Thing()) == arrays.kind([1, 2]) == "other"
    assert Thing not in arrays._TYPE_KINDS and list not in arrays._TYPE_KINDS
