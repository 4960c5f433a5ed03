"""Quantization recipes built from the knobs of SPEC 5, with honest bit counts.

A :class:`QuantSpec` says how one side (K or V) is quantized; a :class:`Recipe`
pairs a key and a value side (each a :class:`QuantSpec` *or* a kvlab format
name) with optional per-layer transforms that cost no bytes per token:

* ``center_keys`` / ``center_values``: subtract a per-layer, per-head,
  per-channel mean (calibrated on text disjoint from the evaluation text)
  before quantizing, add it back after. Exact to fold: ``q·(k − μ)`` differs
  from ``q·k`` by the same constant for every key of a query (softmax is
  shift-invariant), and ``Σ p_i (v_i − μ) + μ = Σ p_i v_i``.
* ``smooth_keys`` (SmoothAttention-style, exponent α): keys are divided per
  channel by ``s_j = max|K_j|^α / max|Q_j|^(1−α)`` and the query multiplied
  by ``s`` (``q·k`` unchanged). Channels ``j`` and ``j + d/2`` share one
  factor so the scaling commutes with RoPE.
* ``pre_rope``: keys are cached before RoPE, which is re-applied on read.

Knobs of :class:`QuantSpec` (SPEC 5):

=============== =====================================================================
``bits``        2, 3, 4, 8
``symmetric``   symmetric codes ``[-2^(b-1), 2^(b-1)-1]`` or asymmetric ``[0, 2^b-1]``
``zero_point``  asymmetric only: ``"scale_word"`` (integer zp hidden in the low ``bits``
                mantissa bits of the scale; 0 extra bits), ``"int8"`` (a separate byte),
                ``"float"`` (the group minimum stored in the scale dtype)
``scale_dtype`` ``"fp32"``, ``"fp16"``, ``"bf16"``, ``"e4m3"`` (RNE, saturating), ``"e8m0"``
                (power of two, rounded up so nothing clips)
``group_size``  elements per scale along the head dim: ``None`` (whole head), 64, 32, 16
``rotation``    ``"none"``, ``"rht"`` (vLLM's signs), ``"rht:<seed>"`` (other random signs)
``clipping``    ``"absmax"`` or ``"mse"`` (per-group search over range shrink factors)
``rounding``    ``"half_away"``, ``"half_even"``, ``"stochastic"`` (seeded)
``codebook``    ``"uniform"`` or ``"lloyd_max"`` (2^b-level Lloyd–Max quantizer for a
                unit Gaussian, scaled by the group RMS; no zero point)
``axis``        ``"token"`` (groups along the head dim of one token) or ``"channel"``
                (groups of ``token_group`` tokens of one channel, KIVI-style keys)
=============== =====================================================================

Bits per element count codes, scales and zero points:
``(bits·g + scale_bits + zp_bits) / g`` for groups of ``g`` elements. The
asymmetric 4-bit, fp32, hidden-zero-point, whole-head, RHT spec is
``int4_per_token_head`` (4.5 bits at d=64) and reproduces its reference (tested).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace
from functools import lru_cache

import ml_dtypes
import numpy as np

from ..checks import check_choice, check_int
from ..formats import FORMAT_NAMES, get_format
from ..reference.fp_codecs import e4m3_round
from ..reference.hadamard import inverse_rht, random_signs, rht
from ..reference.rounding import round_half_away

SCALE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "e4m3": 8, "e8m0": 8}
#: mantissa bits of each scale dtype that can hold a hidden zero point
_MANTISSA_BITS = {"fp32": 23, "fp16": 10, "bf16": 7}
ZERO_POINTS = ("scale_word", "int8", "float")
CLIPPINGS = ("absmax", "mse")
ROUNDINGS = ("half_away", "half_even", "stochastic")
CODEBOOKS = ("uniform", "lloyd_max")
AXES = ("token", "channel")
#: range shrink factors tried by MSE-optimal clipping
MSE_ALPHAS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6)
SCALE_FLOOR = 1e-6


@lru_cache(maxsize=None)
def lloyd_max_levels(bits: int) -> np.ndarray:
    """The 2^bits reconstruction levels of the MSE-optimal scalar quantizer of N(0, 1), float64 sorted.

    Lloyd's iteration (centroids ↔ midpoints) from uniform initial levels, run
    to convergence; symmetric by construction.
    """
    from scipy.stats import norm

    n = 2 ** bits
    levels = np.linspace(-2.5, 2.5, n)
    for _ in range(500):
        edges = np.concatenate([[-np.inf], (levels[1:] + levels[:-1]) / 2, [np.inf]])
        a, b = edges[:-1], edges[1:]
        mass = norm.cdf(b) - norm.cdf(a)
        new = (norm.pdf(a) - norm.pdf(b)) / mass  # E[X | a < X < b]
        if np.max(np.abs(new - levels)) < 1e-12:
            levels = new
            break
        levels = new
    return (levels - levels[::-1]) / 2  # exact symmetry


def store_scale(s: np.ndarray, scale_dtype: str) -> np.ndarray:
    """Round positive scales to ``scale_dtype`` as stored; float32 result (0 where E4M3 underflows)."""
    s = np.asarray(s, dtype=np.float32)
    if scale_dtype == "fp32":
        return s
    if scale_dtype == "fp16":
        return np.minimum(s, 65504.0).astype(np.float16).astype(np.float32)
    if scale_dtype == "bf16":
        return s.astype(ml_dtypes.bfloat16).astype(np.float32)
    if scale_dtype == "e4m3":
        return e4m3_round(s).astype(np.float32)
    if scale_dtype == "e8m0":
        e = np.clip(np.ceil(np.log2(np.maximum(s, 2.0 ** -127))), -127, 127)
        return np.exp2(e).astype(np.float32)
    raise ValueError(f"scale_dtype: expected one of {list(SCALE_BITS)}, got {scale_dtype!r}")


def hide_zero_point(scale: np.ndarray, zp: np.ndarray, scale_dtype: str, bits: int) -> np.ndarray:
    """The scale word with its ``bits`` lowest mantissa bits replaced by ``zp``, as a float32 value."""
    if scale_dtype == "fp32":
        w = (scale.astype(np.float32).view(np.uint32) & np.uint32(~((1 << bits) - 1) & 0xFFFFFFFF))
        return (w | zp.astype(np.uint32)).view(np.float32)
    dt = np.float16 if scale_dtype == "fp16" else ml_dtypes.bfloat16
    w = scale.astype(dt).view(np.uint16) & np.uint16(~((1 << bits) - 1) & 0xFFFF)
    return (w | zp.astype(np.uint16)).view(dt).astype(np.float32)


def _round(v: np.ndarray, mode: str, rng_seed: int = 0) -> np.ndarray:
    if mode == "half_away":
        return round_half_away(v)
    if mode == "half_even":
        return np.rint(v).astype(np.float64)
    rng = np.random.default_rng(rng_seed)
    return np.floor(v.astype(np.float64) + rng.random(v.shape))


@dataclass(frozen=True)
class QuantSpec:
    """How one side's head vectors are quantized (see the module docstring for the knobs)."""

    bits: int = 4
    symmetric: bool = False
    zero_point: str = "scale_word"
    scale_dtype: str = "fp32"
    group_size: int | None = None
    rotation: str = "none"
    clipping: str = "absmax"
    rounding: str = "half_away"
    codebook: str = "uniform"
    axis: str = "token"
    token_group: int = 64

    def __post_init__(self):
        check_choice(self.bits, "bits", (2, 3, 4, 8))
        if not isinstance(self.bits, (int, np.integer)):  # 4.0 == 4 would pass check_choice
            raise TypeError(f"bits: expected an int, got {type(self.bits).__name__} {self.bits!r}")
        if not isinstance(self.symmetric, (bool, np.bool_)):
            raise TypeError(f"symmetric: expected a bool, got {type(self.symmetric).__name__} {self.symmetric!r}")
        for name in ("zero_point", "scale_dtype", "rotation", "clipping", "rounding", "codebook", "axis"):
            v = getattr(self, name)
            if not isinstance(v, str):
                raise TypeError(f"{name}: expected a str, got {type(v).__name__} {v!r}")
        if self.group_size is not None and not isinstance(self.group_size, (int, np.integer)):
            raise TypeError(f"group_size: expected None or an int, got {type(self.group_size).__name__} "
                            f"{self.group_size!r}")
        if self.scale_dtype not in SCALE_BITS:
            raise ValueError(f"scale_dtype: expected one of {list(SCALE_BITS)}, got {self.scale_dtype!r}")
        if self.zero_point not in ZERO_POINTS:
            raise ValueError(f"zero_point: expected one of {list(ZERO_POINTS)}, got {self.zero_point!r}")
        if self.group_size not in (None, 16, 32, 64, 128, 256):
            raise ValueError(f"group_size: expected None, 16, 32, 64, 128 or 256, got {self.group_size!r}")
        if not (self.rotation in ("none", "rht") or (self.rotation.startswith("rht:")
                                                      and self.rotation[4:].isdigit())):
            raise ValueError(f"rotation: expected 'none', 'rht' or 'rht:<seed>', got {self.rotation!r}")
        for name, v, allowed in (("clipping", self.clipping, CLIPPINGS), ("rounding", self.rounding, ROUNDINGS),
                                 ("codebook", self.codebook, CODEBOOKS), ("axis", self.axis, AXES)):
            if v not in allowed:
                raise ValueError(f"{name}: expected one of {list(allowed)}, got {v!r}")
        if self.axis == "channel" and self.group_size is not None:
            raise ValueError("group_size: per-channel specs group along tokens (token_group), not the head dim")
        if isinstance(self.token_group, bool) or not isinstance(self.token_group, int) or self.token_group < 2:
            raise ValueError(f"token_group: expected an int >= 2, got {self.token_group!r}")
        if self.uses_hidden_zero_point:
            if self.scale_dtype not in _MANTISSA_BITS:
                raise ValueError(
                    f"zero_point: a zero point hidden in the scale word needs a scale dtype with a mantissa "
                    f"of at least {self.bits} bits (fp32/fp16/bf16), got scale_dtype={self.scale_dtype!r}")
            if self.bits > _MANTISSA_BITS[self.scale_dtype]:
                raise ValueError(
                    f"zero_point: {self.bits}-bit zero points do not fit in the "
                    f"{_MANTISSA_BITS[self.scale_dtype]}-bit mantissa of {self.scale_dtype}")

    # ---- accounting -----------------------------------------------------------------
    @property
    def is_asymmetric_uniform(self) -> bool:
        return self.codebook == "uniform" and not self.symmetric

    @property
    def uses_hidden_zero_point(self) -> bool:
        return self.is_asymmetric_uniform and self.zero_point == "scale_word"

    def zero_point_bits(self) -> int:
        if not self.is_asymmetric_uniform or self.zero_point == "scale_word":
            return 0
        return 8 if self.zero_point == "int8" else SCALE_BITS[self.scale_dtype]

    def group_elements(self, head_size: int) -> int:
        """Elements sharing one scale: the group along the head dim, or ``token_group`` tokens of a channel."""
        if self.axis == "channel":
            return self.token_group
        return self.group_size or head_size

    def bits_per_element(self, head_size: int) -> float:
        """Storage bits per element: codes + (scale + zero point) / group elements."""
        g = self.group_elements(head_size)
        return self.bits + (SCALE_BITS[self.scale_dtype] + self.zero_point_bits()) / g

    def label(self) -> str:
        """Short human-readable description."""
        parts = [f"{'s' if self.symmetric else 'a'}int{self.bits}" if self.codebook == "uniform"
                 else f"lloydmax{self.bits}"]
        if self.is_asymmetric_uniform:
            parts.append(f"zp={self.zero_point}")
        parts.append(f"scale={self.scale_dtype}")
        parts.append(f"g={'tok' + str(self.token_group) if self.axis == 'channel' else (self.group_size or 'head')}")
        parts.append(f"rot={self.rotation}")
        if self.clipping != "absmax":
            parts.append("clip=mse")
        if self.rounding != "half_away":
            parts.append(f"round={self.rounding}")
        return " ".join(parts)

    # ---- codec (simulated: quantize then dequantize) ---------------------------------
    def signs(self, head_size: int):
        if self.rotation == "none":
            return "none"
        if self.rotation == "rht":
            return None
        return random_signs(head_size, int(self.rotation[4:]))

    def roundtrip(self, x) -> np.ndarray:
        """Quantize and dequantize ``x``; float32 result of the same shape.

        Token axis: ``x`` is ``(..., d)``, every head vector is quantized on its own.
        Channel axis: ``x`` is ``(..., tokens, d)``; every channel of each run of
        ``token_group`` consecutive tokens shares a scale (a short last run too).
        """
        x = np.asarray(x, dtype=np.float32)
        d = x.shape[-1]
        rotated = self.rotation != "none"
        y = rht(x, self.signs(d)).astype(np.float32) if rotated else x
        if self.axis == "token":
            g = self.group_size or d
            if d % g:
                raise ValueError(f"group_size: {g} does not divide the head size {d}")
            deq = self._quant_last(y.reshape(y.shape[:-1] + (d // g, g))).reshape(y.shape)
        else:
            if x.ndim < 2:
                raise ValueError(f"x: per-channel quantization needs (..., tokens, d), got shape {x.shape}")
            yt = np.swapaxes(y, -1, -2)  # (..., d, tokens)
            T = yt.shape[-1]
            G = self.token_group
            pieces = []
            nfull = (T // G) * G
            if nfull:
                full = yt[..., :nfull].reshape(yt.shape[:-1] + (T // G, G))
                pieces.append(self._quant_last(full).reshape(yt.shape[:-1] + (nfull,)))
            if T > nfull:
                pieces.append(self._quant_last(yt[..., nfull:]))
            deq = np.swapaxes(np.concatenate(pieces, axis=-1), -1, -2)
        if rotated:
            deq = inverse_rht(deq, self.signs(d))
        return np.asarray(deq, dtype=np.float32)

    def _quant_last(self, v: np.ndarray) -> np.ndarray:
        """Quantize-dequantize groups along the last axis of float32 ``v`` (..., g)."""
        alphas = MSE_ALPHAS if self.clipping == "mse" else (1.0,)
        best, best_err = None, None
        for a in alphas:
            deq = self._quant_groups(v, a)
            if len(alphas) == 1:
                return deq
            err = np.sum((deq.astype(np.float64) - v) ** 2, axis=-1)
            if best is None:
                best, best_err = deq, err
            else:
                better = err < best_err
                best = np.where(better[..., None], deq, best)
                best_err = np.where(better, err, best_err)
        return best

    def _quant_groups(self, v: np.ndarray, alpha: float) -> np.ndarray:
        f32 = np.float32
        if self.codebook == "lloyd_max":
            levels = lloyd_max_levels(self.bits)
            rms = np.sqrt(np.mean(v.astype(np.float64) ** 2, axis=-1)) * alpha
            s = store_scale(np.maximum(rms, SCALE_FLOOR), self.scale_dtype)
            with np.errstate(divide="ignore", invalid="ignore"):
                u = np.where(s[..., None] > 0, v / s[..., None], 0.0)
            mids = (levels[1:] + levels[:-1]) / 2
            q = np.searchsorted(mids, u)
            return (levels[q] * s[..., None]).astype(f32)
        if self.symmetric:
            qmax = 2 ** (self.bits - 1) - 1 if self.bits > 2 else 1
            qmin = -(2 ** (self.bits - 1))
            amax = np.abs(v).max(axis=-1) * f32(alpha)
            s = store_scale(np.maximum(amax / f32(qmax), f32(SCALE_FLOOR)), self.scale_dtype)
            inv = np.where(s > 0, f32(1.0) / np.where(s > 0, s, 1), 0).astype(f32)
            q = np.clip(_round((v * inv[..., None]).astype(f32), self.rounding), qmin, qmax)
            return (q * s[..., None]).astype(f32)
        L = 2 ** self.bits - 1
        mn = v.min(axis=-1)
        mx = v.max(axis=-1)
        if alpha != 1.0:
            c = (mn + mx) / 2
            mn, mx = (c - (c - mn) * alpha).astype(f32), (c + (mx - c) * alpha).astype(f32)
        s = store_scale(np.maximum((mx - mn) / f32(L), f32(SCALE_FLOOR)), self.scale_dtype)
        ok = s > 0
        inv = np.where(ok, f32(1.0) / np.where(ok, s, 1), 0).astype(f32)
        if self.zero_point == "float":
            off = store_scale(np.abs(mn), self.scale_dtype) * np.sign(mn).astype(f32)
            q = np.clip(_round(((v - off[..., None]) * inv[..., None]).astype(f32), self.rounding), 0, L)
            return (q * s[..., None] + off[..., None]).astype(f32)
        zp = np.clip(round_half_away((-mn * inv).astype(f32)), 0, L)
        vq = (v * inv[..., None]).astype(f32)
        vq = (vq + zp[..., None].astype(f32)).astype(f32)
        q = np.clip(_round(vq, self.rounding), 0, L)
        s_read = hide_zero_point(s, zp.astype(np.uint32), self.scale_dtype, self.bits) \
            if self.zero_point == "scale_word" else s
        return ((q - zp[..., None]) * s_read[..., None]).astype(f32)


#: SPEC 2.1 written as a spec: reproduces ``int4_per_token_head`` (float32 inputs)
INT4_SPEC = QuantSpec(bits=4, rotation="rht")


@dataclass(frozen=True)
class Recipe:
    """A KV-cache recipe: key and value sides (a :class:`QuantSpec` or a kvlab format name) + transforms."""

    name: str
    key: object = "auto"
    value: object = "auto"
    center_keys: bool = False
    center_values: bool = False
    smooth_keys: float = 0.0
    pre_rope: bool = False
    #: nvfp4 sides: ``"unit"`` (vLLM's default 1.0) or ``"calibrated"`` (amax / (6·448) per layer)
    nvfp4_global_scale: str = "unit"
    description: str = field(default="", compare=False)

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"name: expected a str, got {type(self.name).__name__} {self.name!r}")
        for flag in ("center_keys", "center_values", "pre_rope"):
            v = getattr(self, flag)
            if not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"{flag}: expected a bool, got {type(v).__name__} {v!r}")
        if isinstance(self.smooth_keys, (bool, np.bool_)) or not isinstance(self.smooth_keys, numbers.Real):
            raise TypeError(f"smooth_keys: expected a float exponent in [0, 1], got "
                            f"{type(self.smooth_keys).__name__} {self.smooth_keys!r}")
        for side in ("key", "value"):
            v = getattr(self, side)
            if isinstance(v, str):
                if v not in FORMAT_NAMES:
                    raise ValueError(f"{side}: expected a QuantSpec or one of {list(FORMAT_NAMES)}, got {v!r}")
            elif not isinstance(v, QuantSpec):
                raise TypeError(f"{side}: expected a QuantSpec or a format name, got {type(v).__name__}")
        if isinstance(self.value, QuantSpec) and self.value.axis == "channel":
            raise ValueError("value: per-channel quantization is offered for keys only")
        if self.nvfp4_global_scale not in ("unit", "calibrated"):
            raise ValueError(f"nvfp4_global_scale: expected 'unit' or 'calibrated', got {self.nvfp4_global_scale!r}")
        if not (0.0 <= self.smooth_keys <= 1.0):
            raise ValueError(f"smooth_keys: expected an exponent in [0, 1], got {self.smooth_keys!r}")

    @property
    def is_plain_format(self) -> bool:
        """True when both sides are the same kvlab format and nothing else is changed."""
        return (isinstance(self.key, str) and self.key == self.value and not self.center_keys
                and not self.center_values and not self.smooth_keys and not self.pre_rope
                and not (self.key == "nvfp4" and self.nvfp4_global_scale == "calibrated"))

    @property
    def needs_calibration(self) -> bool:
        return bool(self.center_keys or self.center_values or self.smooth_keys
                    or ("nvfp4" in (self.key, self.value) and self.nvfp4_global_scale == "calibrated"))

    def side_bits(self, side: str, head_size: int, model_itemsize: int = 2) -> float:
        s = self.key if side == "k" else self.value
        if isinstance(s, str):
            return get_format(s).bits_per_element(head_size, model_itemsize)
        return s.bits_per_element(head_size)

    def bits_per_element(self, head_size: int, model_itemsize: int = 2) -> float:
        """Mean storage bits per K/V element (scales and zero points included; ``auto`` = model dtype)."""
        return (self.side_bits("k", head_size, model_itemsize) + self.side_bits("v", head_size, model_itemsize)) / 2

    def bytes_per_token_head(self, head_size: int, model_itemsize: int = 2) -> float:
        """Mean bytes per (token, head) row of K and of V (``int4_per_token_head``: d/2 + 4)."""
        return self.bits_per_element(head_size, model_itemsize) * head_size / 8

    def label(self) -> str:
        def one(s):
            return s if isinstance(s, str) else s.label()
        sides = one(self.key) if self.key == self.value else f"K[{one(self.key)}] V[{one(self.value)}]"
        extra = [t for t, on in (("center K", self.center_keys), ("center V", self.center_values),
                                 (f"smooth K α={self.smooth_keys}", self.smooth_keys),
                                 ("pre-RoPE K", self.pre_rope),
                                 ("nvfp4 calibrated gs", self.nvfp4_global_scale == "calibrated")) if on]
        return sides + (" + " + ", ".join(extra) if extra else "")


def format_recipe(name: str, **kw) -> Recipe:
    """The recipe of a plain kvlab format (``"auto"``, ``"int4_per_token_head"``, …)."""
    return Recipe(name=name, key=name, value=name, **kw)


FORMAT_RECIPES = tuple(format_recipe(n) for n in FORMAT_NAMES)


# ---- calibration -----------------------------------------------------------------------
@dataclass
class Calibration:
    """Per-layer statistics of real K/V/Q from calibration windows (float64 NumPy).

    ``k_mean``, ``k_pre_mean``, ``v_mean``, ``k_absmax``, ``k_pre_absmax``:
    ``(layers, kv_heads, d)``; ``q_absmax``, ``q_pre_absmax``: ``(layers, kv_heads, d)``
    (max over the query heads of each KV group); ``k_amax``, ``v_amax``: ``(layers,)``.
    """

    k_mean: np.ndarray
    k_pre_mean: np.ndarray
    v_mean: np.ndarray
    k_absmax: np.ndarray
    k_pre_absmax: np.ndarray
    q_absmax: np.ndarray
    q_pre_absmax: np.ndarray
    k_amax: np.ndarray
    v_amax: np.ndarray

    def smoothing(self, alpha: float, pre_rope: bool) -> np.ndarray:
        """Key smoothing factors ``s`` ``(layers, kv_heads, d)``: ``max|K|^α / max|Q|^(1−α)``, RoPE pairs tied."""
        ka = self.k_pre_absmax if pre_rope else self.k_absmax
        qa = self.q_pre_absmax if pre_rope else self.q_absmax
        s = np.maximum(ka, 1e-5) ** alpha / np.maximum(qa, 1e-5) ** (1 - alpha)
        h = s.shape[-1] // 2
        pair = np.maximum(s[..., :h], s[..., h:])
        s = np.concatenate([pair, pair], axis=-1)
        return s / np.exp(np.mean(np.log(s), axis=-1, keepdims=True))  # geometric mean 1 per head


def calibrate(captures) -> Calibration:
    """:class:`Calibration` from one or more :class:`~kvlab.lab.capture.KVCapture` (concatenated over tokens)."""
    from .capture import KVCapture

    if isinstance(captures, KVCapture):
        captures = [captures]
    caps = list(captures)
    if not caps:
        raise ValueError("captures: need at least one calibration capture")
    for i, c in enumerate(caps):
        if not isinstance(c, KVCapture):
            raise TypeError(f"captures[{i}]: expected a KVCapture (kvlab.lab.capture.capture_kv), "
                            f"got {type(c).__name__}")
        if (c.keys.shape[0], *c.keys.shape[2:]) != (caps[0].keys.shape[0], *caps[0].keys.shape[2:]) \
                or c.queries.shape[2] != caps[0].queries.shape[2]:
            raise ValueError(f"captures[{i}]: expected the geometry of captures[0] (layers, kv_heads, head_dim) "
                             f"= {(caps[0].keys.shape[0], *caps[0].keys.shape[2:])}, got "
                             f"{(c.keys.shape[0], *c.keys.shape[2:])}")
    K = np.concatenate([c.keys for c in caps], axis=1).astype(np.float64)
    Kp = np.concatenate([c.keys_pre_rope for c in caps], axis=1).astype(np.float64)
    V = np.concatenate([c.values for c in caps], axis=1).astype(np.float64)
    Q = np.concatenate([c.queries for c in caps], axis=1).astype(np.float64)
    Qp = np.concatenate([c.queries_pre_rope for c in caps], axis=1).astype(np.float64)
    L, T, Hkv, d = K.shape
    grp = Q.shape[2] // Hkv
    qabs = np.abs(Q).reshape(L, T, Hkv, grp, d).max(axis=(1, 3))
    qpre = np.abs(Qp).reshape(L, T, Hkv, grp, d).max(axis=(1, 3))
    return Calibration(
        k_mean=K.mean(axis=1), k_pre_mean=Kp.mean(axis=1), v_mean=V.mean(axis=1),
        k_absmax=np.abs(K).max(axis=1), k_pre_absmax=np.abs(Kp).max(axis=1),
        q_absmax=qabs, q_pre_absmax=qpre,
        k_amax=np.abs(K).max(axis=(1, 2, 3)), v_amax=np.abs(V).max(axis=(1, 2, 3)),
    )


def check_calibration(calib: Calibration, layer, num_kv_heads: int, head_size: int) -> None:
    """``calib`` has statistics for ``layer`` of a ``(num_kv_heads, head_size)`` geometry (ValueError if not)."""
    n = calib.k_mean.shape[0]
    layer = check_int(layer, "layer", lo=0)
    if layer >= n:
        raise ValueError(f"layer: expected 0 … {n - 1} (the calibration has {n} layers), got {layer}")
    if calib.k_mean.shape[1:] != (num_kv_heads, head_size):
        raise ValueError(f"calib: expected statistics of (kv_heads, head_dim) = {(num_kv_heads, head_size)}, "
                         f"got {calib.k_mean.shape[1:]} (calibrated on another model?)")


# ---- one side, all transforms ---------------------------------------------------------------
def check_recipe_calib(recipe: Recipe, calib) -> None:
    """``calib`` is a :class:`Calibration` or None, and present when ``recipe`` needs one."""
    if recipe.needs_calibration and calib is None:
        raise ValueError(f"calib: recipe {recipe.name!r} needs a Calibration (see kvlab.lab.recipes.calibrate)")
    if calib is not None and not isinstance(calib, Calibration):
        raise TypeError(f"calib: expected a Calibration (kvlab.lab.recipes.calibrate) or None, "
                        f"got {type(calib).__name__}")


def roundtrip_side(recipe: Recipe, side: str, x: np.ndarray, layer: int, calib: Calibration | None = None,
                   head_axis: int = -2) -> np.ndarray:
    """Quantize-dequantize one side of one layer under ``recipe``; float32, shape of ``x``.

    x: float32 ``(..., tokens, kv_heads, d)`` (``head_axis`` = −2) — for keys in the
    domain the recipe stores (pre-RoPE when ``recipe.pre_rope``). Centering and
    smoothing are applied around the quantizer with the layer's calibrated vectors.
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe: expected a Recipe, got {type(recipe).__name__}")
    if side not in ("k", "v"):
        raise ValueError(f"side: expected 'k' or 'v', got {side!r}")
    check_recipe_calib(recipe, calib)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim < 2:
        raise ValueError(f"x: expected (..., tokens, kv_heads, head_dim), got shape {x.shape}")
    if calib is not None and recipe.needs_calibration:
        check_calibration(calib, layer, x.shape[head_axis], x.shape[-1])
    d = x.shape[-1]
    spec = recipe.key if side == "k" else recipe.value

    def per_head(vec):  # (kv_heads, d) -> broadcastable to x
        shape = [1] * x.ndim
        shape[head_axis] = vec.shape[0]
        shape[-1] = d
        return vec.reshape(shape).astype(np.float32)

    mu = s = None
    if side == "k" and recipe.center_keys:
        mu = per_head((calib.k_pre_mean if recipe.pre_rope else calib.k_mean)[layer])
    if side == "v" and recipe.center_values:
        mu = per_head(calib.v_mean[layer])
    if side == "k" and recipe.smooth_keys:
        s = per_head(calib.smoothing(recipe.smooth_keys, recipe.pre_rope)[layer])
    y = x
    if mu is not None:
        y = y - mu
    if s is not None:
        y = y / s
    if isinstance(spec, str):
        fmt = get_format(spec)
        if fmt.stores_model_dtype:
            deq = y
        else:
            gs = 1.0
            if spec == "nvfp4" and recipe.nvfp4_global_scale == "calibrated":
                amax = (calib.k_amax if side == "k" else calib.v_amax)[layer]
                gs = float(amax / (6.0 * 448.0)) if amax > 0 else 1.0
            deq = fmt.dequantize_rows(fmt.quantize_rows(np.ascontiguousarray(y), global_scale=gs), d,
                                      global_scale=gs).astype(np.float32)
    else:
        if spec.axis == "channel":
            # tokens must be the second-to-last axis: move heads in front
            yt = np.moveaxis(y, head_axis, -3) if head_axis != -3 else y
            deq = np.moveaxis(spec.roundtrip(yt), -3, head_axis) if head_axis != -3 else spec.roundtrip(yt)
        else:
            deq = spec.roundtrip(y)
    if s is not None:
        deq = deq * s
    if mu is not None:
        deq = deq + mu
    return deq.astype(np.float32)


def with_name(recipe: Recipe, name: str, **changes) -> Recipe:
    """A copy of ``recipe`` under another name with some fields changed."""
    return replace(recipe, name=name, **changes)
