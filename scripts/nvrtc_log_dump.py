"""Dump NVRTC's raw program log (ptxas -v) and the lowered-name map of one offline family build.

    python scripts/nvrtc_log_dump.py FAMILY ARCH [--options="-DX -DY"] [--out DIR]

What ``kvlab.cuda.loader.compile_family_offline`` parses into registers and spills, unparsed:
for checking that parse against another NVRTC (the lent H200 host's CuPy brings NVRTC 13.0, the
pip toolkit here 13.5) — an entry the parse missed, a spill it attributed to the wrong kernel.
Prints the loader's parse of that same log, one line per instantiation, and writes
``DIR/<family>-<arch>-<options>.log`` with the log and the map. No GPU needed.
"""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family")
    ap.add_argument("arch", help="e.g. sm_90, sm_80, sm_90a")
    ap.add_argument("--options", default="", help="KVLAB_NVRTC_OPTIONS for this build (write --options=\"-DX ...\")")
    ap.add_argument("--out", default="nvrtc_logs", help="folder for the raw log")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"sm_\d{2,3}a?", args.arch):
        ap.error(f"arch: expected sm_<NN> or sm_<NN>a, got {args.arch!r}")
    os.environ["KVLAB_NVRTC_OPTIONS"] = args.options
    from cupy.cuda import nvrtc

    from kvlab.cuda import attention  # noqa: F401  (registers the attention families)
    from kvlab.cuda import loader

    _, source, opts, exprs = loader.offline_build(args.family, args.arch)
    _, text, mapping = loader._nvrtc_compile(args.family, source, opts, exprs)
    tag = re.sub(r"[^A-Za-z0-9_=]+", "_", args.options.replace("-D", "")).strip("_") or "default"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.family}-{args.arch}-{tag}.log"
    path.write_text(f"NVRTC {nvrtc.getVersion()} options {opts}\n\n{text}\n\nLOWERED NAMES\n"
                    + "\n".join(f"{k} -> {v}" for k, v in mapping.items()) + "\n")
    entries = loader._PTXAS_FN.findall(text)   # the loader's own pattern for ptxas's entry lines
    lowered = set(mapping.values())
    print(f"NVRTC {nvrtc.getVersion()}: {len(text)} characters of log, {len(entries)} entry functions named "
          f"({sum(e in lowered for e, _ in entries)} of the {len(exprs)} instantiations), "
          f"{text.count('spill')} 'spill' mentions -> {path}")
    reports = loader.parse_ptxas_log(args.family, text, mapping, exprs)   # the loader's parse of this very log
    for r in sorted(reports, key=lambda r: r.name_expression):
        flag = "  <-- spills" if (r.spill_stores or r.spill_loads or r.stack_frame) else ""
        print(f"  {r.name_expression:58s} {r.registers:4d} regs  {r.spill_stores}/{r.spill_loads} spill  "
              f"{r.stack_frame} stack{flag}")
    missing = sorted(set(exprs) - {r.name_expression for r in reports})
    if missing:
        print(f"  not parsed from the log: {missing}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
