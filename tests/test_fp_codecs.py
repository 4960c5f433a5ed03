"""E2M1 / E4M3 reference codecs (kvlab/reference/fp_codecs.py): ties, saturation, signed zero, subnormals."""
import numpy as np
import pytest

from kvlab.reference.fp_codecs import e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode


@pytest.mark.parametrize(
    "x, code",
    [
        (0.0, 0x0), (0.5, 0x1), (1.0, 0x2), (1.5, 0x3), (2.0, 0x4), (3.0, 0x5), (4.0, 0x6), (6.0, 0x7),
        # ties go to the even mantissa
        (0.25, 0x0),   # 0 | 0.5 -> 0
        (0.75, 0x2),   # 0.5 | 1.0 -> 1.0
        (1.25, 0x2),   # 1.0 | 1.5 -> 1.0
        (1.75, 0x4),   # 1.5 | 2.0 -> 2.0
        (2.5, 0x4),    # 2 | 3 -> 2
        (3.5, 0x6),    # 3 | 4 -> 4
        (5.0, 0x6),    # 4 | 6 -> 4
        (5.0001, 0x7),
        # saturation to ±6
        (6.5, 0x7), (7.0, 0x7), (1e30, 0x7), (np.inf, 0x7), (-7.0, 0xF), (-np.inf, 0xF),
        # signed zero: the sign survives rounding to zero
        (-0.0, 0x8), (-0.1, 0x8), (-0.25, 0x8), (0.1, 0x0),
        (-0.75, 0xA), (-2.5, 0xC), (-5.0, 0xE),
    ],
)
def test_e2m1_encode(x, code):
    assert int(e2m1_encode(np.float64(x))) == code


def test_e2m1_decode_table():
    np.testing.assert_array_equal(
        e2m1_decode(np.arange(16)),
        [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
    )
    assert np.signbit(e2m1_decode(np.array([8]))[0])


@pytest.mark.parametrize(
    "x, byte",
    [
        (1.0, 0x38), (-1.0, 0xB8), (0.0, 0x00), (-0.0, 0x80),
        (448.0, 0x7E), (-448.0, 0xFE),
        (464.0, 0x7E),     # tie between 448 and 480 (not finite in e4m3fn): RNE -> 448
        (480.0, 0x7E), (500.0, 0x7E), (1e9, 0x7E), (np.inf, 0x7E), (-1e9, 0xFE),  # saturation
        (2.0**-9, 0x01),   # smallest subnormal
        (2.0**-10, 0x00),  # tie between 0 and 2^-9 -> even (0)
        (3 * 2.0**-10, 0x02),  # tie between 2^-9 and 2^-8 -> even (2^-8)
        (2.0**-6, 0x08),   # smallest normal
        (7 * 2.0**-9, 0x07),  # largest subnormal
        (1.0625, 0x38),    # tie 1.0 | 1.125 -> 1.0 (even)
        (1.1875, 0x3A),    # tie 1.125 | 1.25 -> 1.25 (even)
    ],
)
def test_e4m3_encode(x, byte):
    assert int(e4m3_encode(np.float64(x))) == byte


def test_e4m3_nan_and_roundtrip():
    assert int(e4m3_encode(np.nan)) & 0x7F == 0x7F
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    np.testing.assert_array_equal(e4m3_encode(e4m3_decode(codes)), codes)
    assert e4m3_decode(np.array([0x7E]))[0] == 448.0
    assert e4m3_decode(np.array([0x01]))[0] == 2.0**-9
