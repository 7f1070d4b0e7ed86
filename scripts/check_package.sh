#!/usr/bin/env bash
# Installs the built library into a scratch prefix and builds + runs examples/consumer against it
# through find_package(smoe): what a C++ user without our sources does. Called by scripts/test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${SMOE_BUILD_DIR:-$ROOT/build}"
PREFIX="$BUILD/package-check/install"
rm -rf "$BUILD/package-check"
cmake --install "$BUILD" --prefix "$PREFIX" >/dev/null
cmake -S "$ROOT/examples/consumer" -B "$BUILD/package-check/consumer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD/package-check/consumer" >/dev/null
"$BUILD/package-check/consumer/smoe_consumer"
echo "package check: examples/consumer built against the installed smoe and ran"
