"""The lab's default text: the English documentation shipped with CPython (``pydoc_data.topics``).

Always present, offline, ~1 MB of prose and code. Windows of tokens are
selected deterministically: topics are joined in sorted key order, tokenized
once, and windows are taken at evenly spaced offsets (no randomness), so every
run of the lab sees the same tokens. Calibration windows (for recipes that
need per-layer statistics) come from a disjoint region of the stream.
"""
from __future__ import annotations

import numpy as np


def default_text() -> str:
    """All pydoc topics joined in sorted key order (str, ~1 M characters)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


_TOKENS: dict = {}


def token_stream(tokenizer, text: str | None = None) -> np.ndarray:
    """Token ids int64 ``(num_tokens,)`` of ``text`` (default: :func:`default_text`), cached."""
    key = (id(tokenizer), None if text is None else hash(text))
    if key not in _TOKENS:
        t = default_text() if text is None else text
        _TOKENS[key] = np.asarray(tokenizer(t, add_special_tokens=False)["input_ids"], dtype=np.int64)
    return _TOKENS[key]


def token_windows(tokenizer, num_windows: int, window_len: int, *, text: str | None = None,
                  split: str = "eval") -> np.ndarray:
    """``num_windows`` deterministic windows of ``window_len`` tokens, int64 ``(num_windows, window_len)``.

    split: ``"eval"`` draws from the first 80% of the token stream, ``"calib"``
    from the last 20% — disjoint, so calibrated recipes never see the text
    they are scored on. Windows are evenly spaced and non-overlapping.
    """
    for n, v in (("num_windows", num_windows), ("window_len", window_len)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{n}: expected a positive int, got {v!r}")
    if split not in ("eval", "calib"):
        raise ValueError(f"split: expected 'eval' or 'calib', got {split!r}")
    ids = token_stream(tokenizer, text)
    cut = int(len(ids) * 0.8)
    region = ids[:cut] if split == "eval" else ids[cut:]
    if num_windows * window_len > len(region):
        raise ValueError(
            f"num_windows * window_len: {num_windows}×{window_len} tokens do not fit in the "
            f"{split} region of {len(region)} tokens"
        )
    stride = len(region) // num_windows
    starts = np.arange(num_windows) * stride
    return np.stack([region[s:s + window_len] for s in starts]).astype(np.int64)
