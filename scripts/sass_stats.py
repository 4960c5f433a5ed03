"""Static SASS instruction mix of kvlab kernels, without a GPU (NVRTC -> cubin -> nvdisasm).

    python scripts/sass_stats.py paged_attention 'decode<3, 128, __nv_bfloat16>'
    python scripts/sass_stats.py reshape_and_cache 'int4' --arch sm_90 --dump out.sass
    python scripts/sass_stats.py paged_prefill_wgmma '<3, 128'    # fixed-arch family: sm_90a

Compiles only the instantiations of FAMILY whose name expression contains every FILTER
(substring match), with the loader's options (``KVLAB_NVRTC_OPTIONS`` included), and prints
per kernel: registers (ptxas), total instructions, warpgroup MMAs (HGMMA) when there are any,
and for each loop (a backward branch and its
target) the instruction count by opcode — the loop body is where a streaming kernel spends
its time, so the counts there are the ones to compare between versions.

nvdisasm comes from the pip package ``nvidia-cuda-nvdisasm`` (13.x); the machine's NVRTC (pip
``nvidia-cuda-nvrtc``) can differ from the GPU machine's, so treat small differences with care.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab.cuda import loader  # noqa: E402


def find_nvdisasm() -> str:
    return loader.nvdisasm_path() or sys.exit("nvdisasm not found: pip install 'nvidia-cuda-nvdisasm==13.*'")


def compile_cubin(family: str, filters: list[str], arch: str) -> tuple[bytes, dict, dict]:
    """(cubin, lowered name -> name expression, name expression -> registers)."""
    specs = loader._ensure_family(family)
    exprs = [s.name_expression() for s in specs if all(f in s.name_expression() for f in filters)]
    if not exprs:
        sys.exit(f"no instantiation of {family!r} matches {filters}; e.g. {specs[0].name_expression()}")
    cubin, mapping, log = loader.offline_cubin(family, exprs, arch, ("--ptxas-options=-v",))
    demangled = {v: k for k, v in mapping.items()}
    regs, cur = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = demangled.get(m.group(1), m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            regs[cur] = int(m.group(1))
    return cubin, demangled, regs


_FN = re.compile(r"^\s*\.text\.(\S+):")
_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_LABEL = re.compile(r"^\.(L_x_\d+):")


def parse(sass: str) -> dict:
    """function -> list of (address, opcode, operands, label-at-this-address or None)."""
    funcs: dict = collections.OrderedDict()
    cur, pending = None, None
    for line in sass.splitlines():
        m = _FN.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            pending = None
            continue
        m = _LABEL.match(line.strip())
        if m:
            pending = m.group(1)
            continue
        m = _INS.search(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(3), m.group(4), pending))
            pending = None
    return funcs


def op_class(op: str) -> str:
    return op.split(".")[0]


def report(funcs: dict, demangled: dict, top: int, regs: dict | None = None) -> None:
    for fn, ins in funcs.items():
        name = demangled.get(fn, fn)
        extra = f", {regs[name]} registers" if regs and name in regs else ""
        ngmma = sum(1 for _, op, _, _ in ins if op.startswith("HGMMA"))
        extra += f", {ngmma} HGMMA" if ngmma else ""
        print(f"\n== {name}: {len(ins)} instructions{extra}")
        labels = {lab: i for i, (_, _, _, lab) in enumerate(ins) if lab}
        loops = []
        for i, (_, op, operands, _) in enumerate(ins):
            if op.startswith("BRA") or op.startswith("BRX"):
                m = re.search(r"`\(\.(L_x_\d+)\)", operands)
                if m and m.group(1) in labels and labels[m.group(1)] <= i:
                    loops.append((labels[m.group(1)], i))
        # outermost-first, largest bodies
        loops.sort(key=lambda ab: ab[1] - ab[0], reverse=True)
        for a, b in loops[:top]:
            body = ins[a:b + 1]
            mix = collections.Counter(op_class(op) for _, op, _, _ in body)
            print(f"  loop [{a}..{b}] {len(body)} instructions: "
                  + ", ".join(f"{k} {v}" for k, v in mix.most_common(24)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family")
    ap.add_argument("filters", nargs="*", help="substrings every selected name expression contains")
    ap.add_argument("--arch", default=None, help="default: the family's fixed arch (sm_90a for "
                    "paged_prefill_wgmma), else sm_90")
    ap.add_argument("--top", type=int, default=3, help="largest loops to show per kernel")
    ap.add_argument("--dump", help="write the full SASS here")
    args = ap.parse_args()
    arch = args.arch or loader.family_arch(args.family) or "sm_90"
    find_nvdisasm()   # exits with the install hint before the compile when there is none
    cubin, demangled, regs = compile_cubin(args.family, args.filters, arch)
    sass = loader.disassemble(cubin)
    if args.dump:
        Path(args.dump).write_text(sass)
    report(parse(sass), demangled, args.top, regs)


if __name__ == "__main__":
    main()
