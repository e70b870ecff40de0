#!/usr/bin/env bash
# Session 45 measured it on an H100 (results/ab_decode_two_tiles_h100_s45.txt): 1-3% slower, the one-tile control
# too; rejected (NOTES session 45 item 4).
# Session 44: the decode GEMM kernel with two weight tiles a CTA and its ring carried across passes (0001; module C
# in .whl, main's module A): its tests (test_decode_kernel_two_tiles_a_cta: bitwise the one-tile grid; the decode and
# layer tests), then ABAB where the decode kernel runs: fused_moe Qwen3-30B / Qwen3-235B / Kimi shard (one tile a CTA:
# the control) at T=16, 64 and StepFun at T=8, 64. ~6 min. Run on a tree with 0001 applied (its test file):
# `git apply benchmarks/patches/decode-two-tiles/0001-*.patch`.
set -uo pipefail
source tools/device_env.sh >/dev/null
R=$OUT/two_tiles; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $R/gpu.txt; cat $R/gpu.txt
cake_use_module C
run_by 170 60 python3 -m pytest -q -p no:cacheprovider test/test_moe_ops.py -k "decode or layer" > $R/test_C.log 2>&1
echo "tests done $(el) s"; tail -3 $R/test_C.log
for round in 1 2; do
  for m in A C; do
    cake_use_module $m; echo "== round $round $m ($(el) s)" | tee -a $R/stepfun.txt >> $R/fused.txt
    run_by 560 40 python3 benchmarks/bench_fused_moe.py --models qwen3_30b,qwen3_235b,kimi_k2_ep8 --tokens 16,64 \
      --no-compiled >> $R/fused.txt 2>&1
    run_by 580 30 python3 benchmarks/bench_stepfun_moe.py --shapes issue_geometry,step35_flash --tokens 8,64 \
      >> $R/stepfun.txt 2>&1
  done
done
cake_use_module A
grep -v "^WARNING" $R/fused.txt; grep -v "^WARNING" $R/stepfun.txt | grep -v "^ *$"
