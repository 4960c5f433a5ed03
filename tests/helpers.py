"""Test helpers: random ragged paged batches (shared by the reference and GPU tests)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import kvlab


@dataclass
class PagedBatch:
    """A ragged batch written into a paged cache.

    k, v: per sequence, float32 ``(seq_len, num_kv_heads, d)`` as written (before quantization);
    q: ``(num_tokens, num_q_heads, d)`` float32; slots: per sequence int64 ``(seq_len,)``.
    """

    fmt: object
    kv_cache: np.ndarray
    block_table: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    q: np.ndarray
    k: list
    v: list
    slots: list
    k_scale: float = 1.0
    v_scale: float = 1.0


def random_block_table(rng, seq_lens, block_size, extra_blocks=3, fill=-7):
    """Blocks for each sequence drawn from a shuffled pool of ``sum(blocks) + extra_blocks``.

    Returns ``(num_blocks, block_table int32 (num_seqs, max_blocks + 1), slots)``; ``slots`` is a
    list of int64 ``(seq_len,)`` slot mappings; table entries a sequence does not use hold ``fill``.
    """
    seq_lens = np.asarray(seq_lens, np.int32)
    nblk = -(-seq_lens // block_size)
    num_blocks = int(nblk.sum()) + extra_blocks
    pool = rng.permutation(num_blocks)
    block_table = np.full((len(seq_lens), int(nblk.max(initial=1)) + 1), fill, np.int32)
    slots, used = [], 0
    for i, L in enumerate(seq_lens):
        blocks = pool[used: used + nblk[i]]
        used += nblk[i]
        block_table[i, : nblk[i]] = blocks
        pos = np.arange(L)
        slots.append(blocks[pos // block_size].astype(np.int64) * block_size + pos % block_size)
    return num_blocks, block_table, slots


def make_paged_batch(rng, fmt_name, seq_lens, query_lens, num_kv_heads, gqa, head_size, block_size,
                     dtype=np.float32, extra_blocks=3, k_scale=1.0, v_scale=1.0, scale=1.0):
    """Random K/V/Q; blocks drawn at random from a shuffled pool; cache written with the reference."""
    fmt = kvlab.get_format(fmt_name)
    seq_lens = np.asarray(seq_lens, np.int32)
    query_lens = np.asarray(query_lens, np.int32)
    # unused table entries hold garbage (-7): kernels must never read them
    num_blocks, block_table, slots = random_block_table(rng, seq_lens, block_size, extra_blocks)
    ks, vs = [], []
    for L in seq_lens:
        ks.append((rng.standard_normal((L, num_kv_heads, head_size)) * scale).astype(dtype))
        vs.append((rng.standard_normal((L, num_kv_heads, head_size)) * scale).astype(dtype))
    cache = kvlab.allocate_cache(fmt, num_blocks, block_size, num_kv_heads, head_size,
                                 dtype=None if not fmt.stores_model_dtype else kvlab.arrays.dtype_name(np.zeros(1, dtype)))
    # random bytes, not zeros: positions never written must never be read
    if not fmt.stores_model_dtype:
        cache[...] = rng.integers(0, 256, cache.shape, dtype=np.uint8)
    else:
        cache[...] = (rng.standard_normal(cache.shape) * 1e3).astype(cache.dtype)
    if len(seq_lens):
        key = np.concatenate(ks) if ks else np.zeros((0, num_kv_heads, head_size), dtype)
        val = np.concatenate(vs)
        kvlab.reshape_and_cache(key, val, cache, np.concatenate(slots), fmt, k_scale, v_scale)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    q = (rng.standard_normal((int(qsl[-1]), num_kv_heads * gqa, head_size)) * scale).astype(dtype)
    return PagedBatch(fmt, cache, block_table, seq_lens, qsl, q, ks, vs, slots, k_scale, v_scale)


def dense_attention(q, k, v, softmax_scale, sliding_window=None):
    """Plain causal softmax attention of one sequence, float64, explicit loops over heads.

    q: ``(Lq, Hq, d)``, k/v: ``(L, Hkv, d)``; the queries are the last Lq positions.
    """
    Lq, Hq, d = q.shape
    L, Hkv, _ = k.shape
    G = Hq // Hkv
    out = np.zeros((Lq, Hq, d))
    for j in range(Lq):
        p = L - Lq + j
        lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
        for h in range(Hq):
            kk, vv = k[lo: p + 1, h // G].astype(np.float64), v[lo: p + 1, h // G].astype(np.float64)
            s = kk @ q[j, h].astype(np.float64) * softmax_scale
            w = np.exp(s - s.max())
            out[j, h] = (w / w.sum()) @ vv
    return out


# ---- the lab on the shipped model (CPU and GPU tests) ----------------------------------------
def model_logits(lm, ids, cache):
    """Logits of ``lm.model`` on token ids ``(batch, tokens)`` (on ``lm.device``) with ``cache``."""
    import torch

    from kvlab.lab.hf_cache import cache_kwargs

    with torch.no_grad():
        return lm.model(torch.as_tensor(ids, device=lm.device), **cache_kwargs(lm.model, cache),
                        use_cache=True).logits


def check_auto_cache_is_exact(lm, ids, split=50):
    """An ``auto`` KVLabCache gives bit-identical logits to transformers' DynamicCache, in one
    call and as a prefill of ``split`` tokens plus a continuation chunk. Returns the reference
    logits and the two KVLabCaches (one call, two chunks) for further checks."""
    import torch
    from transformers import DynamicCache

    from kvlab.lab.hf_cache import KVLabCache

    ref = model_logits(lm, ids, DynamicCache(config=lm.model.config))
    one = KVLabCache("auto", lm.model)
    assert torch.equal(model_logits(lm, ids, one), ref)
    dyn = DynamicCache(config=lm.model.config)
    ref2 = torch.cat([model_logits(lm, ids[:, :split], dyn), model_logits(lm, ids[:, split:], dyn)], dim=1)
    two = KVLabCache("auto", lm.model)
    out2 = torch.cat([model_logits(lm, ids[:, :split], two), model_logits(lm, ids[:, split:], two)], dim=1)
    assert torch.equal(out2, ref2)
    assert two.get_seq_length() == ids.shape[1]
    return ref, one, two


# ---- notebooks (tests/test_notebooks.py, tests/gpu/test_notebook_gpu.py) -----------------------
def run_notebook(path, monkeypatch, timeout_s, env=None):
    """Execute a notebook top to bottom in a fresh kernel in the small mode
    (``KVLAB_NOTEBOOK_SMALL=1``, offline, no progress bars, plus ``env``), without writing it
    back; fails on any error output. Returns the executed notebook."""
    import nbclient
    import nbformat

    for k, v in {"KVLAB_NOTEBOOK_SMALL": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", **(env or {})}.items():
        monkeypatch.setenv(k, v)
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"
    return nb
