"""Where the time of one stepfun_moe forward goes, per family: per-kernel GPU times under CUDA-graph
replay (torch.profiler) in launch order, the replay time and the weight floor (bytes of the experts
touched, at the family's width, / the card's read bandwidth). A diagnostic next to bench_stepfun_moe.py.

    python benchmarks/profile_stepfun_moe.py --shapes issue_geometry --families bf16,fp8 --tokens 8,2048

--static-scales: fp8 with static activation scales (fc1_input_scale, fc2_input_scale) calibrated
on the profiled batch itself (amax / 448), as a deployment with calibrated scales runs it: no amax
on the device.
"""
import argparse
import warnings

import torch

import cake_ops
from bench_grouped_gemm import HBM_TBPS
from bench_stepfun_moe import AMPLITUDE, LIMIT, SHAPES, random_weights, static_scales
from cake_ops import stepfun_moe as sm
from profile_fused_moe import kernels_in_order, print_profile


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="issue_geometry")
    p.add_argument("--families", default="bf16,fp8")
    p.add_argument("--tokens", default="8,2048")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--static-scales", action="store_true", help="fp8: calibrated static activation scales")
    p.add_argument("--seed", type=int, default=None, help="the same weights and routing in every run (A/B runs)")
    args = p.parse_args()
    warnings.simplefilter("ignore", cake_ops.ExperimentalWarning)
    for name in args.shapes.split(","):
        if args.seed is not None:
            torch.manual_seed(args.seed)
        e, k, h, inter = SHAPES[name]
        w1, w2 = random_weights(e, h, inter, "cuda")
        for family in args.families.split(","):
            weights = sm.prepare_weights(w1, w2, LIMIT, family=family)
            for t in map(int, args.tokens.split(",")):
                x = (AMPLITUDE * torch.randn(t, h, device="cuda")).bfloat16()
                logits = torch.randn(t, e, device="cuda")
                view = static_scales(weights, x, logits, k) if args.static_scales and family == "fp8" else weights
                launch = sm.prepare_stepfun_moe(x, view, logits, top_k=k)
                kernels, us = kernels_in_order(launch.launch, args.iters)
                touched = torch.topk(logits, k, dim=-1).indices.unique().numel()
                floor_us = touched * 3 * h * inter * weights.w1.element_size() / (HBM_TBPS * 1e12) * 1e6
                tflops = 2 * t * k * 3 * h * inter / us / 1e6
                print_profile(f"{name} {family} T={t}", us, floor_us, tflops, kernels)


if __name__ == "__main__":
    main()
