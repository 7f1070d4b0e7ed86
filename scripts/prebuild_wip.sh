#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries of HEAD + every docs/wip patch here, on the CPU machine,
# into prebuilt/ (git-ignored), so that the next device call skips its ~80 s build:
#   bash scripts/prebuild_wip.sh                      # ~12 min on 2 cores the first time, then incremental
#   (device tool, carry ["prebuilt", ".deps/googletest", ".deps/cutlass-4.2.0.0/cutlass_library/source/include"])
#   WIP_PREBUILT=prebuilt ... bash scripts/device_wip.sh
# The tree is a clone of this checkout's HEAD (commit first) in build-prebuilt/src, reset and patched
# on every run; the CMake build dir build-prebuilt/build stays, so a second run rebuilds only what
# changed. prebuilt/PREBUILT records the commit and the patches. device_wip.sh falls back to its own
# build when the binaries do not start on the GPU machine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/versions.env
CUTLASS_SRC="$ROOT/.deps/cutlass-$CUTLASS_PIP_VERSION/cutlass_library/source"
[ -d "$CUTLASS_SRC/include" ] || { echo "no CUTLASS headers in .deps: run scripts/setup.sh first"; exit 1; }
WORK="$ROOT/build-prebuilt"
mkdir -p "$WORK"
if [ ! -d "$WORK/src/.git" ]; then git clone -q "$ROOT" "$WORK/src"; fi
# The same code and patches as the last run (a commit of docs alone changes neither): leave the
# tree alone (a reset would touch every file's time and rebuild everything).
code=$(git ls-tree -r HEAD -- src tests bench apps cmake CMakeLists.txt | sha1sum | cut -c1-12)
stamp="$code $(cat docs/wip/*.patch 2>/dev/null | sha1sum | cut -c1-12)"
patches=()
for p in docs/wip/*.patch; do [ -e "$p" ] && patches+=("$(basename "$p")"); done
if [ "$(cat "$WORK/STAMP" 2>/dev/null)" != "$stamp" ]; then
  git -C "$WORK/src" fetch -q "$ROOT" HEAD
  git -C "$WORK/src" reset -q --hard FETCH_HEAD
  git -C "$WORK/src" clean -qfd
  for p in "${patches[@]}"; do git -C "$WORK/src" apply "docs/wip/$p"; done
  echo "$stamp" >"$WORK/STAMP"
fi
cmake -S "$WORK/src" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -Wno-dev \
  -DSMOE_GTEST_SOURCE_DIR="$ROOT/.deps/googletest" -DSMOE_CUTLASS_DIR="$CUTLASS_SRC" >/dev/null
# test_gpu + bench_layer are 31 MB: with .deps/googletest and the CUTLASS headers (31 MB, for the
# fallback build) that still fits the device tool's 64 MiB carry; test_ep (16 MB) only on request.
targets=(test_gpu bench_layer)
if [ "${PREBUILD_EP:-0}" = 1 ]; then targets+=(test_ep); else rm -f "$ROOT/prebuilt/test_ep"; fi
ninja -C "$WORK/build" "${targets[@]}"
mkdir -p "$ROOT/prebuilt"
for t in "${targets[@]}"; do cp "$WORK/build/$t" "$ROOT/prebuilt/"; done
echo "$(git -C "$ROOT" rev-parse --short HEAD) + ${patches[*]:-no patches}, built $(date -u +%FT%TZ)" >"$ROOT/prebuilt/PREBUILT"
cat "$ROOT/prebuilt/PREBUILT"
du -sh "$ROOT/prebuilt"
