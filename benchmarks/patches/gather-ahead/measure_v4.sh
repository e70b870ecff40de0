#!/usr/bin/env bash
# gather-ahead v4 (session 40; written without a device): the rows copied by the producer warp group's idle warp 1
# from the kernel wrapper, outside the tile scheduler's pipeline (v1 / v2 copied from CUTLASS's auxiliary load hook,
# a consumer of that pipeline, and ran GEMM1 ~250 us slower: the copy paced the tiles). Run from the repository root
# of main: it copies the tree to /tmp, applies v2-whole-patch-second-copy.patch and
# v4-copy-warp-outside-the-scheduler-on-top-of-v2.patch there, and takes the module prebuilt from that tree
# (.whl/GA4.so.xz with GA4.source_md5: tools/prebuild_module.sh on main + both patches, ~45 min on 2 cores; carry
# .whl), else builds it (~250 s). One call, ~8 min (tests, a profile per mode, ABAB graph replays): one module,
# CAKE_GEMM1_GATHER_AHEAD=0 (main's launches: the gather kernel, then the plain twin) against 1.
set -uo pipefail
P=$PWD/benchmarks/patches/gather-ahead
TREE=/tmp/gather_ahead_v4_tree; rm -rf $TREE; mkdir -p $TREE
cp -r csrc python test benchmarks tools CMakeLists.txt CMakePresets.json .whl $TREE/ && cd $TREE &&
  patch -p1 -s < $P/v2-whole-patch-second-copy.patch && patch -p1 -s < $P/v4-copy-warp-outside-the-scheduler-on-top-of-v2.patch ||
  { echo "patching the tree copy failed"; exit 1; }
if [ -f .whl/GA4.so.xz ]; then cp .whl/GA4.so.xz .whl/cake_C_sm90.abi3.so.xz; cp .whl/GA4.source_md5 .whl/cake_C_sm90.source_md5; fi
source tools/device_env.sh >/dev/null
cake_use_prebuilt || { echo "no prebuilt module for these sources: building (~250 s)"; cake_build; }
R=$OUT/ga_v4; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $R/gpu.txt
echo "== tests ($(el) s)" >> $R/tests.txt
run_by 200 60 python3 -m pytest test/test_moe_ops.py -q -x -k 'ahead or gather or gemm1' >> $R/tests.txt 2>&1
for mode in 0 1; do
  echo "== CAKE_GEMM1_GATHER_AHEAD=$mode ($(el) s)" >> $R/profile.txt
  run_by 300 25 env CAKE_GEMM1_GATHER_AHEAD=$mode python3 benchmarks/profile_fused_moe.py --seed 0 --no-pdl \
    --models qwen3_235b,kimi_k2_ep8 --tokens 4096,16384 >> $R/profile.txt 2>&1
done
for round in 1 2; do
  for mode in 0 1; do
    echo "== round $round CAKE_GEMM1_GATHER_AHEAD=$mode ($(el) s)" >> $R/bench.txt
    run_by 590 50 env CAKE_GEMM1_GATHER_AHEAD=$mode python3 benchmarks/bench_fused_moe.py \
      --models qwen3_235b,kimi_k2_ep8 --tokens 4096,16384 --no-compiled >> $R/bench.txt 2>&1
  done
done
echo "== end ($(el) s)" >> $R/bench.txt
