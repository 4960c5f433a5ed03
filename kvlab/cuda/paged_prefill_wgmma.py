"""Family module of ``kernels_cu/paged_prefill_wgmma.cu`` (the loader imports ``kvlab.cuda.<family>``).

The Hopper ``wgmma`` prefill kernel, built for ``sm_90a`` only (``register(..., arch="sm_90a")``:
the loader compiles it with NVRTC itself, see :mod:`kvlab.cuda.loader`). The op lives in
:mod:`kvlab.cuda.attention` (``prefill_variant="wgmma"``); importing it registers the family.
"""
from .attention import PREFILL_WGMMA_SPECS, paged_attention, plan_paged_attention  # noqa: F401
