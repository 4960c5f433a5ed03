"""Argument validation of the cache and attention entry points, shared by the reference and the kernels.

Each function raises ``TypeError``/``ValueError`` naming the argument, what
was expected and what was given, and returns the derived sizes so that callers
do not recompute them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import arrays, checks
from . import formats as _formats  # module, not name: kvlab.formats imports kvlab.reference, which imports this
from .formats.base import CacheFormat

INDEX_DTYPES_SLOT = ("int64", "int32")


@dataclass(frozen=True)
class CacheDims:
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int


def check_kv_cache(kv_cache, fmt: CacheFormat, name: str = "kv_cache") -> CacheDims:
    """A cache of ``fmt``: 5-D ``(num_blocks, 2, block_size, num_kv_heads, last)``, C-contiguous;
    on the GPU its data on a 16-byte boundary (a NumPy cache, read by the references, need not be)."""
    if fmt.stores_model_dtype:
        checks.check_array(kv_cache, name, dtypes=checks.FLOAT_DTYPES, ndim=5, contiguous=True)
    else:
        checks.check_array(kv_cache, name, dtypes=("uint8",), ndim=5, contiguous=True)
    if arrays.kind(kv_cache) in ("cupy", "torch"):
        checks.check_aligned16(kv_cache, name)   # the kernels' 16-byte rows and bulk copies
    s = arrays.shape(kv_cache)
    if s[1] != 2:
        raise ValueError(f"{name}: dimension 1 must be 2 (K, V), got shape {s}")
    d = fmt.head_size_from_cache(kv_cache)
    fmt.check_head_size(d, f"{name} head size")
    fmt.check_block_size(s[2], d)
    return CacheDims(s[0], s[2], s[3], d)


#: Global (nvfp4) scales are bounded so that ``sf · global_scale`` and ``x / (sf · global_scale)``
#: stay normal float32 numbers: results then do not depend on the GPU's flush-to-zero.
GLOBAL_SCALE_RANGE = (1e-30, 1e30)


def check_global_scale(value, name: str) -> float:
    v = checks.check_float(value, name, positive=True)
    lo, hi = GLOBAL_SCALE_RANGE
    if not lo <= v <= hi:
        raise ValueError(f"{name}: expected a value in [{lo:g}, {hi:g}], got {v:g}")
    return v


def check_reshape_and_cache(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    fmt = _formats.get_format(kv_cache_dtype)
    backend = checks.check_same_backend(
        {"key": key, "value": value, "kv_cache": kv_cache, "slot_mapping": slot_mapping}
    )
    checks.check_array(key, "key", dtypes=checks.FLOAT_DTYPES, ndim=3)  # same dtypes on both backends
    dims = check_kv_cache(kv_cache, fmt)
    T = arrays.shape(key)[0]
    want = (T, dims.num_kv_heads, dims.head_size)
    checks.check_array(key, "key", shape=want)
    checks.check_array(value, "value", dtypes=(arrays.dtype_name(key),), shape=want)
    checks.check_array(slot_mapping, "slot_mapping", dtypes=INDEX_DTYPES_SLOT, shape=(T,))
    checks.check_index_range(
        slot_mapping, "slot_mapping", 0, dims.num_blocks * dims.block_size, allow_negative_one=True
    )
    if fmt.stores_model_dtype and arrays.dtype_name(kv_cache) != arrays.dtype_name(key):
        raise TypeError(
            f"kv_cache: an 'auto' cache stores the key dtype {arrays.dtype_name(key)}, "
            f"got a {arrays.dtype_name(kv_cache)} cache"
        )
    ks = check_global_scale(k_scale, "k_scale")
    vs = check_global_scale(v_scale, "v_scale")
    return fmt, dims, backend, ks, vs


def check_paged_attention(
    q, kv_cache, block_table, seq_lens, query_start_loc, kv_cache_dtype, softmax_scale,
    k_scale, v_scale, sliding_window, q_dtypes=checks.FLOAT_DTYPES, host_index=None,
):
    """Validate SPEC 2.4's arguments; returns ``(fmt, dims, backend, meta)``.

    ``meta`` holds host copies of the index arrays and the derived numbers. ``host_index``:
    ``(query_start_loc, seq_lens, block_table)`` already copied to the host by the caller (NumPy,
    equal to the device arrays), so that this does not copy them again.
    """
    fmt = _formats.get_format(kv_cache_dtype)
    backend = checks.check_same_backend(
        {"q": q, "kv_cache": kv_cache, "block_table": block_table, "seq_lens": seq_lens,
         "query_start_loc": query_start_loc}
    )
    checks.check_array(q, "q", dtypes=q_dtypes, ndim=3)
    dims = check_kv_cache(kv_cache, fmt)
    T, Hq, d = arrays.shape(q)
    if d != dims.head_size:
        raise ValueError(f"q: head size (dim 2) must match the cache's {dims.head_size}, got {d}")
    if Hq % dims.num_kv_heads:
        raise ValueError(
            f"q: num_q_heads must be a multiple of num_kv_heads={dims.num_kv_heads}, got {Hq}"
        )
    checks.check_array(block_table, "block_table", dtypes=("int32",), ndim=2)
    S = arrays.shape(block_table)[0]
    checks.check_array(seq_lens, "seq_lens", dtypes=("int32",), shape=(S,))
    checks.check_array(query_start_loc, "query_start_loc", dtypes=("int32",), shape=(S + 1,))
    qsl, sl, bt = (host_index if host_index is not None
                   else arrays.to_host_many(query_start_loc, seq_lens, block_table))  # one sync
    qsl, sl = qsl.astype(np.int64), sl.astype(np.int64)
    if qsl[0] != 0:
        raise ValueError(f"query_start_loc: must start at 0, got {int(qsl[0])}")
    qlen = np.diff(qsl)
    if np.any(qlen < 0):
        i = int(np.argmax(qlen < 0))
        raise ValueError(f"query_start_loc: must be non-decreasing, got a drop at index {i + 1}")
    if qsl[-1] != T:
        raise ValueError(
            f"query_start_loc: last entry must equal q's num_tokens={T}, got {int(qsl[-1])}"
        )
    if np.any(sl < qlen):
        i = int(np.argmax(sl < qlen))
        raise ValueError(
            f"seq_lens: each must be >= its query length, got seq_lens[{i}]={int(sl[i])} "
            f"< {int(qlen[i])}"
        )
    nblk_needed = -(-sl // dims.block_size)
    maxb = arrays.shape(block_table)[1]
    if S and nblk_needed.max(initial=0) > maxb:
        i = int(np.argmax(nblk_needed))
        raise ValueError(
            f"block_table: sequence {i} needs {int(nblk_needed[i])} blocks "
            f"(seq_lens={int(sl[i])}, block_size={dims.block_size}), got only {maxb} columns"
        )
    # entries a sequence uses (columns < its block count) must name a real block; one vectorized
    # pass (this runs on every call, so no Python loop over sequences)
    used = np.arange(maxb)[None, :] < nblk_needed[:, None]
    bad = used & ((bt < 0) | (bt >= dims.num_blocks))
    if bad.any():
        i, j = (int(v[0]) for v in np.nonzero(bad))
        raise ValueError(
            f"block_table: entries used by sequence {i} must be in [0, {dims.num_blocks}), "
            f"got block_table[{i}, {j}]={int(bt[i, j])}"
        )
    if softmax_scale is None:
        softmax_scale = 1.0 / np.sqrt(d)
    softmax_scale = checks.check_float(softmax_scale, "softmax_scale", positive=True)
    if sliding_window is not None:
        sliding_window = checks.check_int(sliding_window, "sliding_window", lo=1)
    ks = check_global_scale(k_scale, "k_scale")
    vs = check_global_scale(v_scale, "v_scale")
    meta = dict(
        query_start_loc=qsl, seq_lens=sl, block_table=bt, num_tokens=T, num_q_heads=Hq,
        softmax_scale=softmax_scale, sliding_window=sliding_window, k_scale=ks, v_scale=vs,
        max_query_len=int(qlen.max(initial=0)), max_seq_len=int(sl.max(initial=0)),
    )
    return fmt, dims, backend, meta


def get_format(name):
    """:func:`kvlab.get_format` (re-exported for the reference modules)."""
    return _formats.get_format(name)
