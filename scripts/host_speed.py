"""How fast this machine's host runs kvlab's host-side work, without a GPU.

    python scripts/host_speed.py            # one line per probe: µs per call (fastest of 7 blocks)
    python scripts/host_speed.py --json F   # also write the numbers to F

Session 23 found the plan's Python 3–8× slower on the lent GPU machine than on the development
machine (docs/perf-notes.md, "For the next session (session 23)"). These probes run the same
host work on any machine, so that the two can be compared line by line:

* ``python loop``: a pure-interpreter loop (integer adds and a list append);
* ``isinstance x100``, ``dict.get x100``: the operations validation repeats;
* ``numpy small ops``: the kinds of tiny NumPy calls the work lists make (zeros, cumsum, repeat,
  concatenate, argsort on ~100 elements);
* ``_work_list``, ``_paged_list``, ``_item_meta``: the plan's own host functions
  (kvlab/cuda/attention.py) on the decode benchmark's B = 32 × 8k batch (32/8 heads, d = 128,
  block 16) for an H200's 132 SMs: the paged decode's list for 2·132 resident CTAs, the per-head
  kernel's for 4·132.

The ratio of two machines' lines says whether the lent host is slower at everything (the
interpreter, NumPy) or at something particular (e.g. one NumPy routine).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab.cuda import attention as A  # noqa: E402  (imports no GPU module at import time)


def per_call_us(fn, n: int = 200, blocks: int = 7) -> float:
    """µs per call: the fastest of ``blocks`` blocks of ``n`` calls (the least disturbed block)."""
    fn()
    best = float("inf")
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    def python_loop():
        acc, out = 0, []
        for i in range(1000):
            acc += i
            if i % 100 == 0:
                out.append(acc)
        return out

    objs = [np.zeros(1), 1, "a", 2.0] * 25
    d = {i: i for i in range(50)}

    def isinstance_100():
        return sum(isinstance(o, np.ndarray) for o in objs)

    def dict_get_100():
        return [d.get(i) for i in range(100)]

    a = np.arange(100, dtype=np.int64)

    def numpy_small():
        z = np.zeros(100, np.int32)
        c = np.cumsum(a)
        r = np.repeat(a[:10], 3)
        k = np.concatenate([z, c.astype(np.int32)])
        return np.argsort(-k, kind="stable"), r

    # the decode benchmark's batch: 32 sequences of 8192 tokens, one query token each
    B, CTX, BS, D = 32, 8192, 16, 128
    qsl = np.arange(B + 1, dtype=np.int64)
    sl = np.full(B, CTX, np.int64)
    bt = np.arange(B * CTX // BS, dtype=np.int32).reshape(B, CTX // BS)
    ny, n_sm = 8, 132                                # 8 column groups (4 query heads each), H200
    tpc = A.NCOL // A.heads_per_column_group(4)      # query tokens per column group
    key = (A.FORMAT_CODES["int4_per_token_head"], D)

    def work_list():
        return A._work_list(qsl, sl, tpc, 0, ny, 4 * n_sm)

    def paged_list():
        return A._paged_list(qsl, sl, tpc, 0, 2 * n_sm, None, 1, n_sm, key)

    items = paged_list()[0]

    def item_meta():
        return A._item_meta(items, qsl, sl, bt, tpc, 0, BS)

    probes = [("python loop (1000 iterations)", python_loop), ("isinstance x100", isinstance_100),
              ("dict.get x100", dict_get_100), ("numpy small ops (5 calls)", numpy_small),
              ("_work_list, B = 32 x 8k", work_list), ("_paged_list, B = 32 x 8k", paged_list),
              ("_item_meta, B = 32 x 8k", item_meta)]
    res = {"python": platform.python_version(), "numpy": np.__version__, "machine": platform.node(),
           "processor": platform.processor() or platform.machine()}
    print(f"python {res['python']}, numpy {res['numpy']}, {res['processor']}")
    for name, fn in probes:
        res[name] = per_call_us(fn, n=50 if name.startswith("_") else 200)
        print(f"{name:34s} {res[name]:9.1f} µs")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
