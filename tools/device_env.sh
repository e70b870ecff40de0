# Sourced by the GPU-machine scripts (gpu_test.sh, device_ab.sh) from the repository root: the
# wheels the machine lacks, the compiler, PYTHONPATH, and cake_build (the in-place sm90 build).
# Env: WHEELS (default .whl), CAKE_SITE, MAX_JOBS.
WHEELS=${WHEELS:-.whl}
SITE=${CAKE_SITE:-/tmp/cake_site}
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
export PYTHONPATH="$PWD/python:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# In-place build: the same CMake build that setup.py drives, into python/cake_ops (incremental
# when build/sm90 is there).
# A warm machine keeps build/sm90 between calls, but each call copies the tree afresh with the
# files' old modification times: a source that was patched in the last call and is back to main's
# text now looks older than its object, and ninja would keep the patched object. So the sources
# whose contents differ from the last build's (a checksum manifest) are touched first.
cake_build() {
  local manifest=build/sm90/.source_md5
  if [ -f "$manifest" ]; then
    md5sum --quiet -c "$manifest" 2>/dev/null | sed -n 's/: FAILED$//p' | while read -r f; do
      [ -f "$f" ] && touch "$f"
    done
  fi
  cmake --preset sm90 -DPython_EXECUTABLE="$(command -v python3)" >/dev/null &&
    cmake --build --preset sm90 --parallel "${MAX_JOBS:-$(nproc)}" &&
    find csrc -type f -print0 | xargs -0 md5sum > "$manifest"
}

# Time guards for a call script (one device call runs at most 600 s): `el` is the seconds since
# this file was sourced; `run_by END NEED CMD...` runs CMD under a timeout that ends at END s, or,
# with fewer than NEED s left, skips it and says so (a step started without its time only wastes it).
# A wrapper that runs several call scripts in one call exports its own start, so they share one clock.
export CAKE_CALL_START=${CAKE_CALL_START:-$(date +%s)}
el() { echo $(( $(date +%s) - CAKE_CALL_START )); }
run_by() {
  local end=$1 need=$2
  shift 2
  local left=$(( end - $(el) ))
  if [ "$left" -lt "$need" ]; then echo "(skipped for time at $(el) s: $*)"; return 0; fi
  timeout "$left" "$@"
}

# The sources a module is built from, as one checksum (a prebuilt module is used only for the
# same sources).
cake_source_sum() {
  find csrc CMakeLists.txt CMakePresets.json tools/build_paths.py -type f | LC_ALL=C sort | xargs md5sum | md5sum | cut -c1-32
}

# A/B calls: install the named module of $WHEELS (NAME.so.xz, from tools/prebuild_module.sh on some tree)
# as this tree's, whatever sources it was built from (the caller knows what it compares).
cake_use_module() {
  # A warm machine may keep an earlier call's build: CPython would import its cpython-312 module first.
  rm -f python/cake_ops/_C*.so
  xz -dc "$WHEELS/$1.so.xz" > python/cake_ops/_C.abi3.so
}

# A module built on another machine against the device's torch (2.11.0+cu130; the module uses the
# stable Python ABI, so a build under CPython 3.11 imports under 3.12), xz-compressed in the wheels
# folder by tools/prebuild_module.sh: it saves a call its cold build (~250 s). Installed only for
# the same sources and if it imports; otherwise returns 1 and the caller builds (cake_build).
cake_use_prebuilt() {
  local packed="$WHEELS/cake_C_sm90.abi3.so.xz"
  [ -f "$packed" ] || return 1
  if [ "$(cat "$WHEELS/cake_C_sm90.source_md5" 2>/dev/null)" != "$(cake_source_sum)" ]; then
    echo "prebuilt module: built from other sources, not used"
    return 1
  fi
  cake_use_module cake_C_sm90.abi3 || return 1  # = $packed
  if python3 -c "import torch, cake_ops; assert cake_ops._C.CUDA_ARCHS == '90a'; torch.ops.cake.moe_sort" 2>&1; then
    echo "prebuilt module in use"
  else
    rm -f python/cake_ops/_C.abi3.so
    return 1
  fi
}
