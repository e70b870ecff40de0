#!/usr/bin/env bash
# Build, test and benchmark cake_ops on a GPU machine without internet access.
#   WHEELS=.whl tools/gpu_test.sh [results-dir]
# Env: PYTEST_ARGS (split on spaces), PYTEST_K (a -k expression), BENCH_ARGS, SKIP_BENCH, MAX_JOBS.
# Wheels the machine lacks (nvidia-cutlass, expecttest) come from $WHEELS; torch, pytest, expecttest and
# matplotlib must already be installed. The build goes in place (python/cake_ops/_C*.so) so the
# working tree needs no install; the test log, benchmark JSON and plot go to the results dir.
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-benchmarks/results}
mkdir -p "$RESULTS"
source tools/device_env.sh
time cake_build

python3 -c "import cake_ops, torch; print(cake_ops.build_info(), torch.cuda.get_device_name())"
status=0
python3 -m pytest test -q -rs ${PYTEST_ARGS:-} ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$RESULTS/gpu_test.log" || status=$?
if [ -z "${SKIP_BENCH:-}" ]; then
  python3 benchmarks/bench_grouped_gemm.py ${BENCH_ARGS:-} --json "$RESULTS/grouped_gemm_h200.json" \
    --plot "$RESULTS/grouped_gemm_h200.png" 2>&1 | tee "$RESULTS/grouped_gemm_h200.txt"
fi
exit $status
