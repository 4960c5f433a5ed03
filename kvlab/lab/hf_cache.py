"""A ``transformers`` cache whose layers store K/V in a kvlab format or a lab recipe.

``KVLabCache(recipe, model)`` is a :class:`transformers.Cache` with one
:class:`KVLabLayer` per decoder layer, so ``model(ids, cache=cache)`` and
``model.generate(ids, cache=cache)`` (``past_key_values=`` in older
transformers) run attention on a quantized cache:

* every ``update`` quantizes the new key/value states, stores them, and
  returns the **dequantized** full history — including the new tokens, so even
  a prefill attends to what the cache holds (as vLLM's unified attention does,
  which reads back the cache it just wrote);
* plain kvlab formats go through the public paged API: the new tokens are
  written with :func:`kvlab.reshape_and_cache` into a fresh paged ``uint8``
  cache (kept: these are the stored bytes) and read back with
  :func:`kvlab.dequantize_cache`. NumPy runs the reference; on a GPU the torch
  CUDA tensors go to kvlab's kernels when :mod:`kvlab.cuda` provides them
  (otherwise the reference on the host);
* recipes (:class:`~kvlab.lab.recipes.Recipe` with a :class:`QuantSpec` side,
  centering, smoothing, pre-RoPE keys) are simulated with the NumPy codec of
  :mod:`kvlab.lab.recipes`; their bit counts are analytic
  (``recipe.bits_per_element``).

The dequantized history is kept as a float tensor next to the stored data so a
decode step costs one new row, not the whole history; it is a materialization
of the stored data, not extra information. ``format="auto"`` stores the model
dtype and reproduces an unquantized ``DynamicCache`` bit for bit (tested).

Layout handed to the model: ``(batch, kv_heads, tokens, head_dim)`` in the
model dtype. Batches must not be left-padded when ``pre_rope`` is used (token
positions are taken as ``0, 1, …``).
"""
from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from .. import api
from ..formats import FORMAT_NAMES
from .recipes import Calibration, Recipe, format_recipe, roundtrip_side
from .rope import apply_rope, rope_cos_sin, undo_rope

#: tokens per block of the paged caches the format path writes
BLOCK_SIZE = 16


def _cuda_ops_available() -> bool:
    try:
        from ..cuda import cache as _  # noqa: F401  (written by the kernel engineers)
        return True
    except Exception:
        return False


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy()


class KVLabLayer(DynamicLayer):
    """One layer's quantized K/V. ``keys``/``values`` hold the dequantized history
    ``(batch, kv_heads, tokens, head_dim)``; ``stored`` the paged uint8 caches
    (format path); ``pending`` raw tokens of a not yet full per-channel key group."""

    is_croppable = False

    def __init__(self, owner: "KVLabCache", layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.cumulative_length = 0
        self.stored: list = []
        self._pending_k = None  # storage-domain float32 numpy (batch, tokens, heads, d)

    # -- transformers interface ---------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.cumulative_length
        self.cumulative_length += key_states.shape[-2]
        k_final, k_tail, v_new = self.owner._quantize(self, key_states, value_states, start)
        self.keys = torch.cat([self.keys, k_final], dim=-2) if k_final.shape[-2] else self.keys
        self.values = torch.cat([self.values, v_new], dim=-2)
        keys = self.keys if k_tail is None else torch.cat([self.keys, k_tail], dim=-2)
        return keys, self.values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0
        self.stored = []
        self._pending_k = None

    def reorder_cache(self, beam_idx):  # beam search would need the stored rows reordered too
        raise NotImplementedError("KVLabCache does not support beam search")


class KVLabCache(Cache):
    """transformers Cache storing K/V under a kvlab format or :class:`~kvlab.lab.recipes.Recipe`.

    recipe: a format name (``"int4_per_token_head"``, …) or a Recipe.
    model: the causal LM (for the number of layers and, for pre-RoPE recipes, its RoPE).
    calib: a :class:`~kvlab.lab.recipes.Calibration` when the recipe needs one.
    backend: ``"auto"`` (kernels for CUDA tensors when available, else reference),
    ``"reference"`` (always NumPy).
    """

    def __init__(self, recipe, model, calib: Calibration | None = None, backend: str = "auto"):
        if isinstance(recipe, str):
            if recipe not in FORMAT_NAMES:
                raise ValueError(f"recipe: expected a Recipe or one of {list(FORMAT_NAMES)}, got {recipe!r}")
            recipe = format_recipe(recipe)
        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe: expected a format name or Recipe, got {type(recipe).__name__}")
        if recipe.needs_calibration and calib is None:
            raise ValueError(f"calib: recipe {recipe.name!r} needs a Calibration (kvlab.lab.recipes.calibrate)")
        if backend not in ("auto", "reference"):
            raise ValueError(f"backend: expected 'auto' or 'reference', got {backend!r}")
        cfg = model.config.get_text_config(decoder=True)
        self.recipe = recipe
        self.calib = calib
        self.model = model
        self.backend = backend
        n = int(cfg.num_hidden_layers)
        super().__init__(layers=[KVLabLayer(self, i) for i in range(n)])

    # -- the quantizer --------------------------------------------------------------------
    def _quantize(self, layer: KVLabLayer, k: torch.Tensor, v: torch.Tensor, start: int):
        """New states (batch, heads, t, d) → (finalized keys, key tail or None, values), model dtype."""
        r = self.recipe
        if r.is_plain_format:
            kq, vq = self._format_roundtrip(layer, k, v)
            return kq, None, vq
        dev, dt = k.device, k.dtype
        kn = _to_numpy(k).transpose(0, 2, 1, 3)  # (b, t, h, d)
        vn = _to_numpy(v).transpose(0, 2, 1, 3)
        vq = roundtrip_side(r, "v", vn, layer.layer_idx, self.calib)
        if r.pre_rope:
            cos, sin = rope_cos_sin(self.model, np.arange(start, start + kn.shape[1]))
            kn = undo_rope(kn.astype(np.float64), cos, sin).astype(np.float32)
        channel = not isinstance(r.key, str) and r.key.axis == "channel"
        if channel:  # groups of token_group tokens: finalize full groups, re-quantize the tail
            G = r.key.token_group
            allk = kn if layer._pending_k is None else np.concatenate([layer._pending_k, kn], axis=1)
            first = start - (0 if layer._pending_k is None else layer._pending_k.shape[1])
            nfull = (allk.shape[1] // G) * G
            fin = roundtrip_side(r, "k", allk[:, :nfull], layer.layer_idx, self.calib) if nfull else allk[:, :0]
            tail_raw = allk[:, nfull:]
            tail = roundtrip_side(r, "k", tail_raw, layer.layer_idx, self.calib) if tail_raw.shape[1] else None
            layer._pending_k = tail_raw if tail_raw.shape[1] else None
            fin = self._post_rope(fin, first)
            tail = None if tail is None else self._post_rope(tail, first + nfull)
        else:
            fin = self._post_rope(roundtrip_side(r, "k", kn, layer.layer_idx, self.calib), start)
            tail = None

        def back(a):
            return torch.from_numpy(np.ascontiguousarray(a.transpose(0, 2, 1, 3))).to(dev, dt)

        return back(fin), (None if tail is None else back(tail)), back(vq)

    def _post_rope(self, k: np.ndarray, first: int) -> np.ndarray:
        if not self.recipe.pre_rope or k.shape[1] == 0:
            return k
        cos, sin = rope_cos_sin(self.model, np.arange(first, first + k.shape[1]))
        return apply_rope(k.astype(np.float64), cos, sin).astype(np.float32)

    def _format_roundtrip(self, layer: KVLabLayer, k: torch.Tensor, v: torch.Tensor):
        """Write the new tokens with kvlab.reshape_and_cache into a fresh paged cache, read them back."""
        name = self.recipe.key
        b, h, t, d = k.shape
        n = b * t
        use_cuda = k.is_cuda and self.backend == "auto" and _cuda_ops_available()
        if use_cuda:
            key = k.transpose(1, 2).reshape(n, h, d).contiguous()
            value = v.transpose(1, 2).reshape(n, h, d).contiguous()
            slots = torch.arange(n, device=k.device, dtype=torch.int64)
        else:
            key = np.ascontiguousarray(k.detach().cpu().transpose(1, 2).reshape(n, h, d).numpy())
            value = np.ascontiguousarray(v.detach().cpu().transpose(1, 2).reshape(n, h, d).numpy())
            slots = np.arange(n, dtype=np.int64)
        nblocks = -(-n // BLOCK_SIZE)
        cache = api.allocate_cache(name, nblocks, BLOCK_SIZE, h, d, like=key)
        api.reshape_and_cache(key, value, cache, slots, kv_cache_dtype=name)
        kd, vd = api.dequantize_cache(cache, kv_cache_dtype=name)
        layer.stored.append(cache)

        def back(a):
            a = a.reshape(nblocks * BLOCK_SIZE, h, d)[:n].reshape(b, t, h, d)
            a = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))
            return a.transpose(1, 2).to(k.device, k.dtype).contiguous()

        return back(kd), back(vd)

    # -- accounting -------------------------------------------------------------------------
    def stored_bytes(self) -> int:
        """Bytes of the paged caches written so far (format path; includes padding of last blocks)."""
        return int(sum(int(np.prod(c.shape)) * c.element_size() if isinstance(c, torch.Tensor)
                       else c.nbytes for layer in self.layers for c in layer.stored))
