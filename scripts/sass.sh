#!/usr/bin/env bash
# SASS of an engine instance (or any object of the build), without a GPU:
#   scripts/sass.sh dw_gather_p_256            # build/CMakeFiles/smoe.dir/engine_instances/inst_<name>.cu.o
#   scripts/sass.sh path/to/object.o
# The CUDA 13 toolkit here ships neither cuobjdump nor nvdisasm; their PyPI wheels
# (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) are fetched once into .deps/cuda-tools/.
# BUILD (default build/) names the build folder. Use it to check what ptxas made of a producer loop,
# e.g. where a load's first use is.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="$ROOT/.deps/cuda-tools"
if [ ! -x "$TOOLS/nvidia/cu13/bin/cuobjdump" ] || [ ! -x "$TOOLS/nvidia/cu13/bin/nvdisasm" ]; then
  mkdir -p "$TOOLS"
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm >&2
  for w in "$tmp"/*.whl; do (cd "$TOOLS" && python3 -m zipfile -e "$w" .); done
  chmod +x "$TOOLS"/nvidia/cu13/bin/*
  rm -rf "$tmp"
fi
arg="${1:?usage: scripts/sass.sh <instance name | object file>}"
obj="$arg"
[ -f "$obj" ] || obj="$ROOT/${BUILD:-build}/CMakeFiles/smoe.dir/engine_instances/inst_$arg.cu.o"
[ -f "$obj" ] || { echo "no object $obj (build it first)" >&2; exit 1; }
PATH="$TOOLS/nvidia/cu13/bin:$PATH" cuobjdump -sass "$obj"
