"""Compile kernel families into the on-disk kernel caches, so that later processes with the same
``KVLAB_NVRTC_OPTIONS`` find them compiled (the cache key includes the option string).

    KVLAB_NVRTC_OPTIONS=-DKVLAB_WGMMA_WS_STAGES=2 python3 scripts/warm_kernels.py paged_prefill_wgmma

One process per family is the unit of parallelism (``scripts/gpu_ab.sh`` runs many at once: a
first NVRTC compile of the wgmma family takes more than 90 s on the H200 machine). Needs a GPU for
the CuPy-compiled families (``cupy.RawModule`` compiles for the current device); a fixed-arch
family is skipped on a device of another compute capability. Prints one line per family."""
import os
import sys
import time

from kvlab.cuda import loader


def main(families: list[str]) -> int:
    families = families or loader.all_families()
    for fam in families:
        t = time.time()
        specs = loader._ensure_family(fam)
        try:
            loader.get_kernel(specs[0])
        except RuntimeError as e:  # fixed-arch family on another device
            print(f"warm {fam}: skipped ({e})")
            continue
        print(f"warm {fam} [{os.environ.get('KVLAB_NVRTC_OPTIONS', '')}]: {len(specs)} "
              f"instantiations, {time.time() - t:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
