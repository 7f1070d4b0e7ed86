#!/usr/bin/env bash
# Run on the GPU machine (device tool), from the repository root, carrying
#   .deps/googletest  .deps/cutlass-<ver>/cutlass_library/source/include
# Builds with all cores, then runs the steps named in STEPS (default: all of them):
#   ctest      CPU tests
#   engine     GPU tests of the engine's kernels (GpuEngine.*)
#   gpu        the other GPU tests
#   memcheck   compute-sanitizer memcheck on the small GPU tests
#   racecheck  compute-sanitizer racecheck / synccheck on small engine and routing tests
#   main       the main job
# Logs go to $OUT (when set). Prints a summary table last.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/versions.env
OUT="${OUT:-$ROOT/out}"
STEPS="${STEPS:-ctest engine gpu memcheck racecheck main}"
mkdir -p "$OUT"
BUILD=build-device
CUTLASS_SRC="$ROOT/.deps/cutlass-$CUTLASS_PIP_VERSION/cutlass_library/source"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
t0=$(date +%s)
cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" \
  -Wno-dev -DSMOE_GTEST_SOURCE_DIR="$ROOT/.deps/googletest" -DSMOE_CUTLASS_DIR="$CUTLASS_SRC" >"$OUT/cmake.log" 2>&1 \
  || { cat "$OUT/cmake.log"; exit 1; }
cmake --build $BUILD -j "$(nproc)" >"$OUT/build.log" 2>&1 || { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"

declare -A result
run_step() {  # name, command...
  local name=$1; shift
  case " $STEPS " in *" $name "*) ;; *) return 0;; esac
  local t=$(date +%s)
  timeout "${STEP_TIMEOUT:-300}" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  result[$name]="rc=$rc $(( $(date +%s) - t ))s"
  return $rc
}
SMALL_ENGINE='GpuEngine.StoreWeightsNK:GpuEngine.SwiGLUGathered:GpuEngine.DSwiGLUGathered:GpuEngine.GateUpTwoTensors:GpuEngine.VarlenK:GpuEngine.VarlenKCluster:GpuEngine.ZeroRows'
run_step ctest bash -c "cd $BUILD && ctest --output-on-failure -j 4 -E gpu_tests"
run_step engine $BUILD/test_gpu --gtest_filter='GpuEngine.*'
run_step gpu $BUILD/test_gpu --gtest_filter='-GpuEngine.*'
SMALL="GpuRouting.NonFinite*:GpuRouting.ZeroTokens:GpuRouting.WorkspaceTooSmall*:GpuRouting.Deterministic:GpuLayer.SmallShapes*:GpuLayer.Unsupported*:GpuLayer.GateUpTwoTensorsMatchInterleaved:GpuLayerRouting.*:GpuTokenRounding.SmallShapes*:GpuTokenRounding.ZeroTokens:GpuTokenRounding.WorkspaceTooSmall*:$SMALL_ENGINE"
run_step memcheck compute-sanitizer --tool memcheck --error-exitcode 9 $BUILD/test_gpu --gtest_filter="$SMALL"
run_step racecheck bash -c "compute-sanitizer --tool racecheck --error-exitcode 9 $BUILD/test_gpu --gtest_filter='GpuRouting.NonFinite*:GpuRouting.Deterministic:GpuTokenRounding.StochasticDependsOnSeed:GpuLayerRouting.ProvidedInvalid*:GpuEngine.StoreWeightsNK:GpuEngine.VarlenK:GpuEngine.VarlenKCluster' && compute-sanitizer --tool synccheck --error-exitcode 9 $BUILD/test_gpu --gtest_filter='GpuEngine.StoreWeightsNK:GpuEngine.VarlenK:GpuEngine.VarlenKCluster:GpuEngine.SwiGLUGathered'"
run_step main $BUILD/smoe_main

for k in engine gpu; do
  [ -f "$OUT/$k.log" ] && { echo "---- $k ----"; grep -E "^\[  (PASSED|FAILED)|^\[       OK|FAILED|^  |Failure|Expected|Which is|error|seed" "$OUT/$k.log" | head -60; }
done
for k in memcheck racecheck; do [ -f "$OUT/$k.log" ] && grep -hE "ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK|error" "$OUT/$k.log" | head -10; done
[ -f "$OUT/main.log" ] && { echo "---- main ----"; cat "$OUT/main.log"; }
[ -f "$OUT/ctest.log" ] && { echo "---- ctest ----"; tail -8 "$OUT/ctest.log"; }
echo "==== summary ===="
for k in "${!result[@]}"; do printf "%-10s %s\n" "$k" "${result[$k]}"; done
# The device tool brings back at most 8 files from $OUT: one archive carries every log.
tar czf "$OUT/device_check_logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log 2>/dev/null) 2>/dev/null || true
