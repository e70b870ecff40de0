#!/usr/bin/env bash
# Same-call A/B on a GPU machine. Between device calls the same kernels move 5-15% at large T (the
# dense torch.mm rate too), more than most changes, so a change is measured against its base in
# one call:
#   tools/device_ab.sh OUT "COMMAND" PATCH [PATCH ...]
# builds the tree as it is and runs COMMAND; applies each patch in turn (cumulatively), rebuilds
# incrementally and runs COMMAND; then reverts them all, rebuilds and runs COMMAND once more (an
# order check). COMMAND's output goes to OUT/ab.txt under "== <stage>" lines, the builds to
# OUT/build_<n>.log.   Example:
#   tools/device_ab.sh $OUT "python3 benchmarks/bench_fused_moe.py --tokens 1024,4096 --no-compiled" \
#     benchmarks/patches/swiglu-epilogue-cost/*.patch
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$1
CMD=$2
shift 2
mkdir -p "$OUT"
source tools/device_env.sh
stage=0
measure() {
  stage=$((stage + 1))
  { time cake_build; } >"$OUT/build_$stage.log" 2>&1 || { tail -40 "$OUT/build_$stage.log"; exit 1; }
  echo "== $1" | tee -a "$OUT/ab.txt"
  bash -c "$CMD" 2>&1 | tee -a "$OUT/ab.txt"
}
measure "base (as checked out)"
for patch in "$@"; do
  git apply "$patch"
  measure "+ $(basename "$patch")"
done
for ((i = $#; i >= 1; i--)); do git apply -R "${!i}"; done
measure "base again (order check)"
