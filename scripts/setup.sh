#!/usr/bin/env bash
# Idempotent set-up of a fresh machine: Debian packages (only those missing), the CUTLASS C++
# headers from PyPI into .deps/ (git-ignored), and a configured CMake/Ninja build in build/.
# Quick when everything is already there. Sourced by run.sh and test.sh; usable alone.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=versions.env
source "$ROOT/scripts/versions.env"

missing=()
for p in $APT_PACKAGES; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

CUTLASS_DIR="$ROOT/.deps/cutlass-$CUTLASS_PIP_VERSION"
if [ ! -f "$CUTLASS_DIR/.complete" ]; then
  echo "[setup] fetching CUTLASS $CUTLASS_PIP_VERSION headers from PyPI into .deps/"
  rm -rf "$CUTLASS_DIR"
  python3 -m pip install -q --no-deps --disable-pip-version-check --target "$CUTLASS_DIR" \
    "nvidia-cutlass==$CUTLASS_PIP_VERSION" 2>&1 | grep -v "WARNING: Running pip as" || true
  test -f "$CUTLASS_DIR/cutlass_library/source/include/cutlass/cutlass.h"
  touch "$CUTLASS_DIR/.complete"
fi

# A copy of Debian's googletest sources, so machines without libgtest-dev (the GPU machine) can
# build the tests from .deps/googletest.
if [ ! -d "$ROOT/.deps/googletest" ] && [ -d /usr/src/googletest ]; then
  mkdir -p "$ROOT/.deps" && cp -r /usr/src/googletest "$ROOT/.deps/googletest"
fi

BUILD_DIR="${SMOE_BUILD_DIR:-$ROOT/build}"
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  NVCC="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_COMPILER="$NVCC" \
    -DSMOE_CUTLASS_DIR="$CUTLASS_DIR/cutlass_library/source" >/dev/null
fi
JOBS="${SMOE_JOBS:-$(nproc)}"
cmake --build "$BUILD_DIR" -j "$JOBS"
