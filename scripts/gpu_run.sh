#!/usr/bin/env bash
# One full call on the lent GPU machine (the H200): install what is missing, compile every
# kernel, run the GPU tests (and, with SANITIZE=1, compute-sanitizer over every kernel at the
# same time), then the benchmarks alone on the GPU, and print a short table last.
#
#   bash scripts/gpu_run.sh
#   SUITES="write hadamard" SANITIZE=1 bash scripts/gpu_run.sh
#   PYTEST_ARGS="tests/gpu/test_paged_attention_gpu.py" SKIP_BENCH=1 bash scripts/gpu_run.sh
#   QUICK_SUITES="decode" ...   run those suites with --quick (the target shapes only)
#   HOSTPROF=1 ...   also time the host side of one kvlab.paged_attention call (profile_host.py)
#   VARIANTS="base=;staged=KVLAB_NVRTC_OPTIONS=-DKVLAB_WRITE_STAGED" ...   run every suite once
#                    per variant with the environment assignments after the first '=' (A/B of
#                    compile-time switches or KVLAB_* settings; results in bench_<suite>_<name>/);
#                    VARIANTS_<suite> sets them for one suite only
#   NCU_ARGS="..."   extra Nsight Compute options for PROFILE / PROFILE_WRITE (the stall-reason
#                    breakdown was missing from session 3's --set full text; to try:
#                    NCU_ARGS="--print-details all", not yet verified on the device's ncu)
#   NVRTC=host ...   build with the host's NVRTC even where .nvrtc/ brings another (scripts/pack_nvrtc.sh)
#   PROFILE_WRITE=1 ...   Nsight Compute over one write launch per format (profile_write.py;
#                    PROFILE_WRITE_FORMATS="fp8_per_token_head int8_per_token_head" to pick)
#
# Each step has its own time limit (T_TESTS, T_SANITIZE, T_BENCH seconds) so that one slow
# step cannot eat the whole call; every suite writes its own folder, so partial results
# survive. Missing Python packages (hypothesis, Jupyter's nbformat/nbclient/ipykernel, …)
# travel as wheels in .whl/ (docs/gpu-machine.md); results are packed into $OUT/gpu_run.tgz.
set -uo pipefail
# Work in a scratch folder; at the end everything is packed into $OUT/gpu_run.tgz (the device
# tool brings back only a few files).
FINAL_OUT=${OUT:-/tmp/kvlab_out}
OUT=/tmp/kvlab_gpu_run
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL_OUT"
t0=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# README's pip NVRTC (what its install resolves alone), where .nvrtc/ brings one: every step builds
# with the newest archive's, unless NVRTC=host (docs/gpu-machine.md, "Lessons of session 26")
source scripts/nvrtc_env.sh
if [ -n "$NVRTC_ENVS" ] && [ "${NVRTC:-}" != host ]; then
  _last=${NVRTC_ENVS##* }; export ${!_last}; echo "this run builds with \$$_last"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader \
  | tee "$OUT/gpu.txt"
source scripts/provenance.sh
write_commit_txt "$OUT/commit.txt"
if [ -z "${SKIP_CHECK:-}" ]; then
  timeout 300 python3 -m kvlab check --quiet > "$OUT/check.log" 2>&1; check_rc=$?
else
  echo "skipped (SKIP_CHECK)" > "$OUT/check.log"; check_rc=0
fi
echo "check rc=$check_rc: $(tail -1 "$OUT/check.log")  [$(( $(date +%s) - t0 )) s]"
if [ -n "${SANITIZE:-}" ]; then
  ( OUT="$OUT" timeout "${T_SANITIZE:-300}" bash scripts/sanitize.sh > "$OUT/sanitize.txt" 2>&1;
    echo "sanitize rc=$?" >> "$OUT/sanitize.txt" ) &
  san_pid=$!
fi
# shellcheck disable=SC2086
timeout "${T_TESTS:-300}" python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:--m gpu tests} \
  > "$OUT/pytest.log" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
echo "pytest done [$(( $(date +%s) - t0 )) s]"
[ -n "${san_pid:-}" ] && wait "$san_pid"
if [ -z "${SKIP_BENCH:-}" ]; then
  for s in ${SUITES:-write hadamard decode prefill}; do
    vv="VARIANTS_$s"; IFS=';' read -r -a variants <<< "${!vv:-${VARIANTS:-=}}"
    for v in "${variants[@]}"; do
      vname=${v%%=*}; vopts=${v#*=}; dir="bench_$s${vname:+_$vname}"
      tb="T_BENCH_$s"; tb=${!tb:-${T_BENCH:-150}}
      qk=""; case " ${QUICK_SUITES:-} " in *" $s "*) qk="--quick";; esac
      # shellcheck disable=SC2086
      env $vopts timeout "$tb" python3 -m kvlab bench "$s" $qk --out "$OUT/$dir" \
        > "$OUT/$dir.log" 2>&1 || { echo "bench $dir failed or timed out:"; tail -5 "$OUT/$dir.log"; }
      echo "bench $dir done [$(( $(date +%s) - t0 )) s]"
    done
  done
fi
if [ -n "${PROFILE_WRITE:-}" ]; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] && timeout "${T_PROFILE:-150}" "$NCU" --clock-control none --set full ${NCU_ARGS:-} \
    -k regex:reshape_and_cache -c 5 python3 scripts/profile_write.py ${PROFILE_WRITE_FORMATS:-} \
    > "$OUT/ncu_write.txt" 2>&1
  echo "write profile done [$(( $(date +%s) - t0 )) s]"
  grep -E "reshape_and_cache|^ +(Duration|Memory Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Executed Ipc A)" "$OUT/ncu_write.txt" | head -60
fi
if [ -n "${PROFILE:-}" ]; then
  # one int4 decode launch (batch 32 x 8k, 32/8 heads, d=128) under Nsight Compute, as text
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  # PROFILE_ENV: environment assignments for the profiled run (e.g. KVLAB_DECODE_VARIANT=paged)
  [ -n "$NCU" ] && env ${PROFILE_ENV:-} timeout "${T_PROFILE:-120}" "$NCU" --clock-control none --set full ${NCU_ARGS:-} \
    --import-source yes --export "$OUT/ncu_decode" --force-overwrite \
    -k regex:paged_attention_decode -c 2 python3 scripts/profile_decode.py > "$OUT/ncu_decode.txt" 2>&1
  if [ -f "$OUT/ncu_decode.ncu-rep" ]; then
    # the report as text (details), every metric (raw: the stall-reason breakdown, smsp__pcsamp_*),
    # and the per-SASS-line source view with its stall samples
    "$NCU" --import "$OUT/ncu_decode.ncu-rep" --page details >> "$OUT/ncu_decode.txt" 2>&1
    "$NCU" --import "$OUT/ncu_decode.ncu-rep" --page raw --csv > "$OUT/ncu_decode_raw.csv" 2>&1
    "$NCU" --import "$OUT/ncu_decode.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/ncu_decode_source.csv" 2>&1
    grep -iE "stall" "$OUT/ncu_decode_raw.csv" | head -3 | cut -c1-300
  fi
  echo "profile done [$(( $(date +%s) - t0 )) s]: $(grep -cE 'Duration|Memory Throughput' "$OUT/ncu_decode.txt" 2>/dev/null) metric lines"
  grep -E "paged_attention_decode|^ +(Duration|DRAM Throughput|Registers Per|Achieved Active Warps|Issue Slots Busy|Warp Cycles Per Issued|Stall (Long|Short|Wait|Barrier|Math|MIO|Not Sel|LG))" \
    "$OUT/ncu_decode.txt" | head -40
fi
if [ -n "${HOSTPROF:-}" ]; then
  # host time of one whole kvlab.paged_attention call vs plan / run (scripts/profile_host.py)
  timeout 120 python3 scripts/profile_host.py > "$OUT/profile_host.txt" 2>&1
  echo "host profile done [$(( $(date +%s) - t0 )) s]"
fi
echo "================ summary ================"
echo "check: rc=$check_rc  $(tail -1 "$OUT/check.log")"
echo "pytest: $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest.log" | tail -1)"
[ -f "$OUT/sanitize.txt" ] && grep -E "^(memcheck|racecheck|initcheck|synccheck|sanitize rc)" "$OUT/sanitize.txt"
[ -f "$OUT/profile_host.txt" ] && grep -E "^(whole call|plan only|run only)" "$OUT/profile_host.txt"
for f in "$OUT"/bench_*/results.md; do
  [ -f "$f" ] && echo "# $(basename "$(dirname "$f")")" && sed -n '/^## /,$p' "$f" | grep -E "^## |b=32|B=32|T=65536|1048576 rows x d=128|4096|131072|prefill" | head -40
done
# issue 4's targets over every suite that ran (kvlab/bench/targets.py; exit 1 when none has targets)
js=$(ls "$OUT"/bench_*/results.json 2>/dev/null)
[ -n "$js" ] && { python3 scripts/bench_targets.py $js | sed -n '/^| target/,$p' || true; }
tar czf "$FINAL_OUT/gpu_run.tgz" -C "$OUT" . && echo "results: gpu_run.tgz ($(du -h "$FINAL_OUT/gpu_run.tgz" | cut -f1))"
exit 0
