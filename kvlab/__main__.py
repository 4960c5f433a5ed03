"""kvlab command line: ``python -m kvlab {check,demo,bench,report}``.

Bad arguments become one-line messages and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    """Round trip a random batch through every format with the reference (or the GPU if present)."""
    import numpy as np

    import kvlab
    from kvlab.arrays import NUMPY_BF16

    rng = np.random.default_rng(args.seed)
    T, H, d, bs = 64, 8, 128, 16
    nb = T // bs + 1
    key = rng.standard_normal((T, H, d)).astype(NUMPY_BF16)
    value = rng.standard_normal((T, H, d)).astype(NUMPY_BF16)
    slots = rng.permutation(nb * bs)[:T].astype(np.int64)
    print(f"{'format':22s} {'bytes/row':>9s} {'bits/elem':>9s} {'K rel. err':>11s} {'V rel. err':>11s}")
    for name in kvlab.FORMAT_NAMES:
        fmt = kvlab.get_format(name)
        cache = kvlab.allocate_cache(name, nb, bs, H, d, like=key)
        kvlab.reshape_and_cache(key, value, cache, slots, kv_cache_dtype=name)
        k, v = kvlab.dequantize_cache(cache, kv_cache_dtype=name)
        kr = k.reshape(-1, H, d)[slots]
        vr = v.reshape(-1, H, d)[slots]
        ek = np.linalg.norm(kr - key.astype(np.float32)) / np.linalg.norm(key.astype(np.float32))
        ev = np.linalg.norm(vr - value.astype(np.float32)) / np.linalg.norm(value.astype(np.float32))
        rb = fmt.row_bytes(d)
        print(f"{name:22s} {rb:9d} {fmt.bits_per_element(d):9.2f} {ek:11.4f} {ev:11.4f}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvlab", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="report the environment and NVRTC-compile every kernel")
    c.add_argument("--arch", action="append", help="target(s), default sm_90 and sm_80")
    c.add_argument("--quiet", action="store_true", help="one line per family")
    d = sub.add_parser("demo", help="round trip random data through every format")
    d.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("bench", help="benchmark the kernels against the copy bandwidth and torch")
    b.add_argument("suites", nargs="*", help="suites to run (default: all)")
    b.add_argument("--out", default="benchmarks/latest", help="folder for JSON and Markdown results")
    b.add_argument("--quick", action="store_true", help="fewer repeats and sizes (smoke run)")
    r = sub.add_parser("report", help="the lab's report on real KV data (model + text)")
    r.add_argument("--out", default="reports/latest", help="report folder")
    r.add_argument("--quick", action="store_true", help="small sizes (CI / smoke run)")
    r.add_argument("--model", default=None, help="Hugging Face model id (default: shipped SmolLM2-135M)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "check":
            from kvlab.cli_check import run_check

            return run_check(tuple(args.arch or ("sm_90", "sm_80")), verbose=not args.quiet)
        if args.cmd == "demo":
            return _demo(args)
        if args.cmd == "bench":
            from kvlab.bench.cli import main as bench_main

            return bench_main(args)
        if args.cmd == "report":
            from kvlab.lab.report import main as report_main

            return report_main(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        print(f"kvlab {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
