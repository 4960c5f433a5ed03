"""Stall-reason summary of an Nsight Compute decode profile (the files PROFILE=1 of
scripts/gpu_run.sh brings back), no GPU needed:

    python scripts/ncu_stalls.py ncu_decode_raw.csv ncu_decode_source.csv [--tiles 131072]

Per kernel: the stall-sample breakdown (smsp__pcsamp_warps_issue_stalled_*), IPC, issue-slot
use, shared-load bank conflicts, and from the per-SASS source view the executed instructions
and stall samples per opcode (per 16-token tile when --tiles gives the tile count of the
profiled launch: B·L·H/16, 131072 at B = 32 × 8k with 8 KV heads).
"""
from __future__ import annotations

import argparse
import collections
import csv
import re


def _num(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


def raw_summary(path: str) -> None:
    rows = list(csv.reader(open(path)))
    hdr = rows[0]
    for r in rows[2:]:
        vals = dict(zip(hdr, r))
        print("==", vals.get("Kernel Name", "?")[:100])
        st = sorted(((_num(v), h) for h, v in vals.items()
                     if h.startswith("smsp__pcsamp_warps_issue_stalled_") and not h.endswith("not_issued")),
                    reverse=True)
        tot = sum(x for x, _ in st) or 1.0
        for x, h in st[:12]:
            print(f"  {h[len('smsp__pcsamp_warps_issue_stalled_'):]:28s} {x:9.0f} {100 * x / tot:5.1f} %")
        for key in ("gpu__time_duration.sum", "sm__inst_executed.avg.per_cycle_active",
                    "smsp__issue_active.avg.pct_of_peak_sustained_active",
                    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum", "smsp__inst_executed.sum"):
            if key in vals:
                print(f"  {key:55s} {vals[key]}")


def source_summary(path: str, tiles: int) -> None:
    lines = open(path).read().split("\n")
    blocks, cur = [], None
    for ln in lines:
        if ln.startswith('"Kernel Name"'):
            cur = [ln]
            blocks.append(cur)
        elif cur is not None:
            cur.append(ln)
    for b in blocks:
        rows = list(csv.reader(b[1:]))
        if not rows:
            continue
        hdr = rows[0]
        data = [r for r in rows[1:] if len(r) == len(hdr)]
        col = {h: i for i, h in enumerate(hdr)}
        stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Is" not in h]
        samples = collections.defaultdict(collections.Counter)
        executed = collections.Counter()
        for r in data:
            m = re.match(r"(@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", r[col["Source"]].strip())
            op = m.group(2) if m else "?"
            samples[op]["all"] += _num(r[col["Warp Stall Sampling (All Samples)"]])
            executed[op] += _num(r[col["Instructions Executed"]])
            for sc in stall_cols:
                samples[op][sc] += _num(r[col[sc]])
        tot = sum(c["all"] for c in samples.values()) or 1.0
        per = f"per tile ({tiles})" if tiles else "executed"
        print(f"== {b[0][15:110]}\n  {'opcode':8s} {per:>18s} {'samples':>8s}  top stall reasons")
        for op, c in sorted(samples.items(), key=lambda kv: -kv[1]["all"])[:20]:
            top = sorted(((v, k) for k, v in c.items() if k != "all"), reverse=True)[:3]
            n = executed[op] / tiles if tiles else executed[op]
            print(f"  {op:8s} {n:18.1f} {100 * c['all'] / tot:7.1f}%  "
                  + ", ".join(f"{k[6:]} {100 * v / tot:.1f}%" for v, k in top))
        n = sum(executed.values())
        print(f"  total {n / tiles if tiles else n:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw_csv")
    ap.add_argument("source_csv", nargs="?")
    ap.add_argument("--tiles", type=int, default=0)
    a = ap.parse_args()
    raw_summary(a.raw_csv)
    if a.source_csv:
        source_summary(a.source_csv, a.tiles)


if __name__ == "__main__":
    main()
