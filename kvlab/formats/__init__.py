"""Cache formats (SPEC 2): layout, shape and the NumPy reference codec of each.

``get_format(name)`` returns the :class:`~kvlab.formats.base.CacheFormat`
for one of the names vLLM uses for ``--kv-cache-dtype``.
"""
from __future__ import annotations

from dataclasses import replace

from .auto import AUTO
from .base import CacheFormat
from .int4_per_token_head import INT4_PER_TOKEN_HEAD
from .nvfp4 import NVFP4_FORMAT, calibrate_global_scale
from .per_token_head import FP8_PER_TOKEN_HEAD, INT8_PER_TOKEN_HEAD

FORMATS = {
    f.name: f
    for f in (AUTO, INT8_PER_TOKEN_HEAD, FP8_PER_TOKEN_HEAD, INT4_PER_TOKEN_HEAD, NVFP4_FORMAT)
}
FORMAT_NAMES = tuple(FORMATS)


def get_format(name, *, swizzle_v_scales: bool | None = None) -> CacheFormat:
    """The format called ``name`` (or ``name`` itself if it is already a :class:`CacheFormat`).

    ``swizzle_v_scales`` applies to ``nvfp4`` only (vLLM's SM100 V-scale order).
    """
    if isinstance(name, CacheFormat):
        fmt = name
    elif isinstance(name, str):
        if name not in FORMATS:
            raise ValueError(f"kv_cache_dtype: expected one of {list(FORMATS)}, got {name!r}")
        fmt = FORMATS[name]
    else:
        raise TypeError(
            f"kv_cache_dtype: expected a format name (str) or CacheFormat, got {type(name).__name__}"
        )
    if swizzle_v_scales is not None:
        if fmt.name != "nvfp4":
            raise ValueError(f"swizzle_v_scales: only nvfp4 has a V-scale swizzle, not {fmt.name}")
        fmt = replace(fmt, swizzle_v_scales=bool(swizzle_v_scales))
    return fmt


__all__ = ["CacheFormat", "FORMATS", "FORMAT_NAMES", "get_format", "calibrate_global_scale"]
