#!/usr/bin/env bash
# Run on the GPU machine (device tool), from the repository root, carrying
#   .deps/googletest  .deps/cutlass-<ver>/cutlass_library/source/include  (and tools/util/include)
# Builds with all cores, runs every test (CPU and GPU), compute-sanitizer memcheck and racecheck on
# the small GPU tests, then the main job. Logs go to $OUT (when set). Prints a summary table last.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/versions.env
OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT"
BUILD=build-device
CUTLASS_SRC="$ROOT/.deps/cutlass-$CUTLASS_PIP_VERSION/cutlass_library/source"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
t0=$(date +%s)
cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" \
  -Wno-dev -DSMOE_GTEST_SOURCE_DIR="$ROOT/.deps/googletest" -DSMOE_CUTLASS_DIR="$CUTLASS_SRC" >"$OUT/cmake.log" 2>&1 \
  || { cat "$OUT/cmake.log"; exit 1; }
cmake --build $BUILD -j "$(nproc)" >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"

declare -A result
run_step() {  # name, command...
  local name=$1; shift
  local t=$(date +%s)
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  result[$name]="rc=$rc $(( $(date +%s) - t ))s"
  return $rc
}
run_step ctest bash -c "cd $BUILD && ctest --output-on-failure -j 4 -E gpu_tests"
run_step test_gpu $BUILD/test_gpu
SMALL='GpuRouting.NonFinite*:GpuRouting.ZeroTokens:GpuRouting.WorkspaceTooSmall*:GpuRouting.Deterministic:GpuLayer.SmallShapes*:GpuLayer.Unsupported*'
run_step memcheck compute-sanitizer --tool memcheck --error-exitcode 9 $BUILD/test_gpu --gtest_filter="$SMALL"
run_step racecheck compute-sanitizer --tool racecheck --error-exitcode 9 $BUILD/test_gpu --gtest_filter="GpuRouting.NonFinite*:GpuRouting.Deterministic"
run_step main $BUILD/smoe_main

echo "---- test_gpu ----"; grep -E "^\[  (PASSED|FAILED)|^\[       OK|FAILED|^  |Failure|Expected|Which is|error" "$OUT/test_gpu.log" | head -80
echo "---- sanitizer ----"; grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/memcheck.log" "$OUT/racecheck.log"
echo "---- main ----"; cat "$OUT/main.log"
echo "---- ctest ----"; tail -8 "$OUT/ctest.log"
echo "==== summary ===="
for k in ctest test_gpu memcheck racecheck main; do printf "%-10s %s\n" "$k" "${result[$k]}"; done
