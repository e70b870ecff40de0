#!/usr/bin/env bash
# Build, test and benchmark cake_ops on a GPU machine without internet access.
#   WHEELS=.whl tools/gpu_test.sh [results-dir]
# Env: PYTEST_ARGS (split on spaces), PYTEST_K (a -k expression), BENCH_ARGS, SKIP_BENCH, MAX_JOBS.
# Wheels the machine lacks (nvidia-cutlass, expecttest) come from $WHEELS; torch, pytest, expecttest and
# matplotlib must already be installed. The build goes in place (python/cake_ops/_C*.so) so the
# working tree needs no install; the test log, benchmark JSON and plot go to the results dir.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
RESULTS=${1:-benchmarks/results}
SITE=${CAKE_SITE:-/tmp/cake_site}
mkdir -p "$RESULTS"

# Wheels the machine lacks: nvidia-cutlass (headers) and expecttest (tests).
if ! python3 -c "import cutlass_library, expecttest" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
# Build with the system compiler: a toolchain that links libstdc++ statically into the module
# (seen on the H200 image, whose CXX=/opt/gcc/bin/g++) gives it a second libstdc++ whose locale
# facets crash on the first formatted error message.
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"

# In-place build: the same CMake build that setup.py drives, into python/cake_ops.
time cmake --preset sm90 -DPython_EXECUTABLE="$(command -v python3)" >/dev/null
time cmake --build --preset sm90 --parallel "${MAX_JOBS:-$(nproc)}"

python3 -c "import cake_ops, torch; print(cake_ops.build_info(), torch.cuda.get_device_name())"
status=0
python3 -m pytest test -q -rs ${PYTEST_ARGS:-} ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$RESULTS/gpu_test.log" || status=$?
if [ -z "${SKIP_BENCH:-}" ]; then
  python3 benchmarks/bench_grouped_gemm.py ${BENCH_ARGS:-} --json "$RESULTS/grouped_gemm_h200.json" \
    --plot "$RESULTS/grouped_gemm_h200.png" 2>&1 | tee "$RESULTS/grouped_gemm_h200.txt"
fi
exit $status
