"""Hot-path SASS count of the int4 write (docs/notes-int4-write-mma.md, "SASS: hot-path instructions").

    python scripts/int4_write_hot_count.py                       # bf16 + fp16, d = 128, sm_90
    python scripts/int4_write_hot_count.py --arch sm_80 --dump hot.sass
    KVLAB_NVRTC_OPTIONS=-DKVLAB_INT4_WRITE_PLAIN_TAIL python scripts/int4_write_hot_count.py  # the pre-session-7 tail
    KVLAB_NVRTC_OPTIONS=-DKVLAB_INT4_WRITE_DIV64 python scripts/int4_write_hot_count.py       # session 7's index math

The counting method of sessions 4-6, made a script: compile ``reshape_and_cache<3, 128, T,
false>`` from a copy of ``reshape_and_cache.cu`` in which the rare path (``if
(__ballot_sync(0xffffffffu, flag) & gmask)`` and, for the lean tail (the default since session 7),
``if (!(rng <= FMAX))`` -> ``if (false)``) and the clamping code variant
(``noclamp`` -> ``true``) are compiled out, and count the instructions up to and including the
last EXIT (so the inline parts of divisions and their never-taken slow-path branches are counted,
the out-of-line slow-path subroutines after the last EXIT are not). Divided by the 64 elements (K
and V) of a thread. Also prints the opcode mix of that range and the hot build's registers, and
an estimate of the instructions a thread executes on the common path (executed_path: the blocks
that only set up the 64-bit division's subroutine call are skipped).
"""
from __future__ import annotations

import argparse
import collections
import io
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvlab.cuda import loader  # noqa: E402
import sass_stats  # noqa: E402

#: the rare-path tests: quantize_store_int4's and quantize_store_int4_lean's (the default MMA8 tail)
RARE = ("if (__ballot_sync(0xffffffffu, flag) & gmask) {", "if (!(rng <= FMAX)) {")
NOCLAMP = re.compile(r"const bool noclamp = __all_sync\(0xffffffffu,[^;]*;", re.S)


def hot_source() -> str:
    src = loader.read_source("reshape_and_cache")
    for r in RARE:
        assert src.count(r) == 1, f"the rare-path test {r!r} moved: update RARE"
        src = src.replace(r, "if (false) {")
    src, n = NOCLAMP.subn("const bool noclamp = true;", src)
    assert n == 2, "the noclamp tests moved: update NOCLAMP"
    return src


def compile_sass(src: str, expr: str, arch: str) -> tuple[str, int, str]:
    from cupy.cuda import compiler

    prog = compiler._NVRTCProgram(src, "reshape_and_cache.cu", name_expressions=[expr], method="cubin")
    log = io.StringIO()
    cubin, _ = prog.compile(loader.compile_options() + (f"-arch={arch}", "-ftz=true", "--ptxas-options=-v"),
                            log_stream=log)
    regs = int(re.search(r"Used (\d+) registers", log.getvalue()).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.getvalue())
    sass_stats.find_nvdisasm()   # exits with the install hint when there is none
    sass = loader.disassemble(loader._pad_elf(cubin))
    return sass, regs, f"spills {spill.group(1)}/{spill.group(2)} B" if spill else "spills ?"


def hot_range(sass: str) -> list:
    funcs = sass_stats.parse(sass)
    assert len(funcs) == 1
    ins = next(iter(funcs.values()))
    last_exit = max(i for i, (_, op, _, _) in enumerate(ins) if op.startswith("EXIT"))
    return ins[:last_exit + 1]


def executed_path(sass: str) -> int:
    """Instructions a thread executes on the common path of the hot build (an estimate): the
    longest path from the start to an unpredicated EXIT that calls nothing (the 64-bit division's
    out-of-line subroutine is never called at these sizes; "longest" picks the active row's index
    work over the skipped row's shortcut); predicated instructions count as executed."""
    lines = sass.splitlines()
    start = next(i for i, ln in enumerate(lines) if sass_stats._FN.match(ln))
    ins, labels = [], {}
    for ln in lines[start + 1:]:
        if sass_stats._FN.match(ln):
            break
        m = sass_stats._LABEL.match(ln.strip())
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = sass_stats._INS.search(ln)
        if m:
            ins.append((m.group(2) or "", m.group(3), m.group(4)))
    memo: dict = {}
    for i in range(len(ins) - 1, -1, -1):  # forward branches only: each index's value from later ones
        pred, op, args = ins[i]
        if op.startswith("CALL"):
            memo[i] = float("-inf")
            continue
        if op.startswith("EXIT") and not pred:
            memo[i] = 1
            continue
        nxt = memo.get(i + 1, float("-inf"))
        if op.startswith("BRA"):
            tgt = labels[re.search(r"\.(L_x_\d+)", args).group(1)]
            if tgt <= i:
                memo[i] = float("-inf")  # a backward branch: only in the subroutines after the EXIT
                continue
            taken = memo.get(tgt, float("-inf"))
            unconditional = not pred and not re.match(r"\s*!?U?P\d", args)
            memo[i] = 1 + (taken if unconditional else max(taken, nxt))
        else:
            memo[i] = 1 + nxt
    n = memo[0]
    assert n != float("-inf"), "no call-free path"
    return int(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--types", default="__nv_bfloat16,__half")
    ap.add_argument("--dump", help="write the hot build's SASS here (one file per type: suffix .T)")
    ap.add_argument("--elements", type=int, default=64, help="elements per thread (K + V)")
    args = ap.parse_args()
    src = hot_source()
    for t in args.types.split(","):
        expr = f"reshape_and_cache<3, 128, {t}, false>"
        sass, regs, spills = compile_sass(src, expr, args.arch)
        if args.dump:
            Path(f"{args.dump}.{t}").write_text(sass)
        body = hot_range(sass)
        mix = collections.Counter(op for _, op, _, _ in body)
        n = len(body)
        print(f"== {expr} {args.arch} (hot build: {regs} registers, {spills}): {n} instructions up to the last "
              f"EXIT = {n / args.elements:.2f} per element")
        ex = executed_path(sass)
        print(f"   executed on the common path (estimate, executed_path): "
              f"{ex} = {ex / args.elements:.2f} per element")
        cls = collections.Counter(sass_stats.op_class(op) for _, op, _, _ in body)
        print("   by class: " + ", ".join(f"{k} {v}" for k, v in cls.most_common()))
        print("   by opcode: " + ", ".join(f"{k} {v}" for k, v in mix.most_common()))


if __name__ == "__main__":
    main()
