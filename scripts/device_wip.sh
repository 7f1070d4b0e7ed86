#!/usr/bin/env bash
# Tries the work-in-progress patches of docs/wip/ on the GPU machine (device tool, kind nvidia-h200),
# from the repository root, carrying .deps/googletest and the CUTLASS headers as device_check.sh:
#   1. applies WIP_PATCHES (default: every docs/wip/*.patch) to the working copy;
#   2. builds (scripts/device_check.sh with no test step);
#   3. runs the GPU tests the patches touch (engine, layer, bad input), WIP_TEST_TIMEOUT seconds;
#   4. gate/up as two tensors: bench_layer stage times with SMOE_BENCH_GATE_UP=two (MoEWeights::w3)
#      against the interleaved layout, on WIP_CONFIGS;
#   5. torch: pip install . (the extension with the patches) and pytest tests/python;
#   6. module: bench/module_vs_op.py (the torch module's time against the bare op), after torch;
#   dw: bench_layer's dW1 / dW2 stage times with SMOE_DW_PATH=engine, =cutlass and =engine_tma
#   (WIP_DW_CONFIGS);
#   ep1: build-device/test_ep on this one GPU (GpuEp.WorldOne*: the window-alias fix);
#   cluster: the varlen-M GEMMs with the heuristic's cluster and with SMOE_ENGINE_CLUSTER=2, on
#   bench/cluster_sweep_configs.json (12-48 MiB of gate/up per expert) and Qwen3-235B (exactly 24 MiB,
#   the threshold, so no cluster by default): where the 2-CTA B multicast starts to pay.
#   envs: bench_layer once per word of WIP_ENV_SWEEP (VAR=value[,VAR=value], or "default"), e.g.
#   'SMOE_ENGINE_PREFETCH=0 default SMOE_ENGINE_PREFETCH=4 SMOE_DW_PATH=engine', on WIP_ENV_CONFIGS
#   (default WIP_CONFIGS); one log per word, and wip_env_table.md with every run side by side.
# WIP_STEPS (default "tests bench torch") picks steps 3-5, e.g. two calls: "tests bench", then "torch"
# (a warm machine keeps build-device/; the patches apply again without harm: already-applied ones
# are skipped). Logs to $OUT and $OUT/device_wip.tgz. Nothing is committed: land a patch only if its
# tests pass.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT"
WIP_STEPS="${WIP_STEPS:-tests bench torch}"
has() { case " $WIP_STEPS " in *" $1 "*) return 0;; esac; return 1; }
# Refreshed after every step: the device tool returns only the first 8 files of $OUT by name, and a
# call cut off at its limit then still brings back the steps that finished (device_wip.tgz).
pack_wip() {
  tar czf "$OUT/device_wip.tgz.tmp" -C "$OUT" $(cd "$OUT" && ls wip_* 2>/dev/null) 2>/dev/null &&
    mv "$OUT/device_wip.tgz.tmp" "$OUT/device_wip.tgz"
}
shopt -s nullglob
# Default: every docs/wip patch but the expert-parallel ones (ep_*: scripts/device_ep.sh applies
# those through EP_WIP_PATCHES; ep_forward_ready_counters and pp_da_row_prefetch together spill in
# da_dswiglu_pp<128>, which fails the build).
default_patches=$(ls docs/wip/*.patch 2>/dev/null | grep -v '^docs/wip/ep_')
for p in ${WIP_PATCHES:-$default_patches}; do
  if git apply --reverse --check "$p" 2>/dev/null; then echo "already applied $p"
  elif git apply "$p" 2>/dev/null || patch -p1 --forward --silent < "$p"; then echo "applied $p"
  else echo "FAILED to apply $p"; fi
done
# The torch extension's own CMake build (build-torch/, pip) runs next to the C++ build: the two
# share no objects (static vs shared cudart), and together they fill the cores that one build's
# serial tail leaves idle (on a fresh machine the torch step is otherwise ~150 s after the build).
pip_pid=""
if has torch; then
  (timeout 400 python3 -m pip install --no-build-isolation --no-deps -q . >"$OUT/wip_pip.log" 2>&1; echo $? >"$OUT/wip_pip.rc") &
  pip_pid=$!
fi
# WIP_PREBUILT=<dir>: test_gpu / bench_layer (/ test_ep) built on the CPU machine with the same
# patches (scripts/prebuild_wip.sh) and carried; used if they start here, which saves the ~80 s
# build of every first call. Otherwise (or if they do not start) the usual build.
BIN=build-device
if [ -n "${WIP_PREBUILT:-}" ] && [ -x "$WIP_PREBUILT/test_gpu" ] &&
   "$WIP_PREBUILT/test_gpu" --gtest_list_tests >/dev/null 2>&1; then
  BIN=$WIP_PREBUILT
  echo "prebuilt binaries from $BIN: no build ($(cat "$BIN/PREBUILT" 2>/dev/null))"
else
  [ -n "${WIP_PREBUILT:-}" ] && echo "prebuilt binaries in $WIP_PREBUILT do not start here: building"
  STEPS=none bash scripts/device_check.sh 2>&1 | grep -E "build:|error" | head -20
fi
[ -x $BIN/test_gpu ] || { echo "no test binary: build failed"; exit 1; }
if has tests; then
  timeout "${WIP_TEST_TIMEOUT:-400}" $BIN/test_gpu \
    --gtest_filter="${WIP_TEST_FILTER:-GpuEngine.*:GpuBadInput.*:GpuLayer.*:GpuLayerRouting.*}" >"$OUT/wip_tests.log" 2>&1
  echo "tests rc=$?"
  grep -E "^\[  (PASSED|FAILED)|^\[  FAILED|Failure|Expected|Which is" "$OUT/wip_tests.log" | head -40
  pack_wip
fi
if has ep1 && [ -x $BIN/test_ep ]; then
  timeout 120 $BIN/test_ep >"$OUT/wip_ep1.log" 2>&1
  echo "test_ep (one GPU) rc=$?"; grep -E "SKIPPED|PASSED|FAILED|Failure" "$OUT/wip_ep1.log" | head -10
  pack_wip
fi
# No timing while the torch build still compiles next to it (host load perturbs launch-bound stages).
[ -n "$pip_pid" ] && { has bench || has dw; } && wait "$pip_pid"
CONFIGS="${WIP_CONFIGS:-1.4B n256 E128 K8,30B n256 E256 K16,OLMoE-7B,Qwen3-235B,DeepSeek-V3.2}"
if has bench && [ -x $BIN/bench_layer ]; then
  for mode in interleaved two; do
    if [ "$mode" = two ]; then export SMOE_BENCH_GATE_UP=two; else unset SMOE_BENCH_GATE_UP; fi
    timeout 200 $BIN/bench_layer --only "$CONFIGS" --warmup 2 --reps 5 >"$OUT/wip_bench_$mode.log" 2>&1
    echo "== $mode"; grep -oE "^[^ ].*|up_proj=[0-9.]+|dA_proj=[0-9.]+|dW1=[0-9.]+|dX_proj=[0-9.]+" "$OUT/wip_bench_$mode.log" | head -40
  done
  unset SMOE_BENCH_GATE_UP
  pack_wip
fi
if has dw && [ -x $BIN/bench_layer ]; then  # the weight-gradient path: engine vs CUTLASS
  for mode in engine cutlass engine_tma; do
    path=$mode
    SMOE_DW_PATH=$path timeout 200 $BIN/bench_layer --only "${WIP_DW_CONFIGS:-$CONFIGS}" \
      --warmup 2 --reps 5 >"$OUT/wip_dw_$mode.log" 2>&1
    echo "== SMOE_DW_PATH=$path"
    sed -n '/^per-stage/,$p' "$OUT/wip_dw_$mode.log" | sed -E 's/ +fwd\.[^ ]+//g; s/ +bwd\.(dA_proj|router_bwd|dX_proj|dx_sum)=[^ ]+//g'
    pack_wip
  done
fi
if has envs && [ -x $BIN/bench_layer ]; then  # one bench_layer run per VAR=value word
  for kv in ${WIP_ENV_SWEEP:-default}; do
    tag=$(echo "$kv" | tr -c 'A-Za-z0-9\n' '_')
    if [ "$kv" = default ]; then envs=(); else IFS=, read -r -a envs <<<"$kv"; fi  # A=1,B=2: both
    env ${envs[@]+"${envs[@]}"} timeout 200 $BIN/bench_layer --only "${WIP_ENV_CONFIGS:-$CONFIGS}" --warmup 2 --reps 5 \
      >"$OUT/wip_env_$tag.log" 2>&1
    echo "== $kv"
    sed -n '/^per-stage/,/^host/p' "$OUT/wip_env_$tag.log" |
      sed -E 's/ +(fwd|bwd)\.(router_gemm|routing|aggregate|router_bwd|dx_sum|nan_guard)=[^ ]+//g'
    pack_wip
  done
  # Every run of this call side by side, per config and stage (bench/stage_modes.py).
  runs=()
  for kv in ${WIP_ENV_SWEEP:-default}; do
    tag=$(echo "$kv" | tr -c 'A-Za-z0-9\n' '_')
    runs+=("$tag=$OUT/wip_env_$tag.log")
  done
  python3 bench/stage_modes.py "${runs[@]}" >"$OUT/wip_env_table.md" 2>&1 && cat "$OUT/wip_env_table.md"
  pack_wip
fi
if has cluster && [ -x $BIN/bench_layer ]; then
  for c in default 2; do
    for cfgs in bench/cluster_sweep_configs.json bench/configs.json; do
      only=""; [ "$cfgs" = bench/configs.json ] && only="--only Qwen3-235B"
      tag=$(basename "$cfgs" .json)
      if [ "$c" = 2 ]; then export SMOE_ENGINE_CLUSTER=2; else unset SMOE_ENGINE_CLUSTER; fi
      timeout 200 $BIN/bench_layer --configs "$cfgs" $only --warmup 2 --reps 5 >"$OUT/wip_cluster_${c}_$tag.log" 2>&1
      echo "== cluster $c ($tag)"
      sed -n '/^per-stage/,$p' "$OUT/wip_cluster_${c}_$tag.log" |
        sed -E 's/ +(fwd|bwd)\.(router_gemm|routing|aggregate|dW2|router_bwd|dW1|dx_sum)=[^ ]+//g'
      pack_wip
    done
  done
  unset SMOE_ENGINE_CLUSTER
fi
if has torch; then
  wait "$pip_pid" 2>/dev/null
  echo "pip rc=$(cat "$OUT/wip_pip.rc" 2>/dev/null || echo '?')"
  (cd /tmp && timeout 200 python3 -m pytest -q "$ROOT/tests/python" -p no:cacheprovider) >"$OUT/wip_pytest.log" 2>&1
  echo "pytest rc=$?"; tail -3 "$OUT/wip_pytest.log"; grep -E "^FAILED|Error" "$OUT/wip_pytest.log" | head -10
fi
if has module; then  # the module's cost over the op (no per-step weight copy), after the torch step
  timeout 200 python3 bench/module_vs_op.py --out "$OUT/wip_module_vs_op.json" \
    --commit "${SMOE_COMMIT:-$(git rev-parse HEAD)}" >"$OUT/wip_module_vs_op.log" 2>&1
  echo "module_vs_op rc=$?"; cat "$OUT/wip_module_vs_op.log" | tail -12
fi
pack_wip || true
