#!/usr/bin/env bash
# Session 43: moe_sort pulls fused_moe_bf16's x into L2 while it runs (0001 here, module P: main + 0001 built with
# tools/prebuild_module.sh) against main (module A): gather_order.cu's write-ceiling cases first, then P's GPU tests,
# the per-kernel profile at T=4096 and ABAB bench_fused_moe (Qwen3-30B, Qwen3-235B, T = 1024 / 4096 / 16384).
# Modules in .whl (A.so.xz, P.so.xz). The call's copy of the tree gets 0001 (its tests and the hint in fused_moe.py);
# A's rounds run fused_moe.py without the hint (A's moe_sort has no l2_prefetch argument). ~6.5 min. Run on an H100
# in session 43 (results/sort_l2_prefetch_h100_s43.txt): rejected.
set -uo pipefail
source tools/device_env.sh >/dev/null
R=$OUT/prefetch; mkdir -p $R
grep -q l2_prefetch python/cake_ops/fused_moe.py || patch -p1 -s < benchmarks/patches/sort-l2-prefetch/0001-moe-sort-pulls-x-into-l2.patch
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $R/gpu.txt
cp python/cake_ops/fused_moe.py /tmp/fm_P.py
sed "s/, l2_prefetch=x)/)/" /tmp/fm_P.py > /tmp/fm_A.py
use() { cake_use_module "$1"; cp "/tmp/fm_$1.py" python/cake_ops/fused_moe.py; }
nvcc -O3 -arch=sm_90a -o /tmp/go benchmarks/gather_order.cu && run_by 70 5 /tmp/go > $R/gather_order.txt 2>&1
use P
run_by 130 20 python3 -m pytest -q -p no:cacheprovider test/test_moe_ops.py -k "sort or Errors or opcheck" > $R/tests.txt 2>&1
for m in A P; do
  use $m; echo "== $m ($(el) s)" >> $R/profile.txt
  run_by 190 20 python3 benchmarks/profile_fused_moe.py --seed 0 --models qwen3_30b,qwen3_235b --tokens 4096 >> $R/profile.txt 2>&1
done
for round in 1 2; do
  for m in A P; do
    use $m; echo "== round $round $m ($(el) s)" >> $R/bench.txt
    run_by 400 30 python3 benchmarks/bench_fused_moe.py --models qwen3_30b,qwen3_235b --tokens 1024,4096,16384 \
      --no-compiled >> $R/bench.txt 2>&1
  done
done
use A
cat $R/gpu.txt $R/gather_order.txt; tail -3 $R/tests.txt
grep -vE "UserWarning|_warn_once" $R/profile.txt | grep -E "==|T=|moe_|prepare|GEMM"; grep -v "^WARNING" $R/bench.txt
