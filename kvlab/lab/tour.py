"""Helpers for the tour of the formats (notebook 01): sizes, byte maps of one row, round trips.

All NumPy, no model needed.
"""
from __future__ import annotations

import numpy as np

from ..formats import FORMAT_NAMES, get_format
from ..reference.fp_codecs import e2m1_decode, e4m3_decode
from ..reference.nibble import unpack_nibbles
from .metrics import tensor_errors


def size_table(head_sizes=(64, 128), num_layers: int = 30, num_kv_heads: int = 3) -> list:
    """Rows ``{format, head_size, row_bytes, bits_per_element, vs_bf16, kv_bytes_per_token}``.

    ``kv_bytes_per_token``: K and V of every layer and KV head for one token
    (``2 · num_layers · num_kv_heads · row_bytes``; SmolLM2-135M: 30 layers, 3 KV heads).
    """
    rows = []
    for d in head_sizes:
        for name in FORMAT_NAMES:
            fmt = get_format(name)
            rb = fmt.row_bytes(d)  # auto: bf16
            rows.append({"format": name, "head_size": d, "row_bytes": rb,
                         "bits_per_element": fmt.bits_per_element(d), "vs_bf16": rb / (2 * d),
                         "kv_bytes_per_token": 2 * num_layers * num_kv_heads * rb})
    return rows


def example_vector(head_size: int = 64, seed: int = 0) -> np.ndarray:
    """A float32 head vector ``(head_size,)`` shaped like a real key: Gaussian plus two outlier channels."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(head_size)
    x[3] = 9.0
    x[head_size // 2 + 3] = -7.0
    return x.astype(np.float32)


def explain_row(name: str, x) -> list:
    """What each byte range of the row of ``x`` ``(d,)`` holds in format ``name``.

    Rows ``{bytes, field, raw, meaning}``; ``raw`` shows at most the first 8 bytes in hex.
    """
    fmt = get_format(name)
    x = np.asarray(x, dtype=np.float32)
    d = x.shape[-1]
    row = np.asarray(fmt.quantize_rows(x[None]))[0]

    def hx(b):
        b = np.asarray(b).view(np.uint8).ravel()
        return " ".join(f"{v:02x}" for v in b[:8]) + (" …" if b.size > 8 else "")

    if fmt.stores_model_dtype:
        return [{"bytes": f"0–{d * x.itemsize - 1}", "field": "values", "raw": hx(row),
                 "meaning": f"{d} values in the model dtype ({x.dtype})"}]
    if name in ("int8_per_token_head", "fp8_per_token_head"):
        scale = row[d:d + 4].view("<f4")[0]
        codes = row[:d].view(np.int8) if name.startswith("int8") else e4m3_decode(row[:d])
        return [{"bytes": f"0–{d - 1}", "field": "codes", "raw": hx(row[:d]),
                 "meaning": f"first codes {np.round(np.asarray(codes[:4], dtype=float), 3).tolist()} "
                            f"({'int8' if name.startswith('int8') else 'E4M3'})"},
                {"bytes": f"{d}–{d + 3}", "field": "scale (float32)", "raw": hx(row[d:d + 4]),
                 "meaning": f"scale = absmax/{int(fmt.qmax)} = {scale:.6g}"}]
    if name == "int4_per_token_head":
        q = unpack_nibbles(row[: d // 2])
        word = int(row[d // 2:d // 2 + 4].view("<u4")[0])
        scale = np.uint32(word & 0xFFFFFFF0).view(np.float32)
        return [{"bytes": f"0–{d // 2 - 1}", "field": "packed 4-bit codes (RHT domain)", "raw": hx(row[: d // 2]),
                 "meaning": f"element 2i in the low nibble of byte i; first codes {q[:6].tolist()}"},
                {"bytes": f"{d // 2}–{d // 2 + 3}", "field": "scale word (uint32)", "raw": hx(row[d // 2:]),
                 "meaning": f"float32 scale {scale:.6g} with zero point {word & 0xF} in its 4 low mantissa bits"}]
    if name == "nvfp4":
        q = unpack_nibbles(row[: d // 2])
        sf = e4m3_decode(row[d // 2:])
        return [{"bytes": f"0–{d // 2 - 1}", "field": "packed E2M1 values", "raw": hx(row[: d // 2]),
                 "meaning": f"first values {e2m1_decode(q[:6]).tolist()} (× block scale × global scale)"},
                {"bytes": f"{d // 2}–{d // 2 + d // 16 - 1}", "field": f"{d // 16} E4M3 block scales",
                 "raw": hx(row[d // 2:]), "meaning": f"one per 16 elements: {np.round(sf, 4).tolist()}"}]
    raise ValueError(f"name: no byte map for {name!r}")


def roundtrip_table(x, global_scale: float = 1.0) -> list:
    """Rows ``{format, bits_per_element, rel_mse, sqnr_db, cosine}`` of every format on ``x`` ``(..., d)``."""
    x = np.asarray(x, dtype=np.float32)
    d = x.shape[-1]
    rows = []
    for name in FORMAT_NAMES:
        fmt = get_format(name)
        gs = global_scale if name == "nvfp4" else 1.0
        y = fmt.dequantize_rows(fmt.quantize_rows(x, global_scale=gs), d, global_scale=gs)
        rows.append({"format": name, "bits_per_element": fmt.bits_per_element(d), **tensor_errors(x, y)})
    return rows


def nvfp4_global_scale_sweep(x, factors=(2.0 ** -12, 2.0 ** -8, 2.0 ** -4, 0.25, 1.0, 4.0, 16.0, 2.0 ** 8)) -> list:
    """NVFP4 error of ``x`` ``(..., d)`` at global scales ``factor × calibrated`` (calibrated = amax/(6·448)),
    plus vLLM's default 1.0. Rows ``{global_scale, factor, rel_mse, sqnr_db, cosine}``."""
    from ..formats import calibrate_global_scale

    x = np.asarray(x, dtype=np.float32)
    d = x.shape[-1]
    fmt = get_format("nvfp4")
    cal = calibrate_global_scale(x)
    rows = []
    for f in list(factors) + [1.0 / cal]:
        gs = float(cal * f)
        y = fmt.dequantize_rows(fmt.quantize_rows(x, global_scale=gs), d, global_scale=gs)
        rows.append({"global_scale": gs, "factor": float(f), **tensor_errors(x, y)})
    return sorted(rows, key=lambda r: r["global_scale"])
