"""Registers / stack / spills of the decode kernels as compiled by *this machine's* NVRTC (the GPU
machine's NVRTC can differ from the pip one), for sm_90."""
from kvlab.cuda import loader
import kvlab.cuda.attention  # noqa: F401  (registers the family)
from cupy.cuda import nvrtc

print("nvrtc", nvrtc.getVersion())
for r in loader.compile_family_offline("paged_attention", "sm_90"):
    if "decode" in r.name_expression and "bfloat16" in r.name_expression:
        print(f"{r.name_expression:52s} regs {r.registers:3d} stack {r.stack_frame:4d} spill {r.spill_stores}/{r.spill_loads}")
