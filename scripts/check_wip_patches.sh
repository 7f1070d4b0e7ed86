#!/usr/bin/env bash
# Every docs/wip/*.patch must apply, in name order, on the current tree: a change to main that
# touches a patched file breaks the patch silently otherwise, and the next device session loses a
# call to it. Applies them to a temporary index only (the working tree is never touched).
# Exit 77 (CTest: skipped) outside a git checkout or without patches.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
git rev-parse --git-dir >/dev/null 2>&1 || { echo "not a git checkout: skipped"; exit 77; }
shopt -s nullglob
patches=(docs/wip/*.patch)
[ ${#patches[@]} -gt 0 ] || { echo "no patches in docs/wip: skipped"; exit 77; }
idx="$(mktemp)"
trap 'rm -f "$idx"' EXIT
export GIT_INDEX_FILE="$idx"
# The index of the working tree's tracked files as they are now (committed or not).
git read-tree HEAD
git add -u . 2>/dev/null || true
for p in "${patches[@]}"; do
  if ! git apply --cached "$p"; then
    echo "FAILED: $p does not apply after the patches before it (regenerate it from its branch)"
    exit 1
  fi
  echo "applies: $p"
done
