"""GPU paged-cache ops: ``reshape_and_cache`` and ``dequantize_cache`` for every format.

Kernels: ``kernels_cu/reshape_and_cache.cu`` and ``kernels_cu/dequantize_cache.cu``
(instantiation lists registered here; ``kvlab/cuda/reshape_and_cache.py`` and
``kvlab/cuda/dequantize_cache.py`` are the family modules the loader imports).
Reference: :mod:`kvlab.reference.cache`, same signatures.

Arrays: CuPy arrays or torch CUDA tensors (zero-copy; outputs of the same kind).
CuPy has no bf16 dtype, so bf16 comes as torch tensors.
"""
from __future__ import annotations

import functools
import os

from .. import arrays, validate
from ..formats import get_format
from . import launch as L
from .loader import KernelSpec, get_kernel, register

THREADS = 256
HEAD_SIZES = (16, 32, 64, 128, 256, 512)
DTYPES = ("bfloat16", "float16", "float32")
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
#: format name -> FMT_* id in kernels_cu/quant_formats.cuh
FORMAT_IDS = {
    "auto": 0,
    "int8_per_token_head": 1,
    "fp8_per_token_head": 2,
    "int4_per_token_head": 3,
    "nvfp4": 4,
}


def _write_spec(fmt_name: str, d: int, dtype: str, swizzle: bool) -> KernelSpec:
    return KernelSpec("reshape_and_cache", "reshape_and_cache", (FORMAT_IDS[fmt_name], d, dtype, swizzle))


def _read_spec(fmt_name: str, d: int, cache_dtype: str, swizzle: bool) -> KernelSpec:
    t = cache_dtype if fmt_name == "auto" else "uint8"
    return KernelSpec("dequantize_cache", "dequantize_cache", (FORMAT_IDS[fmt_name], d, t, swizzle))


WRITE_SPECS = register("reshape_and_cache", [
    _write_spec(f, d, dt, sw)
    for f in FORMAT_IDS for d in HEAD_SIZES for dt in DTYPES
    for sw in ((False, True) if f == "nvfp4" and d >= 64 else (False,))
])

PROBE_ENCODE = KernelSpec("dequantize_cache", "fp_codecs_encode_probe")
PROBE_DECODE = KernelSpec("dequantize_cache", "fp_codecs_decode_probe")
READ_SPECS = register("dequantize_cache", [
    _read_spec(f, d, dt, sw)
    for f in FORMAT_IDS for d in HEAD_SIZES
    for dt in (DTYPES if f == "auto" else ("uint8",))
    for sw in ((False, True) if f == "nvfp4" and d >= 64 else (False,))
] + [PROBE_ENCODE, PROBE_DECODE])


def _lanes(d: int, itemsize: int) -> int:
    """Lanes per head vector, as ``RowGeometry`` in ``kernels_cu/quant_formats.cuh``."""
    return max(1, min(32, d // (16 // itemsize)))


#: the NVRTC macro that switches the int4 write to its tensor-core RHT (kernels_cu/int4_write_mma.cuh)
INT4_WRITE_MMA_MACRO = "KVLAB_INT4_WRITE_MMA"


def int4_write_mma_enabled(options=None) -> bool:
    """Whether the write kernels are compiled with ``-DKVLAB_INT4_WRITE_MMA``.

    Reads ``KVLAB_NVRTC_OPTIONS`` (the only user-set part of the loader's NVRTC options), or
    ``options`` (a sequence of option strings) when given. The kernel tests
    ``#if defined(KVLAB_INT4_WRITE_MMA)``, so any value counts (``-DKVLAB_INT4_WRITE_MMA=0`` too).
    The switch changes the launch geometry (:func:`_write_lanes`), so set the variable before the
    first write kernel is compiled in the process and leave it: a module already compiled keeps
    the options it was compiled with. Every write asks this, so the environment's answer is
    cached per value of the variable (the loader's full option list costs ~0.5 ms to build).
    """
    if options is None:
        return _mma_macro_in(os.environ.get("KVLAB_NVRTC_OPTIONS", ""))
    return _has_mma_macro(tuple(options))


@functools.lru_cache(maxsize=8)
def _mma_macro_in(env_options: str) -> bool:
    return _has_mma_macro(tuple(env_options.split()))


def _has_mma_macro(opts: tuple) -> bool:
    for o in opts:
        for prefix in ("-D", "--define-macro="):
            if o.startswith(prefix):
                name = o[len(prefix):].split("=", 1)[0]
                if name == INT4_WRITE_MMA_MACRO:
                    return True
    return False


def int4_write_uses_mma(fmt_name: str, d: int, itemsize: int, enabled: bool | None = None) -> bool:
    """Whether this write takes the tensor-core int4 path — ``int4_write_uses_mma`` in
    kernels_cu/reshape_and_cache.cu: the switch on, int4, 16-bit input, d = 64 or 128."""
    if enabled is None:
        enabled = int4_write_mma_enabled()
    return enabled and fmt_name == "int4_per_token_head" and itemsize == 2 and d in (64, 128)


def _write_lanes(fmt_name: str, d: int, itemsize: int) -> int:
    """Threads per (token, head) of the write kernel (kernels_cu/reshape_and_cache.cu):
    ``Int4Geometry`` (up to 32 elements per lane) for int4, ``WriteGeometry`` otherwise — two
    16-element scale groups per lane for nvfp4 (one at d = 16), four 16-byte chunks per lane
    (at least 1 and at most 32 lanes) for auto/int8/fp8. The tensor-core int4 path
    (:func:`int4_write_uses_mma`) runs a warp per 16 rows: 2 threads per row (the grid rounds
    up to whole blocks, so a partial last warp exists and its missing rows are skipped)."""
    if int4_write_uses_mma(fmt_name, d, itemsize):
        return 2
    if fmt_name in ("int4_per_token_head", "nvfp4"):
        return d // min(d, 32)
    return max(1, min(32, d // (16 // itemsize) // 4))


def _rows(x):
    """``x`` ``(T, H, d)`` as (array, token stride in elements) the kernel can read with 16-byte loads.

    Zero-copy when the (H, d) part is contiguous and rows are 16-byte aligned (e.g. K/V
    sliced out of a fused QKV tensor); otherwise a contiguous copy.
    """
    T, H, d = arrays.shape(x)
    item = _ITEMSIZE[arrays.dtype_name(x)]
    if arrays.kind(x) == "torch":
        st = tuple(x.stride())
    else:
        st = tuple(s // item for s in x.strides)
    ok = (st[2] == 1 and (H == 1 or st[1] == d) and (st[0] * item) % 16 == 0
          and int(L.ptr(x)) % 16 == 0)
    if ok:
        return x, st[0] if T > 1 else H * d
    # always a fresh allocation: .contiguous() / ascontiguousarray return a contiguous view as it
    # is, and one that starts off a 16-byte boundary would then reach the kernel's 16-byte loads
    if arrays.kind(x) == "torch":
        import torch
        x = x.clone(memory_format=torch.contiguous_format)
    else:
        import cupy
        x = cupy.array(x, copy=True, order="C")
    return x, H * d


def _slots_int64(slot_mapping):
    if arrays.dtype_name(slot_mapping) == "int64":
        return slot_mapping
    if arrays.kind(slot_mapping) == "torch":
        import torch
        return slot_mapping.to(torch.int64)
    return slot_mapping.astype("int64")


def launch_reshape_and_cache(key, value, kv_cache, slot_mapping, fmt, k_scale: float = 1.0,
                             v_scale: float = 1.0) -> None:
    """No-validation launcher (benchmarks, callers that validated already).

    ``fmt``: a :class:`~kvlab.formats.base.CacheFormat`; arguments as in
    :func:`reshape_and_cache`, assumed valid.
    """
    T, H, d = arrays.shape(key)
    if T == 0:
        return
    block_size = arrays.shape(kv_cache)[2]
    dt = arrays.dtype_name(key)
    swizzle = bool(getattr(fmt, "swizzle_v_scales", False))
    spec = _write_spec(fmt.name, d, dt, swizzle)
    key, ks = _rows(key)
    value, vs = _rows(value)
    slots = _slots_int64(slot_mapping)
    lanes = _write_lanes(fmt.name, d, _ITEMSIZE[dt])
    grid = -(-(T * H * lanes) // THREADS)
    with L.stream_of(kv_cache):
        k = get_kernel(spec, arrays.device_id(kv_cache))
        L.launch(k, (grid,), (THREADS,), (
            L.ptr(key), L.ptr(value), L.i64(ks), L.i64(vs), L.ptr(kv_cache), L.ptr(slots),
            L.i64(T), L.i32(H), L.i32(block_size), L.f32(k_scale), L.f32(v_scale)))


def reshape_and_cache(key, value, kv_cache, slot_mapping, kv_cache_dtype="auto", k_scale=1.0,
                      v_scale=1.0) -> None:
    """Quantize ``key``/``value`` and write them into ``kv_cache`` at ``slot_mapping`` (in place), one pass.

    key, value: ``(num_tokens, num_kv_heads, head_size)`` bf16/fp16/float32 (the (heads, d)
    part contiguous; other layouts are copied first). kv_cache: C-contiguous
    ``(num_blocks, 2, block_size, num_kv_heads, row)`` uint8 (the key dtype for ``auto``).
    slot_mapping: int64 (or int32) ``(num_tokens,)``, negative = skip (row untouched).
    k_scale, v_scale: nvfp4's global dequantization scales (ignored by other formats).
    ``kv_cache_dtype`` may be ``kvlab.get_format("nvfp4", swizzle_v_scales=True)``.
    Duplicate slots: which token wins is unspecified (the reference keeps the last).
    """
    fmt, dims, backend, ks, vs = validate.check_reshape_and_cache(
        key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    if backend != "cuda":
        raise TypeError("kvlab.cuda.cache.reshape_and_cache takes CuPy arrays or torch CUDA tensors; "
                        "use kvlab.reshape_and_cache for NumPy")
    launch_reshape_and_cache(key, value, kv_cache, slot_mapping, fmt, ks, vs)


def launch_dequantize_cache(kv_cache, fmt, k_out, v_out, k_scale: float = 1.0, v_scale: float = 1.0):
    """No-validation launcher: fills float32 ``k_out``/``v_out`` ``(num_blocks, block_size, H, d)``."""
    nb, _, bs, H, _ = arrays.shape(kv_cache)
    d = arrays.shape(k_out)[-1]
    cdt = arrays.dtype_name(kv_cache)
    swizzle = bool(getattr(fmt, "swizzle_v_scales", False))
    spec = _read_spec(fmt.name, d, cdt, swizzle)
    itemsize = _ITEMSIZE[cdt] if fmt.name == "auto" else 2
    rows = nb * 2 * bs * H
    grid = -(-(rows * _lanes(d, itemsize)) // THREADS)
    with L.stream_of(kv_cache):
        k = get_kernel(spec, arrays.device_id(kv_cache))
        L.launch(k, (grid,), (THREADS,), (
            L.ptr(kv_cache), L.ptr(k_out), L.ptr(v_out), L.i64(nb), L.i32(bs), L.i32(H),
            L.f32(k_scale), L.f32(v_scale)))


def dequantize_cache(kv_cache, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    """Whole cache → ``(k, v)``, each float32 ``(num_blocks, block_size, num_kv_heads, head_size)``, same kind.

    Bit-exact with :func:`kvlab.reference.cache.dequantize_cache` (see the kernel's header).
    """
    fmt = get_format(kv_cache_dtype)
    dims = validate.check_kv_cache(kv_cache, fmt)
    ks = validate.check_global_scale(k_scale, "k_scale")
    vs = validate.check_global_scale(v_scale, "v_scale")
    if arrays.kind(kv_cache) not in ("cupy", "torch"):
        raise TypeError("kvlab.cuda.cache.dequantize_cache takes a CuPy array or torch CUDA tensor; "
                        "use kvlab.dequantize_cache for NumPy")
    shape = (dims.num_blocks, dims.block_size, dims.num_kv_heads, dims.head_size)
    k = L.empty(kv_cache, shape, "float32")
    v = L.empty(kv_cache, shape, "float32")
    launch_dequantize_cache(kv_cache, fmt, k, v, ks, vs)
    return k, v


def codec_probe(x):
    """E2M1, E4M3 and paired-E4M3 (``e4m3x2_encode``, the fp8 write path) codes of float32 ``x``
    (CuPy/torch, contiguous) by the device codecs (tests)."""
    n = 1
    for s in arrays.shape(x):
        n *= s
    c2 = L.empty(x, arrays.shape(x), "uint8")
    c4 = L.empty(x, arrays.shape(x), "uint8")
    c4x2 = L.empty(x, arrays.shape(x), "uint8")
    if n:
        with L.stream_of(x):
            k = get_kernel(PROBE_ENCODE, arrays.device_id(x))
            L.launch(k, (-(-n // THREADS),), (THREADS,),
                     (L.ptr(x), L.ptr(c2), L.ptr(c4), L.ptr(c4x2), L.i64(n)))
    return c2, c4, c4x2


def codec_tables(like):
    """Values of every E2M1 code (16) and E4M3 byte (256) by the device decoders (tests)."""
    t2 = L.empty(like, (16,), "float32")
    t4 = L.empty(like, (256,), "float32")
    with L.stream_of(like):
        k = get_kernel(PROBE_DECODE, arrays.device_id(like))
        L.launch(k, (1,), (256,), (L.ptr(t2), L.ptr(t4)))
    return t2, t4
