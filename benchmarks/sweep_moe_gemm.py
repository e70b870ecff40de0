"""Every tactic of the MoE GEMMs' family on the StepFun shapes: GEMM1 (gather, grouped GEMM, SwiGLUStep)
and GEMM2, CUDA-graph replays timed in rotation, next to the automatic choice (tactic -1) and the
decode kernel (tactic -2). For choosing a family's heuristic from measurements.

    python benchmarks/sweep_moe_gemm.py --shapes issue_geometry --families fp8 --tokens 8,2048,8192
"""
import argparse
import warnings

import torch

import cake_ops
from bench_grouped_gemm import Timer
from bench_stepfun_moe import AMPLITUDE, LIMIT, SHAPES, random_weights
from cake_ops import stepfun_moe as sm

TACTIC_FAMILY = {"bf16": "fwd", "fp8": "fwd_e4m3"}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="issue_geometry")
    p.add_argument("--families", default="fp8")
    p.add_argument("--tokens", default="8,2048,8192")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    warnings.simplefilter("ignore", cake_ops.ExperimentalWarning)
    timer = Timer("cuda", args.reps, 2)
    for name in args.shapes.split(","):
        e, k, h, inter = SHAPES[name]
        w1, w2 = random_weights(e, h, inter, "cuda")
        for family in args.families.split(","):
            weights = sm.prepare_weights(w1, w2, LIMIT, family=family)
            tactics = cake_ops._C.grouped_gemm_tactics(TACTIC_FAMILY[family])
            for t in map(int, args.tokens.split(",")):
                x = (AMPLITUDE * torch.randn(t, h, device="cuda")).bfloat16()
                routed = sm.routing(torch.randn(t, e, device="cuda"), top_k=k, num_experts=e)
                x_q, x_scale = (torch.ops.cake.quantize_fp8(x) if family == "fp8" else (x, None))
                act = sm.fc1(x, weights, routed)
                a_q, a_scale = (torch.ops.cake.quantize_fp8(act) if family == "fp8" else (act, None))

                def gemm1(tactic):
                    return lambda: torch.ops.cake.moe_gemm1_swiglu(
                        x_q, weights.w1, routed.permuted_idx_to_expanded_idx, routed.expert_offsets, k, True,
                        weights.gemm1_clamp_limit, tactic, x_scale, weights.w1_scale)

                def gemm2(tactic):
                    return lambda: torch.ops.cake.moe_gemm2(a_q, weights.w2, routed.expert_offsets, True, tactic,
                                                            a_scale, weights.w2_scale)
                for label, make, flops in (("gemm1", gemm1, 2 * t * k * 2 * inter * h),
                                           ("gemm2", gemm2, 2 * t * k * h * inter)):
                    fns = {"heuristic": (make(-1), None), "decode kernel": (make(-2), None)}
                    fns.update({tactic: (make(i), None) for i, tactic in enumerate(tactics)})
                    times = timer.many(fns, graph=True)
                    ranked = sorted((v, n) for n, v in times.items() if not isinstance(v, str))
                    print(f"{name} {family} T={t} {label}: heuristic {times['heuristic'] * 1e3:8.1f} us; best:")
                    for ms, tactic in ranked[:5]:
                        print(f"    {ms * 1e3:8.1f} us {flops / ms / 1e9:7.1f} TFLOP/s  {tactic}")


if __name__ == "__main__":
    main()
