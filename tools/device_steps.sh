#!/usr/bin/env bash
# The standing measurements of one device call, in the order given, on one clock (a call runs at most
# 600 s), each into $OUT with a header naming the card and the module:
#   bash tools/device_steps.sh STEP...
#   suite           the whole GPU test suite                      gpu_test_<card>.log
#   api             the GPU tests of grouped_mm, FusedMoE, the transformers blocks and experts
#                   implementation, and test_benchmarks            gpu_test_api_<card>.log
#   hf              bench_transformers_experts (cake vs transformers' grouped_mm)
#                                                                  transformers_experts_<card>.txt
#   hfprof          hf's training rows (fwd+bwd, T 1024 and 4096) with each implementation's kernels (--profile)
#                                                                  transformers_experts_profile_<card>.txt
#   gg              issue 3's table                                grouped_gemm_<card>.{txt,json,png}
#   fused:M1,M2     issue 4's table for those models               fused_moe_<card>_M1_M2.{txt,json}
#   gutest          the GPU tests of w1 as [gate; up] halves and of the epilogue twins   gpu_test_gu_<card>.log
#   gu              fused_moe_bf16 with w1 as [gate; up] halves against the interleaved w1, Qwen3-30B and
#                   Mixtral, T 256-16384 (bench_fused_moe --w1-layout both)   w1_layout_<card>.txt
#   stepfun         issue 5's table                                stepfun_moe_<card>.{txt,json,png}
#   layer           issue 5's T=1 layer cut: modules A (main), C, C3 of $WHEELS (see
#                   benchmarks/patches/layer-row-b/measure_layer_row_b.sh), graph replays
#                                                                  ab_layer_<card>.txt
# It lives in the repository, not in the git-ignored .whl/, because a session's checkout starts without .whl/.
# Env: SESSION (for the headers), END (s on the call's clock by which the last step must end; 585),
# H200_ONLY=1 (run only the steps whose result is a ratio of the same run, suite / api / hf / hfprof / gutest / gu, elsewhere).
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/device_env.sh >/dev/null
OUT=${OUT:?set OUT}
END=${END:-585}
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case $CARD in *H200*) TAG=h200 ;; *H100*) TAG=h100 ;; *) TAG=gpu ;; esac
export CAKE_EXPECT_CUDA_ARCHS=90a
cake_use_prebuilt || { echo "building the module ($(el) s)"; cake_build >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }; }
SUM=$(cake_source_sum)
header() { echo "# session ${SESSION:-?} (tools/device_steps.sh $1; $CARD; module of sources ${SUM:0:8}...): $2"; }
PYTEST="python3 -m pytest -q -rs -p no:cacheprovider"
quiet() { grep -v "DeprecationWarning\|warnings.warn\|^  "; }

for step in "$@"; do
  echo "== $step at $(el) s"
  if [ "${H200_ONLY:-}" = 1 ] && [ $TAG != h200 ] && [[ $step != suite && $step != api && $step != hf* && $step != gutest && $step != gu ]]; then
    echo "(not an H200: $step skipped)"; continue
  fi
  case $step in
    suite)
      { header suite "python3 -m pytest test"; run_by "$END" 240 $PYTEST test 2>&1 | quiet; } | tee "$OUT/gpu_test_$TAG.log" | tail -5 ;;
    api)
      { header api "the GPU tests of the Python-level APIs"
        run_by "$END" 40 $PYTEST test/test_grouped_gemm.py test/test_fused_moe.py test/test_benchmarks.py \
          -k "grouped_mm or fused_moe_module or transformers or sparse_moe or test_benchmarks or autocast" 2>&1 | quiet; } \
        | tee "$OUT/gpu_test_api_$TAG.log" | tail -5 ;;
    hf)
      cmd="python3 benchmarks/bench_transformers_experts.py --shapes qwen3_30b,mixtral_8x7b --tokens 1024,4096,16384"
      { header hf "$cmd"; run_by "$END" 60 $cmd; } 2>&1 | tee "$OUT/transformers_experts_$TAG.txt" ;;
    hfprof)
      cmd="python3 benchmarks/bench_transformers_experts.py --shapes qwen3_30b,mixtral_8x7b --tokens 1024,4096 --reps 5 --profile"
      { header hfprof "$cmd"; run_by "$END" 60 $cmd; } 2>&1 | tee "$OUT/transformers_experts_profile_$TAG.txt" ;;
    gg)
      cmd="python3 benchmarks/bench_grouped_gemm.py --json $OUT/grouped_gemm_$TAG.json --plot $OUT/grouped_gemm_$TAG.png"
      { header gg "${cmd//$OUT\//}"; run_by "$END" 150 $cmd; } 2>&1 | tee "$OUT/grouped_gemm_$TAG.txt" ;;
    fused:*)
      models=${step#fused:}; name=fused_moe_${TAG}_${models//,/_}
      cmd="python3 benchmarks/bench_fused_moe.py --models $models --json $OUT/$name.json"
      { header "$step" "${cmd//$OUT\//}"; run_by "$END" 120 $cmd; } 2>&1 | tee "$OUT/$name.txt" ;;
    gutest)
      { header gutest "the GPU tests of w1 as [gate; up] halves and of the epilogue twins"
        run_by "$END" 40 $PYTEST test/test_moe_ops.py test/test_fused_moe.py -k "gate_up or twin or swiglu" 2>&1 | quiet; } \
        | tee "$OUT/gpu_test_gu_$TAG.log" | tail -5 ;;
    gu)
      cmd="python3 benchmarks/bench_fused_moe.py --models qwen3_30b,mixtral_8x7b --tokens 256,1024,4096,16384 --no-compiled --w1-layout both"
      { header gu "$cmd"; run_by "$END" 60 $cmd; } 2>&1 | tee "$OUT/w1_layout_$TAG.txt" ;;
    stepfun)
      cmd="python3 benchmarks/bench_stepfun_moe.py --json $OUT/stepfun_moe_$TAG.json --plot $OUT/stepfun_moe_$TAG.png"
      { header stepfun "${cmd//$OUT\//}"; run_by "$END" 120 $cmd; } 2>&1 | tee "$OUT/stepfun_moe_$TAG.txt" ;;
    layer)
      for m in C C3; do [ -f "$WHEELS/$m.so.xz" ] || { echo "($WHEELS/$m.so.xz missing: layer skipped)"; continue 2; }; done
      cp "$WHEELS/cake_C_sm90.abi3.so.xz" "$WHEELS/A.so.xz"
      stepfun="python3 benchmarks/bench_stepfun_moe.py --shapes issue_geometry,step35_flash --tokens 1"
      fused="python3 benchmarks/bench_fused_moe.py --models qwen3_235b,mixtral_8x7b,qwen3_30b,kimi_k2_ep8 --tokens 1 --no-compiled"
      { header layer "modules A (main), C (+ patches/layer-row-b/0001), C3 (C, at most 4 CTAs an item), graph replays; $stepfun; $fused"
        for m in A C C3 A C C3; do
          cake_use_module $m; echo "== stepfun $m ($(el) s)"; run_by "$END" 25 $stepfun 2>&1 | grep -v "^WARNING"
        done
        for m in A C C3 A C C3; do
          cake_use_module $m; echo "== fused_moe $m ($(el) s)"; run_by "$END" 25 $fused 2>&1 | grep -v "^WARNING"
        done
        cake_use_module C3; echo "== C3 layer tests ($(el) s)"
        run_by "$END" 45 $PYTEST -x test/test_moe_ops.py test/test_stepfun_moe.py -k layer 2>&1 | tail -3
        cake_use_module A; } | tee "$OUT/ab_layer_$TAG.txt" ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "done at $(el) s"
