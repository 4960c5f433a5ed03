"""Capture real K/V activations: what the model caches (post-RoPE), pre-RoPE keys, and queries.

One forward pass of one token window with a plain ``DynamicCache``:

* ``keys``, ``values``: per layer, exactly the tensors the model hands to its
  cache (after RoPE for keys) — float32 ``(layers, tokens, kv_heads, head_dim)``.
* ``keys_pre_rope``: the output of each attention module's ``k_proj`` (forward
  hook), reshaped to ``(layers, tokens, kv_heads, head_dim)``. For LLaMA-style
  models RoPE of these equals ``keys`` (tested).
* ``queries``: ``q_proj`` outputs with RoPE applied, float32
  ``(layers, tokens, q_heads, head_dim)`` — for attention-score metrics;
  ``queries_pre_rope`` the same before RoPE.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .rope import apply_rope, rope_cos_sin


@dataclass
class KVCapture:
    """Activations of one window. Arrays are float32; shapes in the module docstring."""

    keys: np.ndarray
    values: np.ndarray
    keys_pre_rope: np.ndarray
    queries: np.ndarray
    queries_pre_rope: np.ndarray
    input_ids: np.ndarray
    #: softmax scale the model uses (1/sqrt(head_dim) for LLaMA)
    scaling: float

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[-1]


def attention_modules(model) -> list:
    """The attention modules (having ``q_proj``, ``k_proj``, ``v_proj``) in layer order."""
    mods = [m for m in model.modules() if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj"))]
    if not mods:
        raise ValueError("model: no attention modules with q_proj/k_proj/v_proj found")
    return mods


def capture_kv(lm, input_ids) -> KVCapture:
    """Run ``lm`` (a :class:`~kvlab.lab.model.LoadedModel`) on one window and capture K, V, pre-RoPE K, Q.

    input_ids: int ``(tokens,)`` (NumPy, list or torch). Returns a :class:`KVCapture`.
    """
    import torch
    from transformers import DynamicCache

    from .hf_cache import cache_kwargs
    from .metrics import _check_lm, check_token_ids

    _check_lm(lm)
    ids = check_token_ids(input_ids, "input_ids", lm, 1)
    model = lm.model
    mods = attention_modules(model)
    d = lm.head_dim
    captured = {"k": [], "q": []}
    hooks = []
    for m in mods:
        hooks.append(m.k_proj.register_forward_hook(lambda mod, inp, out: captured["k"].append(out)))
        hooks.append(m.q_proj.register_forward_hook(lambda mod, inp, out: captured["q"].append(out)))
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            model(torch.as_tensor(ids, device=lm.device)[None], **cache_kwargs(model, cache),
                  use_cache=True, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    T = ids.size

    def kv(t):  # (1, heads, T, d) -> (T, heads, d)
        return t[0].transpose(0, 1).float().cpu().numpy()

    keys = np.stack([kv(layer.keys) for layer in cache.layers])
    values = np.stack([kv(layer.values) for layer in cache.layers])
    kpre = np.stack([k[0].float().cpu().numpy().reshape(T, -1, d) for k in captured["k"]])
    qpre = np.stack([q[0].float().cpu().numpy().reshape(T, -1, d) for q in captured["q"]])
    cos, sin = rope_cos_sin(model, np.arange(T))
    queries = apply_rope(qpre.astype(np.float64), cos, sin).astype(np.float32)
    scaling = float(getattr(mods[0], "scaling", d ** -0.5))
    return KVCapture(keys=keys, values=values, keys_pre_rope=kpre, queries=queries, queries_pre_rope=qpre,
                     input_ids=ids, scaling=scaling)
