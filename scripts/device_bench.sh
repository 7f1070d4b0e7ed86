#!/usr/bin/env bash
# Run on the GPU machine after scripts/device_check.sh built build-device/ (or pass BUILD=...):
# our layer benchmark and the torch baseline in the same call, merged into the results format of
# ../shared/bench/README.md, then the same for the shapes outside configs.json
# (bench/sweep_configs.json; skipped when CONFIGs are named). Usage:
#   scripts/device_bench.sh COMMIT [CONFIG,CONFIG...]
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/out}"
BUILD="${BUILD:-build-device}"
COMMIT="${1:-unknown}"
ONLY="${2:-}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DRIVER="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
args=(--out "$OUT/ours.json" --commit "$COMMIT" --warmup 3 --reps 15 --driver "$DRIVER")
[ -n "$ONLY" ] && args+=(--only "$ONLY")
"$BUILD/bench_layer" "${args[@]}" 2>&1 | tee "$OUT/bench_ours.log"
targs=(--out "$OUT/torch.json" --counts histc --warmup 3 --reps 15)
[ -n "$ONLY" ] && targs+=(--configs "$ONLY")
python3 bench/torch_baseline.py "${targs[@]}" 2>&1 | grep -v "it/s\]" | tee "$OUT/bench_torch.log" | tail -20
python3 bench/merge_results.py --ours "$OUT/ours.json" --torch "$OUT/torch.json" --out "$OUT/layer.json" --md "$OUT/layer.md"
if [ -z "$ONLY" ]; then
  "$BUILD/bench_layer" --configs bench/sweep_configs.json --out "$OUT/sweep_ours.json" --commit "$COMMIT" \
    --warmup 3 --reps 15 --driver "$DRIVER" 2>&1 | tee "$OUT/bench_sweep_ours.log" | tail -12
  python3 bench/torch_baseline.py --configs-file bench/sweep_configs.json --out "$OUT/sweep_torch.json" \
    --counts histc --warmup 3 --reps 15 2>&1 | grep -v "it/s\]" | tail -12
  python3 bench/merge_results.py --ours "$OUT/sweep_ours.json" --torch "$OUT/sweep_torch.json" \
    --out "$OUT/sweep.json" --md "$OUT/sweep.md"
fi
# The device tool brings back at most 8 files from $OUT: one archive carries every result and log.
tar czf "$OUT/device_bench.tgz" -C "$OUT" $(cd "$OUT" && ls *.json *.md *.log 2>/dev/null) 2>/dev/null || true
