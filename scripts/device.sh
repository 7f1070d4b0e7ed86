#!/usr/bin/env bash
# The one script for the GPU machine (device tool): named steps, run in the order given.
#
#   scripts/device.sh [--dry-run] STEP [STEP ...]    e.g. scripts/device.sh build test sanitize
#   scripts/device.sh --list                          the steps, one line each
#   --dry-run (or DEVICE_DRY_RUN=1): print every command a step would run, run none (any machine).
#
# Steps:
#   build     configure (CMake + Ninja, Release) and build everything in $BUILD (default build/)
#             with all cores; GoogleTest from .deps/googletest (the GPU machine has no
#             libgtest-dev), CUTLASS from .deps/cutlass-<ver> (scripts/versions.env). When a later
#             step needs the PyTorch extension, its build (pip install .) starts next to this one.
#             BUILD_TARGETS='t1 t2': only those CMake targets (e.g. gather_sum_bench: seconds, not
#             the ~70-110 s of everything). BUILD_PATCH='p1 p2': patches applied first (the tree stays
#             patched for the call's later steps; a later build on the warm machine rebuilds their files)
#   test      the GPU tests (test_gpu, TEST_FILTER selects; TEST_TIMEOUT, 400 s), the host tests (test_api:
#             some take a GPU branch on the device) and the main job
#             (smoe_main: the GPU routing check and one layer benchmark)
#   sanitize  compute-sanitizer on small GPU tests: memcheck, racecheck, synccheck
#             (SANITIZE_TOOLS picks, SANITIZE_TIMEOUT per tool, 300 s; SANITIZE_FILTER replaces every
#             tool's gtest filter, e.g. the tests of a patch's new kernels)
#   bench     bench_layer and the torch baseline (bench/baselines/torch_baseline.py) on
#             bench/configs/configs.json, merged by bench/reports/merge_results.py into
#             $OUT/bench/layer.{json,md}; then the same for each <name> of BENCH_SWEEPS (default
#             "sweep wide": bench/configs/<name>_configs.json -> $OUT/bench/<name>.{json,md}; the wide
#             experts, E <= 16 at K = 1 and few tokens per expert are in wide). BENCH_CONFIGS=A,B: only
#             those, no sweep; BENCH_SWEEP=0: no sweep; BENCH_WARMUP (3), BENCH_REPS (15),
#             BENCH_TIMEOUT (500 s a command)
#   sonic     SonicMoE next to ours and torch in one process (bench/drivers/side_by_side.py), carrying
#             .whl (bench/baselines/sonicmoe_env.sh pack). SONIC_STAGE=warm (default: builds our
#             extension, runs SonicMoE alone on SONIC_WARM_CONFIG so its cold (quack) autotune
#             fills the machine's cache) or run (the next call on the still-warm machine:
#             SONIC_CONFIGS names, default all of SONIC_CONFIGS_FILES: bench/configs/configs.json,
#             or several files comma-separated, e.g. adding sweep_configs.json and wide_configs.json;
#             SONIC_ROUNDS: side_by_side.py's --rounds, ours and SonicMoE in alternating rounds after
#             the sequential measurement, default 4, 0 none).
#             SONIC_BUDGET (570 s from the script's start) caps both. SONIC_STAGE=profile (after warm, as
#             run): bench/drivers/sonic_profile.py, both systems' kernels one by one (torch.profiler) on
#             SONIC_PROFILE_CONFIGS (default the large six) -> $OUT/sonic/profile/{<config>.<system>.md,profile.json};
#             SONIC_PROFILE_RESUME=<an earlier call's profile.json, copied into the tree>: profile only what it lacks.
#             SONIC_STAGE=ncu (after warm, as run): each GEMM's launch configuration and throughputs under
#             Nsight Compute, ours beside SonicMoE's, one ncu run per (config, system) of SONIC_NCU_CONFIGS
#             (default 30B n256, 30B n512, Qwen3-Next) -> $OUT/sonic/ncu/{sonic_ncu.md,<config>.<system>.csv}
#             (SONIC_NCU_METRICS, SONIC_NCU_FLAGS: extra ncu words; SONIC_NCU_TIMEOUT, 300 s a run).
#             Every stage seeds quack's autotune cache with bench/baselines/sonic_autotune/<card>/ and
#             brings the cache's results back in $OUT/sonic/autotune/<card>/ (SONIC_AUTOTUNE_SEED=0: none copied in)
#   tune      the engine tuner's evidence: for each configs file of TUNE_CONFIGS (default
#             bench/configs/configs.json and bench/configs/wide_configs.json; the 41 shapes for
#             re-deriving the heuristic add sweep_configs.json and tune_extra_configs.json) build/smoe_tune into a
#             new cache $OUT/tune/<name>.cache.json, then TUNE_PASSES (2) interleaved passes of
#             bench_layer with the heuristic (SMOE_ENGINE_TUNE=0) and with that cache
#             (BENCH_WARMUP 3, BENCH_REPS 10, TUNE_TIMEOUT 300 s a command), then
#             bench/reports/tuner_report.py -> $OUT/tune/tuner.{json,md} and
#             bench/reports/memory_stages.py -> $OUT/tune/memory_stages.md (bench/results/h200/), and
#             bench/reports/heuristic_fit.py -> $OUT/tune/heuristic_fit.md (this build's heuristic against
#             every key's measured candidates; bench/results/h100/)
#   ncu       Nsight Compute on one forward + backward of bench_layer per config of NCU_CONFIGS
#             (OLMoE-7B; names from NCU_CONFIGS_FILE, bench/configs/configs.json: e.g.
#             bench/configs/wide_configs.json): SpeedOfLight, WarpStateStats, Occupancy; bench/reports/ncu_summary.py
#             makes one line per kernel. NCU_TIMEOUT (240 s), NCU_ENV (VAR=value words for the
#             run), NCU_LAUNCHES (60), NCU_KERNEL (regex on the demangled name), NCU_SECTIONS
#             (more sections; their details page too), NCU_FLAGS (e.g. '--clock-control none'),
#             NCU_SOURCE=1 (SourceCounters: per-SASS-instruction stalls, ncu_source_top.py),
#             NCU_KEEP_REPORTS=1 (the .ncu-rep files too: large)
#   ep        expert parallelism, kind nvidia-h200-x2 (2 GPUs): the sub-steps of EP_STEPS
#             (default "test comm torch train"):
#               test      test_ep (C++, 2 GPUs)
#               comm      ep_comm_bench: dispatch / combine bandwidth
#               torch     the extension + tests/python/test_ep.py
#               train     examples/ep_train under torchrun (EP = 2, 100 steps)
#               bench     bench/baselines/ep_baseline.py (EP_CONFIGS, EP_SYSTEMS, EP_WARMUP 2,
#                         EP_REPS 7, EP_BENCH_TIMEOUT 500 s; EP_PROFILE=1 adds kernel times per call)
#               overlap   ours_ep at each SMOE_EP_OVERLAP of EP_OVERLAPS (default "0 1")
#               pkb       bench/drivers/pkb_ep.py at every world size of PKB_SIZES (1 2 4 8, those
#                         the machine has) and scaling of PKB_SCALING (strong weak), PKB_SEEDS (2),
#                         PKB_TIMEOUT (300 s a run), then bench/reports/pkb_report.py
#               sanitize  memcheck on two small EP tests. It does not finish: under the sanitizer
#                         the two GPUs' kernels (one process, a thread per GPU) serialise and a
#                         kernel waiting at an LSA barrier for its peer times out. Kept for a later
#                         multi-process test binary.
#   pytest    build the PyTorch extension (pip install --no-build-isolation .) and run
#             tests/python from /tmp (PYTEST_TIMEOUT, 480 s: the folder takes ~4 min on an H100; the
#             two-GPU EP tests skip on one GPU)
#   digest    $BUILD/layer_digest > $OUT/digest.txt (fails, saying so, when the binary is missing)
#   gather    the gather-sums alone: $BUILD/gather_sum_bench (every built variant against the kernel
#             before them and a copy; GATHER_SHAPES=T:d:K:E,... replaces its shapes, GATHER_REPS 20)
#             -> $OUT/gather/gather_sum.{json,txt} (bench/results/h100/gather_sum.md)
#   router    the router GEMM alone: $BUILD/router_gemm_bench (the layer's cublasGemmEx against every
#             algorithm cublasLt's heuristic offers and a copy of x; ROUTER_SHAPES=T:d:E,... replaces its
#             shapes, ROUTER_REPS 20) -> $OUT/router/router_gemm.{json,txt}
#   ab        a same-call layer A/B (run after build: the build is side A). AB_PATCH (e.g.
#             docs/wip/<name>.patch, or several space-separated, applied in order on top of each
#             other): applied, rebuilt as side B, AB_TEST_FILTER run on it, then reverted in the
#             tree ($BUILD keeps side B); without it B is A's binary (env A/Bs).
#             AB_VARIANTS: side B's runs, 'name:VAR=v VAR2=w;name2:...' (default 'b:'); AB_ENV_A: side
#             A's VAR=value words. layer_digest of A and of the first variant must match bitwise
#             (AB_DIGEST=0: not compared; AB_DIGEST_VARIANTS='all' or 'v1 v2': those variants'). Then AB_ROUNDS (3) interleaved rounds (A, each variant; even
#             rounds in the reverse order unless AB_ORDER=fixed) of
#             bench_layer over each configs file stem of AB_CONFIGS (default "configs wide_configs":
#             bench/configs/<stem>.json; 'unseen': bench/configs/unseen.py's draw with seed
#             AB_UNSEEN_SEED, default today's date, in $OUT/ab/unseen.json; or a path to a configs
#             JSON, e.g. docs/wip/<name>.heldout.json, its stem the file name; 'v1,v2=<entry>': only
#             A and those variants run on it, e.g. each rule's variant on its own held-out shapes), SMOE_ENGINE_TUNE=0,
#             AB_WARMUP (2), AB_REPS (8), AB_TIMEOUT (150 s a pass) -> $OUT/ab/<side>_<stem>_<round>.json, then
#             bench/reports/layer_ab.py per variant and stem -> $OUT/ab/ab_<variant>_<stem>.{json,md}
#
# Output: every step prints a header and a few summary lines here, logs everything to
# $OUT/<step>.log and puts its other files in $OUT/<step>/. OUT defaults to ./device_out (the
# device tool sets it). The device tool brings back at most 8 files of $OUT, so $OUT/00-all.tgz,
# rewritten after every step, holds all of them (a call cut off at its limit still returns what
# finished). Exit status: 0 when every step passed, 1 when any failed (the later steps still run),
# 2 for bad usage. SMOE_COMMIT labels results (pass the hash: the device's copy of .git can be
# stale; on 2026-11-30 it reported the session's first commit for a later tree).
#
# Device calls (each command at most 600 s; a warm machine keeps build/, so a second call's build
# step is incremental). Carry for build: [".deps/googletest",
# ".deps/cutlass-4.2.0.0/cutlass_library/source/include"] (31 MB):
#   run(command="scripts/device.sh build test sanitize", carry=[...])   # ~80 s build, ~200 s tests
#   run(command="SMOE_COMMIT=<hash> scripts/device.sh build bench", carry=[...])
#   run(command="SMOE_COMMIT=<hash> scripts/device.sh build pytest digest", carry=[...])
#   run(command="EP_STEPS='test comm torch train' scripts/device.sh build ep", carry=[...], kind="nvidia-h200-x2")
#   run(command="SONIC_STAGE=warm scripts/device.sh sonic", carry=[".whl"]), then SONIC_STAGE=run
#     within ~30 s (the .whl of sonicmoe_env.sh pack holds the CUTLASS headers and GoogleTest's sources
#     too, so carry=[".whl"] alone also serves `build`: .whl and .deps together exceed the 64 MiB).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=versions.env
source scripts/versions.env

ALL_STEPS="build test sanitize bench tune sonic ncu ep pytest digest gather router ab"
OUT="${OUT:-$ROOT/device_out}"
BUILD="${BUILD:-build}"
DRY="${DEVICE_DRY_RUN:-0}"
CUTLASS_SRC="$ROOT/.deps/cutlass-$CUTLASS_PIP_VERSION/cutlass_library/source"
COMMIT="${SMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
T0=$(date +%s)
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0   # NVLink multicast stays off on shared machines
case ":$PATH:" in *:/usr/local/cuda/bin:*) ;; *) PATH="$PATH:/usr/local/cuda/bin" ;; esac

usage() { sed -n '2,/^set -uo/{/^#/s/^# \{0,1\}//p}' "$0"; }

steps=()
for a in "$@"; do
  case "$a" in
    --dry-run|-n) DRY=1 ;;
    --list) for s in $ALL_STEPS; do echo "$s"; done; exit 0 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "device.sh: unknown option $a" >&2; exit 2 ;;
    *) case " $ALL_STEPS " in
         *" $a "*) steps+=("$a") ;;
         *) echo "device.sh: unknown step '$a' (steps: $ALL_STEPS)" >&2; exit 2 ;;
       esac ;;
  esac
done
[ ${#steps[@]} -gt 0 ] || { usage >&2; exit 2; }
wants() { case " ${steps[*]} " in *" $1 "*) return 0 ;; esac; return 1; }

mkdir -p "$OUT"
STATE="$(mktemp -d)"      # this call's flags (the torch extension's build)
PGFILE="${TMPDIR:-/tmp}/smoe_device.pgids"   # process groups of commands in flight (see xt)
export SMOE_DEVICE_CALL="$$.$T0"              # marks the processes this script starts

# ---- helpers -------------------------------------------------------------------------------------
say() { printf '%s\n' "$*"; }
quote() { local s; printf -v s '%q ' "$@"; printf '%s' "${s% }"; }
dry() { [ "$DRY" = 1 ]; }
body() { tail -n +2 "$1"; }   # a step's log without its header line
redir_text() {  # redir_text MODE FILE: " > FILE" (-o) or " &> FILE" (-a), FILE relative to the root
  case "$1" in -o) printf ' > %s' "${2#"$ROOT"/}" ;; -a) printf ' &> %s' "${2#"$ROOT"/}" ;; esac
}

# x [-o FILE | -a FILE] CMD...: print the command, then run it (a dry run prints only).
# -o: its stdout to FILE; -a: stdout and stderr to FILE. Otherwise both go to the step's log.
x() {
  local mode="" f=""
  case "${1:-}" in -o|-a) mode=$1; f=$2; shift 2 ;; esac
  say "+ $(quote "$@")$(redir_text "$mode" "$f")"
  dry && return 0
  case "$mode" in
    -o) "$@" >"$f" ;;
    -a) "$@" >"$f" 2>&1 ;;
    *) "$@" ;;
  esac
}

# ended_text RC LIMIT ELAPSED UPTIME0: how a command under `timeout --kill-after=10` ended. 124 is its
# limit; 137 is SIGKILL, which is the limit's follow-up kill only when the limit has passed: a SIGKILL
# before it came from elsewhere (the host's OOM killer, say; the 2026-12-07 pytest step died so after
# 82 of 400 s), and calling that a time-out sends the next session after the wrong cause. The kernel
# log's OOM lines are shown only when newer than the command's start (UPTIME0, /proc/uptime seconds).
ended_text() {
  local rc=$1 secs=$2 took=$3 up0=${4:-0} oom
  if [ "$rc" -eq 124 ] || [ "$took" -ge "$secs" ]; then
    echo "(timed out after $secs s)"
  else
    oom=$(dmesg 2>/dev/null | awk -F'[][]' -v t="$up0" '$2 + 0 > t' | grep -iE 'killed process|out of memory' |
      tail -n 1 || true)
    echo "(killed by SIGKILL after $took of $secs s: not the time limit; the host's OOM killer?" \
      "dmesg since the start: ${oom:-none readable})"
  fi
}

# xt [-o FILE | -a FILE] SECONDS CMD...: x under `timeout`, which runs the command in a process
# group of its own and ends the whole group (torchrun's workers too) at the limit. The group is
# recorded in $PGFILE while it runs: a call that the device tool cuts off leaves it there, and the
# next call on the warm machine ends it before anything runs (leftover torchrun workers held 95 GB
# of GPU 0 on 2026-11-30 and the next call ran out of memory).
xt() {
  local mode="" f=""
  case "${1:-}" in -o|-a) mode=$1; f=$2; shift 2 ;; esac
  local secs=$1; shift
  [ "$secs" -ge 1 ] 2>/dev/null || { say "no time left for: $(quote "$@")"; return 124; }
  say "+ timeout $secs $(quote "$@")$(redir_text "$mode" "$f")"
  dry && return 0
  case "$mode" in
    -o) timeout --kill-after=10 "$secs" "$@" >"$f" & ;;
    -a) timeout --kill-after=10 "$secs" "$@" >"$f" 2>&1 & ;;
    *) timeout --kill-after=10 "$secs" "$@" & ;;
  esac
  local pid=$! rc t0=$SECONDS up0
  up0=$(cut -d' ' -f1 /proc/uptime 2>/dev/null || echo 0)
  echo "$pid" >>"$PGFILE"
  wait "$pid"; rc=$?
  sed -i "/^$pid\$/d" "$PGFILE" 2>/dev/null
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    say "$(ended_text "$rc" "$secs" $((SECONDS - t0)) "$up0")"
    kill -9 -- "-$pid" 2>/dev/null
  fi
  return "$rc"
}

# Process groups an earlier call left in $PGFILE: ended only if one of their processes carries
# SMOE_DEVICE_CALL (i.e. was started by this script), so a reused id is left alone.
end_leftovers() {
  [ -s "$PGFILE" ] || return 0
  local pg p ended=0
  while read -r pg; do
    [ -n "$pg" ] || continue
    for p in $(ps -eo pid=,pgid= | awk -v g="$pg" '$2 == g {print $1}'); do
      if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -q '^SMOE_DEVICE_CALL='; then
        kill -9 -- "-$pg" 2>/dev/null && { say "ended process group $pg, left running by an earlier call"; ended=1; }
        break
      fi
    done
  done <"$PGFILE"
  : >"$PGFILE"
  [ "$ended" = 1 ] && sleep 2
  return 0
}

need_bin() {  # need_bin NAME STEP: $BUILD/NAME must exist (not checked in a dry run)
  dry || [ -x "$BUILD/$1" ] || { say "no $BUILD/$1: build it first (scripts/device.sh build $2)"; return 1; }
}
ngpus() { if dry; then echo "${DRY_GPUS:-2}"; else nvidia-smi -L 2>/dev/null | grep -c '^GPU'; fi; }
left() { local l=$(( ${SONIC_BUDGET:-570} - ($(date +%s) - T0) )); [ "$l" -ge 1 ] && echo "$l" || echo 0; }

# The CUTLASS headers: carried in .deps, or unpacked from .whl (bench/baselines/sonicmoe_env.sh pack).
cutlass_headers() {
  [ -f "$CUTLASS_SRC/include/cutlass/cutlass.h" ] && return 0
  if [ -f .whl/cutlass-headers.tar.xz ]; then
    x tar xJf .whl/cutlass-headers.tar.xz
    dry || [ -f "$CUTLASS_SRC/include/cutlass/cutlass.h" ] && return 0
  fi
  dry && return 0
  say "no CUTLASS headers in ${CUTLASS_SRC#"$ROOT"/}/include: carry .deps/cutlass-$CUTLASS_PIP_VERSION/cutlass_library/source/include"
  return 1
}

# ---- the PyTorch extension (pip install .), built at most once per call --------------------------
# Steps that need it: pytest, sonic, and ep with a torch sub-step. With the build step in the same
# call it builds next to the C++ build (own CMake dir build-torch/, shared cudart: the two share no
# objects, and together they fill the cores one build's serial tail leaves idle).
EP_STEPS="${EP_STEPS:-test comm torch train}"
ep_has() { case " $EP_STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
torch_ext_wanted() {
  wants pytest || wants sonic || { wants ep && { ep_has torch || ep_has train || ep_has bench || ep_has overlap || ep_has pkb; }; }
}
TORCH_EXT=(python3 -m pip install --no-build-isolation --no-deps -q .)
torch_ext_start() {  # in the background
  [ -e "$STATE/ext.started" ] && return 0
  touch "$STATE/ext.started"
  say "torch extension: building in the background, log torch_ext.log"
  x -a "$OUT/torch_ext.log" "${TORCH_EXT[@]}"
  if dry; then echo 0 >"$STATE/ext.rc"; return 0; fi
  ( timeout 400 "${TORCH_EXT[@]}" >"$OUT/torch_ext.log" 2>&1; echo $? >"$STATE/ext.rc" ) &
}
torch_ext_settle() {  # no timing while it still compiles next to it
  [ -e "$STATE/ext.started" ] && [ ! -e "$STATE/ext.rc" ] && say "waiting for the torch extension's build"
  while [ -e "$STATE/ext.started" ] && [ ! -e "$STATE/ext.rc" ]; do sleep 2; done
  return 0
}
torch_ext() {  # wait for it (or build it now); its status
  if [ ! -e "$STATE/ext.started" ]; then
    touch "$STATE/ext.started"
    cutlass_headers || { echo 1 >"$STATE/ext.rc"; return 1; }
    xt -a "$OUT/torch_ext.log" 400 "${TORCH_EXT[@]}"
    echo $? >"$STATE/ext.rc"
  fi
  torch_ext_settle
  local rc; rc=$(cat "$STATE/ext.rc")
  say "torch extension: pip rc=$rc"
  [ "$rc" = 0 ] || { tail -20 "$OUT/torch_ext.log" 2>/dev/null; return 1; }
}

# git apply PATCH, its files recorded in $BUILD/.ab_patched_files: the next build step on this (warm)
# machine then rebuilds them from the clean tree a later call copies in (step_build).
apply_recorded() {
  x git apply "$1" || return 1
  dry && return 0
  mkdir -p "$BUILD" && git apply --numstat "$1" | cut -f3 >>"$BUILD/.ab_patched_files"
}

# ---- steps ---------------------------------------------------------------------------------------
step_build() {
  cutlass_headers || return 1
  local gtest=()
  # GoogleTest from .whl (sonicmoe_env.sh pack) where a call carries .whl and no room is left for .deps.
  if [ ! -d .deps/googletest ] && [ -f .whl/googletest.tar.xz ]; then
    x tar xJf .whl/googletest.tar.xz || { say ".whl/googletest.tar.xz: unpack failed"; rm -rf .deps/googletest; }
  fi
  if [ -d .deps/googletest ] || { dry && [ -f .whl/googletest.tar.xz ]; }; then
    gtest=(-DSMOE_GTEST_SOURCE_DIR="$ROOT/.deps/googletest")
  else say "no .deps/googletest (carry it, or .whl packed with it): CMake looks for an installed GoogleTest"; fi
  torch_ext_wanted && torch_ext_start
  local nvcc t rc=0
  nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
  t=$(date +%s)
  # An ab step on this (warm) machine left $BUILD built with its patch; the tree copied in since may
  # carry those files with older times than the objects, which ninja would keep: touch them.
  if [ -s "$BUILD/.ab_patched_files" ]; then
    say "build: $BUILD holds an ab patch's side B; rebuilding its files: $(tr '\n' ' ' <"$BUILD/.ab_patched_files")"
    # shellcheck disable=SC2046  # one path per line
    x touch -c $(cat "$BUILD/.ab_patched_files") || true
    x rm -f "$BUILD/.ab_patched_files"
  fi
  # BUILD_PATCH: patches applied to the tree (in order) before this build, and recorded like an ab
  # step's side B, so that a later call on this warm machine rebuilds their files from its clean tree.
  local bp
  for bp in ${BUILD_PATCH:-}; do
    apply_recorded "$bp" || { say "BUILD_PATCH $bp does not apply"; return 1; }
  done
  x cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$nvcc" -Wno-dev \
    ${gtest[@]+"${gtest[@]}"} -DSMOE_CUTLASS_DIR="$CUTLASS_SRC" || return 1
  # BUILD_TARGETS: only these CMake targets (a short call measuring one binary, e.g. gather_sum_bench).
  # shellcheck disable=SC2086  # target names, space-separated
  x cmake --build "$BUILD" -j "$(nproc)" ${BUILD_TARGETS:+--target $BUILD_TARGETS} || rc=1
  say "build: $(( $(date +%s) - t )) s"
  return $rc
}
summary_build() { grep -E "^build: |error|FAILED:|no CUTLASS|no \.deps" "$1" | head -40; }

step_test() {
  need_bin test_gpu test || return 1
  local rc=0
  xt "${TEST_TIMEOUT:-400}" "$BUILD/test_gpu" ${TEST_FILTER:+"--gtest_filter=$TEST_FILTER"} || rc=1
  # The host tests too (a second): some take a GPU branch where one is present (EngineApi's prepare
  # and consume-order tests), which CI's CPU machine never runs.
  if dry || [ -x "$BUILD/test_api" ]; then xt 120 "$BUILD/test_api" || rc=1; fi
  if dry || [ -x "$BUILD/smoe_main" ]; then xt 180 "$BUILD/smoe_main" || rc=1; fi
  return $rc
}
summary_test() {
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\] .* ran|Failure$|Expected|Which is|timed out|killed by SIGKILL" "$1" | head -40
}

# The filters of the old device_check.sh: small shapes, so the sanitizers finish in minutes.
SAN_SMALL_ENGINE='GpuEngine.StoreWeightsNK:GpuEngine.SwiGLUGathered:GpuEngine.DSwiGLUGathered:GpuEngine.GateUpTwoTensors:GpuEngine.VarlenK:GpuEngine.VarlenKCluster:GpuEngine.ZeroRows'
SAN_MEMCHECK="GpuRouting.NonFinite*:GpuRouting.ZeroTokens:GpuRouting.WorkspaceTooSmall*:GpuRouting.Deterministic:GpuLayer.SmallShapes*:GpuLayer.Unsupported*:GpuLayer.GateUpTwoTensorsMatchInterleaved:GpuLayerRouting.*:GpuTokenRounding.SmallShapes*:GpuTokenRounding.ZeroTokens:GpuTokenRounding.WorkspaceTooSmall*:GpuExpertMajor.ZeroRows:GpuExpertMajor.InvalidCounts*:GpuExpertMajor.EdgeShapes:$SAN_SMALL_ENGINE"
SAN_RACECHECK='GpuEngine.DSwiGLUGathered:GpuExpertMajor.InvalidCounts*:GpuRouting.NonFinite*:GpuRouting.Deterministic:GpuTokenRounding.StochasticDependsOnSeed:GpuLayerRouting.ProvidedInvalid*:GpuEngine.StoreWeightsNK:GpuEngine.VarlenK:GpuEngine.VarlenKCluster'
SAN_SYNCCHECK='GpuEngine.StoreWeightsNK:GpuEngine.VarlenK:GpuEngine.VarlenKCluster:GpuEngine.SwiGLUGathered'
step_sanitize() {
  need_bin test_gpu sanitize || return 1
  local rc=0 tool filter
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
    case "$tool" in
      memcheck) filter=$SAN_MEMCHECK ;;
      racecheck) filter=$SAN_RACECHECK ;;
      synccheck) filter=$SAN_SYNCCHECK ;;
      *) say "unknown sanitizer tool $tool"; rc=1; continue ;;
    esac
    filter="${SANITIZE_FILTER:-$filter}"
    say "---- $tool"
    xt "${SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool "$tool" --error-exitcode 9 "$BUILD/test_gpu" \
      --gtest_filter="$filter" || rc=1
  done
  return $rc
}
summary_sanitize() { grep -E "^---- |ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY|^\[  (PASSED|FAILED) |timed out|killed by SIGKILL" "$1" | head -30; }

step_bench() {
  need_bin bench_layer bench || return 1
  torch_ext_settle
  local d="$OUT/bench" rc=0 driver="unknown" only="${BENCH_CONFIGS:-}"
  local w="${BENCH_WARMUP:-3}" r="${BENCH_REPS:-15}" t="${BENCH_TIMEOUT:-500}"
  mkdir -p "$d"
  dry || driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
  xt "$t" "$BUILD/bench_layer" --out "$d/ours.json" --commit "$COMMIT" --warmup "$w" --reps "$r" \
    --driver "$driver" ${only:+--only "$only"} || rc=1
  xt -a "$d/torch.log" "$t" python3 bench/baselines/torch_baseline.py --out "$d/torch.json" --counts histc \
    --warmup "$w" --reps "$r" ${only:+--configs "$only"} || rc=1
  x python3 bench/reports/merge_results.py --ours "$d/ours.json" --torch "$d/torch.json" \
    --out "$d/layer.json" --md "$d/layer.md" || rc=1
  if [ -z "$only" ] && [ "${BENCH_SWEEP:-1}" != 0 ]; then
    local sw
    for sw in ${BENCH_SWEEPS:-sweep wide}; do  # bench/configs/<sw>_configs.json -> $d/<sw>.{json,md}
      xt "$t" "$BUILD/bench_layer" --configs "bench/configs/${sw}_configs.json" --out "$d/${sw}_ours.json" \
        --commit "$COMMIT" --warmup "$w" --reps "$r" --driver "$driver" || rc=1
      xt -a "$d/${sw}_torch.log" "$t" python3 bench/baselines/torch_baseline.py \
        --configs-file "bench/configs/${sw}_configs.json" --out "$d/${sw}_torch.json" --counts histc \
        --warmup "$w" --reps "$r" || rc=1
      x python3 bench/reports/merge_results.py --ours "$d/${sw}_ours.json" --torch "$d/${sw}_torch.json" \
        --out "$d/${sw}.json" --md "$d/${sw}.md" || rc=1
    done
  fi
  return $rc
}
summary_bench() {
  local f
  for f in "$OUT/bench/layer.md" "$OUT"/bench/{sweep,wide,tune_extra}.md; do [ -f "$f" ] && { say "-- ${f#"$OUT"/}"; head -20 "$f"; }; done
  grep -E "timed out|killed by SIGKILL|Error|error" "$1" | head -10
}

step_tune() {
  need_bin smoe_tune tune || return 1
  need_bin bench_layer tune || return 1
  local d="$OUT/tune" rc=0 w="${BENCH_WARMUP:-3}" r="${BENCH_REPS:-10}" t="${TUNE_TIMEOUT:-300}"
  local passes="${TUNE_PASSES:-2}" cf name cache i sets=() heur tuned
  mkdir -p "$d"
  for cf in ${TUNE_CONFIGS:-bench/configs/configs.json bench/configs/wide_configs.json}; do
    name="$(basename "$cf" .json)"
    cache="$d/$name.cache.json"
    x rm -f "$cache"
    xt -a "$d/$name.tune.log" "$t" env SMOE_ENGINE_TUNE_CACHE="$cache" "$BUILD/smoe_tune" "$cf" || { rc=1; continue; }
    heur="" tuned=""
    for i in $(seq 1 "$passes"); do
      xt -a "$d/$name.heur_$i.log" "$t" env SMOE_ENGINE_TUNE=0 "$BUILD/bench_layer" --configs "$cf" \
        --out "$d/$name.heur_$i.json" --commit "$COMMIT" --warmup "$w" --reps "$r" || rc=1
      xt -a "$d/$name.tuned_$i.log" "$t" env SMOE_ENGINE_TUNE_CACHE="$cache" "$BUILD/bench_layer" --configs "$cf" \
        --out "$d/$name.tuned_$i.json" --commit "$COMMIT" --warmup "$w" --reps "$r" || rc=1
      heur="${heur:+$heur,}$d/$name.heur_$i.json"
      tuned="${tuned:+$tuned,}$d/$name.tuned_$i.json"
    done
    sets+=(--set "$name" "$d/$name.tune.log" "$heur" "$tuned" --configs "$cf")
  done
  [ ${#sets[@]} -gt 0 ] || return 1
  x python3 bench/reports/tuner_report.py --commit "$COMMIT" --device "$(dry || nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
    --command "SMOE_COMMIT=$COMMIT TUNE_CONFIGS='${TUNE_CONFIGS:-}' scripts/device.sh build tune" \
    "${sets[@]}" --out "$d/tuner.json" --md "$d/tuner.md" || rc=1
  if ! dry; then
    # shellcheck disable=SC2046  # the heuristic passes' JSONs, one word each
    x -o "$d/memory_stages.md" python3 bench/reports/memory_stages.py $(ls "$d"/*.heur_*.json 2>/dev/null) || rc=1
    # This build's heuristic scored against every key's measured candidates (the logs carry the device's
    # bandwidth): what a rule change in heuristic.cpp is judged by, also later on the CPU.
    # shellcheck disable=SC2046
    x python3 bench/reports/heuristic_fit.py --bin "$BUILD/smoe_heuristic" $(ls "$d"/*.tune.log 2>/dev/null) \
      --md "$d/heuristic_fit.md" || rc=1
  fi
  return $rc
}
summary_tune() { grep -E "^\| |timed out|killed by SIGKILL|rc=" "$OUT/tune/tuner.md" "$1" 2>/dev/null | grep -vE "^\S+:\|---" | head -40; }

SONIC_LARGE_SIX='Qwen3-Next-80B,30B n512 E128 K8,30B n256 E256 K16,Qwen3-235B,120B n1024 E128 K8,OLMoE-7B'
# SonicMoE's autotune results, per card: quack times every candidate of each GEMM on its first call
# of a shape and keeps the timings in <cache>/<key>/<kernel>.autotune.json (a few KB each; the key
# hashes quack's version, the shape key and the candidate list, not the card). On a fresh machine
# that is the warm stage's minutes. The results measured on a card kind are committed under
# bench/baselines/sonic_autotune/<card>/ (h100, h200; SONIC_AUTOTUNE_DIR replaces the folder) and
# copied into a fresh cache before the stage, never over a result already there: SonicMoE then runs
# its own autotuner's picks for that card and compiles only those (Triton's autotune of SonicMoE's
# gather-sums is kept the same way, under triton/). SONIC_AUTOTUNE_SEED=0 copies nothing in (a
# fresh machine then tunes cold; a warm one keeps its cache). After the stage every result in the cache goes to $OUT/sonic/autotune/<card>/ (in
# 00-all.tgz); new ones go into the tree with `cp -rn <that folder>/. bench/baselines/sonic_autotune/<card>/`.
SONIC_CACHE="${SONIC_CACHE_DIR:-/tmp/smoe_quack_cache}"
sonic_card() {  # h100, h200 or other (SONIC_CARD overrides: the dry-run tests)
  local name="${SONIC_CARD:-}"
  [ -n "$name" ] && { echo "$name"; return; }
  dry || name="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  # The SXM cards the device tool lends; other variants (PCIe, NVL, GH200) time differently: "other".
  case "$name" in "NVIDIA H200") echo h200 ;; "NVIDIA H100 80GB HBM3") echo h100 ;; *) echo other ;; esac
}
sonic_autotune_seed() {
  local src="${SONIC_AUTOTUNE_DIR:-bench/baselines/sonic_autotune}/$1"
  [ "${SONIC_AUTOTUNE_SEED:-1}" = 0 ] &&
    { say "SonicMoE autotune: nothing copied in (SONIC_AUTOTUNE_SEED=0; the machine's cache, if any, stays)"; return 0; }
  [ -d "$src" ] || { say "SonicMoE autotune: no committed results for $1 ($src): cold"; return 0; }
  x mkdir -p "$SONIC_CACHE"
  x cp -rn "$src/." "$SONIC_CACHE/"
}
sonic_autotune_harvest() {
  local dst="$OUT/sonic/autotune/$1"
  dry && { say "+ (every *.autotune.json of $SONIC_CACHE, with its key folder, into ${dst#"$ROOT"/})"; return 0; }
  local files=()
  [ -d "$SONIC_CACHE" ] && mapfile -t files < <(cd "$SONIC_CACHE" && find . -name '*.autotune.json' | sort)
  [ "${#files[@]}" -gt 0 ] || { say "SonicMoE autotune: no result in $SONIC_CACHE"; return 0; }
  mkdir -p "$dst" && dst="$(cd "$dst" && pwd)" &&  # absolute: the copy runs inside the cache
    (cd "$SONIC_CACHE" && cp --parents "${files[@]}" "$dst/") ||
    { say "SonicMoE autotune: copying ${#files[@]} result(s) from $SONIC_CACHE failed"; return 1; }
  say "SonicMoE autotune: ${#files[@]} result(s) in $SONIC_CACHE, copied to ${dst#"$ROOT"/}"
}

# SONIC_STAGE=ncu: each GEMM's launch configuration (grid, cluster, registers, shared memory: the tile and
# stages an autotune or heuristic chose) and throughputs under Nsight Compute, ours beside SonicMoE's. One
# ncu run per (config, system): sonic_profile.py --ncu runs one iteration after its warm-up between
# cudaProfilerStart / Stop (--profile-from-start off: SonicMoE's autotune and JIT launches are not profiled),
# so the run's kernels in launch order name the GEMMs (bench/reports/sonic_ncu_report.py, from manifest.tsv).
# Hardware metrics this ncu does not know are dropped first (an unknown --metrics name fails the run).
sonic_ncu_metrics() {
  local want="${SONIC_NCU_METRICS-dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,launch__cluster_dim_x}"
  want="${want// /}"
  dry && { echo "$want"; return; }
  local known m keep=() ms=()
  known="$(timeout 60 ncu --query-metrics 2>/dev/null | awk '{print $1}')"
  [ -n "$known" ] || { echo "$want"; return; }
  IFS=',' read -r -a ms <<<"$want"
  for m in "${ms[@]}"; do
    case "$m" in launch__*) keep+=("$m"); continue ;; esac
    if grep -qx "${m%%.*}" <<<"$known"; then keep+=("$m"); else say "sonic ncu: this ncu has no metric ${m%%.*}: dropped" >&2; fi
  done
  local IFS=,; echo "${keep[*]}"
}
sonic_ncu() {
  local d="$1" rep="${TMPDIR:-/tmp}/smoe_sonic_ncu" cfg sys tag rc=0 metrics cfgs=()
  mkdir -p "$d" "$rep"   # the reports themselves outside $OUT (size)
  : >"$d/manifest.tsv"
  metrics="$(sonic_ncu_metrics)"
  IFS=',' read -r -a cfgs <<<"${SONIC_NCU_CONFIGS:-30B n256 E256 K16,30B n512 E128 K8,Qwen3-Next-80B}"
  for cfg in "${cfgs[@]}"; do
    tag=$(echo "$cfg" | tr -c 'A-Za-z0-9.\n-' '_')
    for sys in ours sonicmoe; do
      say "---- $cfg, $sys"
      x rm -f "$rep/$tag.$sys.ncu-rep"  # an earlier call's report is never imported as this one's
      local t; t=$(left); [ "$t" -gt "${SONIC_NCU_TIMEOUT:-300}" ] && t=${SONIC_NCU_TIMEOUT:-300}
      # shellcheck disable=SC2086  # SONIC_NCU_FLAGS: extra ncu words, e.g. --clock-control none
      xt -a "$d/ncu_$tag.$sys.log" "$t" ncu --target-processes all --profile-from-start off -f -o "$rep/$tag.$sys" \
        --section SpeedOfLight --section LaunchStats ${metrics:+--metrics "$metrics"} ${SONIC_NCU_FLAGS:-} \
        python3 bench/drivers/sonic_profile.py --ncu --configs "$cfg" --systems "$sys" --out "$d" \
        --commit "$COMMIT" || { rc=1; tail -5 "$d/ncu_$tag.$sys.log"; continue; }
      if ! dry && [ ! -s "$rep/$tag.$sys.ncu-rep" ]; then
        say "$cfg, $sys: ncu wrote no report"; tail -5 "$d/ncu_$tag.$sys.log"; rc=1; continue
      fi
      x -o "$d/$tag.$sys.csv" ncu --import "$rep/$tag.$sys.ncu-rep" --csv --page raw --print-units base \
        --print-kernel-base demangled || { rc=1; continue; }
      printf '%s\t%s\t%s\n' "$cfg" "$sys" "$tag.$sys.csv" >>"$d/manifest.tsv"
    done
  done
  x -o "$d/sonic_ncu.md" python3 bench/reports/sonic_ncu_report.py "$d" || rc=1
  dry || cat "$d/sonic_ncu.md"
  return $rc
}

step_sonic() {
  if ! dry && [ ! -d .whl ]; then say "no .whl/: run bench/baselines/sonicmoe_env.sh pack here and carry .whl"; return 1; fi
  torch_ext || return 1
  local d="$OUT/sonic" rc=0 had_pp="${PYTHONPATH+set}" old_pp="${PYTHONPATH:-}" envline card
  mkdir -p "$d"
  card="$(sonic_card)"
  sonic_autotune_seed "$card"
  say "+ eval \"\$(bash bench/baselines/sonicmoe_env.sh install)\""
  if ! dry; then
    envline="$(bash bench/baselines/sonicmoe_env.sh install)" || return 1
    eval "$envline"   # PYTHONPATH for this step only (restored below)
  fi
  # For this step only (restored below): quack's autotune results and compiled kernels, and Triton's
  # (SonicMoE's gather-sums autotune through triton.autotune; TRITON_CACHE_AUTOTUNING keeps its results).
  local had_tc="${TRITON_CACHE_DIR+set}" old_tc="${TRITON_CACHE_DIR:-}"
  export QUACK_CACHE_DIR="$SONIC_CACHE" TRITON_CACHE_DIR="$SONIC_CACHE/triton" TRITON_CACHE_AUTOTUNING=1
  if x python3 -c "import sonicmoe"; then
    case "${SONIC_STAGE:-warm}" in
      warm)
        xt -a "$d/sonic_warm.log" "$(left)" python3 bench/drivers/side_by_side.py --systems sonicmoe \
          --configs "${SONIC_WARM_CONFIG:-1.4B n256 E128 K8}" --reps 1 --warmup 1 --out "$d/sonic_warm.json" \
          --commit "$COMMIT" || rc=1 ;;
      run)
        xt -a "$d/side_by_side.log" "$(left)" python3 bench/drivers/side_by_side.py \
          --configs-file "${SONIC_CONFIGS_FILES:-bench/configs/configs.json}" \
          ${SONIC_CONFIGS:+--configs "$SONIC_CONFIGS"} ${SONIC_ROUNDS:+--rounds "$SONIC_ROUNDS"} \
          --out "$d/side_by_side.json" --plots "$d" --commit "$COMMIT" || rc=1 ;;
      profile)
        # Both systems' kernels one by one in one process, same inputs (bench/drivers/sonic_profile.py):
        # which of SonicMoE's GEMMs / sums beats ours. After a warm stage, as run.
        xt -a "$d/profile.log" "$(left)" python3 bench/drivers/sonic_profile.py \
          --configs "${SONIC_PROFILE_CONFIGS:-$SONIC_LARGE_SIX}" --out "$d/profile" --commit "$COMMIT" \
          ${SONIC_PROFILE_RESUME:+--resume "$SONIC_PROFILE_RESUME"} || rc=1 ;;
      ncu) sonic_ncu "$d/ncu" || rc=1 ;;
      *) say "SONIC_STAGE must be warm, run, profile or ncu"; rc=1 ;;
    esac
  else
    say "sonicmoe does not import"; rc=1
  fi
  sonic_autotune_harvest "$card" || rc=1
  unset QUACK_CACHE_DIR TRITON_CACHE_AUTOTUNING
  if [ "$had_tc" = set ]; then export TRITON_CACHE_DIR="$old_tc"; else unset TRITON_CACHE_DIR; fi
  if [ "$had_pp" = set ]; then export PYTHONPATH="$old_pp"; else unset PYTHONPATH; fi
  return $rc
}
summary_sonic() {
  tail -n 15 "$OUT"/sonic/*.log 2>/dev/null
  local f
  for f in "$OUT"/sonic/ncu/ncu_*.log; do [ -f "$f" ] && grep -m5 -E "==ERROR==|==WARNING==|No kernels were profiled" "$f"; done
  [ -s "$OUT/sonic/ncu/sonic_ncu.md" ] && head -60 "$OUT/sonic/ncu/sonic_ncu.md"
  grep -E "does not import|timed out|killed by SIGKILL|pip rc" "$1"
}

step_ncu() {
  need_bin bench_layer ncu || return 1
  torch_ext_settle
  local d="$OUT/ncu" rep="${TMPDIR:-/tmp}/smoe_ncu" rc=0 cfg tag sec f extra
  mkdir -p "$d" "$rep"   # the reports themselves outside $OUT (size)
  IFS=',' read -r -a cfgs <<<"${NCU_CONFIGS:-OLMoE-7B}"
  for cfg in "${cfgs[@]}"; do
    tag=$(echo "$cfg" | tr -c 'A-Za-z0-9.\n-' '_')
    extra=()
    for sec in ${NCU_SECTIONS:-}; do extra+=(--section "$sec"); done
    [ "${NCU_SOURCE:-0}" = 1 ] && extra+=(--section SourceCounters)
    for f in ${NCU_FLAGS:-}; do extra+=("$f"); done
    # Matched against the demangled name: the bare function name is engine_kernel for every instance.
    [ -n "${NCU_KERNEL:-}" ] && extra+=(--kernel-name-base demangled --kernel-name "regex:$NCU_KERNEL")
    say "---- $cfg"
    # shellcheck disable=SC2086  # NCU_ENV: VAR=value words
    xt -a "$d/ncu_$tag.log" "${NCU_TIMEOUT:-240}" env ${NCU_ENV:-} ncu -f -o "$rep/ncu_$tag" \
      --section SpeedOfLight --section WarpStateStats --section Occupancy ${extra[@]+"${extra[@]}"} \
      --launch-count "${NCU_LAUNCHES:-60}" "$BUILD/bench_layer" --configs "${NCU_CONFIGS_FILE:-bench/configs/configs.json}" \
      --only "$cfg" --warmup 0 --reps 1 || rc=1
    # The raw page: every collected metric as a column, one row per kernel.
    x -o "$d/ncu_$tag.csv" ncu --import "$rep/ncu_$tag.ncu-rep" --csv --page raw || rc=1
    x -o "$d/ncu_$tag.md" python3 bench/reports/ncu_summary.py "$d/ncu_$tag.csv" || rc=1
    dry || cat "$d/ncu_$tag.md"
    if [ "${NCU_SOURCE:-0}" = 1 ]; then
      x -o "$d/ncu_${tag}_source.csv" ncu --import "$rep/ncu_$tag.ncu-rep" --page source --print-source sass --csv &&
        x -o "$d/ncu_${tag}_source_top.txt" python3 bench/reports/ncu_source_top.py "$d/ncu_${tag}_source.csv" --top 30
    fi
    if [ -n "${NCU_SECTIONS:-}" ]; then x -o "$d/ncu_${tag}_details.txt" ncu --import "$rep/ncu_$tag.ncu-rep" --page details; fi
    if [ "${NCU_KEEP_REPORTS:-0}" = 1 ]; then x cp "$rep/ncu_$tag.ncu-rep" "$d/"; fi
  done
  return $rc
}
summary_ncu() { body "$1" | grep -vE "^\+ " | head -60; }

step_ep() {
  local ng d="$OUT/ep" rc=0 sub
  ng=$(ngpus)
  mkdir -p "$d"
  [ "$ng" -ge 2 ] || say "only $ng GPU(s): the EP steps need 2 (device kind nvidia-h200-x2); test_ep skips, torchrun -n 2 fails"
  for sub in $EP_STEPS; do
    case "$sub" in test|comm|torch|train|bench|overlap|pkb|sanitize) ;;
      build) say "ep: 'build' is its own step now (scripts/device.sh build ep)"; continue ;;
      *) say "ep: unknown sub-step $sub"; rc=1; continue ;;
    esac
    say "---- ep $sub"
    "ep_$sub" "$d" "$ng" || { rc=1; say "ep $sub: FAILED"; }
  done
  return $rc
}
ep_test() {
  need_bin test_ep ep || return 1
  xt -a "$1/test.log" 200 "$BUILD/test_ep"; local rc=$?
  dry || grep -E "PASSED|FAILED|Failure|error" "$1/test.log" | head -20
  return $rc
}
ep_sanitize() {
  need_bin test_ep ep || return 1
  xt -a "$1/sanitize.log" 300 compute-sanitizer --tool memcheck --error-exitcode 9 "$BUILD/test_ep" \
    --gtest_filter='GpuEp.RandomRoutingUnevenRanks:GpuEp.RoundtripIsRanksTimesX'; local rc=$?
  dry || grep -E "ERROR SUMMARY|PASSED|FAILED" "$1/sanitize.log" | head
  return $rc
}
ep_comm() {
  need_bin ep_comm_bench ep || return 1
  torch_ext_settle
  xt -a "$1/comm.log" 200 "$BUILD/ep_comm_bench" --reps 20 --out "$1/ep_comm_$COMMIT.json"; local rc=$?
  dry || tail -20 "$1/comm.log"
  return $rc
}
ep_torch() {
  torch_ext || return 1
  (cd /tmp && xt -a "$1/pytest.log" 300 python3 -m pytest -q "$ROOT/tests/python/test_ep.py" -p no:cacheprovider)
  local rc=$?
  dry || tail -5 "$1/pytest.log"
  return $rc
}
ep_train() {
  torch_ext || return 1
  xt -a "$1/train.log" 200 torchrun --nproc_per_node 2 examples/ep_train/ep_train.py --steps 100; local rc=$?
  dry || grep -vE "Warning|\*\*\*\*" "$1/train.log" | tail -14
  return $rc
}
ep_bench() {
  torch_ext || return 1
  xt -a "$1/bench.log" "${EP_BENCH_TIMEOUT:-500}" env SMOE_COMMIT="$COMMIT" torchrun --nproc_per_node 2 \
    bench/baselines/ep_baseline.py --warmup "${EP_WARMUP:-2}" --reps "${EP_REPS:-7}" \
    ${EP_CONFIGS:+--only "$EP_CONFIGS"} --systems "${EP_SYSTEMS:-torchtitan_a2a,ours_local_a2a,ours_ep}" \
    --out "$1/ep_$COMMIT.json" ${EP_PROFILE:+--profile}; local rc=$?
  dry || grep -E "^RESULT" "$1/bench.log" | cut -c1-400
  return $rc
}
ep_overlap() {  # EpConfig::overlap: ours_ep at each level of EP_OVERLAPS
  torch_ext || return 1
  local ov rc=0
  for ov in ${EP_OVERLAPS:-0 1}; do
    xt -a "$1/overlap_$ov.log" "${EP_BENCH_TIMEOUT:-240}" env SMOE_EP_OVERLAP="$ov" SMOE_COMMIT="$COMMIT" \
      torchrun --nproc_per_node 2 bench/baselines/ep_baseline.py --warmup "${EP_WARMUP:-2}" --reps "${EP_REPS:-7}" \
      ${EP_CONFIGS:+--only "$EP_CONFIGS"} --systems ours_ep --out "$1/ep_overlap_${ov}_$COMMIT.json" || rc=1
    dry || grep -E "^RESULT" "$1/overlap_$ov.log" | cut -c1-400
  done
  return $rc
}
ep_pkb() {  # issue 12: Parallel Kernel Bench-style tasks at each world size and scaling mode
  torch_ext || return 1
  local ng=$2 r sc rc=0 gpu="GPU"
  for r in ${PKB_SIZES:-1 2 4 8}; do
    [ "$r" -le "$ng" ] || continue
    for sc in ${PKB_SCALING:-strong weak}; do
      xt -a "$1/pkb_${sc}_$r.log" "${PKB_TIMEOUT:-300}" env SMOE_COMMIT="$COMMIT" torchrun --nproc_per_node "$r" \
        bench/drivers/pkb_ep.py --scaling "$sc" --seeds "${PKB_SEEDS:-2}" ${EP_CONFIGS:+--only "$EP_CONFIGS"} \
        --out "$1/pkb_${sc}_$r.json" || rc=1
      dry || grep -E "^FAST@P" "$1/pkb_${sc}_$r.log"
    done
  done
  dry || gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  x python3 bench/reports/pkb_report.py "$1"/pkb_*.json --out "$1/ep_scaling" --device "$ng x $gpu" \
    --date "$(date +%F)" || rc=1
  dry || head -12 "$1/ep_scaling.md" 2>/dev/null
  return $rc
}
summary_ep() { body "$1" | grep -vE "^\+ " | head -60; }

step_pytest() {
  torch_ext || return 1
  # The drop-ins' tests compare with the frameworks' own code: the pinned wheels travel in
  # .deps/wheels (scripts/fetch_wheels.sh fetch, then carried); without them the tests use twins.
  if [ -d .deps/wheels ]; then x -a "$OUT/pytest_wheels.log" scripts/fetch_wheels.sh install || true; fi
  (cd /tmp && xt "${PYTEST_TIMEOUT:-480}" python3 -m pytest -q "$ROOT/tests/python" -p no:cacheprovider)
}
summary_pytest() { grep -E "passed|failed|skipped|^FAILED|^ERROR|Error|timed out|killed by SIGKILL|pip rc" "$1" | tail -15; }

step_digest() {
  if ! dry && [ ! -x "$BUILD/layer_digest" ]; then
    say "no $BUILD/layer_digest: not built (no layer_digest target in this tree, or the build step did not run or failed)"
    return 1
  fi
  xt -o "$OUT/digest.txt" "${DIGEST_TIMEOUT:-300}" "$BUILD/layer_digest"; local rc=$?
  dry || say "digest: $(wc -l <"$OUT/digest.txt") lines in digest.txt"
  return $rc
}
summary_digest() { body "$1" | grep -E "^digest: "; [ -s "$OUT/digest.txt" ] && head -n 20 "$OUT/digest.txt"; }

step_gather() {
  need_bin gather_sum_bench gather || return 1
  local d="$OUT/gather"
  mkdir -p "$d"
  SMOE_COMMIT="$COMMIT" xt -o "$d/gather_sum.txt" "${GATHER_TIMEOUT:-300}" "$BUILD/gather_sum_bench" \
    --reps "${GATHER_REPS:-20}" ${GATHER_SHAPES:+--shapes "$GATHER_SHAPES"} --out "$d/gather_sum.json"
}
summary_gather() { [ -s "$OUT/gather/gather_sum.txt" ] && grep -E "^T |chosen|checked|DIFFERS|WRONG" "$OUT/gather/gather_sum.txt" | head -40; }

step_router() {
  need_bin router_gemm_bench router || return 1
  local d="$OUT/router" rc=0
  mkdir -p "$d"
  # Exit 1 = the layer's call failed its check: the table is still written, the step fails.
  SMOE_COMMIT="$COMMIT" xt -o "$d/router_gemm.txt" "${ROUTER_TIMEOUT:-300}" "$BUILD/router_gemm_bench" \
    --reps "${ROUTER_REPS:-20}" ${ROUTER_SHAPES:+--shapes "$ROUTER_SHAPES"} --out "$d/router_gemm.json" || rc=1
  dry || [ -s "$d/router_gemm.json" ] || { say "router_gemm_bench wrote no JSON"; return 1; }
  x python3 bench/reports/router_report.py "$d/router_gemm.json" --md "$d/router_gemm.md" || rc=1
  return $rc
}
summary_router() { [ -s "$OUT/router/router_gemm.md" ] && grep -E "^\| [0-9]|^Geomean" "$OUT/router/router_gemm.md" | head -20; }

ab_vars() { case "$1" in *:*) printf '%s' "${1#*:}" ;; esac; }  # 'name:VAR=v ...' -> 'VAR=v ...' ('name': none)
step_ab() {
  need_bin bench_layer ab || return 1
  local d="$OUT/ab" rc=0 a_bin="$STATE/bench_a" b_bin="$BUILD/bench_layer" digest=0
  local w="${AB_WARMUP:-2}" r="${AB_REPS:-8}" t="${AB_TIMEOUT:-150}" i stem entry v name vars f
  local variants=() names=() order="${AB_ORDER:-alternate}"
  case "$order" in alternate | fixed) ;; *) say "AB_ORDER=$order: alternate or fixed"; return 1 ;; esac
  IFS=';' read -r -a variants <<<"${AB_VARIANTS:-b:}"
  for v in "${variants[@]}"; do
    name=${v%%:*}
    case "$name" in ''|a|*[!A-Za-z0-9_-]*) say "AB_VARIANTS: bad name '$name' in '$v' (letters, digits, _ and -; not 'a')"; return 1 ;; esac
    names+=("$name")
  done
  local scoped=() sv
  for entry in ${AB_CONFIGS:-configs wide_configs}; do
    IFS=',' read -r -a scoped <<<"$(ab_entry_variants "$entry")"
    for sv in ${scoped[@]+"${scoped[@]}"}; do
      [[ " ${names[*]} " == *" $sv "* ]] || { say "AB_CONFIGS: variant '$sv' of '$entry' is not in AB_VARIANTS"; return 1; }
    done
  done
  # AB_DIGEST_VARIANTS: the variants whose digest must equal A's ('all', or names; default the
  # first): a stack of switched patches checks each switch's bits in one call.
  local dnames=() dn
  case "${AB_DIGEST_VARIANTS:-}" in
    '') dnames=("${names[0]}") ;;
    all) dnames=("${names[@]}") ;;
    *) read -r -a dnames <<<"${AB_DIGEST_VARIANTS//,/ }" ;;
  esac
  for dn in "${dnames[@]}"; do
    [[ " ${names[*]} " == *" $dn "* ]] || { say "AB_DIGEST_VARIANTS: '$dn' is not in AB_VARIANTS"; return 1; }
  done
  mkdir -p "$d"
  x cp "$BUILD/bench_layer" "$a_bin" || return 1
  if [ "${AB_DIGEST:-1}" != 0 ] && { dry || [ -x "$BUILD/layer_digest" ]; }; then
    digest=1
    x cp "$BUILD/layer_digest" "$STATE/digest_a" || return 1
  elif [ "${AB_DIGEST:-1}" != 0 ]; then
    say "ab: no $BUILD/layer_digest (BUILD_TARGETS?): no digest compared"
  fi
  # AB_PATCH: one patch, or several (space-separated) applied in that order on top of each other,
  # reverted in the reverse order.
  local patches=() applied=() p
  read -r -a patches <<<"${AB_PATCH:-}"
  unapply() { local i; for ((i = ${#applied[@]} - 1; i >= 0; i--)); do x git apply -R "${applied[i]}" || return 1; done; }
  if [ ${#patches[@]} -gt 0 ]; then
    for p in "${patches[@]}"; do
      apply_recorded "$p" || { say "AB_PATCH $p does not apply"; unapply; return 1; }
      applied+=("$p")
    done
    # Side B builds what side A's build step did (BUILD_TARGETS) and always what the A/B runs of it
    # (bench_layer, layer_digest when compared, test_gpu for AB_TEST_FILTER): a patch's A/B then rebuilds
    # a few binaries, not the whole tree (~60 s of device time), and never runs a stale side B.
    local b_targets=()
    [ -n "${BUILD_TARGETS:-}" ] && read -r -a b_targets <<<"$BUILD_TARGETS"
    add_target() { [ ${#b_targets[@]} -gt 0 ] && [[ " ${b_targets[*]} " != *" $1 "* ]] && b_targets+=("$1"); }
    add_target bench_layer
    [ "$digest" = 1 ] && add_target layer_digest
    [ -n "${AB_TEST_FILTER:-}" ] && add_target test_gpu
    x cmake --build "$BUILD" -j "$(nproc)" ${b_targets[@]+--target "${b_targets[@]}"} || { unapply; return 1; }
    if [ -n "${AB_TEST_FILTER:-}" ]; then
      xt -a "$d/test_b.log" "${TEST_TIMEOUT:-400}" "$BUILD/test_gpu" --gtest_filter="$AB_TEST_FILTER" || rc=1
      dry || grep -E "^\[  (PASSED|FAILED) " "$d/test_b.log"
    fi
    unapply || rc=1  # the tree as it was; $BUILD keeps side B
  fi
  local env_a=() env_b=()
  read -r -a env_a <<<"${AB_ENV_A:-}"
  # The stem 'unseen': a seeded draw of shapes in none of the configs files (bench/configs/unseen.py).
  for entry in ${AB_CONFIGS:-}; do
    if [ "$(ab_entry_config "$entry")" = unseen ]; then
      x python3 bench/configs/unseen.py --seed "${AB_UNSEEN_SEED:-$(date -u +%Y%m%d)}" --out "$d/unseen.json" || return 1
      break
    fi
  done
  if [ "$digest" = 1 ]; then
    xt -o "$d/digest_a.txt" 300 env ${env_a[@]+"${env_a[@]}"} "$STATE/digest_a" || rc=1
    for dn in "${dnames[@]}"; do
      for v in "${variants[@]}"; do [ "${v%%:*}" = "$dn" ] && break; done  # names checked above
      # One digest compared (the default): digest_b.txt as always; several: digest_<variant>.txt each.
      f="$d/digest_$dn.txt"
      [ ${#dnames[@]} -eq 1 ] && f="$d/digest_b.txt"
      read -r -a env_b <<<"$(ab_vars "$v")"
      xt -o "$f" 300 env ${env_b[@]+"${env_b[@]}"} "$BUILD/layer_digest" || rc=1
      if ! dry; then
        if cmp -s "$d/digest_a.txt" "$f"; then say "digest: $dn == a (bitwise)"
        else say "digest: $dn DIFFERS from a"; diff "$d/digest_a.txt" "$f" | head -8; rc=1; fi
      fi
    done
  fi
  # The sides of a round: A, then each variant; AB_ORDER=alternate (the default) runs even rounds in
  # the reverse order, so that no side always runs first or right after another. (On the H100 two
  # variants of one binary, second and third in every round, measured the same dW kernels 4-7% apart in
  # geomean, up to 14% on one shape:
  # bench/results/h100/dswiglu_staged_ab.json, pps against plain.) AB_ORDER=fixed keeps A first.
  local sides=(-a- "${variants[@]}") k
  for i in $(seq 1 "${AB_ROUNDS:-3}"); do
    local round=("${sides[@]}")
    if [ "$order" = alternate ] && [ $((i % 2)) -eq 0 ]; then
      round=(); for ((k = ${#sides[@]} - 1; k >= 0; k--)); do round+=("${sides[k]}"); done
    fi
    for entry in ${AB_CONFIGS:-configs wide_configs}; do
      f=$(ab_config_file "$(ab_entry_config "$entry")" "$d"); stem=$(ab_config_stem "$(ab_entry_config "$entry")")
      for v in "${round[@]}"; do
        [ "$v" = -a- ] || ab_entry_runs "$entry" "${v%%:*}" || continue
        if [ "$v" = -a- ]; then
          xt -a "$d/a_${stem}_$i.log" "$t" env SMOE_ENGINE_TUNE=0 ${env_a[@]+"${env_a[@]}"} "$a_bin" --configs "$f" \
            --warmup "$w" --reps "$r" --commit "$COMMIT" --out "$d/a_${stem}_$i.json" || rc=1
          continue
        fi
        name=${v%%:*}; vars=$(ab_vars "$v"); env_b=()
        read -r -a env_b <<<"$vars"
        xt -a "$d/${name}_${stem}_$i.log" "$t" env SMOE_ENGINE_TUNE=0 ${env_b[@]+"${env_b[@]}"} "$b_bin" \
          --configs "$f" --warmup "$w" --reps "$r" --commit "$COMMIT" --out "$d/${name}_${stem}_$i.json" || rc=1
      done
    done
    pack_out  # each finished round in 00-all.tgz: a call cut at its limit still returns the rounds it ran
  done
  local gpu="GPU"
  dry || gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  for entry in ${AB_CONFIGS:-configs wide_configs}; do
    stem=$(ab_config_stem "$(ab_entry_config "$entry")")
    for name in "${names[@]}"; do
      ab_entry_runs "$entry" "$name" || continue
      local fa="" fb=""
      for i in $(seq 1 "${AB_ROUNDS:-3}"); do fa+="$d/a_${stem}_$i.json,"; fb+="$d/${name}_${stem}_$i.json,"; done
      x python3 bench/reports/layer_ab.py --a "a=$fa" --b "$name=$fb" --commit "$COMMIT${AB_PATCH:+ + $AB_PATCH}" \
        --device "$gpu" --command "scripts/device.sh ab (AB_PATCH=${AB_PATCH:-} AB_VARIANTS=${AB_VARIANTS:-b:} AB_ENV_A=${AB_ENV_A:-} AB_ORDER=${AB_ORDER:-alternate}), $stem, ${AB_ROUNDS:-3} rounds, --warmup $w --reps $r" \
        --out "$d/ab_${name}_${stem}.json" --md "$d/ab_${name}_${stem}.md" || rc=1
    done
  done
  return $rc
}
# An AB_CONFIGS entry: a stem of bench/configs/, 'unseen' (the step's draw), or a path to a configs JSON
# (e.g. docs/wip/<name>.heldout.json: shapes a rule change picks differently, bench/reports/rule_cache.py),
# whose reports are named by its file name without .json.
ab_config_file() {
  case "$1" in
    unseen) echo "$2/unseen.json" ;;
    */*|*.json) echo "$1" ;;
    *) echo "bench/configs/$1.json" ;;
  esac
}
ab_config_stem() { local b; b=$(basename "$1"); echo "${b%.json}"; }
# A scoped entry 'v1,v2=<entry>' runs side A and only the variants named; a plain entry runs every one.
ab_entry_config() { echo "${1#*=}"; }
ab_entry_variants() { case "$1" in *=*) echo "${1%%=*}" ;; esac; }
ab_entry_runs() {
  case "$1" in *=*) [[ ",${1%%=*}," == *",$2,"* ]] ;; *) return 0 ;; esac
}
summary_ab() {
  grep -E "^digest: |^\[  (PASSED|FAILED) |does not apply|timed out|killed by SIGKILL|bad name" "$1" | head -12
  local f
  for f in "$OUT"/ab/ab_*.md; do [ -f "$f" ] && say "${f#"$OUT"/}: $(grep -m1 '^Geomean' "$f")"; done
}

# ---- run -----------------------------------------------------------------------------------------
pack_out() {  # $OUT/00-all.tgz: everything under $OUT (the device tool returns 8 files at most)
  dry && return 0
  tar czf "$OUT/00-all.tgz.tmp" -C "$OUT" --exclude='00-all.tgz*' . 2>/dev/null &&
    mv "$OUT/00-all.tgz.tmp" "$OUT/00-all.tgz"
}
on_signal() {
  local pg
  while read -r pg; do [ -n "$pg" ] && kill -9 -- "-$pg" 2>/dev/null; done <"$PGFILE" 2>/dev/null
  : >"$PGFILE" 2>/dev/null
  pack_out
  exit 143
}
trap on_signal TERM INT
trap 'rm -rf "$STATE"' EXIT

say "device.sh: ${steps[*]}  (commit $COMMIT, build dir $BUILD, out ${OUT#"$ROOT"/}$(dry && echo ', dry run'))"
if ! dry; then
  end_leftovers
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader 2>/dev/null ||
    say "(no nvidia-smi: not a GPU machine)"
fi

declare -A result
failed=0
for s in "${steps[@]}"; do
  log="$OUT/$s.log"
  header="==== $s ==== $(date -u +%FT%TZ)"
  say ""
  say "$header"
  t=$(date +%s)
  { say "$header"; "step_$s"; } >"$log" 2>&1
  rc=$?
  if dry; then tail -n +2 "$log"
  elif declare -F "summary_$s" >/dev/null; then "summary_$s" "$log"
  else body "$log" | tail -n 15; fi
  # A failure shows the log's last lines too (a missing binary, a command's last words).
  if ! dry && [ "$rc" != 0 ]; then say "-- last lines of $s.log:"; body "$log" | tail -n 8; fi
  result[$s]="$([ "$rc" = 0 ] && echo ok || echo "FAILED (rc=$rc)")  $(( $(date +%s) - t )) s"
  say "---- $s: ${result[$s]}  (log: ${log#"$ROOT"/})"
  [ "$rc" = 0 ] || failed=1
  pack_out
done

torch_ext_settle   # a background build no step waited for
{
  say "==== summary ($(( $(date +%s) - T0 )) s) ===="
  for s in "${steps[@]}"; do printf '%-9s %s\n' "$s" "${result[$s]}"; done
} | tee "$OUT/summary.txt"
pack_out
exit "$failed"
