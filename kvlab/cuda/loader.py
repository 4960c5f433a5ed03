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
  GPU (CI, ``python -m kvlab check``) and reports registers and spills; its reports and its
  cubin are kept on disk keyed on every input NVRTC sees, so the same build is compiled once (the
  check, then the test suite's spill and SASS tests, :func:`offline_cubin`), and any edit
  compiles afresh.
* A family registered with a fixed ``arch`` (``register(..., arch="sm_90a")``: the wgmma
  prefill kernel, whose ``wgmma``/``setmaxnreg`` instructions exist only for the
  architecture-specific target) is not built through ``cupy.RawModule``, which always adds
  its own ``-arch=sm_<device>``: the loader drives NVRTC itself to a cubin for that arch
  (cached on disk under CuPy's cache folder, keyed like CuPy's own cache on source + options
  + arch + NVRTC version), loads it with ``RawModule(path=...)`` and looks kernels up by the
  lowered names NVRTC reports for the name expressions. ``compile_family_offline`` and
  ``python -m kvlab check`` compile such a family for its arch only (:func:`family_archs`).
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
#: families that build for one fixed architecture only (e.g. "sm_90a"); the others follow the device
FAMILY_ARCH: dict[str, str] = {}


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


def register(family: str, specs, arch: str | None = None) -> list:
    """Declare the closed list of instantiations of one family (called by kvlab/cuda/<family>.py).

    ``arch`` (e.g. ``"sm_90a"``): the family compiles for that architecture only and runs only
    on devices of that compute capability (see the module docstring)."""
    specs = list(specs)
    for s in specs:
        if s.family != family:
            raise ValueError(f"spec {s} registered under family {family!r}")
    if arch is not None and not re.fullmatch(r"sm_\d{2,3}a?", arch):
        raise ValueError(f"arch: expected sm_<NN> or sm_<NN>a, got {arch!r}")
    FAMILIES[family] = specs
    if arch is not None:
        FAMILY_ARCH[family] = arch
    else:
        FAMILY_ARCH.pop(family, None)
    return specs


def family_arch(family: str) -> str | None:
    """The fixed architecture of ``family`` (``"sm_90a"``), or None if it builds for any device."""
    _ensure_family(family)
    return FAMILY_ARCH.get(family)


def family_archs(family: str, archs) -> tuple:
    """The architectures to compile ``family`` for when a check asks for ``archs``: its fixed
    arch alone if it has one, else ``archs``."""
    fixed = family_arch(family)
    return (fixed,) if fixed else tuple(archs)


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
    opts += user_options()
    return tuple(opts)


def user_options() -> tuple:
    """The ``KVLAB_NVRTC_OPTIONS`` part of :func:`compile_options` alone: a check of one switch
    (``"-DKVLAB_DECODE_NO_PDL" in user_options()``) without the folder lookups (~0.1 ms)."""
    return tuple(os.environ.get("KVLAB_NVRTC_OPTIONS", "").split())


def _ensure_family(family: str) -> list:
    if family not in FAMILIES:
        import importlib

        importlib.import_module(f"kvlab.cuda.{family}")
    if family not in FAMILIES:
        raise KeyError(f"kernel family {family!r} registered no instantiations")
    return FAMILIES[family]


@functools.cache
def _module(family: str, device_id: int):
    """(module, name expression -> name to look up): CuPy compiles the family for the device,
    or, for a fixed-arch family, :func:`_arch_module` does."""
    import cupy

    specs = _ensure_family(family)
    exprs = [s.name_expression() for s in specs]
    with cupy.cuda.Device(device_id):
        arch = FAMILY_ARCH.get(family)
        if arch is not None:
            return _arch_module(family, arch, device_id, exprs)
        mod = cupy.RawModule(code=read_source(family), options=compile_options(), name_expressions=exprs)
        return mod, {e: e for e in exprs}


def _check_device_arch(family: str, arch: str, device_id: int) -> None:
    import cupy

    cc = int(cupy.cuda.Device(device_id).compute_capability)
    want = int(re.fullmatch(r"sm_(\d+)a?", arch).group(1))
    if cc != want:
        raise RuntimeError(f"kernel family {family!r} is built for {arch} only (compute capability "
                           f"{want // 10}.{want % 10}); device {device_id} has compute capability "
                           f"{cc // 10}.{cc % 10}")


def _cache_base() -> Path:
    """CuPy's kernel cache folder (``CUPY_CACHE_DIR``, else ``~/.cupy/kernel_cache``): the loader's
    own caches (fixed-arch cubins, offline compile reports) live in subfolders of it."""
    return Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))


def _arch_module(family: str, arch: str, device_id: int, exprs: list):
    """NVRTC -> cubin for ``arch`` (disk-cached), loaded with ``cupy.RawModule(path=...)``."""
    import json

    import cupy
    from cupy.cuda import compiler, nvrtc

    _check_device_arch(family, arch, device_id)
    source = read_source(family)
    opts = compile_options() + (f"-arch={arch}", "-ftz=true")  # -ftz=true as CuPy's own compiles
    key = hashlib.sha256("\0".join([source, *opts, *sorted(exprs), str(nvrtc.getVersion()),
                                     cupy.__version__]).encode()).hexdigest()[:32]
    cache_dir = _cache_base() / "kvlab_arch"
    cubin_path, map_path = cache_dir / f"{family}-{arch}-{key}.cubin", cache_dir / f"{family}-{arch}-{key}.json"
    if not (cubin_path.is_file() and map_path.is_file()):
        prog = compiler._NVRTCProgram(source, f"{family}.cu", name_expressions=exprs, method="cubin")
        cubin, mapping = prog.compile(opts)
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cubin_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(_pad_elf(cubin))
        os.replace(tmp, cubin_path)
        tmp = map_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({e: mapping[e] for e in exprs}))
        os.replace(tmp, map_path)
    lowered = json.loads(map_path.read_text())
    return cupy.RawModule(path=str(cubin_path)), lowered


def _pad_elf(b: bytes) -> bytes:
    """CuPy's ``getCUBIN`` drops the image's last byte (it treats it like a C string); restore
    the length the ELF header implies (the lost byte is padding, zero)."""
    import struct

    if len(b) < 0x40 or b[:4] != b"\x7fELF":
        return b
    shoff, = struct.unpack_from("<Q", b, 0x28)
    phoff, = struct.unpack_from("<Q", b, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", b, 0x36)
    need = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
    return b + b"\0" * max(0, need - len(b))


def offline_cubin(family: str, exprs: list, arch: str, extra: tuple = ()) -> tuple[bytes, dict, str]:
    """NVRTC -> cubin of the instantiations ``exprs`` of ``family`` for ``arch``, without a GPU: the
    loader's options (``KVLAB_NVRTC_OPTIONS`` included), ``-ftz=true`` as at run time, then
    ``extra``. Returns (the cubin, padded as ``_pad_elf`` does; name expression -> lowered name; the
    compile log, where ``extra`` has ``--ptxas-options=-v`` the ptxas report). For the SASS tools
    (``scripts/sass_stats.py``) and the SASS tests.

    Disk-cached like :func:`compile_family_offline`'s reports, under the same key (every input NVRTC
    sees), so a build with ``extra=("--ptxas-options=-v",)`` and the family's whole instantiation
    list is the very compile that :func:`compile_family_offline` (``kvlab check``, the spill tests)
    already ran: answered from its cubin without a second NVRTC run. ``KVLAB_COMPILE_CACHE=0`` skips
    the read."""
    source = read_source(family)
    opts = compile_options() + (f"-arch={arch}", "-ftz=true") + tuple(extra)
    path = _cubin_cache_path(family, arch, source, opts, exprs)
    if compile_cache_enabled():
        hit = _load_cubin(path)
        if hit is not None:
            return hit
    cubin, log, mapping = _nvrtc_compile(family, source, opts, exprs)
    _store_cubin(path, cubin, mapping, log)
    return cubin, mapping, log


def nvdisasm_path() -> str | None:
    """nvdisasm on PATH or from the pip package ``nvidia-cuda-nvdisasm`` (13.x, the ``dev`` extra), or None."""
    import shutil

    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    try:
        import nvidia.cu13  # type: ignore
    except ImportError:
        return None
    for base in nvidia.cu13.__path__:
        cand = Path(base) / "bin" / "nvdisasm"
        if cand.exists():
            return str(cand)
    return None


def disassemble(cubin: bytes) -> str | None:
    """``nvdisasm -c`` text of a cubin (as ``offline_cubin`` returns it), or None without nvdisasm."""
    import subprocess
    import tempfile

    exe = nvdisasm_path()
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as td:
        path = Path(td) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([exe, "-c", str(path)], capture_output=True, text=True, check=True).stdout


def get_kernel(spec: KernelSpec, device_id: int | None = None):
    """The compiled ``cupy.RawKernel`` of one instantiation (compiled once per device).

    A fixed-arch family (``register(..., arch=...)``) raises ``RuntimeError`` on a device of
    another compute capability."""
    import cupy

    dev = cupy.cuda.runtime.getDevice() if device_id is None else device_id
    hit = _KERNELS.get((spec, dev))
    if hit is not None:   # every launch asks: skip the instantiation-list scan (~50 µs)
        return hit
    if spec not in _ensure_family(spec.family):
        raise ValueError(
            f"{spec.name_expression()} is not in the instantiation list of {spec.family!r}; "
            f"supported: {[s.name_expression() for s in FAMILIES[spec.family]]}"
        )
    mod, names = _module(spec.family, dev)
    kernel = _KERNELS[(spec, dev)] = mod.get_function(names[spec.name_expression()])
    return kernel


#: (spec, device) -> the kernel :func:`get_kernel` returned (its module is cached by ``_module``)
_KERNELS: dict = {}


# ---------------------------------------------------------------- offline compile (no GPU)
@dataclass
class CompileReport:
    """ptxas's account of one compiled instantiation. ``cached``: read from the offline compile
    cache (an earlier NVRTC run of the very same input, :func:`compile_family_offline`)."""

    family: str
    arch: str
    name_expression: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    shared_bytes: int
    cached: bool = False


_PTXAS_FN = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def compile_cache_enabled() -> bool:
    """Whether :func:`compile_family_offline` may answer from its disk cache (``KVLAB_COMPILE_CACHE=0``
    turns the reads off; results are still written)."""
    return os.environ.get("KVLAB_COMPILE_CACHE", "1") != "0"


@functools.cache
def _include_fingerprint(dirs: tuple) -> str:
    """Name, size and mtime of every file directly in the CUDA include folders: a header update
    (a new cuda-toolkit wheel) changes the offline cache key even where NVRTC's version does not."""
    h = hashlib.sha256()
    for d in dirs:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        for e in entries:
            if e.is_file():
                st = e.stat()
                h.update(f"{e.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _offline_cache_path(family: str, arch: str, source: str, opts: tuple, exprs: list) -> Path:
    """Where the reports of one offline compile are kept: keyed on everything NVRTC sees — the
    source (which carries the kvlab headers' hash, :func:`read_source`), the options (include
    folders, ``KVLAB_NVRTC_OPTIONS``, arch), the instantiation list, NVRTC's version and the CUDA
    include folders' files."""
    from cupy.cuda import nvrtc

    key = hashlib.sha256("\0".join([source, *opts, *exprs, str(nvrtc.getVersion()),
                                     _include_fingerprint(tuple(cuda_include_dirs()))]).encode()).hexdigest()[:32]
    return _cache_base() / "kvlab_offline" / f"{family}-{arch}-{key}.json"


def _nvrtc_compile(family: str, source: str, opts: tuple, exprs: list) -> tuple[bytes, str, dict]:
    """NVRTC -> cubin of ``exprs`` with ``opts``: (the cubin, padded as ``_pad_elf`` does; the program
    log — ptxas's ``-v`` report when the options ask for it —; name expression -> lowered name).
    Raises ``CompileException``."""
    from cupy.cuda import compiler

    prog = compiler._NVRTCProgram(source, f"{family}.cu", name_expressions=exprs, method="cubin")
    log = io.StringIO()
    cubin, mapping = prog.compile(opts, log_stream=log)
    return _pad_elf(cubin), log.getvalue(), dict(mapping or {})


def _cubin_cache_path(family: str, arch: str, source: str, opts: tuple, exprs: list) -> Path:
    """Where :func:`offline_cubin` keeps a cubin: beside the reports of the same build
    (:func:`_offline_cache_path`, same key), as ``.cubinz`` (zlib: length of the JSON header
    (mapping, log) as 8 bytes little-endian, the header, the cubin)."""
    return _offline_cache_path(family, arch, source, opts, exprs).with_suffix(".cubinz")


def _store_cubin(path: Path, cubin: bytes, mapping: dict, log: str) -> None:
    """Write one cubin entry atomically (parallel test workers may write the same one); a
    read-only cache folder leaves it unwritten."""
    import json
    import zlib

    head = json.dumps({"mapping": mapping, "log": log}).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")   # not the reports' temporary name
        tmp.write_bytes(zlib.compress(len(head).to_bytes(8, "little") + head + bytes(cubin), 1))
        os.replace(tmp, path)
    except OSError:
        pass


def _load_cubin(path: Path) -> tuple[bytes, dict, str] | None:
    """(cubin, mapping, log) of a cubin entry, or None where it is missing or damaged."""
    import json
    import zlib

    try:
        raw = zlib.decompress(path.read_bytes())
        n = int.from_bytes(raw[:8], "little")
        head = json.loads(raw[8:8 + n])
        cubin = raw[8 + n:]
        if not cubin.startswith(b"\x7fELF"):
            return None
        return cubin, dict(head["mapping"]), str(head["log"])
    except (OSError, ValueError, KeyError, TypeError, zlib.error):
        return None


def _offline_arch(family: str, arch: str | None) -> str:
    """``arch``, or the family's fixed arch (:func:`family_arch`), or ``"sm_90"``; ValueError for a
    fixed-arch family asked for another arch."""
    fixed = FAMILY_ARCH.get(family)
    if arch is None:
        return fixed or "sm_90"
    if fixed is not None and arch != fixed:
        raise ValueError(f"arch: kernel family {family!r} builds for {fixed} only, got {arch!r}")
    return arch


def offline_build(family: str, arch: str | None = None) -> tuple[str, str, tuple, list]:
    """(arch, source, NVRTC options, name expressions) of :func:`compile_family_offline`'s build
    of ``family`` (same arch defaults and errors), ``KVLAB_NVRTC_OPTIONS`` included."""
    specs = _ensure_family(family)
    arch = _offline_arch(family, arch)
    # -ftz=true: CuPy adds it to every run-time compile, so the offline build matches
    opts = compile_options() + (f"-arch={arch}", "-ftz=true", "--ptxas-options=-v")
    return arch, read_source(family), opts, [s.name_expression() for s in specs]


def parse_ptxas_log(family: str, text: str, mapping: dict, exprs: list) -> list[CompileReport]:
    """The reports of the entry functions named in a ptxas ``-v`` log (NVRTC's program log) that
    are in ``exprs`` (lowered names mapped back through ``mapping``)."""
    lowered_to_expr = {v: k for k, v in mapping.items()}
    reports, current = [], None
    for line in text.splitlines():
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


def compile_family_offline(family: str, arch: str | None = None, use_cache: bool | None = None,
                           where=None) -> list[CompileReport]:
    """Compile every instantiation of ``family`` to a cubin for ``arch`` with NVRTC, no GPU needed.

    ``where``: an optional predicate on name expressions; only the instantiations it accepts are
    compiled, a build of its own (the spill tests check an A/B switch build in the instantiations
    the switch is for). ``ValueError`` if it accepts none.

    ``arch`` defaults to the family's fixed arch (:func:`family_arch`) or ``"sm_90"``; a
    fixed-arch family asked for another arch raises ``ValueError``. Raises
    ``cupy.cuda.compiler.CompileException`` (with NVRTC's log) on errors.

    The reports of a successful compile are kept on disk (``<CuPy cache>/kvlab_offline/``), keyed
    on every input NVRTC sees (:func:`_offline_cache_path`); the same input again is answered
    from there (reports marked ``cached``) unless ``use_cache`` is False (default: on unless
    ``KVLAB_COMPILE_CACHE=0``; results are written either way). So ``kvlab check``
    followed by the test suite (README's test command) compiles each build once, and any change
    to a source, header, option or toolkit compiles afresh. Failed compiles are never cached.
    """
    import json

    arch, source, opts, exprs = offline_build(family, arch)
    if where is not None:
        exprs = [e for e in exprs if where(e)]
        if not exprs:
            raise ValueError(f"where: no instantiation of kernel family {family!r} selected")
    cache_path = _offline_cache_path(family, arch, source, opts, exprs)
    if (compile_cache_enabled() if use_cache is None else use_cache) and cache_path.is_file():
        try:
            rows = json.loads(cache_path.read_text())
            reports = [CompileReport(**{**r, "cached": True}) for r in rows]
            if {r.name_expression for r in reports} == set(exprs):
                return reports
        except (OSError, ValueError, TypeError):   # unreadable or foreign: compile afresh
            pass
    cubin, text, mapping = _nvrtc_compile(family, source, opts, exprs)
    reports = parse_ptxas_log(family, text, mapping, exprs)
    if {r.name_expression for r in reports} == set(exprs):   # complete: worth keeping
        # the cubin too, for offline_cubin's SASS readers of the same build (same key)
        _store_cubin(_cubin_cache_path(family, arch, source, opts, exprs), cubin, mapping, text)
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps([{k: v for k, v in vars(r).items() if k != "cached"} for r in reports]))
            os.replace(tmp, cache_path)   # atomic: parallel test workers may write the same entry
        except OSError:   # a read-only home: the compile's result stands, uncached
            pass
    return reports


def all_families() -> list[str]:
    """Families with a ``.cu`` file in ``kernels_cu/``."""
    return sorted(p.stem for p in kernels_dir().glob("*.cu"))
