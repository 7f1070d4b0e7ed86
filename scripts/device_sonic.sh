#!/usr/bin/env bash
# SonicMoE next to this library and torch in one process (issue 8, bench/side_by_side.py), on the
# H200 in two device calls, carrying .whl (bench/sonicmoe_env.sh pack, here: 58 MB with the CUTLASS
# headers inside, so no other carry is needed):
#   SONIC_STAGE=warm  installs SonicMoE, builds our torch extension (pip install .) and runs SonicMoE
#                     alone on one config: its Triton autotune took over 400 s cold on 2026-11-30's
#                     first attempt, and its cache stays on the machine's disk;
#   SONIC_STAGE=run   (the next call, on the same machine while it is still warm: within ~30 s)
#                     bench/side_by_side.py on SONIC_CONFIGS (default every config) -> $OUT.
# Pass SMOE_COMMIT=<hash>. Each stage stops itself before the device tool's 600 s limit (SONIC_BUDGET).
# 2026-12-01 (bench/results/h200/side_by_side_e46ff74_logs/): the warm stage's one config did not
# finish its cold autotune in 570 s, yet the run stage that followed on the warm machine did the
# ten public configs in four calls of 2-3 configs each (76-352 s; SONIC_CONFIGS, OUT=$OUT/<part>);
# side_by_side.py rewrites its JSON after every config, and `side_by_side.py --merge` (no GPU) makes
# one results file of the parts.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT"
t0=$(date +%s)
left() { echo $(( ${SONIC_BUDGET:-570} - ($(date +%s) - t0) )); }
[ -d .whl ] || { echo "no .whl/: run bench/sonicmoe_env.sh pack here and carry .whl"; exit 2; }
eval "$(bash bench/sonicmoe_env.sh install)"
python3 -c "import sonicmoe" 2>"$OUT/sonic_import.log" || { echo "sonicmoe does not import"; tail -5 "$OUT/sonic_import.log"; exit 1; }
case "${SONIC_STAGE:-warm}" in
  warm)
    timeout 300 python3 -m pip install --no-build-isolation --no-deps -q . >"$OUT/sonic_pip.log" 2>&1
    echo "pip rc=$? after $(( $(date +%s) - t0 )) s"
    timeout "$(left)" python3 bench/side_by_side.py --systems sonicmoe --configs "${SONIC_WARM_CONFIG:-1.4B n256 E128 K8}" \
      --reps 1 --warmup 1 --out "$OUT/sonic_warm.json" --commit "${SMOE_COMMIT:-unknown}" >"$OUT/sonic_warm.log" 2>&1
    echo "warm-up rc=$? after $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/sonic_warm.log"
    ;;
  run)
    python3 -c "import smoe_torch" 2>/dev/null || timeout 300 python3 -m pip install --no-build-isolation --no-deps -q . >"$OUT/sonic_pip.log" 2>&1
    timeout "$(left)" python3 bench/side_by_side.py ${SONIC_CONFIGS:+--configs "$SONIC_CONFIGS"} \
      --out "$OUT/side_by_side.json" --plots "$OUT" --commit "${SMOE_COMMIT:-unknown}" >"$OUT/side_by_side.log" 2>&1
    echo "side_by_side rc=$? after $(( $(date +%s) - t0 )) s"; tail -15 "$OUT/side_by_side.log"
    ;;
  *) echo "SONIC_STAGE must be warm or run"; exit 2 ;;
esac
