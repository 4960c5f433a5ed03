"""Issue 4's targets, read off committed benchmark results (no GPU needed).

    python scripts/bench_targets.py                      # benchmarks/latest/{decode,prefill}/results.json
    python scripts/bench_targets.py RUN/results.json ... # any results.json files of `python -m kvlab bench`

Prints, per file, the GPU and date it was measured on, then one Markdown table of the targets
over the rows of all files (``kvlab.bench.targets``: the default's kernel per format, its
measured ratio, the limit, the time the limit allows and the distance from the paged read floor).
The same table ends every ``results.md`` the benchmark writes.
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvlab.bench import targets  # noqa: E402

DEFAULT = [ROOT / "benchmarks/latest/decode/results.json", ROOT / "benchmarks/latest/prefill/results.json"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path, help="results.json files (default: the committed decode and prefill runs)")
    args = ap.parse_args(argv)
    rows = []
    for f in args.files or DEFAULT:
        try:
            data = json.loads(Path(f).read_text())
        except (OSError, ValueError) as e:
            print(f"bench_targets: {f}: {e}", file=sys.stderr)
            return 2
        env = data.get("environment", {})
        print(f"- {f}: {env.get('gpu', '?')}, {env.get('date', '?')}, NVRTC {env.get('nvrtc', '?')}")
        rows += data.get("rows", [])
    lines = targets.markdown_lines(rows)
    if not lines:
        print("bench_targets: none of these rows belong to a suite with targets (decode, prefill)", file=sys.stderr)
        return 1
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
