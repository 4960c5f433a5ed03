"""The one kernel loader: ``kernels_cu/<family>.cu`` → ``cupy.RawModule``, cached.

* Sources are read from the installed package (``kvlab/kernels_cu/`` inside the
  wheel) or, in a source checkout, from the repository's ``kernels_cu/``.
* ``#line 1 "kernels_cu/<file>"`` is prepended so NVRTC errors name the real file.
* A hash of every ``*.cuh`` header is folded into the source text, because
  CuPy's compile cache keys on the source and options but not on headers
  pulled in with ``-I``: without it an edited header would reuse a stale binary.
* Template instantiations form a closed list per family (:class:`KernelSpec`),
  compiled through ``name_expressions``; the module is cached per device.
* :func:`compile_family_offline` drives NVRTC for an explicit ``sm_XX`` without a
  GPU (CI, ``python -m kvlab check``) and reports registers and spills.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.resources
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

#: dtype name → C++ type used in template arguments
C_TYPES = {
    "bfloat16": "__nv_bfloat16",
    "float16": "__half",
    "float32": "float",
    "uint8": "uint8_t",
    "int32": "int",
    "int64": "long long",
}

#: every kernel family: kernels_cu/<family>.cu ↔ kvlab/cuda/<family>.py
FAMILIES: dict[str, list] = {}


@dataclass(frozen=True)
class KernelSpec:
    """One template instantiation: ``kernel<params...>`` in ``kernels_cu/<family>.cu``.

    params: ints (rendered as they are), bools (``true``/``false``) or dtype
    names (rendered through :data:`C_TYPES`), or raw C++ tokens wrapped in
    :class:`Raw`.
    """

    family: str
    kernel: str
    params: tuple = ()

    def name_expression(self) -> str:
        if not self.params:
            return self.kernel
        return f"{self.kernel}<{', '.join(_render(p) for p in self.params)}>"


@dataclass(frozen=True)
class Raw:
    token: str


def _render(p) -> str:
    if isinstance(p, bool):
        return "true" if p else "false"
    if isinstance(p, int):
        return str(p)
    if isinstance(p, Raw):
        return p.token
    if isinstance(p, str) and p in C_TYPES:
        return C_TYPES[p]
    raise ValueError(f"template parameter: cannot render {p!r}")


def register(family: str, specs) -> list:
    """Declare the closed list of instantiations of one family (called by kvlab/cuda/<family>.py)."""
    specs = list(specs)
    for s in specs:
        if s.family != family:
            raise ValueError(f"spec {s} registered under family {family!r}")
    FAMILIES[family] = specs
    return specs


def kernels_dir() -> Path:
    """Folder of the ``.cu``/``.cuh`` sources: inside the installed package, else the checkout's."""
    installed = Path(str(importlib.resources.files("kvlab"))) / "kernels_cu"
    if installed.is_dir():
        return installed
    checkout = Path(__file__).resolve().parents[2] / "kernels_cu"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(
        f"kernels_cu/ not found (looked in {installed} and {checkout}); "
        "the wheel must ship kvlab/kernels_cu/"
    )


def headers_hash() -> str:
    h = hashlib.sha256()
    for p in sorted(kernels_dir().glob("*.cuh")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def read_source(family: str) -> str:
    path = kernels_dir() / f"{family}.cu"
    if not path.is_file():
        raise FileNotFoundError(f"kernel family {family!r}: {path} does not exist")
    return (
        f"// kvlab headers sha256:{headers_hash()}\n"
        f'#line 1 "kernels_cu/{family}.cu"\n' + path.read_text()
    )


def cuda_include_dirs() -> list[str]:
    """CUDA headers (cuda_bf16.h, cuda_fp8.h …) from the pip wheels, if present."""
    dirs = []
    try:
        from cuda import pathfinder

        d = pathfinder.find_nvidia_header_directory("cudart")
        if d:
            dirs.append(str(d))
    except Exception:  # pathfinder missing or no pip headers: CuPy's own search applies
        pass
    return dirs


def compile_options() -> tuple:
    """NVRTC options: C++17, the kernels and CUDA include folders, plus ``KVLAB_NVRTC_OPTIONS``.

    ``KVLAB_NVRTC_OPTIONS`` (space-separated, e.g. ``-lineinfo`` for profiling or a ``-D`` of a
    tuning macro) is part of CuPy's cache key, so changing it recompiles.
    """
    # -default-device: unannotated functions (e.g. the operator() of a generic lambda inside a
    # kernel) are device functions; NVRTC 13.0 rejects them as host functions without it.
    opts = ["-std=c++17", "-default-device", f"-I{kernels_dir()}"]
    opts += [f"-I{d}" for d in cuda_include_dirs()]
    opts += os.environ.get("KVLAB_NVRTC_OPTIONS", "").split()
    return tuple(opts)


def _ensure_family(family: str) -> list:
    if family not in FAMILIES:
        import importlib

        importlib.import_module(f"kvlab.cuda.{family}")
    if family not in FAMILIES:
        raise KeyError(f"kernel family {family!r} registered no instantiations")
    return FAMILIES[family]


@functools.cache
def _module(family: str, device_id: int):
    import cupy

    specs = _ensure_family(family)
    with cupy.cuda.Device(device_id):
        return cupy.RawModule(
            code=read_source(family),
            options=compile_options(),
            name_expressions=[s.name_expression() for s in specs],
        )


def get_kernel(spec: KernelSpec, device_id: int | None = None):
    """The compiled ``cupy.RawKernel`` of one instantiation (compiled once per device)."""
    import cupy

    if spec not in _ensure_family(spec.family):
        raise ValueError(
            f"{spec.name_expression()} is not in the instantiation list of {spec.family!r}; "
            f"supported: {[s.name_expression() for s in FAMILIES[spec.family]]}"
        )
    dev = cupy.cuda.runtime.getDevice() if device_id is None else device_id
    return _module(spec.family, dev).get_function(spec.name_expression())


# ---------------------------------------------------------------- offline compile (no GPU)
@dataclass
class CompileReport:
    family: str
    arch: str
    name_expression: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    shared_bytes: int


_PTXAS_FN = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def compile_family_offline(family: str, arch: str = "sm_90") -> list[CompileReport]:
    """Compile every instantiation of ``family`` to a cubin for ``arch`` with NVRTC, no GPU needed.

    Raises ``cupy.cuda.compiler.CompileException`` (with NVRTC's log) on errors.
    """
    from cupy.cuda import compiler

    specs = _ensure_family(family)
    exprs = [s.name_expression() for s in specs]
    prog = compiler._NVRTCProgram(read_source(family), f"{family}.cu", name_expressions=exprs,
                                  method="cubin")
    log = io.StringIO()
    # -ftz=true: CuPy adds it to every run-time compile, so the offline build matches
    opts = compile_options() + (f"-arch={arch}", "-ftz=true", "--ptxas-options=-v")
    _, mapping = prog.compile(opts, log_stream=log)
    lowered_to_expr = {v: k for k, v in (mapping or {}).items()}
    reports, current = [], None
    for line in log.getvalue().splitlines():
        m = _PTXAS_FN.search(line)
        if m:
            current = CompileReport(family, m.group(2), lowered_to_expr.get(m.group(1), m.group(1)),
                                    0, 0, 0, 0, 0)
            reports.append(current)
            continue
        if current is None:
            continue
        m = _PTXAS_SPILL.search(line)
        if m:
            current.stack_frame, current.spill_stores, current.spill_loads = map(int, m.groups())
        m = _PTXAS_REGS.search(line)
        if m:
            current.registers = int(m.group(1))
            if m.group(2):
                current.shared_bytes = int(m.group(2))
    # keep only entry points we asked for (ptxas also reports device functions in some modes)
    return [r for r in reports if r.name_expression in exprs]


def all_families() -> list[str]:
    """Families with a ``.cu`` file in ``kernels_cu/``."""
    return sorted(p.stem for p in kernels_dir().glob("*.cu"))
