#!/usr/bin/env bash
# Where GEMM2's fused finalize loses its ~50-100 us (session 41; plain GEMM2 752 us, fused 850 us at Qwen3-235B
# T=4096 on an H100). Modules: .whl/A.so.xz (main) and .whl/SD.so.xz (main + 0001 here, built with
# tools/prebuild_module.sh): every register epilogue takes all its row states before its first store (the
# scatter's route and scale loads, one round trip pair for all rows instead of one per row half), and
# CAKE_SCATTER_MODE picks what the scatter does with its rows: 0 the reds (correct), 1 plain 16-byte stores
# (wrong sums: measure only), 2 nothing. One short call (~2 min): sweeps of the fused finalize per mode against
# main's (and main's plain GEMM2), then the finalize tests on SD in mode 0.
set -uo pipefail
source tools/device_env.sh >/dev/null
R=$OUT/scatter_diag; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $R/gpu.txt
SWEEP=(python3 benchmarks/sweep_moe_gemm.py --shapes "" --top 2)
cake_use_module A;  echo "== A ($(el) s)" >> $R/sweep.txt
run_by 120 10 "${SWEEP[@]}" --models qwen3_235b --tokens 4096 --gemms "gemm2,gemm2 fused finalize" >> $R/sweep.txt 2>&1
cake_use_module SD
for mode in 0 1 2; do
  echo "== SD mode $mode ($(el) s)" >> $R/sweep.txt
  run_by 120 10 env CAKE_SCATTER_MODE=$mode "${SWEEP[@]}" --models qwen3_235b --tokens 4096 --gemms "gemm2 fused finalize" >> $R/sweep.txt 2>&1
done
echo "== SD mode 0, Kimi T=16384 ($(el) s)" >> $R/sweep.txt
run_by 150 20 "${SWEEP[@]}" --models kimi_k2_ep8 --tokens 16384 --gemms "gemm2 fused finalize" >> $R/sweep.txt 2>&1
cake_use_module A; echo "== A, Kimi T=16384 ($(el) s)" >> $R/sweep.txt
run_by 180 20 "${SWEEP[@]}" --models kimi_k2_ep8 --tokens 16384 --gemms "gemm2 fused finalize" >> $R/sweep.txt 2>&1
cake_use_module SD; echo "== SD tests ($(el) s)" >> $R/tests.txt
run_by 205 30 python3 -m pytest test/test_moe_ops.py test/test_fused_moe.py -q -x -k 'finalize or scatter or gemm2' >> $R/tests.txt 2>&1
cake_use_module A
echo "== end ($(el) s)" >> $R/sweep.txt
