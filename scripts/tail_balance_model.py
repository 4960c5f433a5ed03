"""What would balancing the paged decode's stages at run time gain? A model on measured per-CTA
timelines (``scripts/decode_cta_timeline.py --out DIR`` writes ``decode_cta_timeline.json``).

    python3 scripts/tail_balance_model.py benchmarks/latest/decode/variants_session21/call5_cta_timeline.json

The plan splits a sequence's KV range into equal parts before the launch; the CTAs then stream
at rates that differ by a few per cent from run to run (the per-SM rates of two runs are not
correlated: the spread is not a property of an SM that a plan could weigh). The kernel's span
ends with the slowest CTA. The model keeps every CTA's measured start, first-data time, rate
(stages / loop time) and epilogue, and moves stages between CTAs:

* ``sequence``: the CTAs of one sequence share its stages (e.g. by claiming them from a counter
  per sequence), so they end together at start + their stages / the sum of their rates;
* ``global``: every CTA shares every stage (an upper bound: partials would then mix sequences).

It ignores what the claims would cost (an atomic and a block-table read per stage, off the
critical path only if issued ahead) and any change of rate when a neighbour stops early. CTAs
are grouped into sequences as ``ctas / B`` consecutive CTAs (the work list is sequence-major for
uniform batches; a weighted list groups approximately). Prints, per case and run, the measured
span and the two modelled spans (µs from the first CTA's start).

Session 27 built the sequence-balanced form (claims per part, thefts within the group; branch
``experiment/decode-claim``) and measured it *slower* for the dual-ring CTA, where the model had
predicted 1–2.5 µs less: a theft's round trips idle the thief's warps about as long as the stage
it brings (docs/perf-notes.md "Session 27"). Read the model as an upper bound.
"""
from __future__ import annotations

import argparse
import json

import numpy as np


def model(a: np.ndarray, batch: int) -> dict:
    """``a``: one run's raw timeline rows (CTAs × 24 words: globaltimer marks 0 … 4 in ns, the
    SM in word 10, the stage count in word 11). Returns spans in µs."""
    t = a[:, 0:5].astype(np.float64)
    t = (t - t[:, 0].min()) / 1e3
    nst = a[:, 11].astype(np.float64)
    loop = t[:, 3] - t[:, 2]
    rate = nst / np.maximum(loop, 1e-9)
    epi = t[:, 4] - t[:, 3]
    n = len(a)
    group = max(1, n // max(1, batch))
    seq_end = np.empty(n)
    for s in range(0, n, group):
        idx = slice(s, min(n, s + group))
        seq_end[idx] = t[idx, 2].mean() + nst[idx].sum() / rate[idx].sum() + epi[idx].mean()
    glob = t[:, 2].mean() + nst.sum() / rate.sum() + np.median(epi)
    return dict(ctas=n, group=group, span=float(t[:, 4].max()), end_median=float(np.median(t[:, 4])),
                sequence=float(seq_end.max()), global_=float(glob),
                loop_cv=float(loop.std() / loop.mean()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("timeline_json")
    args = ap.parse_args()
    raw = json.load(open(args.timeline_json))["raw"]
    print("| case | run | CTAs | CTAs per sequence | span | median end | sequence-balanced | all balanced | loop cv |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case, runs in raw.items():
        batch = int(case.split(":")[1])
        for i, a in enumerate(runs):
            m = model(np.asarray(a, dtype=np.int64), batch)
            print(f"| {case} | {i} | {m['ctas']} | {m['group']} | {m['span']:.1f} | {m['end_median']:.1f} | "
                  f"{m['sequence']:.1f} | {m['global_']:.1f} | {m['loop_cv']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
