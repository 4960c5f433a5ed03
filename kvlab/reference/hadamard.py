"""Walsh–Hadamard transform and the randomized Hadamard transform (RHT).

Reference (float64) for ``kernels_cu/hadamard.cu``. SPEC section 2.1.

``H`` is the *unnormalized* Sylvester Hadamard matrix of order ``d``
(``H @ H == d * I``, ``H`` symmetric), ``s`` the fixed ±1 sign vector that
vLLM uses (a CPU ``torch.Generator`` seeded with ``0x9E3779B9``). The RHT is
``y = H @ (s * x)``; its inverse is ``x = s * (H @ y) / d``.
"""
from __future__ import annotations

import numpy as np

from .. import checks

__all__ = [
    "SUPPORTED_HEAD_SIZES",
    "VLLM_SIGNS_512",
    "rht_signs",
    "random_signs",
    "wht",
    "rht",
    "inverse_rht",
    "hadamard_matrix",
]

#: Head sizes the Hadamard transform supports: powers of two, 16 … 512.
SUPPORTED_HEAD_SIZES = (16, 32, 64, 128, 256, 512)

#: The first 512 signs of vLLM's RHT (``+`` = +1). Shorter head sizes use a
#: prefix. Shipped as data so that no torch is needed; ``tests/test_hadamard.py``
#: regenerates it with torch when torch is installed.
VLLM_SIGNS_512 = (
    "+-++----+--++-+-++--+++-+-+--++-+---++-++-+-++---------+-------+--++-++-+-++++----+---+--++--+-+---+++----+-+-+-+++++++-++-+-++-+------+++-+---+--+--+-+-+-+--+-+-----+---+---++++++-+-+++-+-+-+---+--+----++--+++-+-----+--++-------+-+++----+------+---+-+++++++--++----+++----+++-++-+-++--+-++-+--+++++---+++--+-+-+---+-+-+-+-++-+++-+++---+-+-+--+++-++---+--++-+-++--++-+++---------++--+-+++-++-+--++++----+++------++---+++---------+---++--+--+-++--++-++-+++---+--+-------+-++--+--+++--+++-+--++-+-++-+++--+-+-+---+"
)
assert len(VLLM_SIGNS_512) == 512  # data integrity of this module, not user input

_SIGNS = np.array([1.0 if c == "+" else -1.0 for c in VLLM_SIGNS_512], dtype=np.float64)
_SIGNS.setflags(write=False)


def rht_signs(head_size: int) -> np.ndarray:
    """vLLM's RHT sign vector for ``head_size``: float64 ``(head_size,)`` of ±1."""
    checks.check_choice(head_size, "head_size", SUPPORTED_HEAD_SIZES)
    return _SIGNS[:head_size].copy()


def random_signs(head_size: int, seed: int) -> np.ndarray:
    """Another random ±1 sign vector (for the lab's rotation knob), float64 ``(head_size,)``."""
    checks.check_choice(head_size, "head_size", SUPPORTED_HEAD_SIZES)
    rng = np.random.default_rng(seed)
    return rng.choice(np.array([-1.0, 1.0]), size=head_size)


def hadamard_matrix(d: int) -> np.ndarray:
    """The unnormalized Sylvester Hadamard matrix of order ``d`` (float64 ``(d, d)``)."""
    checks.check_power_of_two(d, "d", lo=1, hi=4096)
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


def wht(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Unnormalized fast Walsh–Hadamard transform along ``axis`` (float64 result).

    Equals ``x @ hadamard_matrix(d)`` along that axis (``H`` is symmetric), in
    ``d * log2(d)`` additions: butterflies of stride 1, 2, 4, … ``d/2``.
    """
    y = np.moveaxis(np.asarray(x, dtype=np.float64), axis, -1).copy()
    d = y.shape[-1]
    checks.check_power_of_two(d, "x.shape[axis]", lo=1, hi=4096)
    lead = y.shape[:-1]
    h = 1
    while h < d:
        y = y.reshape(*lead, d // (2 * h), 2, h)
        a = y[..., 0, :].copy()
        b = y[..., 1, :]
        y[..., 0, :] = a + b
        y[..., 1, :] = a - b
        h *= 2
    return np.moveaxis(y.reshape(*lead, d), -1, axis)


def _signs_for(d: int, signs) -> np.ndarray | None:
    if signs is None:
        return rht_signs(d)
    if isinstance(signs, str) and signs == "none":
        return None
    s = np.asarray(signs, dtype=np.float64)
    if s.shape != (d,):
        raise ValueError(f"signs: expected shape ({d},), got {s.shape}")
    if not np.all(np.abs(s) == 1.0):
        raise ValueError("signs: expected entries of ±1")
    return s


def rht(x: np.ndarray, signs=None) -> np.ndarray:
    """Randomized Hadamard transform ``y = H · (s ⊙ x)`` along the last axis.

    x: ``(..., d)``, any real dtype, ``d`` in :data:`SUPPORTED_HEAD_SIZES`.
    signs: ``None`` for vLLM's sign vector, ``"none"`` for a plain WHT, or a
    ±1 array of shape ``(d,)``. Returns float64 ``(..., d)``; ``‖y‖ = √d ‖x‖``.
    """
    x = np.asarray(x)
    checks.check_last_dim_in(x, "x", SUPPORTED_HEAD_SIZES)
    s = _signs_for(x.shape[-1], signs)
    xs = x.astype(np.float64) if s is None else x.astype(np.float64) * s
    return wht(xs)


def inverse_rht(y: np.ndarray, signs=None) -> np.ndarray:
    """Inverse of :func:`rht`: ``x = s ⊙ (H · y) / d`` along the last axis (float64)."""
    y = np.asarray(y)
    checks.check_last_dim_in(y, "y", SUPPORTED_HEAD_SIZES)
    d = y.shape[-1]
    s = _signs_for(d, signs)
    x = wht(y) / d
    return x if s is None else x * s
