#!/usr/bin/env bash
# One full call on the lent GPU machine (the H200): install what is missing, compile every
# kernel, run the GPU tests, run the benchmarks, print a short table last.
#
#   bash scripts/gpu_run.sh                 # everything
#   SUITES="write hadamard" bash scripts/gpu_run.sh
#   PYTEST_ARGS="tests/gpu/test_paged_attention_gpu.py" SKIP_BENCH=1 bash scripts/gpu_run.sh
#
# Missing Python packages (hypothesis, Jupyter's nbformat/nbclient/ipykernel, …) travel as
# wheels in .whl/ (see docs/gpu-machine.md); results go to $OUT (or /tmp/kvlab_out).
set -uo pipefail
OUT=${OUT:-/tmp/kvlab_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader \
  | tee "$OUT/gpu.txt"
python3 -m kvlab check --quiet > "$OUT/check.log" 2>&1; check_rc=$?
tail -1 "$OUT/check.log"
# shellcheck disable=SC2086
python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:--m gpu tests} 2>&1 | tee "$OUT/pytest.log" \
  | grep -vE '^(\.|s|F|E)+ +\[' | tail -40
if [ -z "${SKIP_BENCH:-}" ]; then
  # shellcheck disable=SC2086
  python3 -m kvlab bench ${SUITES:-} --out "$OUT/bench" > "$OUT/bench.log" 2>&1 || tail -20 "$OUT/bench.log"
fi
echo "================ summary ================"
echo "check: rc=$check_rc  $(tail -1 "$OUT/check.log")"
echo "pytest: $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest.log" | tail -1)"
[ -f "$OUT/bench/results.md" ] && cat "$OUT/bench/results.md"
exit 0
