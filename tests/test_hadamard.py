"""Reference WHT / RHT (kvlab/reference/hadamard.py). GPU kernel tests: tests/gpu/test_hadamard_gpu.py."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvlab.reference import hadamard as hd


def test_sign_vector_matches_torch_generator():
    """The shipped signs are vLLM's: torch.bernoulli with a CPU generator seeded 0x9E3779B9."""
    torch = pytest.importorskip("torch")
    g = torch.Generator()
    g.manual_seed(0x9E3779B9)
    s = 2 * torch.bernoulli(torch.full((512,), 0.5), generator=g) - 1
    np.testing.assert_array_equal(hd.rht_signs(512), s.numpy().astype(np.float64))
    # shorter head sizes are prefixes
    for d in hd.SUPPORTED_HEAD_SIZES:
        np.testing.assert_array_equal(hd.rht_signs(d), hd.rht_signs(512)[:d])


def test_hadamard_matrix_hand_case():
    h4 = np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], float)
    np.testing.assert_array_equal(hd.hadamard_matrix(4), h4)
    np.testing.assert_array_equal(hd.wht(np.array([1.0, 2.0, 3.0, 4.0])), [10.0, -2.0, -4.0, 0.0])


@pytest.mark.parametrize("d", hd.SUPPORTED_HEAD_SIZES)
def test_wht_equals_matrix_and_is_involution_up_to_d(d, rng):
    x = rng.standard_normal((5, d))
    H = hd.hadamard_matrix(d)
    np.testing.assert_allclose(H @ H, d * np.eye(d))
    np.testing.assert_allclose(hd.wht(x), x @ H, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(hd.wht(hd.wht(x)) / d, x, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d", hd.SUPPORTED_HEAD_SIZES)
def test_rht_definition(d, rng):
    x = rng.standard_normal((3, d))
    s = hd.rht_signs(d)
    np.testing.assert_allclose(hd.rht(x), (x * s) @ hd.hadamard_matrix(d), rtol=1e-12, atol=1e-12)
    # ‖y‖ = √d ‖x‖ (H/√d is orthogonal)
    np.testing.assert_allclose(np.linalg.norm(hd.rht(x), axis=-1), np.sqrt(d) * np.linalg.norm(x, axis=-1))
    np.testing.assert_allclose(hd.rht(x, signs="none"), hd.wht(x), rtol=1e-12, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    d=st.sampled_from(hd.SUPPORTED_HEAD_SIZES),
    data=st.data(),
)
def test_rht_inverse_recovers_input(d, data):
    x = data.draw(arrays(np.float64, (2, d), elements=st.floats(-1e4, 1e4, allow_nan=False)))
    back = hd.inverse_rht(hd.rht(x))
    # float64 butterflies: log2(d) additions per element, error ≤ a few ulp of the row's max
    tol = 1e-12 * (np.abs(x).max() + 1.0) * d
    np.testing.assert_allclose(back, x, atol=tol, rtol=0)


def test_rht_rejects_bad_head_size():
    with pytest.raises(ValueError, match="head size"):
        hd.rht(np.zeros((2, 24)) + 1.0)
    with pytest.raises(ValueError, match="head_size"):
        hd.rht_signs(1024)
    with pytest.raises(ValueError, match="signs"):
        hd.rht(np.ones(16), signs=np.ones(8))
    with pytest.raises(ValueError, match="signs"):
        hd.rht(np.ones(16), signs=np.full(16, 0.5))
