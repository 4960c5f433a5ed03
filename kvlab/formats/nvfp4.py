"""``nvfp4`` — FP4 E2M1 values with one E4M3 scale per 16 elements and a per-layer global scale.

SPEC 2.3 (vLLM #37332 compatible). Per head vector, per group ``g`` of 16
consecutive elements, float32 arithmetic as the kernels do::

    sf_g   = e4m3_rne_sat(amax_g / 6 / global_scale)       # the stored E4M3 byte
    code_i = e2m1_rne_sat(x_i / (sf_g · global_scale))      # 0 when sf_g == 0
    x_i   ≈ e2m1(code_i) · sf_g · global_scale              # dequantization

Non-finite input: the invalid row of ``formats/base.py`` (codes 0, every
scale byte 0x7F = E4M3 NaN).

``global_scale`` (vLLM's ``k_scale``/``v_scale``) is a *dequantization
multiplier*: 1.0 by default; :func:`calibrate_global_scale` gives
``amax / (6 · 448)``.

Page layout. The cache has shape ``(num_blocks, 2, block_size, num_kv_heads,
d/2 + d/16)`` but each ``(block, side)`` slab of ``block_size · num_kv_heads ·
(d/2 + d/16)`` bytes is ``[data | scales]``::

    slab offset of data byte j of (token t, head h):   (t·H + h)·d/2 + j
    slab offset of scale g of (token t, head h):       block_size·H·d/2 + (t·H + h)·d/16 + g

With the optional V-scale swizzle (vLLM's SM100 convention, V side only),
scale ``(t, g)`` of a head is stored at ``(t', g')`` with
``t' = (t // 4)·4 + g // (S/4)``, ``g' = (g % (S/4))·4 + t % 4``, ``S = d/16``.
The *logical* row this module's codec uses is ``data (d/2) ‖ scales (d/16)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import checks
from ..reference.fp_codecs import E2M1_MAX, E4M3_MAX, e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode
from ..reference.nibble import pack_nibbles, unpack_nibbles
from .base import SIDES, CacheFormat

GROUP = 16


def calibrate_global_scale(x) -> float:
    """Calibrated global scale ``amax / (6 · 448)`` of a tensor (1.0 for an all-zero one)."""
    amax = float(np.max(np.abs(np.asarray(x, dtype=np.float64)))) if np.size(x) else 0.0
    if not np.isfinite(amax):
        raise ValueError(f"x: calibration needs finite values, got amax {amax}")
    return amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else 1.0


def nvfp4_block_scales(x: np.ndarray, global_scale: float) -> np.ndarray:
    """E4M3 scale bytes uint8 ``(..., d/16)`` of ``x`` ``(..., d)``."""
    x = np.asarray(x, dtype=np.float32)
    g = x.reshape(x.shape[:-1] + (x.shape[-1] // GROUP, GROUP))
    amax = np.abs(g).max(axis=-1).astype(np.float32)
    sf = (amax / np.float32(6.0)).astype(np.float32) / np.float32(global_scale)
    return e4m3_encode(sf.astype(np.float32))


def nvfp4_codes(x: np.ndarray, sf_bytes: np.ndarray, global_scale: float) -> np.ndarray:
    """E2M1 codes uint8 ``(..., d)`` of ``x`` given its scale bytes."""
    x = np.asarray(x, dtype=np.float32)
    sf = e4m3_decode(sf_bytes).astype(np.float32)
    denom = (sf * np.float32(global_scale)).astype(np.float32)
    g = x.reshape(x.shape[:-1] + (x.shape[-1] // GROUP, GROUP))
    with np.errstate(divide="ignore", invalid="ignore"):
        v = (g / denom[..., None]).astype(np.float32)
    codes = e2m1_encode(v)
    codes = np.where((sf == 0)[..., None], np.uint8(0), codes)
    return codes.reshape(x.shape).astype(np.uint8)


def swizzle_index(block_size: int, S: int):
    """For logical ``(t, g)`` grids ``(block_size, S)``, the stored ``(t', g')`` index arrays."""
    t = np.arange(block_size)[:, None]
    g = np.arange(S)[None, :]
    q = S // 4
    tp = (t // 4) * 4 + g // q
    gp = (g % q) * 4 + t % 4
    return np.broadcast_to(tp, (block_size, S)), np.broadcast_to(gp, (block_size, S))


@dataclass(frozen=True)
class NVFP4(CacheFormat):
    name: str = "nvfp4"
    description: str = "FP4 E2M1 values, E4M3 scale per 16, float32 global scale"
    supported_head_sizes: tuple = (16, 32, 64, 128, 256, 512)
    #: store V scales in vLLM's SM100 swizzled order (interop); off in kvlab's own kernels
    swizzle_v_scales: bool = False

    def row_bytes(self, head_size):
        return head_size // 2 + head_size // GROUP

    def data_bytes(self, head_size):
        return head_size // 2

    def check_block_size(self, block_size, head_size):
        if self.swizzle_v_scales:
            if block_size % 4:
                raise ValueError(
                    f"block_size: the nvfp4 V-scale swizzle needs a multiple of 4, got {block_size}"
                )
            if (head_size // GROUP) % 4:
                raise ValueError(
                    f"head_size: the nvfp4 V-scale swizzle needs a multiple of 64, got {head_size}"
                )

    # ---- codec ----------------------------------------------------------------------
    def quantize_rows(self, x, global_scale: float = 1.0):
        x, lead, d, bad = self._head_vectors(x)  # (n, d) rows; reshaped back to lead at the end
        gs = checks.check_float(global_scale, "global_scale", positive=True)
        x = np.where(bad[..., None], 0, x.astype(np.float32))
        sf = nvfp4_block_scales(x, gs)
        codes = nvfp4_codes(x, sf, gs)
        codes[bad] = 0
        sf[bad] = 0x7F                          # the invalid row (NaN/Inf rule, formats/base.py)
        rows = np.concatenate([pack_nibbles(codes), sf], axis=-1)
        return rows.reshape(lead + rows.shape[-1:])

    def dequantize_rows(self, rows, head_size, global_scale: float = 1.0):
        rows = np.asarray(rows, dtype=np.uint8)
        d = head_size
        vals = e2m1_decode(unpack_nibbles(np.ascontiguousarray(rows[..., : d // 2])))
        sf = e4m3_decode(rows[..., d // 2 : d // 2 + d // GROUP])
        out = vals.reshape(vals.shape[:-1] + (d // GROUP, GROUP)) * sf[..., None]
        return out.reshape(vals.shape) * np.float64(np.float32(global_scale))

    # ---- slab layout ----------------------------------------------------------------
    def _slab_parts(self, cache: np.ndarray):
        nb, two, bs, H, R = cache.shape
        d = self.head_size_from_cache(cache)
        slab = cache.reshape(nb, two, bs * H * R)
        nd = bs * H * (d // 2)
        data = slab[..., :nd].reshape(nb, two, bs, H, d // 2)
        scales = slab[..., nd:].reshape(nb, two, bs, H, d // GROUP)
        return data, scales

    def _unswizzle(self, stored_v: np.ndarray) -> np.ndarray:
        """Stored V scales ``(nb, bs, H, S)`` → logical order."""
        bs, S = stored_v.shape[1], stored_v.shape[3]
        tp, gp = swizzle_index(bs, S)
        return np.transpose(stored_v, (0, 2, 1, 3))[:, :, tp, gp].transpose(0, 2, 1, 3)

    def split_views(self, cache, side):
        """``(data uint8 (nb, bs, H, d/2), scales uint8 E4M3 (nb, bs, H, d/16))``.

        Both are views of the slab; V scales are in *stored* order (swizzled
        when :attr:`swizzle_v_scales`): use :meth:`gather_rows` for logical order.
        """
        data, scales = self._slab_parts(cache)
        return data[:, SIDES[side]], scales[:, SIDES[side]]

    def gather_rows(self, cache):
        data, scales = self._slab_parts(cache)
        scales = scales.copy()
        if self.swizzle_v_scales:
            scales[:, 1] = self._unswizzle(scales[:, 1])
        return np.concatenate([data, scales], axis=-1)

    def scatter_rows(self, cache, side, blocks, offsets, rows):
        data, scales = self._slab_parts(cache)
        d2 = data.shape[-1]
        data[blocks, side, offsets] = rows[..., :d2]
        sf = rows[..., d2:]
        if self.swizzle_v_scales and side == 1:
            bs, S = cache.shape[2], sf.shape[-1]
            tp, gp = swizzle_index(bs, S)
            offsets = np.asarray(offsets)
            t_st = tp[offsets]  # (n, S)
            g_st = gp[offsets]
            H = sf.shape[1]
            b = np.asarray(blocks)[:, None, None]
            h = np.arange(H)[None, :, None]
            scales[b, 1, t_st[:, None, :], h, g_st[:, None, :]] = sf
        else:
            scales[blocks, side, offsets] = sf


NVFP4_FORMAT = NVFP4()
