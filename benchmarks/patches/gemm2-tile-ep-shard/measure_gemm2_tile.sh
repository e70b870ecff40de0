#!/usr/bin/env bash
# Session 41 (H200): the Kimi-K2 shard's GEMM2 with the fused finalize at T=16384 (341 rows per expert) runs
# 1066-1088 us on the heuristic's tile (fixed 64x256 pingpong: the small-groups rule under the scatter twin,
# kScatterSmallGroupMaxRows) and 878 us on the 128x256 cooperative tile in a 1x2 cluster (sweep_moe_gemm), yet
# profile_fused_moe showed GEMM2 at 912 us in the pipeline. This call settles which tile the pipeline runs
# (the profile now names each GEMM's configuration), where the rule goes wrong (rows per expert 171 / 341 / 683:
# T = 4096 is the short-groups tile), and what the cooperative tile gains end to end. One call, ~7 min,
# main's module (.whl/A.so.xz or a build); with .whl/G2.so.xz (main + 0001 here: the rule, built with
# tools/prebuild_module.sh) also ABAB bench_fused_moe A / G2 and G2's heuristic test.
set -uo pipefail
source tools/device_env.sh >/dev/null
if [ -f .whl/A.so.xz ]; then cake_use_module A; else cake_build; fi
R=$OUT/gemm2_tile; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $R/gpu.txt
run_by 90 20 python3 benchmarks/profile_fused_moe.py --seed 0 --models kimi_k2_ep8,qwen3_235b --tokens 8192,16384 \
  >> $R/profile.txt 2>&1
run_by 170 20 python3 benchmarks/sweep_moe_gemm.py --shapes "" --top 6 --models kimi_k2_ep8,qwen3_30b \
  --tokens 8192,16384 --gemms "gemm2 fused finalize" >> $R/sweep.txt 2>&1
for round in 1 2; do
  echo "== round $round" >> $R/ab.txt
  run_by 330 40 python3 benchmarks/ab_fused_moe_overrides.py --models kimi_k2_ep8,qwen3_235b --tokens 8192,16384 \
    --overrides gemm2_tile_n=256,gemm2_cluster_shape_mn=1x2 >> $R/ab.txt 2>&1
done
if [ -f .whl/G2.so.xz ]; then
  for round in 1 2; do
    for m in A G2; do
      cake_use_module $m; echo "== round $round $m ($(el) s)" >> $R/bench.txt
      run_by 540 50 python3 benchmarks/bench_fused_moe.py --models kimi_k2_ep8,qwen3_235b,qwen3_30b --tokens 4096,8192,16384 \
        --no-compiled >> $R/bench.txt 2>&1
    done
  done
  DT=/tmp/g2_tests; rm -rf $DT; mkdir -p $DT; cp -r csrc test $DT/
  (cd $DT && patch -p1 -s < "$OLDPWD/benchmarks/patches/gemm2-tile-ep-shard/0001-scatter-twin-on-few-routes-shards-takes-the-cooperative-tile.patch") || echo "patching the test copy failed" >> $R/tests.txt
  cake_use_module G2; run_by 590 20 python3 -m pytest -q $DT/test/test_grouped_gemm.py -k "heuristic" >> $R/tests.txt 2>&1
  cake_use_module A
fi
grep -vE "UserWarning|_warn_once" $R/profile.txt | grep -E "T=|GEMM"; cat $R/sweep.txt $R/ab.txt $R/bench.txt $R/tests.txt 2>/dev/null | grep -v "^WARNING"
