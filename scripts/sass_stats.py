"""Static SASS instruction mix of kvlab kernels, without a GPU (NVRTC -> cubin -> nvdisasm).

    python scripts/sass_stats.py paged_attention 'decode<3, 128, __nv_bfloat16>'
    python scripts/sass_stats.py reshape_and_cache 'int4' --arch sm_90 --dump out.sass
    python scripts/sass_stats.py paged_prefill_wgmma '<3, 128'    # fixed-arch family: sm_90a
    python scripts/sass_stats.py paged_prefill_wgmma '<3, 128, __nv' --tile-path

Compiles only the instantiations of FAMILY whose name expression contains every FILTER
(substring match), with the loader's options (``KVLAB_NVRTC_OPTIONS`` included), and prints
per kernel: registers (ptxas), total instructions, warpgroup MMAs (HGMMA) when there are any,
and for each loop (a backward branch and its
target) the instruction count by opcode — the loop body is where a streaming kernel spends
its time, so the counts there are the ones to compare between versions.

``--tile-path`` (wgmma prefill family): the instructions one warp executes for one steady-state
tile, i.e. the shortest path through the tile loop (the smallest loop holding the P·V HGMMAs,
``.tnspB``) that contains the P·V group, exactly one S group (D/16 HGMMAs) and, after the tile
barrier, the next tile's global loads (LDG, or LDGSTS for auto). Shortest = the optional blocks
are skipped: the causal / window mask of diagonal tiles, the accumulator rescale, the first
S of a warpgroup's first tile (pipelined build); BRA.DIV fallbacks count as not taken.

nvdisasm comes from the pip package ``nvidia-cuda-nvdisasm`` (13.x); the machine's NVRTC (pip
``nvidia-cuda-nvrtc``) can differ from the GPU machine's, so treat small differences with care.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab.cuda import loader  # noqa: E402


def find_nvdisasm() -> str:
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    try:
        import nvidia.cu13  # type: ignore

        for base in nvidia.cu13.__path__:
            cand = Path(base) / "bin" / "nvdisasm"
            if cand.exists():
                return str(cand)
    except ImportError:
        pass
    sys.exit("nvdisasm not found: pip install 'nvidia-cuda-nvdisasm==13.*'")


def compile_cubin(family: str, filters: list[str], arch: str) -> tuple[bytes, dict, dict]:
    """(cubin, lowered name -> name expression, name expression -> registers)."""
    import io

    from cupy.cuda import compiler

    specs = loader._ensure_family(family)
    exprs = [s.name_expression() for s in specs if all(f in s.name_expression() for f in filters)]
    if not exprs:
        sys.exit(f"no instantiation of {family!r} matches {filters}; e.g. {specs[0].name_expression()}")
    prog = compiler._NVRTCProgram(loader.read_source(family), f"{family}.cu", name_expressions=exprs,
                                  method="cubin")
    log = io.StringIO()
    cubin, mapping = prog.compile(loader.compile_options() + (f"-arch={arch}", "-ftz=true",  # as CuPy
                                                              "--ptxas-options=-v"), log_stream=log)
    demangled = {v: k for k, v in (mapping or {}).items()}
    regs, cur = {}, None
    for line in log.getvalue().splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = demangled.get(m.group(1), m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            regs[cur] = int(m.group(1))
    return loader._pad_elf(cubin), demangled, regs


_FN = re.compile(r"^\s*\.text\.(\S+):")
_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
_LABEL = re.compile(r"^\.(L_x_\d+):")


def parse(sass: str) -> dict:
    """function -> list of (address, opcode, operands, labels at this address: a tuple, guard
    predicate or "")."""
    funcs: dict = collections.OrderedDict()
    cur, pending = None, []
    for line in sass.splitlines():
        m = _FN.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            pending = []
            continue
        m = _LABEL.match(line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = _INS.search(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(3), m.group(4), tuple(pending), (m.group(2) or "").strip()))
            pending = []
    return funcs


def _branch_target(operands: str):
    m = re.search(r"`\(\.(L_x_\d+)\)", operands)
    return m.group(1) if m else None


def tile_path(ins: list, d: int):
    """(loop start, loop end, steady-state tile path length) of a wgmma prefill kernel (see the
    module docstring), or None when no such loop / path exists."""
    labels = {lab: i for i, x in enumerate(ins) for lab in x[3]}
    loop = None
    for i, (_, op, operands, *_) in enumerate(ins):
        t = labels.get(_branch_target(operands)) if op.startswith("BRA") and not op.startswith("BRA.DIV") else None
        if t is not None and t <= i and any("tnspB" in x[2] for x in ins[t:i + 1]) \
                and (loop is None or i - t < loop[1] - loop[0]):
            loop = (t, i)
    if loop is None:
        return None
    a, b = loop
    auto = any(x[1].startswith("LDGSTS") for x in ins[a:b + 1])
    want_s = d // 16
    inf = 1 << 30

    def after(state, i):  # state = (S HGMMAs, P·V seen, barrier seen, next loads seen)
        ns, pv, bar, ld = state
        op, operands = ins[i][1], ins[i][2]
        if op.startswith("HGMMA"):
            if "tnspB" in operands:
                pv = 1
            else:
                ns = min(ns + 1, 2 * want_s + 1)
        if op.startswith("BAR.SYNC"):
            bar = 1
        if bar and (op.startswith("LDGSTS") if auto else op.startswith("LDG")):
            ld = 1
        return ns, pv, bar, ld

    def succ(i):
        _, op, operands, _, pred = ins[i]
        if op.startswith("BRA") and not op.startswith("BRA.DIV"):
            t = labels.get(_branch_target(operands))
            out = [t] if t is not None and i < t <= b else []
            return out + ([i + 1] if pred else [])  # unguarded: no fall-through
        return [] if op == "EXIT" else [i + 1]

    best: dict = {}
    states = [(ns, pv, bar, ld) for ns in range(2 * want_s + 2) for pv in (0, 1) for bar in (0, 1) for ld in (0, 1)]
    for i in range(b, a - 1, -1):
        for st in states:
            nxt = after(st, i)
            if i == b:
                ok = nxt[0] == want_s and nxt[1] and nxt[3]
                best[i, st] = 1 if ok else inf
            else:
                r = min((best.get((j, nxt), inf) for j in succ(i) if j <= b), default=inf)
                best[i, st] = r + 1 if r < inf else inf
    n = best[a, (0, 0, 0, 0)]
    return (a, b, n) if n < inf else None


def op_class(op: str) -> str:
    return op.split(".")[0]


def report(funcs: dict, demangled: dict, top: int, regs: dict | None = None, tile: bool = False) -> None:
    for fn, ins in funcs.items():
        name = demangled.get(fn, fn)
        extra = f", {regs[name]} registers" if regs and name in regs else ""
        ngmma = sum(1 for x in ins if x[1].startswith("HGMMA"))
        extra += f", {ngmma} HGMMA" if ngmma else ""
        print(f"\n== {name}: {len(ins)} instructions{extra}")
        if tile:
            m = re.search(r"<\d+, (\d+),", name)
            tp = tile_path(ins, int(m.group(1))) if m else None
            print(f"  tile loop [{tp[0]}..{tp[1]}] {tp[1] - tp[0] + 1} instructions, steady-state tile path "
                  f"{tp[2]} instructions per warp" if tp else "  no wgmma tile loop / steady-state path found")
        labels = {lab: i for i, x in enumerate(ins) for lab in x[3]}
        loops = []
        for i, (_, op, operands, *_) in enumerate(ins):
            if op.startswith("BRA") or op.startswith("BRX"):
                m = re.search(r"`\(\.(L_x_\d+)\)", operands)
                if m and m.group(1) in labels and labels[m.group(1)] <= i:
                    loops.append((labels[m.group(1)], i))
        # outermost-first, largest bodies
        loops.sort(key=lambda ab: ab[1] - ab[0], reverse=True)
        for a, b in loops[:top]:
            body = ins[a:b + 1]
            mix = collections.Counter(op_class(x[1]) for x in body)
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
    ap.add_argument("--tile-path", action="store_true", help="wgmma prefill: instructions of one "
                    "steady-state tile per warp (module docstring)")
    args = ap.parse_args()
    arch = args.arch or loader.family_arch(args.family) or "sm_90"
    cubin, demangled, regs = compile_cubin(args.family, args.filters, arch)
    with tempfile.TemporaryDirectory() as td:
        path = os.path.join(td, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([find_nvdisasm(), "-c", path],
                              capture_output=True, text=True, check=True).stdout
    if args.dump:
        Path(args.dump).write_text(sass)
    report(parse(sass), demangled, args.top, regs, args.tile_path)


if __name__ == "__main__":
    main()
