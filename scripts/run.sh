#!/usr/bin/env bash
# The main job: set up, build, and run smoe_main (CPU reference check without a GPU; GPU routing
# check and timings on a Hopper GPU). Extra arguments go to smoe_main.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
exec "${SMOE_BUILD_DIR:-$ROOT/build}/smoe_main" "$@"
