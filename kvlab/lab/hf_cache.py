"""A ``transformers`` cache whose layers store K/V in a kvlab format or a lab recipe.

``KVLabCache(recipe, model)`` is a :class:`transformers.Cache` with one
:class:`KVLabLayer` per decoder layer, so ``model(ids, **cache_kwargs(model, cache))`` and
``model.generate(ids, **cache_kwargs(model, cache))`` run attention on a quantized cache
(:func:`cache_kwargs` names the argument as the installed transformers does: ``cache=`` in
recent versions, ``past_key_values=`` in older ones such as 5.17):

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

from collections import Counter

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from .. import api
from ..arrays import NUMPY_BF16
from ..formats import FORMAT_NAMES
from .model import LoadedModel
from .recipes import Calibration, Recipe, check_recipe_calib, format_recipe, roundtrip_side
from .rope import apply_rope, rope_cos_sin, undo_rope

#: tokens per block of the paged caches the format path writes
BLOCK_SIZE = 16



def cache_kwargs(model, cache) -> dict:
    """``{"cache": cache}`` or ``{"past_key_values": cache}``, whichever argument the model's
    ``forward`` takes (transformers renamed it; an unknown keyword is silently ignored by the
    model and rejected by ``generate``)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}

def _cuda_ops_available() -> bool:
    try:
        from ..cuda import cache as _  # noqa: F401  (written by the kernel engineers)
        return True
    except Exception:
        return False


#: dtypes of key/value states the cache accepts (the model's activations)
_STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy()


def _to_numpy_same_dtype(t: torch.Tensor) -> np.ndarray:
    """A host copy in the tensor's own dtype (bf16 as ml_dtypes' bfloat16: NumPy has none)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return np.ascontiguousarray(t.view(torch.int16).numpy()).view(NUMPY_BF16)
    return np.ascontiguousarray(t.numpy())


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
        self._k_tail = None     # dequantized keys of the pending group, model dtype (batch, heads, tokens, d)
        self._geometry = None   # (batch, kv_heads, key d, value d, dtype, device) of the stored history

    # -- transformers interface ---------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        """Store new states ``(batch, kv_heads, tokens, head_dim)``; return the dequantized history.

        Arguments are checked before anything is stored: a rejected call leaves the layer as it was.
        Zero new tokens store nothing and return the history.
        """
        self._check_states(key_states, value_states)
        if key_states.shape[-2] == 0:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            return self._history()
        start = self.cumulative_length
        k_final, k_tail, v_new = self.owner._quantize(self, key_states, value_states, start)
        # state changes only after the quantizer succeeded
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        self.keys = torch.cat([self.keys, k_final], dim=-2) if k_final.shape[-2] else self.keys
        self.values = torch.cat([self.values, v_new], dim=-2)
        self._k_tail = k_tail
        self._geometry = (key_states.shape[0], key_states.shape[1], key_states.shape[-1], value_states.shape[-1],
                          key_states.dtype, key_states.device)
        return self._history()

    def _history(self):
        keys = self.keys if self._k_tail is None else torch.cat([self.keys, self._k_tail], dim=-2)
        return keys, self.values

    def _check_states(self, k, v) -> None:
        """TypeError/ValueError naming the argument, before any state changes."""
        for name, t in (("key_states", k), ("value_states", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in _STATE_DTYPES:
                raise TypeError(f"{name}: expected dtype in {[str(d) for d in _STATE_DTYPES]}, got {t.dtype}")
            if t.dim() != 4:
                raise ValueError(f"{name}: expected 4 dimensions (batch, kv_heads, tokens, head_dim), "
                                 f"got shape {tuple(t.shape)}")
        if v.shape[:-1] != k.shape[:-1]:
            raise ValueError(f"value_states: expected (batch, kv_heads, tokens) = {tuple(k.shape[:-1])} as "
                             f"key_states, got {tuple(v.shape[:-1])}")
        if self.owner.recipe.is_plain_format and v.shape[-1] != k.shape[-1]:
            raise ValueError(f"value_states: kvlab formats store K and V of one head size, expected "
                             f"head_dim {k.shape[-1]}, got {v.shape[-1]}")
        if v.dtype != k.dtype or v.device != k.device:
            raise TypeError(f"value_states: expected {k.dtype} on {k.device} as key_states, got {v.dtype} "
                            f"on {v.device}")
        if self._geometry is not None:
            want = self._geometry
            got = (k.shape[0], k.shape[1], k.shape[-1], v.shape[-1], k.dtype, k.device)
            if got[:4] != want[:4]:
                raise ValueError(f"key_states, value_states: expected (batch, kv_heads, key head_dim, value head_dim)"
                                 f" = {want[:4]} as the cached history of layer {self.layer_idx}, got {got[:4]}")
            if got[4:] != want[4:]:
                raise TypeError(f"key_states: expected {want[4]} on {want[5]} as the cached history of layer "
                                f"{self.layer_idx}, got {k.dtype} on {k.device}")

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0
        self.stored = []
        self._pending_k = None
        self._k_tail = None
        self._geometry = None

    def reorder_cache(self, beam_idx):
        """Beam search is not supported (it would reorder the quantized history by beam):
        raises with what to do instead."""
        raise NotImplementedError("KVLabCache does not support beam search: generate with num_beams=1 "
                                  "(greedy or sampling)")


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
        check_recipe_calib(recipe, calib)
        if backend not in ("auto", "reference"):
            raise ValueError(f"backend: expected 'auto' or 'reference', got {backend!r}")
        if isinstance(model, LoadedModel):
            raise TypeError("model: expected the transformers model, got a LoadedModel (pass lm.model)")
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "get_text_config"):
            raise TypeError(f"model: expected a transformers model (with a .config), got {type(model).__name__}")
        cfg = config.get_text_config(decoder=True)
        n = int(cfg.num_hidden_layers)
        if calib is not None and calib.k_mean.shape[0] != n:
            raise ValueError(f"calib: expected statistics of the model's {n} layers, got "
                             f"{calib.k_mean.shape[0]} (calibrated on another model?)")
        self.recipe = recipe
        self.calib = calib
        self.model = model
        self.backend = backend
        #: how many (layer, update) writes went through each path: ``"kernels"`` (kvlab.cuda),
        #: ``"reference"`` (NumPy, kvlab formats) or ``"recipe"`` (NumPy codec of kvlab.lab.recipes)
        self.paths_used: Counter = Counter()
        super().__init__(layers=[KVLabLayer(self, i) for i in range(n)])

    # -- the quantizer --------------------------------------------------------------------
    def _quantize(self, layer: KVLabLayer, k: torch.Tensor, v: torch.Tensor, start: int):
        """New states (batch, heads, t, d) → (finalized keys, key tail or None, values), model dtype."""
        r = self.recipe
        if r.is_plain_format:
            kq, vq = self._format_roundtrip(layer, k, v)
            return kq, None, vq
        self.paths_used["recipe"] += 1
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
            key = _to_numpy_same_dtype(k.transpose(1, 2).reshape(n, h, d))
            value = _to_numpy_same_dtype(v.transpose(1, 2).reshape(n, h, d))
            slots = np.arange(n, dtype=np.int64)
        nblocks = -(-n // BLOCK_SIZE)
        cache = api.allocate_cache(name, nblocks, BLOCK_SIZE, h, d, like=key)
        api.reshape_and_cache(key, value, cache, slots, kv_cache_dtype=name)
        kd, vd = api.dequantize_cache(cache, kv_cache_dtype=name)
        layer.stored.append(cache)
        self.paths_used["kernels" if use_cuda else "reference"] += 1

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
