#!/usr/bin/env bash
# Build the sm90 module on this machine for the GPU machine, whose cold build takes ~250 s of a
# device call: against the torch the device has (2.11.0+cu130; the CPython 3.11 wheel will do, as
# the module uses the stable Python ABI), then xz it into .whl/ (carried; git-ignored) with the
# checksum of its sources. On the device `cake_use_prebuilt` (tools/device_env.sh) installs it when
# the sources match. 2 cores: ~31 min cold; a .cpp change ~20 s, a new configuration ~1 min.
#   pip download --no-deps torch==2.11.0 -d /tmp/t211dl
#   pip install --no-deps --target /tmp/t211 /tmp/t211dl/torch-2.11.0-*.whl
#   ln -s "$(python3 -c 'import site; print(site.getsitepackages()[0])')/nvidia" /tmp/t211/nvidia
#   tools/prebuild_module.sh
# Env: TORCH_SITE (default /tmp/t211), BUILD (default /tmp/build_t211), MAX_JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SITE=${TORCH_SITE:-/tmp/t211}
BUILD=${BUILD:-/tmp/build_t211}
export PYTHONPATH="$TORCH_SITE"
python3 -c "import torch; assert torch.__version__.startswith('2.11.0'), torch.__version__"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCAKE_WITH_CUDA=ON -DCAKE_CUDA_ARCHS=9.0a \
  -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$BUILD/module" -DPython_EXECUTABLE="$(command -v python3)" >/dev/null
source tools/device_env.sh >/dev/null  # cake_source_sum
sum_before=$(cake_source_sum)
cmake --build "$BUILD" --parallel "${MAX_JOBS:-2}"
sum_after=$(cake_source_sum)
[ "$sum_before" = "$sum_after" ] || { echo "sources changed during the build; run again" >&2; exit 1; }
mkdir -p .whl
xz -T0 -6 -c "$BUILD"/module/_C*.so > .whl/cake_C_sm90.abi3.so.xz
echo "$sum_after" > .whl/cake_C_sm90.source_md5
ls -la .whl/cake_C_sm90.abi3.so.xz
