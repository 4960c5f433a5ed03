#!/usr/bin/env bash
# Run every GPU kernel (scripts/sanitize_driver.py) under compute-sanitizer: memcheck, racecheck,
# initcheck, synccheck. Prints each tool's ERROR SUMMARY; exit 1 if any tool reports an error.
#   OUT=/some/dir bash scripts/sanitize.sh
set -uo pipefail
OUT=${OUT:-/tmp/kvlab_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONUNBUFFERED=1
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -z "$CS" ]; then echo "compute-sanitizer not found"; exit 2; fi
# warm the kernel cache outside the sanitizer (compiles are host work)
python3 scripts/sanitize_driver.py > "$OUT/sanitize_warmup.log" 2>&1 || { tail -20 "$OUT/sanitize_warmup.log"; exit 1; }
rc=0
for tool in memcheck racecheck initcheck synccheck; do
  extra=""
  [ "$tool" = memcheck ] && extra="--leak-check no"
  # shellcheck disable=SC2086
  "$CS" --tool "$tool" $extra --target-processes all --print-limit 20 \
    python3 scripts/sanitize_driver.py > "$OUT/sanitizer_$tool.log" 2>&1
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitizer_$tool.log" | tail -1)
  echo "$tool: ${summary:-no summary (see sanitizer_$tool.log)}"
  if ! echo "$summary" | grep -qE ": 0 (errors|hazards)"; then rc=1; grep -m5 -E "=========  (Invalid|Race|Uninit|Barrier|Error)" "$OUT/sanitizer_$tool.log"; fi
done
exit $rc
