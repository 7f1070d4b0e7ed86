#!/usr/bin/env bash
# The wheelhouse for tests/python/test_dropins.py: the pinned training stacks (torchtitan 0.3.0,
# transformers 5.24.0, megatron-core 0.16.1) and the few extra packages their imported modules need,
# for a machine without network (the GPU machine). Not torch, not nvidia-*, not numpy (every torch
# environment here has numpy; 16 MB a wheel), not tokenizers (transformers imports it lazily).
#
#   scripts/fetch_wheels.sh [fetch]      (here, with network) download into .deps/wheels/ (git-ignored)
#   scripts/fetch_wheels.sh install      (there, offline) install from .deps/wheels/ into the current
#                                        python3: the three frameworks at their pins, and each extra
#                                        package only if what is installed does not satisfy it:
#       python3 -m pip install --no-index --find-links .deps/wheels --no-deps \
#           torchtitan==0.3.0 transformers==5.24.0 megatron-core==0.16.1 <the DEPS specs below>
#   scripts/fetch_wheels.sh check        import what the tests import (prints the versions)
#
# Then: python3 -m pytest -q tests/python/test_dropins.py (the tests use the real packages when
# importable, the twins of tests/python/framework_twins.py otherwise). Ship .deps/wheels with the
# working tree (device runs: carry ".deps/wheels").
#
# Python: torchtitan 0.3.0 and transformers 5.24.0 need Python >= 3.11 (Requires-Python);
# megatron-core 0.16.1 is a cpXY wheel (it has one compiled module, megatron/core/datasets/
# helpers_cpp, not used by the experts), so its wheel, regex's and PyYAML's are fetched per Python
# version: PYVERS (default "3.11 3.12": this machine's venv and the GPU machine's /opt/torch/.venv).
# Size: about 22 MB for both versions (limit 40 MB, checked below).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${WHEELHOUSE:-$ROOT/.deps/wheels}"
PY="${PYTHON:-python3}"
PYVERS="${PYVERS:-3.11 3.12}"
MAX_MB=40

FRAMEWORKS=(torchtitan==0.3.0 transformers==5.24.0 megatron-core==0.16.1)
# Pure-python extras (py3-none-any): what `import torchtitan.models.common.moe`, `import transformers`
# (+ its runtime dependency check) and `import megatron.core.transformer.moe.experts` need.
PURE=(spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1
      huggingface_hub==1.33.0 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 idna==3.20
      certifi==2026.10.19.post1 tqdm==4.70.1 filelock==4.3.1 packaging==26.4)
# Compiled (per Python version / abi3).
BINARY=(megatron-core==0.16.1 regex==2026.11.19 pyyaml==6.0.4 safetensors==0.8.0)
# What `install` asks for: the frameworks' own requirements, so an installed version that satisfies
# them is kept (the GPU machine already has huggingface_hub, safetensors, regex, PyYAML, tqdm, ...).
DEPS=("spmd_types==0.2.3" "tyro" "docstring_parser" "typeguard" "huggingface_hub>=1.31.0,<3.0"
      "httpx" "httpcore" "h11" "anyio" "idna" "certifi" "tqdm>=4.60" "filelock" "packaging>=24.2"
      "regex>=2025.10.22" "pyyaml>=5.1" "safetensors>=0.8.0")
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)

fetch() {
  mkdir -p "$DEST"
  local pip=("$PY" -m pip download --disable-pip-version-check --no-deps --only-binary=:all: -q -d "$DEST")
  "${pip[@]}" torchtitan==0.3.0 transformers==5.24.0 "${PURE[@]}"
  for v in $PYVERS; do
    "${pip[@]}" --python-version "$v" --implementation cp "${PLATFORMS[@]}" "${BINARY[@]}"
  done
  local mb
  mb=$(du -sm "$DEST" | cut -f1)
  ls -1 "$DEST"
  echo "[fetch_wheels] $(ls "$DEST" | wc -l) wheels, ${mb} MB in $DEST"
  if [ "$mb" -gt "$MAX_MB" ]; then
    echo "[fetch_wheels] over ${MAX_MB} MB" >&2
    exit 1
  fi
}

install() {
  [ -d "$DEST" ] || { echo "[fetch_wheels] no wheelhouse at $DEST: run scripts/fetch_wheels.sh first" >&2; exit 1; }
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "[fetch_wheels] torchtitan 0.3.0 / transformers 5.24.0 need Python >= 3.11 ($("$PY" -V))" >&2; exit 1; }
  "$PY" -m pip install --disable-pip-version-check --no-index --find-links "$DEST" --no-deps -q \
    "${FRAMEWORKS[@]}" "${DEPS[@]}"
}

check() {
  "$PY" - <<'EOF'
import importlib, importlib.metadata as md
for mod, dist in [("torchtitan.models.common.moe", "torchtitan"), ("torchtitan.config.override", "torchtitan"),
                  ("transformers.integrations.moe", "transformers"),
                  ("transformers.models.qwen3_moe.modeling_qwen3_moe", "transformers"),
                  ("megatron.core.transformer.moe.experts", "megatron-core")]:
    importlib.import_module(mod)
    print(f"ok  {mod}  ({dist} {md.version(dist)})")
EOF
}

case "${1:-fetch}" in
  fetch) fetch ;;
  install) install ;;
  check) check ;;
  *) echo "usage: $0 [fetch|install|check]" >&2; exit 2 ;;
esac
