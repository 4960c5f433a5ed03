"""CUDA backend: Python ops over ``kernels_cu/`` (one module per kernel family, same name)."""
from .loader import KernelSpec, get_kernel, kernels_dir

__all__ = ["KernelSpec", "get_kernel", "kernels_dir"]
