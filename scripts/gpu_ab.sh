#!/usr/bin/env bash
# A/B call on the lent GPU machine for compile-time switches (KVLAB_NVRTC_OPTIONS). Every step runs
# under a deadline (DEADLINE) so that the results are always packed before the call's limit.
# (scripts/gpu_run.sh is the full run: check, whole suite, sanitizer, every bench.)
#
#   WARM=';-DKVLAB_WGMMA_WS_STAGES=2|paged_prefill_wgmma reshape_and_cache'
#                                      option strings, each optionally followed by |families (else
#                                      every family) and |environment assignments: compiled once per
#                                      entry, one process per (entry, family), all in parallel
#   TESTS='s2|-DKVLAB_WGMMA_WS_STAGES=2|tests/gpu/test_prefill_gpu.py -k "wgmma or agree";lean|-DX|-m gpu tests/gpu/a.py'
#                                      name|options|pytest arguments (shell words, eval'd)[|environment
#                                      assignments]: all run in parallel, each cut at T_TESTS s
#   BENCH='pf_base||prefill --quick;pf_s3|-DKVLAB_WGMMA_WS_STAGES=3|prefill --quick|KVLAB_BENCH_PREFILL_VARIANTS=wgmma'
#                                      name|options|bench arguments[|environment assignments]: one
#                                      after another, alone on the GPU, each cut to T_BENCH s and
#                                      to what the deadline leaves
#   BENCH_ENV='KVLAB_BENCH_PREFILL_VARIANTS=wgmma'   extra environment for every bench
#   SANITIZE=1                         scripts/sanitize.sh (every kernel, 4 tools) alongside TESTS
#   SANITIZE_ENV='$NVRTC135'           its environment (eval'd, as an entry's environment field)
#   PROFILE_PREFILL='int4_per_token_head auto nvfp4@-DKVLAB_WGMMA_ROWGROUP'   Nsight Compute over one
#                                      wgmma prefill launch per entry (scripts/profile_prefill.py; FORMAT
#                                      or FORMAT@OPTIONS, options comma-separated), after the benches:
#                                      the details page, raw metrics and the per-SASS-line stall
#                                      samples (PROFILE_LEAN=1: a few sections and the L1 breakdown)
#   PROFILE_DECODE='int4_per_token_head:32:8192:paged int4_per_token_head:1:131072:per_head'
#                                      Nsight Compute over one decode launch per case
#                                      (scripts/profile_decode.py FORMAT:B:CTX:VARIANT), after the benches
#   PRE='python3 scripts/ring_probe.py --out "$OUT/ring"'
#                                      shell commands run alone on the GPU after the warm-up and
#                                      before TESTS/SANITIZE (bash -c, cut at T_PRE s), output in pre.log
#   DEADLINE=570                       seconds after start at which nothing new is started
#   .nvrtc/NAME.tar.xz                 another NVRTC (scripts/pack_nvrtc.sh, scripts/nvrtc_env.sh):
#                                      $NAME in upper case (e.g. $NVRTC135) holds the environment
#                                      assignments that load it, for an entry's environment field
#                                      (write it as \$NVRTC135 or inside single quotes: it is eval'd here)
# Everything lands in $OUT/ab.tgz (the device tool brings back only a few files) plus summary.txt.
set -uo pipefail
FINAL_OUT=${OUT:-/tmp/kvlab_ab_out}
OUT=/tmp/kvlab_ab
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL_OUT"
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${DEADLINE:-570} - $(el) )); }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
source scripts/nvrtc_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/provenance.sh
write_commit_txt "$OUT/commit.txt"
if [ -n "${WARM:-}" ]; then
  fams=$(python3 -c "from kvlab.cuda import loader; print(' '.join(loader.all_families()))")
  IFS=';' read -r -a wopts <<< "$WARM"
  for o in "${wopts[@]}"; do
    of=$fams; wenv=""
    case "$o" in *"|"*) IFS='|' read -r o of wenv <<< "$o";; esac   # 'opts|' alone: no family
    for f in $of; do printf '%s\t%s\t%s\n' "$o" "$f" "$wenv"; done
  done \
    | xargs -P "${WARM_JOBS:-16}" -d '\n' -I{} bash -c \
      'o=$(cut -f1 <<< "{}"); f=$(cut -f2 <<< "{}"); e=$(cut -f3 <<< "{}"); eval "env $e KVLAB_NVRTC_OPTIONS=\"\$o\" timeout '"${T_WARM:-300}"' python3 scripts/warm_kernels.py \"\$f\"" 2>&1 | tail -1' \
    > "$OUT/warm.log" 2>&1
  echo "warm done [$(el) s]: $(grep -c '^warm .* s$' "$OUT/warm.log") compiled, slowest: $(grep -o '[0-9]* s$' "$OUT/warm.log" | sort -n | tail -1)"
fi
if [ -n "${PRE:-}" ]; then
  OUT="$OUT" timeout "${T_PRE:-120}" bash -c "$PRE" > "$OUT/pre.log" 2>&1; echo "pre rc=$? [$(el) s]"
  tail -"${PRE_LINES:-40}" "$OUT/pre.log"
fi
pids=()
if [ -n "${SANITIZE:-}" ]; then
  # shellcheck disable=SC2086
  ( eval "env ${SANITIZE_ENV:-} OUT=\"\$OUT/sanitize\" timeout ${T_SANITIZE:-400} bash scripts/sanitize.sh" \
      > "$OUT/sanitize.txt" 2>&1
    echo "sanitize rc=$?" >> "$OUT/sanitize.txt" ) &
  pids+=($!)
fi
if [ -n "${TESTS:-}" ]; then
  IFS=';' read -r -a tests <<< "$TESTS"
  for t in "${tests[@]}"; do
    IFS='|' read -r name opts args tenv <<< "$t"
    # shellcheck disable=SC2086
    ( eval "env ${tenv:-} KVLAB_NVRTC_OPTIONS=\"\$opts\" timeout ${T_TESTS:-300} python3 -m pytest -q -p no:cacheprovider -rfE $args" \
        > "$OUT/pytest_$name.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_$name.log" ) &
    pids+=($!)
  done
fi
for p in "${pids[@]}"; do wait "$p"; done
[ -f "$OUT/sanitize.txt" ] && grep -E "^(memcheck|racecheck|initcheck|synccheck|sanitize rc)" "$OUT/sanitize.txt"
if [ -n "${TESTS:-}" ]; then
  for t in "${tests[@]}"; do name=${t%%|*}
    echo "pytest $name: $(grep -E '[0-9]+ (passed|failed|error)' "$OUT/pytest_$name.log" | tail -1) $(tail -1 "$OUT/pytest_$name.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest_$name.log" | head -8
  done
  echo "tests done [$(el) s]"
fi
if [ -n "${BENCH:-}" ]; then
  IFS=';' read -r -a benches <<< "$BENCH"
  for b in "${benches[@]}"; do
    IFS='|' read -r name opts args benv <<< "$b"
    if [ "$(left)" -lt 20 ]; then echo "bench $name: not started (deadline)"; continue; fi
    lim=$(left); [ "$lim" -gt "${T_BENCH:-200}" ] && lim=${T_BENCH:-200}
    # shellcheck disable=SC2086
    eval "env ${BENCH_ENV:-} ${benv:-} KVLAB_NVRTC_OPTIONS=\"\$opts\" timeout $lim python3 -m kvlab bench $args --out \"$OUT/bench_$name\"" \
      > "$OUT/bench_$name.log" 2>&1 || { echo "bench $name failed or timed out:"; tail -3 "$OUT/bench_$name.log"; }
    echo "bench $name done [$(el) s]"
  done
fi
# An Nsight Compute report REP.ncu-rep as text next to it: the details page (appended to REP.txt),
# every metric (REP_raw.csv: the stall-reason breakdown) and the per-SASS-line source view with its
# stall samples (REP_source.csv; scripts/ncu_stalls.py reads the two CSVs).
ncu_pages() {
  [ -f "$1.ncu-rep" ] || return 0
  "$NCU" --import "$1.ncu-rep" --page details >> "$1.txt" 2>&1
  "$NCU" --import "$1.ncu-rep" --page raw --csv > "$1_raw.csv" 2>&1
  "$NCU" --import "$1.ncu-rep" --page source --csv --print-source sass > "$1_source.csv" 2>&1
}
# PROFILE_PREFILL entries: FORMAT or FORMAT@OPTIONS (comma-separated -D options of that build, e.g.
# nvfp4@-DKVLAB_WGMMA_ROWGROUP); PROFILE_LEAN=1 collects the L1 data-pipe breakdown, the warp states
# and the per-SASS-line stall samples only (a few passes instead of --set full's ~38).
LEAN_METRICS=l1tex__data_pipe_lsu_wavefronts.sum,l1tex__data_pipe_lsu_wavefronts.avg.pct_of_peak_sustained_elapsed,\
l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,\
l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,l1tex__t_output_wavefronts_pipe_lsu_mem_global_op_ld.sum,\
l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed,\
smsp__sass_inst_executed_op_shared_gmma.sum,smsp__sass_inst_executed_op_shared_ld.sum,smsp__sass_inst_executed_op_shared_st.sum,\
smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__inst_executed.avg.per_cycle_active
for pf in ${PROFILE_PREFILL:-}; do
  [ "$(left)" -gt 60 ] || { echo "profile $pf: not started (deadline)"; continue; }
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] || { echo "ncu not found"; break; }
  fmt=${pf%%@*}; popts=""; tag=$fmt
  case "$pf" in *@*) popts=$(tr ',' ' ' <<< "${pf#*@}"); tag="${fmt}_$(tr -cd 'A-Za-z0-9_' <<< "${pf#*@}" | sed 's/DKVLAB_WGMMA_//g')";; esac
  if [ -n "${PROFILE_LEAN:-}" ]; then
    sets=(--section SpeedOfLight --section WarpStateStats --section SourceCounters --section SchedulerStats --metrics "$LEAN_METRICS")
  else
    sets=(--set full)
  fi
  lim=$(left); lim=$(( lim - 20 )); rep="$OUT/ncu_prefill_$tag"
  KVLAB_NVRTC_OPTIONS="$popts" timeout "$lim" "$NCU" --clock-control none "${sets[@]}" --import-source yes --export "$rep" --force-overwrite \
    -k regex:paged_attention_prefill_wgmma -c 1 python3 scripts/profile_prefill.py "$fmt" wgmma > "$rep.txt" 2>&1
  ncu_pages "$rep"
  echo "prefill profile $pf done [$(el) s]"
  grep -E "^ +(Duration|Registers Per|Issue Slots Busy|No Eligible|Compute \(SM\) Throughput|L1/TEX Cache Throughput)" "$rep.txt" | head -6
done
if [ -n "${PROFILE_DECODE:-}" ] && [ "$(left)" -gt 60 ]; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -n "$NCU" ]; then
    lim=$(left); lim=$(( lim - 20 )); rep="$OUT/ncu_decode"; n=$(wc -w <<< "$PROFILE_DECODE")
    # shellcheck disable=SC2086
    timeout "$lim" "$NCU" --clock-control none --set full --import-source yes --export "$rep" --force-overwrite \
      -k regex:'paged_attention_decode' -c "$n" python3 scripts/profile_decode.py $PROFILE_DECODE > "$rep.txt" 2>&1
    ncu_pages "$rep"
    echo "decode profile done [$(el) s]"
    grep -E "paged_attention_decode|^ +(Duration|Registers Per|Issue Slots Busy|No Eligible|DRAM Throughput)" "$rep.txt" | head -24
  fi
fi
echo "================ summary ================"
for f in "$OUT"/bench_*/results.md; do
  [ -f "$f" ] && echo "# $(basename "$(dirname "$f")")" && sed -n '/^## /,$p' "$f" \
    | grep -E "T=4096 causal 32/8 d=128|T=65536 H=8|B=32 L=8192 32/8 d=128|B=1 L=131072 32/8 d=128" \
    | cut -d'|' -f3-4,7-8 | head -"${SUMMARY_LINES:-24}"
done
tar czf "$FINAL_OUT/ab.tgz" -C "$OUT" --exclude='*.ncu-rep' . && echo "results: ab.tgz ($(du -h "$FINAL_OUT/ab.tgz" | cut -f1))"
exit 0
