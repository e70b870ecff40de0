#!/usr/bin/env bash
# The decode-path patches of session 39 on the H200 (written then; no device was lent). One device call, ~8 min;
# carry .whl with the modules below (S optional), each from tools/prebuild_module.sh on its tree (copy .whl/cake_C_sm90.abi3.so.xz
# after each build; after main's cold build each patch rebuilds 2-3 objects, ~1 min):
#   A  main                                  C  main + stage-first/0001 (B staged before the step loop)
#   R  main + layer-route-ready/0001         D  main + stage-first/0001 + layer-route-ready/0002 (both)
#   S  main + code-size/0001 (C's code-size part alone: no quantizing code in the 16-bit decode kernels, the
#      layer kernel's quantize out of line; optional: left out of the rotation when .whl/S.so.xz is missing)
# Rotation A S C R D twice: StepFun T=1 (bf16: C and R move it; fp8 with dynamic scales: C only; fp8 with static
# scales: C and R) and fused_moe T=1 (the layer kernel), T=16 / 64 (the decode GEMM kernel: C only); then the layer /
# decode tests on D and on R; ab_moe_layer on D and A.
set -uo pipefail
source tools/device_env.sh >/dev/null
R=$OUT/layer_patches; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $R/gpu.txt
for round in 1 2; do
  for m in A S C R D; do
    [ -f .whl/$m.so.xz ] || continue
    cake_use_module $m
    echo "== round $round $m ($(el) s)" | tee -a $R/profile.txt
    run_by 380 15 python3 benchmarks/profile_stepfun_moe.py --seed 0 --shapes issue_geometry,step35_flash --tokens 1,8 >> $R/profile.txt 2>&1
    run_by 380 10 python3 benchmarks/profile_stepfun_moe.py --seed 0 --shapes issue_geometry,step35_flash --families fp8 --tokens 1 --static-scales >> $R/profile.txt 2>&1
    run_by 380 15 python3 benchmarks/profile_fused_moe.py --seed 0 --models qwen3_30b,qwen3_235b,mixtral_8x7b,kimi_k2_ep8 --tokens 1,16,64 >> $R/profile.txt 2>&1
  done
done
# The tests from a copy of the tree with both patches applied: route-ready's GPU test
# (test_layer_kernel_with_more_gemm1_items_than_ctas) is in the patch.
DT=/tmp/layer_patches_tree; rm -rf $DT; mkdir -p $DT; cp -r csrc test $DT/
(cd $DT && patch -p1 -s < "$OLDPWD/benchmarks/patches/stage-first/0001-first-b-chunk-staged-before-the-step-loop.patch" &&
  patch -p1 -s < "$OLDPWD/benchmarks/patches/layer-route-ready/0002-on-top-of-stage-first.patch") || echo "patching the test copy failed"
for m in D R; do
  cake_use_module $m
  echo "== $m layer/decode tests ($(el) s)" | tee -a $R/tests.txt
  run_by 490 45 python3 -m pytest $DT/test/test_moe_ops.py $DT/test/test_stepfun_moe.py $DT/test/test_fused_moe.py -q -x \
    -k 'layer or decode or one_token' >> $R/tests.txt 2>&1
done
for m in D A; do
  cake_use_module $m
  echo "== ab_moe_layer $m ($(el) s)" | tee -a $R/ab_layer.txt
  run_by 585 40 python3 benchmarks/ab_moe_layer.py --tokens 1,2 --stepfun-tokens 1 >> $R/ab_layer.txt 2>&1
done
echo "== end ($(el) s)"
