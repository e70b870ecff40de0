#!/usr/bin/env bash
# Session 49's lead (NOTES.md s49 item 8): large-group fwd / dgrad on the 2x1 tile along N where a group's row
# slab overflows L2. One device call, any Hopper card (say which in the results):
#   bash benchmarks/patches/large-groups-2x1-along-n/measure_large_groups.sh   (carry [".whl"])
# Modules in .whl (git-ignored): cake_C_sm90.abi3.so.xz = main, S.so.xz = main + 0001 (rebuild: git apply 0001,
# tools/prebuild_module.sh, mv .whl/cake_C_sm90.abi3.so.xz .whl/S.so.xz, git checkout csrc, prebuild main again).
# 1) every tile order on the shapes not yet swept (main's module); 2) ABAB main / S on the large-group shapes and
# the Mixtral T=16384 MoE forward (its plain GEMM2 changes under S).
source tools/device_env.sh >/dev/null 2>&1
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "card: $CARD"
cp .whl/cake_C_sm90.abi3.so.xz .whl/MAIN.so.xz
cake_use_module MAIN
run_by 200 60 python3 benchmarks/bench_grouped_gemm.py --shapes down_e4_m112576_balanced,down_e8_m131072,down_e16_m131072,mixtral_fc2,mixtral_fc1 --ops fwd,dgrad --sweep-all --reps 6 --json $OUT/sweep_all_large.json 2>&1 | grep -v "^WARNING\|_warn_once" | tee $OUT/sweep_all_large.txt
SHAPES=gate_up_e4_m112576_balanced,gate_up_e4_m136064_skewed,gate_up_e8_m131072,gate_up_e16_m131072,gate_up_e32_m131072,down_e4_m112576_balanced,down_e8_m131072,down_e16_m131072,mixtral_fc1,mixtral_fc2
{ for round in 1 2; do for m in MAIN S; do
    cake_use_module $m; echo "== $m round $round ($(el) s)"
    run_by 585 40 python3 benchmarks/bench_grouped_gemm.py --shapes $SHAPES --ops fwd,dgrad --reps 8 2>&1 | grep -v "^WARNING\|_warn_once"
    run_by 585 20 python3 benchmarks/bench_fused_moe.py --models mixtral_8x7b --tokens 16384 --no-compiled 2>&1 | grep -v "^WARNING\|_warn_once"
  done; done; } | tee $OUT/ab_large_groups.txt
echo "done at $(el) s"
