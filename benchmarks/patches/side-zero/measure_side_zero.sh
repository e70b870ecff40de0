#!/usr/bin/env bash
# GEMM1 zeroes the fused finalize's output (session 40; written without a device). One device call, ~8 min, on
# main's tree with .whl/A.so.xz (main's module) and .whl/Z.so.xz (main + 0001, tools/prebuild_module.sh on that
# tree). The patch changes Python and tests too, so Z runs with a patched copy of python/cake_ops (swapped in
# with its module) and its tests from the patched tree.
# ABAB graph replays of the fused path at T = 4096 / 16384 (Qwen3-235B, Qwen3-30B, the Kimi-K2 shard), a profile
# of each (GEMM2's prologue should drop to its argument writes), then Z's GPU tests of the ops it touches.
set -uo pipefail
source tools/device_env.sh >/dev/null
P=$PWD/benchmarks/patches/side-zero/0001-gemm1-zeroes-the-fused-finalize-output.patch
ZT=/tmp/side_zero_tree; rm -rf $ZT /tmp/pyA; mkdir -p $ZT /tmp/pyA
cp -r csrc python test benchmarks README.md $ZT/ && (cd $ZT && patch -p1 -s < "$P") || { echo "patch failed"; exit 1; }
cp python/cake_ops/*.py /tmp/pyA/
use() {
  rm -f python/cake_ops/_C*.so; xz -dc .whl/$1.so.xz > python/cake_ops/_C.abi3.so
  if [ "$1" = Z ]; then cp $ZT/python/cake_ops/*.py python/cake_ops/; else cp /tmp/pyA/*.py python/cake_ops/; fi
}
R=$OUT/side_zero; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $R/gpu.txt
for round in 1 2; do
  for m in A Z; do
    use $m
    echo "== round $round $m ($(el) s)" | tee -a $R/bench.txt
    run_by 330 40 python3 benchmarks/bench_fused_moe.py --models qwen3_235b,qwen3_30b,kimi_k2_ep8 --tokens 4096,16384 \
      --no-compiled >> $R/bench.txt 2>&1
  done
done
for m in A Z; do
  use $m
  echo "== profile $m ($(el) s)" | tee -a $R/profile.txt
  run_by 400 25 python3 benchmarks/profile_fused_moe.py --seed 0 --models qwen3_235b,kimi_k2_ep8 --tokens 4096,16384 \
    >> $R/profile.txt 2>&1
done
use Z
echo "== Z tests ($(el) s)" | tee -a $R/tests.txt
run_by 590 60 python3 -m pytest $ZT/test/test_moe_ops.py $ZT/test/test_fused_moe.py -q -x \
  -k 'also_zero or zeroed or gemm1 or gemm2 or decode or preallocated or graph or fullgraph' >> $R/tests.txt 2>&1
use A
echo "== end ($(el) s)"
