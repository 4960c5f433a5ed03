"""Family module of ``kernels_cu/paged_prefill.cu`` (the loader imports ``kvlab.cuda.<family>``).

The op itself lives in :mod:`kvlab.cuda.attention`; importing it registers the family.
"""
from .attention import PREFILL_SPECS, paged_attention, plan_paged_attention  # noqa: F401
