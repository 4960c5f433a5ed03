"""Reference paged attention (float64): decode, prefill and chunked prefill in one entry point.

Mirrors ``kernels_cu/paged_attention.cu``. SPEC 2.4 semantics:

* sequence ``i`` owns query tokens ``query_start_loc[i] … query_start_loc[i+1]-1``
  and KV positions ``0 … seq_lens[i]-1`` (its new tokens already written);
* query token ``j`` of a sequence with query length ``L_q`` and KV length ``L``
  sits at position ``p = L − L_q + j`` and attends to ``0 … p`` (causal), and
  with ``sliding_window = w`` only to ``p − w + 1 … p`` (the last ``w`` positions,
  itself included — vLLM's convention);
* KV head ``h`` serves query heads ``h·G … h·G + G − 1`` (GQA, ``G = Hq / Hkv``).

For ``int4_per_token_head`` the computation runs as the kernels do, in the
rotated domain: the query is rotated once (``q̃ = H·(s ⊙ q)``), the softmax
scale divided by ``d`` (``q·k = q̃·k̃ / d``), V rows stay rotated and the output
is inverse-rotated once (``o = s ⊙ (H·õ) / d``). Mathematically this equals
attention over the dequantized cache, which the tests check.
"""
from __future__ import annotations

import numpy as np

from .. import validate
from .cache import dequantize_cache_float64
from .hadamard import inverse_rht, rht


def _gather_positions(bt_row, L, block_size):
    pos = np.arange(L)
    return bt_row[pos // block_size], pos % block_size


def paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, kv_cache_dtype="auto",
                    softmax_scale=None, k_scale=1.0, v_scale=1.0, sliding_window=None,
                    out_dtype=None) -> np.ndarray:
    """Paged attention over a cache of any format, float64 inside.

    q: ``(num_tokens, num_q_heads, head_size)`` bf16/fp16/float32. Returns
    ``(num_tokens, num_q_heads, head_size)`` in ``out_dtype`` (default: q's dtype;
    pass ``np.float64`` for the unrounded reference).
    """
    fmt, dims, backend, meta = validate.check_paged_attention(
        q, kv_cache, block_table, seq_lens, query_start_loc, kv_cache_dtype, softmax_scale,
        k_scale, v_scale, sliding_window,
    )
    if backend != "numpy":
        raise TypeError("kvlab.reference.paged_attention takes NumPy arrays; use kvlab.paged_attention")
    q64 = np.asarray(q).astype(np.float64)
    d = dims.head_size
    rotated = fmt.name == "int4_per_token_head"
    if rotated:
        rows = fmt.gather_rows(np.asarray(kv_cache))
        K = fmt.dequantize_rotated(rows[:, 0], d)   # (nb, bs, Hkv, d), rotated domain
        V = fmt.dequantize_rotated(rows[:, 1], d)
        q64 = rht(q64)
        scale = meta["softmax_scale"] / d
    else:
        K, V = dequantize_cache_float64(kv_cache, fmt, meta["k_scale"], meta["v_scale"])
        scale = meta["softmax_scale"]
    T, Hq = meta["num_tokens"], meta["num_q_heads"]
    G = Hq // dims.num_kv_heads
    out = np.zeros((T, Hq, d), dtype=np.float64)
    qsl, sl, bt, w = meta["query_start_loc"], meta["seq_lens"], meta["block_table"], meta["sliding_window"]
    for i in range(len(sl)):
        q0, q1, L = int(qsl[i]), int(qsl[i + 1]), int(sl[i])
        Lq = q1 - q0
        if Lq == 0:
            continue
        blk, off = _gather_positions(bt[i], L, dims.block_size)
        Ki = K[blk, off]            # (L, Hkv, d)
        Vi = V[blk, off]
        qi = q64[q0:q1].reshape(Lq, dims.num_kv_heads, G, d)
        o = np.empty((Lq, dims.num_kv_heads, G, d))
        for j in range(Lq):
            # only the rows a query may see enter its sum (so a NaN row outside the causal
            # or sliding window never reaches it — the NaN rule of formats/base.py)
            p = L - Lq + j
            lo = 0 if w is None else max(0, p - w + 1)
            kk, vv = Ki[lo: p + 1], Vi[lo: p + 1]                  # (n, Hkv, d)
            sc = np.einsum("hgd,khd->hgk", qi[j], kk) * scale
            pr = np.exp(sc - sc.max(axis=-1, keepdims=True))
            pr /= pr.sum(axis=-1, keepdims=True)
            o[j] = np.einsum("hgk,khd->hgd", pr, vv)
        out[q0:q1] = o.reshape(Lq, Hq, d)
    if rotated:
        out = inverse_rht(out)
    dt = np.asarray(q).dtype if out_dtype is None else np.dtype(out_dtype)
    return out.astype(dt)
