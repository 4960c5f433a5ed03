"""Scalar rounding rules the formats name."""
from __future__ import annotations

import numpy as np


def round_half_away(v) -> np.ndarray:
    """Round to nearest, ties away from zero (C ``roundf``), exactly, float64 result.

    ``floor(|v| + 0.5)`` is wrong for the float just below 0.5 (the addition
    rounds up), so round half-to-even first and then fix the exact ties.
    """
    v = np.asarray(v, dtype=np.float64)
    r = np.round(v)
    t = np.trunc(v)
    tie = np.abs(v - t) == 0.5
    return np.where(tie, t + np.sign(v), r)
