#!/usr/bin/env bash
# Session 45 measured it on an H100 (results/ab_tail_split_static_early_h100_s45.txt, traces in
# results/trace_tail_split_h100_s45.txt): +2 to +5 us at T=1, rejected (NOTES session 45 item 2).
# Session 44: the layer kernel's phase-1 tail split (0001; module B in .whl, main's module A) on the GPU:
# its tests (bitwise against the staged decode ops; the tail split itself in test_layer_kernel_splits_
# phase1_last_round), then ABAB at T=1: StepFun issue geometry / Step-3.5 (bf16, fp8) and fused_moe
# Qwen3-235B (plain launch, split), Mixtral (spreading launch, split) and Qwen3-30B (no split: the
# control); then the trace of both (TA / TB: A / B with 0002's stamps) at T=1. ~7 min. The tests need
# the patch's test file: run on a tree with 0001 applied (`git apply benchmarks/patches/layer-tail-split/
# 0001-*.patch`, or the tail-split branch). Modules A, B, TA, TB prebuilt in .whl (session 44).
set -uo pipefail
source tools/device_env.sh >/dev/null
R=$OUT/tail_split; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $R/gpu.txt; cat $R/gpu.txt
cake_use_module B
run_by 200 60 python3 -m pytest -q -p no:cacheprovider test/test_moe_ops.py test/test_stepfun_moe.py -k "layer" \
  > $R/test_B.log 2>&1
echo "tests done $(el) s"; tail -3 $R/test_B.log
for round in 1 2; do
  for m in A B; do
    cake_use_module $m; echo "== round $round $m ($(el) s)" | tee -a $R/stepfun.txt >> $R/fused.txt
    run_by 470 40 python3 benchmarks/bench_stepfun_moe.py --shapes issue_geometry,step35_flash --tokens 1 >> $R/stepfun.txt 2>&1
    run_by 500 30 python3 benchmarks/bench_fused_moe.py --models qwen3_235b,mixtral_8x7b,qwen3_30b --tokens 1 \
      --no-compiled >> $R/fused.txt 2>&1
  done
done
for m in TA TB; do
  cake_use_module $m; echo "== trace $m ($(el) s)" >> $R/trace.txt
  run_by 585 25 python3 benchmarks/patches/layer-tail-split/trace_tail_split.py >> $R/trace.txt 2>&1
done
cake_use_module A
cat $R/trace.txt
grep -v "^WARNING" $R/stepfun.txt | grep -v "^ *$"; grep -v "^WARNING" $R/fused.txt
