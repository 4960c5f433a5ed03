"""Reference reshape_and_cache / dequantize_cache / allocate_cache (kvlab/reference/cache.py)."""
import numpy as np
import pytest

import kvlab
from kvlab.arrays import NUMPY_BF16

FORMATS = kvlab.FORMAT_NAMES


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("d", [64, 128])
def test_write_then_read_every_slot(name, d, rng):
    fmt = kvlab.get_format(name)
    nb, bs, H, T = 6, 16, 3, 50
    key = rng.standard_normal((T, H, d)).astype(NUMPY_BF16)
    val = rng.standard_normal((T, H, d)).astype(NUMPY_BF16)
    cache = kvlab.allocate_cache(name, nb, bs, H, d, like=key)
    poison = 0xA5 if not fmt.stores_model_dtype else 3.0
    cache[...] = poison
    slots = rng.permutation(nb * bs)[:T].astype(np.int64)
    slots[rng.random(T) < 0.2] = -1                      # skipped tokens
    kvlab.reshape_and_cache(key, val, cache, slots, name)
    k, v = kvlab.dequantize_cache(cache, name)
    assert k.dtype == np.float32 and k.shape == (nb, bs, H, d)
    keep = slots >= 0
    blocks, offs = slots[keep] // bs, slots[keep] % bs
    np.testing.assert_array_equal(
        k[blocks, offs], fmt.dequantize_rows(fmt.quantize_rows(key[keep]), d).astype(np.float32))
    np.testing.assert_array_equal(
        v[blocks, offs], fmt.dequantize_rows(fmt.quantize_rows(val[keep]), d).astype(np.float32))
    # every byte of every slot not written still holds the poison
    written = np.zeros((nb, bs), bool)
    written[blocks, offs] = True
    if name == "nvfp4":
        data, scales = fmt._slab_parts(cache)
        assert np.all(np.moveaxis(data, 1, 2)[~written] == poison)
        assert np.all(np.moveaxis(scales, 1, 2)[~written] == poison)
    else:
        assert np.all(np.moveaxis(cache, 1, 2)[~written] == poison)


def test_duplicate_slots_last_writer_wins(rng):
    key = rng.standard_normal((3, 1, 16)).astype(np.float32)
    cache = kvlab.allocate_cache("int8_per_token_head", 1, 16, 1, 16)
    kvlab.reshape_and_cache(key, key, cache, np.array([5, 5, 5]), "int8_per_token_head")
    np.testing.assert_array_equal(cache[0, 0, 5], kvlab.get_format("int8_per_token_head").quantize_rows(key[2]))


def test_empty_batch_is_a_no_op():
    cache = kvlab.allocate_cache("int4_per_token_head", 2, 16, 2, 64)
    before = cache.copy()
    z = np.zeros((0, 2, 64), np.float32)
    kvlab.reshape_and_cache(z, z, cache, np.zeros((0,), np.int64), "int4_per_token_head")
    np.testing.assert_array_equal(cache, before)


@pytest.mark.parametrize("name", FORMATS)
def test_allocate_cache_shapes(name):
    fmt = kvlab.get_format(name)
    c = kvlab.allocate_cache(name, 4, 16, 8, 128)
    assert c.shape == fmt.cache_shape(4, 16, 8, 128) and not c.any()
    expected_last = {"auto": 128, "int8_per_token_head": 132, "fp8_per_token_head": 132,
                     "int4_per_token_head": 68, "nvfp4": 72}[name]
    assert c.shape == (4, 2, 16, 8, expected_last)
    assert c.dtype == (NUMPY_BF16 if name == "auto" else np.uint8)


def test_format_table_bytes():
    """SPEC 2's table: bytes per (token, head) at d=128 and the ratio to bf16."""
    rows = {n: kvlab.get_format(n).row_bytes(128) for n in FORMATS}
    assert rows == {"auto": 256, "int8_per_token_head": 132, "fp8_per_token_head": 132,
                    "int4_per_token_head": 68, "nvfp4": 72}
    assert kvlab.get_format("int4_per_token_head").bits_per_element(128) == 4.25
    assert kvlab.get_format("nvfp4").bits_per_element(128) == 4.5


def test_allocate_cache_like_torch_cpu_is_rejected():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="like: torch CPU tensors"):
        kvlab.allocate_cache("auto", 2, 16, 2, 64, like=torch.zeros(2))
