"""Rotary position embedding (LLaMA's rotate-half convention), forward and inverse, in NumPy.

For a head vector split in halves ``(a, b)`` and angle ``θ_j = pos · inv_freq_j``::

    rope(x)   = x · cos + rotate_half(x) · sin,   rotate_half(a, b) = (−b, a)
    unrope(y) = y · cos − rotate_half(y) · sin    (the inverse rotation)

``cos``/``sin`` come from the model's own ``rotary_emb`` module, so scaled RoPE
variants are followed. Used by :mod:`kvlab.lab.capture` (queries) and by the
pre-RoPE key recipes of :mod:`kvlab.lab.hf_cache`, which store keys before
RoPE and re-apply it after dequantization.
"""
from __future__ import annotations

import numpy as np


def rope_cos_sin(model, positions) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``(cos, sin)``, each ``(num_positions, head_dim)``, from ``model.model.rotary_emb``."""
    import torch

    inner = getattr(model, "model", model)
    rot = getattr(inner, "rotary_emb", None)
    if rot is None:
        raise ValueError("model: no rotary_emb module found (the lab's RoPE helpers need a RoPE model)")
    bufs = list(rot.buffers())
    dev = bufs[0].device if bufs else torch.device("cpu")
    pos = torch.as_tensor(np.asarray(positions, dtype=np.int64), device=dev)[None, :]
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    with torch.no_grad():
        cos, sin = rot(dummy, pos)
    return cos[0].double().cpu().numpy(), sin[0].double().cpu().numpy()


def _rotate_half(x: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, token_axis: int = -3) -> np.ndarray:
    """RoPE of ``x`` ``(..., tokens, heads, d)`` (tokens at ``token_axis``) with ``cos``/``sin`` ``(tokens, d)``."""
    c, s = _bcast(x, cos, token_axis), _bcast(x, sin, token_axis)
    return x * c + _rotate_half(x) * s


def undo_rope(y: np.ndarray, cos: np.ndarray, sin: np.ndarray, token_axis: int = -3) -> np.ndarray:
    """Inverse of :func:`apply_rope` (same shapes)."""
    c, s = _bcast(y, cos, token_axis), _bcast(y, sin, token_axis)
    return y * c - _rotate_half(y) * s


def _bcast(x: np.ndarray, cs: np.ndarray, token_axis: int) -> np.ndarray:
    ax = token_axis % x.ndim
    shape = [1] * x.ndim
    shape[ax] = cs.shape[0]
    shape[-1] = cs.shape[1]
    return cs.reshape(shape)
