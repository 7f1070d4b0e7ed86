#!/usr/bin/env bash
# CUDA compiler launcher of the smoe library (CMakeLists.txt): runs the compile and fails it when
# ptxas reports serialised wgmma (C7510 .. C7519, "Potential Performance Loss: wgmma.mma_async
# instructions are serialized"). CUDA 13.0's ptxas prints these as "info", not as warnings, so
# --warning-as-error does not catch them; a serialised mainloop ran the halves dA' 1.5x slower on
# Qwen3-235B (docs/wip, 2026-11-30) and passed every test. SMOE_ALLOW_WGMMA_SERIALIZATION=ON at
# configure time (-DSMOE_ALLOW_WGMMA_SERIALIZATION=ON) turns the guard off.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$@" 2>"$log"
rc=$?
cat "$log" >&2
if [ "$rc" -eq 0 ] && grep -qE "\(C751[0-9]\)" "$log"; then
  echo "error: ptxas serialised wgmma in this translation unit (see the C751x lines above); see scripts/ptxas_guard.sh" >&2
  exit 1
fi
exit "$rc"
