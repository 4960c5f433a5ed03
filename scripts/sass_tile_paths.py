"""Per-tile instruction counts of the wgmma prefill's consumer loop, without a GPU.

    python scripts/sass_tile_paths.py '<3, 128, __nv_bfloat16'
    python scripts/sass_tile_paths.py '<0, 128, __nv_bfloat16'   # the session-8 (lean) consumer loop

Compiles the matching ``paged_prefill_wgmma`` instantiations (scripts/sass_stats.py's compile,
the loader's options, ``KVLAB_NVRTC_OPTIONS`` included), finds the consumer tile loop (the
innermost backward branch whose body contains the HGMMAs) and walks one pass through its body
with the branches resolved, for three kinds of tile:

* full tile, no rescale: the P·V + S wgmma branch, the mask-free softmax, the O rescale skipped;
* full tile, rescale: the same with the O rescale;
* diagonal tile, rescale: the causal / window mask applied.

The branches are found by their shape in the SASS: the first conditional branch after the
ping-pong ``BAR.SYNC`` (taken: into the P·V + S block), the last two-predicate ``BRA`` before the
warp vote (taken: over the mask), and the first conditional branch after ``VOTE.ANY`` (taken: over
the rescale). ``BRA.DIV`` (the shuffles' divergence check) is never taken, unconditional branches
always. Counts are static: one instruction issued per warp per SASS line on the path (the
mbarrier try-wait is counted once).
"""
from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab.cuda import loader  # noqa: E402
from sass_stats import compile_cubin, find_nvdisasm  # noqa: E402

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_TARGET = re.compile(r"`\(\.(L_x_\d+)\)")


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def function_body(func_sass: str):
    ins, labels = [], {}
    for line in func_sass.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(ins)
        m = _LINE.search(line)
        if m:
            ins.append(m.group(2).strip())
    return ins, labels


def consumer_loop(ins, labels):
    best = None
    for i, t in enumerate(ins):
        if re.match(r"(@!?U?P\w+\s+)?BRA", t):
            m = _TARGET.search(t)
            a = labels.get(m.group(1)) if m else None
            if a is not None and a <= i and any("HGMMA" in x for x in ins[a:i]):
                if best is None or i - a < best[1] - best[0]:
                    best = (a, i)
    return best


def walk(ins, labels, a, b, taken):
    i, cnt = a, collections.Counter()
    while i <= b:
        t = ins[i]
        cnt[opcode(t)] += 1
        if i < b and "BRA" in t:
            m = _TARGET.search(t)
            tg = labels.get(m.group(1)) if m else None
            cond = t.startswith("@") or "BRA.DIV" in t
            if tg is not None and tg > i and (not cond or i - a in taken):
                i = tg
                continue
        i += 1
    return cnt


def report(name: str, func_sass: str) -> None:
    ins, labels = function_body(func_sass)
    a, b = consumer_loop(ins, labels)
    body = ins[a:b + 1]
    rel = list(enumerate(body))
    turn = next(i for i, t in rel if re.search(r"BAR\.SYNC\S*\s+R\d+", t))
    pvs = next(i for i, t in rel if i > turn and "BRA" in t and t.startswith("@"))
    vote = next(i for i, t in rel if "VOTE.ANY" in t)
    mask = [i for i, t in rel if i < vote and re.match(r"@!?P\d BRA !?P\d", t)][-1]
    resc = next(i for i, t in rel if i > vote and "BRA" in t and t.startswith("@"))
    mix = collections.Counter(opcode(t) for t in body)
    print(f"\n== {name}: consumer loop body {len(body)} instructions (all branches)")
    print("   " + ", ".join(f"{k} {v}" for k, v in mix.most_common(16)))
    for label, tk in (("full tile, no rescale", {pvs, mask, resc}), ("full tile, rescale", {pvs, mask}),
                      ("diagonal tile, rescale", {pvs})):
        c = walk(ins, labels, a, b, tk)
        print(f"  {label}: {sum(c.values())}: " + ", ".join(f"{k} {v}" for k, v in c.most_common(16)))


def main() -> None:
    filters = sys.argv[1:]
    cubin, demangled, _ = compile_cubin("paged_prefill_wgmma", filters, "sm_90a")
    find_nvdisasm()   # exits with the install hint when there is none
    sass = loader.disassemble(cubin)
    for f in re.split(r"\n\s*\.text\.", sass)[1:]:
        fn = f.split(":")[0].strip()
        report(demangled.get(fn, fn), f)


if __name__ == "__main__":
    main()
