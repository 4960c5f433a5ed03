"""Error metrics: tensors, attention, and end to end (perplexity, KL of next-token distributions).

Tensor metrics compare a quantized array with its original (any shapes, float):
relative MSE ``‖x̂ − x‖² / ‖x‖²``, SQNR in dB ``−10·log10(rel. MSE)``, and the
mean cosine similarity of head vectors (last axis).

Attention metrics take one layer's captured queries ``(tokens, q_heads, d)``
and keys/values ``(tokens, kv_heads, d)`` (GQA: query head ``i`` reads KV
head ``i // (q_heads / kv_heads)``), causal:

* score error: relative Frobenius error of the pre-softmax scores ``q·k·scale``
  over the causal entries;
* output error: relative error of ``softmax(scores) · V``.

End to end (:func:`evaluate_recipe`): every window ``(context ‖ continuation)``
is prefilled — context first, then the continuation in one chunk — into a
:class:`~kvlab.lab.hf_cache.KVLabCache`; the next-token distributions of the
``N`` continuation tokens are compared with those of an unquantized
``DynamicCache`` run of the same windows: mean ``KL(p_ref ‖ p_quant)`` in nats
per token, and perplexity of the continuation under each.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks import check_float, check_int


def _same_shape(x, xq):
    """float64 copies of ``x`` and ``xq``; ValueError unless their shapes are equal (no broadcasting:
    a broadcast comparison would silently measure something else)."""
    x = np.asarray(x, dtype=np.float64)
    xq = np.asarray(xq, dtype=np.float64)
    if x.shape != xq.shape:
        raise ValueError(f"xq: expected the shape of x {x.shape}, got {xq.shape}")
    return x, xq


def rel_mse(x, xq) -> float:
    """``‖xq − x‖² / ‖x‖²`` (float64 arithmetic)."""
    x, xq = _same_shape(x, xq)
    e = xq - x
    return float(np.sum(e * e) / max(np.sum(x * x), 1e-300))


def sqnr_db(x, xq) -> float:
    """Signal-to-quantization-noise ratio in dB (``inf`` for an exact copy)."""
    r = rel_mse(x, xq)
    return float("inf") if r == 0 else float(-10.0 * np.log10(r))


def mean_cosine(x, xq) -> float:
    """Mean cosine similarity of the vectors along the last axis (zero vectors count as 1)."""
    x, xq = _same_shape(x, xq)
    num = np.sum(x * xq, axis=-1)
    den = np.linalg.norm(x, axis=-1) * np.linalg.norm(xq, axis=-1)
    cos = np.where(den > 0, num / np.where(den > 0, den, 1), 1.0)
    return float(np.mean(cos))


def tensor_errors(x, xq) -> dict:
    """``{"rel_mse", "sqnr_db", "cosine"}`` of ``xq`` against ``x``."""
    return {"rel_mse": rel_mse(x, xq), "sqnr_db": sqnr_db(x, xq), "cosine": mean_cosine(x, xq)}


def _scores(q, k, scaling):
    """Causal scores float64 ``(q_heads, T, T)`` (masked entries −inf) of q ``(T, Hq, d)``, k ``(T, Hkv, d)``."""
    T, Hq, d = q.shape
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"q: {Hq} query heads is not a multiple of {Hkv} KV heads")
    kk = np.repeat(np.asarray(k, dtype=np.float64), Hq // Hkv, axis=1)
    s = np.einsum("thd,shd->hts", np.asarray(q, dtype=np.float64), kk) * scaling
    mask = np.triu(np.ones((T, T), dtype=bool), 1)
    s[:, mask] = -np.inf
    return s


def _attend(s, v, Hq):
    vv = np.repeat(np.asarray(v, dtype=np.float64), Hq // v.shape[1], axis=1)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, vv)


def attention_errors(q, k, v, kq, vq, scaling: float) -> dict:
    """``{"score_rel_err", "out_rel_err"}`` of one layer with quantized ``kq``/``vq``.

    q: ``(T, q_heads, d)`` post-RoPE queries; k, v, kq, vq: ``(T, kv_heads, d)``.
    """
    q = np.asarray(q)
    if q.ndim != 3:
        raise ValueError(f"q: expected (tokens, q_heads, head_dim), got shape {q.shape}")
    want = (q.shape[0], None, q.shape[2])
    shape0 = None
    for name, a in (("k", k), ("v", v), ("kq", kq), ("vq", vq)):
        sh = np.shape(a)
        if len(sh) != 3 or sh[0] != want[0] or sh[2] != want[2] or (shape0 is not None and sh != shape0):
            raise ValueError(f"{name}: expected (tokens={want[0]}, kv_heads, head_dim={want[2]})"
                             f"{'' if shape0 is None else ' = ' + str(shape0)} like q/k, got shape {sh}")
        shape0 = shape0 or sh
    scaling = check_float(scaling, "scaling", positive=True)
    s = _scores(q, k, scaling)
    sq = _scores(q, kq, scaling)
    fin = np.isfinite(s)
    score_err = np.linalg.norm(sq[fin] - s[fin]) / max(np.linalg.norm(s[fin]), 1e-300)
    o = _attend(s, v, q.shape[1])
    oq = _attend(sq, vq, q.shape[1])
    out_err = np.linalg.norm(oq - o) / max(np.linalg.norm(o), 1e-300)
    return {"score_rel_err": float(score_err), "out_rel_err": float(out_err)}


# ---- end to end ----------------------------------------------------------------------------
@dataclass
class Reference:
    """Unquantized next-token log-probabilities of the continuation tokens.

    logprobs: float32 ``(windows, N, vocab)``; targets: int64 ``(windows, N)``;
    nll: float64 ``(windows, N)``; context_len: int.
    """

    windows: np.ndarray
    context_len: int
    logprobs: np.ndarray
    targets: np.ndarray
    nll: np.ndarray

    @property
    def ppl(self) -> float:
        return float(np.exp(self.nll.mean()))


def _continuation_logprobs(lm, batch, context_len: int, cache):
    """log-softmax float32 ``(b, N, vocab)`` predicting tokens ``context_len …`` of ``batch``."""
    import torch

    from .hf_cache import cache_kwargs

    ids = torch.as_tensor(batch, device=lm.device)
    with torch.no_grad():
        a = lm.model(ids[:, :context_len], **cache_kwargs(lm.model, cache), use_cache=True, logits_to_keep=1).logits
        b = lm.model(ids[:, context_len:], **cache_kwargs(lm.model, cache), use_cache=True).logits
    if cache.get_seq_length() != ids.shape[1]:
        # a transformers version that does not know the ``cache=`` argument would ignore it and
        # use its own unquantized cache: every KL would silently be 0
        raise RuntimeError(f"cache: the model did not write the {ids.shape[1]} tokens into the cache it was "
                           f"given (it holds {cache.get_seq_length()}); this transformers version may "
                           f"expect past_key_values= instead of cache=")
    with torch.no_grad():
        logits = torch.cat([a[:, -1:], b[:, :-1]], dim=1).float()
        return torch.log_softmax(logits, dim=-1).cpu().numpy()


def check_token_ids(ids, name: str, lm, ndim: int) -> np.ndarray:
    """Token ids as int64 NumPy of ``ndim`` dimensions, every id in ``[0, vocab)`` of ``lm``.

    Checked on the host: an out-of-range id on a GPU would be a device-side assert that
    poisons the CUDA context instead of an error naming the argument.
    """
    if hasattr(ids, "detach"):
        ids = ids.detach().cpu().numpy()
    a = np.asarray(ids)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integer token ids, got dtype {a.dtype}")
    a = a.astype(np.int64)
    if a.ndim != ndim or a.size == 0:
        want = "(num_windows, window_len)" if ndim == 2 else "(tokens,)"
        raise ValueError(f"{name}: expected a non-empty {want} array of token ids, got shape {a.shape}")
    vocab = _vocab_size(lm)
    if vocab is not None and (a.min() < 0 or a.max() >= vocab):
        bad = int(a.min()) if a.min() < 0 else int(a.max())
        raise ValueError(f"{name}: token ids must be in [0, {vocab}), got {bad}")
    return a


def _vocab_size(lm):
    try:
        return int(lm.model.get_input_embeddings().num_embeddings)
    except Exception:  # a model without an embedding table: nothing to check against
        return None


def _check_lm(lm):
    from .model import LoadedModel

    if not isinstance(lm, LoadedModel):
        raise TypeError(f"lm: expected a LoadedModel (kvlab.lab.model.load_model), got {type(lm).__name__}")


def _check_windows(windows, context_len, lm=None):
    if lm is not None:
        windows = check_token_ids(windows, "windows", lm, 2)
    else:
        windows = np.asarray(windows, dtype=np.int64)
    if windows.ndim != 2:
        raise ValueError(f"windows: expected (num_windows, window_len) token ids, got shape {windows.shape}")
    context_len = check_int(context_len, "context_len")
    if not (1 <= context_len < windows.shape[1]):
        raise ValueError(f"context_len: expected 1 … {windows.shape[1] - 1}, got {context_len}")
    return windows


def reference_logprobs(lm, windows, context_len: int, batch_size: int = 2) -> Reference:
    """Unquantized (``DynamicCache``) continuation log-probs of ``windows`` int64 ``(n, L)``."""
    from transformers import DynamicCache

    _check_lm(lm)
    windows = _check_windows(windows, context_len, lm)
    batch_size = check_int(batch_size, "batch_size", lo=1)
    outs = []
    for i in range(0, len(windows), batch_size):
        outs.append(_continuation_logprobs(lm, windows[i:i + batch_size], context_len,
                                           DynamicCache(config=lm.model.config)))
    lp = np.concatenate(outs)
    tgt = windows[:, context_len:]
    nll = -np.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0].astype(np.float64)
    return Reference(windows=windows, context_len=context_len, logprobs=lp, targets=tgt, nll=nll)


def evaluate_recipe(lm, recipe, ref: Reference, calib=None, batch_size: int = 2) -> dict:
    """KL and perplexity of ``recipe`` (a format name or Recipe) against ``ref``.

    Returns ``{"kl", "kl_sem", "ppl", "ppl_ref", "delta_nll", "tokens", "kl_per_window"}``:
    mean KL in nats/token, its standard error over windows, perplexities, mean
    NLL change, scored tokens, and the mean KL of each window (for paired comparisons).
    """
    from .hf_cache import KVLabCache

    _check_lm(lm)
    if not isinstance(ref, Reference):
        raise TypeError(f"ref: expected a Reference (kvlab.lab.metrics.reference_logprobs), got {type(ref).__name__}")
    batch_size = check_int(batch_size, "batch_size", lo=1)
    KVLabCache(recipe, lm.model, calib=calib)  # checks recipe and calib before the first forward pass
    kls, nlls = [], []
    w = ref.windows
    for i in range(0, len(w), batch_size):
        cache = KVLabCache(recipe, lm.model, calib=calib)
        lq = _continuation_logprobs(lm, w[i:i + batch_size], ref.context_len, cache)
        lr = ref.logprobs[i:i + batch_size]
        kl = np.sum(np.exp(lr.astype(np.float64)) * (lr.astype(np.float64) - lq), axis=-1)
        kls.append(kl)
        tgt = ref.targets[i:i + batch_size]
        nlls.append(-np.take_along_axis(lq, tgt[..., None], axis=-1)[..., 0].astype(np.float64))
    kl = np.concatenate(kls)
    nll = np.concatenate(nlls)
    per_window = kl.mean(axis=1)
    sem = float(per_window.std(ddof=1) / np.sqrt(len(per_window))) if len(per_window) > 1 else float("nan")
    return {"kl": float(kl.mean()), "kl_sem": sem, "ppl": float(np.exp(nll.mean())), "ppl_ref": ref.ppl,
            "delta_nll": float(nll.mean() - ref.nll.mean()), "tokens": int(kl.size),
            "kl_per_window": [float(x) for x in per_window]}


def paired_ratio(kl_a, kl_b, n_boot: int = 2000, seed: int = 0) -> dict:
    """Ratio ``mean(kl_a) / mean(kl_b)`` of per-window KLs on the same windows, with a 95% bootstrap
    interval (windows resampled jointly, fixed seed). Returns ``{"ratio", "lo", "hi"}``."""
    a = np.asarray(kl_a, dtype=np.float64)
    b = np.asarray(kl_b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"kl_a, kl_b: expected equal 1-D per-window arrays, got {a.shape} and {b.shape}")
    ratio = float(a.mean() / b.mean())
    if a.size < 2:
        return {"ratio": ratio, "lo": float("nan"), "hi": float("nan")}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, size=(n_boot, a.size))
    r = a[idx].mean(axis=1) / b[idx].mean(axis=1)
    return {"ratio": ratio, "lo": float(np.quantile(r, 0.025)), "hi": float(np.quantile(r, 0.975))}
