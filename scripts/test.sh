#!/usr/bin/env bash
# The whole test suite: set up, build everything (all CUDA code included: a build break fails),
# then run every test through CTest. GPU tests skip, saying so, when no GPU is present.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "${SMOE_BUILD_DIR:-$ROOT/build}"
ctest --output-on-failure -j "${SMOE_JOBS:-$(nproc)}" "$@"
"$ROOT/scripts/check_package.sh"
