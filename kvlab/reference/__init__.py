"""NumPy references — the specification of every format and operation (float64 inside).

Each module mirrors a kernel family of ``kernels_cu/`` by name.
"""
from .attention import paged_attention
from .cache import dequantize_cache, dequantize_cache_float64, reshape_and_cache
from .fp_codecs import e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode
from .hadamard import inverse_rht, rht, rht_signs, wht
from .nibble import pack_nibbles, unpack_nibbles

__all__ = [
    "paged_attention", "reshape_and_cache", "dequantize_cache", "dequantize_cache_float64",
    "e2m1_encode", "e2m1_decode", "e4m3_encode", "e4m3_decode",
    "wht", "rht", "inverse_rht", "rht_signs", "pack_nibbles", "unpack_nibbles",
]
