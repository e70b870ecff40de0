#!/usr/bin/env bash
# Session 47: the layer kernel at 3 CTAs an SM (0001: B as one dense row, a 9-wide tile; module C) and C with
# the spreading rule of a 2-CTAs-an-SM grid (0001 + 0002; module C2) against main (A), graph replays at T=1.
# Measured on an H100 only (results/ab_layer_row_b*_h100_s47.txt): level to +3 us; the H200, where session 36's
# trace had the phase-1 tail CTA-bound, decides. C's layer tests passed (results/test_layer_row_b_h100_s47.txt).
# Modules, built here against torch 2.11 (tools/prebuild_module.sh's header), in .whl as A/B/C/C2.so.xz:
#   git apply benchmarks/patches/layer-row-b/0001*.patch && BUILD=/tmp/build_t211 tools/prebuild_module.sh
#   cp .whl/cake_C_sm90.abi3.so.xz .whl/C.so.xz   (then 0002 on top for C2; revert both, rebuild main)
# C3 (session 48) = 0001 with spread_share's CTAs an item capped at 4 (Kimi's phase 1 as main, Mixtral's phase 2 as C):
#   in spread_share, `const int share = grid / items < 4 ? grid / items : 4; return slices < share ? slices : share;`
# B = main + patches/layer-tail-split/0001 (session 44). ~5 min on an H200.
source tools/device_env.sh >/dev/null 2>&1
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader)
[[ $CARD == *H200* ]] || { echo "not an H200 ($CARD): nothing run (the H100 rows are in results/*_h100_s47.txt)"; exit 0; }
FUSED="python3 benchmarks/bench_fused_moe.py --models qwen3_235b,mixtral_8x7b,qwen3_30b,kimi_k2_ep8 --tokens 1 --no-compiled"
STEP="python3 benchmarks/bench_stepfun_moe.py --shapes issue_geometry,step35_flash --tokens 1"
{ echo "# patches/layer-row-b/measure_layer_row_b.sh ($CARD): modules A (main), B (+ layer-tail-split 0001), C (+ layer-row-b 0001), C2 (C + 0002), C3 (C, share <= 4), graph replays"
  echo "# $STEP; $FUSED"
  for round in 1 2; do for m in A B C C2 C3; do
    cake_use_module $m; echo "== stepfun round $round $m ($(el) s)"
    run_by 230 20 $STEP 2>&1 | grep -v "^WARNING"
  done; done
  for m in A C C3 C2 A C C3; do
    cake_use_module $m; echo "== fused_moe $m ($(el) s)"
    run_by 420 25 $FUSED 2>&1 | grep -v "^WARNING"
  done; } 2>&1 | tee $OUT/ab_layer.txt
# C3's layer tests last (C's passed on an H100 in session 47; C3 only moves the spreading, whose sums keep their order)
cake_use_module C3; echo "== C3 layer tests ($(el) s)" | tee -a $OUT/ab_layer.txt
run_by 530 45 python3 -m pytest -q -x -p no:cacheprovider test/test_moe_ops.py test/test_stepfun_moe.py -k layer 2>&1 | tail -4 | tee -a $OUT/ab_layer.txt
echo "done at $(el) s"
