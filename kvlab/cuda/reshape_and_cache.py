"""Family module of ``kernels_cu/reshape_and_cache.cu`` (the loader imports ``kvlab.cuda.<family>``).

The op and its instantiation list live in :mod:`kvlab.cuda.cache`, beside ``dequantize_cache``.
"""
from .cache import WRITE_SPECS as SPECS, reshape_and_cache  # noqa: F401  (registers the family)
