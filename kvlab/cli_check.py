"""``python -m kvlab check``: the environment, and an NVRTC compile of every kernel instantiation."""
from __future__ import annotations

import platform
import sys
import time


#: the NVRTC that kvlab's register bounds are tuned with: no kernel spills under it
TUNED_NVRTC = (13, 5)
NVRTC_NOTE = ("older than 13.5, which kvlab's register bounds are tuned with (pip picks 13.0 beside "
              "torch's cu130 wheels): a few kernels may spill here (they do under 13.0), flagged "
              "'<-- spills' without --quiet (the INT4 write, measured 0.8 % slower; "
              "tests/test_kernels_compile.py, OLDER_NVRTC_SPILLS)")


def environment() -> dict:
    """What this machine offers kvlab: GPU or not, NVRTC, CUDA headers, library versions."""
    info = {"python": platform.python_version()}
    import numpy

    info["numpy"] = numpy.__version__
    try:
        import cupy

        info["cupy"] = cupy.__version__
        from cupy.cuda import nvrtc

        major, minor = nvrtc.getVersion()
        info["nvrtc"] = f"{major}.{minor}"
        if (major, minor) < TUNED_NVRTC:
            info["nvrtc_note"] = NVRTC_NOTE
    except Exception as e:  # report, do not crash: check is the diagnostic tool
        info["cupy"] = info.get("cupy", f"unavailable ({e.__class__.__name__}: {e})")
        info.setdefault("nvrtc", "unavailable")
    from .cuda.loader import cuda_include_dirs, kernels_dir

    inc = cuda_include_dirs()
    info["cuda_headers"] = inc[0] if inc else "not found via cuda.pathfinder (CuPy's default search applies)"
    info["kernels_dir"] = str(kernels_dir())
    info["gpu"] = gpu_name()
    try:
        import torch

        info["torch"] = torch.__version__
    except Exception:
        info["torch"] = "not installed (optional)"
    return info


def gpu_name() -> str | None:
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        if n == 0:
            return None
        p = cupy.cuda.runtime.getDeviceProperties(0)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        return f"{name} (sm_{p['major']}{p['minor']}, {n} device(s))"
    except Exception:
        return None


def check_archs(archs) -> tuple:
    """``--arch`` values as a tuple, each ``sm_<NN>`` (optionally with an ``a``/``f`` suffix) that this
    NVRTC supports; ValueError naming ``--arch`` otherwise (before any compile)."""
    import re

    supported = None
    try:
        from cupy.cuda import nvrtc

        supported = tuple(int(a) for a in nvrtc.getSupportedArchs())
    except Exception:  # no NVRTC here: the format is still checked, the compile reports the rest
        pass
    out = []
    for a in archs:
        m = re.fullmatch(r"sm_(\d{2,3})[af]?", str(a))
        if m is None:
            raise ValueError(f"--arch: expected sm_<NN> (e.g. sm_90, sm_80), got {a!r}")
        if supported is not None and int(m.group(1)) not in supported:
            raise ValueError(f"--arch: expected one of {['sm_%d' % v for v in supported]} (what this NVRTC "
                             f"supports), got {a!r}")
        out.append(str(a))
    return tuple(out)


def run_check(archs=("sm_90", "sm_80"), verbose: bool = True, fresh: bool = False) -> int:
    """Print the environment and compile every family for every arch. Returns the exit code.

    A build whose every input NVRTC would see was compiled before is answered from the offline
    compile cache (``loader.compile_family_offline``; the family's line says ``cached``);
    ``fresh=True`` (``kvlab check --fresh``) compiles everything again."""
    from .cuda import loader

    info = environment()
    print("kvlab environment")
    for k, v in info.items():
        print(f"  {k:13s} {v if v is not None else 'none (kernels compile but do not run here)'}")
    failures = 0
    total = 0
    print()
    if verbose:
        print(f"{'family':20s} {'arch':6s} {'instantiation':58s} {'regs':>5s} {'spill st/ld':>12s} {'stack':>6s}")
    for fam in loader.all_families():
        # a fixed-arch family (the wgmma prefill kernel: sm_90a) compiles for its arch only
        for arch in loader.family_archs(fam, archs):
            t0 = time.perf_counter()
            try:
                reps = loader.compile_family_offline(fam, arch, use_cache=False if fresh else None)
            except Exception as e:  # a compile error: print NVRTC's log and keep going
                failures += 1
                print(f"{fam:20s} {arch:6s} COMPILE ERROR\n{e}", file=sys.stderr)
                continue
            dt = time.perf_counter() - t0
            total += len(reps)
            for r in sorted(reps, key=lambda r: r.name_expression):
                flag = "  <-- spills" if (r.spill_stores or r.spill_loads) else ""
                if verbose:
                    print(f"{fam:20s} {arch:6s} {r.name_expression:58.58s} {r.registers:5d} "
                          f"{r.spill_stores:5d}/{r.spill_loads:<6d} {r.stack_frame:6d}{flag}")
            if verbose and reps and all(r.cached for r in reps):
                print(f"{fam:20s} {arch:6s} (the rows above: offline compile cache; --fresh compiles again)")
            expected = len(loader.FAMILIES.get(fam, []))
            if len(reps) != expected:
                failures += 1
                print(f"{fam}: {arch}: compiled {len(reps)} instantiations, expected {expected}",
                      file=sys.stderr)
            if not verbose:
                how = " (cached)" if reps and all(r.cached for r in reps) else ""
                print(f"{fam:20s} {arch:6s} {len(reps)} instantiations in {dt:.2f} s{how}")
    print()
    status = "OK" if failures == 0 else f"FAILED ({failures} families)"
    print(f"compiled {total} kernel instantiations for {', '.join(archs)}: {status}")
    return 0 if failures == 0 else 1
