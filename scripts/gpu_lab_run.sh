#!/usr/bin/env bash
# The lab on the lent GPU machine (second of the two back-to-back calls of docs/gpu-machine.md:
# the first carried .whl and .model_b and ran `gpu_model_parts.sh stash_b`; this one carries
# .model_a). Joins the shipped model, runs the lab's GPU tests, then times the full report
# (`python -m kvlab report`, default sizes) on the GPU. Results: $OUT/gpu_lab.tgz.
#
#   bash scripts/gpu_lab_run.sh
#   SKIP_REPORT=1 bash scripts/gpu_lab_run.sh    # the lab's GPU tests only
set -uo pipefail
FINAL_OUT=${OUT:-/tmp/kvlab_out}
OUT=/tmp/kvlab_gpu_lab
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL_OUT"
t0=$(date +%s)
bash scripts/gpu_model_parts.sh join > "$OUT/join.log" 2>&1 || { cat "$OUT/join.log"; exit 1; }
export PYTHONPATH=/tmp/site:/tmp/kvlab_model/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "${T_TESTS:-330}" python3 -m pytest -q -p no:cacheprovider -rA \
  tests/gpu/test_lab_gpu.py tests/gpu/test_report_gpu.py tests/gpu/test_notebook_gpu.py \
  > "$OUT/pytest_lab_gpu.log" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest_lab_gpu.log" | head
echo "lab tests done [$(( $(date +%s) - t0 )) s]"
t1=$(date +%s)
if [ -z "${SKIP_REPORT:-}" ]; then
  timeout "${T_REPORT:-240}" python3 -m kvlab report --out "$OUT/report" > "$OUT/report.log" 2>&1
  report_rc=$?
  echo "report rc=$report_rc in $(( $(date +%s) - t1 )) s (full sizes, on the GPU)" | tee "$OUT/report_time.txt"
else
  echo "report skipped (SKIP_REPORT)" | tee "$OUT/report_time.txt" > "$OUT/report.log"
fi
echo "================ summary ================"
echo "lab pytest: $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest_lab_gpu.log" | tail -1)"
grep -iE "int4 logits|KL" "$OUT/pytest_lab_gpu.log" | grep -v Warning | head -8
cat "$OUT/report_time.txt"; tail -3 "$OUT/report.log"
tar czf "$FINAL_OUT/gpu_lab.tgz" -C "$OUT" . && echo "results: gpu_lab.tgz ($(du -h "$FINAL_OUT/gpu_lab.tgz" | cut -f1))"
