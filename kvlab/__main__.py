"""kvlab command line: ``python -m kvlab {check,demo,bench,report}``.

Bad arguments become one-line messages and exit code 2, never a traceback; a missing GPU for
``bench`` is exit code 1 with one line.
"""
from __future__ import annotations

import argparse
import sys


def check_output_dir(path, name: str = "--out"):
    """``path`` is a folder that exists or can be created, and is writable; ValueError otherwise.

    Checked before a long run starts, so a bad folder fails in a second, not after minutes.
    """
    import os
    from pathlib import Path

    p = Path(path)
    if str(path).strip() == "":
        raise ValueError(f"{name}: expected a folder, got an empty path")
    if p.exists() and not p.is_dir():
        raise ValueError(f"{name}: expected a folder, got the existing file {str(p)!r}")
    parent = p
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{name}: cannot create {str(p)!r}: {str(parent)!r} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{name}: folder {str(parent)!r} is not writable (needed for {str(p)!r})")
    return p


def _demo(args) -> int:
    """Round trip a random batch through every format (or the ``--format`` ones) with the reference."""
    import numpy as np

    import kvlab
    from kvlab.arrays import NUMPY_BF16
    from kvlab.checks import check_int

    if args.seed < 0:
        raise ValueError(f"--seed: expected an int >= 0, got {args.seed}")
    T = check_int(args.tokens, "--tokens", lo=1, hi=1 << 20)
    H = check_int(args.heads, "--heads", lo=1, hi=256)
    d = args.head_size
    bs = check_int(args.block_size, "--block-size", lo=1, hi=4096)
    names = list(dict.fromkeys(args.format or kvlab.FORMAT_NAMES))
    for n in names:
        if n not in kvlab.FORMAT_NAMES:
            raise ValueError(f"--format: expected one of {list(kvlab.FORMAT_NAMES)}, got {n!r}")
    for n in names:  # every format's own rules (supported head sizes, block sizes), named after the option
        fmt = kvlab.get_format(n)
        fmt.check_head_size(d, "--head-size")
        fmt.check_block_size(bs, d)
    rng = np.random.default_rng(args.seed)
    nb = T // bs + 1
    key = rng.standard_normal((T, H, d)).astype(NUMPY_BF16)
    value = rng.standard_normal((T, H, d)).astype(NUMPY_BF16)
    slots = rng.permutation(nb * bs)[:T].astype(np.int64)
    print(f"{'format':22s} {'bytes/row':>9s} {'bits/elem':>9s} {'K rel. err':>11s} {'V rel. err':>11s}")
    for name in names:
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
    c.add_argument("--fresh", action="store_true",
                   help="compile every build again, not from the offline compile cache (KVLAB_COMPILE_CACHE=0 likewise)")
    d = sub.add_parser("demo", help="round trip random data through every format")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--format", action="append", help="format(s) to run (default: every format)")
    d.add_argument("--tokens", type=int, default=64, help="tokens (default 64)")
    d.add_argument("--heads", type=int, default=8, help="KV heads (default 8)")
    d.add_argument("--head-size", type=int, default=128, help="head size (default 128)")
    d.add_argument("--block-size", type=int, default=16, help="tokens per cache block (default 16)")
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
            from kvlab.cli_check import check_archs, run_check

            return run_check(check_archs(args.arch or ("sm_90", "sm_80")), verbose=not args.quiet,
                             fresh=args.fresh)
        if args.cmd == "demo":
            return _demo(args)
        if args.cmd == "bench":
            from kvlab.bench.cli import main as bench_main

            check_output_dir(args.out)
            return bench_main(args)
        if args.cmd == "report":
            from kvlab.lab.report import main as report_main

            check_output_dir(args.out)
            if args.model is not None and not args.model.strip():
                raise ValueError("--model: expected a Hugging Face model id or a folder, got an empty string")
            return report_main(args)
    except (ValueError, TypeError, OSError, ImportError) as e:
        # OSError covers FileNotFoundError, PermissionError, a full disk …: one line, never a traceback
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"kvlab {args.cmd}: error: {msg}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
