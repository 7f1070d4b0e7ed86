#!/usr/bin/env bash
# Expert-parallel checks and benchmarks on the 2-GPU machine (device tool kind nvidia-h200-x2), from
# the repository root, carrying .deps/googletest and the CUTLASS headers (as device_check.sh).
# Steps (EP_STEPS, default "build test comm torch train"):
#   build   cmake build in build-device/ (all cores)       test   test_ep (C++, 2 GPUs)
#   comm    ep_comm_bench: dispatch / combine bandwidth    torch  pip install . + tests/python/test_ep.py
#   train   examples/ep_train under torchrun (EP = 2)      bench  bench/ep_baseline.py (EP_CONFIGS, EP_SYSTEMS;
#           EP_PROFILE=1 adds each system's kernel time per call, torch.profiler, and its top kernels to the log)
#   overlap ours_ep with SMOE_EP_OVERLAP=0 and =1 (EpConfig::overlap; EP_WIP_PATCHES=docs/wip/ep_backward_x_overlap.patch
#           until it lands), EP_CONFIGS
#   pkb     issue 12: bench/pkb_ep.py at every world size in PKB_SIZES (default 1 2 4 8, those the
#           machine has) and scaling mode in PKB_SCALING (default strong weak), then
#           bench/pkb_report.py -> $OUT/ep_scaling.{json,md,png}; PKB_SEEDS (2), PKB_TIMEOUT (300 s a run)
#   sanitize  compute-sanitizer memcheck on two small EP tests. Does not finish: under the sanitizer
#             the two GPUs' kernels (one process, a thread per GPU) serialise, so a kernel waiting at
#             an LSA barrier for its peer never sees it arrive (timed out at 300 s on 6910319).
#             Kept for a later multi-process test binary; sanitize the single-GPU tests instead.
# Logs and results go to $OUT, and all of them into $OUT/device_ep.tgz.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0   # NVLink multicast stays off on shared machines
STEPS="${EP_STEPS:-build test comm torch train}"
# The commit results are labelled with: pass SMOE_COMMIT from the local side (put the hash in the
# device command). The device's copy of .git may be stale: on 2026-11-30 it reported the session's
# first commit (6ab4848) for a run of a69cc78's tree.
COMMIT="${SMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
step() {  # name timeout command...
  local name=$1 t=$2; shift 2
  local t0=$(date +%s)
  timeout --kill-after=10 "$t" "$@" >"$OUT/ep_$name.log" 2>&1
  local rc=$?
  # A timed-out torchrun can leave its workers running, holding GPU memory (on 2026-11-30 one held
  # 95 GB of GPU 0 and the next call's DeepSeek run ran out of memory): kill them.
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    pkill -9 -f "[b]ench/(pkb_ep|ep_baseline)\.py|[e]xamples/ep_train" 2>/dev/null
    sleep 2
  fi
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s"
  pack_out
  return $rc
}
# The device tool returns at most 8 files from $OUT, the first by name (build.log, cmake.log,
# device_check_logs.tgz, device_ep.tgz, ...): every step refreshes device_ep.tgz, so a call cut off
# by the tool's limit still brings back what finished (on 2026-11-30 pkb_strong_1.json was lost so).
pack_out() {
  tar czf "$OUT/device_ep.tgz.tmp" -C "$OUT" $(cd "$OUT" && ls ep_* pkb_* 2>/dev/null) 2>/dev/null &&
    mv "$OUT/device_ep.tgz.tmp" "$OUT/device_ep.tgz"
}
# A previous call on this (warm) machine that ran past the device tool's limit leaves its torchrun
# workers behind, still holding GPU memory: clear them before anything runs.
pkill -9 -f "[b]ench/(pkb_ep|ep_baseline)\.py|[e]xamples/ep_train" 2>/dev/null && sleep 2
# EP_WIP_PATCHES: docs/wip patches to apply first (e.g. docs/wip/ep_backward_x_overlap.patch).
for p in ${EP_WIP_PATCHES:-}; do
  if git apply --reverse --check "$p" 2>/dev/null; then echo "already applied $p"
  elif git apply "$p"; then echo "applied $p"; else echo "FAILED to apply $p"; fi
done
pip_pid=""
if has build && has torch; then  # the torch extension's build next to the C++ one (device_wip.sh does the same)
  (step pip 400 python3 -m pip install --no-build-isolation --no-deps -q .) &
  pip_pid=$!
fi
if has build; then
  STEPS=none bash scripts/device_check.sh >/dev/null 2>&1
  ls build-device/test_ep build-device/ep_comm_bench >/dev/null 2>&1 || { echo "build failed"; grep -E "error" out/build.log | head; }
fi
has test && { step test 200 build-device/test_ep; grep -E "PASSED|FAILED|Failure|error" "$OUT/ep_test.log" | head -20; }
has sanitize && { step sanitize 300 compute-sanitizer --tool memcheck --error-exitcode 9 build-device/test_ep \
  --gtest_filter='GpuEp.RandomRoutingUnevenRanks:GpuEp.RoundtripIsRanksTimesX'; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/ep_sanitize.log" | head; }
# No timing while the torch build still compiles next to it.
[ -n "$pip_pid" ] && { wait "$pip_pid"; pip_pid=""; }
has comm && { step comm 200 build-device/ep_comm_bench --reps 20 --out "$OUT/ep_comm_$COMMIT.json"; tail -20 "$OUT/ep_comm.log"; }
if has torch; then
  # Built next to the C++ build when both steps ran (waited for above); otherwise here.
  [ -f "$OUT/ep_pip.log" ] || step pip 300 python3 -m pip install --no-build-isolation --no-deps -q .
  (cd /tmp && step pytest 300 python3 -m pytest -q "$ROOT/tests/python/test_ep.py" -p no:cacheprovider); tail -5 "$OUT/ep_pytest.log"
fi
has train && { step train 200 torchrun --nproc_per_node 2 examples/ep_train/ep_train.py --steps 100; grep -vE "Warning|\*\*\*\*" "$OUT/ep_train.log" | tail -14; }
if has bench; then
  SMOE_COMMIT=$COMMIT step bench "${EP_BENCH_TIMEOUT:-500}" torchrun --nproc_per_node 2 bench/ep_baseline.py --warmup "${EP_WARMUP:-2}" --reps "${EP_REPS:-7}" \
    ${EP_CONFIGS:+--only "$EP_CONFIGS"} --systems "${EP_SYSTEMS:-torchtitan_a2a,ours_local_a2a,ours_ep}" --out "$OUT/ep_$COMMIT.json" \
    ${EP_PROFILE:+--profile}
  grep -E "^RESULT" "$OUT/ep_bench.log" | cut -c1-400
fi
if has overlap; then  # EpConfig::overlap: ours_ep at each level of EP_OVERLAPS (default 0 1; 2 needs ep_forward_ready_counters)
  for ov in ${EP_OVERLAPS:-0 1}; do
    SMOE_EP_OVERLAP=$ov SMOE_COMMIT=$COMMIT step "overlap_$ov" "${EP_BENCH_TIMEOUT:-240}" torchrun --nproc_per_node 2 \
      bench/ep_baseline.py --warmup "${EP_WARMUP:-2}" --reps "${EP_REPS:-7}" ${EP_CONFIGS:+--only "$EP_CONFIGS"} \
      --systems ours_ep --out "$OUT/ep_overlap_${ov}_$COMMIT.json"
    grep -E "^RESULT" "$OUT/ep_overlap_$ov.log" | cut -c1-400
  done
fi
if has pkb; then
  NG=$(nvidia-smi -L | wc -l)
  for R in ${PKB_SIZES:-1 2 4 8}; do
    [ "$R" -le "$NG" ] || continue
    for sc in ${PKB_SCALING:-strong weak}; do
      SMOE_COMMIT=$COMMIT step "pkb_${sc}_$R" "${PKB_TIMEOUT:-300}" torchrun --nproc_per_node "$R" bench/pkb_ep.py \
        --scaling "$sc" --seeds "${PKB_SEEDS:-2}" ${EP_CONFIGS:+--only "$EP_CONFIGS"} --out "$OUT/pkb_${sc}_$R.json"
      grep -E "^FAST@P" "$OUT/ep_pkb_${sc}_$R.log"
    done
  done
  python3 bench/pkb_report.py "$OUT"/pkb_*.json --out "$OUT/ep_scaling" --device "$NG x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
    --date "$(date +%F)" && head -12 "$OUT/ep_scaling.md"
fi
pack_out || true
