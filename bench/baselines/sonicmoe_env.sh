#!/usr/bin/env bash
# SonicMoE for the side-by-side benchmark, on a GPU machine that has no network.
#
#   bench/baselines/sonicmoe_env.sh pack       (here, with network) fills .whl/ (git-ignored), < 64 MiB in all
#   eval "$(bench/baselines/sonicmoe_env.sh install)"   (on the GPU machine, carrying .whl) sets PYTHONPATH
#
# What it takes, and why it is packed this way:
#   sonic-moe 0.1.2.post1 (pure python) needs nvidia-cutlass-dsl==4.4.2, quack-kernels>=0.3.11,
#   torch<=2.9.1. The GPU machine has torch 2.11 (cu130); the pin is not honoured (--no-deps) and the
#   benchmark records whether it runs anyway. quack-kernels 0.4.1 is the newest release that still
#   accepts cutlass-dsl 4.4.2 (0.5.0 wants >=4.5.2). quack needs apache-tvm-ffi<0.2 and
#   torch-c-dlpack-ext. nvidia-cutlass-dsl-libs-cu13 (78 MB wheel) is a superset of -libs-base
#   (74 MB, the CUDA 12 build), so only cu13 is taken; its wheel is over the 64 MiB a call carries,
#   so it travels unpacked and re-compressed with xz (53 MB). The CUTLASS C++ headers our own build
#   needs travel as an xz tarball too (1 MB instead of 28 MB), leaving room for both in one call, and so do
#   GoogleTest's sources (googletest.tar.xz, unpacked by scripts/device.sh's build step).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
W="$ROOT/.whl"
PLAT=(--python-version 3.12 --implementation cp --only-binary=:all: --no-deps
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)

pack() {
  source "$ROOT/scripts/versions.env"
  mkdir -p "$W"
  local tmp; tmp=$(mktemp -d)
  python3 -m pip download -q "${PLAT[@]}" -d "$W" sonic-moe==0.1.2.post1 nvidia-cutlass-dsl==4.4.2 \
    quack-kernels==0.4.1 "apache-tvm-ffi>=0.1.6,<0.2" torch-c-dlpack-ext
  python3 -m pip download -q "${PLAT[@]}" -d "$tmp" nvidia-cutlass-dsl-libs-cu13==4.4.2
  (mkdir -p "$tmp/x" && cd "$tmp/x" && unzip -q "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl \
     && tar cf - . | xz -9e -T0 > "$W/cutlass-dsl-cu13.tar.xz")
  (cd "$ROOT" && tar cf - ".deps/cutlass-$CUTLASS_PIP_VERSION/cutlass_library/source/include" \
     ".deps/cutlass-$CUTLASS_PIP_VERSION/cutlass_library/source/tools/util/include" \
     | xz -9 -T0 > "$W/cutlass-headers.tar.xz")
  # GoogleTest's sources (scripts/setup.sh's copy; without googlemock, docs, tests: ~0.2 MB) for the
  # build step's tests, which a call carrying .whl has no room left to carry as .deps/googletest.
  if [ -d "$ROOT/.deps/googletest" ]; then
    (cd "$ROOT" && tar cf - --exclude=.deps/googletest/googlemock --exclude=.deps/googletest/googletest/docs \
       --exclude=.deps/googletest/googletest/test --exclude=.deps/googletest/googletest/samples .deps/googletest \
       | xz -9 -T0 > "$W/googletest.tar.xz")
  else
    rm -f "$W/googletest.tar.xz"
    echo "no .deps/googletest (scripts/setup.sh copies it from /usr/src/googletest): .whl holds no GoogleTest" >&2
  fi
  rm -rf "$tmp"
  du -cb "$W"/* | tail -1
}

install() {
  local site=/tmp/site
  mkdir -p "$site"
  (cd "$ROOT" && tar xJf "$W/cutlass-headers.tar.xz")
  tar xJf "$W"/cutlass-dsl-cu13.tar.xz -C "$site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$W"/*.whl >&2
  # --target does not process .pth files, so add what nvidia_cutlass_dsl.pth names by hand.
  echo "export PYTHONPATH=$site:$site/nvidia_cutlass_dsl/python_packages\${PYTHONPATH:+:\$PYTHONPATH}"
}

case "${1:-}" in
  pack) pack ;;
  install) install ;;
  *) echo "usage: $0 pack | eval \"\$($0 install)\"" >&2; exit 2 ;;
esac
