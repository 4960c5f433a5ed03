"""Nibble pack/unpack: reference (kvlab/reference/nibble.py) and the GPU kernel (kernels_cu/nibble.cu)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays as np_arrays

from kvlab.reference.nibble import pack_nibbles, unpack_nibbles


def test_hand_case():
    codes = np.array([0x1, 0xA, 0xF, 0x0, 0x3, 0x7], np.uint8)
    # element 2i low nibble, 2i+1 high nibble
    np.testing.assert_array_equal(pack_nibbles(codes), [0xA1, 0x0F, 0x73])
    np.testing.assert_array_equal(unpack_nibbles(np.array([0xA1, 0x0F, 0x73], np.uint8)), codes)


@settings(max_examples=100, deadline=None)
@given(np_arrays(np.uint8, st.tuples(st.integers(0, 4), st.integers(1, 40).map(lambda n: 2 * n)),
                 elements=st.integers(0, 15)))
def test_pack_unpack_identity(codes):
    np.testing.assert_array_equal(unpack_nibbles(pack_nibbles(codes)), codes)


@settings(max_examples=50, deadline=None)
@given(np_arrays(np.uint8, st.integers(1, 64)))
def test_unpack_pack_identity(packed):
    np.testing.assert_array_equal(pack_nibbles(unpack_nibbles(packed)), packed)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="codes: expected values in"):
        pack_nibbles(np.array([16, 0], np.uint8))
    with pytest.raises(ValueError, match="codes: expected an even"):
        pack_nibbles(np.array([1, 2, 3], np.uint8))
    with pytest.raises(TypeError, match="codes: expected an integer"):
        pack_nibbles(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="packed: expected dtype"):
        unpack_nibbles(np.array([1, 2], np.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 2), (7, 130), (3, 5, 64), (1 << 20,)])
def test_gpu_matches_reference(shape, rng):
    import cupy as cp

    from kvlab.cuda import nibble

    codes = rng.integers(0, 16, size=shape, dtype=np.uint8)
    packed = nibble.pack_nibbles(cp.asarray(codes))
    assert isinstance(packed, cp.ndarray)
    np.testing.assert_array_equal(packed.get(), pack_nibbles(codes))  # bit-exact
    np.testing.assert_array_equal(nibble.unpack_nibbles(packed).get(), codes)


@pytest.mark.gpu
def test_gpu_torch_roundtrip(rng):
    torch = pytest.importorskip("torch")
    from kvlab.cuda import nibble

    codes = torch.from_numpy(rng.integers(0, 16, size=(33, 128), dtype=np.uint8)).cuda()
    packed = nibble.pack_nibbles(codes)
    assert isinstance(packed, torch.Tensor) and packed.is_cuda
    np.testing.assert_array_equal(packed.cpu().numpy(), pack_nibbles(codes.cpu().numpy()))
    assert torch.equal(nibble.unpack_nibbles(packed), codes)


@pytest.mark.gpu
def test_gpu_rejects_bad_input():
    import cupy as cp

    from kvlab.cuda import nibble

    with pytest.raises(TypeError, match="codes: expected dtype"):
        nibble.pack_nibbles(cp.zeros((4,), cp.int32))
    with pytest.raises(ValueError, match="codes: expected a C-contiguous"):
        nibble.pack_nibbles(cp.zeros((4, 8), cp.uint8)[:, ::2])
