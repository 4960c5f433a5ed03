"""The plan's resident-CTA count against the CUDA driver's occupancy calculator.

The decode work lists are cut for the CTAs that fit on the GPU at once (``_resident_paged_ctas``,
``_resident_ctas`` -> ``ctas_per_sm``): one too many per SM and the last CTAs wait for a second
wave (session 24 measured it at 9 / 3 heads: 108 of 768 CTAs started ~20 µs late, because the
whole-SM register quotient said 6 CTAs of 3 warps where the sub-partitions hold 5). Here every
decode kernel a plan can launch — each format and head size, the paged kernel with 1 … 8 warps per
half in both CTA forms with the plan's own shared memory, and the per-head kernel — is asked of
the driver (``cuOccupancyMaxActiveBlocksPerMultiprocessor``), and ``ctas_per_sm`` must give the
same number. Exact equality: both are counts.
"""
import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from kvlab.cuda import attention as A  # noqa: E402
from kvlab.cuda.loader import get_kernel  # noqa: E402

T = "bfloat16"   # the q dtype the plans pass (arrays.dtype_name)


def _driver_ctas(kernel, spec, dev, threads, dyn_smem):
    from cupy_backends.cuda.api import driver

    A._raise_dynamic_smem(kernel, spec, dev, dyn_smem)
    with cupy.cuda.Device(dev):
        fn = getattr(kernel, "kernel", kernel)   # cupy.RawKernel -> its cupy.cuda.function.Function
        return driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, threads, dyn_smem)


def _sm90(dev):
    return A._compute_capability(dev) >= 90


@pytest.mark.parametrize("fmt", sorted(A.FORMAT_CODES))
@pytest.mark.parametrize("d", sorted(A.HEAD_SIZES))
def test_paged_decode_ctas_match_the_driver(fmt, d):
    dev = cupy.cuda.Device().id
    if not _sm90(dev):
        pytest.skip("the paged decode kernel runs on sm_90")
    code = A.FORMAT_CODES[fmt]
    n_sm, smem_sm = A._device_props(dev)
    checked = 0
    for nh in (1, 2):
        if nh == 2 and (code not in A.PG_DUAL_CODES or d not in A.PG_DUAL_HEAD_SIZES):
            continue
        spec = A._paged_spec(code, d, T, nh)
        kernel = get_kernel(spec, dev)
        for ny in range(1, A.PG_MAXW + 1):   # one KV head per warp (G = 1): ny = num_kv_heads
            nbuf, note = A._paged_buffers(code, d, ny, ny, dev, nh)
            if not nbuf:
                continue
            smem = A.paged_smem_bytes(code, d, ny, ny, nbuf, nh)
            want = _driver_ctas(kernel, spec, dev, nh * ny * 32, smem)
            got = A.ctas_per_sm(int(kernel.num_regs), nh * ny, int(kernel.shared_size_bytes) + smem, smem_sm)
            assert got == want, (f"{fmt} d={d} nh={nh} ny={ny}: ctas_per_sm {got}, driver {want} "
                                 f"({kernel.num_regs} registers, {smem} B dynamic shared memory)")
            assert A._resident_paged_ctas(spec, dev, nh * ny, smem) == n_sm * want
            checked += 1
    assert checked >= 1


@pytest.mark.parametrize("fmt", sorted(A.FORMAT_CODES))
@pytest.mark.parametrize("d", sorted(A.HEAD_SIZES))
def test_per_head_decode_ctas_match_the_driver(fmt, d):
    dev = cupy.cuda.Device().id
    spec = A._decode_spec(A.FORMAT_CODES[fmt], d, T)
    kernel = get_kernel(spec, dev)
    n_sm, smem_sm = A._device_props(dev)
    want = _driver_ctas(kernel, spec, dev, A.NW * 32, 0)
    assert A.ctas_per_sm(int(kernel.num_regs), A.NW, int(kernel.shared_size_bytes), smem_sm) == want
    assert A._resident_ctas(spec, dev) == n_sm * want
