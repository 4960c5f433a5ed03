"""Family module of ``kernels_cu/dequantize_cache.cu`` (the loader imports ``kvlab.cuda.<family>``).

The op and its instantiation list live in :mod:`kvlab.cuda.cache`, beside ``reshape_and_cache``.
"""
from .cache import READ_SPECS as SPECS, dequantize_cache  # noqa: F401  (registers the family)
