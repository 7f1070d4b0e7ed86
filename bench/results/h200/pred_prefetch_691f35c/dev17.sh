#!/usr/bin/env bash
# session 14 call 1: c19 (predicated epilogue stores + dSwiGLU H prefetch into L2, switch SMOE_ENGINE_H_PREFETCH)
# vs c18 (3584633): A/B on 32 shapes, GPU tests of c19, ncu (source) of dA', layer + torch + sweep at c19
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
C19=$1
for c in c18 c19; do mkdir -p /tmp/$c && for f in prebuilt/$c/*.xz; do xz -d -T8 -c $f > /tmp/$c/$(basename $f .xz); done; chmod +x /tmp/$c/*; done
for i in 1 2; do
  /tmp/c18/bench_layer --configs prebuilt/all_configs.json --warmup 2 --reps 6 > $OUT/c18_$i.log 2>&1
  SMOE_ENGINE_H_PREFETCH=0 /tmp/c19/bench_layer --configs prebuilt/all_configs.json --warmup 2 --reps 6 > $OUT/c19nopf_$i.log 2>&1
  /tmp/c19/bench_layer --configs prebuilt/all_configs.json --warmup 2 --reps 6 > $OUT/c19_$i.log 2>&1
  echo "ab $i $(( $(date +%s)-T0 ))s"; done
python3 bench/stage_modes.py c18_1=$OUT/c18_1.log c19nopf_1=$OUT/c19nopf_1.log c19_1=$OUT/c19_1.log c18_2=$OUT/c18_2.log c19nopf_2=$OUT/c19nopf_2.log c19_2=$OUT/c19_2.log > $OUT/e0_ab.md 2>&1
grep -E "up_proj|dA_proj|all stages" $OUT/e0_ab.md
/tmp/c19/test_gpu --gtest_filter='GpuEngine.*:GpuLayer.*:GpuBadInput.*' > $OUT/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s)-T0 ))s: $(grep -E '^\[  (PASSED|FAILED) ' $OUT/tests.log | tr '\n' ' ')"; grep -E "^\[  FAILED|Failure" $OUT/tests.log | head -12
OUT=$OUT/bench BUILD=/tmp/c19 bash scripts/device_bench.sh $C19 > $OUT/device_bench.log 2>&1
echo "bench done $(( $(date +%s)-T0 ))s"; tail -14 $OUT/bench/layer.md; tail -10 $OUT/bench/sweep.md
mkdir -p build-device && cp /tmp/c19/bench_layer build-device/
NCU_CONFIGS='1.4B n256 E128 K8,OLMoE-7B,Qwen3-235B,120B n1024 E128 K8' NCU_KERNEL='EpiDSwiGLU' NCU_LAUNCHES=1 NCU_SOURCE=1 OUT=$OUT/ncu bash scripts/device_ncu.sh > $OUT/ncu.log 2>&1
echo "ncu done $(( $(date +%s)-T0 ))s"; grep -E "^\| [0-9]|==" $OUT/ncu.log
cd $OUT && tar czf e1_all.tgz *.log *.md ncu bench
