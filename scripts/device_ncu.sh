#!/usr/bin/env bash
# What holds each kernel of the layer back: Nsight Compute on one forward + backward of bench_layer
# (no warm-up, one repetition: every kernel once), on the GPU machine after scripts/device_check.sh
# built build-device/. Sections: SpeedOfLight (SM / memory / L2 / DRAM throughput, duration),
# WarpStateStats (stall reasons), Occupancy. bench/ncu_summary.py turns the report's raw page into
# one line per kernel. Usage (device tool, kind nvidia-h200):
#   NCU_CONFIGS='OLMoE-7B,Qwen3-235B' bash scripts/device_ncu.sh
# Env: NCU_CONFIGS (default OLMoE-7B), NCU_TIMEOUT (s per config, 240), NCU_ENV (extra VAR=value
# words for the run, e.g. 'SMOE_DW_PATH=engine'), NCU_LAUNCHES (kernels profiled per config, 60),
# NCU_KERNEL (a regex on the kernel name: profile only those, e.g. 'VarlenKKernel'), NCU_SECTIONS
# (more sections, e.g. 'SchedulerStats MemoryWorkloadAnalysis SourceCounters InstructionStats';
# their human-readable page goes to ncu_<config>_details.txt).
# NCU_FLAGS: more ncu words, e.g. '--clock-control none' (kernel times at the clocks the bench sees).
# NCU_SOURCE=1 adds the SourceCounters section and writes ncu_<config>_source.csv: per SASS instruction
# of every profiled kernel, its warp-stall samples by reason (where a kernel waits, line by line).
# Logs and CSVs to $OUT and $OUT/device_ncu.tgz.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT"
[ -x build-device/bench_layer ] || STEPS=none bash scripts/device_check.sh >/dev/null 2>&1
[ -x build-device/bench_layer ] || { echo "no build-device/bench_layer: build failed"; exit 1; }
REP="${TMPDIR:-/tmp}/smoe_ncu"   # reports outside $OUT: the device tool brings back what is in $OUT
mkdir -p "$REP"
IFS=',' read -r -a cfgs <<<"${NCU_CONFIGS:-OLMoE-7B}"
for cfg in "${cfgs[@]}"; do
  tag=$(echo "$cfg" | tr -c 'A-Za-z0-9.\n-' '_')
  t0=$(date +%s)
  extra=()
  for sec in ${NCU_SECTIONS:-}; do extra+=(--section "$sec"); done
  [ "${NCU_SOURCE:-0}" = 1 ] && extra+=(--section SourceCounters)
  for f in ${NCU_FLAGS:-}; do extra+=("$f"); done  # e.g. '--clock-control none' (ncu locks base clocks)
  # The regex is matched against the demangled name (the default, the bare function name, is
  # engine_kernel for every engine instance).
  [ -n "${NCU_KERNEL:-}" ] && extra+=(--kernel-name-base demangled --kernel-name "regex:$NCU_KERNEL")
  env ${NCU_ENV:-} timeout "${NCU_TIMEOUT:-240}" ncu -f -o "$REP/ncu_$tag" --section SpeedOfLight --section WarpStateStats \
    --section Occupancy "${extra[@]}" --launch-count "${NCU_LAUNCHES:-60}" build-device/bench_layer --only "$cfg" \
    --warmup 0 --reps 1 >"$OUT/ncu_$tag.log" 2>&1
  echo "== $cfg: ncu rc=$? $(( $(date +%s) - t0 ))s"
  # The raw page: every collected metric as a column, one row per kernel (bench/ncu_summary.py).
  ncu --import "$REP/ncu_$tag.ncu-rep" --csv --page raw >"$OUT/ncu_$tag.csv" 2>>"$OUT/ncu_$tag.log"
  python3 bench/ncu_summary.py "$OUT/ncu_$tag.csv" | tee "$OUT/ncu_$tag.md"
  [ "${NCU_SOURCE:-0}" = 1 ] &&
    ncu --import "$REP/ncu_$tag.ncu-rep" --page source --print-source sass --csv >"$OUT/ncu_${tag}_source.csv" 2>>"$OUT/ncu_$tag.log" &&
    python3 bench/ncu_source_top.py "$OUT/ncu_${tag}_source.csv" --top 30 >"$OUT/ncu_${tag}_source_top.txt" 2>&1
  [ -n "${NCU_SECTIONS:-}" ] && ncu --import "$REP/ncu_$tag.ncu-rep" --page details >"$OUT/ncu_${tag}_details.txt" 2>&1
done
# The reports themselves (.ncu-rep, for the Nsight Compute GUI) only with NCU_KEEP_REPORTS=1 (size).
[ "${NCU_KEEP_REPORTS:-0}" = 1 ] && cp "$REP"/ncu_*.ncu-rep "$OUT"/ 2>/dev/null
tar czf "$OUT/device_ncu.tgz" -C "$OUT" $(cd "$OUT" && ls ncu_* 2>/dev/null) 2>/dev/null || true
